"""The collectives of one decode step of a sharded replica, on paper: what each moves, per rank and per
token of the step (:func:`decode_collectives`; :mod:`pipeline.serving.sharding.plan` sums them into a plan).

Communication (:func:`decode_collectives`). A decode step with ``t`` tokens in each dp group (``dp * t``
in the replica); every figure is bytes per rank per token of the step (divided by ``dp * t``), as the
collective's payload (the tensor reduced, or the gathered result) and as what a ring moves per rank:
all-reduce ``2 (n - 1) / n x payload``, all-gather ``(n - 1) / n x`` the gathered payload. A collective
over a group of one rank is not issued. Per token through the model (the MTP layer, with its embedding
and head, counted as one more pass of every token through it):

    embedding     all-reduce SUM bf16 [t, hidden] over tp (vocab-parallel lookup; main and MTP)
    attention     o_proj row-parallel: all-reduce SUM int32 [t, hidden] over tp (its int32 products,
                  exact); a dynamic (per-token) o_proj (its type in ``recipe.layer_types``) first
                  all-reduces MAX its float32 per-token absmax [t]
    dense MLP     down_proj row-parallel (W8A8_DYNAMIC): MAX float32 [t], then SUM int32 [t, hidden], tp
    MoE layer     shared expert's down_proj as the dense MLP's; dispatch (dp > 1): all-gather bf16
                  [t, hidden] of every dp group over the dp peers (every rank then holds all dp * t
                  tokens: each tp rank of a group already holds the group's; the engine also gathers
                  the groups' row counts, 8 B each, not counted); moe_tp > 1: for each expert with
                  tokens, its down_proj's MAX float32 [slots] and SUM int32 [slots, hidden] over moe_tp,
                  where the slots of a rank's expert group are dp * t * top_k / moe_ep in expectation
                  (uniform routing), over at most min(E / moe_ep, that) experts (``calls_per_step`` is
                  that bound); combine (world > 1; only moe_tp rank 0 of each expert group contributes,
                  as pipeline.engine.sharding.sharded.ShardedMoE does): ``reduce`` all-reduces float32
                  [dp * t, hidden] over the world, ``exact`` float32 [dp * t, top_k, hidden] (each token
                  slot's output kept apart and added in a fixed order afterwards)
    lm_head       vocab-parallel: all-gather float32 logits [t, vocab] over tp (main and MTP heads)

Batch metadata (one broadcast per step) and the sampled tokens are not counted (tens of bytes per
sequence). Activations are taken in bf16, as on an accelerator; the CPU engine runs them in float32,
which doubles the embedding and dispatch payloads there. With ``ranks_per_node``, a collective whose
group spans nodes is marked ``inter_node`` (its whole ring traffic counted so, an upper bound on what
crosses the node boundary).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.format.description import W8A8_DYNAMIC
from pipeline.parallel import ParallelConfig
from pipeline.quant.recipe.recipe import Recipe

COMBINES = ("reduce", "exact")


# ----- communication ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    where: str                   # "attention o_proj", "MoE combine", ...
    op: str                      # "all-reduce SUM", "all-reduce MAX", "all-gather"
    dtype: str                   # bf16 / int32 / float32
    shape: str                   # the per-step tensor, e.g. "[t, 7168]"
    group: str                   # tp / dp peers / moe_tp / world
    group_size: int
    calls_per_step: int          # collectives issued per step (layers x experts)
    payload_bytes: float         # per rank per token of the step (module doc)
    moved_bytes: float           # per rank per token of the step, ring algorithm
    inter_node: bool
    combine: Optional[str] = None  # "reduce" / "exact" for the MoE combine, else None (both modes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ring(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op.startswith("all-reduce") else (n - 1) / n


def _spans_nodes(groups: Sequence[Sequence[int]], ranks_per_node: Optional[int]) -> bool:
    return bool(ranks_per_node) and any(len({r // ranks_per_node for r in g}) > 1 for g in groups)


def decode_collectives(cfg: DeepseekV3Config, parallel: ParallelConfig, recipe: Optional[Recipe] = None,
                       mtp: bool = True, ranks_per_node: Optional[int] = None) -> list[Collective]:
    """Every collective of a decode step (module doc), bytes per rank per token of the step."""
    recipe = recipe or Recipe()
    P, h, V, k = parallel, cfg.hidden_size, cfg.vocab_size, cfg.num_experts_per_tok
    step_tokens = P.dp  # one token per dp group; every payload below is per step, divided by this
    ids = layout.all_layer_ids(cfg) if mtp else list(range(cfg.num_hidden_layers))
    moe = [i for i in ids if cfg.is_moe_layer(i)]
    dense = [i for i in ids if not cfg.is_moe_layer(i)]
    heads = 1 + (len(cfg.mtp_layer_ids) if mtp else 0)  # embeddings and lm_heads
    world = list(range(P.world))
    tp_groups = [P.tp_group(d * P.tp) for d in range(P.dp)]
    dp_groups = [P.dp_peers(r) for r in range(P.tp)]
    moe_tp_groups = [P.moe_tp_group(e * P.moe_tp) for e in range(P.moe_ep)]
    groups = {"tp": (P.tp, tp_groups), "dp peers": (P.dp, dp_groups), "moe_tp": (P.moe_tp, moe_tp_groups),
              "world": (P.world, [world])}
    out: list[Collective] = []

    def add(where, op, dtype, shape, group, calls, step_payload, combine=None):
        n, gs = groups[group]
        if n == 1 or calls == 0:
            return
        payload = step_payload * calls / step_tokens
        out.append(Collective(where, op, dtype, shape, group, n, calls, payload, payload * _ring(op, n),
                              _spans_nodes(gs, ranks_per_node), combine))

    o_dynamic = [i for i in ids if recipe.layer_types(cfg, i).get(layout.layer_prefix(i) + "self_attn.o_proj")
                 == W8A8_DYNAMIC]
    add("embedding (vocab-parallel)", "all-reduce SUM", "bf16", f"[t, {h}]", "tp", heads, 2 * h)
    if o_dynamic:
        add("attention o_proj absmax", "all-reduce MAX", "float32", "[t]", "tp", len(o_dynamic), 4)
    add("attention o_proj", "all-reduce SUM", "int32", f"[t, {h}]", "tp", len(ids), 4 * h)
    add("dense MLP down_proj absmax", "all-reduce MAX", "float32", "[t]", "tp", len(dense), 4)
    add("dense MLP down_proj", "all-reduce SUM", "int32", f"[t, {h}]", "tp", len(dense), 4 * h)
    if cfg.n_shared_experts:
        add("shared expert down_proj absmax", "all-reduce MAX", "float32", "[t]", "tp", len(moe), 4)
        add("shared expert down_proj", "all-reduce SUM", "int32", f"[t, {h}]", "tp", len(moe), 4 * h)
    if moe:
        add("MoE dispatch (DP-attention gather)", "all-gather", "bf16", f"[dp*t, {h}]", "dp peers", len(moe),
            P.dp * 2 * h)
        slots = P.dp * k / P.moe_ep  # token slots of one expert group per step, uniform routing
        hit = min(cfg.n_routed_experts // P.moe_ep, math.ceil(slots))  # its experts with tokens, at most
        add("expert down_proj absmax (per expert)", "all-reduce MAX", "float32", "[slots]", "moe_tp",
            len(moe) * hit, 4 * slots / hit)
        add("expert down_proj (per expert)", "all-reduce SUM", "int32", f"[slots, {h}]", "moe_tp",
            len(moe) * hit, 4 * h * slots / hit)
        add("MoE combine", "all-reduce SUM", "float32", f"[dp*t, {h}]", "world", len(moe), P.dp * 4 * h, "reduce")
        add("MoE combine", "all-reduce SUM", "float32", f"[dp*t, {k}, {h}]", "world", len(moe),
            P.dp * 4 * k * h, "exact")
    add("lm_head logits (vocab-parallel)", "all-gather", "float32", f"[t, {V}]", "tp", heads, 4 * V)
    return out


def comm_totals(collectives: Sequence[Collective]) -> dict[str, dict[str, float]]:
    """combine mode -> {payload, moved, moved_inter_node, calls}: bytes per rank per token of the step."""
    out = {}
    for mode in COMBINES:
        cs = [c for c in collectives if c.combine in (None, mode)]
        out[mode] = {"payload": sum(c.payload_bytes for c in cs), "moved": sum(c.moved_bytes for c in cs),
                     "moved_inter_node": sum(c.moved_bytes for c in cs if c.inter_node),
                     "calls": sum(c.calls_per_step for c in cs)}
    return out
