"""What each quantized piece costs, measured: the FA3 latent of each layer and each quantized linear, ranked,
and the smallest fallback set that meets an accuracy target. What ``--fa-fallback`` / ``--linear-fallback``
choose from.

Inputs: the float model as the recipe quantizes it (smoothed when the recipe smooths; any float dtype,
float32 is what is measured in), the recipe's fake-quant parameters (:class:`FakeQuantParams`: from the
calibration statistics with :meth:`FakeQuantParams.from_stats`, or from a written output with
:meth:`FakeQuantParams.from_dir`), and token samples (the calibration samples, each run alone). The
quantized pieces are installed on the float model itself for a measurement and removed after
(:func:`quantized`), so nothing is copied.

Costs (``method``):
    "kl"    end to end: only that piece quantized (one layer's int8 latent, or one linear), everything else
            float; the mean KL(float || that model) of the next-token distributions over the samples, and
            the top-1 agreement with float. One pass over the samples per piece.
    "sqnr"  the cheap proxy, one pass for all pieces: on the float model's own forward, each piece's output
            against its quantized output on the same input. Per FA3 layer: the attention output with the
            int8 latent against the float latent, ranked by that error against the residual stream it is
            added to (``residual_sqnr_db``; the attention's and the latent's own SQNR come too). Per linear:
            its output SQNR.
    "residual" (linears) per piece, its block (attention or MLP) rerun on the float input with only that
            piece quantized: the block output's error against the residual stream (``residual_sqnr_db``).
            One block forward per piece and sample, no full passes.
Proxies are ranked by SQNR, lowest (most costly) first; ``score`` is the noise-to-signal ratio 10^(-SQNR/10).
Both return :class:`Cost` lists, most costly first. The proxy's ranking can be checked against "kl" with
:func:`rank_correlation` (Spearman); benchmarks/accuracy_variants.json reports it for the embedded model
and its outlier variants.

The fallback pick (:func:`smallest_fallback`) meets a :class:`Target`: agreement >= ``min_agreement``,
mean KL <= ``max_kl``, perplexity change <= ``max_ppl_delta_pct``, every layer's attention SQNR >=
``min_attn_sqnr_db``, every given bound at once. The attention bound is per layer and a layer's attention
output (measured on the float residual) depends on that layer's pieces alone, so it is met first, layer by
layer, from the attention blocks (:func:`attention_fallback`: each layer below the bound gives up its own
pieces in ranked order until it meets it). Then the other pieces in ranked order: the shortest prefix whose
fallback, with those the attention asked for (pieces left float / their latent bf16, every other piece
quantized), meets the whole target. It assumes the figures improve as more pieces fall back (true of the
ranked prefixes in practice, not guaranteed): it checks the forced set alone and everything, then bisects,
about log2(n) + 2 full passes over the samples, and returns every evaluation it made. When even all falling
back misses the target (the other kind's pieces may be the problem), ``met`` is False and the set is all of
them.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from pipeline.config import model_dtype
from pipeline.model import DeepseekV3ForCausalLM
from pipeline.quant.evaluation.fakequant import QuantLinear, fa3_latent

Key = Union[int, str]       # an FA3 layer id or a linear's module name


# ----- the recipe's fake-quant parameters ------------------------------------------------------------
@dataclass
class FakeQuantParams:
    """module name -> (W8A8 or W8A8_DYNAMIC, QuantLinear parameters); layer id -> fa_k latent scale."""

    linears: dict[str, tuple[str, dict[str, torch.Tensor]]] = field(default_factory=dict)
    fa_k: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_stats(cls, model: DeepseekV3ForCausalLM, stats, recipe) -> "FakeQuantParams":
        """What the quantizer would write for ``model`` (its own weights, in the config's dtype) from
        calibration ``stats`` (pipeline.quant.numerics.observers.Stats) under ``recipe``."""
        from pipeline.quant.writing.quantize_layer import quantize_layer

        cfg = model.config
        md = model_dtype(cfg)
        out = cls()
        for layer in model.model.layers:
            i = layer.layer_id
            p = f"model.layers.{i}."
            tensors = {p + k: (v if k.endswith("e_score_correction_bias") else v.to(md))
                       for k, v in layer.state_dict().items()}
            q, types = quantize_layer(cfg, i, tensors, stats, recipe)
            out._add(q, types)
        return out

    @classmethod
    def from_dir(cls, path: str) -> "FakeQuantParams":
        """The parameters of a written output (any dialect)."""
        from pipeline.format.reader import read_quantized

        _, types, tensors = read_quantized(path)
        out = cls()
        out._add(tensors, types)
        return out

    def _add(self, tensors: Mapping[str, torch.Tensor], types: Mapping[str, str]) -> None:
        from pipeline.format.description import FAQUANT, QUANT_KINDS

        for name, kind in types.items():
            if kind in QUANT_KINDS and name.endswith(".weight"):
                prefix = name[: -len(".weight")]
                self.linears[prefix] = (kind, {k[len(prefix) + 1:]: v for k, v in tensors.items()
                                               if k.startswith(prefix + ".") and k.count(".") == prefix.count(".") + 1})
            elif kind == FAQUANT and name.endswith("self_attn.fa_k.scale"):
                self.fa_k[int(name.split(".")[2])] = tensors[name]

    def only(self, linears: Sequence[str] = (), fa: Sequence[int] = ()) -> "FakeQuantParams":
        return FakeQuantParams({k: self.linears[k] for k in linears}, {i: self.fa_k[i] for i in fa})

    def without(self, linears: Sequence[str] = (), fa: Sequence[int] = ()) -> "FakeQuantParams":
        return FakeQuantParams({k: v for k, v in self.linears.items() if k not in set(linears)},
                               {i: v for i, v in self.fa_k.items() if i not in set(fa)})


@contextmanager
def quantized(model: DeepseekV3ForCausalLM, params: FakeQuantParams) -> Iterator[DeepseekV3ForCausalLM]:
    """``model`` with ``params``' linears swapped for QuantLinears and their latents through int8, restored
    on exit."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    with ExitStack() as stack:
        for name, (kind, p) in params.linears.items():
            parent_name, child = name.rsplit(".", 1)
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
            if not isinstance(old, nn.Linear):
                raise ValueError(f"{name}: no float linear to quantize in the model")
            setattr(parent, child, QuantLinear(kind, {k: v.to(old.weight.device) for k, v in p.items()}))
            swapped.append((parent, child, old))
        stack.callback(lambda: [setattr(pa, ch, o) for pa, ch, o in reversed(swapped)])
        for i, s in params.fa_k.items():
            norm = model.model.layers[i].self_attn.kv_a_layernorm
            h = norm.register_forward_hook(lambda mod, args, out, s=s: fa3_latent(out, s))
            stack.callback(h.remove)
        yield model


# ----- the float reference and end-to-end figures ---------------------------------------------------
@dataclass
class Metrics:
    """End-to-end figures of one measurement; with the attention captured (FloatReference), the lowest
    per-layer attention SQNR (``min_attn_sqnr_db``, inf when no layer has any error) and its layer."""

    agreement: float
    kl_mean: float
    kl_p99: float
    ppl_delta_pct: float
    tokens: int
    min_attn_sqnr_db: Optional[float] = None
    min_attn_layer: Optional[int] = None

    def to_dict(self) -> dict:
        out = {"agreement": self.agreement, "kl_mean": self.kl_mean, "kl_p99": self.kl_p99,
               "ppl_delta_pct": self.ppl_delta_pct, "tokens": self.tokens}
        if self.min_attn_sqnr_db is not None:      # JSON has no inf: no error is written as null
            out["min_attn_sqnr_db"] = self.min_attn_sqnr_db if math.isfinite(self.min_attn_sqnr_db) else None
            out["min_attn_layer"] = self.min_attn_layer
        return out


class FloatReference:
    """The float model's next-token log-probabilities on each sample (kept: every measurement compares
    with them; memory tokens x vocab x 4 bytes). ``model`` is what the pieces are installed on; the
    log-probabilities come from ``reference`` when given (the source's float model, where ``model`` is a
    written output's dequantized model: pipeline.quant.evaluation.fallback), else from ``model`` itself.

    With ``attention``, the float model's residual input, (cos, sin) and output of every attention block
    (the MTP layer's too, when both models have one) are kept as well (memory 2 x tokens x hidden x 4 bytes
    per layer), and each measurement adds the per-layer attention SQNR that pipeline.quant.evaluation.evaluate reports
    as ``attn_sqnr_db``: the float residual input through the measured model's block, against the float
    block's output."""

    def __init__(self, model: DeepseekV3ForCausalLM, samples: Sequence[Sequence[int]],
                 reference: Optional[DeepseekV3ForCausalLM] = None, attention: bool = False):
        from pipeline.quant.evaluation.evaluate import FloatCapture

        if not samples or any(len(s) < 2 for s in samples):
            raise ValueError("samples: need at least one sample, each of two tokens or more")
        self.model = model
        self.ids = [torch.tensor([list(s)], device=model.lm_head.weight.device) for s in samples]
        ref_model = model if reference is None else reference
        mtp = bool(model.mtp_layers) and bool(ref_model.mtp_layers)
        self.logp, self.attn = [], []
        with torch.no_grad():
            for x in self.ids:
                cap = FloatCapture(ref_model)
                with ExitStack() as stack:
                    if attention:
                        stack.enter_context(cap)
                    logits, hidden = ref_model(x[:, :-1], return_hidden=True)
                    if attention and mtp and x.shape[1] > 2:
                        ref_model.mtp(hidden[:, :-1], x[:, 1:-1])
                self.logp.append(logits.float().log_softmax(-1))
                if attention:
                    self.attn.append({i: (cap.h_in[i], cap.rope[i], cap.attn[i]) for i in cap.attn})
        self.nll = sum(-lp.gather(-1, x[:, 1:, None]).sum().item() for lp, x in zip(self.logp, self.ids))
        self.tokens = sum(x.shape[1] - 1 for x in self.ids)

    @torch.no_grad()
    def measure(self, params: FakeQuantParams) -> Metrics:
        """Agreement, KL and perplexity change of the model with ``params`` installed."""
        kls, agree, nll = [], 0, 0.0
        with quantized(self.model, params) as m:
            for x, ref in zip(self.ids, self.logp):
                lp = m(x[:, :-1]).float().log_softmax(-1)
                kls.append((ref.exp() * (ref - lp)).sum(-1).flatten().clamp_min(0))
                agree += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
                nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
            sqnr = self._attention_errors()
        kl = torch.cat(kls).double()
        worst = min(sqnr, key=lambda i: (_db(sqnr[i]), i)) if sqnr else None
        return Metrics(agree / self.tokens, kl.mean().item(), torch.quantile(kl, 0.99).item(),
                       100 * (math.exp((nll - self.nll) / self.tokens) - 1), self.tokens,
                       _db(sqnr[worst]) if sqnr else None, worst)

    @torch.no_grad()
    def attention_sqnr(self, params: FakeQuantParams, layers: Optional[Sequence[int]] = None) -> dict[int, float]:
        """Per decoder layer (``layers``, default every one): the attention SQNR :meth:`measure` reports, from
        the attention blocks alone (no full pass)."""
        if not self.attn:
            raise ValueError("attention_sqnr: measure with a FloatReference(..., attention=True)")
        with quantized(self.model, params):
            return {i: _db(a) for i, a in self._attention_errors(layers).items()}

    def _attention_errors(self, only: Optional[Sequence[int]] = None) -> dict[int, list]:
        """[signal, noise] energies per layer of the isolated attention blocks, with what is installed now."""
        from pipeline.quant.evaluation.evaluate import isolated_attention

        rot = getattr(self.model, "global_rotation", None)
        layers = {layer.layer_id: layer for layer in self.model.model.layers
                  if only is None or layer.layer_id in only}
        out: dict[int, list] = {}
        for per_sample in self.attn:
            for i, (h, rope, ref) in per_sample.items():
                if i in layers:
                    _acc(out.setdefault(i, [0.0, 0.0]), ref, isolated_attention(layers[i], h, rope, rot))
        return out


# ----- costs ---------------------------------------------------------------------------------------------
@dataclass
class Cost:
    """One piece's measured cost. ``score``: what the ranking sorts on, larger = more costly (KL for "kl",
    the noise-to-signal ratio for "sqnr")."""

    key: Key
    method: str
    score: float
    figures: dict

    def to_dict(self) -> dict:
        return {"key": self.key, "method": self.method, "score": self.score, **self.figures}


def _ranked(costs: list[Cost]) -> list[Cost]:
    return sorted(costs, key=lambda c: (-c.score, str(c.key)))


def _nsr(db: float) -> float:
    return 10 ** (-db / 10) if math.isfinite(db) else 0.0


def fa3_costs(ref: FloatReference, params: FakeQuantParams, method: str = "kl",
              progress: Optional[Callable[[Key], None]] = None) -> list[Cost]:
    """Each FA3 layer's cost (module doc), most costly first."""
    layers = sorted(params.fa_k)
    if method == "kl":
        out = []
        for i in layers:
            m = ref.measure(params.only(fa=[i]))
            out.append(Cost(i, method, m.kl_mean, m.to_dict()))
            if progress:
                progress(i)
        return _ranked(out)
    if method != "sqnr":
        raise ValueError(f"method: {method!r}, expected 'kl' or 'sqnr'")
    attn = {i: [0.0, 0.0] for i in layers}
    lat = {i: [0.0, 0.0] for i in layers}
    resid = {i: [0.0, 0.0] for i in layers}
    h_in: dict[int, torch.Tensor] = {}
    model = ref.model
    hooks = []

    def attn_hook(i):
        def hook(mod, args, out):
            seen = {}
            s = params.fa_k[i]

            def q(m_, a_, o_):
                seen["c"] = o_
                seen["q"] = fa3_latent(o_, s)
                return seen["q"]
            h = mod.kv_a_layernorm.register_forward_hook(q)
            try:
                got = mod.forward(*args)          # not mod(...): that would call this hook again
            finally:
                h.remove()
            _acc(attn[i], out, got)
            _acc(lat[i], seen["c"], seen["q"])
            h = h_in[i].float() + out.float()
            _acc(resid[i], h, h - out.float() + got.float())
        return hook
    for i in layers:
        layer = model.model.layers[i]
        hooks.append(layer.input_layernorm.register_forward_pre_hook(
            lambda mod, args, i=i: h_in.__setitem__(i, args[0])))
        hooks.append(layer.self_attn.register_forward_hook(attn_hook(i)))
    try:
        _float_passes(model, ref.ids, layers)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i in layers:
        a, c, r = _db(attn[i]), _db(lat[i]), _db(resid[i])
        out.append(Cost(i, method, _nsr(r), {"residual_sqnr_db": r, "attn_sqnr_db": a, "latent_sqnr_db": c}))
    return _ranked(out)


def linear_costs(ref: FloatReference, params: FakeQuantParams, method: str = "sqnr",
                 groups: Optional[Mapping[str, Sequence[str]]] = None,
                 progress: Optional[Callable[[Key], None]] = None) -> list[Cost]:
    """Each quantized linear's (or each group's, ``groups``: name -> module names) cost (module doc),
    most costly first."""
    groups = dict(groups) if groups is not None else {n: [n] for n in params.linears}
    missing = [n for g in groups.values() for n in g if n not in params.linears]
    if missing:
        raise ValueError(f"groups: {missing[:4]} are not quantized linears of the recipe")
    if method == "kl":
        out = []
        for g, names in groups.items():
            m = ref.measure(params.only(linears=names))
            out.append(Cost(g, method, m.kl_mean, m.to_dict()))
            if progress:
                progress(g)
        return _ranked(out)
    if method == "residual":
        return _ranked(_block_costs(ref, params, groups))
    if method != "sqnr":
        raise ValueError(f"method: {method!r}, expected 'kl', 'sqnr' or 'residual'")
    acc = {n: [0.0, 0.0] for ns in groups.values() for n in ns}
    model = ref.model
    quant = {n: QuantLinear(*params.linears[n]) for n in acc}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: _acc(acc[n], out, quant[n](args[0]))) for n in acc]
    layers = sorted({int(n.split(".")[2]) for n in acc})
    try:
        _float_passes(model, ref.ids, layers)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for g, names in groups.items():
        db = _db([sum(acc[n][0] for n in names), sum(acc[n][1] for n in names)])
        out.append(Cost(g, method, _nsr(db), {"sqnr_db": db, "linears": len(names)}))
    return _ranked(out)


