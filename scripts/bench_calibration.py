"""Benchmark: the calibration forward of ``jobs.quantize``, fp32 products (the default) against the reference
mode (``--calib-products model``: torch's bf16 matmuls), on the embedded model (its default recipe: static
W8A8 attention + FA3, 64 calibration texts) and on a generated bf16 checkpoint with DeepSeek-V3's layer
shapes (scripts/bench_vs_llmcompressor.py's: hidden 7168, 128 heads, expert width 2048; ``--dynamic`` with
FA3, the first --calib default texts).

    python scripts/bench_calibration.py [--rounds 3] [--calib 16] [--layers 4] [--experts 8]
        [--dir /tmp/dsquant-calib] [--keep] [--out benchmarks/calibration.json]

Each run is a fresh ``python -m jobs.quantize`` process from a cold page cache, timed from here (wall, peak
RSS) with the job's own split (``calibration_s``: seconds in the forwards); the modes alternate within each
round, and the figures are medians with ranges. Then the outputs of the two modes are compared tensor by
tensor: which tensors differ and by how much (the weights never do; a static input scale or an FA3 scale
may move where an fp32 sum rounds to the other bf16 neighbour).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import write_result  # noqa: E402
from bench_vs_llmcompressor import calib_file, generate, loadavg, our_phases, timed  # noqa: E402

MODES = ("fp32", "model")


def differences(a: Path, b: Path) -> dict:
    """Tensors of two outputs that differ: name -> (elements that differ, max |a - b| / max |a|)."""
    import torch
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(a.glob("*.safetensors")):
        ta, tb = load_file(str(f)), load_file(str(b / f.name))
        for k, x in ta.items():
            y = tb[k]
            if x.shape != y.shape or not torch.equal(x, y):
                xd, yd = x.double(), y.double()
                rel = float((xd - yd).abs().max() / xd.abs().max().clamp_min(1e-30))
                out[k] = {"elements": int((xd != yd).sum()), "of": x.numel(), "max_rel": round(rel, 5)}
    return out


def summarize(runs: list[dict], key: str) -> dict:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return {"median": round(statistics.median(vals), 2), "range": [round(min(vals), 2), round(max(vals), 2)]} if vals else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--calib", type=int, default=16, help="calibration texts of the V3-shaped runs (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="V3-shaped main layers (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=8, help="V3-shaped routed experts (default: %(default)s)")
    ap.add_argument("--no-v3", dest="v3", action="store_false", help="only the embedded model")
    ap.add_argument("--dir", default="/tmp/dsquant-calib", help="checkpoint and outputs (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the outputs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "calibration.json"), help="(default: %(default)s)")
    args = ap.parse_args()

    from pipeline.assets import EMBEDDED_MODEL_DIR

    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    models = {"embedded": (Path(EMBEDDED_MODEL_DIR), [])}
    if args.v3:
        src = work / "v3-shaped"
        if not src.exists():
            print(f"generating {src}", flush=True)
            generate(src, args.layers, args.experts)
        models["v3_shaped"] = (src, ["--dynamic", "--calib-data", str(calib_file(work, args.calib))])
    runs: dict = {f"{m}_{mode}": [] for m in models for mode in MODES}
    for r in range(args.rounds):
        for m, (src, extra) in models.items():
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                name, dst = f"{m}_{mode}", work / f"{m}-{mode}"
                cmd = [py, "-m", "jobs.quantize", "--model-path", str(src), "--save-path", str(dst), "--overwrite",
                       "--no-progress", "--no-estimate", "--calib-products", mode, *extra]
                res = {**timed(cmd, src, dst, work / f"{name}.log"), **our_phases(dst)}
                runs[name].append(res)
                print(f"round {r + 1} {name}: {res['seconds']:.1f} s (calibration {res.get('calibration_s', 0):.1f} s), "
                      f"load {res['load_before'][0]:.2f}", flush=True)
    result = {
        "what": "jobs.quantize's calibration forward, --calib-products fp32 (default) against model (torch's bf16 "
                "matmuls, the reference mode); fresh processes, cold page cache, modes alternating",
        "machine": {"cpus": __import__("os").cpu_count(), "load_at_end": loadavg()},
        "v3_shaped": {"layers": args.layers, "experts": args.experts, "calib_texts": args.calib} if args.v3 else None,
        "summary": {name: {"seconds": summarize(rs, "seconds"), "calibration_s": summarize(rs, "calibration_s"),
                           "peak_rss_gib": summarize(rs, "peak_rss_gib")} for name, rs in runs.items()},
        "speedup_calibration": {m: round(statistics.median(r["calibration_s"] for r in runs[f"{m}_model"]) /
                                         statistics.median(r["calibration_s"] for r in runs[f"{m}_fp32"]), 2)
                                for m in models},
        "differences_fp32_vs_model": {m: differences(work / f"{m}-model", work / f"{m}-fp32") for m in models},
        "runs": runs,
    }
    write_result(Path(args.out), result, hide=("runs",))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
