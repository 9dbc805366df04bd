"""Where an engine step's time goes: a per-step profile of the engine on the embedded model, quantized (or
any model directory the engine loads: ``--model-dir pipeline/assets/dsv3-tiny-pydoc`` for the float one).

    python scripts/profile_engine.py [--batch 8] [--prompt-len 128] [--new-tokens 64] [--mtp] [--out FILE]
    python scripts/profile_engine.py --rounds 3 --batches 1,8,16 --kernels torch,native [--out FILE]

The second form runs the first once per (round, batch, kernels) in a fresh process (``DSQUANT_KERNELS``
set), alternating, and writes the medians and ranges of every configuration to one JSON
(benchmarks/engine_profile.json).

A batch of ``--batch`` held-out texts cut to ``--prompt-len`` tokens, greedy, ``--new-tokens`` each (the
load of ``vllm bench serve --random-input-len 128 --random-output-len 64`` at that concurrency), run to the
end through one engine after a warm-up. Each region below is timed by wrapping the function that does it;
times are exclusive (a region's own time, less the regions it calls), so the columns add up to the step:

  schedule    Scheduler.schedule (which sequences, how many tokens, cache blocks)
  prepare     what the step and the runner do around the model: spans, positions, rows, bookkeeping
  embed/norm/rope/einsum   the model's float work outside the regions below (the runner's own code)
  cache write the attention backend's write (quantize the latents, store them)
  attention   the attention backend's decode / prefill over the cache (attention.backends)
  moe         MoE.forward's own work: routing, the per-expert loop, gathering and combining (a float
              model's: NativeFloatMoE, routed and shared experts in one C call)
  linears     every int8 (W8A8, W8A8_DYNAMIC) and float linear (a float model's dense MLP: NativeFloatMLP)
  sampling    LLMEngine.sampled: the next token(s) of every piece (one argmax for the plain greedy
              ones), the scheduler's update
  stop/detok  the engine's detokenization of requests with stop strings

Decode steps (every piece one token) and steps holding prefill are reported apart; per-step medians are
in milliseconds. Writes JSON to --out (default benchmarks/engine_profile.json; the runs on the other machines
of docs/performance.md: ``--out benchmarks/engine_profile_avx2.json``, AVX2 + FMA, and
``benchmarks/engine_profile_avx512.json``, AVX-512 without AMX).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from actors.serving.serve_config import DEFAULT_ENGINE  # noqa: E402
from bench_io import write_result  # noqa: E402
from pipeline.cbuild import cpu_description  # noqa: E402

REGIONS = ("schedule", "prepare", "model other", "cache write", "attention", "moe", "linears", "sampling",
           "stop/detok")


class Profiler:
    """Exclusive wall time per region, per step; regions nest through a stack."""

    def __init__(self):
        self.stack: list[list] = []      # [region, start, time spent in children]
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attr: str, region: str) -> None:
        fn = getattr(owner, attr)
        prof = self

        def timed(*args, **kwargs):
            prof.stack.append([region, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                r, t0, child = prof.stack.pop()
                spent = time.perf_counter() - t0
                prof.step[r] += spent - child
                if prof.stack:
                    prof.stack[-1][2] += spent

        setattr(owner, attr, timed)

    def timer(self, region: str, seconds: float) -> None:
        """A replayed decode step's op (ModelRunner.graph_timer): its region's time, inside the open one."""
        self.step[region] += seconds
        if self.stack:
            self.stack[-1][2] += seconds


def instrument(prof: Profiler) -> None:
    import torch

    from pipeline.engine.cache import paged_cache
    from pipeline.engine.core import engine, scheduler
    from pipeline.engine.layers import qlinear
    from pipeline.engine.worker import runner
    from pipeline.model import ffn

    prof.wrap(engine.LLMEngine, "step", "prepare")
    prof.wrap(scheduler.Scheduler, "schedule", "schedule")
    prof.wrap(runner.ModelRunner, "forward", "model other")
    prof.wrap(runner.ModelRunner, "mtp_forward", "model other")
    prof.wrap(paged_cache.PagedLatentCache, "write", "cache write")
    from pipeline.engine.attention import backends                       # the attention backends' calls

    for cls in (backends.TorchAttention, backends.NativeAttention, backends.TritonAttention):
        for name, region in (("write", "cache write"), ("decode", "attention"), ("prefill", "attention")):
            if name in vars(cls):
                prof.wrap(cls, name, region)
    prof.wrap(ffn.MoE, "forward", "moe")
    from pipeline.engine.native import cpu_float_ffn                         # a float model's MLP and MoE in C

    prof.wrap(cpu_float_ffn.NativeFloatMoE, "forward", "moe")
    prof.wrap(cpu_float_ffn.NativeFloatMLP, "forward", "linears")
    try:
        from pipeline.engine.layers import moe as engine_moe
        prof.wrap(engine_moe.Int8MoE, "forward", "moe")
    except ImportError:
        pass
    from pipeline.engine.native import cpu_float

    for cls in (qlinear.W8A8StaticLinear, qlinear.W8A8DynamicLinear, torch.nn.Linear, cpu_float.NativeHeadLinear):
        prof.wrap(cls, "forward", "linears")
    prof.wrap(engine.LLMEngine, "sampled", "sampling")
    from pipeline.engine.core import detokenizer

    prof.wrap(detokenizer.Detokenizer, "add", "stop/detok")
    prof.wrap(detokenizer.Detokenizer, "finish", "stop/detok")


def prompts(n: int, length: int) -> list[list[int]]:
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.text import corpus
    from pipeline.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    docs = [d.text for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]]
    out = []
    for text in docs:
        ids = tok.encode(text, add_bos=True)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} held-out texts have {length} tokens")


def summarize(steps: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    total = [sum(s.values()) for s in steps]
    med = {r: round(1e3 * statistics.median(s.get(r, 0.0) for s in steps), 3) for r in REGIONS}
    share = {r: round(sum(s.get(r, 0.0) for s in steps) / sum(total), 3) for r in REGIONS}
    return {"steps": len(steps), "median_step_ms": round(1e3 * statistics.median(total), 3),
            "median_ms": med, "share_of_time": share}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-dir", default=str(REPO / "out" / "dsv3-tiny-pydoc-w8a8-fa3"),
                    help="a quantized directory (python -m jobs.quantize writes this one) or a float checkpoint")
    ap.add_argument("--batch", type=int, default=8, help="sequences run together")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--mtp", action="store_true", help="MTP speculative decoding on (default: off)")
    ap.add_argument("--max-batched-tokens", type=int, default=DEFAULT_ENGINE.max_batched_tokens,
                    help="tokens one step may hold (the served engines' default: actors/serving/serve_config.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU engine core uses one)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the layers' work around attention (EngineConfig.compile)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "engine_profile.json"), help="JSON output")
    ap.add_argument("--rounds", type=int, default=0,
                    help="> 0: alternating rounds of every --batches x --kernels run, each in a fresh process")
    ap.add_argument("--batches", default="1,8,16", help="batch sizes of the --rounds form")
    ap.add_argument("--kernels", default="torch,native",
                    help="DSQUANT_KERNELS values of the --rounds form (a value ending in -eager: those kernels "
                         "with DSQUANT_DECODE_GRAPH=0, no replayed decode steps)")
    args = ap.parse_args()
    if args.rounds > 0:
        return rounds(args)

    import torch

    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.protocol import EngineRequest, SamplingParams

    torch.set_num_threads(args.threads)
    if not any((Path(args.model_dir) / f).exists() for f in ("quant_model_description.json", "config.json")):
        raise SystemExit(f"{args.model_dir}: no model (the quantized one: python -m jobs.quantize --overwrite)")
    extra = {"compile": True} if args.compile else {}       # (an engine before the option: no keyword)
    eng = LLMEngine.from_dir(args.model_dir, num_blocks=2048, nz=True, mtp=args.mtp,
                             max_num_seqs=max(16, args.batch),
                             max_batched_tokens=args.max_batched_tokens, **extra)
    batch = prompts(args.batch, args.prompt_len)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    for n in (1, 2, args.batch):          # warm-up, not profiled (compiles every size class when compiling)
        eng.generate(prompts(n, 24), SamplingParams(max_new_tokens=4))
    eng.warm_up()                         # what a served engine runs first: a full-size prompt step, decode
    prof = Profiler()
    instrument(prof)
    eng.runner.graph_timer = prof.timer   # replayed decode steps (engine.decode_graph) time each op
    decode, prefill = [], []
    for i, p in enumerate(batch):
        eng.add(EngineRequest(f"profile-{i}", tuple(p), params))
    t0 = time.perf_counter()
    generated = eng.stats().generated_tokens
    while eng.has_work:
        prof.step = defaultdict(float)
        prefilling = any(s.in_prefill for s in eng.scheduler.running + list(eng.scheduler.waiting))
        eng.step()
        (prefill if prefilling else decode).append(dict(prof.step))
    wall = time.perf_counter() - t0
    res = {"model_dir": Path(args.model_dir).name, "batch": args.batch, "compile": args.compile, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "mtp": args.mtp, "threads": args.threads, "wall_s": round(wall, 3),
           "output_tok_s": round((eng.stats().generated_tokens - generated) / wall, 1),
           "kernels": eng.runner.kernels, "machine": cpu_description(), "decode": summarize(decode),
           "prefill": summarize(prefill)}
    write_result(args.out, res)
    return 0


def rounds(args) -> int:
    """The --rounds form: every (batch, kernels) run once per round in a fresh process, rounds alternating;
    per configuration the median and range of the decode step and tokens/s, the regions' medians."""
    import json
    import os
    import subprocess
    import tempfile

    from bench_io import loadavg

    batches = [int(b) for b in args.batches.split(",")]
    kernels = args.kernels.split(",")
    got: dict = {str(b): {k: [] for k in kernels} for b in batches}
    flags = ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--threads",
             str(args.threads), "--model-dir", args.model_dir] + (["--mtp"] if args.mtp else []) \
        + (["--compile"] if args.compile else [])
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for b in batches:
                for k in kernels:
                    out = Path(tmp) / f"{r}-{b}-{k}.json"
                    print(f"round {r + 1}/{args.rounds}: batch {b}, kernels {k} (load {loadavg()})", flush=True)
                    env = {**os.environ, "DSQUANT_KERNELS": k.removesuffix("-eager")}
                    if k.endswith("-eager"):            # the same kernels, every step eager
                        env["DSQUANT_DECODE_GRAPH"] = "0"
                    subprocess.run([sys.executable, __file__, "--batch", str(b), "--out", str(out), *flags],
                                   check=True, stdout=subprocess.DEVNULL, env=env)
                    got[str(b)][k].append(json.loads(out.read_text()))

    def spread(xs: list[float]) -> dict:
        return {"median": round(statistics.median(xs), 3), "range": [round(min(xs), 3), round(max(xs), 3)]}

    res = {"what": f"scripts/profile_engine.py --rounds {args.rounds}: decode-step regions (exclusive ms, "
                   f"medians per run), {Path(args.model_dir).name}, B sequences x {args.prompt_len} prompt tokens "
                   f"x {args.new_tokens} new, greedy, {args.threads} torch thread(s); alternating rounds of "
                   f"DSQUANT_KERNELS = {', '.join(kernels)} per batch size, each run a fresh process",
           "machine": cpu_description(), "load_at_end": loadavg(), "runs": {}}
    for b, per in got.items():
        res["runs"][b] = {}
        for k, runs in per.items():
            res["runs"][b][k] = {
                "decode_step_ms": spread([x["decode"]["median_step_ms"] for x in runs]),
                "output_tok_s": spread([x["output_tok_s"] for x in runs]),
                "regions_ms_median": {reg: round(statistics.median(x["decode"]["median_ms"][reg] for x in runs), 3)
                                      for reg in REGIONS},
                "prefill_step_ms_median": round(statistics.median(
                    x["prefill"].get("median_step_ms", 0.0) for x in runs), 3),
                "kernels": runs[0]["kernels"]}
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
