"""One replica of the quantized model sharded over ranks, on paper: per-rank weight bytes, KV capacity in
tokens and the bytes a decode step communicates, from the config alone (no weight read, no compute).

The layout is :class:`pipeline.parallel.ParallelConfig`'s (``world = dp * tp = moe_ep * moe_tp``).

Weights: every tensor is placed by :mod:`pipeline.serving.sharding.placement`'s rules (REP, TP, MOE; its module
doc), which also give the bytes each rank holds.

KV cache. Each tp rank of a dp group holds the whole latent cache of that group's sequences (the latent is
one per token, not per head), so a group's capacity is what one of its ranks can hold and the replica's
is ``dp`` times that::

    room   = floor(device_bytes * usable_fraction) - weights of the rank - reserve_bytes
    tokens = room // kv_bytes_per_token      (per dp group)

``kv_bytes_per_token`` is :func:`pipeline.quant.recipe.recipe.kv_bytes_per_token`: 512 + 64 * 2 = 640 B on an FA3
layer, (512 + 64) * 2 = 1152 B on a layer without FA3; the MTP layer has a cache of its own and gets FA3
only when the recipe quantizes it (``quantize_mtp``), so the default recipe's V3 figure is
61 * 640 + 1152 = 40192 B and ``quantize_mtp`` gives 62 * 640 = 39680 B; the all-bf16 comparison is
62 * 1152 = 71424 B. ``reserve_bytes`` (default 4 GB per rank) stands for the runtime context, the
communication buffers and the activations of a step (decode batches, prefill chunks up to ~2k tokens per
dp group). A layout fits when its weights leave room, per dp group, for at least ``min_kv_tokens``
(default 4096: one 4k-token sequence; the model's 163840-token maximum is reported, not required).

Communication: :mod:`pipeline.serving.sharding.collectives` (every collective of a decode step, bytes per rank per
token of the step).

Units: GB = 10^9 bytes throughout (the devices' nominal capacities are read as decimal GB, which the
devices exceed slightly: the figures are on the safe side).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from pipeline.config import DeepseekV3Config
from pipeline.parallel import ParallelConfig
# the rules and the communication, also under this module's name (pipeline.serving.sharding.plan.placement, ...)
from pipeline.serving.sharding.collectives import COMBINES, Collective, comm_totals, decode_collectives  # noqa: F401
from pipeline.serving.sharding.placement import (MOE, PARTS, REP, SECTIONS, TP, Bucket, Placement, _sections,  # noqa: F401
                                     bucket_share, check_splits, kind_of, kv_per_token, model_buckets,
                                     model_bytes, placement, rank_weights, tensor_share)
from pipeline.quant.recipe.recipe import Recipe

GB = 10 ** 9
GiB = 1024 ** 3
USABLE_FRACTION = 0.9
RESERVE_BYTES = 4 * GB
MIN_KV_TOKENS = 4096
RANKS_PER_NODE = 8          # a tp group is packed on one node; suggestions keep tp <= this


# ----- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardingPlan:
    name: str
    device: str
    parallel: dict                       # ParallelConfig.to_dict()
    world: int
    device_bytes: int
    usable_fraction: float
    reserve_bytes: int
    min_kv_tokens: int
    recipe: dict
    mtp: bool
    model_bytes: int                     # the whole quantized model (sections loaded)
    rank_bytes: tuple[int, ...]          # resident weight bytes of each rank
    weight_bytes: int                    # the largest rank's
    replicated_bytes: int                # of which whole on every rank (kind_of: "replicated")
    split_bytes: int                     # of which its share of the tp-split parts and of the experts
    tp_share_bytes: int                  # of which its share of the tp-split parts (kind_of: "tp")
    expert_bytes: int                    # of which its routed experts (kind_of: "moe")
    sections: dict                       # globals / main / mtp -> bytes on the largest rank
    parts: dict                          # part -> bytes on the largest rank
    kv_bytes_per_token: int              # all layers, MTP included (recipe)
    kv_bytes_per_token_bf16: int
    kv_room_bytes: int                   # per rank, may be negative
    kv_tokens_per_group: int
    kv_tokens: int                       # the replica: dp x per group
    kv_tokens_bf16_per_group: int
    kv_tokens_bf16: int
    max_seq_len: int
    max_len_seqs_per_group: int          # sequences of max_position_embeddings tokens a group can hold
    collectives: tuple[Collective, ...]
    comm: dict                           # comm_totals
    fits: bool
    refusal: Optional[str] = None

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * self.usable_fraction)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rank_bytes"] = list(self.rank_bytes)
        d["collectives"] = [c.to_dict() for c in self.collectives]
        d["usable_bytes"] = self.usable_bytes
        return d


def _fit(cfg, parallel, device_bytes, recipe, usable_fraction, reserve_bytes, mtp) -> tuple[int, int]:
    """(kv tokens per group, largest rank's weight bytes) for a candidate layout, rank 0 only (all ranks
    hold the same bytes when the splits are even)."""
    w = sum(rank_weights(cfg, parallel, 0, recipe, mtp).values())
    room = int(device_bytes * usable_fraction) - w - reserve_bytes
    return max(room, 0) // kv_per_token(cfg, recipe, mtp)[0], w


def _candidates(cfg: DeepseekV3Config, world: int, max_tp: int) -> list[ParallelConfig]:
    """Layouts of ``world`` ranks the model splits evenly, tp <= max_tp: for each tp, the largest moe_ep."""
    out = []
    for tp in (d for d in range(1, min(world, max_tp) + 1) if world % d == 0):
        for moe_ep in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
            try:
                p = ParallelConfig(tp=tp, dp=world // tp, moe_ep=moe_ep)
                p.check_config(cfg)
            except ValueError:
                continue
            out.append(p)
            break
    return out


def suggest(cfg: DeepseekV3Config, parallel: ParallelConfig, device_bytes: int, recipe: Optional[Recipe] = None,
            usable_fraction: float = USABLE_FRACTION, reserve_bytes: int = RESERVE_BYTES,
            min_kv_tokens: int = MIN_KV_TOKENS, mtp: bool = True, max_tp: int = RANKS_PER_NODE,
            max_world: int = 1024) -> Optional[tuple[ParallelConfig, int]]:
    """The fitting layout to change to, with its KV tokens per dp group: of ``parallel``'s world size if
    one fits (the most replica KV tokens), else of the smallest world that fits; None if none up to
    ``max_world``."""
    worlds = [parallel.world] + [w for w in range(parallel.world + 1, max_world + 1)
                                 if w % min(max_tp, 8) == 0 or (w & (w - 1)) == 0]
    for w in worlds:
        best = None
        for p in _candidates(cfg, w, max(max_tp, 1)):
            tokens, _ = _fit(cfg, p, device_bytes, recipe, usable_fraction, reserve_bytes, mtp)
            if tokens >= min_kv_tokens and (best is None or tokens * p.dp > best[1] * best[0].dp):
                best = (p, tokens)
        if best is not None:
            return best
    return None


def _layout(p: ParallelConfig) -> str:
    return f"dp {p.dp} x tp {p.tp}, moe_ep {p.moe_ep} x moe_tp {p.moe_tp}"


def _refusal(cfg, parallel, device_bytes, recipe, usable_fraction, reserve_bytes, min_kv_tokens, mtp,
             weights, replicated, tp_share, experts, tokens, max_tp) -> str:
    usable = int(device_bytes * usable_fraction)
    if weights + reserve_bytes > usable:
        what = (f"weights {weights / GB:.1f} GB per rank exceed the usable {usable / GB:.1f} GB "
                f"({usable_fraction:g} x {device_bytes / GB:.0f} GB) minus the {reserve_bytes / GB:.1f} GB reserve")
    else:
        what = (f"weights {weights / GB:.1f} GB per rank leave room for {tokens} KV tokens per dp group, less "
                f"than the minimum {min_kv_tokens} (one {min_kv_tokens}-token sequence)")
    levers = (f"of the rank's weights, the routed experts ({experts / GB:.1f} GB) shrink only with more ranks "
              f"(1/world of them per rank, E / moe_ep experts per expert group each split over moe_tp), the "
              f"tp-split parts (attention heads, dense MLP, shared expert, embeddings, lm_head: "
              f"{tp_share / GB:.1f} GB) with a larger tp, the replicated parts ({replicated / GB:.1f} GB) not at all")
    s = suggest(cfg, parallel, device_bytes, recipe, usable_fraction, reserve_bytes, min_kv_tokens, mtp, max_tp)
    if s is None:
        fix = "no layout of up to 1024 such devices fits: use a device with more memory"
    elif s[0].world == parallel.world:
        fix = (f"keep {parallel.world} ranks and change the layout to {_layout(s[0])} ({s[1]} KV tokens per dp "
               f"group)")
    else:
        more = (" with a larger moe_ep" if s[0].moe_ep > parallel.moe_ep else "")
        fix = (f"use more ranks{more}: at least {s[0].world} of these devices, e.g. {_layout(s[0])} "
               f"({s[1]} KV tokens per dp group)")
    return (f"layout {_layout(parallel)} on {parallel.world} x {device_bytes / GB:.0f} GB does not fit: {what}; "
            f"{levers}; {fix}")


def plan_sharding(cfg: DeepseekV3Config, parallel: ParallelConfig, device_bytes: int, *,
                  recipe: Optional[Recipe] = None, usable_fraction: float = USABLE_FRACTION,
                  reserve_bytes: int = RESERVE_BYTES, min_kv_tokens: int = MIN_KV_TOKENS, mtp: bool = True,
                  ranks_per_node: Optional[int] = None, name: str = "", device: str = "") -> ShardingPlan:
    """The sharded replica on paper (module doc). A layout the shapes cannot split raises ValueError; one
    that does not fit the device is returned with ``fits=False`` and ``refusal`` (see :func:`check_fits`)."""
    recipe = recipe or Recipe()
    if isinstance(device_bytes, bool) or not isinstance(device_bytes, int) or device_bytes <= 0:
        raise ValueError(f"device_bytes must be a positive integer, got {device_bytes!r}")
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
    if reserve_bytes < 0 or min_kv_tokens < 1:
        raise ValueError(f"reserve_bytes must be >= 0 and min_kv_tokens >= 1, got {reserve_bytes}, {min_kv_tokens}")
    check_splits(cfg, parallel, recipe, mtp)
    per_rank = [rank_weights(cfg, parallel, r, recipe, mtp) for r in range(parallel.world)]
    totals = [sum(d.values()) for d in per_rank]
    top = per_rank[max(range(parallel.world), key=lambda r: totals[r])]
    weights = max(totals)
    sections = {s: sum(v for (sec, _, _), v in top.items() if sec == s) for s in _sections(mtp)}
    parts = {p: sum(v for (_, part, _), v in top.items() if part == p) for p in PARTS}
    parts = {p: v for p, v in parts.items() if v}
    replicated = sum(v for (_, _, kind), v in top.items() if kind == "replicated")
    tp_share = sum(v for (_, _, kind), v in top.items() if kind == TP)
    experts = weights - replicated - tp_share
    kv_tok, kv_bf16 = kv_per_token(cfg, recipe, mtp)
    room = int(device_bytes * usable_fraction) - weights - reserve_bytes
    tokens = max(room, 0) // kv_tok
    tokens_bf16 = max(room, 0) // kv_bf16
    colls = decode_collectives(cfg, parallel, recipe, mtp, ranks_per_node)
    fits = tokens >= min_kv_tokens
    refusal = None
    if not fits:
        refusal = _refusal(cfg, parallel, device_bytes, recipe, usable_fraction, reserve_bytes, min_kv_tokens,
                           mtp, weights, replicated, tp_share, experts, tokens, ranks_per_node or RANKS_PER_NODE)
    return ShardingPlan(
        name=name or _layout(parallel), device=device, parallel=parallel.to_dict(), world=parallel.world,
        device_bytes=device_bytes, usable_fraction=usable_fraction, reserve_bytes=reserve_bytes,
        min_kv_tokens=min_kv_tokens, recipe=recipe.to_dict(), mtp=mtp, model_bytes=model_bytes(cfg, recipe, mtp),
        rank_bytes=tuple(totals), weight_bytes=weights, replicated_bytes=replicated,
        split_bytes=weights - replicated, tp_share_bytes=tp_share, expert_bytes=experts, sections=sections,
        parts=parts, kv_bytes_per_token=kv_tok, kv_bytes_per_token_bf16=kv_bf16, kv_room_bytes=room,
        kv_tokens_per_group=tokens, kv_tokens=tokens * parallel.dp, kv_tokens_bf16_per_group=tokens_bf16,
        kv_tokens_bf16=tokens_bf16 * parallel.dp,
        max_seq_len=cfg.max_position_embeddings, max_len_seqs_per_group=tokens // cfg.max_position_embeddings,
        collectives=tuple(colls), comm=comm_totals(colls), fits=fits, refusal=refusal)


def check_fits(plan_or_cfg: Union[ShardingPlan, DeepseekV3Config], *args: Any, **kwargs: Any) -> ShardingPlan:
    """A plan that fits, else ValueError with the refusal (what does not fit and what to change). Takes a
    :class:`ShardingPlan`, or :func:`plan_sharding`'s arguments."""
    plan = plan_or_cfg if isinstance(plan_or_cfg, ShardingPlan) else plan_sharding(plan_or_cfg, *args, **kwargs)
    if not plan.fits:
        raise ValueError(plan.refusal)
    return plan


