"""The subgraphs msModelSlim's anti-outlier steps (iter_smooth, flex_smooth_quant) smooth in a DeepSeek layer.

A subgraph is a producer whose output channels can absorb a per-channel factor and the linears that read
those channels (msModelSlim's DeepSeek-V3 adapter, ``get_adapter_config_for_subgraph``)::

    ov           kv_b_proj (its value rows, head by head)   -> o_proj
    norm-linear  input_layernorm                             -> q_a_proj (or q_proj), kv_a_proj_with_mqa
    norm-linear  self_attn.q_a_layernorm                     -> q_b_proj            (when q_lora_rank)
    up-down      mlp.up_proj                                 -> mlp.down_proj        (dense layers)
                 mlp.shared_experts.up_proj                  -> its down_proj        (MoE layers)
                 mlp.experts.{e}.up_proj                     -> its down_proj        (every routed expert)

in that order, for every main layer; the MTP layer is never smoothed (msModelSlim leaves it out). A step
keeps the subgraphs whose type is in its ``enable_subgraph_type`` and whose *source* module name (the
producer: ``model.layers.0.input_layernorm``, ``model.layers.0.self_attn.kv_b_proj``, ...) passes its
``include`` / ``exclude`` patterns (pipeline.quant.recipe.patterns), then smooths them by priority: up-down,
ov, linear-linear, norm-linear (a stable sort, so the order above breaks ties). The statistics of a
subgraph are those of the input of its first target (``observed``); DeepSeek has no linear-linear
subgraph, the type is accepted because recipes may name it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.quant.recipe.patterns import check_patterns, selected
from pipeline.quant.numerics.qparams import QuantError

log = logging.getLogger(__name__)
NORM_LINEAR, LINEAR_LINEAR, OV, UP_DOWN = "norm-linear", "linear-linear", "ov", "up-down"
SUBGRAPH_TYPES = (NORM_LINEAR, LINEAR_LINEAR, OV, UP_DOWN)   # msModelSlim's default enable_subgraph_type
PRIORITY = {UP_DOWN: 1, OV: 2, LINEAR_LINEAR: 3, NORM_LINEAR: 4}


@dataclass(frozen=True)
class Subgraph:
    """``kind`` one of SUBGRAPH_TYPES; ``source`` the producer's module name; ``targets`` the linears fed."""

    kind: str
    source: str
    targets: tuple[str, ...]

    @property
    def observed(self) -> str:
        """The module whose input the step observes (msModelSlim reads the first target's only)."""
        return self.targets[0]

    @property
    def routed_expert(self) -> bool:
        """An up-down of a routed expert: one that may see no token (then msModelSlim skips it)."""
        return ".mlp.experts." in self.source


def layer_subgraphs(cfg: DeepseekV3Config, layer_id: int) -> list[Subgraph]:
    """Every subgraph of layer ``layer_id`` in msModelSlim's order (none for an MTP layer)."""
    if not 0 <= layer_id < cfg.num_hidden_layers:
        return []
    p = layout.layer_prefix(layer_id)
    a = p + "self_attn."
    q_in = a + ("q_a_proj" if cfg.q_lora_rank else "q_proj")
    out = [Subgraph(OV, a + "kv_b_proj", (a + "o_proj",)),
           Subgraph(NORM_LINEAR, p + "input_layernorm", (q_in, a + "kv_a_proj_with_mqa"))]
    if cfg.q_lora_rank:
        out.append(Subgraph(NORM_LINEAR, a + "q_a_layernorm", (a + "q_b_proj",)))
    if cfg.is_moe_layer(layer_id):
        mlps = ([p + "mlp.shared_experts."] if cfg.n_shared_experts else []) + [
            f"{p}mlp.experts.{e}." for e in range(cfg.n_routed_experts)]
    else:
        mlps = [p + "mlp."]
    out += [Subgraph(UP_DOWN, m + "up_proj", (m + "down_proj",)) for m in mlps]
    return out


def check_subgraph_types(types, where: str) -> tuple[str, ...]:
    """A recipe's ``enable_subgraph_type`` as a tuple, or QuantError naming ``where`` and the bad entry."""
    if isinstance(types, str) or not isinstance(types, (list, tuple)):
        raise QuantError(f"{where}: expected a list of subgraph types, got {type(types).__name__}")
    for t in types:
        if t not in SUBGRAPH_TYPES:
            raise QuantError(f"{where}: unknown subgraph type {t!r}; use any of {list(SUBGRAPH_TYPES)}")
    return tuple(types)


def select_subgraphs(subgraphs: Sequence[Subgraph], enable: Sequence[str], include: Optional[Sequence[str]],
                     exclude: Optional[Sequence[str]]) -> list[Subgraph]:
    """The subgraphs a step smooths, in the order it smooths them (see the module docstring)."""
    enable = check_subgraph_types(enable, "enable_subgraph_type")
    include, exclude = check_patterns(include, "include"), check_patterns(exclude, "exclude")
    kept = [s for s in subgraphs if s.kind in enable and selected(s.source, include, exclude)]
    return sorted(kept, key=lambda s: PRIORITY[s.kind])


