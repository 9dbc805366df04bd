"""Benchmark: the full quantization job (calibration + quantization + write), single process against the
distributed job on a local Ray, on the FP8 checkpoint with DeepSeek-V3's real layer shapes that
scripts/bench_quantize_weights.py generates (hidden 7168, MLA 1536/512/64, experts of 2048).

    python scripts/bench_distributed.py [--layers 4] [--experts 8] [--samples 4] [--tokens 64]
                                        [--stages 2] [--repeat 1] [--dir /tmp/dsquant-bench] [--out FILE]

Each run is a fresh process with the source evicted from the page cache first (as in the weight-phase
benchmark). The single-process run uses every core in one process; the distributed run starts a local Ray
with one CPU per stage actor (``--stages`` actors; the driver only orchestrates). Calibration uses
``--samples`` texts of the embedded calibration set cut to ``--tokens`` tokens (the model is random, so
only the cost matters). Figures: wall time per phase, and the overlap achieved: for each phase, the sum of
the actors' busy seconds over the phase's wall time (1.0: one actor at a time; 2.0: two actors busy
throughout). Writes JSON to --out (default benchmarks/distributed.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import write_result  # noqa: E402
sys.path.insert(0, str(REPO / "scripts"))


def prepare(args) -> tuple[Path, Path]:
    """The generated checkpoint (with the embedded model's tokenizer copied in) and the calibration file."""
    from bench_quantize_weights import generate

    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.calibration.calib_data import load_texts

    src = Path(args.dir) / f"v3shapes-L{args.layers}-E{args.experts}-fp8"
    if not (src / "model.safetensors.index.json").exists():
        print(f"generating {src} ...", flush=True)
        generate(src, args.layers, args.experts)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(EMBEDDED_MODEL_DIR) / f, src / f)
    calib = Path(args.dir) / f"calib-{args.samples}.json"
    calib.write_text(json.dumps(load_texts(None)[: args.samples]))
    return src, calib


def child(which: str, src: str, dst: str, calib: str, tokens: int, stages: int) -> None:
    import torch

    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint

    opts = QuantizeOptions(calib_path=calib, max_calib_tokens=tokens, truncate=True, overwrite=True)
    t = time.perf_counter()
    if which == "single":
        torch.set_num_threads(os.cpu_count() or 2)
        s = quantize_checkpoint(src, dst, Recipe(), opts, log=lambda m: None)
        res = {"seconds": time.perf_counter() - t,
               "phases": {"calibration_s": s["calibration_s"], "weights_s": s["quantize_write_s"]}}
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        from actors.quantize.quantize_job import quantize_distributed
        from actors.quantize.ray_session import DistOptions

        s = quantize_distributed(src, dst, Recipe(), opts, DistOptions(stages=stages, ray_logs=False, progress_s=600),
                                 log=lambda m: None)
        cal = s["phases"].get("calibration_stats_s", 0.0)
        busy = [a.get("busy_s", {}) for a in s["actors"]]
        res = {"seconds": time.perf_counter() - t, "phases": s["phases"],
               "overlap": {"load": round(sum(b.get("load", 0) for b in busy) / max(s["phases"]["load_s"], 1e-9), 2),
                           "calibration": round(sum(b.get("forward", 0) for b in busy) / max(cal, 1e-9), 2),
                           "weights": round(sum(b.get("weights", 0) for b in busy) / max(s["phases"]["weights_s"], 1e-9), 2)},
               "actors_peak_rss_gib": [round(a.get("peak_rss", 0) / 2**30, 2) for a in s["actors"]],
               "stages": s["stages"]}
    import resource

    res["driver_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(res))


def run_child(which: str, src: Path, dst: Path, calib: Path, args) -> dict:
    from bench_quantize_weights import drop_from_page_cache

    shutil.rmtree(dst, ignore_errors=True)
    drop_from_page_cache(src)
    out = subprocess.run([sys.executable, __file__, "--child", which, str(src), str(dst), str(calib),
                          str(args.tokens), str(args.stages)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{which} run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dir", default="/tmp/dsquant-bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "distributed.json"))
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        which, src, dst, calib, tokens, stages = args.child
        child(which, src, dst, calib, int(tokens), int(stages))
        return 0
    src, calib = prepare(args)
    runs: dict[str, list[dict]] = {"single": [], "distributed": []}
    for _ in range(args.repeat):
        for which in runs:
            runs[which].append(run_child(which, src, Path(args.dir) / f"out-{which}", calib, args))
            print(which, json.dumps(runs[which][-1]), flush=True)
    a, b = (Path(args.dir) / "out-single", Path(args.dir) / "out-distributed")
    same = all((a / f.name).read_bytes() == f.read_bytes() for f in b.glob("*.safetensors"))
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    res = {"checkpoint": {"layers": args.layers, "experts": args.experts,
                          "fp8_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors"))},
           "calibration": {"samples": args.samples, "tokens_per_sample": args.tokens},
           "stages": args.stages, "repeat": args.repeat, "machine": {"cpus": os.cpu_count()},
           "single_s": round(med["single"], 2), "distributed_s": round(med["distributed"], 2),
           "speedup": round(med["single"] / med["distributed"], 2), "identical_shards": same, "runs": runs}
    write_result(args.out, res, hide=["runs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
