"""Where each tensor of the quantized checkpoint lives when one replica is sharded over ranks, and the
bytes each rank holds, from the config alone (the rules of :mod:`pipeline.serving.sharding.plan`'s plan).

Weights. Every tensor the quantizer writes (:func:`pipeline.quant.writing.quantize_layer.layer_output_specs` of
the release's header-only replica, :func:`pipeline.serving.sharding.replica.release_specs`, under ``recipe``: int8
weights with their scale tensors per docs/format.md, FLOAT tensors in the model dtype) is placed on ranks
by one of three rules:

    REP    every rank holds it whole: norms, the router (mlp.gate weight and bias), q_a_proj and
           kv_a_proj_with_mqa (every leaf), the FA3 scales fa_q / fa_k / fa_v (fa_q [heads, 1] too, as
           pipeline.engine.sharding.shard_spec holds it: 3 bytes a head), the MTP layer's eh_proj; and the leaves of a
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

"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.io.checkpoint import SCALE_SUFFIX, read_dtype
from pipeline.io.safetensors_io import itemsize
from pipeline.parallel import ParallelConfig
from pipeline.serving.sharding.replica import release_specs
from pipeline.quant.writing.quantize_layer import layer_output_specs
from pipeline.quant.recipe.recipe import Recipe, kv_bytes_per_token

REP, TP, MOE = "rep", "tp", "moe"
SECTIONS = ("globals", "main", "mtp")
PARTS = ("embedding", "lm_head", "norms", "attention", "dense_mlp", "shared_expert", "router",
         "routed_experts", "mtp_eh_proj")
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
