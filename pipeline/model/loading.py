"""Load the float model from a checkpoint directory (any fsspec URL), one layer at a time."""

from __future__ import annotations

import torch

from pipeline.io.checkpoint import CheckpointReader
from pipeline.model import DeepseekV3ForCausalLM, build_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    """'auto' (None) is float32 on CPU, where bf16 arithmetic is slow, and bfloat16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def load_model(path: str, dtype: str | torch.dtype | None = None, device: str | None = None,
               with_mtp: bool = True) -> DeepseekV3ForCausalLM:
    """Read the checkpoint (FP8 sources dequantized per layer) and build the model on ``device``."""
    device = device or default_device()
    dt = resolve_dtype(dtype, device)
    reader = CheckpointReader(path)
    cfg = reader.config
    tensors = dict(reader.read_globals(dtype=dt))
    layer_ids = list(range(cfg.num_hidden_layers)) + (cfg.mtp_layer_ids if with_mtp else [])
    for i in layer_ids:
        tensors.update({k: v.to(device) for k, v in reader.read_layer(i, dtype=dt).items()})
    return build_model(cfg, tensors, dtype=dt, device=device, with_mtp=with_mtp and bool(cfg.mtp_layer_ids))
