"""Write an outlier-bearing variant of a checkpoint that computes the same logits, bit for bit.

    python -m jobs.make_outlier_variant --model-path SRC --save-path DST [--seed S] [--channels K]
        [--factor-log2 4..6] [--norms all | input,post_attention,q_a,kv_a,mtp_enorm,mtp_hnorm,mtp_head[:K]]
        [--layers 0,1,2] [--shared-channels] [--overwrite] [--no-check]

Per layer and per RMSNorm, K channels of the norm's weight are multiplied by 2^e (e drawn from the
--factor-log2 range) and the matching input columns of every linear reading that norm divided by 2^e
(pipeline/quant/evaluation/outlier_variant.py says which). The variant is checked against the source (logits and MTP
logits, float32 and the model dtype, bit for bit) before it is moved into DST, with outlier_variant.json
recording every change. SRC: any DeepSeek-V3-format checkpoint (bf16, fp16, fp32, or FP8, written
dequantized); default: the embedded model. Exit status: 0 written, 2 bad input (one line naming it).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Sequence

from jobs.quantize import _flag, _layers


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.make_outlier_variant", description=__doc__.split("\n")[0])
    _flag(ap, "--model-path", default=None, help="source checkpoint; None: the embedded model")
    _flag(ap, "--save-path", required=True, help="directory of the variant (required; no default)")
    _flag(ap, "--seed", type=int, default=0, help="seed of the channel and factor draws")
    _flag(ap, "--channels", type=int, default=4, help="channels per norm (unless --norms gives a count)")
    _flag(ap, "--factor-log2", default="4..6", help="exponent range LO..HI (or one N) of the power-of-two factors")
    _flag(ap, "--norms", default="all",
          help="norms to change, comma-separated, each optionally NAME:K: input, post_attention, q_a, kv_a, "
               "mtp_enorm, mtp_hnorm, mtp_head, or all")
    _flag(ap, "--layers", type=_layers, default=None, help="layers to change, e.g. 0,1,2; None: every layer, MTP included")
    _flag(ap, "--shared-channels", action="store_true",
          help="the same channels of a norm kind in every layer (one draw per kind), as DeepSeek's outliers sit")
    _flag(ap, "--overwrite", action="store_true", help="replace an existing --save-path (kept until the new one passes)")
    _flag(ap, "--no-check", action="store_true", help="skip the logits check (it loads both models twice)")
    _flag(ap, "--shard-size-gb", type=float, default=4.0, help="weight shard size limit in GiB")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from jobs.quantize import error_line, job_errors
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.evaluation.outlier_variant import VariantSpec, parse_log2_range, parse_norms
    from pipeline.quant.evaluation.variant_writer import RECORD_NAME, write_variant

    src = args.model_path or EMBEDDED_MODEL_DIR
    try:
        if args.channels < 0:
            raise ValueError(f"--channels must be >= 0, got {args.channels}")
        if not 0 < args.shard_size_gb < math.inf:
            raise ValueError(f"--shard-size-gb must be a finite number > 0, got {args.shard_size_gb}")
        spec = VariantSpec(seed=args.seed, channels=parse_norms(args.norms, args.channels),
                           log2_range=parse_log2_range(args.factor_log2), layers=args.layers,
                           shared_channels=args.shared_channels)
        record = write_variant(src, args.save_path, spec, overwrite=args.overwrite, check=not args.no_check,
                               shard_bytes=int(args.shard_size_gb * 1024 ** 3))
    except job_errors() as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    s = record["summary"]
    checked = "logits identical to the source" if "check" in record else "not checked"
    ratios = [c["outlier_ratio"] for c in record["changes"] if c.get("outlier_ratio") is not None]
    stand = f"; picked channels stand out {min(ratios):.3g}x to {max(ratios):.3g}x the median channel" if ratios else ""
    print(f"done: {args.save_path}: {s['channels']} channels of {s['norms']} norms, {s['linears']} linears "
          f"({checked}{stand}; see {RECORD_NAME})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
