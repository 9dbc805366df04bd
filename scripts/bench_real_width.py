"""Benchmark at DeepSeek-V3's real width: the project's server against llama.cpp's on the same random-weight
checkpoint (jobs.make_checkpoint), with vLLM's own client, against the machine's read bandwidth.

    python scripts/bench_real_width.py --quant-dir Q --float-dir F --q8-gguf Q8.gguf [--bf16-gguf BF16.gguf]
        --llama-bin DIR --vllm-python VENV/bin/python [--servers w8a8,q8_0,float,bf16] [--rounds 2]
        [--threads 2] [--out benchmarks/real_width.json]

1. The read bandwidth: scripts/membw.c, every core reading its own slice of a huge-page backed 2 GiB buffer,
   one stream a thread and four, alternating; the better median (27 passes each).
2. The bytes of weights a decode token reads, from the config (the active experts: top_k routed + shared;
   int8 linears 1 byte a weight, kv_b_proj / router / lm_head / a float model's linears 2): the floor is
   bytes / bandwidth, and each server's roofline ratio is floor / its median TPOT at one client.
3. Each round starts each server in turn (their order rotates from round to round), each in its own process
   group through ../shared/peers/llamacpp/serve.sh (the project: jobs.serve --torch-threads THREADS;
   llama.cpp: llama-server -t THREADS -fa on, 16 slots of 1152 tokens, a q8_0 latent cache for Q8_0), and
   drives it with vLLM's client
   (`vllm bench serve`, random prompts with a fresh seed per run, greedy, ignore_eos): 128 in / 32 out at
   1, 4 and 16 clients (4, 8 and 16 prompts), then 1024 in / 4 out at one client (TTFT at 1024); each timed run
   waits for a quiet CPU first (1-minute load below --quiet, at most 60 s).
Writes medians and ranges per server, the ratios of ours to llama.cpp's, and a plot beside the JSON
(benchmarks/real_width.json and real_width.png by default).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import loadavg, write_result  # noqa: E402
from pipeline.cbuild import BASE_FLAGS, NativeLibrary, cpu_description  # noqa: E402

PEERS = REPO.parent / "shared" / "peers"
LOADS = [("c1", 128, 32, 4, 1), ("c4", 128, 32, 8, 4), ("c16", 128, 32, 16, 16), ("ttft1024", 1024, 4, 2, 1)]


# ----- the machine and the model ---------------------------------------------------------------------------

def read_bandwidth(threads: int, gib: float = 2.0, reps: int = 9) -> dict:
    """Every core reading its slice of a huge-page backed buffer, one stream a thread and four, alternating
    (3 x reps passes each); the machine's figure is the better median."""
    def declare(dll):
        dll.read_bandwidth.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_double)]
        dll.read_bandwidth.restype = ctypes.c_int
    lib = NativeLibrary(REPO / "scripts" / "membw.c", declare, BASE_FLAGS + ("-pthread",), what="bandwidth probe")
    dll = lib.library()
    if dll is None:
        raise SystemExit(f"error: the bandwidth probe could not be built: {lib.status()}")
    got: dict[int, list] = {1: [], 4: []}
    for _ in range(3):
        for streams in (1, 4):
            out = (ctypes.c_double * reps)()
            if dll.read_bandwidth(int(gib * 2 ** 30), threads, streams, reps, out):
                raise SystemExit("error: the bandwidth probe could not allocate its buffer")
            got[streams] += list(out)
    med = {s: statistics.median(v) for s, v in got.items()}
    best = max(med, key=med.get)
    return {"threads": threads, "buffer_gib": gib, "gb_s_median": round(med[best], 1),
            "gb_s_range": [round(min(got[best]), 1), round(max(got[best]), 1)], "streams_per_thread": best,
            "gb_s_median_by_streams": {str(s): round(m, 1) for s, m in med.items()}}


def decode_bytes(config: dict, int8: bool) -> dict:
    """Bytes of weights one decode token reads (one sequence), by part."""
    h, H, V = config["hidden_size"], config["num_attention_heads"], config["vocab_size"]
    dn, dr, dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    C, ql = config["kv_lora_rank"], config["q_lora_rank"]
    lin = 1 if int8 else 2
    attn = lin * (ql * h + H * (dn + dr) * ql + (C + dr) * h + h * H * dv) + 2 * H * (dn + dv) * C
    dense = lin * 3 * h * config["intermediate_size"]
    active = config["num_experts_per_tok"] + config.get("n_shared_experts", 0)
    moe = lin * 3 * h * config["moe_intermediate_size"] * active + 2 * config["n_routed_experts"] * h
    L, k = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    parts = {"attention": L * attn, "dense_mlp": k * dense, "moe_active": (L - k) * moe, "lm_head": 2 * V * h}
    parts["total"] = sum(parts.values())
    return parts


