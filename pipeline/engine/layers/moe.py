"""The MoE of a quantized layer as the engine runs it: the same routing and the same arithmetic as the
model's ``MoE`` over int8 experts, with less work per step.

- The layer's input is quantized once per token (W8A8_DYNAMIC quantizes each token by itself, so one
  token's int8 row and scale are the same for every expert that reads it, the shared expert included);
- each expert's gate and up projections are one int8 GEMM over their stacked weights ([2I, H]);
- tokens are grouped by expert in one sort, and the per-expert results are added back in that order.

Every output equals the model's ``MoE`` with the same int8 linears bit for bit in the linears' reference
mode (the same integers, scales and epilogue per output column; the same casts and the same order of
the index_add), which the tests check. On the torch path the experts run one GEMM each in a
Python loop over the experts that have tokens. Where the kernels backend is ``native`` (a CPU with a C
compiler), the routed experts of all tokens run in two C calls instead (:mod:`pipeline.engine.native.cpu_moe`:
the same arithmetic in the same order, the same bits) and the shared expert through the fused C linears;
on CUDA with triton, the grouped Triton kernels (:mod:`pipeline.engine.triton.moe_gemm`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.native import cpu_moe
from pipeline.engine.config import TRITON, backend
from pipeline.engine.layers.qlinear import W8A8DynamicLinear, quantize_per_token
from pipeline.model.ffn import MLP, MoE, combine_experts


class Int8Expert(nn.Module):
    """An expert (or the shared experts) with int8 W8A8_DYNAMIC linears: gate and up stacked."""

    def __init__(self, mlp: MLP):
        super().__init__()
        g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.inter = g.out_features
        self.gate_up = W8A8DynamicLinear(f"{g.name}+up_proj", torch.cat([g.weight, u.weight]),
                                         torch.cat([g.weight_scale, u.weight_scale]), kernel=g.kernel,
                                         epilogue=g.epilogue)
        self.down_proj = d

    def forward_quantized(self, x_q: torch.Tensor, s_tok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows already quantized per token -> the expert's output in ``dtype``, as ``MLP.forward``
        computes it with these linears (gate and up cast to ``dtype``, SiLU and product in ``dtype``)."""
        gu = self.gate_up.apply_quantized(x_q, s_tok)
        h = F.silu(gu[:, :self.inter].to(dtype)) * gu[:, self.inter:].to(dtype)
        return self.down_proj(h)


def is_int8_mlp(mlp: Optional[nn.Module]) -> bool:
    """An MLP whose three linears are W8A8_DYNAMIC without bias (a wrapped one, e.g. a sharded replica's
    row-parallel ``down_proj``, by its ``inner`` linear)."""
    return isinstance(mlp, MLP) and all(
        isinstance(lin, W8A8DynamicLinear) and lin.bias is None
        for lin in (getattr(m, "inner", m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)))


def can_fuse(moe: nn.Module) -> bool:
    """A MoE whose every expert (and shared expert) is W8A8_DYNAMIC without bias, with one epilogue."""
    if not isinstance(moe, MoE) or not all(is_int8_mlp(e) for e in moe.experts):
        return False
    if moe.shared_experts is not None and not is_int8_mlp(moe.shared_experts):
        return False
    linears = [m for m in moe.modules() if isinstance(m, W8A8DynamicLinear)]
    return len({(m.epilogue, m.kernel) for m in linears}) == 1


class Int8MoE(nn.Module):
    """Drop-in for a ``MoE`` that :func:`can_fuse`; keeps its router and ``last_load``."""

    def __init__(self, moe: MoE):
        super().__init__()
        if not can_fuse(moe):
            raise ValueError("Int8MoE: every expert must be W8A8_DYNAMIC without bias, with one epilogue")
        self.gate = moe.gate
        self.experts = nn.ModuleList(Int8Expert(e) for e in moe.experts)
        self.shared_experts = Int8Expert(moe.shared_experts) if moe.shared_experts is not None else None
        self.last_load: Optional[torch.Tensor] = None
        # the kernels, chosen when built (the engine's; alone: the environment's now)
        self.native = all(m.native for m in self.modules() if isinstance(m, W8A8DynamicLinear))
        self.backend = backend(self.gate.weight.device)
        self.register_load_state_dict_post_hook(cpu_moe.drop_pack)    # the C path's packed experts

    def _apply(self, fn, recurse=True):
        cpu_moe.drop_pack(self)                         # .to(), .float(), ...: new expert tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_moe.can_run(self, x):                    # the CPU's C kernels (cpu_moe)
            shape, dtype = x.shape, x.dtype
            flat = x.reshape(-1, shape[-1])
            weights, idx = self.gate(flat)
            out, self.last_load = cpu_moe.routed(self, flat, weights, idx)
            out = out.to(dtype)
            if self.shared_experts is not None:
                out = out + cpu_moe.shared_forward(self.shared_experts, flat)
            return out.view(shape)
        if self.backend == TRITON:                      # the fused grouped int8 GEMM (triton.moe_gemm)
            from pipeline.engine.triton.moe_gemm import StackedExperts, int8_moe_forward

            if getattr(self, "_stacked", None) is None:
                self._stacked = StackedExperts.of(self)
            return int8_moe_forward(self, self._stacked, x)
        shape, dtype = x.shape, x.dtype
        flat = x.reshape(-1, shape[-1])
        weights, idx = self.gate(flat)
        x_q, s_tok = quantize_per_token(flat)
        out, self.last_load = combine_experts(flat, weights, idx, len(self.experts),
                                              lambda e, t: self.experts[e].forward_quantized(x_q[t], s_tok[t], dtype))
        out = out.to(dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward_quantized(x_q, s_tok, dtype)
        return out.view(shape)


def fuse_moe_layers(model: nn.Module) -> int:
    """Replace every fusable MoE in ``model`` by an :class:`Int8MoE`; returns how many."""
    n = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, MoE) and can_fuse(mod):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8MoE(mod))
            n += 1
    return n
