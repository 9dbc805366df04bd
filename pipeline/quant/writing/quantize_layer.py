"""Quantize one decoder layer (or the globals) into the tensors of the format, in either dialect.

For each module prefix p of ``Recipe.layer_types`` (docs/format.md, "Tensors"):

    W8A8          W8, ws, wo = quantize_weight_per_channel(W);  s, o = static_activation_params(Stats[p])
                  deq_scale, quant_bias = deq_scale_and_quant_bias(s, o, W8, ws)
                  seed:     weight, input_scale, input_offset, quant_bias, deq_scale, weight_scale, weight_offset
                  ascendV1: weight, quant_bias, input_scale, input_offset, deq_scale   (scales float32)
    W8A8_DYNAMIC  weight, weight_scale, weight_offset          (ascendV1: scales float32)
    FAQuant       fa_x.scale = fa_scale(Stats[fa_x]) [R, 1], fa_x.offset int8 zeros; R = heads for fa_q,
                  1 for fa_k and fa_v (ascendV1: scales float32, and a description-only entry
                  ``<layer>.self_attn.quant_type: "INT8"`` that names no tensor)
    FLOAT         as given; ascendV1 writes the router correction bias in md and the MTP-only tensors
                  (embed_tokens, enorm, hnorm, eh_proj, shared_head.*) in float32, as msModelSlim does

deq_scale is float32 when md is bf16, else int64 holding the float32 bit pattern (both dialects).
Returns (tensors, types): ``types`` maps every output tensor name (and, for ascendV1, the quant_type
entry) to its type for quant_model_description.json.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Mapping, Optional

import torch
from torch import Tensor

from pipeline import layout
from pipeline.config import DeepseekV3Config, model_dtype
from pipeline.io.fp8 import BlockRows
from pipeline.format.description import LAYER_ENTRY_SUFFIX, LAYER_QUANT_TYPE
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.numerics.qparams import (
    QuantError, check_float, deq_scale_and_quant_bias, fa_offset, fa_scale,
    quantize_weight_per_channel, static_activation_params,
)
from pipeline.format.description import FAQUANT, FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.recipe_plan import resolve
from pipeline.io.safetensors_io import DTYPE_NAMES, TensorSpec

MTP_ONLY = layout.MTP_ONLY_MODULES
QUANT_TYPE_KEY = LAYER_ENTRY_SUFFIX[1:]          # "self_attn.quant_type"
QUANT_TYPE_INT8 = LAYER_QUANT_TYPE


def _check_tensors(tensors: Mapping[str, Tensor], expected: Mapping[str, tuple], what: str,
                   quantized: frozenset = frozenset()) -> None:
    """Names, shapes, float dtypes, and finiteness except for the ``quantized`` weights, which
    quantize_weight_per_channel checks on its way (and which alone may come as FP8 BlockRows)."""
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected]
    if missing or unexpected:
        raise QuantError(f"{what}: tensors do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for n, shape in expected.items():
        t = tensors[n]
        if isinstance(t, BlockRows) and n not in quantized:
            raise QuantError(f"{n}: an FP8 weight still to dequantize, but it is not quantized here")
        if not isinstance(t, BlockRows):
            check_float(t, n, finite=n not in quantized)
        if tuple(t.shape) != tuple(shape):
            raise QuantError(f"{n}: shape {list(t.shape)} does not match the config ({list(shape)})")


def _scale_out(t: Tensor, ascend: bool) -> Tensor:
    return t.float() if ascend else t


def _w8a8(p: str, w: Tensor, stats: Stats, md: torch.dtype, ascend: bool,
          bias: Optional[Tensor] = None) -> dict[str, Tensor]:
    q, ws, wo = quantize_weight_per_channel(w, p + ".weight")
    mm = stats.minmax(p)
    s, o = static_activation_params(mm.lo, mm.hi, md, p)
    deq, qb = deq_scale_and_quant_bias(s, o, q, ws, bias, name=p)
    if ascend:
        out = {"weight": q, "quant_bias": qb, "input_scale": s.float(), "input_offset": o.float(), "deq_scale": deq}
    else:
        out = {"weight": q, "input_scale": s, "input_offset": o, "quant_bias": qb, "deq_scale": deq,
               "weight_scale": ws, "weight_offset": wo}
    if bias is not None:  # also inside quant_bias: a runtime adds one or the other, never both
        out["bias"] = bias.float()
    return out


def _fa(p: str, stats: Stats, md: torch.dtype, rows: int, ascend: bool) -> dict[str, Tensor]:
    win = stats.window(p)
    if win.rows != rows:
        raise QuantError(f"{p}: statistics have {win.rows} rows, expected {rows}")
    scale = fa_scale(torch.tensor(win.lo, dtype=torch.float64), torch.tensor(win.hi, dtype=torch.float64), md, p)
    return {"scale": _scale_out(scale, ascend), "offset": fa_offset(scale)}


def quantize_layer(cfg: DeepseekV3Config, layer_id: int, tensors: Mapping[str, Tensor], stats: Stats,
                   recipe: Recipe) -> tuple[dict[str, Tensor], dict[str, str]]:
    """One layer's float tensors (HF names, md; the router bias may be float32) -> (tensors, types).
    The weights it quantizes may come as FP8 BlockRows (``CheckpointReader.read_layer(deferred=...)``,
    :func:`deferred_weights`): the result is the same as for their dequantized tensors."""
    out: dict[str, Tensor] = {}
    types: dict[str, str] = {}
    for piece, piece_types in quantize_layer_pieces(cfg, layer_id, tensors, stats, recipe):
        out.update(piece)
        types.update(piece_types)
    return out, types


def quantize_layer_pieces(cfg: DeepseekV3Config, layer_id: int, tensors: Mapping[str, Tensor], stats: Stats,
                          recipe: Recipe) -> Iterator[tuple[dict[str, Tensor], dict[str, str]]]:
    """:func:`quantize_layer`'s result in pieces, in its order, each computed only when asked for: one per
    module, except that the attention's modules (whose format rules pair them: q_a/kv_a, the fa_* group)
    come as one piece. A streaming writer can write each piece while the next is computed. The inputs are
    checked before the first piece."""
    types_of = recipe.layer_types(cfg, layer_id)
    quantized = _per_channel_weights(types_of)
    _check_tensors(tensors, {**layout.layer_shapes(cfg, layer_id), **resolve(recipe, cfg).biases(layer_id)},
                   f"layer {layer_id}", quantized)
    md = model_dtype(cfg)
    ascend = recipe.ascend_dialect
    lp = layout.layer_prefix(layer_id)
    is_mtp = layer_id >= cfg.num_hidden_layers
    names_of: dict[str, list[str]] = {}
    for name in tensors:
        names_of.setdefault(name.rsplit(".", 1)[0], []).append(name)

    def module(p: str, kind: str) -> tuple[dict[str, Tensor], dict[str, str]]:
        if kind in (W8A8, W8A8_DYNAMIC):
            w = tensors[p + ".weight"]
            if w.dtype != md:
                raise QuantError(f"{p}.weight: dtype {w.dtype} is not the model dtype {md}")
            if kind == W8A8:
                parts = _w8a8(p, w, stats, md, ascend, tensors.get(p + ".bias"))
            else:
                q, ws, wo = quantize_weight_per_channel(w, p + ".weight")
                parts = {"weight": q, "weight_scale": _scale_out(ws, ascend), "weight_offset": _scale_out(wo, ascend)}
                if p + ".bias" in tensors:
                    parts["bias"] = tensors[p + ".bias"].float()
        elif kind == FAQUANT:
            parts = _fa(p, stats, md, cfg.num_attention_heads if p.endswith(".fa_q") else 1, ascend)
        else:
            out = {}
            for name in names_of[p]:
                t = tensors[name]
                if is_mtp and p[len(lp):] in MTP_ONLY:
                    t = t.float() if ascend else t.to(md)  # (QuaRot leaves them float32, as msModelSlim)
                elif ascend and name.endswith("e_score_correction_bias"):
                    t = t.to(md)
                out[name] = t
            return out, dict.fromkeys(out, FLOAT)
        out = {f"{p}.{k}": v for k, v in parts.items()}
        types = {n: FLOAT if n.endswith(".bias") else kind for n in out}
        if ascend and p.endswith(".fa_q"):
            types[lp + QUANT_TYPE_KEY] = QUANT_TYPE_INT8
        return out, types

    def piece_key(p: str) -> str:
        return "attention" if p.startswith(lp + "self_attn.") else p

    for _, group in itertools.groupby(types_of.items(), key=lambda item: piece_key(item[0])):
        out: dict[str, Tensor] = {}
        types: dict[str, str] = {}
        for p, kind in group:
            t, ty = module(p, kind)
            out.update(t)
            types.update(ty)
        yield out, types


def deferred_weights(cfg: DeepseekV3Config, layer_id: int, recipe: Recipe,
                     keep: Iterable[str] = frozenset()) -> frozenset[str]:
    """The weights of layer ``layer_id`` that :func:`quantize_layer` quantizes per channel, less those
    in ``keep`` (ones a smoothing fold must change first): the FP8 weights the reader may leave as
    BlockRows."""
    return _per_channel_weights(recipe.layer_types(cfg, layer_id)) - frozenset(keep)


def _per_channel_weights(types_of: Mapping[str, str]) -> frozenset[str]:
    """The ``.weight`` of every module typed W8A8 or W8A8_DYNAMIC."""
    return frozenset(p + ".weight" for p, kind in types_of.items() if kind in (W8A8, W8A8_DYNAMIC))


def quantize_globals(cfg: DeepseekV3Config, tensors: Mapping[str, Tensor],
                     recipe: Recipe) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``: FLOAT, as given (both
    dialects)."""
    recipe.check_config(cfg)
    _check_tensors(tensors, layout.global_shapes(cfg), "globals")
    return dict(tensors), {n: FLOAT for n in tensors}