def step_subgraphs(step: Any, cfg: DeepseekV3Config, layer_id: int) -> list[Subgraph]:
    """The subgraphs of layer ``layer_id`` that ``step`` (a recipe step with ``enable_subgraph_type``,
    ``include`` and ``exclude``: pipeline.quant.recipe.steps.IterSmooth / FlexSmooth) smooths, in its order."""
    return select_subgraphs(layer_subgraphs(cfg, layer_id), step.enable_subgraph_type, step.include, step.exclude)


def subgraph_weights(subgraphs: Sequence[Subgraph]) -> frozenset[str]:
    """The tensors (``.weight`` names) smoothing these subgraphs may rewrite: what a reader must hand over
    in the model dtype rather than defer (FP8 weights read later)."""
    return frozenset(n + ".weight" for s in subgraphs for n in (s.source, *s.targets))


# ----- MLA value rows ---------------------------------------------------------------------------------
def value_rows(kv_b_weight: torch.Tensor, heads: int, nope: int, v: int,
               name: str = "kv_b_proj.weight") -> torch.Tensor:
    """The value rows of kv_b_proj [H * (nope + v), C] as [H * v, C] (head-major: what o_proj's input
    columns multiply), a copy."""
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != heads * (nope + v):
        raise QuantError(f"{name}: expected [{heads * (nope + v)}, C] for {heads} heads of {nope} + {v} rows, "
                         f"got {list(kv_b_weight.shape)}")
    return kv_b_weight.view(heads, nope + v, -1)[:, nope:].reshape(heads * v, -1).clone()


def with_value_rows(kv_b_weight: torch.Tensor, rows: torch.Tensor, heads: int, nope: int, v: int) -> torch.Tensor:
    """kv_b_proj's weight with its value rows replaced by ``rows`` [H * v, C] (a new tensor)."""
    out = kv_b_weight.clone()
    out.view(heads, nope + v, -1)[:, nope:] = rows.view(heads, v, -1)
    return out


# ----- applying a step to a layer ---------------------------------------------------------------------
# norm-linear: (subgraph, the layer's tensors so far, its statistics) -> the tensors to replace or add
NormRule = Callable[[Subgraph, Mapping[str, torch.Tensor], Any], dict]
# ov / up-down: (subgraph, producer rows P [k, C], consumer W [n, k], its statistics) -> (new P, new W)
PairRule = Callable[[Subgraph, torch.Tensor, torch.Tensor, Any], tuple]


def need(tensors: Mapping[str, torch.Tensor], name: str, step: str) -> torch.Tensor:
    if name not in tensors:
        raise QuantError(f"{step}: tensor {name} is missing from the layer")
    return tensors[name]


def smooth_subgraphs(step: str, tensors: Mapping[str, torch.Tensor], cfg: DeepseekV3Config,
                     subgraphs: Sequence[Subgraph], stats: Mapping[str, Any], norm_rule: NormRule,
                     pair_rule: PairRule) -> dict[str, torch.Tensor]:
    """A layer's HF-named tensors with ``subgraphs`` smoothed in order: a new dict, untouched tensors shared.
    ``stats`` maps each subgraph's observed module to its observer (``samples`` 0: nothing seen). A routed
    expert that saw no token is left as it is (msModelSlim skips it); any other missing statistic is an
    error."""
    out = dict(tensors)
    for sg in subgraphs:
        obs = stats.get(sg.observed)
        if obs is None or not obs.samples:
            if sg.routed_expert:
                log.info("%s: %s saw no token; left unsmoothed", step, sg.observed)
                continue
            raise QuantError(f"{step}: no statistics for {sg.observed} (subgraph {sg.kind} of {sg.source})")
        if sg.kind == NORM_LINEAR:
            out.update(norm_rule(sg, out, obs))
        elif sg.kind == OV:
            kv_b, o = sg.source + ".weight", sg.observed + ".weight"
            H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            rows, out[o] = pair_rule(sg, value_rows(need(out, kv_b, step), H, dn, dv, kv_b), need(out, o, step), obs)
            out[kv_b] = with_value_rows(out[kv_b], rows, H, dn, dv)
        elif sg.kind == UP_DOWN:
            up, down = sg.source + ".weight", sg.observed + ".weight"
            out[up], out[down] = pair_rule(sg, need(out, up, step), need(out, down, step), obs)
        else:  # DeepSeek has no linear-linear subgraph (layer_subgraphs never lists one)
            raise QuantError(f"{step}: subgraph type {sg.kind} has no rule")
    return out
