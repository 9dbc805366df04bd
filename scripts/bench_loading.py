"""Peak and steady memory of the engine loading a model directory (issue: loading at real width).

For each model directory (a quantized output or a float checkpoint: loader.load_model takes either), in a
fresh process each: the tensors' bytes (the MTP layer left out unless --mtp), the peak RSS while it loads,
the RSS after one decode step, and what the replica's check before loading (pipeline/engine/worker/memory.py)
said it would need. Writes
benchmarks/loading.json (--out) and prints one line per model. ``--tp N``: a sharded replica's N ranks
instead (tensor parallel, one process each joined by gloo on this machine: shard_loader.load_sharded),
each rank's peak while loading, RSS after one step together and resident bytes.

    python scripts/bench_loading.py /data/rw-q [/data/rw-bf16 ...] [--mtp | --also-mtp] [--tp N] [--out benchmarks/loading.json]

The float engine on a bf16 checkpoint at real width, without and with its MTP layer:

    python scripts/bench_loading.py /work/ckpt/rw-3l-16e --also-mtp --out benchmarks/loading_float.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, torch
from pipeline.engine.worker.loader import load_model
from pipeline.engine.worker import memory

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

path, mtp = sys.argv[1], sys.argv[2] == "1"
w = memory.tensor_bytes(path, mtp)
base = status("VmRSS:")
t = time.perf_counter()
m = load_model(path, with_mtp=mtp)
load_s = time.perf_counter() - t
peak = status("VmHWM:")
with torch.no_grad():
    m.model(torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({"weights_bytes": w.total, "estimate_bytes": w.need, "start_rss_bytes": base,
                  "peak_loading_bytes": peak, "steady_bytes": status("VmRSS:"), "load_s": round(load_s, 1)}))
"""


RANK = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from pipeline.engine.sharding.comm import Comm
from pipeline.engine.sharding.shard_loader import load_sharded, resident_bytes
from pipeline.parallel import ParallelConfig

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

path, mtp, tp, rank, init = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
comm = Comm.init(ParallelConfig(tp=tp), rank, init)
t = time.perf_counter()
m = load_sharded(path, comm, with_mtp=mtp)
load_s = time.perf_counter() - t
peak = status("VmHWM:")
with torch.no_grad():
    m.model(torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({"rank": rank, "resident_bytes": resident_bytes(m.model), "peak_loading_bytes": peak,
                  "steady_bytes": status("VmRSS:"), "load_s": round(load_s, 1)}))
"""


def measure_sharded(path: str, mtp: bool, tp: int) -> dict:
    """Each rank of a tp replica (RANK, one process each: a step runs on all of them together)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DSQUANT_SKIP_MEMORY_CHECK="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, path, "1" if mtp else "0", str(tp), str(r),
                               f"tcp://127.0.0.1:{port}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(tp)]
    ranks = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"error: {path}: a rank's load failed: {err.strip().splitlines()[-1:]}")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    return {"model": path, "with_mtp": mtp, "tp": tp, "ranks": ranks}


def measure(path: str, mtp: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, "1" if mtp else "0"], cwd=REPO, capture_output=True,
                         text=True, env=dict(os.environ, DSQUANT_SKIP_MEMORY_CHECK="1"))
    if out.returncode:
        raise SystemExit(f"error: {path}: the load failed: {out.stderr.strip().splitlines()[-1:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    w = r["weights_bytes"]
    r.update(model=path, with_mtp=mtp, peak_x=round(r["peak_loading_bytes"] / w, 3),
             steady_x=round(r["steady_bytes"] / w, 3), estimate_x_peak=round(r["estimate_bytes"] / r["peak_loading_bytes"], 3))
    return r


def report(r: dict) -> dict:
    print(f"{r['model']}{' with MTP' if r['with_mtp'] else ''}: weights {r['weights_bytes'] / 1e9:.2f} GB, peak while "
          f"loading {r['peak_loading_bytes'] / 1e9:.2f} GB ({r['peak_x']}x), after a step {r['steady_bytes'] / 1e9:.2f} "
          f"GB ({r['steady_x']}x), the check said {r['estimate_bytes'] / 1e9:.2f} GB, loaded in {r['load_s']} s")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="quantized output directories or float checkpoints")
    ap.add_argument("--mtp", action="store_true", help="load the MTP layer too")
    ap.add_argument("--also-mtp", action="store_true", help="measure each model without, then with its MTP layer")
    ap.add_argument("--tp", type=int, default=1, help="measure each rank of a replica sharded over this many "
                                                      "tensor-parallel ranks (processes on this machine)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "loading.json"))
    args = ap.parse_args(argv)
    rows = []
    for path in args.models:
        if args.tp > 1:
            rows.append(measure_sharded(path, args.mtp, args.tp))
            for r in rows[-1]["ranks"]:
                print(f"{path}: tp {args.tp} rank {r['rank']}: holds {r['resident_bytes'] / 1e9:.2f} GB, peak while "
                      f"loading {r['peak_loading_bytes'] / 1e9:.2f} GB, after a step {r['steady_bytes'] / 1e9:.2f} GB, "
                      f"loaded in {r['load_s']} s")
            continue
        for mtp in ([False, True] if args.also_mtp else [args.mtp]):
            rows.append(report(measure(path, mtp)))
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "when": time.strftime("%Y-%m-%d"), "goal": "peak <= 1.3x weights + 2 GB",
                                          "runs": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
