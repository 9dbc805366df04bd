"""This project's server against vLLM's, on the same model and load, measured with vLLM's own client.

    python scripts/bench_vs_vllm.py --vllm-venv VENV [--ours float,quantized] [--rounds 3] [--concurrency 1,4,8,16]
        [--out FILE]

Installs nothing: VENV is a venv with vLLM's CPU build (``../shared/peers/vllm/setup.sh`` makes one; its
README lists the known breakages this works around: vLLM is run through ``vllm_cli.py``). Each round
starts each server in turn, in its own process group, waits until ``/v1/models`` answers, runs ``vllm
bench serve`` unmodified at every concurrency (random 128 in / 64 out, 32 prompts, ``--ignore-eos``, new
prompts every run: ``--seed`` from :func:`prompt_seed`, the same for every server of a round,
greedy), and stops the group before the next server starts. The servers alternate their order from
round to round, and each timed run waits for a quiet CPU (load average below ``--quiet``).

Servers: ours, ``python -m jobs.serve`` on the quantized embedded model (``ours-quantized``: W8A8 + FA3,
int8-NZ cache) and on the float embedded checkpoint itself (``ours-float``: float linears in --float-dtype,
the latent cached NZ in bf16), as --ours picks (default both); and ``vllm`` (``vllm serve`` on the embedded
model in bf16). Writes the medians and ranges per server and concurrency, and each of ours' ratios to vLLM,
to --out (default benchmarks/vs_vllm.json), the plot beside it (scripts/plot_serving.py; benchmarks/vs_vllm.png),
and prints a markdown table with a row per server and concurrency. The runs on the other machines of
docs/performance.md: ``--out benchmarks/vs_vllm_avx2.json`` (AVX2 + FMA, no AVX-512; vs_vllm_avx2.png beside
it) and ``--out benchmarks/vs_vllm_avx512.json`` (AVX-512, no AMX; vs_vllm_avx512.png).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
from plot_serving import plot  # noqa: E402
from pipeline.cbuild import cpu_description  # noqa: E402

MODEL_DIR = REPO / "pipeline" / "assets" / "dsv3-tiny-pydoc"
QUANTIZED = REPO / "out" / "dsv3-tiny-pydoc-w8a8-fa3"
PEER = REPO.parent / "shared" / "peers" / "vllm"
METRICS = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "median_itl_ms")
# --ours choice -> server name; the plain ones listen through jobs.serve's default front door (Ray's HAProxy
# where Ray has it), the -serve-proxy ones through Serve's own HTTP proxy (jobs.serve --http-proxy serve)
OURS = {"float": "ours-float", "quantized": "ours-quantized", "float-serve-proxy": "ours-float-serve-proxy",
        "quantized-serve-proxy": "ours-quantized-serve-proxy"}
VLLM = "vllm"
LABELS = {"ours-quantized": "dsquant, W8A8 + FA3", "ours-float": "dsquant, float (bf16 checkpoint)",
          "ours-quantized-serve-proxy": "dsquant, W8A8 + FA3, Serve's HTTP proxy",
          "ours-float-serve-proxy": "dsquant, float, Serve's HTTP proxy", VLLM: "vLLM CPU, bf16"}


def parse_ours(text: str) -> list[str]:
    """``float,quantized`` -> the server names, in that order; an unknown or repeated choice is an error."""
    picked = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in picked if c not in OURS]
    if not picked or bad or len(set(picked)) != len(picked):
        raise argparse.ArgumentTypeError(f"--ours takes a comma-separated subset of {', '.join(OURS)}, got {text!r}")
    return [OURS[c] for c in picked]


def server_command(name: str, args, port: int) -> tuple[list[str], dict]:
    """The command line and environment of server ``name`` (ours-quantized, ours-float or vllm)."""
    env = dict(os.environ)
    if name in OURS.values():
        quantized = name.startswith(OURS["quantized"])
        model, extra = (QUANTIZED, []) if quantized else (MODEL_DIR, ["--dtype", args.float_dtype])
        if name.endswith("-serve-proxy"):
            extra += ["--http-proxy", "serve"]
        return ([sys.executable, "-m", "jobs.serve", "--model-path", str(model), "--served-model-name", name,
                 "--port", str(port), *extra, *shlex.split(args.ours_args)], env)
    venv = Path(args.vllm_venv)
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(venv / "lib" / "libiomp5.so"))
               if Path(p).exists()]
    env.update(VLLM_CPU_KVCACHE_SPACE="2", LD_PRELOAD=":".join(preload))
    return ([str(venv / "bin" / "python"), str(Path(args.vllm_cli)), "serve", str(MODEL_DIR), "--host", "127.0.0.1",
             "--port", str(port), "--max-model-len", "2048", "--dtype", "bfloat16", "--served-model-name", name], env)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server on port {port} was not ready within {timeout:.0f} s")


def wait_quiet(limit: float, timeout: float = 120) -> float:
    deadline = time.time() + timeout
    while True:
        load = os.getloadavg()[0]
        if load < limit or time.time() > deadline:
            return load
        time.sleep(5)


def prompt_seed(round_: int, concurrency: int) -> int:
    """``vllm bench serve --seed`` of one run: the same prompts for every server of a round at one
    concurrency, other prompts for every other run (its default seed would send the same 32 prompts to
    every run, and a server with prefix caching would skip their prefill from the second run on; vLLM's
    CPU build turns prefix caching off for MLA models). Concurrency 0: the round's warm-up run."""
    return 1000 * (round_ + 1) + concurrency