@torch.no_grad()
def _block_costs(ref: FloatReference, params: FakeQuantParams, groups: Mapping[str, Sequence[str]]) -> list[Cost]:
    """Per group: its block (the attention or the MLP holding it) rerun on the float block input with only
    the group quantized; the block output's error against the residual stream it is added to."""
    model = ref.model
    layers = sorted({int(n.split(".")[2]) for ns in groups.values() for n in ns})
    seen: dict[tuple[int, str], list] = {}
    h_in: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layers:
        layer = model.model.layers[i]
        hooks.append(layer.input_layernorm.register_forward_pre_hook(lambda m, a, i=i: h_in.__setitem__(i, a[0])))

        def attn(m, a, out, i=i):
            seen.setdefault((i, "self_attn"), []).append((a[:3], out, h_in[i].float() + out.float()))

        def mlp(m, a, out, i=i):
            prev = seen[(i, "self_attn")][-1][2]
            seen.setdefault((i, "mlp"), []).append((a[:1], out, prev + out.float()))
        hooks.append(layer.self_attn.register_forward_hook(attn))
        hooks.append(layer.mlp.register_forward_hook(mlp))
    try:
        _float_passes(model, ref.ids, layers)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for g, names in groups.items():
        blocks = {(int(n.split(".")[2]), "self_attn" if ".self_attn." in n else "mlp") for n in names}
        acc = [0.0, 0.0]
        with quantized(model, params.only(linears=names)):
            for i, kind in sorted(blocks):
                block = getattr(model.model.layers[i], kind)
                for args, y, resid in seen[(i, kind)]:
                    _acc(acc, resid, resid + (block(*args).float() - y.float()))
        db = _db(acc)
        out.append(Cost(g, "residual", _nsr(db), {"residual_sqnr_db": db, "linears": len(names)}))
    return out


