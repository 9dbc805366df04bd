"""Measured fallback (``--fa-fallback`` / ``--linear-fallback``): the FA3 layers and the linears whose
quantization costs most stay in the model dtype.

The job quantizes once with the recipe into a probe directory (a hidden sibling of the destination, under
the destination's lock: removed when the job ends or is stopped with SIGTERM, and by the next run on the
destination after a SIGKILL), measures there what each piece costs, picks, and quantizes again with the
recipe amended; that amended recipe is what the output's
``<model_type>_best_practice.yaml`` holds, so a rerun from it writes the same output without the flags:

- FA3 layers that fall back join ``fa_exclude_layers`` (the file's ``dsquant`` section);
- linears that fall back join the ``exclude`` patterns of every ``linear_quant`` rule (the default mix is
  written out as its two rules first), so they are FLOAT in the description. Routed experts fall back per
  layer and projection (``model.layers.5.mlp.experts.*.down_proj``, one pattern); a layer's ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` fall back together (``model.layers.5.self_attn.{q_a_proj,kv_a_proj_with_mqa}``),
  since runtimes fuse the two and the format wants one type for both.

What is measured: on the probe's own model (its float tensors, biases and rotation, and each quantized
linear with the float weight it was quantized from, smoothed and rotated as the recipe has it, kept while
the probe is written: :class:`FloatWeights`), each piece is put back to its quantized form and compared with
the source's float model on the calibration samples (pipeline.quant.evaluation.sensitivity). A linear that falls back
is then measured as the output writes it (its float weight), not as its dequantized int8 weight, whose
error is large where smoothing has scaled outlier columns up:
- FA3 layers, ranked by the ``sqnr`` proxy (the attention output with the int8 latent against the residual
  stream it joins); the pick is judged with the linears unquantized, so it is the latent's share alone;
- linears (and expert groups), ranked by the ``residual`` proxy (their block rerun with only them
  quantized); the pick is judged on the whole model with the FA3 pick applied.

``auto`` takes what each layer's attention bound needs, then the shortest ranked prefix of the rest that
meets :data:`TARGET` or ``--fallback-target`` (the module doc of pipeline.quant.evaluation.sensitivity says how it
searches); ``N`` the N costliest (at most the pieces the recipe quantizes, checked before any work); ``none``
(or ``0``) nothing, and no probe for it. The default target (agreement >= 98%, perplexity
within +1%, every layer's attention output SQNR >= 32 dB) is stricter than the project's goals (agreement
>= 95%, perplexity within +2%, attention SQNR >= 30 dB on held-out text) because the calibration texts are
not the evaluation texts and the final output is calibrated again.
``fallback.json`` in the output records the picks, each piece's cost, the target and the figures measured.
"""

from __future__ import annotations

import json
import math
import posixpath
import uuid
from dataclasses import replace
from typing import Callable, Optional, Union

from pipeline.io import storage
from pipeline.quant.recipe.linear_rules import LinearRule, default_rules
from pipeline.quant.writing.output_files import FALLBACK_REPORT
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.evaluation.sensitivity import (Cost, FakeQuantParams, FloatReference, Target, expert_groups, fa3_costs,
                                        linear_costs, smallest_fallback)

AUTO = "auto"
Choice = Union[str, int, None]       # "auto", N >= 0, or None (no fallback)
TARGET = Target(min_agreement=0.98, max_ppl_delta_pct=1.0, min_attn_sqnr_db=32.0)
REPORT_NAME = FALLBACK_REPORT


def parse_choice(text: str, flag: str) -> Choice:
    """``auto`` | N | ``none`` as the flag gives it; a one-line error naming ``flag`` otherwise."""
    t = str(text).strip().lower()
    if t == AUTO:
        return AUTO
    if t == "none":
        return None
    if t.isascii() and t.isdigit():        # not '²' or '٣', which str.isdigit takes and int() may not
        return int(t)
    raise QuantError(f"{flag}: expected auto, none or a count such as 3, got {text!r}")


TARGET_KEYS = {"agreement": "min_agreement", "ppl": "max_ppl_delta_pct", "kl": "max_kl", "sqnr": "min_attn_sqnr_db"}


