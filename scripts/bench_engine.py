"""Benchmark: end-to-end generation of the engine on the embedded model, quantized (W8A8 + FA3), on this
machine: tokens/s with and without MTP speculative decoding, with the int8 (NZ) latent cache and with a
bf16 latent cache, and the cache bytes per token of each.

    python scripts/bench_engine.py [--prompts 16] [--max-new-tokens 64] [--repeat 3] [--out FILE]

Prompts: the first questions of the embedded model's chat data, greedy. Each configuration runs the same
batch through a fresh engine (continuous batching, up to 16 sequences); the figure is the median wall
time over --repeat runs. Writes JSON to --out (default benchmarks/engine.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import embedded_quantized, write_result  # noqa: E402

QUESTIONS = ["What's deep learning?", "What does the os module do?", "Explain list comprehensions.",
             "How do I open a file?", "What is a decorator?", "Describe the json module.",
             "What is a generator?", "How do I sort a list?", "What does the re module do?",
             "Explain exceptions.", "What is a dictionary?", "How do I read a CSV file?",
             "What is the pathlib module?", "Explain classes.", "What does zip do?", "What is asyncio?"]
CONFIGS = {"int8-NZ cache": {"nz": True}, "int8-NZ cache + MTP": {"nz": True, "mtp": True},
           "bf16 cache": {"fa3": False}, "bf16 cache + MTP": {"fa3": False, "mtp": True}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dsquant-engine-bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "engine.json"))
    args = ap.parse_args()

    import torch

    from pipeline.engine.config import EngineConfig
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.worker.loader import load_quantized
    from pipeline.engine.protocol import SamplingParams
    from pipeline.text.tokenizer import Tokenizer

    torch.set_num_threads(2)
    qdir = embedded_quantized(args.dir)
    tok = Tokenizer.from_dir(str(qdir))
    loaded = load_quantized(str(qdir))
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in (QUESTIONS * 4)[: args.prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    res: dict = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                 "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "configs": {}}
    outputs = {}
    for name, kw in CONFIGS.items():
        times, eng = [], None
        for _ in range(args.repeat):
            eng = LLMEngine(loaded, EngineConfig(num_blocks=512, block_size=16, **kw), tok)
            t = time.perf_counter()
            outputs[name] = eng.generate(prompts, params)
            times.append(time.perf_counter() - t)
        stats = eng.stats()
        gen = stats.generated_tokens
        res["configs"][name] = {
            "seconds": round(statistics.median(times), 3), "generated_tokens": gen,
            "tokens_per_s": round(gen / statistics.median(times), 1), "steps": stats.steps,
            "acceptance_rate": round(stats.acceptance_rate, 3) if kw.get("mtp") else None,
            "cache_bytes_per_token": eng.runner.bytes_per_token(), "runs_s": [round(t, 3) for t in times]}
        print(name, json.dumps(res["configs"][name]), flush=True)
    res["mtp_outputs_identical"] = (outputs["int8-NZ cache + MTP"] == outputs["int8-NZ cache"]
                                    and outputs["bf16 cache + MTP"] == outputs["bf16 cache"])
    write_result(args.out, res, hide=["configs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
