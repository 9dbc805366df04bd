"""Benchmark: the OpenAI-compatible service under load, in the spirit of vLLM's ``bench serve``: colocated
against prefill/decode disaggregated, on the quantized embedded model, on this machine.

    python scripts/bench_serve.py [--requests 32] [--concurrency 1,4,8] [--input-len 64] [--output-len 32]

For each mode a local Ray (capped object store) and Serve are started, the app is run, and for each
concurrency level ``--requests`` streaming completions of random prompts (``--input-len`` tokens of
held-out text) with ``max_tokens=--output-len`` (greedy) are sent by that many concurrent clients.
Reported per level: TTFT, TPOT = (latency - TTFT) / (output tokens - 1), ITL (gaps between streamed
chunks) and end-to-end latency (mean, median, p99, ms), request and output-token throughput, and goodput
(requests/s whose TPOT <= --slo-tpot-ms). Writes JSON to --out (default benchmarks/serve.json) and its plot
beside it (benchmarks/serve.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import write_result  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {"mean": round(1e3 * statistics.fmean(xs), 1) if xs else None,
            "median": round(1e3 * statistics.median(xs), 1) if xs else None, "p99": round(1e3 * pct(xs, 0.99), 1)}


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, n = [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].text:
            times.append(time.perf_counter())
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    end = time.perf_counter()
    ttft = (times[0] - t0) if times else end - t0
    return {"ttft": ttft, "e2e": end - t0, "n": n, "itl": [b - a for a, b in zip(times, times[1:])],
            "tpot": (end - t0 - ttft) / (n - 1) if n > 1 else None}


async def level(base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, slo: float) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    queue = list(prompts)
    results: list[dict] = []

    async def worker():
        while queue:
            results.append(await one(client, model, queue.pop(), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": round(wall, 2),
            "ttft_ms": summary([r["ttft"] for r in results]), "tpot_ms": summary(tpots),
            "itl_ms": summary([x for r in results for x in r["itl"]]), "e2e_ms": summary([r["e2e"] for r in results]),
            "request_throughput": round(len(results) / wall, 2),
            "output_token_throughput": round(sum(r["n"] for r in results) / wall, 1),
            "goodput": round(sum(1 for t in tpots if t * 1e3 <= slo) / wall, 2)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--dir", default="/tmp/dsquant-serve-bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "serve.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray
    from ray import serve

    from actors.serving.app.serve_app import build_app
    from actors.serving.serve_config import DeploymentOptions, ServeConfig
    from pipeline.text import corpus
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.engine.config import EngineConfig
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
    from pipeline.text.tokenizer import Tokenizer

    qdir = Path(args.dir) / "q"
    if not (qdir / "quant_model_description.json").exists():
        quantize_checkpoint(str(EMBEDDED_MODEL_DIR), str(qdir), Recipe(), QuantizeOptions(overwrite=True),
                            log=lambda m: None)
    tok = Tokenizer.from_dir(str(qdir))
    _, held = corpus.load_heldout(EMBEDDED_MODEL_DIR)
    stream = [t for d in held for t in tok.encode(d.text)]
    rng = random.Random(0)
    starts = [rng.randrange(len(stream) - args.input_len) for _ in range(args.requests)]
    prompts = [tok.decode(stream[s:s + args.input_len]) for s in starts]
    engine = EngineConfig(num_blocks=512, block_size=16, max_num_seqs=16, max_batched_tokens=256, nz=True)
    one_cpu, small = DeploymentOptions(1, {"num_cpus": 1}), DeploymentOptions(1, {"num_cpus": 0.1})
    res: dict = {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
                 "slo_tpot_ms": args.slo_tpot_ms, "machine": {"cpus": os.cpu_count()}, "modes": {}}
    for mode in ("colocated", "disaggregated"):
        ray.init(num_cpus=4, object_store_memory=256 * 2**20, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            cfg = ServeConfig(str(qdir), "dsquant", engine, max_in_flight=64, llm=one_cpu, ingress=small,
                              prefill=one_cpu, mode=mode)
            serve.run(build_app(cfg), name=mode, route_prefix="/")
            base = f"http://127.0.0.1:{port}/v1"
            asyncio.run(level(base, "dsquant", prompts[:2], 1, 4, args.slo_tpot_ms))  # warm-up
            res["modes"][mode] = [asyncio.run(level(base, "dsquant", prompts, int(c), args.output_len,
                                                    args.slo_tpot_ms)) for c in args.concurrency.split(",")]
            for r in res["modes"][mode]:
                print(mode, json.dumps(r), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    write_result(args.out, res, hide=["modes"])
    from plot_serving import plot, series_of   # scripts/ is on sys.path when this runs as a script

    png = Path(args.out).with_suffix(".png")
    plot(series_of(Path(args.out)), png, "dsquant serving, colocated vs disaggregated")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
