"""The memory a replica's engine takes, estimated before it loads, so that a server or a job that cannot fit
says so in one line (the bytes it needs, the bytes free) instead of being killed by the kernel's or Ray's
memory monitor and restarted in a loop.

The estimate follows what the loader holds (pipeline.engine.worker.loader, measured in docs/performance.md
"Loading at real width"): every int8 weight once (read one layer at a time straight into the C kernels'
packed layout, the pack the only copy); a quantized output's float parts by what they become
(:func:`float_factor`): a float linear's weight (lm_head, the MTP layer's when FLOAT, eh_proj) as the C
float kernels' bf16 bits only, 2 bytes a value (where those kernels run: :func:`float_bits`; else widened
to float32), kv_b_proj's also as the attention's absorbed forms, everything else (embeddings, norms,
router) widened to float32; a float checkpoint's the same way where its linears are read as bits
(pipeline.engine.worker.float_bits: the C float kernels run and no weight is FP8), else its values as
float32 with a bf16 copy for the C kernels (:data:`FLOAT_MODEL_FACTOR`); the largest layer once more
while it is read and packed, and
:data:`FIXED_BYTES` for the runtime and a default KV cache. Only the safetensors headers are read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.format.description import DESCRIPTION_NAME

FLOAT_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1}
#: bytes held per float value of a quantized output (module docstring): widened to float32
FLOAT_FACTOR = 4
#: ... a float linear's weight held as the C float kernels' bf16 bits only (cpu_float.NativeLinear.compact)
BITS_FACTOR = 2
#: ... kv_b_proj's: its bits (which the MHA prefill reads too) and the attention's absorbed W_UK / W_UV^T in
#: bf16 (pipeline.engine.attention.backends.NativeAttention; float32 forms, 2 + 8, on a CPU without the
#: prefill's vector loops); without the bits: the float32 weight, the float32 forms and the prefill's
#: float32 form (4 + 4 + 4)
KV_B_FACTOR, KV_B_WIDE_FACTOR = 2 + 2, 12
#: bytes held per value of a float checkpoint read as float32 (an FP8 one, or where the C float kernels do
#: not run): float32 (4) and the C kernels' bf16 copy of its linears (2)
FLOAT_MODEL_FACTOR = 6
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FIXED_BYTES = int(1e9)
_NOT_LINEARS = ("embed_tokens.weight", ".mlp.gate.weight")     # 2-D float weights that are not linears


@dataclass
class WeightBytes:
    """A model directory's tensor bytes, by what the engine makes of them."""

    total: int = 0              # the tensors' bytes as stored
    held: int = 0               # what the loaded engine holds for them (module docstring)
    largest_layer: int = 0      # the largest layer's stored bytes (read and packed once more)

    @property
    def need(self) -> int:
        return self.held + self.largest_layer + FIXED_BYTES


def _headers(files: list[Path]):
    """(file, header dict or None when unreadable) per safetensors file."""
    for f in files:
        with open(f, "rb") as fh:
            try:
                yield f, json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            except (struct.error, ValueError, MemoryError):
                yield f, None


def float_bits() -> bool:
    """Whether an engine on this CPU holds a quantized output's float linears as bf16 bits: the C float
    kernels run (pipeline.engine.config: the native backend, ``DSQUANT_NATIVE_FLOAT`` not 0), read from the
    environment without building anything."""
    from pipeline.engine import config

    try:
        return config.choose("cpu")[0] == config.NATIVE and os.environ.get("DSQUANT_NATIVE_FLOAT", "1") != "0"
    except (RuntimeError, ValueError):
        return False


def float_factor(name: str, meta: dict, names, bits: bool) -> int:
    """Bytes held per value of a quantized output's float tensor ``name`` (``meta``: its header entry;
    ``names``: every tensor name of the directory, for a linear's bias; ``bits``: :func:`float_bits`). The
    loader keeps only a bias-free linear's stored bf16 weight as bits."""
    shape = meta.get("shape", ())
    if len(shape) != 2 or not name.endswith(".weight") or name.endswith(_NOT_LINEARS) \
            or name[: -len("weight")] + "bias" in names:
        return FLOAT_FACTOR
    bits = bits and meta.get("dtype") == "BF16"
    if name.endswith("self_attn.kv_b_proj.weight"):
        return KV_B_FACTOR if bits else KV_B_WIDE_FACTOR
    return BITS_FACTOR if bits else FLOAT_FACTOR