def parse_target(text: str, flag: str = "--fallback-target") -> Target:
    """``agreement=0.99,ppl=0.5[,kl=0.01][,sqnr=30]`` (agreement as a fraction, ppl in percent, kl the mean
    KL, sqnr the lowest per-layer attention SQNR in dB) as a Target; a one-line error naming ``flag``
    otherwise."""
    fields = {}
    for item in str(text).split(","):
        key, sep, value = item.partition("=")
        try:
            fields[TARGET_KEYS[key.strip()]] = float(value)
        except (KeyError, ValueError):
            raise QuantError(f"{flag}: expected NAME=VALUE pairs of {sorted(TARGET_KEYS)} such as "
                             f"agreement=0.97,ppl=1.0, got {item!r}") from None
        if not sep or not math.isfinite(fields[TARGET_KEYS[key.strip()]]):
            raise QuantError(f"{flag}: expected NAME=VALUE with a finite number, got {item!r}")
    try:
        return Target(**fields)
    except ValueError as e:
        raise QuantError(f"{flag}: {e}") from None


def target_text(target: Target) -> str:
    """``target`` as ``--fallback-target`` spells it."""
    names = {v: k for k, v in TARGET_KEYS.items()}
    return ",".join(f"{names[k]}={v:g}" for k, v in vars(target).items() if v is not None)


def with_fallback(recipe: Recipe, fa_layers, linears) -> Recipe:
    """``recipe`` with ``fa_layers`` kept off FA3 and the linears (names or patterns) kept FLOAT."""
    out = recipe
    if fa_layers:
        out = replace(out, fa_exclude_layers=tuple(sorted(set(out.fa_exclude_layers) | set(fa_layers))))
    if linears:
        rules = out.linear_rules or default_rules()
        extra = tuple(sorted(linears))
        out = replace(out, linear_rules=tuple(
            LinearRule(r.kind, r.include, r.exclude + tuple(p for p in extra if p not in r.exclude)) for r in rules))
    return out


def pieces(recipe: Recipe, cfg) -> tuple[int, int]:
    """(FA3 layers, linear pieces: an expert group or a q_a/kv_a pair counted once) the recipe quantizes in
    a model of config ``cfg``: what ``N`` may count up to, known from the recipe and config alone."""
    from pipeline import layout
    from pipeline.format.description import QUANT_KINDS
    from pipeline.quant.recipe.recipe import module_types

    ids = layout.all_layer_ids(cfg)
    types = module_types(cfg, recipe, ids)
    names = [m for m, kind in types.items() if kind in QUANT_KINDS and layout.is_quantizable_linear(m)]
    return sum(recipe.fa_layer(cfg, i) for i in ids), len(fallback_groups(names))


def check_choices(recipe: Recipe, cfg, fa: Choice, linear: Choice) -> tuple[Choice, Choice]:
    """The choices as the job runs them, checked against what the recipe quantizes before any work: ``0``
    is ``none`` (no probe for it); a count above the pieces there are, or a fallback of what the recipe
    does not quantize (FA3 off), is a QuantError naming the flag."""
    fa, linear = (None if c == 0 else c for c in (fa, linear))
    n_fa, n_lin = pieces(recipe, cfg)
    for flag, choice, n, what in (("--fa-fallback", fa, n_fa, "FA3 layers"),
                                  ("--linear-fallback", linear, n_lin,
                                   "linears (an expert group, or a q_a/kv_a pair, counted once)")):
        if choice is None:
            continue
        if n == 0:
            why = "no layer has FA3" if flag == "--fa-fallback" else "it quantizes no linear"
            raise QuantError(f"{flag} {choice}: the recipe has nothing to keep ({why}); drop the flag")
        if choice != AUTO and choice > n:
            raise QuantError(f"{flag} {choice}: the recipe quantizes only {n} {what}")
    return fa, linear


def _take(choice: Choice, ranked: list[Cost], ref: FloatReference, params: FakeQuantParams, kind: str,
          target: Target, groups=None) -> tuple[list, Optional[dict]]:
    if choice is None or not ranked:
        return [], None
    if choice == AUTO:
        pick = smallest_fallback(ref, params, ranked, target, kind, groups)
        return list(pick.keys), pick.to_dict()
    return [c.key for c in ranked[:choice]], None