def bench(name: str, args, port: int, concurrency: int, out_dir: Path, seed: int = 0) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    fname = f"{name}-c{concurrency}-{int(time.time() * 1000)}.json"
    cmd = [str(Path(args.vllm_venv) / "bin" / "python"), str(Path(args.vllm_cli)), "bench", "serve",
           "--backend", "openai", "--host", "127.0.0.1", "--port", str(port), "--model", name,
           "--tokenizer", str(MODEL_DIR), "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--save-result",
           "--result-dir", str(out_dir), "--result-filename", fname]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
    path = out_dir / fname
    if run.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve against {name} failed ({run.returncode}):\n{run.stdout[-1500:]}"
                           f"\n{run.stderr[-1500:]}")
    r = json.loads(path.read_text())
    if r.get("completed", 0) != args.num_prompts:
        raise RuntimeError(f"{name}: only {r.get('completed')} of {args.num_prompts} requests completed")
    return {k: r[k] for k in METRICS}


def start_server(name: str, args, port: int, log) -> subprocess.Popen:
    """Server ``name`` in its own process group (output to ``log``), answering /v1/models on ``port``."""
    cmd, env = server_command(name, args, port)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(port, proc, args.ready_timeout)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's group (jobs.serve and vLLM stop on it), SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):    # the group may be gone already
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def one_server(name: str, args, port: int, levels: list[int], out_dir: Path, round_: int = 0) -> dict[int, dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{name}-server.log", "a") as log:
        proc = start_server(name, args, port, log)
        try:
            bench(name, args, port, 1, out_dir / "warmup", prompt_seed(round_, 0))   # first-request costs
            res = {}
            for c in levels:
                load = wait_quiet(args.quiet)
                res[c] = {**bench(name, args, port, c, out_dir / name, prompt_seed(round_, c)),
                          "load_at_start": round(load, 2)}
                print(name, c, json.dumps(res[c]), flush=True)
            return res
        finally:
            stop_server(proc)


def summarize(rounds: list[dict]) -> dict:
    """Per server and concurrency, each metric's median and range over the rounds; ``ratio``: each of
    ours' median output throughput and TPOT over vLLM's (server -> concurrency -> metric)."""
    out: dict = {}
    servers = list(rounds[0])
    for name in servers:
        out[name] = {}
        for c in rounds[0][name]:
            vals = {k: [r[name][c][k] for r in rounds] for k in METRICS}
            out[name][c] = {k: {"median": round(statistics.median(v), 2), "range": [round(min(v), 2), round(max(v), 2)]}
                            for k, v in vals.items()}
    out["ratio"] = {name: {c: {k: round(out[name][c][k]["median"] / out[VLLM][c][k]["median"], 3)
                               for k in ("output_throughput", "median_tpot_ms")} for c in out[name]}
                    for name in servers if name != VLLM}
    return out


def table(s: dict) -> str:
    """The README's table: a row per concurrency and server (ours first, then vLLM)."""
    servers = [n for n in s if n not in ("ratio", VLLM)] + [VLLM]
    rows = ["| concurrency | server | output tok/s | vs vLLM | median TPOT ms | median TTFT ms |",
            "|---|---|---|---|---|---|"]
    for c in s[VLLM]:
        for n in servers:
            d = s[n][c]
            ratio = f"{s['ratio'][n][c]['output_throughput']:.2f}x" if n != VLLM else "1.00x"
            rows.append(f"| {c} | {LABELS[n]} | {d['output_throughput']['median']:.0f} | {ratio} | "
                        f"{d['median_tpot_ms']['median']:.1f} | {d['median_ttft_ms']['median']:.1f} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vllm-venv", required=True, help="a venv with vllm-cpu (../shared/peers/vllm/setup.sh)")
    ap.add_argument("--vllm-cli", default=str(PEER / "vllm_cli.py"), help="vLLM's CLI wrapper for vllm-cpu")
    ap.add_argument("--ours", type=parse_ours, default="float,quantized",
                    help="which of our servers to run: a comma-separated subset of float (the embedded bf16 "
                         "checkpoint), quantized (its W8A8 + FA3 output), and either with -serve-proxy (served through "
                         "Serve's own HTTP proxy: jobs.serve --http-proxy serve; the default is Ray's HAProxy)")
    ap.add_argument("--float-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="compute dtype of ours-float (jobs.serve --dtype; auto: float32 on CPU)")
    ap.add_argument("--ours-args", default="", help="more jobs.serve flags for our servers, given with '=' (the "
                                                   "value starts with --): --ours-args=--compile, "
                                                   "--ours-args=--no-engine-process (recorded in the JSON)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of all the servers")
    ap.add_argument("--concurrency", default="1,4,8,16", help="client concurrencies, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    ap.add_argument("--input-len", type=int, default=128, help="random prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="generated tokens (ignore_eos)")
    ap.add_argument("--port", type=int, default=8123, help="port each server listens on in turn")
    ap.add_argument("--quiet", type=float, default=1.5, help="wait for a 1-minute load average below this")
    ap.add_argument("--ready-timeout", type=float, default=300, help="seconds a server may take to start")
    ap.add_argument("--bench-timeout", type=float, default=900, help="seconds one client run may take")
    ap.add_argument("--work-dir", default="/tmp/dsquant-vs-vllm", help="raw results and server logs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "vs_vllm.json"), help="JSON summary")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if not (Path(args.vllm_venv) / "bin" / "python").exists():
        print(f"error: --vllm-venv {args.vllm_venv} has no bin/python (make it with {PEER / 'setup.sh'})",
              file=sys.stderr)
        return 2
    if any(n.startswith(OURS["quantized"]) for n in args.ours) and not (QUANTIZED / "quant_model_description.json").exists():
        subprocess.run([sys.executable, "-m", "jobs.quantize", "--overwrite"], cwd=REPO, check=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(args.work_dir)
    servers = [*args.ours, VLLM]
    rounds = []
    for r in range(args.rounds):
        k = r % len(servers)
        order = servers[k:] + servers[:k]       # each server leads in turn
        done = {name: one_server(name, args, args.port, levels, work / f"round{r}", r) for name in order}
        rounds.append({name: done[name] for name in servers})
    s = summarize(rounds)
    result = {"load": f"vllm bench serve, random {args.input_len} in / {args.output_len} out, {args.num_prompts} "
                      f"prompts, greedy, ignore_eos, new prompts every run (--seed: prompt_seed); {args.rounds} "
                      f"alternating rounds; medians and ranges",
              "servers": {n: LABELS[n] for n in servers}, "float_dtype": args.float_dtype,
              "ours_args": args.ours_args,
              "machine": cpu_description(), "summary": s, "rounds": rounds}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    series = [{"label": LABELS[n],
               "points": [{"concurrency": c, "output_tok_s": s[n][c]["output_throughput"]["median"],
                           "median_tpot_ms": s[n][c]["median_tpot_ms"]["median"]} for c in s[n]]}
              for n in servers]
    plot(series, Path(args.out).with_suffix(".png"), "vllm bench serve: dsquant (float, quantized) vs vLLM, "
                                                      "same model and load")
    print(table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
