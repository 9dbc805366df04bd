"""The memory a replica's engine takes, estimated before it loads, so that a server or a job that cannot fit
says so in one line (the bytes it needs, the bytes free) instead of being killed by the kernel's or Ray's
memory monitor and restarted in a loop.

The estimate is the model directory's tensor bytes times :data:`BYTES_PER_WEIGHT_BYTE`, plus
:data:`FIXED_BYTES` for the runtime. The factor is measured (a real-width W8A8 + FA3 output of 5.5 GB: peak
and steady RSS 16.8 GB after the first step, docs/performance.md "Loading"): the loader keeps every int8
weight twice (the module's buffer and the C kernels' packed copy), widens the float parts (embeddings,
lm_head, a FLOAT MTP layer) to float32, and keeps kv_b_proj's absorbed forms beside it. It is what the
loader needs today, not what it should; the per-part breakdown and what to drop are in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Optional

BYTES_PER_WEIGHT_BYTE = 3.1
FIXED_BYTES = int(1.5e9)


def weight_bytes(path: str, with_mtp: bool = True) -> Optional[int]:
    """The tensor bytes of a local model directory (its *.safetensors files; without the MTP layer's
    tensors unless ``with_mtp``, from the files' headers); None for a URL."""
    if "://" in path:
        return None
    files = sorted(Path(path).glob("*.safetensors"))
    if with_mtp:
        return sum(f.stat().st_size for f in files)
    try:
        first_mtp = int(json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return sum(f.stat().st_size for f in files)
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            try:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            except (struct.error, ValueError, MemoryError):
                total += f.stat().st_size
                continue
        for name, meta in header.items():
            if name == "__metadata__" or not isinstance(meta, dict):
                continue
            parts = name.split(".")
            mtp = len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                and int(parts[2]) >= first_mtp
            if not mtp:
                a, b = meta.get("data_offsets", (0, 0))
                total += b - a
    return total


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
    w = weight_bytes(path, with_mtp)
    return None if w is None else int(w * BYTES_PER_WEIGHT_BYTE) + FIXED_BYTES


def check_fits(path: str, engines: int = 1, what: str = "--model-path", with_mtp: bool = True) -> None:
    """ValueError (one line: what the engines need, what is free) when ``engines`` engines of ``path`` do
    not fit in this machine's free memory; nothing when they do or when either side is unknown.
    ``DSQUANT_SKIP_MEMORY_CHECK=1`` skips it (memory that frees as it loads, e.g. a page cache)."""
    if os.environ.get("DSQUANT_SKIP_MEMORY_CHECK") == "1":
        return
    need, free = engine_bytes(path, with_mtp), available_bytes()
    if need is None or free is None or engines * need <= free:
        return
    w = weight_bytes(path, with_mtp) or 0
    raise ValueError(f"{what} {path}: {engines} engine(s) need about {engines * need / 1e9:.1f} GB "
                     f"({w / 1e9:.1f} GB of weights x {BYTES_PER_WEIGHT_BYTE} + {FIXED_BYTES / 1e9:.1f} GB each), "
                     f"{free / 1e9:.1f} GB is free; serve fewer replicas, shard the model (--tp / --moe-ep over "
                     f"nodes), or set DSQUANT_SKIP_MEMORY_CHECK=1 to try anyway")
