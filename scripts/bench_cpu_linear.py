"""Per-call time of the engine's int8 linears and routed MoE on the CPU: the torch path against the C kernels.

    python scripts/bench_cpu_linear.py [--model-dir DIR] [--threads 1,2] [--reps 200] [--out FILE]

Linears: every distinct (kind, in, out) shape of the embedded model's quantized linears at m = 1, 8, 16,
64, 128, 512, 2048 rows of float32 input, plus a DeepSeek-V3-wide one (7168 -> 1536, W8A8_DYNAMIC, random
int8) at m <= 128: the module's forward on the torch path (``kernel="int_mm"``: quantize, ``torch._int_mm``,
the float64 epilogue, casts) and the fused C call (``kernel="native"``), and ``torch._int_mm`` alone on the
same int8 rows (the integer product only). MoE: layer 1's ``Int8MoE.forward`` on 1, 8, 16, 64, 512 tokens
with ``DSQUANT_KERNELS=torch`` and the default (native). For each torch thread count in ``--threads``.
Medians of ``--reps`` calls (fewer for big ones) after a warm-up, in microseconds; /proc/loadavg before
and after each part (the 2 cores are shared with other work: read the figures with it).
Writes JSON to --out (default benchmarks/cpu_linear.json; on an AVX2 machine without AVX-512, ``--out
benchmarks/cpu_linear_avx2.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import loadavg, median_us, write_result  # noqa: E402

ROWS = (1, 8, 16, 64, 128, 512, 2048)
WIDE_ROWS = (1, 8, 16, 64, 128)
MOE_TOKENS = (1, 8, 16, 64, 512)


def _reps(reps: int, macs: float) -> int:
    """Fewer calls for big products: about ``reps`` calls of a 2^24-MAC product's time, 5 at least."""
    return max(5, min(reps, int(reps * 2 ** 24 / max(macs, 1))))


def linears(model_dir: str, reps: int) -> list[dict]:
    import torch

    from pipeline.engine.worker.loader import load_quantized
    from pipeline.engine.layers.qlinear import Int8Linear, W8A8DynamicLinear

    model = load_quantized(model_dir, fuse_moe=False).model
    seen, mods = set(), []
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear) and (m.kind, m.in_features, m.out_features) not in seen:
            seen.add((m.kind, m.in_features, m.out_features))
            mods.append((name, m))
    g = torch.Generator().manual_seed(0)
    wide = W8A8DynamicLinear("v3.q_a_like", torch.randint(-128, 128, (1536, 7168), dtype=torch.int8, generator=g),
                             torch.rand(1536, 1, generator=g) * 1e-3)
    mods.append(("deepseek-v3 7168 -> 1536 (random)", wide))
    out = []
    for name, m in mods:
        for rows in (ROWS if m is not wide else WIDE_ROWS):
            x = torch.randn(rows, m.in_features, generator=g)
            x_q = torch.randint(-128, 128, (rows, m.in_features), dtype=torch.int8, generator=g)
            r = _reps(reps, rows * m.in_features * m.out_features)
            row = {"linear": name, "kind": m.kind, "k": m.in_features, "n": m.out_features, "m": rows}
            for kernel in ("int_mm", "native"):
                m.kernel = kernel
                with torch.no_grad():
                    row[f"{kernel}_forward_us"] = median_us(lambda: m(x), r)
            row["int_mm_alone_us"] = median_us(lambda: torch._int_mm(x_q, m.weight.t()), r)
            m.kernel = "auto"
            row["speedup"] = round(row["int_mm_forward_us"] / row["native_forward_us"], 2)
            print(f"{name:45s} {m.kind:13s} {m.in_features:5d}->{m.out_features:5d} m={rows:3d}: torch "
                  f"{row['int_mm_forward_us']:8.1f} us  native {row['native_forward_us']:8.1f} us  (_int_mm alone "
                  f"{row['int_mm_alone_us']:8.1f})  x{row['speedup']}", flush=True)
            out.append(row)
    return out


def moe(model_dir: str, reps: int) -> list[dict]:
    import torch

    from pipeline.engine.worker.loader import load_quantized
    from pipeline.engine.layers.moe import Int8MoE

    model = load_quantized(model_dir).model
    layer = next(m for m in model.modules() if isinstance(m, Int8MoE))
    g = torch.Generator().manual_seed(1)
    out = []
    for n in MOE_TOKENS:
        x = torch.randn(1, n, model.config.hidden_size, generator=g)
        row = {"tokens": n}
        for label, env in (("torch", "torch"), ("native", "")):
            os.environ["DSQUANT_KERNELS"] = env
            with torch.no_grad():
                row[f"{label}_us"] = median_us(lambda: layer(x), _reps(reps, n * 2 ** 22))
        os.environ.pop("DSQUANT_KERNELS")
        row["speedup"] = round(row["torch_us"] / row["native_us"], 2)
        print(f"MoE layer, {n:3d} tokens: torch {row['torch_us']:8.1f} us  native {row['native_us']:8.1f} us  "
              f"x{row['speedup']}", flush=True)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-dir", default=str(REPO / "out" / "dsv3-tiny-pydoc-w8a8-fa3"),
                    help="a quantized directory (python -m jobs.quantize writes this one)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated (the engine profile uses 1)")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per figure")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "cpu_linear.json"), help="JSON output")
    args = ap.parse_args()

    import torch

    from pipeline.engine.native import cpu_linear

    if os.environ.get("DSQUANT_KERNELS", "") not in ("", "auto"):
        raise SystemExit("unset DSQUANT_KERNELS: the script switches it itself")
    if not (Path(args.model_dir) / "quant_model_description.json").exists():
        raise SystemExit(f"{args.model_dir}: no quantized model (run: python -m jobs.quantize --overwrite)")
    res = {"kernel": cpu_linear.status(), "reps": args.reps, "auto_rows_with_threads": {"max_rows": cpu_linear.MAX_ROWS,
           "min_rows": cpu_linear.MIN_ROWS, "max_macs": cpu_linear.MAX_MACS}, "runs": []}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        run = {"threads": threads, "loadavg_before": loadavg()}
        print(f"{cpu_linear.status()}; torch threads {threads}; loadavg {run['loadavg_before']}", flush=True)
        run["linears"] = linears(args.model_dir, args.reps)
        run["loadavg_after_linears"] = loadavg()
        run["moe"] = moe(args.model_dir, args.reps)
        run["loadavg_after"] = loadavg()
        res["runs"].append(run)
    write_result(args.out, res, hide=("runs",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
