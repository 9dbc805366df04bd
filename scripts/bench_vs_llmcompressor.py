"""Benchmark: ``jobs.quantize`` against llm-compressor's ``model_free_ptq`` and the I/O floor, on one
generated bf16 checkpoint with DeepSeek-V3's real layer shapes (hidden 7168, 128 heads, MLA 1536/512/64,
expert width 2048; layer 0 dense, the rest MoE with --experts routed experts + 1 shared; embeddings and
head cut to 16k rows: scripts/bench_quantize_weights.py's shapes, in bf16 since llm-compressor reads bf16).

    python scripts/bench_vs_llmcompressor.py [--layers 4] [--experts 8] [--rounds 3] [--calib 16,64]
        [--calib-rounds 1] [--llmc-python /tmp/llmc/venv/bin/python] [--dir /tmp/dsquant-vs-llmc] [--keep]

llm-compressor lives in a venv of its own (it pins its own transformers)::

    python3 -m venv /tmp/llmc/venv && /tmp/llmc/venv/bin/pip install torch==2.13.0 && \\
        /tmp/llmc/venv/bin/pip install llmcompressor

The runs, each a fresh process timed by wall clock from here (what a user waits: start-up and imports
included), with its peak RSS (``wait4``) and the disk's read bytes over the run (``/sys/block/*/stat``,
machine-wide, so other work's reads count too):

    io_floor             read every stored tensor, write the same bytes (bench_quantize_weights.io_floor)
    llmcompressor        model_free_ptq(src, dst, scheme="W8A8", ignore=[lm_head, embed_tokens, kv_b_proj,
                         mlp.gate]): int8 per-channel symmetric weights, dynamic per-token int8 activations
    ours_data_free       python -m jobs.quantize --dynamic --no-fa-quant --disable-anti: exactly that scheme (data-free)
    ours_data_free_ray2  the same with --stages 2 (private Ray, 2 stage actors)
    ours_fa3_<n>         python -m jobs.quantize --dynamic (FA3 on) with the first n default calibration texts
    ours_fa3_<n>_two_pass  the same with --two-pass (with --two-pass: the reference, reading the source twice)

Each of our runs also reports the job's own count of the source bytes it read (``bytes_read`` in the
manifest, and ``source_reads``: that over the checkpoint's bytes, 1.0 for one read) and the kernel's
count of the process's reads (``rchar``).

Before every run the page cache is cold: ``sync`` then ``/proc/sys/vm/drop_caches`` when writable (else
``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the checkpoint; the JSON says which). The runs
are interleaved in --rounds rounds (the FA3 runs in the first --calib-rounds only: one is minutes) and
the figures are medians with ranges, with the load average before each run.

Then the int8 weights of both tools are compared tensor by tensor where the arithmetic is the same
(per-channel symmetric int8 of the same bf16 weight): the fraction of equal values and the largest
|difference|, and, on a sample of the weights, each tool's values against three formulas applied to the source's bf16
weight: compressed-tensors' (absmax / 127.5, every step in bf16), ours (msModelSlim's: absmax / 127, every
step in bf16), and absmax / 127 in float32: the formula that gives a tool's values everywhere is its
arithmetic, and the divisor is then the only difference.

Writes the figures to --out (JSON) and a plot to --plot (PNG); deletes the checkpoint and the outputs at
the end unless --keep.
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

IGNORE = ["lm_head", "re:.*embed_tokens$", "re:.*kv_b_proj$", "re:.*mlp\\.gate$"]
LLMC_CODE = """
import json, sys, time
t = time.perf_counter()
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme="W8A8", ignore=json.loads(sys.argv[3]))
print(json.dumps({"inner_s": time.perf_counter() - t}))
"""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# ---------------------------------------------------------------- the checkpoint

def bf16_config(layers: int, experts: int) -> dict:
    from bench_quantize_weights import bench_config

    cfg = bench_config(layers, experts)
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def generate(path: Path, layers: int, experts: int) -> int:
    """A random bf16 checkpoint, one shard per unit (the globals, then each layer), written one unit at
    a time (memory: one layer), with the embedded model's tokenizer (its 4096 ids fit the 16k vocab).
    Returns its bytes."""
    import torch

    from pipeline import layout
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.config import DeepseekV3Config
    from pipeline.io.release_layout.fp8_copy import shard_name
    from pipeline.io.safetensors_io import save_safetensors

    cfg_dict = bf16_config(layers, experts)
    cfg = DeepseekV3Config.from_dict(cfg_dict)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    units = [None] + list(range(layers))
    weight_map, total = {}, 0
    for n, lid in enumerate(units, start=1):
        shapes = layout.global_shapes(cfg) if lid is None else layout.layer_shapes(cfg, lid)
        tensors = {}
        for name, shape in shapes.items():
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.rand(shape, generator=g) * 0.01      # float32 by design
            elif name.endswith("norm.weight"):
                tensors[name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
            else:
                std = 0.02 if len(shape) < 2 or "embed_tokens" in name or "lm_head" in name else shape[-1] ** -0.5
                tensors[name] = torch.randn(shape, generator=g).mul_(std).to(torch.bfloat16)
        fname = shard_name(n, len(units))
        total += save_safetensors(tensors, str(tmp / fname))
        weight_map.update({k: fname for k in tensors})
        del tensors
        print(f"  generated {fname}", flush=True)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    for f in TOKENIZER_FILES:
        shutil.copy(Path(EMBEDDED_MODEL_DIR) / f, tmp / f)
    tmp.rename(path)
    return total


def calib_file(path: Path, n: int) -> Path:
    """The first ``n`` of the default calibration texts (the embedded model's), as a JSON list."""
    from pipeline.quant.calibration.calib_data import load_texts

    texts = load_texts()
    if n > len(texts):
        raise SystemExit(f"--calib {n}: the default calibration data has {len(texts)} texts")
    out = path / f"calib-{n}.json"
    out.write_text(json.dumps(texts[:n]))
    return out


# ---------------------------------------------------------------- one run

def cold_cache(src: Path) -> str:
    """Flush dirty pages and empty the page cache (or evict the source's files from it); says how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        from bench_quantize_weights import drop_from_page_cache

        drop_from_page_cache(src)
        return "posix_fadvise"


def disk_read_bytes() -> int:
    """Bytes read from every non-virtual block device since boot (machine-wide)."""
    total = 0
    for d in Path("/sys/block").iterdir():
        if d.name.startswith(("loop", "zram", "ram", "dm-")):
            continue
        try:
            total += int((d / "stat").read_text().split()[2]) * 512
        except (OSError, IndexError, ValueError):
            pass
    return total


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def timed(cmd: list[str], src: Path, dst: Path, log: Path) -> dict:
    """Run ``cmd`` from a cold cache into a fresh ``dst``: wall seconds, peak RSS, disk reads, load."""
    shutil.rmtree(dst, ignore_errors=True)
    how = cold_cache(src)
    load = loadavg()
    r0 = disk_read_bytes()
    t = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    read = disk_read_bytes() - r0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}; its output: {log}\n{log.read_text()[-3000:]}")
    written = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file() and ".dsquant" not in f.parts)
    return {"seconds": round(wall, 3), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "disk_read_gb": round(read / 1e9, 3),
            "bytes_written": written, "load_before": load, "load_after": loadavg(), "cache": how}


def our_phases(dst: Path) -> dict:
    """The job's own split of its time (single-process: the manifest's job section; Ray: job_summary)."""
    from pipeline.format.description import MANIFEST_NAME

    try:
        summary = dst / "job_summary.json"
        if summary.exists():
            job = json.loads(summary.read_text())
            out = {"phases": job.get("phases", {})}
        else:
            job = json.loads((dst / MANIFEST_NAME).read_text()).get("job", {})
            out = {k: job[k] for k in ("calibration_s", "quantize_write_s") if k in job}
        # the source bytes the job read (its own count, per unit read) and the kernel's count of the
        # process's reads (/proc/self/io rchar: every file, the probe's and the tokenizer's included)
        out.update({k: job[k] for k in ("bytes_read", "rchar") if job.get(k) is not None})
        if "estimate" in job:  # what the job printed before it started (pipeline.quant.job.estimate)
            out["estimate_s"] = job["estimate"]["total_s"]
            out["estimate_probe"] = job["estimate"]["probe"]
        return out
    except (OSError, ValueError):
        return {}


def commands(args, src: Path, work: Path, calib: dict[int, Path]) -> dict[str, tuple[list[str], Path]]:
    py = sys.executable
    ours = [py, "-m", "jobs.quantize", "--model-path", str(src), "--no-progress", "--overwrite", "--dynamic",
            "--disable-anti"]
    out = {
        "io_floor": ([py, __file__, "--child-io", str(src), str(work / "io")], work / "io"),
        "llmcompressor": ([args.llmc_python, "-c", LLMC_CODE, str(src), str(work / "llmc"), json.dumps(IGNORE)],
                          work / "llmc"),
        "ours_data_free": (ours + ["--no-fa-quant", "--save-path", str(work / "ours")], work / "ours"),
    }
    if args.ray:
        out["ours_data_free_ray2"] = (ours + ["--no-fa-quant", "--stages", "2", "--ray-address", "local",
                                              "--save-path", str(work / "ours-ray")], work / "ours-ray")
    for n, f in calib.items():
        out[f"ours_fa3_{n}"] = (ours + ["--calib-data", str(f), "--save-path", str(work / f"fa3-{n}")],
                                work / f"fa3-{n}")
        if args.two_pass:  # the reference calibration (whole float model, then the weights read again)
            out[f"ours_fa3_{n}_two_pass"] = (ours + ["--two-pass", "--calib-data", str(f), "--save-path",
                                                     str(work / f"fa3-{n}-2p")], work / f"fa3-{n}-2p")
    return out


def child_io(src: str, dst: str) -> None:
    from bench_quantize_weights import io_floor

    os.makedirs(dst, exist_ok=True)
    print(json.dumps(io_floor(src, dst)))


# ---------------------------------------------------------------- agreement of the int8 weights

def compare_int8(ours_dir: Path, llmc_dir: Path) -> dict:
    """Every weight both tools stored as int8: the fraction of equal values and the largest |diff|,
    and llm-compressor's values against ours recomputed from the source's bf16 weights with its divisor
    (our int8 * our scale is not needed: the source is read again, per tensor)."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    def get(where: dict[str, Path], name: str) -> torch.Tensor:
        with safe_open(str(where[name]), "pt") as h:
            return h.get_tensor(name)

    a, b = index(ours_dir), index(llmc_dir)
    names = sorted(n for n in a if n.endswith(".weight") and n in b)
    equal = total = 0
    max_diff = 0
    hist: dict[int, int] = {}
    only_ours, only_llmc, int8_names = [], [], []
    for n in names:
        qa, qb = get(a, n), get(b, n)
        if qa.dtype != torch.int8 or qb.dtype != torch.int8:
            if (qa.dtype == torch.int8) != (qb.dtype == torch.int8):
                (only_ours if qa.dtype == torch.int8 else only_llmc).append(n)
            continue
        int8_names.append(n)
        d = (qa.to(torch.int16) - qb.to(torch.int16)).abs()
        equal += int((d == 0).sum())
        total += d.numel()
        max_diff = max(max_diff, int(d.max()))
        for v, c in zip(*torch.unique(d, return_counts=True)):
            hist[int(v)] = hist.get(int(v), 0) + int(c)
    return {"int8_weights_compared": len(int8_names), "values": total,
            "equal_fraction": equal / max(total, 1), "max_abs_diff": max_diff,
            "abs_diff_histogram": {str(k): v for k, v in sorted(hist.items())},
            "int8_only_in_ours": only_ours, "int8_only_in_llmcompressor": only_llmc}


