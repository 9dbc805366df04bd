"""The CPU's feature flags as Linux reports them (/proc/cpuinfo), for tests that build a kernel for an
instruction set and need the CPU to run it."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (avx2, fma, avx512f, amx_tile, ...); empty where /proc/cpuinfo is not."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
