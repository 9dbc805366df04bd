"""Load a quantized directory (ours, or any the checker accepts) as the engine runs it: the float parts
(embeddings, norms, router, ``kv_b_proj``, the MTP layer when FLOAT) in the compute dtype, every W8A8 and
W8A8_DYNAMIC linear as an :class:`pipeline.engine.qlinear.Int8Linear` that computes with the stored
integers, and each FA3 layer's ``fa_k`` scale for the int8 latent cache.

The quantized linears are never materialized in float: the model is built with those weights on the meta
device and the modules are then replaced. ``epilogue`` picks the int8 linears' epilogue (``exact``, the
reference mode, or ``fast``); with ``fuse_moe`` every MoE whose experts are all W8A8_DYNAMIC runs as
:class:`pipeline.engine.moe.Int8MoE` (one activation quantization per layer, gate and up stacked: the same
output in the reference mode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.model import DeepseekV3ForCausalLM, build_model
from pipeline.engine.moe import fuse_moe_layers
from pipeline.engine.qlinear import EXACT, build_from_checkpoint, by_linear
from pipeline.format.description import FLOAT, QUANT_KINDS
from pipeline.format.reader import fa_scales, read_quantized


@dataclass
class LoadedModel:
    model: DeepseekV3ForCausalLM
    config: DeepseekV3Config
    types: dict[str, str]
    fa_k: dict[int, float]          # layer id -> the latent's int8 scale (FA3 layers only)
    path: str

    @property
    def quantized_linears(self) -> int:
        return sum(1 for n, t in self.types.items() if n.endswith(".weight") and t in QUANT_KINDS)


def load_quantized(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   with_mtp: bool = True, epilogue: str = EXACT, fuse_moe: bool = True) -> LoadedModel:
    """Validate ``path`` with the checker (refusing what it rejects, with its report) and build the model."""
    cfg, types, tensors = read_quantized(path)
    quant = {n[: -len(".weight")] for n, t in types.items() if n.endswith(".weight") and t in QUANT_KINDS}
    floats = {n: tensors[n] for n in layout.checkpoint_shapes(cfg)
              if n in tensors and types.get(n, FLOAT) == FLOAT and n[: -len(".weight")] not in quant}
    if not with_mtp:
        floats = {n: t for n, t in floats.items() if layout.layer_of(n) not in cfg.mtp_layer_ids}
    model = build_model(cfg, floats, dtype=dtype, device=device, with_mtp=with_mtp and bool(cfg.mtp_layer_ids),
                        strict=False)
    index = by_linear(tensors)
    for prefix in sorted(quant):
        if not with_mtp and layout.layer_of(prefix + ".weight") in cfg.mtp_layer_ids:
            continue
        parent_name, child = prefix.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child, None), nn.Linear):
            raise ValueError(f"{path}: {prefix} is typed {types[prefix + '.weight']} but the model has no linear there")
        params = {f"{prefix}.{leaf}": v.to(device) for leaf, v in index.get(prefix, {}).items()}
        setattr(parent, child, build_from_checkpoint(prefix, params, types, epilogue=epilogue))
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{path}: tensors missing for {missing[:5]}")
    if fuse_moe:
        fuse_moe_layers(model)
    fa_k = {i: float(s.float().reshape(())) for i, s in fa_scales(tensors).items()}
    return LoadedModel(model.eval(), cfg, dict(types), fa_k, path)