FORMULAS = {
    # both tools compute in the weight dtype (bf16): absmax, scale, division, then round half to even
    "bf16_absmax/127.5": ("bfloat16", 127.5),   # compressed-tensors (llm-compressor)
    "bf16_absmax/127": ("bfloat16", 127.0),     # msModelSlim's and ours
    "fp32_absmax/127": ("float32", 127.0),      # neither: what the compute dtype alone changes
}


def formula_int8(w, dtype_name: str, div: float):
    """clamp(round(w / (absmax_row / div)), -128, 127) with every step in ``dtype_name``; torch.round is
    round-half-to-even, as both tools use it."""
    import torch

    dt = getattr(torch, dtype_name)
    x = w.to(dt)
    scale = x.abs().amax(dim=1, keepdim=True) / torch.tensor(div, dtype=dt)
    return torch.round(torch.clamp(x / scale, -128, 127)).to(torch.int16)


def recompute_check(src: Path, ours_dir: Path, llmc_dir: Path, limit: int = 12) -> dict:
    """For a sample of the weights both tools store as int8 (every k-th such ``*_proj.weight``): each formula of FORMULAS
    applied to the source's bf16 weight, against each tool's stored int8 (fraction equal, max |diff|).
    The formula that gives a tool's values everywhere is that tool's arithmetic; the others show what
    each difference (divisor, compute dtype) accounts for."""
    import torch
    from safetensors import safe_open

    from pipeline.io.checkpoint import CheckpointReader

    reader = CheckpointReader(str(src))

    def files(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    where = {"ours": files(ours_dir), "llmcompressor": files(llmc_dir)}
    def int8(t: str, n: str) -> bool:
        with safe_open(str(where[t][n]), "pt") as h:
            return h.get_slice(n).get_dtype() == "I8"

    names = [n for n in sorted(where["llmcompressor"]) if n.endswith("_proj.weight") and n in where["ours"]
             and int8("ours", n) and int8("llmcompressor", n)]
    pick = names[:: max(1, len(names) // limit)][:limit]
    acc = {(t, f): [0, 0, 0] for t in where for f in FORMULAS}
    for n in pick:
        stored = {}
        for t, fs in where.items():
            with safe_open(str(fs[n]), "pt") as h:
                stored[t] = h.get_tensor(n).to(torch.int16)
        w = reader.read_tensor(n)
        for f, (dt, div) in FORMULAS.items():
            q = formula_int8(w, dt, div)
            for t in where:
                d = (q - stored[t]).abs()
                a = acc[(t, f)]
                a[0] += int((d == 0).sum())
                a[1] += d.numel()
                a[2] = max(a[2], int(d.max()))
    return {"weights_checked": pick, "formula": "clamp(round(w / (absmax_row / div)), -128, 127), every step "
            "in the named dtype, round half to even",
            "against": {t: {f: {"equal_fraction": acc[(t, f)][0] / max(acc[(t, f)][1], 1),
                                "max_abs_diff": acc[(t, f)][2]} for f in FORMULAS} for t in where}}


# ---------------------------------------------------------------- figures

def summarize(runs: list[dict]) -> dict:
    s = [r["seconds"] for r in runs]
    return {"median_s": round(statistics.median(s), 2), "min_s": round(min(s), 2), "max_s": round(max(s), 2),
            "runs_s": s, "peak_rss_gib": max(r["peak_rss_gib"] for r in runs),
            "disk_read_gb_median": round(statistics.median(r["disk_read_gb"] for r in runs), 3),
            "bytes_written": runs[-1]["bytes_written"],
            "load_before": [r["load_before"][0] for r in runs], "extra": [r.get("job", {}) for r in runs]}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["series"])
    sr = res["series"]
    med = [sr[n]["median_s"] for n in names]
    lo = [m - sr[n]["min_s"] for n, m in zip(names, med)]
    hi = [sr[n]["max_s"] - m for n, m in zip(names, med)]
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    colors = ["#888888" if n == "io_floor" else "#d95f02" if n == "llmcompressor" else "#1b9e77" for n in names]
    ax.barh(names, med, xerr=[lo, hi], color=colors, capsize=4)
    ax.set_xscale("log")
    for y, n in enumerate(names):
        runs = len(sr[n]["runs_s"])
        rng = f" ({sr[n]['min_s']:.0f}-{sr[n]['max_s']:.0f})" if runs > 1 else " (1 run)"
        rng += ", earlier run" if sr[n].get("carried_from_earlier_run") else ""
        ax.text(sr[n]["max_s"] * 1.08, y, f"{sr[n]['median_s']:.1f} s{rng}", va="center", fontsize=9)
    ax.invert_yaxis()
    ck = res["checkpoint"]
    loads = [x for v in sr.values() for x in v["load_before"]]
    ax.set_xlabel("wall seconds, cold page cache, log scale (median; bars: min-max over rounds)")
    ax.set_title(f"bf16 DeepSeek-V3-shaped checkpoint, {ck['layers']} layers x {ck['experts']} experts "
                 f"({ck['bytes'] / 1e9:.1f} GB), {res['machine']['cpus']} CPUs, load average "
                 f"{min(loads):.1f}-{max(loads):.1f} (shared)", fontsize=9.5)
    ax.set_xlim(min(sr[n]["min_s"] for n in names) * 0.5, max(sr[n]["max_s"] for n in names) * 3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def carry_over(res: dict, earlier: dict) -> None:
    """Keep an earlier run beside this one: the series this run did not measure (e.g. the minutes-long
    FA3 runs beside a rerun of the fast ones), marked so, and the earlier run's own figures whole."""
    for k, v in earlier["series"].items():
        res["series"].setdefault(k, {**v, "carried_from_earlier_run": True})
    res["earlier_run"] = {k: earlier[k] for k in ("series", "ratios", "goals", "machine") if k in earlier}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="main layers (layer 0 dense) (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--calib", default="16,64",
                    help="calibration sample counts of the FA3 runs, comma-separated; '' for none (default: %(default)s)")
    ap.add_argument("--calib-rounds", type=int, default=1, help="rounds that include the FA3 runs (default: %(default)s)")
    ap.add_argument("--no-ray", dest="ray", action="store_false", help="skip the --stages 2 data-free run")
    ap.add_argument("--two-pass", action="store_true",
                    help="also run each FA3 job with --two-pass (the reference: the checkpoint read twice)")
    ap.add_argument("--llmc-python", default="/tmp/llmc/venv/bin/python",
                    help="the python of llm-compressor's venv (default: %(default)s)")
    ap.add_argument("--dir", default="/tmp/dsquant-vs-llmc", help="checkpoint and outputs (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the outputs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "vs_llmcompressor.json"), help="(default: %(default)s)")
    ap.add_argument("--plot", default=str(REPO / "benchmarks" / "vs_llmcompressor.png"), help="(default: %(default)s)")
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from the figures in --out")
    ap.add_argument("--carry", default=None,
                    help="an earlier result JSON whose series this run does not measure are kept (marked so)")
    ap.add_argument("--child-io", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), Path(args.plot))
        return 0
    if args.child_io:
        child_io(*args.child_io)
        return 0
    if not Path(args.llmc_python).exists():
        raise SystemExit(f"--llmc-python {args.llmc_python}: not found; install llm-compressor as the module doc says")
    llmc_version = subprocess.run([args.llmc_python, "-c", "import importlib.metadata as m; print("
                                   "m.version('llmcompressor'), m.version('compressed-tensors'), m.version('torch'))"],
                                  capture_output=True, text=True, check=True).stdout.split()
    root = Path(args.dir)
    src = root / f"v3shapes-L{args.layers}-E{args.experts}-bf16"
    work = root / "out"
    work.mkdir(parents=True, exist_ok=True)
    if not (src / "config.json").exists():
        print(f"generating {src} ...", flush=True)
        generate(src, args.layers, args.experts)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    calib = {int(n): calib_file(root, int(n)) for n in args.calib.split(",") if n.strip()}
    cmds = commands(args, src, work, calib)
    runs: dict[str, list[dict]] = {k: [] for k in cmds}
    for rnd in range(args.rounds):
        order = [k for k in cmds if not k.startswith("ours_fa3_") or rnd < args.calib_rounds]
        if rnd % 2:  # alternate the order too: no series always runs right after the same one
            order = order[::-1]
        for k in order:
            cmd, dst = cmds[k]
            r = timed(cmd, src, dst, root / f"{k}.log")
            if k.startswith("ours"):
                r["job"] = our_phases(dst)
            runs[k].append(r)
            own = r.get("job", {}).get("bytes_read")
            print(f"round {rnd + 1}/{args.rounds} {k}: {r['seconds']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB, "
                  f"read {r['disk_read_gb']:.2f} GB (disk)" + (f", {own / 1e9:.2f} GB (the job's count)" if own else "")
                  + f", load {r['load_before'][0]:.2f} ({r['cache']})", flush=True)
    series = {k: summarize(v) for k, v in runs.items() if v}
    agree = compare_int8(work / "ours", work / "llmc")
    agree["formulas"] = recompute_check(src, work / "ours", work / "llmc")
    fl, lc, df = (series[k]["median_s"] for k in ("io_floor", "llmcompressor", "ours_data_free"))
    pairs = [l["seconds"] / o["seconds"] for l, o in zip(runs["llmcompressor"], runs["ours_data_free"])]
    res = {
        "checkpoint": {"layers": args.layers, "experts": args.experts, "shared_experts": 1, "dtype": "bfloat16",
                       "bytes": src_bytes, "shapes": "DeepSeek-V3 (hidden 7168, 128 heads, MLA 1536/512/64, "
                       "dense 18432, expert 2048), vocab cut to 16384"},
        "series": series,
        "ratios": {"llmcompressor_over_ours_data_free": round(lc / df, 3),
                   "llmcompressor_over_ours_data_free_per_round": [round(p, 3) for p in pairs],
                   "ours_data_free_over_io_floor": round(df / fl, 3),
                   "llmcompressor_over_io_floor": round(lc / fl, 3)},
        "goals": {"data_free_at_least_2.5x_llmcompressor": lc / df >= 2.5,
                  "data_free_within_1.3x_io_floor": df / fl <= 1.3},
        # source bytes read per job over the checkpoint's bytes (the job's own count; the disk's in series)
        "source_reads": {k: round(statistics.median(r["job"]["bytes_read"] for r in v) / src_bytes, 3)
                         for k, v in runs.items() if v and all("bytes_read" in r.get("job", {}) for r in v)},
        "int8_agreement": agree,
        "versions": {"llmcompressor": llmc_version[0], "compressed_tensors": llmc_version[1],
                     "llmc_torch": llmc_version[2], "ours_torch": __import__("torch").__version__},
        "llmcompressor_call": f"model_free_ptq(src, dst, scheme='W8A8', ignore={IGNORE}) (max_workers default 1)",
        "rounds": args.rounds, "calib_rounds": args.calib_rounds,
        "cold_cache": sorted({r["cache"] for v in runs.values() for r in v}),
        "machine": {"cpus": os.cpu_count(), "load_at_end": loadavg()},
    }
    if args.carry:
        carry_over(res, json.loads(Path(args.carry).read_text()))
    write_result(args.out, res)
    plot(res, Path(args.plot))
    print(f"plot: {args.plot}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
