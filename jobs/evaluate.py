"""Accuracy of quantized outputs against the float model: agreement, perplexity, KL, per-layer and
per-linear SQNR.

    python -m jobs.evaluate --model-path FLOAT --compare OUT [OUT ...] [--dataset FILE] [--out DIR]
    python -m jobs.evaluate [--model-path FLOAT] [--dynamic] [--fa-exclude-layers ...] [--out DIR]

With ``--compare``, each OUT (a quantized directory written by jobs.quantize, msModelSlim or anything in
the format) is run by fake-quant from its files alone against FLOAT (default: the embedded model). Without
it, FLOAT is first quantized with the recipe flags, with and without smoothing, into DIR/plain and
DIR/smooth, and those are compared (every variant: as written, W8A8 only, FA3 only).

Text: --dataset (.json list of strings, .jsonl with a "text" field, .parquet with a "text" column;
default: the embedded model's held-out texts), cut into windows of --seq tokens. Writes into DIR:
evaluation.json (all of it), summary/layers/linears.parquet, report.md, report.png and report.html
(pipeline/quant/evaluation/evaluate.py says what each figure means). Exit status: 0 done, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANT_FLAGS = {"full": "W8A8 + FA3", "w8a8-only": "W8A8 only", "fa3-only": "FA3 only"}
TABLES = ("summary", "layers", "linears")
OUT_ENTRIES = ("evaluation.json", *(f"{t}.parquet" for t in TABLES), "report.md", "report.png", "report.html",
               "plain", "smooth")   # what an evaluation writes into --out (plain/smooth: without --compare)


def build_parser() -> argparse.ArgumentParser:
    from jobs.quantize import _flag, _layers

    ap = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__.split("\n")[0])
    _flag(ap, "--model-path", default=None, help="the float checkpoint; None: the embedded model")
    _flag(ap, "--compare", nargs="+", default=None, metavar="OUT",
          help="quantized directories to evaluate; None: quantize --model-path with and without smoothing")
    _flag(ap, "--labels", nargs="+", default=None, help="names of the --compare outputs in the report; None: "
                                                        "their folder names")
    _flag(ap, "--variants", default=None,
          help="comma-separated: full (as written), w8a8-only (latent in float), fa3-only (dequantized "
               "weights, int8 latent); None: full with --compare, all three without")
    _flag(ap, "--out", default=os.path.join("out", "eval"), help="directory of the report (and quantized copies)")
    _flag(ap, "--dataset", "--heldout", dest="dataset", default=None,
          help="evaluation texts (.json list / .jsonl / .parquet); None: the embedded model's held-out texts")
    _flag(ap, "--text-field", default="text", help="the field / column holding the text in .jsonl / .parquet")
    _flag(ap, "--seq", type=int, default=256, help="tokens per window")
    _flag(ap, "--max-tokens", "--max-heldout-tokens", dest="max_tokens", type=int, default=0,
          help="evaluate on at most this many tokens (0: all)")
    _flag(ap, "--no-linears", action="store_true", help="skip the per-linear SQNR")
    _flag(ap, "--no-progress", action="store_true", help="no progress bar")
    _flag(ap, "--threads", type=int, default=0, help="torch threads (0: torch's default)")
    q = ap.add_argument_group("recipe, without --compare (as jobs.quantize)")
    _flag(q, "--calib-data", default=None, help="calibration texts; None: the built-in set")
    _flag(q, "--fa-exclude-layers", type=_layers, default=(), help="layers kept out of FA3, e.g. 0,1,2")
    _flag(q, "--dynamic", action="store_true", help="every quantized linear W8A8_DYNAMIC")
    _flag(q, "--no-fa-quant", action="store_true", help="W8A8 only, no FA3")
    _flag(q, "--quantize-mtp", action="store_true", help="quantize the MTP layer too")
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def eval_texts(path, text_field: str = "text"):
    """(texts, label) of ``path`` (calibration-data formats), default the embedded held-out texts."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.calibration.calib_data import load_texts
    from pipeline.quant.evaluation.eval_report import model_label
    from pipeline.text import corpus

    if path:
        return load_texts(path, text_field), model_label(path)
    return [d.text for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]], "the embedded model's held-out texts"


def _variants(args) -> tuple[str, ...]:
    if args.variants is None:
        return ("W8A8 + FA3",) if args.compare else tuple(VARIANT_FLAGS.values())
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANT_FLAGS]
    if bad or not names:
        raise ValueError(f"--variants: unknown {bad or names}; choose from {', '.join(VARIANT_FLAGS)}")
    return tuple(VARIANT_FLAGS[v] for v in names)


