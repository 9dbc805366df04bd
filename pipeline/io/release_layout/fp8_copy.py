"""Write an FP8 block-quantized copy of a checkpoint in the DeepSeek-V3 release's exact layout.

Every tensor with ``layout.is_fp8_quantizable(name)`` becomes float8_e4m3fn plus ``<name>_scale_inv``
(float32, [ceil(out / 128), ceil(in / 128)]) by :func:`pipeline.io.fp8.quantize_fp8_blocks`; an FP8 source
with the same block size is passed through bit for bit. Every other tensor keeps its stored dtype.

Output: ``model-00001-of-000NNN.safetensors`` (5-digit index, 6-digit total, as in the release), then
config.json with ``quantization_config``, the other top-level files (tokenizer, generation config, ...),
and last ``model.safetensors.index.json``, so a directory with an index is complete. Each shard's header is
planned from the source headers before any value is read, so the copy streams one layer at a time: only
the current layer is in memory, and a shard may span several layers.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Optional

import torch

from pipeline import layout
from pipeline.io import storage
from pipeline.io.destination.rule import check_not_source
from pipeline.io.checkpoint import CONFIG_NAME, INDEX_NAME, PICKLE_SUFFIXES, SCALE_SUFFIX, CheckpointReader
from pipeline.io.fp8 import DEFAULT_BLOCK, FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks, scale_shape
from pipeline.io.safetensors_io import DTYPE_NAMES, SafetensorsWriter, TensorSpec

SHARD_BYTES = 4 * 1024**3  # default shard size target when --shards is not given


def quantization_config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """The release's ``quantization_config`` entry."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


def shard_name(index: int, total: int) -> str:
    """``model-00001-of-000163.safetensors`` for index 1 of 163 (1-based)."""
    return f"model-{index:05d}-of-{total:06d}.safetensors"


@dataclass(frozen=True)
class _Unit:
    """What is read in one go: the globals (layer_id None) or one layer; specs in write order."""

    layer_id: Optional[int]
    specs: tuple[TensorSpec, ...]


def plan_units(reader: CheckpointReader, block: tuple[int, int] = DEFAULT_BLOCK) -> list[_Unit]:
    """The output tensors of each unit (globals first, then layers in order), from headers only."""
    cfg = reader.config
    out_dtype = DTYPE_NAMES[getattr(torch, cfg.torch_dtype)]
    units = []
    for lid in [None, *layout.all_layer_ids(cfg)]:
        shapes = layout.global_shapes(cfg) if lid is None else layout.layer_shapes(cfg, lid)
        specs: list[TensorSpec] = []
        for name in sorted(shapes):
            shape = tuple(shapes[name])
            if layout.is_fp8_quantizable(name):
                specs.append(TensorSpec(name, "F8_E4M3", shape))
                specs.append(TensorSpec(name + SCALE_SUFFIX, "F32", scale_shape(shape, block)))
            else:
                stored = reader.header(name)[0]
                specs.append(TensorSpec(name, out_dtype if stored == "F8_E4M3" else stored, shape))
        units.append(_Unit(lid, tuple(specs)))
    return units


def assign_shards(sizes: list[int], n: int) -> list[int]:
    """A shard index in [0, n) for each tensor, in order: contiguous runs of about total / n bytes.
    Tensor k goes to the shard its byte midpoint falls in, kept within [prev, prev + 1] (no shard
    skipped) and high enough that the tensors left can fill the shards left, so all n are used."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {n} shards")
    total, seen, prev, out = max(sum(sizes), 1), 0, 0, []
    for k, size in enumerate(sizes):
        target = min(n - 1, int((seen + size / 2) * n / total))
        prev = 0 if k == 0 else min(prev + 1, max(prev, target, n - (len(sizes) - k)))
        out.append(prev)
        seen += size
    return out


def _convert(reader: CheckpointReader, unit: _Unit, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """One unit's output tensors, from its stored tensors (read and validated by the reader)."""
    stored = reader.read_globals(dequantize=False) if unit.layer_id is None else \
        reader.read_layer(unit.layer_id, dequantize=False)
    out: dict[str, torch.Tensor] = {}
    for spec in unit.specs:
        name = spec.name
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in out:
            continue  # written together with its weight below
        t = stored.pop(name)
        scale = stored.pop(name + SCALE_SUFFIX, None)
        if layout.is_fp8_quantizable(name):
            if t.dtype == FP8_DTYPE and tuple(reader.block) == tuple(block):
                out[name], out[name + SCALE_SUFFIX] = t, scale.to(torch.float32)
                continue
            w = dequantize_fp8_blocks(t, scale, reader.block, torch.float32, name) if scale is not None else t
            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_blocks(w, block, name)
        elif t.dtype == FP8_DTYPE:  # not quantizable in the release: store it dequantized
            out[name] = dequantize_fp8_blocks(t, scale, reader.block, getattr(torch, reader.config.torch_dtype), name)
        else:
            out[name] = t
    return out


