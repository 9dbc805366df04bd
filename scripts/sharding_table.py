"""The 671B model sharded on paper (pipeline.serving.sharding.plan): per-rank weights, KV capacity and the bytes a
decode step communicates, for the layouts of pipeline.serving.sharding.plan.LAYOUTS, from DeepSeek-V3's config
alone (no weight read). Prints the table and writes benchmarks/sharding_671b.json and .md.

    .venv/bin/python scripts/sharding_table.py [--out-dir benchmarks] [--reserve-gb 4] [--usable 0.9]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import DeepseekV3Config  # noqa: E402
from pipeline.serving.sharding import plan as S  # noqa: E402
from pipeline.serving.sharding.replica import DEEPSEEK_V3_CONFIG  # noqa: E402
from pipeline.quant.recipe.recipe import Recipe  # noqa: E402

RECIPES = {
    "default": (Recipe(), "The project's default recipe (jobs.quantize without flags, seed dialect): FA3 on "
                          "every main layer, the MTP layer FLOAT (bf16 weights, bf16 latent cache)"),
    "quantize_mtp": (Recipe(quantize_mtp=True), "--quantize-mtp: the MTP layer quantized by the same rules, "
                                                "with FA3 (640 B per token on all 62 cached layers)"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "benchmarks"))
    ap.add_argument("--usable", type=float, default=S.USABLE_FRACTION, help="usable fraction of device memory")
    ap.add_argument("--reserve-gb", type=float, default=S.RESERVE_BYTES / S.GB,
                    help="activation / workspace reserve per rank, GB (10^9 B)")
    ap.add_argument("--min-kv-tokens", type=int, default=S.MIN_KV_TOKENS)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = DeepseekV3Config.from_dict(DEEPSEEK_V3_CONFIG)
    kw = dict(usable_fraction=args.usable, reserve_bytes=int(args.reserve_gb * S.GB), min_kv_tokens=args.min_kv_tokens)
    results = {k: [S.plan_layout(cfg, lay, recipe=r, **kw) for lay in S.LAYOUTS] for k, (r, _) in RECIPES.items()}
    seconds = time.perf_counter() - t0

    default = results["default"]
    head = (f"DeepSeek-V3/R1 671B (pipeline.serving.sharding.replica.DEEPSEEK_V3_CONFIG), W8A8 + FA3 as this project writes it. "
            f"Whole quantized model: {default[0].model_bytes / S.GB:,.1f} GB with the default recipe, "
            f"{results['quantize_mtp'][0].model_bytes / S.GB:,.1f} GB with --quantize-mtp (MTP layer included in "
            f"both). Usable memory {args.usable:g} x the device's nominal GB, minus a {args.reserve_gb:g} GB "
            f"reserve per rank; minimum KV room: {args.min_kv_tokens} tokens per dp group. KV per token: "
            f"{default[0].kv_bytes_per_token} B (default recipe: 61 x 640 + 1152 for the FLOAT MTP layer), "
            f"{results['quantize_mtp'][0].kv_bytes_per_token} B with --quantize-mtp, "
            f"{default[0].kv_bytes_per_token_bf16} B all-bf16. GB = 10^9 B; comm in KB = 10^3 B per rank per "
            f"token of the decode step (payload, and in parentheses what a ring moves).")
    md = ["# The 671B model sharded on paper", "", "Written by `scripts/sharding_table.py` "
          "(`pipeline/serving/sharding/plan.py`; definitions in its module doc and those of `placement.py` and "
          "`collectives.py` beside it).", "", head, "",
          "## Default recipe", "", RECIPES["default"][1] + ".", "", S.to_markdown(default),
          "## With --quantize-mtp", "", RECIPES["quantize_mtp"][1] + ".", "",
          S.to_markdown(results["quantize_mtp"], collectives=False)]
    text = "\n".join(md)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharding_671b.md").write_text(text)
    payload = {
        "model": "DeepSeek-V3 671B (pipeline.serving.sharding.replica.DEEPSEEK_V3_CONFIG)",
        "assumptions": {"usable_fraction": args.usable, "reserve_bytes": kw["reserve_bytes"],
                        "min_kv_tokens": args.min_kv_tokens, "gb": S.GB,
                        "comm": "bytes per rank per token of a decode step (one token per dp group); payload and "
                                "ring-moved (all-reduce 2(n-1)/n, all-gather (n-1)/n of the gathered tensor); "
                                "expert token slots in expectation under uniform routing"},
        "recipes": {k: {"recipe": r.to_dict(), "note": note, "plans": [p.to_dict() for p in results[k]]}
                    for k, (r, note) in RECIPES.items()},
        "seconds": round(seconds, 2),
    }
    (out / "sharding_671b.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(text)
    print(f"wrote {out / 'sharding_671b.json'} and {out / 'sharding_671b.md'} ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