# ----- the layouts tabulated ----------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    name: str
    device: str
    device_bytes: int
    parallel: ParallelConfig
    ranks_per_node: int = RANKS_PER_NODE


LAYOUTS: tuple[Layout, ...] = (
    Layout("MindIE seed: 2 nodes x 8 Ascend 910B", "Ascend 910B 64 GB", 64 * GB,
           ParallelConfig(tp=8, dp=2, moe_ep=4, moe_tp=4)),
    Layout("8 x H200, tp 8, moe_ep 8", "H200 141 GB", 141 * GB, ParallelConfig(tp=8, dp=1, moe_ep=8, moe_tp=1)),
    Layout("8 x H200, DP-attention dp 8, moe_ep 8", "H200 141 GB", 141 * GB,
           ParallelConfig(tp=1, dp=8, moe_ep=8, moe_tp=1)),
    Layout("2 nodes x 8 H100, dp 2 x tp 8, moe_ep 16", "H100 80 GB", 80 * GB,
           ParallelConfig(tp=8, dp=2, moe_ep=16, moe_tp=1)),
    Layout("8 x H100, tp 8, moe_ep 8", "H100 80 GB", 80 * GB, ParallelConfig(tp=8, dp=1, moe_ep=8, moe_tp=1)),
    Layout("1 x H200", "H200 141 GB", 141 * GB, ParallelConfig()),
)


