"""Quantize a DeepSeek-V3/R1 checkpoint to W8A8 + FA3 (FAKQuant) in the msModelSlim format.

    python -m jobs.quantize --model-path SRC --save-path DST [--fa-quant] [--mindie-format] [--dynamic]
                            [--calib-data FILE] [--fa-exclude-layers 0,1,2] [--smooth] ...

msModelSlim's flags are kept (underscore spellings too). With no arguments it quantizes the embedded
model into ./out/dsv3-tiny-pydoc-w8a8-fa3. SRC and DST may be local paths or fsspec URLs (s3://...).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_SAVE = os.path.join("out", "dsv3-tiny-pydoc-w8a8-fa3")


def _flag(ap, *names, **kw):
    """Each --a-b option also as --a_b (msModelSlim's spelling)."""
    spelled = []
    for n in names:
        spelled += [n] + ([f"--{n[2:].replace('-', '_')}"] if "-" in n[2:] else [])
    return ap.add_argument(*spelled, **kw)


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids like 0,1,2, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.quantize", description=__doc__.split("\n")[1])
    _flag(ap, "--model-path", default=None, help="source checkpoint (default: the embedded model)")
    _flag(ap, "--save-path", default=DEFAULT_SAVE, help=f"output directory (default: {DEFAULT_SAVE})")
    _flag(ap, "--calib-data", "--calib_file", dest="calib_data", default=None,
          help="calibration texts: .json list of strings, .jsonl with 'text', or .parquet with a 'text' column")
    fa = ap.add_mutually_exclusive_group()
    _flag(fa, "--fa-quant", dest="fa_quant", action="store_true", default=True,
          help="FA3: int8 MLA latent cache scales (the default)")
    _flag(fa, "--no-fa-quant", dest="fa_quant", action="store_false", help="W8A8 only, no FA3")
    _flag(ap, "--fa-exclude-layers", type=_layers, default=(), help="layers kept out of FA3, e.g. 0,1,2,46")
    _flag(ap, "--dynamic", action="store_true", help="every quantized linear W8A8_DYNAMIC")
    _flag(ap, "--mindie-format", action="store_true", help="add MindIE's config.json keys (and model_type deepseekv2)")
    _flag(ap, "--smooth", action="store_true", help="anti-outlier smoothing (SmoothQuant + latent), format unchanged")
    _flag(ap, "--smooth-alpha", type=float, default=0.5)
    _flag(ap, "--quantize-mtp", action="store_true", help="quantize the MTP layer too (default: FLOAT)")
    _flag(ap, "--dialect", choices=("seed", "ascendV1"), default="seed",
          help="seed: the legacy msModelSlim/MindIE layout (default); ascendV1: msModelSlim's newer saver")
    _flag(ap, "--batch-size", type=int, default=1,
          help="accepted for msModelSlim compatibility; statistics are always taken per sample (batch of one)")
    _flag(ap, "--max-calib-tokens", type=int, default=2048, help="longest calibration sample allowed")
    _flag(ap, "--truncate", action="store_true", help="cut longer calibration samples instead of failing")
    _flag(ap, "--shard-size-gb", type=float, default=4.0, help="weight shard size limit in GiB")
    _flag(ap, "--overwrite", action="store_true", help="replace an existing output in --save-path")
    _flag(ap, "--device", default=None, help="cpu or cuda (default: cuda when present)")
    _flag(ap, "--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.checkpoint import CheckpointError
    from pipeline.config import ConfigError
    from pipeline.embedded import EMBEDDED_MODEL_DIR
    from pipeline.loading import default_device
    from pipeline.quant.calib_data import CalibDataError
    from pipeline.quant.qparams import QuantError
    from pipeline.quant.recipe import Recipe
    from pipeline.quant.run import QuantizeOptions, quantize_checkpoint

    src = args.model_path or EMBEDDED_MODEL_DIR
    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        recipe = Recipe(fa_quant=args.fa_quant, dynamic=args.dynamic, fa_exclude_layers=args.fa_exclude_layers,
                        quantize_mtp=args.quantize_mtp, dialect=args.dialect, smooth=args.smooth)
        opts = QuantizeOptions(calib_path=args.calib_data, max_calib_tokens=args.max_calib_tokens,
                               truncate=args.truncate, smooth_alpha=args.smooth_alpha,
                               mindie_format=args.mindie_format, overwrite=args.overwrite,
                               shard_bytes=int(args.shard_size_gb * 1024 ** 3),
                               device=args.device or default_device(), progress=not args.no_progress)
        quantize_checkpoint(src, args.save_path, recipe, opts)
    except (CheckpointError, ConfigError, CalibDataError, QuantError, FileExistsError, FileNotFoundError,
            ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done: {args.save_path} (check it with: python -m jobs.check {args.save_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
