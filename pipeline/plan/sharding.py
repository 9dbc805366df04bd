"""One replica of the quantized model sharded over ranks, on paper: per-rank weight bytes, KV capacity in
tokens and the bytes a decode step communicates, from the config alone (no weight read, no compute).

The layout is :class:`pipeline.parallel.ParallelConfig`'s (``world = dp * tp = moe_ep * moe_tp``).

Weights. Every tensor the quantizer writes (:func:`pipeline.quant.quantize_layer.layer_output_specs` of
the release's header-only replica, :func:`pipeline.plan.replica.release_specs`, under ``recipe``: int8
weights with their scale tensors per docs/format.md, FLOAT tensors in the model dtype) is placed on ranks
by one of three rules:

    REP    every rank holds it whole: norms, the router (mlp.gate weight and bias), q_a_proj and
           kv_a_proj_with_mqa (every leaf), the FA3 scales fa_q / fa_k / fa_v (fa_q [heads, 1] too, as
           pipeline.engine.shard_spec holds it: 3 bytes a head), the MTP layer's eh_proj; and the leaves of a
           split linear that the split does not cut (below). Held ``world`` times in the replica.
    TP     split over the ``tp`` ranks of a dp group, one copy per dp group (``dp`` copies):
           column-parallel q_b_proj, kv_b_proj, gate_proj / up_proj of the dense MLP and of the shared
           expert: the weight and its per-output-channel leaves (weight_scale, weight_offset, quant_bias,
           deq_scale) cut on dim 0, input_scale / input_offset [1] replicated; row-parallel o_proj and
           down_proj: the weight cut on dim 1 (the input width), every other leaf (per output channel,
           [hidden]) replicated; embed_tokens, lm_head and the MTP layer's
           embed_tokens / shared_head.head vocab-parallel (dim 0).
    MOE    routed expert e of every MoE layer lives on the ``moe_tp`` ranks of expert group
           ``e // (E / moe_ep)`` only (one copy in the replica), cut over moe_tp as a TP linear is over
           tp (gate/up dim 0, down dim 1; down's per-channel scales replicated in the moe_tp group).

Sections: ``globals`` (embed_tokens, model.norm, lm_head), ``main`` (layers 0..60), ``mtp`` (layer 61,
with its own embedding and head); ``mtp=False`` leaves the MTP layer out (not loaded, no cache).

KV cache. Each tp rank of a dp group holds the whole latent cache of that group's sequences (the latent is
one per token, not per head), so a group's capacity is what one of its ranks can hold and the replica's
is ``dp`` times that::

    room   = floor(device_bytes * usable_fraction) - weights of the rank - reserve_bytes
    tokens = room // kv_bytes_per_token      (per dp group)

``kv_bytes_per_token`` is :func:`pipeline.quant.recipe.kv_bytes_per_token`: 512 + 64 * 2 = 640 B on an FA3
layer, (512 + 64) * 2 = 1152 B on a layer without FA3; the MTP layer has a cache of its own and gets FA3
only when the recipe quantizes it (``quantize_mtp``), so the default recipe's V3 figure is
61 * 640 + 1152 = 40192 B and ``quantize_mtp`` gives 62 * 640 = 39680 B; the all-bf16 comparison is
62 * 1152 = 71424 B. ``reserve_bytes`` (default 4 GB per rank) stands for the runtime context, the
communication buffers and the activations of a step (decode batches, prefill chunks up to ~2k tokens per
dp group). A layout fits when its weights leave room, per dp group, for at least ``min_kv_tokens``
(default 4096: one 4k-token sequence; the model's 163840-token maximum is reported, not required).

Communication (:func:`decode_collectives`). A decode step with ``t`` tokens in each dp group (``dp * t``
in the replica); every figure is bytes per rank per token of the step (divided by ``dp * t``), as the
collective's payload (the tensor reduced, or the gathered result) and as what a ring moves per rank:
all-reduce ``2 (n - 1) / n x payload``, all-gather ``(n - 1) / n x`` the gathered payload. A collective
over a group of one rank is not issued. Per token through the model (the MTP layer, with its embedding
and head, counted as one more pass of every token through it):

    embedding     all-reduce SUM bf16 [t, hidden] over tp (vocab-parallel lookup; main and MTP)
    attention     o_proj row-parallel: all-reduce SUM int32 [t, hidden] over tp (its int32 products,
                  exact); a dynamic (per-token) o_proj (``recipe.dynamic``) first all-reduces MAX its
                  float32 per-token absmax [t]
    dense MLP     down_proj row-parallel (W8A8_DYNAMIC): MAX float32 [t], then SUM int32 [t, hidden], tp
    MoE layer     shared expert's down_proj as the dense MLP's; dispatch (dp > 1): all-gather bf16
                  [t, hidden] of every dp group over the dp peers (every rank then holds all dp * t
                  tokens: each tp rank of a group already holds the group's; the engine also gathers
                  the groups' row counts, 8 B each, not counted); moe_tp > 1: for each expert with
                  tokens, its down_proj's MAX float32 [slots] and SUM int32 [slots, hidden] over moe_tp,
                  where the slots of a rank's expert group are dp * t * top_k / moe_ep in expectation
                  (uniform routing), over at most min(E / moe_ep, that) experts (``calls_per_step`` is
                  that bound); combine (world > 1; only moe_tp rank 0 of each expert group contributes,
                  as pipeline.engine.sharded.ShardedMoE does): ``reduce`` all-reduces float32
                  [dp * t, hidden] over the world, ``exact`` float32 [dp * t, top_k, hidden] (each token
                  slot's output kept apart and added in a fixed order afterwards)
    lm_head       vocab-parallel: all-gather float32 logits [t, vocab] over tp (main and MTP heads)

Batch metadata (one broadcast per step) and the sampled tokens are not counted (tens of bytes per
sequence). Activations are taken in bf16, as on an accelerator; the CPU engine runs them in float32,
which doubles the embedding and dispatch payloads there. With ``ranks_per_node``, a collective whose
group spans nodes is marked ``inter_node`` (its whole ring traffic counted so, an upper bound on what
crosses the node boundary).

Units: GB = 10^9 bytes throughout (the devices' nominal capacities are read as decimal GB, which the
devices exceed slightly: the figures are on the safe side).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.io.checkpoint import SCALE_SUFFIX, read_dtype
from pipeline.io.safetensors_io import itemsize
from pipeline.parallel import ParallelConfig
from pipeline.plan.replica import release_specs
from pipeline.quant.quantize_layer import layer_output_specs
from pipeline.quant.recipe import Recipe, kv_bytes_per_token

GB = 10 ** 9
GiB = 1024 ** 3
USABLE_FRACTION = 0.9
RESERVE_BYTES = 4 * GB
MIN_KV_TOKENS = 4096
RANKS_PER_NODE = 8          # a tp group is packed on one node; suggestions keep tp <= this

REP, TP, MOE = "rep", "tp", "moe"
SECTIONS = ("globals", "main", "mtp")
PARTS = ("embedding", "lm_head", "norms", "attention", "dense_mlp", "shared_expert", "router",
         "routed_experts", "mtp_eh_proj")
COMBINES = ("reduce", "exact")
_COLUMN = ("q_b_proj", "q_proj", "kv_b_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_PER_TENSOR = ("input_scale", "input_offset")


# ----- the tensors and where they go --------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    section: str                 # globals / main / mtp
    part: str                    # one of PARTS
    rule: str                    # REP / TP / MOE
    split_dim: Optional[int]     # the dim cut over tp (TP) or moe_tp (MOE); None: whole in its group
    expert: Optional[int] = None  # MOE only


def _linear_split(module: str, leaf: str) -> Optional[int]:
    """The dim a column- or row-parallel linear's leaf is cut on (None: the leaf is whole on every rank
    of the split group)."""
    if module in _COLUMN:
        return None if leaf in _PER_TENSOR else 0
    if module in _ROW:
        return 1 if leaf == "weight" else None
    raise ValueError(f"{module} is not a split linear")


def placement(cfg: DeepseekV3Config, name: str) -> Placement:
    """Where tensor ``name`` of the quantized checkpoint lives (module doc); ValueError for a name that
    is not part of the model."""
    lid = layout.layer_of(name)
    if lid is None:
        if name.startswith("model.embed_tokens."):
            return Placement("globals", "embedding", TP, 0)
        if name.startswith("lm_head."):
            return Placement("globals", "lm_head", TP, 0)
        if name.startswith("model.norm."):
            return Placement("globals", "norms", REP, None)
        raise ValueError(f"tensor {name!r} is not part of the model")
    section = "mtp" if lid >= cfg.num_hidden_layers else "main"
    module, leaf = name[len(layout.layer_prefix(lid)):].rsplit(".", 1)
    last = module.rsplit(".", 1)[-1]
    if last.endswith("norm") or module == "shared_head.norm":
        return Placement(section, "norms", REP, None)
    if module == "embed_tokens":
        return Placement(section, "embedding", TP, 0)
    if module == "shared_head.head":
        return Placement(section, "lm_head", TP, 0)
    if module == "eh_proj":
        return Placement(section, "mtp_eh_proj", REP, None)
    if module.startswith("self_attn."):
        if last in ("q_a_proj", "kv_a_proj_with_mqa", "fa_q", "fa_k", "fa_v"):
            return Placement(section, "attention", REP, None)
        if last in _COLUMN or last in _ROW:
            return Placement(section, "attention", TP, _linear_split(last, leaf))
    elif module == "mlp.gate":
        return Placement(section, "router", REP, None)
    elif module.startswith("mlp.experts.") and last in _COLUMN + _ROW:
        return Placement(section, "routed_experts", MOE, _linear_split(last, leaf), int(module.split(".")[2]))
    elif module.startswith("mlp.shared_experts.") and last in _COLUMN + _ROW:
        return Placement(section, "shared_expert", TP, _linear_split(last, leaf))
    elif module.startswith("mlp.") and last in _COLUMN + _ROW:
        return Placement(section, "dense_mlp", TP, _linear_split(last, leaf))
    raise ValueError(f"tensor {name!r}: no sharding rule for module {module!r}")


@dataclass(frozen=True)
class Bucket:
    """Tensors that share a placement and the length of the dim they are cut on: their bytes split alike."""
    placement: Placement
    split_len: int               # the cut dim's length (0 when split_dim is None)
    nbytes: int
    tensors: int
    example: str                 # one tensor's name, for messages


def _quantized_specs(cfg: DeepseekV3Config, recipe: Recipe) -> list:
    """Every tensor the quantizer writes for the release's layout, in order (globals, then each layer)."""
    rel = {s.name: s for s in release_specs(cfg) if not s.name.endswith(SCALE_SUFFIX)}

    def inputs(names):
        return {n: (read_dtype(n, rel[n].dtype, cfg.torch_dtype), tuple(rel[n].shape)) for n in names}

    out = list(layer_output_specs(cfg, None, inputs(layout.global_shapes(cfg)), recipe))
    for lid in layout.all_layer_ids(cfg):
        out += layer_output_specs(cfg, lid, inputs(layout.layer_shapes(cfg, lid)), recipe)
    return out


