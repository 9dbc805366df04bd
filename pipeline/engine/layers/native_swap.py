"""A model's kernels, chosen when it is built (:func:`use_kernels`: the engine's, pipeline.engine.config), and
swapping the engine's float C modules into a model in place (:func:`use_native_float_ops`): the
modules of :mod:`pipeline.engine.native.cpu_float` (linears, RMSNorm, router) and of
:mod:`pipeline.engine.native.cpu_float_ffn` (a float model's MoE and dense MLPs), each where it takes the module's
weights; a module that does not fit stays torch."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from pipeline.engine.config import TRITON, Kernels
from pipeline.engine.native import cpu_float_ffn
from pipeline.engine.native.cpu_float import _DT, _LIB, NativeLinear, NativeRMSNorm, NativeRouter
from pipeline.model.ffn import MLP, MoE, Router
from pipeline.model.norm import RMSNorm

log = logging.getLogger("dsquant.kernels")


def use_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Give ``model`` ``kernels``: its int8 linears and int8 MoEs run their C kernels or not as
    ``kernels.linears`` says (on a triton backend the linears' and the MoE's Triton GEMMs), and the float C modules are
    swapped in where ``kernels.float_ops`` (each float linear's bf16 bits its only copy: NativeLinear.compact)."""
    from pipeline.engine.layers.moe import Int8MoE
    from pipeline.engine.layers.qlinear import Int8Linear

    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.native, m.triton = kernels.linears, kernels.backend == TRITON
        elif isinstance(m, Int8MoE):
            m.native, m.backend = kernels.linears, kernels.backend
    if kernels.float_ops:
        use_native_float_ops(model, compact=True)


def compact_linears(module: nn.Module) -> None:
    """Pack every int8 linear and int8 MoE under ``module`` for the C kernels now, the pack the only copy
    of its weight (cpu_linear.compact, cpu_moe.compact; the torch path reads it back from the pack)."""
    from pipeline.engine.layers.moe import Int8MoE
    from pipeline.engine.layers.qlinear import Int8Linear
    from pipeline.engine.native import cpu_linear, cpu_moe

    if cpu_linear.library() is None:
        return
    for m in module.modules():
        if isinstance(m, Int8MoE):
            cpu_moe.compact(m)
    for m in module.modules():
        if isinstance(m, Int8Linear) and m.kernel in cpu_moe.C_KERNELS and 0 < m.in_features <= cpu_linear.MAX_K:
            cpu_linear.compact(m)


def _is_head(name: str) -> bool:
    return name == "lm_head" or name.endswith("shared_head.head")


def _quantized(model: nn.Module) -> bool:
    from pipeline.engine.layers.qlinear import Int8Linear

    return any(isinstance(m, Int8Linear) for m in model.modules())


def _swap(name: str, mod: nn.Module, float_model: bool) -> Optional[tuple[nn.Module, str]]:
    """The C module for ``mod`` and its kind, or None (it stays)."""
    try:
        if type(mod) is nn.Linear and mod.bias is None and mod.weight.dtype == torch.float32:
            return NativeLinear(mod), "lm_head" if _is_head(name) else "linear"
        if type(mod) is RMSNorm and mod.weight.dtype in _DT and mod.bias is None:  # (the C norm has no bias)
            return NativeRMSNorm(mod), "rms_norm"
        if type(mod) is Router and mod.weight.dtype in _DT:
            return NativeRouter(mod), "router"
        if type(mod) is MoE and float_model and cpu_float_ffn.supported(mod):
            return cpu_float_ffn.NativeFloatMoE(mod), "moe"
        if type(mod) is MLP and float_model and cpu_float_ffn.plain_mlp(mod):
            return cpu_float_ffn.NativeFloatMLP(mod), "mlp"
    except ValueError as e:                     # e.g. a linear of other values than bf16's
        log.info("%s stays torch: %s", name, e)
    return None


def _computed_inside(name: str, moe: nn.Module) -> list[str]:
    """The submodules of a MoE that its NativeFloatMoE computes within its C call."""
    return [name + ".experts"] + ([name + ".shared_experts"] if cpu_float_ffn.plain_mlp(moe.shared_experts) else [])


def use_native_float_ops(model: nn.Module, compact: bool = False) -> dict[str, int]:
    """Swap the C modules into ``model`` (in place); the counts per kind. Any model: the lm_head / MTP head
    when a float32 linear of bf16 values, every RMSNorm of a float32 or bf16 weight, every Router that fits
    (groups of >= 2 experts). A float model (no int8 linear) also: every MoE whose experts fit and every
    dense MLP (cpu_float_ffn: their linears, and a MoE's shared expert, run inside the C call and stay
    nn.Linear for the torch fallback). Every model: every other bias-free float32 linear of bf16 values
    (a quantized model's float MTP layer's included; its MoE stays torch, its experts' linears swapped).
    ``compact``: each NativeLinear keeps its bf16 bits as the only copy of its weight (NativeLinear.compact),
    made so as it is swapped in, so that no more than one float32 weight and its bits are held at once
    beyond the model's. Nothing when the library is not available (:func:`status` says why)."""
    counts = dict.fromkeys(("lm_head", "linear", "rms_norm", "router", "moe", "mlp"), 0)
    if _LIB.library() is None:
        return counts
    float_model = not _quantized(model) and cpu_float_ffn.library() is not None
    inside = []                                  # prefixes computed within a swapped C block
    # parents first (named_modules' order): a MoE's router is then set on the NativeFloatMoE, which holds it;
    # each entry let go as it is taken, so that a swapped linear's float32 weight is freed then
    modules = list(model.named_modules())
    for i, (name, mod) in enumerate(modules):
        modules[i] = None
        if not name or any(name == p or name.startswith(p + ".") for p in inside):
            continue
        if isinstance(mod, cpu_float_ffn.NativeFloatMoE):      # swapped already (a loader's: float_bits)
            inside.extend(_computed_inside(name, mod))
            continue
        new = _swap(name, mod, float_model)
        if new is None:
            continue
        module, kind = new
        if kind == "mlp":
            inside.append(name)
        elif kind == "moe":
            inside.extend(_computed_inside(name, mod))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        if compact and isinstance(module, NativeLinear):
            module.compact()
        counts[kind] += 1
    log.info("native float ops: %s", counts)
    return counts
