"""The modules of a sharded replica (pipeline.parallel; which slice each rank holds: shard_spec).

Exact where it is free: a row-parallel int8 linear reduces its int32 products (exact integers) over the
group and runs the epilogue once on the sum, so its output equals the single-rank linear's bit for bit;
a per-token (W8A8_DYNAMIC) one first all-reduces the per-token absmax of its slices (the max is exact),
so every rank quantizes its slice with the single-rank scale. Column-parallel linears are plain smaller
linears (each output column computed as before). The vocab-parallel embedding sums one non-zero row per
token (exact); the vocab-parallel head gathers its slices.

The MoE (:class:`ShardedMoE`): every rank routes every token (the router is whole), the dp groups' tokens
are gathered first (DP-attention: each group holds only its own), each rank runs the experts it holds on
the tokens routed to them, and the results are combined over the world:

- ``reduce`` (the default): each rank sums its experts' weighted outputs per token in float32 and the sums
  are all-reduced: one [tokens, hidden] float32 payload, but the float additions happen in another order
  than on one rank (within float32 rounding);
- ``exact``: each (token, slot) output is all-reduced by itself ([tokens, top_k, hidden]: top_k times the
  bytes) and every rank adds a token's slots in the single-rank order (by expert id): bit-identical.

Every rank routes every token itself, so the ranks must compute the float router identically: the same
kernels and thread count (a CPU GEMM's summation order depends on its thread count; actors.serving.engine.rank_group
gives every rank rank 0's). Float linears (e.g. an MTP layer left in float) split the same way; a row-parallel float
linear reduces float32 partial sums (not exact: within float32 rounding).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.sharding.comm import Comm
from pipeline.engine.int8_arith import quantize_per_token, quantize_with_absmax
from pipeline.engine.layers.qlinear import W8A8DynamicLinear, W8A8StaticLinear
from pipeline.model.ffn import expert_slots

REDUCE, EXACT_COMBINE = "reduce", "exact"
COMBINES = (REDUCE, EXACT_COMBINE)


class RowParallel(nn.Module):
    """``inner`` holds the columns of the rank's input slice; the products are reduced over ``group``."""

    def __init__(self, inner: nn.Module, comm: Comm, group: str):
        super().__init__()
        self.inner, self.comm, self.group = inner, comm, group
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin, shape = self.inner, x.shape
        x2 = x.reshape(-1, shape[-1])
        if isinstance(lin, W8A8StaticLinear):
            acc = self.comm.all_reduce(lin._acc(lin.quantize_input(x2)), self.group)
            y = lin.finish(acc)
        elif isinstance(lin, W8A8DynamicLinear):
            y = self.apply_quantized(*self.quantize(x2))
            if lin.bias is not None:
                y = y + lin.bias.float()
        elif isinstance(lin, nn.Linear):
            y = self.comm.all_reduce(F.linear(x2.float(), lin.weight.float()), self.group)
            if lin.bias is not None:
                y = y + lin.bias.float()
        else:
            raise TypeError(f"RowParallel: cannot split a {type(lin).__name__}")
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token int8 of the rank's slice with the whole row's scale (W8A8_DYNAMIC)."""
        xf = x2.float()
        absmax = self.comm.all_reduce(xf.abs().amax(dim=-1, keepdim=True), self.group, op="max")
        return quantize_with_absmax(xf, absmax)

    def apply_quantized(self, x_q: torch.Tensor, s_tok: torch.Tensor) -> torch.Tensor:
        lin = self.inner
        return lin.finish(self.comm.all_reduce(lin._acc(x_q), self.group), s_tok)


class VocabEmbedding(nn.Module):
    """Rows ``start .. start + n`` of the embedding; the tp group's lookups summed (one non-zero each)."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        local = ids - self.start
        mine = (local >= 0) & (local < n)
        out = F.embedding(local.clamp(0, n - 1), self.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return self.comm.all_reduce(out, "tp")


class VocabHead(nn.Module):
    """The rank's rows of the output head; the logits of the tp group gathered in vocab order."""

    def __init__(self, weight: torch.Tensor, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_tp(F.linear(h, self.weight), dim=-1)


def run_expert_fn(module: nn.Module) -> Callable:
    """``f(x_rows, x_q_rows, s_rows, dtype)`` -> the expert's output rows, for an Int8Expert (quantized
    rows) or a float MLP (float rows)."""
    if hasattr(module, "forward_quantized"):
        return lambda x, x_q, s, dtype: module.forward_quantized(x_q, s, dtype)
    return lambda x, x_q, s, dtype: module(x)


class ShardedMoE(nn.Module):
    """The MoE over expert-parallel ranks (module docstring). ``experts``: expert id -> the module this
    rank holds (its moe_tp slice); ``shared``: the shared expert split over tp, or None."""

    def __init__(self, gate: nn.Module, experts: dict[int, nn.Module], shared: Optional[nn.Module],
                 n_experts: int, comm: Comm, combine: str = REDUCE):
        super().__init__()
        if combine not in COMBINES:
            raise ValueError(f"MoE combine {combine!r}: expected one of {', '.join(COMBINES)}")
        self.gate, self.comm, self.combine, self.n_experts = gate, comm, combine, n_experts
        self.held = nn.ModuleDict({str(e): m for e, m in experts.items()})
        self._run = {e: run_expert_fn(m) for e, m in experts.items()}
        self.shared_experts = shared
        self._shared_run = run_expert_fn(shared) if shared is not None else None
        self.quantized = all(hasattr(m, "forward_quantized") for m in experts.values())
        self.last_load: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype, comm = x.shape, x.dtype, self.comm
        local = x.reshape(-1, shape[-1])
        flat, counts = comm.all_gather_dp(local)
        weights, idx = self.gate(flat)
        x_q, s_tok = quantize_per_token(flat) if self.quantized or self._quantized_shared() else (None, None)
        N, k = idx.shape
        load, groups = expert_slots(weights, idx, self.n_experts)
        contributes = comm.moe_tp_rank == 0        # a moe_tp group computes each output once
        exact = self.combine == EXACT_COMBINE
        out = torch.zeros((N * k if exact else N, shape[-1]), dtype=torch.float32, device=flat.device)
        for e, slots, t, w in groups:
            if e not in self._run:
                continue
            y = self._run[e](flat[t], None if x_q is None else x_q[t], None if s_tok is None else s_tok[t],
                             dtype).float() * w
            if contributes:
                if exact:
                    out[slots] = y
                else:
                    out.index_add_(0, t, y)
        comm.all_reduce(out, "world")
        if exact:                                   # each token's slots added in expert order, from zero
            slots = out.view(N, k, -1).gather(1, idx.argsort(dim=1).unsqueeze(-1).expand(N, k, shape[-1]))
            out = torch.zeros((N, shape[-1]), dtype=torch.float32, device=flat.device)
            for j in range(k):
                out += slots[:, j]
        a = sum(counts[:comm.parallel.dp_rank(comm.rank)])
        out = out[a:a + local.shape[0]].to(dtype)
        self.last_load = load
        if self.shared_experts is not None:
            rows = slice(a, a + local.shape[0])
            out = out + self._shared_run(local, None if x_q is None else x_q[rows],
                                         None if s_tok is None else s_tok[rows], dtype)
        return out.view(shape)

    def _quantized_shared(self) -> bool:
        return self.shared_experts is not None and hasattr(self.shared_experts, "forward_quantized")