@functools.lru_cache(maxsize=16)
def _buckets_cached(cfg_json: str, recipe: Recipe) -> tuple[Bucket, ...]:
    cfg = DeepseekV3Config.from_dict(json.loads(cfg_json))
    acc: dict[tuple, list] = {}
    for s in _quantized_specs(cfg, recipe):
        p = placement(cfg, s.name)
        key = (p, s.shape[p.split_dim] if p.split_dim is not None else 0)
        a = acc.setdefault(key, [0, 0, s.name])
        a[0] += math.prod(s.shape) * itemsize(s.dtype)
        a[1] += 1
    return tuple(Bucket(p, n, b, k, ex) for (p, n), (b, k, ex) in acc.items())


def model_buckets(cfg: DeepseekV3Config, recipe: Optional[Recipe] = None) -> tuple[Bucket, ...]:
    """The quantized model's tensors grouped by placement (cached per config and recipe)."""
    return _buckets_cached(json.dumps(cfg.to_dict(), sort_keys=True), recipe or Recipe())


def _sections(mtp: bool) -> tuple[str, ...]:
    return SECTIONS if mtp else ("globals", "main")


def check_splits(cfg: DeepseekV3Config, parallel: ParallelConfig, recipe: Optional[Recipe] = None,
                 mtp: bool = True) -> None:
    """The model's shapes must split evenly under ``parallel``; ValueError naming the size and the fix."""
    parallel.check_config(cfg)
    for b in model_buckets(cfg, recipe):
        if b.placement.section not in _sections(mtp) or b.placement.split_dim is None:
            continue
        name, k = ("tp", parallel.tp) if b.placement.rule == TP else ("moe_tp", parallel.moe_tp)
        if b.split_len % k:
            raise ValueError(f"parallel config: {name} {k} does not divide dim {b.placement.split_dim} "
                             f"({b.split_len}) of {b.example}; choose {name} among the divisors of {b.split_len}")