@torch.no_grad()
def _float_passes(model: DeepseekV3ForCausalLM, ids: Sequence[torch.Tensor], layers: Sequence[int]) -> None:
    """The float model over every sample, its MTP layer too when one of ``layers`` is there."""
    mtp = bool(model.mtp_layers) and any(i >= model.config.num_hidden_layers for i in layers)
    for x in ids:
        _, h = model(x[:, :-1], return_hidden=True)
        if mtp and x.shape[1] > 2:
            model.mtp(h[:, :-1], x[:, 1:-1])


def _acc(a: list, ref: torch.Tensor, got: torch.Tensor) -> None:
    r = ref.float()
    a[0] += torch.linalg.vector_norm(r).item() ** 2
    a[1] += torch.linalg.vector_norm(r - got.float()).item() ** 2


def _db(a: Sequence[float]) -> float:
    if a[1] == 0:
        return math.inf
    return 10 * math.log10(a[0] / a[1]) if a[0] > 0 else -math.inf


def rank_correlation(a: Sequence[Cost], b: Sequence[Cost]) -> float:
    """Spearman's rho between two rankings of the same keys (1: same order)."""
    ra = {c.key: k for k, c in enumerate(a)}
    rb = {c.key: k for k, c in enumerate(b)}
    if set(ra) != set(rb):
        raise ValueError("rank_correlation: the rankings hold different keys")
    n = len(ra)
    if n < 2:
        return 1.0
    d2 = sum((ra[k] - rb[k]) ** 2 for k in ra)
    return 1 - 6 * d2 / (n * (n * n - 1))