def layer_output_specs(cfg: DeepseekV3Config, layer_id: Optional[int],
                       inputs: Mapping[str, tuple[torch.dtype, tuple]], recipe: Recipe) -> list[TensorSpec]:
    """What :func:`quantize_layer` (:func:`quantize_globals` for ``layer_id`` None) returns, in its order
    (name, dtype, shape), for input tensors of these dtypes and shapes (what
    ``CheckpointReader.read_specs`` says the reader gives): known before any value exists, so that a
    writer can lay out its shards ahead of the data."""
    if layer_id is None:
        return [TensorSpec(n, DTYPE_NAMES[dt], tuple(shape)) for n, (dt, shape) in inputs.items()]
    md = model_dtype(cfg)
    ascend = recipe.ascend_dialect
    sc = torch.float32 if ascend else md
    deq = torch.float32 if md == torch.bfloat16 else torch.int64
    lp = layout.layer_prefix(layer_id)
    is_mtp = layer_id >= cfg.num_hidden_layers
    names_of: dict[str, list[str]] = {}
    biases = resolve(recipe, cfg).biases(layer_id)
    inputs = {**inputs, **{n: (torch.float32, shape) for n, shape in biases.items()}}
    for name in inputs:
        names_of.setdefault(name.rsplit(".", 1)[0], []).append(name)
    out: list[TensorSpec] = []
    for p, kind in recipe.layer_types(cfg, layer_id).items():
        if kind in (W8A8, W8A8_DYNAMIC):
            n, k = inputs[p + ".weight"][1]
            weight, per_channel = ("weight", torch.int8, (n, k)), [("weight_scale", sc, (n, 1)),
                                                                   ("weight_offset", sc, (n, 1))]
            static = [("input_scale", sc, (1,)), ("input_offset", sc, (1,))]
            qb, dq = ("quant_bias", torch.int32, (n,)), ("deq_scale", deq, (n,))
            if kind == W8A8_DYNAMIC:
                parts = [weight, *per_channel]
            else:
                parts = [weight, qb, *static, dq] if ascend else [weight, *static, qb, dq, *per_channel]
            if p + ".bias" in biases:
                parts.append(("bias", torch.float32, (n,)))
        elif kind == FAQUANT:
            rows = cfg.num_attention_heads if p.endswith(".fa_q") else 1
            parts = [("scale", sc, (rows, 1)), ("offset", torch.int8, (rows, 1))]
        else:
            parts = []
            for name in names_of[p]:
                dt, shape = inputs[name]
                if is_mtp and p[len(lp):] in MTP_ONLY:
                    dt = torch.float32 if ascend else md
                elif ascend and name.endswith("e_score_correction_bias"):
                    dt = md
                out.append(TensorSpec(name, DTYPE_NAMES[dt], tuple(shape)))
        out += [TensorSpec(f"{p}.{leaf}", DTYPE_NAMES[dt], shape) for leaf, dt, shape in parts]
    return out
