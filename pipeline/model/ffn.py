"""Feed-forward blocks: the dense SwiGLU MLP, the noaux_tc sigmoid router, and the MoE.

Router (fp32 throughout, so bf16 weights cannot flip near-ties)::

    s   = sigmoid(x @ Wg.T)                       # [N, E]
    sb  = s + e_score_correction_bias             # selection only
    g_j = sum of the top-2 sb in group j          # n_group groups of E / n_group experts
    keep the topk_group best groups, pick the top num_experts_per_tok experts by sb among them
    w   = s[picked] / sum(s[picked]) * routed_scaling_factor      (normalised when norm_topk_prob)

MoE(x) = sum_k w_k * Expert_k(x) + SharedExperts(x), Expert(x) = down(silu(gate(x)) * up(x)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import DeepseekV3Config


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); x: [..., hidden]."""

    def __init__(self, hidden: int, inter: int, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, inter, **kw)
        self.up_proj = nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The noaux_tc grouped sigmoid router (HF name ``mlp.gate``).

    ``e_score_correction_bias`` is a float32 buffer whatever the model dtype: it only shifts selection
    and is updated outside autograd during training (aux-loss-free balancing).
    """

    def __init__(self, cfg: DeepseekV3Config, device=None, dtype=None):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, device=device, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, device=device, dtype=torch.float32))
        self.n_group, self.topk_group, self.top_k = cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (weights [N, top_k] float32, expert ids [N, top_k] int64)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        N, E = biased.shape
        grouped = biased.view(N, self.n_group, E // self.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)                     # [N, n_group]
        keep = group_score.topk(self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        biased = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(N, E)
        idx = biased.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


def combine_experts(flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, n_experts: int,
                    run_expert) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k weights[:, k] * Expert_idx[:, k](x) over tokens ``flat`` [N, h], in float32: the token slots
    sorted by expert (stable), ``run_expert(e, rows)`` called once per expert with tokens (``rows``: their
    indices into ``flat``) and its results added back in that order. Returns (out float32 [N, h], tokens
    per expert int64 [E])."""
    out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
    load, groups = expert_slots(weights, idx, n_experts)
    for e, _, t, w in groups:
        out.index_add_(0, t, run_expert(e, t).float() * w)
    return out, load


def expert_slots(weights: torch.Tensor, idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list]:
    """The token slots (token, k) grouped by expert in one stable sort: (tokens per expert int64 [E],
    ``[(e, slot indices into the flat [N * k] slots, token indices, slot weights [n, 1])]`` for every
    expert that has tokens, in expert order)."""
    load = torch.bincount(idx.flatten(), minlength=n_experts)
    order = idx.flatten().argsort(stable=True)
    tokens = order // idx.shape[1]
    slot_w = weights.flatten()[order]
    groups, start = [], 0
    for e, n in enumerate(load.tolist()):
        if n:
            groups.append((e, order[start:start + n], tokens[start:start + n], slot_w[start:start + n, None]))
        start += n
    return load, groups


class MoE(nn.Module):
    """Routed experts plus shared experts. After each forward, ``last_load`` holds the number of
    tokens routed to each expert (int64 [E]), for load balancing and statistics."""

    def __init__(self, cfg: DeepseekV3Config, device=None, dtype=None):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg, device=device, dtype=dtype)
        self.experts = nn.ModuleList(MLP(h, inter, device, dtype) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(h, inter * cfg.n_shared_experts, device, dtype) if cfg.n_shared_experts else None
        self.last_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx = self.gate(flat)
        out, self.last_load = combine_experts(flat, weights, idx, len(self.experts),
                                              lambda e, t: self.experts[e](flat[t]))
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