def _labels(args) -> list[str]:
    from pipeline.quant.evaluation.eval_report import model_label

    if args.labels is not None:
        if len(args.labels) != len(args.compare or ()):
            raise ValueError(f"--labels: {len(args.labels)} given for {len(args.compare or ())} --compare outputs")
        labels = list(args.labels)
    else:
        labels = [model_label(p) for p in args.compare]
        if len(set(labels)) < len(labels):
            labels = list(args.compare)
    if len(set(labels)) < len(labels):
        raise ValueError(f"--labels: names repeat: {labels}")
    return labels


def check_args(args) -> None:
    if args.seq < 2:
        raise ValueError(f"--seq must be >= 2, got {args.seq}")
    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.labels is not None and not args.compare:
        raise ValueError("--labels names --compare outputs; give --compare too")
    check_out(args)


def check_out(args) -> None:
    """--out holds nothing but an earlier evaluation (replaced: the report files, and plain/ and smooth/ of
    the quantizing form), and is none of the models read nor inside one (pipeline/io/destination/rule.py); it may
    hold one (``--compare OUT/plain --out OUT``): the job writes only its own names there."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.io.destination.rule import check_destination

    check_destination(args.out, kind="an evaluation report", is_own=lambda entries: set(entries) <= set(OUT_ENTRIES),
                      overwrite=True, sources=(args.model_path or EMBEDDED_MODEL_DIR, *(args.compare or ())),
                      flag="--out", overwrite_flag=None, may_hold=True)


def run(args) -> tuple[str, object, str]:
    """(float source, EvalResult, text label)."""
    import torch

    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.model.loading import load_model
    from pipeline.model.perplexity import token_stream
    from pipeline.quant.evaluation.evaluate import compare, evaluate, load_candidates, windows_of
    from pipeline.text.tokenizer import Tokenizer

    check_args(args)
    variants = _variants(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    src = args.model_path or EMBEDDED_MODEL_DIR
    texts, data_label = eval_texts(args.dataset, args.text_field)
    stream = token_stream(Tokenizer.from_dir(src), texts)
    if args.max_tokens:
        stream = stream[: args.max_tokens + 1]
    with torch.inference_mode():
        if args.compare:
            labels = _labels(args)
            float_model = load_model(src, dtype=torch.float32, device="cpu")
            cands = load_candidates(args.compare, labels, variants)
            for path, c in zip([p for p in args.compare for _ in variants], cands):
                check_same_model(float_model.config, c.model.config, path)
            res = compare(float_model, cands, windows_of(stream, args.seq), per_linear=not args.no_linears,
                          progress=not args.no_progress)
        else:
            from pipeline.quant.recipe.recipe import Recipe
            from pipeline.quant.job.run import QuantizeOptions

            recipe = Recipe(fa_exclude_layers=args.fa_exclude_layers, dynamic=args.dynamic,
                            quantize_mtp=args.quantize_mtp, fa_quant=not args.no_fa_quant)
            opts = QuantizeOptions(calib_path=args.calib_data, truncate=True, device="cpu")
            res = evaluate(src, args.out, stream, recipe, opts, seq=args.seq, variants=variants,
                           per_linear=not args.no_linears, progress=not args.no_progress)
    return src, res, data_label


FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "moe_intermediate_size",
          "intermediate_size", "first_k_dense_replace")


def check_same_model(ref, cfg, path: str) -> None:
    """A quantized output must be of the float model's architecture."""
    for f in FIELDS:
        if getattr(ref, f) != getattr(cfg, f):
            raise ValueError(f"{path}: config field '{f}' is {getattr(cfg, f)}, the float model's is "
                             f"{getattr(ref, f)}: not a quantization of it")


def write_outputs(out: str, src: str, res, data_label: str) -> str:
    from pipeline.io import storage
    from pipeline.quant.evaluation.eval_report import model_label, write_report
    from pipeline.quant.evaluation.evaluate import write_parquet

    for name, rows in zip(TABLES, (res.summary, res.layers, res.linears)):
        if rows:
            write_parquet(rows, storage.join(out, f"{name}.parquet"))
    doc = {"float_model": model_label(src), "text": data_label, **res.to_dict()}
    storage.write_bytes(storage.join(out, "evaluation.json"), (json.dumps(doc, indent=1) + "\n").encode())
    return write_report(out, src, res, data_label)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jobs.quantize import run_guarded

    rc, got = run_guarded(lambda: run(args))
    if rc:
        return rc
    src, res, data_label = got
    rc, md = run_guarded(lambda: write_outputs(args.out, src, res, data_label))
    if rc:
        return rc
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
