"""Peak memory and time of the quantize job on real-width checkpoints, against the job's own estimate
(issue: the quantize job at real width).

For each source checkpoint (``jobs.make_checkpoint``, bf16 or FP8), ``python -m jobs.quantize`` runs in a
fresh process (the calibration texts of --calib-data, the recipe flags of --args) while this script samples
its RSS; the peak is the child's own high-water mark (getrusage of a fresh runner, so runs do not mix).
Beside it: the largest layer's bf16 bytes (the headers, through the planner's cost model), the goal
(2 x that + 2 GB), and the estimate the job printed before it ran (memory and time). Writes
benchmarks/quantize_memory.json (--out) and prints one line per checkpoint.

    python scripts/bench_quantize_memory.py /data/rw-3l-16e /data/rw-6l-32e-fp8 --calib-data calib.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
FIXED_GOAL_BYTES = 2 * GB      # the goal's fixed part: peak <= 2 x the largest layer in bf16 + 2 GB


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def run_child(cmd: list[str]) -> None:
    """The runner: start the job, sample its RSS each 0.5 s, print a JSON line with the peak and timeline."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timeline: list[tuple[float, int]] = []

    def sample() -> None:
        while proc.poll() is None:
            timeline.append((round(time.perf_counter() - t0, 1), rss_of(proc.pid)))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log = proc.stdout.read()
    rc = proc.wait()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_bytes": peak,
                      "timeline": timeline[::max(1, len(timeline) // 200)], "log": log}))


def layer_bytes(path: str) -> dict:
    """The largest layer's bytes in bf16 (FP8 weights dequantized, scales left out) and the source's shape,
    from the headers."""
    import math

    from pipeline import layout
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.io.safetensors_io import itemsize

    reader = CheckpointReader(path)
    cfg = reader.config
    per_layer: dict[int, int] = {}
    fp8 = False
    for n in reader.tensor_names():
        lid = layout.layer_of(n)
        dt, shape = reader.header(n)
        fp8 |= dt == "F8_E4M3"
        if lid is not None and not n.endswith("_scale_inv"):
            per_layer[lid] = per_layer.get(lid, 0) + math.prod(shape) * (2 if dt == "F8_E4M3" else itemsize(dt))
    return {"layers": cfg.num_hidden_layers, "mtp_layers": len(cfg.mtp_layer_ids),
            "experts": cfg.n_routed_experts, "source": "fp8" if fp8 else "bf16",
            "largest_layer_bf16_bytes": max(per_layer.values())}


def parse_estimate(log: str) -> dict:
    out = {}
    m = re.search(r"memory: peak ~([\d.]+) GB", log)
    if m:
        out["estimate_peak_bytes"] = float(m.group(1)) * GB
    m = re.search(r"total: ~([\d.]+) (s|min|h)", log)
    if m:
        out["estimate_s"] = float(m.group(1)) * {"s": 1, "min": 60, "h": 3600}[m.group(2)]
    return out


def measure(path: str, calib: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-qmem-") as tmp:
        cmd = [sys.executable, "-m", "jobs.quantize", "--model-path", path, "--save-path", f"{tmp}/out",
               "--calib-data", calib, "--no-progress", *args]
        out = subprocess.run([sys.executable, __file__, "--child", shlex.join(cmd)], cwd=REPO,
                             capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: {path}: the runner failed: {out.stderr.strip().splitlines()[-1:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["rc"]:
        raise SystemExit(f"error: {path}: jobs.quantize exited {r['rc']}: {r['log'].strip().splitlines()[-1:]}")
    shape = layer_bytes(path)
    goal = 2 * shape["largest_layer_bf16_bytes"] + FIXED_GOAL_BYTES
    est = parse_estimate(r["log"])
    row = {"model": path, "args": args, **shape, "peak_rss_bytes": r["peak_rss_bytes"], "goal_bytes": goal,
           "peak_over_goal": round(r["peak_rss_bytes"] / goal, 3), "wall_s": r["wall_s"], **est,
           "timeline_s_rss": r["timeline"]}
    if "estimate_peak_bytes" in est:
        row["estimate_peak_over_measured"] = round(est["estimate_peak_bytes"] / r["peak_rss_bytes"], 3)
    if "estimate_s" in est:
        row["estimate_s_over_measured"] = round(est["estimate_s"] / r["wall_s"], 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="source checkpoint directories (jobs.make_checkpoint)")
    ap.add_argument("--calib-data", help="calibration texts for the job (.json list of strings)")
    ap.add_argument("--args", default="--fa-quant", help="extra jobs.quantize flags, one string (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "quantize_memory.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        run_child(shlex.split(a.child))
        return 0
    if not a.models or not a.calib_data:
        ap.error("give the source checkpoints and --calib-data")
    rows = []
    for m in a.models:
        r = measure(m, a.calib_data, shlex.split(a.args))
        rows.append(r)
        print(f"{m}: {r['layers']} layers x {r['experts']} experts ({r['source']}), "
              f"layer {r['largest_layer_bf16_bytes'] / GB:.2f} GB bf16: peak {r['peak_rss_bytes'] / GB:.2f} GB "
              f"(goal {r['goal_bytes'] / GB:.2f} GB, "
              f"estimate {r.get('estimate_peak_bytes', 0) / GB:.2f} GB), {r['wall_s']:.0f} s "
              f"(estimate {r.get('estimate_s', 0):.0f} s)", flush=True)
    doc = {"script": "scripts/bench_quantize_memory.py", "machine": {"cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "loadavg_start": open("/proc/loadavg").read().split()[:3]},
           "fixed_goal_bytes": FIXED_GOAL_BYTES, "runs": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
