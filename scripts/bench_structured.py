"""Benchmark: constrained decoding's cost in the engine on the embedded model, quantized (W8A8 + FA3), on
this machine: generated tokens/s at concurrency C (4 and 16 requests in flight) with 0 %, 50 % and 100 %
of the requests constrained by a JSON schema (SamplingParams.grammar, pipeline.engine.core.guided).

    python scripts/bench_structured.py [--requests-per-slot 2] [--max-new-tokens 48] [--repeat 3] [--out FILE]

Every request has the same chat prompt shape and generates exactly --max-new-tokens tokens (the schema
cannot be completed sooner; unconstrained requests ignore eos), so every configuration does the same
token work and tokens/s compare directly. C requests are kept in flight (a finished one is replaced)
until C * --requests-per-slot have run; sampling at temperature 1 with fixed seeds. The three shares
run interleaved, --repeat rounds, so that a busy machine's slow spells fall on all of them alike. Per
configuration: the median over the rounds of tokens/s and step time, and the time spent waiting for and
applying the masks per step (Guides.mask_seconds / steps). Writes JSON to --out (default benchmarks/structured.json).
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
from bench_io import embedded_quantized, loadavg, write_result  # noqa: E402

QUESTIONS = ["List some people as JSON.", "Give me records of users.", "Describe a team in JSON.",
             "What people work here?"]
# objects of people, at least 6 of them: more than --max-new-tokens tokens, so no output can end early
SCHEMA = {"type": "array", "minItems": 6, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
    "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 12},
                   "age": {"type": "integer", "minimum": 18, "maximum": 99},
                   "role": {"enum": ["engineer", "manager", "designer", "analyst"]}}}}


def run(eng, prompts, grammar, concurrency: int, total: int, frac: float, max_new: int) -> dict:
    from pipeline.engine.protocol import EngineRequest, SamplingParams

    constrained = round(concurrency * frac)

    def request(i: int) -> EngineRequest:
        guided = (i % concurrency) < constrained      # the same share of every wave
        p = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=i, ignore_eos=not guided,
                           grammar=grammar if guided else None)
        return EngineRequest(f"r{i}", prompts[i % len(prompts)], p)

    nxt, done, gen = 0, 0, 0
    for _ in range(concurrency):
        eng.add(request(nxt))
        nxt += 1
    t0 = time.perf_counter()
    steps0, mask0 = eng.counters.steps, eng.guides.mask_seconds
    while eng.has_work:
        for o in eng.step():
            gen += len(o.token_ids)
            if o.finish_reason is not None:
                assert o.error is None, o.error
                done += 1
                if nxt < total:
                    eng.add(request(nxt))
                    nxt += 1
    dt = time.perf_counter() - t0
    steps = eng.counters.steps - steps0
    return {"seconds": dt, "generated_tokens": gen, "tokens_per_s": gen / dt, "steps": steps,
            "step_ms": 1000 * dt / steps, "mask_ms_per_step": 1000 * (eng.guides.mask_seconds - mask0) / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--dir", default="/tmp/dsquant-engine-bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "structured.json"))
    args = ap.parse_args()

    import torch

    from pipeline.engine.config import EngineConfig
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.worker.loader import load_quantized
    from pipeline.serving.structured_outputs import json_schema_grammar
    from pipeline.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    qdir = embedded_quantized(args.dir)
    tok = Tokenizer.from_dir(str(qdir))
    loaded = load_quantized(str(qdir))
    prompts = [tuple(tok.encode_chat([{"role": "user", "content": q}])) for q in QUESTIONS]
    grammar = json_schema_grammar(SCHEMA)
    res: dict = {"model": "embedded (dsv3-tiny-pydoc) W8A8 + FA3, int8 NZ cache", "torch_threads": args.threads,
                 "max_new_tokens": args.max_new_tokens, "requests_per_slot": args.requests_per_slot,
                 "repeat": args.repeat, "schema": SCHEMA, "loadavg_before": loadavg(), "configs": {}}
    for c in (4, 16):
        eng = LLMEngine(loaded, EngineConfig(num_blocks=512, block_size=16, max_num_seqs=16, nz=True), tok)
        run(eng, prompts, grammar, c, c, 1.0, 4)          # warm-up: first calls, the grammar compiled once
        fracs = (0.0, 0.5, 1.0)
        runs_of: dict = {f: [] for f in fracs}
        for _ in range(args.repeat):     # interleaved: a busy machine's slow spell hits every share alike
            for frac in fracs:
                runs_of[frac].append(run(eng, prompts, grammar, c, c * args.requests_per_slot, frac,
                                         args.max_new_tokens))
        for frac in fracs:
            runs = runs_of[frac]
            med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
            med["runs_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in runs]
            res["configs"][f"C={c} constrained={int(frac * 100)}%"] = med
            print(f"C={c} constrained={int(frac * 100)}%", json.dumps(med), flush=True)
        base = res["configs"][f"C={c} constrained=0%"]["tokens_per_s"]
        for frac in (50, 100):
            cfg = res["configs"][f"C={c} constrained={frac}%"]
            cfg["throughput_vs_unconstrained"] = round(cfg["tokens_per_s"] / base, 3)
    res["loadavg_after"] = loadavg()
    write_result(args.out, res, hide=["schema"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
