"""How an engine is built: :class:`EngineConfig` (the cache, the batch limits, the modes) and the kernels it
runs (:class:`Kernels`), chosen once, when the engine is built (:func:`resolve`), recorded in its config,
logged once and shown in ``/metrics``; nothing on a step's path reads the environment.

Which implementation of the hot paths runs (``backend``): ``"triton"`` (pipeline.engine.triton's kernels)
on a CUDA device when ``triton`` can be imported; ``"native"`` (the C kernels of pipeline.engine.native,
built on first use) on the CPU when a C compiler is on PATH and ``DSQUANT_NATIVE`` is not ``0``; else
``"torch"`` (the engine's torch code, the reference). ``DSQUANT_KERNELS`` overrides the rule: ``torch``
always gives ``"torch"``; ``triton`` gives ``"triton"`` or raises (triton missing, or a CPU device
without ``TRITON_INTERPRET=1``, where the kernels cannot run); ``native`` gives ``"native"`` or raises
(a CUDA device, or no compiler); empty or ``auto`` is the default rule. Under ``native`` each family of C
kernels is used where its library builds and its switch is not ``0``: the int8 linears and MoE
(``DSQUANT_NATIVE_LINEAR``), the float ops (``DSQUANT_NATIVE_FLOAT``: norms, rope, float linears, a float
model's FFNs), the decode attention (built with its vector loops) and the cache write. Replayed decode
steps (``EngineConfig.decode_graph``) are off where ``DSQUANT_DECODE_GRAPH=0``. Triton is imported only to
answer for a CUDA device or a forced ``triton``; a CPU device under the default rule imports nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch

ENV = "DSQUANT_KERNELS"
GRAPH_ENV = "DSQUANT_DECODE_GRAPH"
TRITON, TORCH, NATIVE = "triton", "torch", "native"


@dataclass(frozen=True)
class Kernels:
    """The kernels an engine runs on ``device`` (:func:`resolve`): the ``backend`` and why, and under
    ``native`` which families of C kernels are on."""

    device: str = "cpu"
    backend: str = TORCH
    why: str = ""
    linears: bool = False           # the int8 linears and the int8 MoE's experts in C
    float_ops: bool = False         # norms, rope, router, float linears, a float model's FFNs in C
    attention: bool = False         # decode attention in C (its vector loops built)
    cache_write: bool = False       # the step's cache write in C

    def describe(self) -> str:
        """One line for the log."""
        if self.backend != NATIVE:
            return f"{self.backend} ({self.why})"
        on = [n for n, v in (("int8 linears", self.linears), ("float ops", self.float_ops),
                             ("decode attention", self.attention), ("cache write", self.cache_write)) if v]
        off = [n for n, v in (("int8 linears", self.linears), ("float ops", self.float_ops),
                              ("decode attention", self.attention), ("cache write", self.cache_write)) if not v]
        return (f"native ({self.why}): C {', '.join(on) or 'nothing'}"
                + (f"; torch {', '.join(off)}" if off else ""))

    def labels(self) -> dict[str, str]:
        """The choice as metric labels (``dsquant_engine_kernels``)."""
        def kind(on: bool) -> str:
            return NATIVE if on else TORCH if self.backend != TRITON else TRITON
        return {"device": self.device, "backend": self.backend, "linears": kind(self.linears),
                "float_ops": kind(self.float_ops), "attention": kind(self.attention)}


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 16
    max_batched_tokens: int = 256
    max_model_len: Optional[int] = None     # default: what the cache holds, capped by the model's positions
    nz: bool = False
    device: str = "cpu"
    cache_dtype: Optional[str] = None       # k_pe / non-FA3 latent storage; default the model's dtype
    mtp: bool = False                       # speculative decoding with the MTP layer (one draft token)
    fa3: bool = True                        # int8 latent cache on FA3 layers (False: the latent in bf16)
    compile: bool = False                   # torch.compile the layers' work around attention (layers.regions)
    prefix_caching: bool = True             # reuse cached full blocks across requests (cache.prefix_cache)
    decode_graph: bool = True               # replay pure decode steps (worker.decode_graph; False: eager)
    kernels: Optional[Kernels] = None       # the kernels chosen (resolve); None: not built yet

    def __post_init__(self):
        if isinstance(self.kernels, dict):      # from asdict (a config sent to another process)
            object.__setattr__(self, "kernels", Kernels(**self.kernels))

    def resolved(self, kernels: Optional[Kernels] = None, env: Mapping[str, str] = os.environ) -> "EngineConfig":
        """This config as the engine runs it: its kernels (``kernels``: the ones its model was built for;
        else its own, else resolved for its device now) and the decode graph off where
        ``DSQUANT_DECODE_GRAPH=0``."""
        k = kernels or self.kernels or resolve(self.device, env)
        return dataclasses.replace(self, kernels=k, decode_graph=self.decode_graph and env.get(GRAPH_ENV) != "0")


# ----- the choice -----------------------------------------------------------------------------------------

def triton_available() -> bool:
    """Whether ``import triton`` works (it is imported: only asked where the kernels would run)."""
    try:
        importlib.import_module("triton")
    except Exception:                  # missing, or a broken install (e.g. no driver libraries)
        return False
    return True


def native_available(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the CPU's C kernels can be built here: a compiler on PATH, ``DSQUANT_NATIVE`` not ``0``."""
    from pipeline.cbuild import compiler

    return env.get("DSQUANT_NATIVE", "1") != "0" and compiler() is not None