# ----- the servers -----------------------------------------------------------------------------------------

def start(kind: str, model: str, port: int, log: Path, ray_tmp: str,
          args: argparse.Namespace) -> tuple[int, str]:
    env = dict(os.environ, LLAMA_BIN=args.llama_bin, THREADS=str(args.threads), PROJECT=str(REPO), CTX="18432",
               PY=sys.executable, RAY_TMPDIR=ray_tmp)     # short (Ray's socket paths), removed after the stop
    extra = []
    if kind == "llamacpp":
        extra = ["--threads-http", "64", "-fa", "on"]       # flash attention, as ../shared/peers' compare.sh
        if model == args.q8_gguf:
            extra += ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
    else:
        extra = ["--torch-threads", str(args.threads)]
    out = subprocess.run(["bash", str(PEERS / "llamacpp" / "serve.sh"), kind, model, str(port), str(log), *extra],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} {model} did not start: {out.stderr.strip()[-400:]}")
    pgid, mid = out.stdout.split()[-2:]
    return int(pgid), mid


def stop(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGINT)
    except ProcessLookupError:
        return
    for _ in range(40):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(1)
    else:
        os.killpg(pgid, signal.SIGKILL)
    leftovers = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout.split("\n")
    for line in leftovers:
        parts = line.split()
        if len(parts) == 2 and int(parts[1]) == pgid:
            try:
                os.kill(int(parts[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_quiet(limit: float, max_s: float = 60) -> str:
    t0 = time.time()
    while float(loadavg().split()[0]) >= limit and time.time() - t0 < max_s:
        time.sleep(5)
    return loadavg()


def drive(port: int, mid: str, tokdir: str, out: Path, tag: str, load: tuple, seed: int,
          args: argparse.Namespace) -> dict:
    name, n_in, n_out, n, c = load
    shim = PEERS / "vllm" / "vllm_cli.py"
    cmd = [args.vllm_python, str(shim), "bench", "serve", "--seed", str(seed), "--backend", "openai",
           "--host", "127.0.0.1", "--port", str(port), "--model", mid, "--tokenizer", tokdir,
           "--dataset-name", "random", "--random-input-len", str(n_in), "--random-output-len", str(n_out),
           "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
           "--result-dir", str(out), "--result-filename", f"{tag}-{name}.json"]
    load_at = wait_quiet(args.quiet)
    with open(out / f"{tag}-{name}.log", "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    try:
        r = json.loads((out / f"{tag}-{name}.json").read_text())
    except OSError:
        return {"error": "no result", "load": load_at}
    return {"completed": r["completed"], "of": n, "out_tok_s": round(r["output_throughput"], 2),
            "ttft_ms": round(r["median_ttft_ms"], 1), "tpot_ms": round(r["median_tpot_ms"], 2), "load": load_at}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in ("tpot_ms", "out_tok_s", "ttft_ms"):
        v = [r[key] for r in runs if key in r and r.get("completed") == r.get("of")]
        if v:
            out[key] = {"median": round(statistics.median(v), 2), "range": [min(v), max(v)], "n": len(v)}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(result["servers"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    tp = [result["servers"][s]["c1"].get("tpot_ms", {}).get("median", 0) for s in servers]
    axes[0].bar(servers, tp, color="tab:blue")
    for s, fl in (("w8a8", "floor_ms_int8"), ("float", "floor_ms_bf16")):
        if result.get(fl):
            axes[0].axhline(result[fl], ls="--", color="gray")
            axes[0].text(-0.4, result[fl], f"floor {s}: {result[fl]:.0f} ms", va="bottom", fontsize=8)
    axes[0].set_ylabel("median TPOT at 1 client (ms)")
    axes[0].set_title("one client: time per output token")
    for s in servers:                    # a load with no complete run (the client lost it) is left out
        pts = [(n, result["servers"][s].get(c, {}).get("out_tok_s", {}).get("median"))
               for n, c in ((1, "c1"), (4, "c4"), (16, "c16"))]
        pts = [(n, y) for n, y in pts if y]
        axes[1].plot([n for n, _ in pts], [y for _, y in pts], marker="o", label=s)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("clients")
    axes[1].set_ylabel("output tok/s (median)")
    axes[1].legend()
    axes[1].set_title("throughput")
    fig.suptitle(f"DeepSeek-V3 width, {result['model']['layers']} layers, {result['model']['experts']} experts; "
                 f"{result['machine']['cpu']} x{result['machine']['cpus']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant-dir", required=True, help="the project's W8A8 + FA3 output of the checkpoint")
    ap.add_argument("--float-dir", default=None, help="the bf16 checkpoint itself (server 'float')")
    ap.add_argument("--q8-gguf", default=None, help="llama.cpp's Q8_0 GGUF of the checkpoint")
    ap.add_argument("--bf16-gguf", default=None, help="llama.cpp's bf16 GGUF of the checkpoint")
    ap.add_argument("--llama-bin", default="", help="directory with llama-server")
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vLLM (../shared/peers/vllm/setup.sh)")
    ap.add_argument("--servers", default="w8a8,q8_0,float,bf16")
    ap.add_argument("--loads", default="c1,c4,c16,ttft1024", help="which of the loads to run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quiet", type=float, default=1.5, help="1-minute load to wait for before each run")
    ap.add_argument("--port", type=int, default=17300)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--work", default="/tmp/bench_real_width", help="vLLM client results and server logs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "real_width.json"))
    args = ap.parse_args()
    config = json.loads((Path(args.quant_dir) / "config.json").read_text())
    models = {"w8a8": ("project", args.quant_dir), "float": ("project", args.float_dir),
              "q8_0": ("llamacpp", args.q8_gguf), "bf16": ("llamacpp", args.bf16_gguf)}
    servers = [s for s in args.servers.split(",") if models[s][1]]
    loads = [ld for ld in LOADS if ld[0] in args.loads.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bw = read_bandwidth(args.threads)
    int8, bf16 = decode_bytes(config, True), decode_bytes(config, False)
    print(f"read bandwidth {bw['gb_s_median']} GB/s; a decode token reads {int8['total'] / 1e9:.2f} GB (int8) / "
          f"{bf16['total'] / 1e9:.2f} GB (bf16)", flush=True)
    runs: dict[str, dict[str, list]] = {s: {ld[0]: [] for ld in loads} for s in servers}
    for r in range(args.rounds):
        order = servers[r % len(servers):] + servers[:r % len(servers)]
        for s in order:
            kind, model = models[s]
            tag = f"{s}-r{r}"
            t0 = time.time()
            ray_tmp = tempfile.mkdtemp(prefix="ray.")
            try:
                pgid, mid = start(kind, model, args.port, work / f"server-{tag}.log", ray_tmp, args)
            except RuntimeError as e:
                print(f"  {e}", flush=True)
                shutil.rmtree(ray_tmp, ignore_errors=True)
                continue
            print(f"  {tag}: started in {time.time() - t0:.0f} s", flush=True)
            try:
                for i, ld in enumerate(loads):
                    res = drive(args.port, mid, args.quant_dir, work, tag, ld, args.seed + 1000 * r + i, args)
                    runs[s][ld[0]].append(res)
                    print(f"  {tag} {ld[0]}: {res}", flush=True)
            finally:
                stop(pgid)
                shutil.rmtree(ray_tmp, ignore_errors=True)
    result = {"machine": cpu_description(), "bandwidth": bw, "threads": args.threads,
              "model": {"layers": config["num_hidden_layers"], "experts": config["n_routed_experts"],
                        "top_k": config["num_experts_per_tok"], "hidden": config["hidden_size"],
                        "heads": config["num_attention_heads"], "vocab": config["vocab_size"]},
              "decode_bytes": {"int8": int8, "bf16": bf16},
              "floor_ms_int8": round(int8["total"] / (bw["gb_s_median"] * 1e9) * 1e3, 1),
              "floor_ms_bf16": round(bf16["total"] / (bw["gb_s_median"] * 1e9) * 1e3, 1),
              "loads": [dict(zip(("name", "in", "out", "prompts", "clients"), ld)) for ld in loads],
              "servers": {s: {ld: summarize(v) for ld, v in by.items()} for s, by in runs.items()},
              "runs": runs}
    for s, floor in (("w8a8", "floor_ms_int8"), ("q8_0", "floor_ms_int8"), ("float", "floor_ms_bf16"),
                     ("bf16", "floor_ms_bf16")):
        tp = result["servers"].get(s, {}).get("c1", {}).get("tpot_ms")
        if tp:
            result["servers"][s]["roofline"] = round(result[floor] / tp["median"], 3)
    ratios = {}
    for ours, peer in (("w8a8", "q8_0"), ("float", "bf16")):
        a, b = result["servers"].get(ours, {}), result["servers"].get(peer, {})
        for ld, key in (("c1", "tpot_ms"), ("c1", "out_tok_s"), ("c4", "out_tok_s"), ("c16", "out_tok_s"),
                        ("c1", "ttft_ms"), ("ttft1024", "ttft_ms")):
            if key in a.get(ld, {}) and key in b.get(ld, {}):
                ratios[f"{ours}/{peer} {ld} {key}"] = round(a[ld][key]["median"] / b[ld][key]["median"], 3)
    result["ratios"] = ratios
    write_result(args.out, result, hide=("runs",))
    plot(result, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
