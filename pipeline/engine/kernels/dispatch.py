"""Which implementation of the hot paths runs: ``"triton"`` (this package's kernels) or ``"torch"`` (the
engine's torch code).

``backend(device)``: ``"triton"`` on a CUDA device when ``triton`` can be imported, else ``"torch"``. The
environment variable ``DSQUANT_KERNELS`` overrides it: ``torch`` always gives ``"torch"``; ``triton`` gives
``"triton"`` or raises (triton missing, or a CPU device without ``TRITON_INTERPRET=1``, where the kernels
cannot run); empty or ``auto`` is the default rule. The choice is logged once per device and value, in
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
TRITON, TORCH = "triton", "torch"
log = logging.getLogger("dsquant.kernels")
_chosen: dict[str, str] = {}


def triton_available() -> bool:
    """Whether ``import triton`` works (it is imported: only asked where the kernels would run)."""
    try:
        importlib.import_module("triton")
    except Exception:                  # missing, or a broken install (e.g. no driver libraries)
        return False
    return True


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend(device: Union[str, torch.device]) -> str:
    """``"triton"`` or ``"torch"`` for work on ``device`` (module docstring). ValueError for a bad
    ``DSQUANT_KERNELS``; RuntimeError when ``triton`` is forced where it cannot run."""
    dev = torch.device(device)
    want = os.environ.get(ENV, "").strip().lower()
    if want not in ("", "auto", TRITON, TORCH):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 'torch', 'triton' or 'auto'")
    if want == TORCH:
        choice, why = TORCH, f"{ENV}=torch"
    elif want == TRITON:
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton is not installed (pip install triton)")
        if dev.type != "cuda" and not _interpret():
            raise RuntimeError(f"{ENV}=triton on {dev}: the kernels need CUDA, or TRITON_INTERPRET=1 on a CPU")
        choice, why = TRITON, f"{ENV}=triton"
    elif dev.type == "cuda" and triton_available():
        choice, why = TRITON, "CUDA device, triton installed"
    else:
        choice = TORCH
        why = "not a CUDA device" if dev.type != "cuda" else "triton not installed"
    key = str(dev)
    if _chosen.get(key) != choice:
        log.info("kernels on %s: %s (%s)", key, choice, why)
    _chosen[key] = choice
    return choice


def chosen() -> dict[str, str]:
    """The backend chosen so far per device, e.g. ``{"cuda:0": "triton"}`` (a copy; for metrics)."""
    return dict(_chosen)