def tensor_bytes(path: str, with_mtp: bool = True, bits: Optional[bool] = None) -> Optional[WeightBytes]:
    """The tensor bytes of a local model directory (its *.safetensors files, from their headers; without
    the MTP layer's tensors unless ``with_mtp``); None for a URL. ``bits``: whether the C float kernels
    hold the float linears as bf16 bits (default :func:`float_bits`)."""
    if "://" in path:
        return None
    files = sorted(Path(path).glob("*.safetensors"))
    try:
        first_mtp = int(json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        first_mtp = None
    quantized = (Path(path) / DESCRIPTION_NAME).is_file()
    bits = float_bits() if bits is None else bits
    headers = list(_headers(files))
    names = {n for _, h in headers if h is not None for n in h}
    # a float checkpoint's linears are held as bits where the loader reads them so (float_bits.takes)
    as_bits = quantized or (bits and not any(isinstance(m, dict) and m.get("dtype") in FP8_DTYPES
                                             for _, h in headers if h is not None for m in h.values()))
    out, layers = WeightBytes(), {}
    for f, header in headers:
        if header is None:                       # unreadable: count the file as float, the worst case
            size = f.stat().st_size
            out.total += size
            out.held += size * FLOAT_MODEL_FACTOR // 2
            continue
        for name, meta in header.items():
            if name == "__metadata__" or not isinstance(meta, dict):
                continue
            parts = name.split(".")
            layer = int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                else None
            if not with_mtp and first_mtp is not None and layer is not None and layer >= first_mtp:
                continue
            a, b = meta.get("data_offsets", (0, 0))
            dt = meta.get("dtype")
            out.total += b - a
            if dt in FLOAT_DTYPES:
                factor = float_factor(name, meta, names, bits) if as_bits else FLOAT_MODEL_FACTOR
                out.held += (b - a) // FLOAT_DTYPES[dt] * factor
            else:
                out.held += b - a
            if layer is not None:
                layers[layer] = layers.get(layer, 0) + b - a
    out.largest_layer = max(layers.values(), default=0)
    return out


def weight_bytes(path: str, with_mtp: bool = True) -> Optional[int]:
    """The tensor bytes of a local model directory as stored (:func:`tensor_bytes`); None for a URL."""
    w = tensor_bytes(path, with_mtp)
    return None if w is None else w.total


def available_bytes() -> Optional[int]:
    """Memory this process may still take: MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    try:
        avail = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                     if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def engine_bytes(path: str, with_mtp: bool = True) -> Optional[int]:
    """The estimated memory of one engine serving ``path`` (module docstring); None for a URL."""
    w = tensor_bytes(path, with_mtp)
    return None if w is None else w.need


def check_fits(path: str, engines: int = 1, what: str = "--model-path", with_mtp: bool = True) -> None:
    """ValueError (one line: what the engines need, what is free) when ``engines`` engines of ``path`` do
    not fit in this machine's free memory; nothing when they do or when either side is unknown.
    ``DSQUANT_SKIP_MEMORY_CHECK=1`` skips it (memory that frees as it loads, e.g. a page cache)."""
    if os.environ.get("DSQUANT_SKIP_MEMORY_CHECK") == "1":
        return
    w, free = tensor_bytes(path, with_mtp), available_bytes()
    if w is None or free is None or engines * w.need <= free:
        return
    raise ValueError(f"{what} {path}: {engines} engine(s) need about {engines * w.need / 1e9:.1f} GB "
                     f"({w.total / 1e9:.1f} GB of weights held as {w.held / 1e9:.1f} GB, {w.largest_layer / 1e9:.1f} GB "
                     f"for the layer being loaded, {FIXED_BYTES / 1e9:.1f} GB fixed, each), {free / 1e9:.1f} GB is "
                     f"free; serve fewer replicas, shard the model (--tp / --moe-ep over nodes), or set "
                     f"DSQUANT_SKIP_MEMORY_CHECK=1 to try anyway")