def backend(device: Union[str, torch.device], env: Mapping[str, str] = os.environ) -> str:
    """The backend for work on ``device`` (module docstring): :func:`choose`'s first half."""
    return choose(device, env)[0]


def choose(device: Union[str, torch.device], env: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(backend, why) for work on ``device`` (module docstring). ValueError for a bad ``DSQUANT_KERNELS``;
    RuntimeError when a backend is forced where it cannot run."""
    dev = torch.device(device)
    want = env.get(ENV, "").strip().lower()
    if want not in ("", "auto", TRITON, TORCH, NATIVE):
        raise ValueError(f"{ENV}={env[ENV]!r}: expected 'torch', 'triton', 'native' or 'auto'")
    if want == TORCH:
        return TORCH, f"{ENV}=torch"
    if want == NATIVE:
        if dev.type != "cpu" or not native_available(env):
            raise RuntimeError(f"{ENV}=native on {dev}: the C kernels need a CPU device and a C compiler "
                               f"(DSQUANT_NATIVE not 0)")
        return NATIVE, f"{ENV}=native"
    if want == TRITON:
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton is not installed (pip install triton)")
        if dev.type != "cuda" and env.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(f"{ENV}=triton on {dev}: the kernels need CUDA, or TRITON_INTERPRET=1 on a CPU")
        return TRITON, f"{ENV}=triton"
    if dev.type == "cuda" and triton_available():
        return TRITON, "CUDA device, triton installed"
    if dev.type == "cpu" and native_available(env):
        return NATIVE, "CPU device, C compiler found"
    return TORCH, "triton not installed" if dev.type == "cuda" else "no C compiler (or DSQUANT_NATIVE=0)"


def resolve(device: Union[str, torch.device] = "cpu", env: Mapping[str, str] = os.environ) -> Kernels:
    """The kernels for work on ``device``, from the environment now (module docstring); the libraries of
    the chosen C kernels are built here (first use) and their switches read."""
    name, why = choose(device, env)
    if name != NATIVE:
        return Kernels(str(torch.device(device)), name, why)
    from pipeline.engine.native import cpu_attention, cpu_float, cpu_linear

    return Kernels(str(torch.device(device)), name, why, linears=cpu_linear.library() is not None,
                   float_ops=cpu_float.library() is not None, attention=cpu_attention.serving_library() is not None,
                   cache_write=cpu_attention.write_library() is not None)