def check_destination(src: str, dst: str) -> None:
    """``dst`` must not be, hold or lie inside ``src`` (:mod:`pipeline.io.destination.rule`) and must be new or
    empty: a copy written into another checkpoint or output would overwrite its config.json and mix their files."""
    check_not_source(src, dst, "--dst")
    if storage.exists(dst):
        if not storage.isdir(dst):
            raise FileExistsError(f"{dst}: exists and is not a directory")
        entries = storage.listdir(dst)
        if entries:
            raise FileExistsError(f"{dst}: not empty ({', '.join(entries[:4])}); the FP8 copy goes into a new or "
                                  "empty directory")


def write_fp8_copy(src: str, dst: str, shards: Optional[int] = None,
                   block: tuple[int, int] = DEFAULT_BLOCK, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the FP8 copy of checkpoint ``src`` to directory ``dst``; returns the index written.
    ``shards``: the number of shard files (default: ceil(total bytes / ``shard_bytes``))."""
    check_destination(src, dst)
    reader = CheckpointReader(src)
    units = plan_units(reader, block)
    specs = [s for u in units for s in u.specs]
    total = sum(s.nbytes for s in specs)
    n = shards if shards is not None else max(1, math.ceil(total / shard_bytes))
    shard_of = assign_shards([s.nbytes for s in specs], n)
    names = [shard_name(k + 1, n) for k in range(n)]
    weight_map = {s.name: names[k] for s, k in zip(specs, shard_of)}
    shard_specs: list[list[TensorSpec]] = [[] for _ in range(n)]
    for s, k in zip(specs, shard_of):
        shard_specs[k].append(s)

    with contextlib.ExitStack() as stack:  # one open shard at a time; aborted (no file) on error
        writer, current, i = None, -1, 0
        for unit in units:
            tensors = _convert(reader, unit, block)
            for spec in unit.specs:
                if shard_of[i] != current:
                    stack.close()  # commits the previous shard
                    current = shard_of[i]
                    writer = stack.enter_context(SafetensorsWriter(
                        storage.join(dst, names[current]), shard_specs[current], metadata={"format": "pt"}))
                writer.write(spec.name, tensors.pop(spec.name))
                i += 1

    raw_config = json.loads(storage.read_bytes(storage.join(src, CONFIG_NAME)))
    raw_config["quantization_config"] = quantization_config(block)
    storage.write_bytes(storage.join(dst, CONFIG_NAME), (json.dumps(raw_config, indent=2) + "\n").encode())
    copy_other_files(src, dst)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    storage.write_bytes(storage.join(dst, INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode())
    return index


def copy_other_files(src: str, dst: str) -> None:
    """Top-level files other than weights, index and config (tokenizer, generation config, code, ...)."""
    skip_suffixes = (".safetensors", ".safetensors.index.json", *PICKLE_SUFFIXES)
    for entry in storage.listdir(src):
        path = storage.join(src, entry)
        if entry == CONFIG_NAME or entry.startswith(".") or entry.endswith(skip_suffixes) or storage.isdir(path):
            continue
        storage.copy_file(path, storage.join(dst, entry))