def expert_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """Routed experts grouped per layer and projection (``model.layers.5.mlp.experts.*.down_proj``); every
    other linear alone."""
    out: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        key = ".".join(parts[:5] + ["*"] + parts[6:]) if len(parts) > 6 and parts[4] == "experts" else n
        out.setdefault(key, []).append(n)
    return out


# ----- the fallback pick ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Bounds a fallback must meet (None: not asked). ``max_share_above_int8`` is a budget, not a figure:
    the ladder (pipeline.quant.evaluation.fallback) keeps at most that share of the linear weights above int8
    and takes the fewest moves within it that meet the rest (all of them when none does)."""

    min_agreement: Optional[float] = None
    max_kl: Optional[float] = None
    max_ppl_delta_pct: Optional[float] = None
    min_attn_sqnr_db: Optional[float] = None
    max_share_above_int8: Optional[float] = None

    def __post_init__(self):
        if all(v is None for v in vars(self).values()):
            raise ValueError("target: give at least one of min_agreement, max_kl, max_ppl_delta_pct, "
                             "min_attn_sqnr_db")
        if self.min_agreement is not None and not 0 <= self.min_agreement <= 1:
            raise ValueError(f"target: min_agreement must be in [0, 1], got {self.min_agreement}")
        if self.max_share_above_int8 is not None and not 0 <= self.max_share_above_int8 <= 1:
            raise ValueError(f"target: max_share_above_int8 must be in [0, 1], got {self.max_share_above_int8}")

    def met(self, m: Metrics) -> bool:
        if self.min_attn_sqnr_db is not None and m.min_attn_sqnr_db is None:
            raise ValueError("target: min_attn_sqnr_db asks for the attention SQNR; measure with a "
                             "FloatReference(..., attention=True)")
        return ((self.min_agreement is None or m.agreement >= self.min_agreement)
                and (self.max_kl is None or m.kl_mean <= self.max_kl)
                and (self.max_ppl_delta_pct is None or m.ppl_delta_pct <= self.max_ppl_delta_pct)
                and (self.min_attn_sqnr_db is None or m.min_attn_sqnr_db >= self.min_attn_sqnr_db))


@dataclass
class Pick:
    """The fallback chosen: ``keys`` (layer ids or module names), whether the target is ``met``, the
    figures with that fallback, every (fallback size, figures) evaluated on the way, and the keys the
    attention bound alone asked for (``forced``: the first ones of ``keys``)."""

    keys: list
    met: bool
    metrics: Metrics
    tried: list = field(default_factory=list)
    forced: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"keys": self.keys, "met": self.met, "metrics": self.metrics.to_dict(), "forced": self.forced,
                "tried": [{"n": n, **m.to_dict()} for n, m in self.tried]}


def attention_layer(key: Key, kind: str, groups: Optional[Mapping[str, Sequence[str]]] = None) -> Optional[int]:
    """The layer whose attention output ``key`` changes: an FA3 layer's id; for a linear or a group, the
    layer whose ``self_attn`` holds all its members; else None (an MLP piece)."""
    if kind == "fa":
        return int(key)
    names = groups[key] if groups else [key]
    layers = {int(n.split(".")[2]) for n in names if ".self_attn." in n}
    return layers.pop() if len(layers) == 1 and all(".self_attn." in n for n in names) else None


def attention_fallback(ref: FloatReference, keys: Sequence[Key], target: Target, kind: str,
                       without: Callable[[list], FakeQuantParams],
                       groups: Optional[Mapping[str, Sequence[str]]] = None) -> list:
    """The pieces the per-layer attention bound (``target.min_attn_sqnr_db``) asks for, before any search:
    a layer's attention output depends on its own pieces only (the float residual goes in), so for each
    layer below the bound its pieces fall back in ranked order (``keys``) until it meets it, or all of them
    have. Blocks alone, no full passes. [] when the target sets no such bound."""
    bound = target.min_attn_sqnr_db
    if bound is None:
        return []
    per_layer: dict[int, list] = {}
    for k in keys:
        i = attention_layer(k, kind, groups)
        if i is not None:
            per_layer.setdefault(i, []).append(k)
    out: list = []
    for i, mine in sorted(per_layer.items()):
        n = 0
        while n < len(mine) and ref.attention_sqnr(without(mine[:n]), [i]).get(i, math.inf) < bound:
            n += 1
        out.extend(mine[:n])
    return [k for k in keys if k in out]


def smallest_fallback(ref: FloatReference, params: FakeQuantParams, ranked: Sequence[Cost], target: Target,
                      kind: str, groups: Optional[Mapping[str, Sequence[str]]] = None) -> Pick:
    """The shortest prefix of ``ranked`` (kind "fa": FA3 layers; "linear": linears or ``groups``) whose
    fallback meets ``target``, all other pieces of ``params`` quantized (module doc)."""
    if kind not in ("fa", "linear"):
        raise ValueError(f"kind: {kind!r}, expected 'fa' or 'linear'")
    def without(chosen) -> FakeQuantParams:
        if kind == "fa":
            return params.without(fa=chosen)
        return params.without(linears=[m for k in chosen for m in (groups[k] if groups else [k])])

    every = [c.key for c in ranked]
    forced = attention_fallback(ref, every, target, kind, without, groups)
    keys = forced + [k for k in every if k not in forced]
    tried: dict[int, Metrics] = {}

    def figures(n: int) -> Metrics:
        if n not in tried:
            tried[n] = ref.measure(without(keys[:n]))
        return tried[n]

    def pick(n: int, met: bool) -> Pick:
        return Pick(keys[:n], met, figures(n), sorted(tried.items()), forced)

    lo = len(forced)
    if target.met(figures(lo)):
        return pick(lo, True)
    if not target.met(figures(len(keys))):
        return pick(len(keys), False)
    hi = len(keys)                 # lo misses, hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if target.met(figures(mid)):
            hi = mid
        else:
            lo = mid
    return pick(hi, True)