def bucket_share(b: Bucket, parallel: ParallelConfig, rank: int, n_experts: int) -> int:
    """Bytes of bucket ``b`` that ``rank`` holds (after :func:`check_splits`)."""
    p = b.placement
    if p.rule == REP:
        return b.nbytes
    if p.rule == TP:
        return b.nbytes // parallel.tp if p.split_dim is not None else b.nbytes
    per = n_experts // parallel.moe_ep
    if not parallel.ep_rank(rank) * per <= p.expert < (parallel.ep_rank(rank) + 1) * per:
        return 0
    return b.nbytes // parallel.moe_tp if p.split_dim is not None else b.nbytes


def tensor_share(cfg: DeepseekV3Config, parallel: ParallelConfig, rank: int, name: str, shape: Sequence[int],
                 nbytes: int) -> int:
    """Bytes of one tensor (``name``, ``shape``, ``nbytes`` in all) that ``rank`` holds."""
    p = placement(cfg, name)
    b = Bucket(p, shape[p.split_dim] if p.split_dim is not None else 0, nbytes, 1, name)
    return bucket_share(b, parallel, rank, cfg.n_routed_experts)


def kind_of(p: Placement) -> str:
    """``replicated`` (whole on every rank: REP, or a leaf a tp split does not cut), ``tp`` (a tp share)
    or ``moe`` (owned experts, their moe_tp share)."""
    if p.rule == MOE:
        return MOE
    return TP if p.rule == TP and p.split_dim is not None else "replicated"