FUSED = ("q_a_proj", "kv_a_proj_with_mqa")        # runtimes fuse them: one type for both (checker's qa-kva-type)


def fallback_groups(names: list[str]) -> dict[str, list[str]]:
    """What falls back together: a layer's routed experts per projection (sensitivity.expert_groups), and a
    layer's q_a_proj with its kv_a_proj_with_mqa, keyed by a pattern naming both."""
    out: dict[str, list[str]] = {}
    for key, members in expert_groups(names).items():
        head, _, leaf = key.rpartition(".")
        if leaf in FUSED and head.endswith(".self_attn"):
            key = f"{head}.{{{','.join(FUSED)}}}"
        out.setdefault(key, []).extend(members)
    return out


class FloatWeights:
    """``on_layer`` hook of the probe's quantize_checkpoint: keeps the float weight (and bias) of each linear
    the recipe quantizes, as it is quantized; :meth:`install` puts them in the probe's model."""

    def __init__(self, cfg, recipe: Recipe):
        self.cfg, self.recipe = cfg, recipe
        self.tensors: dict = {}

    def __call__(self, layer_id: int, tensors: dict) -> None:
        from pipeline.format.description import QUANT_KINDS
        from pipeline.io.fp8 import BlockRows

        for p, kind in self.recipe.layer_types(self.cfg, layer_id).items():
            if kind in QUANT_KINDS:
                for name in (p + ".weight", p + ".bias"):
                    t = tensors.get(name)
                    if t is not None:
                        self.tensors[name] = t.materialize() if isinstance(t, BlockRows) else t.detach().clone()

    def install(self, model) -> None:
        import torch

        for name, t in self.tensors.items():
            parent, leaf = name.rsplit(".", 1)
            mod = model.get_submodule(parent)
            like = mod.weight
            setattr(mod, leaf, torch.nn.Parameter(t.to(like.device, like.dtype), requires_grad=False))


def choose(src: str, probe: str, samples: list[list[int]], fa: Choice, linear: Choice, target: Target = TARGET,
           log: Callable[[str], None] = print, float_weights: Optional[FloatWeights] = None) -> dict:
    """Measure the probe output ``probe`` of ``src`` on ``samples`` and pick (module doc): the report.
    ``float_weights``: the probe's quantized linears' float weights (without them, a linear that falls back
    is measured with its dequantized int8 weight)."""
    import torch

    from pipeline.model.loading import load_model
    from pipeline.quant.evaluation.fakequant import load_fakequant_model

    with torch.no_grad():
        base = load_fakequant_model(probe, w8a8=False, fa3=False)
        if float_weights is not None:
            float_weights.install(base)
        ref = FloatReference(base, samples, reference=load_model(src, dtype=torch.float32, device="cpu"),
                             attention=True)
    params = FakeQuantParams.from_dir(probe)
    groups = fallback_groups(list(params.linears))
    report: dict = {"target": {k: v for k, v in vars(target).items() if v is not None},
                    "samples": len(samples), "tokens": ref.tokens,
                    "fa_fallback": fa, "linear_fallback": linear,
                    "quantized": ref.measure(params).to_dict()}
    fa_keys: list = []
    if fa is not None:
        ranked = fa3_costs(ref, params, "sqnr")
        fa_keys, search = _take(fa, ranked, ref, params.only(fa=list(params.fa_k)), "fa", target)
        report["fa"] = {"picked": fa_keys, "search": search, "costs": [_cost(c) for c in ranked]}
        log(f"FA3 fallback ({fa}): layers {fa_keys} stay bf16 (of {len(ranked)} FA3 layers){_why(search)}")
    lin_keys: list = []
    if linear is not None:
        ranked = linear_costs(ref, params, "residual", groups)
        lin_keys, search = _take(linear, ranked, ref, params.without(fa=fa_keys), "linear", target, groups)
        report["linear"] = {"picked": lin_keys, "search": search, "costs": [_cost(c) for c in ranked]}
        log(f"linear fallback ({linear}): {len(lin_keys)} kept float{_why(search)}: {lin_keys}")
    report["with_fallback"] = ref.measure(params.without(
        fa=fa_keys, linears=[m for k in lin_keys for m in groups[k]])).to_dict()
    return report


