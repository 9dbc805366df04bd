"""Accuracy report of W8A8 + FA3 against the float model, with and without smoothing.

    python -m jobs.evaluate [--model-path SRC] [--out DIR] [--calib-data FILE] [--fa-exclude-layers ...]

Quantizes SRC (default: the embedded model) into DIR/plain and DIR/smooth, evaluates float, W8A8 only,
FA3 only and W8A8 + FA3 on the held-out text (default: the embedded model's heldout.json), and writes
DIR/perplexity.parquet, DIR/sqnr.parquet and the report: DIR/report.md, report.png (perplexity per variant,
SQNR per layer and module type) and report.html (both in one page).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_parser() -> argparse.ArgumentParser:
    from jobs.quantize import _flag, _layers

    ap = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__.split("\n")[0])
    _flag(ap, "--model-path", default=None, help="source checkpoint (default: the embedded model)")
    _flag(ap, "--out", default=os.path.join("out", "eval"),
          help="directory of the quantized copies and the report (default: %(default)s)")
    _flag(ap, "--calib-data", default=None,
          help="calibration texts, as jobs.quantize reads them (default: the built-in calibration set)")
    _flag(ap, "--heldout", default=None, help="held-out texts (.json list / .jsonl / .parquet) (default: "
                                                "the embedded model's heldout.json)")
    _flag(ap, "--fa-exclude-layers", type=_layers, default=(),
          help="layers kept out of FA3, e.g. 0,1,2 (default: none)")
    _flag(ap, "--dynamic", action="store_true", help="every quantized linear W8A8_DYNAMIC (default: off)")
    _flag(ap, "--quantize-mtp", action="store_true", help="quantize the MTP layer too (default: off, FLOAT)")
    _flag(ap, "--seq", type=int, default=256, help="tokens per perplexity window (default: %(default)s)")
    _flag(ap, "--max-heldout-tokens", type=int, default=0,
          help="evaluate on at most this many tokens (default: %(default)s, all)")
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


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
    from pipeline.quant.eval_report import write_report
    from pipeline.quant.evaluate import evaluate, write_parquet
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
    report = write_report(args.out, src, ppl, sqnr, args.seq)
    storage.write_bytes(storage.join(args.out, "perplexity.json"), json.dumps(ppl, indent=1).encode())
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
