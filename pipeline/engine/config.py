"""How an engine is built: :class:`EngineConfig` (the cache, the batch limits, the modes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 16
    max_batched_tokens: int = 256
    max_model_len: Optional[int] = None     # default: what the cache holds, capped by the model's positions
    nz: bool = False
    device: str = "cpu"
    cache_dtype: Optional[str] = None       # k_pe / non-FA3 latent storage; default the model's dtype
    mtp: bool = False                       # speculative decoding with the MTP layer (one draft token)
    fa3: bool = True                        # int8 latent cache on FA3 layers (False: the latent in bf16)
    compile: bool = False                   # torch.compile the layers' work around attention (layers.regions)
    prefix_caching: bool = True             # reuse cached full blocks across requests (cache.prefix_cache)
    decode_graph: bool = True               # replay pure decode steps (worker.decode_graph; False: eager)
