"""Pinning an engine core process to CPUs of its own (as vLLM's CPU build binds its engine core's OpenMP
threads): the step loop then keeps its caches and is not migrated between cores by the HTTP, streaming
and Serve processes beside it (more output tokens/s and a lower TPOT under `vllm bench serve` at many
clients). Only the engine is pinned; everything else keeps every CPU.

``spec`` (``ServeConfig.engine_cpus``, ``jobs.serve --engine-cpus``):

- ``"auto"``: as many CPUs as the engine has torch threads, the highest-numbered ones this process may
  use that no other live engine on the node has claimed, always leaving at least one CPU unclaimed (a
  machine of one CPU, or one whose CPUs are all claimed, pins nothing). Claims are files named by CPU
  under :func:`claims_dir` holding the claiming pid; a dead pid's claim is taken over.
- ``"none"``: no pinning.
- a list: ``"3"``, ``"2,3"``, ``"4-7"``: exactly those CPUs (ValueError for CPUs this process may not use).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

AUTO, NONE = "auto", "none"


def parse(spec: str) -> Optional[list[int]]:
    """``spec`` checked: None for "auto" / "none", else the listed CPUs (sorted, distinct)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"engine_cpus must be 'auto', 'none' or a CPU list like '3' or '2-3', got {spec!r}")
    s = spec.strip().lower()
    if s in (AUTO, NONE):
        return None
    cpus: set[int] = set()
    for part in s.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"engine_cpus: {part.strip()!r} in {spec!r} is not a CPU number or range") from None
        if a < 0 or b < a:
            raise ValueError(f"engine_cpus: {part.strip()!r} in {spec!r} is not a CPU range")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"dsquant-engine-cpus-{getattr(os, 'getuid', lambda: 0)()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip() or "0")
    except (OSError, ValueError):
        return None


def claim(n: int, allowed: set[int], pid: int, where: Optional[Path] = None) -> list[int]:
    """Claim ``n`` CPUs of ``allowed`` for ``pid`` (the "auto" policy, module docstring); [] when they do
    not fit. Each claim is one file made with O_EXCL, so concurrent engines never claim the same CPU."""
    where = where or claims_dir()
    where.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    for cpu in sorted(allowed, reverse=True):
        if len(got) == n:
            break
        path = where / str(cpu)
        holder = _holder(path)
        if holder is not None and holder != pid and _alive(holder):
            continue
        if holder is not None:
            path.unlink(missing_ok=True)               # a dead engine's claim (or our own)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:                        # another engine got there first
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(pid))
        got.append(cpu)
    claimed = set(got) | {c for c in allowed if (h := _holder(where / str(c))) is not None and _alive(h)}
    if len(got) < n or not allowed - claimed:          # always leave one CPU to everything else
        for cpu in got:
            (where / str(cpu)).unlink(missing_ok=True)
        return []
    return got


def pin(spec: str, threads: int) -> list[int]:
    """Pin this process (its threads made from now on) per ``spec``; the CPUs pinned to ([] when none)."""
    cpus = parse(spec)
    if not hasattr(os, "sched_setaffinity"):
        return []
    allowed = set(os.sched_getaffinity(0))
    if cpus is None:
        if spec.strip().lower() == NONE or len(allowed) < 2:
            return []
        cpus = claim(max(1, threads), allowed, os.getpid())
        if not cpus:
            return []
    elif not set(cpus) <= allowed:
        raise ValueError(f"engine_cpus {spec!r}: CPU(s) {sorted(set(cpus) - allowed)} are not available to "
                         f"this process (it may use {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    return cpus