def rank_weights(cfg: DeepseekV3Config, parallel: ParallelConfig, rank: int, recipe: Optional[Recipe] = None,
                 mtp: bool = True) -> dict[tuple[str, str, str], int]:
    """(section, part, kind) -> bytes that ``rank`` holds (after :func:`check_splits`; kind: :func:`kind_of`)."""
    out: dict[tuple[str, str, str], int] = {}
    for b in model_buckets(cfg, recipe):
        p = b.placement
        if p.section not in _sections(mtp):
            continue
        share = bucket_share(b, parallel, rank, cfg.n_routed_experts)
        if share:
            key = (p.section, p.part, kind_of(p))
            out[key] = out.get(key, 0) + share
    return out


def kv_per_token(cfg: DeepseekV3Config, recipe: Optional[Recipe] = None, mtp: bool = True) -> tuple[int, int]:
    """(bytes of KV cache per token over every cached layer under ``recipe``, the same all in bf16)."""
    per_layer, _ = kv_bytes_per_token(cfg, recipe or Recipe())
    ids = [i for i in per_layer if mtp or i < cfg.num_hidden_layers]
    return sum(per_layer[i] for i in ids), len(ids) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2


def model_bytes(cfg: DeepseekV3Config, recipe: Optional[Recipe] = None, mtp: bool = True) -> int:
    """Bytes of the whole quantized model (the sections loaded)."""
    return sum(b.nbytes for b in model_buckets(cfg, recipe) if b.placement.section in _sections(mtp))


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

    o_dynamic = recipe.dynamic
    add("embedding (vocab-parallel)", "all-reduce SUM", "bf16", f"[t, {h}]", "tp", heads, 2 * h)
    if o_dynamic:
        add("attention o_proj absmax", "all-reduce MAX", "float32", "[t]", "tp", len(ids), 4)
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