def _why(search: Optional[dict]) -> str:
    """What the log says of an auto pick: how many pieces the attention bound asked for, and whether the
    target was met."""
    if not search:
        return ""
    met = "target met" if search["met"] else "target missed even with all of them"
    return f" ({len(search['forced'])} for the per-layer attention bound; {met})"


def _cost(c: Cost) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in c.to_dict().items()}


PROBE_TAG = ".fallback-probe-"   # the probe of DST: the hidden sibling .DST.fallback-probe-<token>


def probe_path(dst: str) -> str:
    """Where the probe of a job writing ``dst`` goes: a hidden sibling (the disk that was checked for room,
    under the job's lock; never $TMPDIR)."""
    return storage.sibling(dst, f".{posixpath.basename(dst.rstrip('/'))}{PROBE_TAG}{uuid.uuid4().hex[:12]}")


def sweep_probes(dst: str, log: Callable[[str], None] = print) -> list[str]:
    """Remove the probes (and their locks) that killed runs left beside ``dst``; call holding ``dst``'s lock
    (no other job on ``dst`` runs, so none of them is in use). Returns the names removed."""
    parent = posixpath.dirname(dst.rstrip("/")) or "."
    stem = f"{posixpath.basename(dst.rstrip('/'))}{PROBE_TAG}"
    if not storage.isdir(parent):
        return []
    stale = [e for e in storage.listdir(parent) if e.lstrip(".").startswith(stem)]
    for e in stale:
        storage.remove(storage.join(parent, e))
    if stale:
        log(f"fallback: removed {len(stale)} probe file(s) a stopped run left beside {dst}: {', '.join(stale[:4])}")
    return stale


def quantize_with_fallback(src: str, dst: str, recipe: Recipe, opts, fa: Choice, linear: Choice,
                           recipe_yaml: Callable[[Recipe], str], target: Target = TARGET,
                           log: Callable[[str], None] = print) -> Recipe:
    """Probe, pick, and write ``dst`` with the amended recipe (module doc); ``recipe_yaml`` renders the
    recipe file written next to the weights. Returns the amended recipe."""
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.io.destination.lock import DestinationLock
    from pipeline.quant.job.options import calibration_samples
    from pipeline.quant.job.preflight import check_job
    from pipeline.quant.job.run import quantize_checkpoint

    cfg = CheckpointReader(src).config
    fa, linear = check_choices(recipe, cfg, fa, linear)
    if fa is None and linear is None:             # nothing to measure: the job without the flags
        quantize_checkpoint(src, dst, recipe, opts, log=log)
        return recipe
    check_job(src, dst, recipe, opts)             # bad input fails before the probe
    samples = calibration_samples(src, opts, cfg.max_position_embeddings)
    with DestinationLock(dst) as lock:            # the probe and the output: one job's, beside each other
        sweep_probes(dst, log)
        probe = probe_path(dst)
        try:
            log(f"fallback: quantizing a probe with the recipe as given ({probe})")
            weights = FloatWeights(cfg, recipe)
            quantize_checkpoint(src, probe, recipe, replace(opts, overwrite=False, estimate=False, recipe_file=None),
                                log=lambda m: None, on_layer=weights)
            report = choose(src, probe, samples, fa, linear, target, log, weights)
            del weights
        finally:
            storage.remove(probe)
        final = with_fallback(recipe, report.get("fa", {}).get("picked", []),
                              report.get("linear", {}).get("picked", []))
        name = opts.recipe_file[0] if opts.recipe_file else None
        files = (*opts.extra_files, (REPORT_NAME, (json.dumps(report, indent=1) + "\n").encode()))
        quantize_checkpoint(src, dst, final, replace(opts, recipe_file=(name, recipe_yaml(final)) if name else None,
                                                     extra_files=files), log=log, lock=lock)
    log(f"fallback: {REPORT_NAME} written; on the calibration samples agreement "
        f"{report['quantized']['agreement']:.4f} -> {report['with_fallback']['agreement']:.4f}, perplexity "
        f"{report['quantized']['ppl_delta_pct']:+.2f}% -> {report['with_fallback']['ppl_delta_pct']:+.2f}%")
    return final
