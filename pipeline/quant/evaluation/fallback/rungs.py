"""The pieces of the ladder, their rungs and the bytes each rung keeps above int8.

A piece is what takes one type: a linear, or linears runtimes fuse into one (a layer's q_a_proj with its
kv_a_proj_with_mqa; an MLP's, a shared expert's or one routed expert's gate_proj with its up_proj), named by
one rule pattern that matches exactly its members (``model.layers.1.mlp.experts.5.{gate_proj,up_proj}``).
Routed experts are pieces one expert at a time, so a layer's experts need not climb together.

Rungs, from the recipe's type up: W8A8 (static per-tensor int8 activations) -> W8A8_DYNAMIC (per-token int8
activations, the same int8 weight: no byte above int8) -> FLOAT (the weight in the model dtype: one byte
per element above int8 in bf16). A piece the recipe makes W8A8_DYNAMIC starts there.

What a pick writes (:func:`with_ladder`): the linears moved to W8A8_DYNAMIC are the ``include`` of one
W8A8_DYNAMIC rule put first, those kept FLOAT join the ``exclude`` of every rule, and FA3 layers kept bf16
join ``fa_exclude_layers``; the description then types every linear as the pick has it, and the written
recipe reproduces it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import torch

from pipeline.format.description import FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.quant.recipe.linear_rules import LinearRule, default_rules
from pipeline.quant.recipe.recipe import Recipe

RUNGS = (W8A8, W8A8_DYNAMIC, FLOAT)
FUSED_PAIRS = (("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Piece:
    """``key``: the rule pattern naming exactly ``members``; ``kind``: the recipe's type for them;
    ``weights``: their weight elements; ``layer``: the decoder layer; ``attention``: under ``self_attn``."""

    key: str
    members: tuple[str, ...]
    kind: str
    weights: int
    layer: int
    attention: bool

    @property
    def rungs(self) -> tuple[str, ...]:
        """The types it may take, from its recipe type up."""
        return RUNGS[RUNGS.index(self.kind):]

    def extra_bytes(self, rung: str, float_bytes: int = 2) -> int:
        """Bytes of its weights above their int8 form at ``rung``."""
        return self.weights * (float_bytes - 1) if rung == FLOAT else 0


def ladder_pieces(linears: Mapping[str, tuple[str, Mapping[str, torch.Tensor]]]) -> list[Piece]:
    """The pieces of quantized linears ``linears`` (module name -> (type, parameters with ``weight``),
    FakeQuantParams.linears): fused pairs of one type together, every other linear alone, in name order."""
    out, seen = [], set()
    for name in sorted(linears):
        if name in seen:
            continue
        head, _, leaf = name.rpartition(".")
        members = (name,)
        for pair in FUSED_PAIRS:
            if leaf in pair:
                both = tuple(f"{head}.{m}" for m in pair)
                if all(linears.get(m, ("",))[0] == linears[name][0] for m in both):
                    members = both
        seen.update(members)
        key = members[0] if len(members) == 1 else f"{head}.{{{','.join(m.rpartition('.')[2] for m in members)}}}"
        out.append(Piece(key, members, linears[name][0], sum(linears[m][1]["weight"].numel() for m in members),
                         int(name.split(".")[2]), ".self_attn." in name))
    return out


def dynamic_params(kind: str, params: Mapping[str, torch.Tensor], float_weight: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The W8A8_DYNAMIC parameters of a quantized linear (``kind``, ``params`` as FakeQuantParams holds
    them): the same per-channel int8 weight; from its float weight (and bias) when given, as the writer
    quantizes it, else from the stored weight scale (a static layer's ``deq_scale / input_scale`` where it
    stores none) and bias."""
    from pipeline.quant.evaluation.fakequant import QuantLinear
    from pipeline.quant.numerics.qparams import deq_scale_to_float32, quantize_weight_per_channel

    if kind == W8A8_DYNAMIC:
        return dict(params)
    if float_weight is not None:
        q, ws, _ = quantize_weight_per_channel(float_weight, "weight")
        out = {"weight": q, "weight_scale": ws}
    else:
        ws = params.get("weight_scale")
        if ws is None:
            ws = (deq_scale_to_float32(params["deq_scale"]) / params["input_scale"].float()).reshape(-1, 1)
        out = {"weight": params["weight"], "weight_scale": ws}
        bias = QuantLinear(kind, params).dequantized_bias() if bias is None and "bias" in params else bias
    if bias is not None:
        out["bias"] = bias.float()
    return out


def with_ladder(recipe: Recipe, fa_layers: Sequence[int] = (), dynamic: Sequence[str] = (),
                floats: Sequence[str] = ()) -> Recipe:
    """``recipe`` with FA3 layers ``fa_layers`` kept bf16, the linears of patterns ``dynamic`` made
    W8A8_DYNAMIC (one rule put first) and those of ``floats`` kept FLOAT (every rule's exclude)."""
    out = recipe
    if fa_layers:
        out = replace(out, fa_exclude_layers=tuple(sorted(set(out.fa_exclude_layers) | set(fa_layers))))
    if dynamic or floats:
        rules = out.linear_rules or default_rules()
        extra = tuple(sorted(floats))
        rules = tuple(LinearRule(r.kind, r.include, r.exclude + tuple(p for p in extra if p not in r.exclude))
                      for r in rules)
        if dynamic:
            rules = (LinearRule(W8A8_DYNAMIC, tuple(sorted(dynamic)), extra),) + rules
        out = replace(out, linear_rules=rules)
    return out


def rung_bytes(pieces: Sequence[Piece], state: Mapping[str, str], float_bytes: int = 2) -> dict:
    """Per rung, the pieces, linears, weight elements and bytes there (``state``: piece key -> rung,
    the recipe's type where absent); ``above_int8``: the bytes kept above int8."""
    out = {r: {"pieces": 0, "linears": 0, "weights": 0, "bytes": 0} for r in RUNGS}
    extra = 0
    for p in pieces:
        r = state.get(p.key, p.kind)
        row = out[r]
        row["pieces"] += 1
        row["linears"] += len(p.members)
        row["weights"] += p.weights
        row["bytes"] += p.weights * (float_bytes if r == FLOAT else 1)
        extra += p.extra_bytes(r, float_bytes)
    return {"rungs": out, "above_int8": extra}
