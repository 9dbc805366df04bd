"""Reading a quantized directory: validated by the checker first, then its config, tensor types and tensors
(used by the engine that serves it and by the fake-quant evaluation)."""

from __future__ import annotations

from typing import Mapping

import torch

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.format.checker import check_dir
from pipeline.format.description import DESCRIPTION_NAME, loads_json_object, parse_description
from pipeline.io import storage
from pipeline.io.safetensors_io import CheckpointError, read_header, read_tensors


def fa_scales(tensors: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """layer id -> fa_k scale, from a quantized directory's tensors."""
    return {layout.layer_of(k): v for k, v in tensors.items() if k.endswith("self_attn.fa_k.scale")}


def read_quantized(path: str) -> tuple[DeepseekV3Config, dict[str, str], dict[str, torch.Tensor]]:
    """Validate a quantized directory with the checker (the manifest's sizes, not its hashes: run
    ``python -m jobs.check`` for those), then read config, types and every tensor.
    Refuses a directory the checker rejects, with its report."""
    report = check_dir(path, verify=False)  # sizes only: re-hashing every shard would double the load's reads
    if not report.ok:
        raise CheckpointError(f"{path}: not a valid quantized directory:\n{report.to_text()}")
    cfg = DeepseekV3Config.from_file(storage.join(path, "config.json"))
    desc = parse_description(loads_json_object(storage.read_bytes(storage.join(path, DESCRIPTION_NAME)),
                                               DESCRIPTION_NAME))
    tensors: dict[str, torch.Tensor] = {}
    for f in report.weight_files:
        header = read_header(storage.join(path, f))
        tensors.update(read_tensors(header, list(header.tensors)))
    return cfg, dict(desc.tensors), tensors
