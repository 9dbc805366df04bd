"""The measured fallback job (``--fa-fallback`` / ``--linear-fallback``): the FA3 layers and the linears whose
quantization costs most climb a ladder, toward the model dtype, by measurement.

The job quantizes once with the recipe into a probe directory (a hidden sibling of the destination, under
the destination's lock: removed when the job ends or is stopped with SIGTERM, and by the next run on the
destination after a SIGKILL), measures there what each piece costs, picks, and quantizes again with the
recipe amended; that amended recipe is what the output's
``<model_type>_best_practice.yaml`` holds, so a rerun from it writes the same output without the flags:

- FA3 layers that fall back join ``fa_exclude_layers`` (the file's ``dsquant`` section);
- linears moved to W8A8_DYNAMIC are the ``include`` of one W8A8_DYNAMIC ``linear_quant`` rule put first;
  linears kept float join the ``exclude`` patterns of every rule (the default mix is written out as its two
  rules first), so they are FLOAT in the description (:func:`.rungs.with_ladder`).

What is measured: on the probe's own model (its float tensors, biases and rotation, and each quantized
linear with the float weight it was quantized from, smoothed and rotated as the recipe has it, kept while
the probe is written: :class:`FloatWeights`), each piece is put back to its quantized form and compared with
the source's float model on the calibration samples (pipeline.quant.evaluation.sensitivity). A linear that
falls back is measured as the output writes it (its float weight, not its dequantized int8 weight, whose
error is large where smoothing has scaled outlier columns up). Every fourth calibration sample is held out
of the fitting and validates the pick (:mod:`.search`); the report gives both
figures.
- FA3 layers (int8 latent -> bf16), ranked by the ``sqnr`` proxy (the attention output with the int8 latent
  against the residual stream it joins); the pick is judged with the linears unquantized, so it is the
  latent's share alone;
- linears, ``auto``: first the MLP input smoothing (:mod:`.smoothing`: a second probe with every candidate
  layer's post_attention_layernorm smoothed into its gate/up linears and router, kept on the layers where it
  lowers the measured MLP error; the ladder then measures the probe of the recipe with those layers in
  ``mlp_smooth_layers``, which the written recipe carries), then the ladder (:mod:`.rungs`, :mod:`.search`):
  each piece (a linear; a q_a/kv_a pair or a gate/up pair, which runtimes fuse; one routed expert at a time)
  W8A8 -> W8A8_DYNAMIC -> FLOAT, by the ``residual`` proxy's error reduction per byte kept above int8
  (W8A8_DYNAMIC keeps the int8 weight: no byte, so it comes first), the fewest bytes above int8 meeting the
  target on the whole model with the FA3 pick applied, on the fitting and the held-out samples; ``N``: the N
  costliest pieces as before the ladder (routed experts per layer and projection, a layer's q_a/kv_a together)
  kept FLOAT.

``auto`` for FA3 takes what each layer's attention bound needs, then the shortest ranked prefix of the rest
that meets :data:`TARGET` or ``--fallback-target`` (the module doc of pipeline.quant.evaluation.sensitivity
says how it searches); ``N`` the N costliest (at most the pieces the recipe quantizes, checked before any
work); ``none`` (or ``0``) nothing, and no probe for it. The default target (agreement >= 98%, perplexity
within +1%, every layer's attention output SQNR >= 32 dB) is stricter than the project's goals (agreement
>= 95%, perplexity within +2%, attention SQNR >= 30 dB on held-out text) because the calibration texts are
not the evaluation texts and the final output is calibrated again.
``fallback.json`` in the output records the picks, each piece's cost per rung, the bytes per rung, the
target and the figures measured on the fitting and held-out samples; the log gives the share of the linear
weights kept above int8 in the written output (:mod:`.share`).
"""

from __future__ import annotations

import json
import math
import posixpath
import uuid
from dataclasses import replace
from typing import Callable, Optional, Union

from pipeline.format.description import FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.io import storage
from pipeline.quant.writing.output_files import FALLBACK_REPORT
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.evaluation.fallback.rungs import dynamic_params, ladder_pieces, rung_bytes, with_ladder
from pipeline.quant.evaluation.fallback.search import (ladder_moves, ladder_search, params_at, rung_costs,
                                                     split_samples, state_of, within_budget)
from pipeline.quant.evaluation.fallback.share import counted, linear_share, output_share
from pipeline.quant.evaluation.fallback.smoothing import smooth_where_it_helps
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


