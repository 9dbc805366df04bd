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
from pipeline.io.checkpoint import read_model_config
from pipeline.io.safetensors_io import CheckpointError, read_header, read_rows, read_tensors


def fa_scales(tensors: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """layer id -> fa_k scale, from a quantized directory's tensors."""
    return {layout.layer_of(k): v for k, v in tensors.items() if k.endswith("self_attn.fa_k.scale")}


def read_types(path: str) -> dict[str, str]:
    """Tensor name -> type, from the quantized directory's description (not validated: see check_dir)."""
    raw = storage.read_bytes(storage.join(path, DESCRIPTION_NAME))
    return dict(parse_description(loads_json_object(raw, DESCRIPTION_NAME)).tensors)


def carried_model(path: str, types: Mapping[str, str]) -> DeepseekV3Config:
    """The model the quantized directory at ``path`` carries, its description's tensors ``types``:
    config.json's, without the MTP layer when no tensor of it is there (pipeline.layout.carried_config)."""
    return layout.carried_config(read_model_config(storage.join(path, "config.json")), types)


class QuantizedSource:
    """A quantized directory validated by the checker, with its config, types and a tensor -> file index;
    tensors are read on demand, whole or in parts (a sharded replica's rank reads only its slices).
    ``config`` is the model the directory carries (pipeline.layout.carried_config): config.json's, without
    the MTP layer when the output left it out (msModelSlim's ``--quant_mtp none``), so that every reader
    (the engine, fake-quant, the evaluation) runs the model without it and offers no MTP drafting."""

    def __init__(self, path: str):
        report = check_dir(path, verify=False)  # sizes only (see read_quantized)
        if not report.ok:
            v = report.violations[0]
            more = f" and {len(report.violations) - 1} more" if len(report.violations) > 1 else ""
            raise CheckpointError(f"{path}: not a valid quantized directory: [{v.rule}] {v.where}: {v.message}{more} "
                                  f"(python -m jobs.check {path} lists them)\n{report.to_text()}")
        self.path = path
        self.types = read_types(path)
        self.config = carried_model(path, self.types)
        self.headers = [read_header(storage.join(path, f)) for f in report.weight_files]
        self.where = {n: h for h in self.headers for n in h.tensors}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].info(name).shape

    def read(self, parts: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """``parts``: name -> "full" or (dim, start, end). Whole tensors are read together per file; a
        dim-0 part with one ranged read of its rows; a dim-1 part by reading the tensor, keeping a copy of
        the columns (one tensor at a time)."""
        out: dict[str, torch.Tensor] = {}
        for h in self.headers:
            names = [n for n in h.tensors if n in parts]
            out.update(read_tensors(h, [n for n in names if parts[n] == "full"]))
            for n in names:
                p = parts[n]
                if p == "full":
                    continue
                dim, a, b = p
                out[n] = read_rows(h, n, a, b) if dim == 0 else \
                    read_tensors(h, [n])[n].narrow(dim, a, b - a).contiguous()
        return out


def read_quantized(path: str) -> tuple[DeepseekV3Config, dict[str, str], dict[str, torch.Tensor]]:
    """Validate a quantized directory with the checker (the manifest's sizes, not its hashes: run
    ``python -m jobs.check`` for those), then read config, types and every tensor.
    Refuses a directory the checker rejects, with its report."""
    src = QuantizedSource(path)
    return src.config, src.types, src.read({n: "full" for n in src.where})