def plan_layout(cfg: DeepseekV3Config, lay: Layout, **kwargs: Any) -> ShardingPlan:
    return plan_sharding(cfg, lay.parallel, lay.device_bytes, ranks_per_node=lay.ranks_per_node, name=lay.name,
                         device=lay.device, **kwargs)


# ----- the table ----------------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / GB:,.1f}"


def _tok(n: int) -> str:
    return f"{n:,}" if n < 10 ** 6 else f"{n / 1e6:,.2f} M"


def _kb(n: float) -> str:
    return f"{n / 1e3:,.0f}"


def to_markdown(rows: Sequence[ShardingPlan], collectives: bool = True) -> str:
    """The plans as markdown: one summary table, then (``collectives``) each fitting layout's decode-step
    collectives, then the refusals."""
    lines = [
        "| layout | ranks: dp x tp / moe_ep x moe_tp | weights / rank GB (replicated + tp share + experts) "
        "| KV room / rank GB "
        "| KV tokens / dp group (FA3) | replica KV tokens (FA3) | replica KV tokens (bf16 latent) "
        "| 163840-token seqs / group | comm / token / rank KB, reduce: payload (ring) | exact: payload (ring) "
        "| of which inter-node (ring, reduce / exact) | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.parallel
        red, ex = r.comm["reduce"], r.comm["exact"]
        lines.append(
            f"| {r.name} ({r.device}) | {r.world}: {p['dp']} x {p['tp']} / {p['moe_ep']} x {p['moe_tp']} "
            f"| {_gb(r.weight_bytes)} ({_gb(r.replicated_bytes)} + {_gb(r.tp_share_bytes)} + {_gb(r.expert_bytes)}) "
            f"| {_gb(r.kv_room_bytes)} "
            f"| {_tok(r.kv_tokens_per_group)} | {_tok(r.kv_tokens)} | {_tok(r.kv_tokens_bf16)} "
            f"| {r.max_len_seqs_per_group} | {_kb(red['payload'])} ({_kb(red['moved'])}) "
            f"| {_kb(ex['payload'])} ({_kb(ex['moved'])}) "
            f"| {_kb(red['moved_inter_node'])} / {_kb(ex['moved_inter_node'])} "
            f"| {'yes' if r.fits else '**refused**'} |")
    if collectives:
        for r in rows:
            if not r.fits or not r.collectives:
                continue
            lines += ["", f"**{r.name}**: collectives of a decode step, bytes per rank per token of the step",
                      "", "| where | op | dtype, shape | group (n) | calls / step | payload B | ring B | inter-node |",
                      "|---|---|---|---|---|---|---|---|"]
            for c in r.collectives:
                mode = f" ({c.combine})" if c.combine else ""
                lines.append(f"| {c.where}{mode} | {c.op} | {c.dtype} {c.shape} | {c.group} ({c.group_size}) "
                             f"| {c.calls_per_step} | {c.payload_bytes:,.0f} | {c.moved_bytes:,.0f} "
                             f"| {'yes' if c.inter_node else 'no'} |")
    refused = [r for r in rows if not r.fits]
    if refused:
        lines += ["", "Refused:", ""] + [f"- **{r.name}**: {r.refusal}" for r in refused]
    return "\n".join(lines) + "\n"