TARGET_KEYS = {"agreement": "min_agreement", "ppl": "max_ppl_delta_pct", "kl": "max_kl", "sqnr": "min_attn_sqnr_db",
               "share": "max_share_above_int8"}


def parse_target(text: str, flag: str = "--fallback-target") -> Target:
    """``agreement=0.99,ppl=0.5[,kl=0.01][,sqnr=30][,share=0.05]`` (agreement as a fraction, ppl in percent,
    kl the mean KL, sqnr the lowest per-layer attention SQNR in dB, share the budget of linear weights kept
    above int8, a fraction) as a Target; a one-line error naming ``flag`` otherwise."""
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
    return with_ladder(recipe, fa_layers, (), linears)


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
    is measured with its dequantized int8 weight, and its W8A8_DYNAMIC rung from the stored int8 weight)."""
    import torch

    from pipeline.model.loading import load_model
    from pipeline.quant.evaluation.fakequant import load_fakequant_model

    fit, hold = split_samples(samples)
    with torch.no_grad():
        base = load_fakequant_model(probe, w8a8=False, fa3=False)
        if float_weights is not None:
            float_weights.install(base)
        reference = load_model(src, dtype=torch.float32, device="cpu")
        ref = FloatReference(base, fit, reference=reference, attention=True)
        held = FloatReference(base, hold, reference=reference, attention=True) if hold else None
        del reference
    params = FakeQuantParams.from_dir(probe)
    groups = fallback_groups(list(params.linears))
    report: dict = {"target": {k: v for k, v in vars(target).items() if v is not None},
                    "samples": len(fit), "tokens": ref.tokens,
                    "heldout_samples": len(hold), "heldout_tokens": held.tokens if held else 0,
                    "fa_fallback": fa, "linear_fallback": linear,
                    "quantized": ref.measure(params).to_dict(),
                    "quantized_heldout": held.measure(params).to_dict() if held else None}
    fa_keys: list = []
    if fa is not None:
        ranked = fa3_costs(ref, params, "sqnr")
        fa_keys, search = _take(fa, ranked, ref, params.only(fa=list(params.fa_k)), "fa", target)
        report["fa"] = {"picked": fa_keys, "search": search, "costs": [_cost(c) for c in ranked],
                        "cache_bytes_per_token_above_int8": len(fa_keys) * base.config.kv_lora_rank}
        log(f"FA3 fallback ({fa}): layers {fa_keys} stay bf16 (of {len(ranked)} FA3 layers){_why(search)}")
    final = params.without(fa=fa_keys)
    if linear == AUTO:
        report["linear"], final = _ladder(ref, held, final, target, log, float_weights)
    elif linear is not None:
        ranked = linear_costs(ref, params, "residual", groups)
        lin_keys, _ = _take(linear, ranked, ref, final, "linear", target, groups)
        report["linear"] = {"picked": lin_keys, "dynamic": [], "search": None, "costs": [_cost(c) for c in ranked]}
        log(f"linear fallback ({linear}): {len(lin_keys)} kept float: {lin_keys}")
        final = final.without(linears=[m for k in lin_keys for m in groups[k]])
    report["with_fallback"] = ref.measure(final).to_dict()
    report["with_fallback_heldout"] = held.measure(final).to_dict() if held else None
    return report


def _ladder(ref: FloatReference, held: Optional[FloatReference], params: FakeQuantParams, target: Target,
            log: Callable[[str], None], float_weights: Optional[FloatWeights]) -> tuple[dict, FakeQuantParams]:
    """``--linear-fallback auto``: the ladder's pick (:mod:`.search`) over ``params`` (the
    FA3 pick applied): the report's ``linear`` section and the parameters with the pick made."""
    fw = float_weights.tensors if float_weights is not None else {}
    pieces = ladder_pieces(params.linears)
    dynamic = {m: dynamic_params(kind, p, fw.get(m + ".weight"), fw.get(m + ".bias"))
               for m, (kind, p) in params.linears.items() if kind == W8A8}
    costs = rung_costs(ref, pieces, params, dynamic)
    n_layers = ref.model.config.num_hidden_layers
    moves = ladder_moves(pieces, costs)
    if target.max_share_above_int8 is not None:
        total = sum(p[1]["weight"].numel() for m, p in params.linears.items() if counted(m, n_layers))
        moves = within_budget(moves, target.max_share_above_int8 * total)
    pick = ladder_search(ref, held, moves, target, lambda ms: params_at(params, pieces, state_of(ms), dynamic))
    state = pick.state
    types = {m: state.get(p.key, p.kind) for p in pieces for m in p.members}
    share = linear_share(types, {m: p[1]["weight"].numel() for m, p in params.linears.items()}, n_layers)
    section = {"picked": pick.keys(FLOAT), "dynamic": pick.keys(W8A8_DYNAMIC), "pieces": len(pieces),
               "bytes": rung_bytes(pieces, state), "quantized_share_above_int8": share["share"],
               "search": pick.to_dict(),
               "costs": [{"key": p.key, "kind": p.kind, "weights": p.weights, "costs": costs[p.key]} for p in pieces]}
    held_text = f", held-out agreement {pick.heldout.agreement:.4f}" if pick.heldout else ""
    log(f"linear fallback (auto): {len(section['dynamic'])} of {len(pieces)} pieces W8A8_DYNAMIC, "
        f"{len(section['picked'])} FLOAT ({pick.bytes} bytes above int8, {100 * share['share']:.2f}% of the "
        f"quantized linear weights); {'target met' if pick.met else 'target missed even with every move'}: "
        f"agreement {pick.metrics.agreement:.4f}{held_text}")
    return section, params_at(params, pieces, state, dynamic)


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
                           log: Callable[[str], None] = print, mlp_smooth: bool = True) -> Recipe:
    """Probe, pick, and write ``dst`` with the amended recipe (module doc); ``recipe_yaml`` renders the
    recipe file written next to the weights. With ``linear`` auto and ``mlp_smooth``, the MLP input
    smoothing of :mod:`.smoothing` is tried first, kept on the layers where it lowers the measured error.
    Returns the amended recipe."""
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
        probes: list[str] = []

        def quantize_probe(r: Recipe) -> tuple[str, FloatWeights]:
            probes.append(probe_path(dst))
            log(f"fallback: quantizing a probe with the recipe {'as given' if r is recipe else 'smoothed'} "
                f"({probes[-1]})")
            weights = FloatWeights(cfg, r)
            quantize_checkpoint(src, probes[-1], r, replace(opts, overwrite=False, estimate=False, recipe_file=None),
                                log=lambda m: None, on_layer=weights)
            return probes[-1], weights

        try:
            probe = quantize_probe(recipe)
            smoothing = None
            if linear == AUTO and mlp_smooth:
                recipe, probe, smoothing = smooth_where_it_helps(recipe, cfg, probe, quantize_probe,
                                                                 split_samples(samples)[0], log)
            report = choose(src, probe[0], samples, fa, linear, target, log, probe[1])
            if smoothing is not None:
                report["mlp_smooth"] = smoothing
            del probe
        finally:
            for p in probes:
                storage.remove(p)
        lin = report.get("linear") or {}
        final = with_ladder(recipe, report.get("fa", {}).get("picked", []), lin.get("dynamic", []),
                            lin.get("picked", []))
        name = opts.recipe_file[0] if opts.recipe_file else None
        files = (*opts.extra_files, (REPORT_NAME, (json.dumps(report, indent=1) + "\n").encode()))
        quantize_checkpoint(src, dst, final, replace(opts, recipe_file=(name, recipe_yaml(final)) if name else None,
                                                     extra_files=files), log=log, lock=lock)
    q, w = report["quantized"], report["with_fallback"]
    log(f"fallback: {REPORT_NAME} written; on {report['samples']} calibration samples agreement "
        f"{q['agreement']:.4f} -> {w['agreement']:.4f}, perplexity {q['ppl_delta_pct']:+.2f}% -> "
        f"{w['ppl_delta_pct']:+.2f}%{_held_text(report)}")
    share = output_share(dst)
    log(f"fallback: {100 * share['share']:.2f}% of the linear weights above int8 (kv_b_proj, router and MTP layer "
        f"left out; W8A8 {share['weights'][W8A8]}, W8A8_DYNAMIC {share['weights'][W8A8_DYNAMIC]}, FLOAT "
        f"{share['weights'][FLOAT]} elements)")
    return final


def _held_text(report: dict) -> str:
    q, w = report.get("quantized_heldout"), report.get("with_fallback_heldout")
    if not q or not w:
        return ""
    return (f"; on {report['heldout_samples']} held-out ones {q['agreement']:.4f} -> {w['agreement']:.4f}, "
            f"{q['ppl_delta_pct']:+.2f}% -> {w['ppl_delta_pct']:+.2f}%")
