"""Sharded replica overhead: the engine at 1, 2 and 4 ranks on the quantized embedded model, on this machine.

    .venv/bin/python scripts/bench_sharded.py [--model-path out/dsv3-tiny-pydoc-w8a8-fa3] [--rounds 3]

Every layout generates the same batch (greedy, MTP on, ``--prompts`` chat prompts x ``--max-new-tokens``),
in alternating rounds; reported per layout: output tokens/s, the median step time (TPOT of a step that
decodes every sequence), and the bytes each rank sends into collectives per step. On a 2-core machine the
ranks share the cores (one thread each), so this measures the cost of splitting and communicating, not a
speed-up: more ranks cannot be faster here. Writes ``benchmarks/sharded.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"1 rank": None, "2 ranks (tp 2, moe_ep 2)": dict(tp=2, moe_ep=2),
           "4 ranks (tp 4, moe_ep 4)": dict(tp=4, moe_ep=4)}
QUESTIONS = ["What's deep learning?", "How do I open a file?", "Explain list comprehensions",
             "What does the os module do?", "How do I sort a dict by value?", "What is a generator?",
             "How do I read a CSV file?", "What is asyncio?"]


def run(eng, prompts, params) -> dict:
    comm = getattr(eng.runner, "comm", None)
    sent0 = comm.bytes_sent if comm else 0
    steps0 = eng.stats().steps
    times = (eng.counters if hasattr(eng, "counters") else eng.groups[0].counters).step_seconds
    times.clear()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t
    steps = eng.stats().steps - steps0
    n = sum(len(o) for o in outs)
    return {"tokens": n, "wall_s": wall, "tok_s": n / wall,
            "step_ms_median": 1000 * statistics.median(times),
            "bytes_per_step": ((comm.bytes_sent - sent0) / steps) if comm else 0.0, "outputs": outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=str(ROOT / "out" / "dsv3-tiny-pydoc-w8a8-fa3"),
                    help="quantized directory (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "sharded.json"), help="(default: %(default)s)")
    args = ap.parse_args(argv)

    import ray
    import torch

    from actors.serving.engine.rank_group import build_sharded_engine
    from actors.cluster.ray_start import init_ray
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.worker.loader import load_quantized
    from pipeline.engine.protocol import SamplingParams
    from pipeline.parallel import ParallelConfig
    from pipeline.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(args.model_path)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in (QUESTIONS * 4)[:args.prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    cfg = EngineConfig(num_blocks=128, nz=True, mtp=True, max_num_seqs=args.prompts)
    init_ray(None, num_cpus=4, object_store_memory=256 * 2**20, log=lambda m: None)
    def build(layout):
        if layout is None:
            return LLMEngine(load_quantized(args.model_path), cfg, tok)
        return build_sharded_engine(args.model_path, ParallelConfig(**layout), cfg, tok, threads_per_rank=1,
                                    log=lambda m: None)

    # a process is rank 0 of one process group at a time: each sharded replica is built, measured and
    # closed in turn, every round (the load is not measured)
    results, loads = {name: [] for name in LAYOUTS}, []
    try:
        for r in range(args.rounds):
            for name, layout in LAYOUTS.items():
                eng = build(layout)
                try:
                    run(eng, prompts[:2], SamplingParams(max_new_tokens=4))          # warm-up
                    loads.append(os.getloadavg()[0])
                    results[name].append(run(eng, prompts, params))
                finally:
                    close = getattr(eng.runner, "close", None)
                    if close:
                        close()
                res = results[name][-1]
                print(f"round {r + 1} {name}: {res['tok_s']:.0f} tok/s, step {res['step_ms_median']:.1f} ms, "
                      f"{res['bytes_per_step'] / 1024:.0f} KiB/step per rank", flush=True)
        same = all(res["outputs"] == results["1 rank"][0]["outputs"] for runs in results.values() for res in runs)
        summary = {}
        for name, runs in results.items():
            summary[name] = {k: {"median": statistics.median(x[k] for x in runs),
                                 "min": min(x[k] for x in runs), "max": max(x[k] for x in runs)}
                             for k in ("tok_s", "step_ms_median", "bytes_per_step")}
        base = summary["1 rank"]["tok_s"]["median"]
        for s in summary.values():
            s["tok_s_vs_1_rank"] = s["tok_s"]["median"] / base
        out = {"what": "engine tokens/s and step time at 1/2/4 ranks on this machine (ranks share its cores: "
                       "the overhead of splitting and communicating, not a speed-up)",
               "model": Path(args.model_path).name, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
               "mtp": True, "moe_combine": "reduce", "greedy_outputs_equal_across_layouts": same,
               "loadavg_1min": {"median": statistics.median(loads), "max": max(loads)},
               "layouts": summary}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        for name, s in summary.items():
            print(f"{name}: {s['tok_s']['median']:.0f} tok/s ({s['tok_s']['min']:.0f}-{s['tok_s']['max']:.0f}), "
                  f"{s['tok_s_vs_1_rank']:.2f}x of one rank, step {s['step_ms_median']['median']:.1f} ms, "
                  f"{s['bytes_per_step']['median'] / 1024:.0f} KiB/step per rank")
        print(f"greedy outputs equal across layouts: {same}; wrote {args.out}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
