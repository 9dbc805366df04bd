"""Accuracy report of W8A8 + FA3 against the float model, with and without smoothing.

    python -m jobs.evaluate [--model-path SRC] [--out DIR] [--calib-data FILE] [--fa-exclude-layers ...]

Quantizes SRC (default: the embedded model) into DIR/plain and DIR/smooth, evaluates float, W8A8 only,
FA3 only and W8A8 + FA3 on the held-out text (default: the embedded model's heldout.json), and writes
DIR/perplexity.parquet, DIR/sqnr.parquet and DIR/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None):
    from jobs.quantize import _flag, _layers

    ap = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__.split("\n")[1])
    _flag(ap, "--model-path", default=None)
    _flag(ap, "--out", default=os.path.join("out", "eval"))
    _flag(ap, "--calib-data", default=None)
    _flag(ap, "--heldout", default=None, help="held-out texts (.json list / .jsonl / .parquet); default: "
                                                "the embedded model's heldout.json")
    _flag(ap, "--fa-exclude-layers", type=_layers, default=())
    _flag(ap, "--dynamic", action="store_true")
    _flag(ap, "--quantize-mtp", action="store_true")
    _flag(ap, "--seq", type=int, default=256)
    _flag(ap, "--max-heldout-tokens", type=int, default=0, help="evaluate on at most this many tokens (0: all)")
    return ap.parse_args(argv)


def heldout_texts(path):
    from pipeline.text import corpus
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.calib_data import load_texts

    if path:
        return load_texts(path)
    return [d.text for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from pipeline.io import storage
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.model.perplexity import token_stream
    from pipeline.quant.evaluate import evaluate, ppl_table, sqnr_summary, write_parquet
    from pipeline.quant.recipe import Recipe
    from pipeline.quant.run import QuantizeOptions
    from pipeline.text.tokenizer import Tokenizer

    src = args.model_path or EMBEDDED_MODEL_DIR
    try:
        tok = Tokenizer.from_dir(src)
        stream = token_stream(tok, heldout_texts(args.heldout))
        if args.max_heldout_tokens:
            stream = stream[: args.max_heldout_tokens]
        recipe = Recipe(fa_exclude_layers=args.fa_exclude_layers, dynamic=args.dynamic, quantize_mtp=args.quantize_mtp)
        opts = QuantizeOptions(calib_path=args.calib_data, truncate=True, device="cpu")
        with torch.inference_mode():
            ppl, sqnr = evaluate(src, args.out, stream, recipe, opts, seq=args.seq)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_parquet(ppl, storage.join(args.out, "perplexity.parquet"))
    write_parquet(sqnr, storage.join(args.out, "sqnr.parquet"))
    report = (f"# Accuracy of W8A8 + FA3 on {src}\n\nHeld-out tokens: {ppl[0]['tokens']} "
              f"(windows of {args.seq})\n\n## Perplexity\n\n{ppl_table(ppl)}\n\n"
              f"## Per-module SQNR (each module on the float model's input)\n\n{sqnr_summary(sqnr)}\n")
    storage.write_bytes(storage.join(args.out, "report.md"), report.encode())
    storage.write_bytes(storage.join(args.out, "perplexity.json"), json.dumps(ppl, indent=1).encode())
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
