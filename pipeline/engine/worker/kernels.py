"""Which implementation of the hot paths runs: ``"triton"`` (this package's kernels), ``"native"`` (the
engine's C kernels for the CPU, :mod:`pipeline.engine.native.csrc`, built on first use) or ``"torch"`` (the
engine's torch code, the reference).

``backend(device)``: ``"triton"`` on a CUDA device when ``triton`` can be imported; ``"native"`` on the CPU
when a C compiler is on PATH (and ``DSQUANT_NATIVE`` is not ``0``); else ``"torch"``. A native kernel whose
library fails to build falls back to the torch code on its own (its module says so in its ``status()``).
The environment variable ``DSQUANT_KERNELS`` overrides the rule: ``torch`` always gives ``"torch"``;
``triton`` gives ``"triton"`` or raises (triton missing, or a CPU device without ``TRITON_INTERPRET=1``,
where the kernels cannot run); ``native`` gives ``"native"`` or raises (a CUDA device, or no compiler);
empty or ``auto`` is the default rule. The choice is logged once per device and value, in
one line, and remembered for :func:`chosen` (the metrics' ``kernels`` field). Triton is imported only to
answer for a CUDA device or a forced ``triton``; a CPU device under the default rule imports nothing.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Union

import torch

ENV = "DSQUANT_KERNELS"
TRITON, TORCH, NATIVE = "triton", "torch", "native"
log = logging.getLogger("dsquant.kernels")
_chosen: dict[str, str] = {}


def triton_available() -> bool:
    """Whether ``import triton`` works (it is imported: only asked where the kernels would run)."""
    try:
        importlib.import_module("triton")
    except Exception:                  # missing, or a broken install (e.g. no driver libraries)
        return False
    return True


def native_available() -> bool:
    """Whether the CPU's C kernels can be built here: a compiler on PATH, ``DSQUANT_NATIVE`` not ``0``."""
    from pipeline.cbuild import compiler

    return os.environ.get("DSQUANT_NATIVE", "1") != "0" and compiler() is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend(device: Union[str, torch.device]) -> str:
    """``"triton"`` or ``"torch"`` for work on ``device`` (module docstring). ValueError for a bad
    ``DSQUANT_KERNELS``; RuntimeError when ``triton`` is forced where it cannot run."""
    dev = torch.device(device)
    want = os.environ.get(ENV, "").strip().lower()
    if want not in ("", "auto", TRITON, TORCH, NATIVE):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 'torch', 'triton', 'native' or 'auto'")
    if want == TORCH:
        choice, why = TORCH, f"{ENV}=torch"
    elif want == NATIVE:
        if dev.type != "cpu" or not native_available():
            raise RuntimeError(f"{ENV}=native on {dev}: the C kernels need a CPU device and a C compiler "
                               f"(DSQUANT_NATIVE not 0)")
        choice, why = NATIVE, f"{ENV}=native"
    elif want == TRITON:
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton is not installed (pip install triton)")
        if dev.type != "cuda" and not _interpret():
            raise RuntimeError(f"{ENV}=triton on {dev}: the kernels need CUDA, or TRITON_INTERPRET=1 on a CPU")
        choice, why = TRITON, f"{ENV}=triton"
    elif dev.type == "cuda" and triton_available():
        choice, why = TRITON, "CUDA device, triton installed"
    elif dev.type == "cpu" and native_available():
        choice, why = NATIVE, "CPU device, C compiler found"
    else:
        choice = TORCH
        why = "triton not installed" if dev.type == "cuda" else "no C compiler (or DSQUANT_NATIVE=0)"
    key = str(dev)
    if _chosen.get(key) != choice:
        log.info("kernels on %s: %s (%s)", key, choice, why)
    _chosen[key] = choice
    return choice


def chosen() -> dict[str, str]:
    """The backend chosen so far per device, e.g. ``{"cuda:0": "triton"}`` (a copy; for metrics)."""
    return dict(_chosen)
