"""Benchmark: the engine's decode attention for ONE layer on the CPU, the torch path
(``batched_decode_attention``) against the C kernel (``pipeline.engine.native.cpu_attention``), and the step's
cache write (``PagedLatentCache.write_slots``) through torch ops against the C kernel.

    python scripts/bench_cpu_attention.py [--batches 1,8,16,32] [--contexts 190,1000] [--repeat 15]
        [--kinds int8_nd,int8_nz,bf16_nd] [--threads 1] [--out benchmarks/cpu_attention.json]

Shapes of the embedded model (pipeline/assets/dsv3-tiny-pydoc): 4 heads, latent C = 512, rope d_r = 64,
block size 16; B sequences of ``context`` cached tokens each on shuffled blocks, one query token each.
Kinds: ``int8_nd`` / ``int8_nz`` (FA3 layer: int8 latent, bf16 k_pe, ND or NZ) and ``bf16_nd`` (a layer
without FA3). Each point: one warm-up per path, then --repeat rounds that time torch and native once
each, interleaved (load from other processes hits both alike); the figures are the medians (minimums
kept too), in milliseconds. The machine is shared: /proc/loadavg is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import loadavg, write_result  # noqa: E402

import torch  # noqa: E402

from pipeline.cbuild import cpu_description  # noqa: E402
from pipeline.engine.native import cpu_attention  # noqa: E402
from pipeline.engine.attention.batched import DecodeBatch, batched_decode_attention  # noqa: E402
from pipeline.engine import config as engine_config  # noqa: E402
from pipeline.engine.cache.paged_cache import PagedLatentCache  # noqa: E402

H, C, D_R, BLOCK = 4, 512, 64, 16
SOFTMAX_SCALE = 0.1352338
FA_K = 5.0 / 127


def make_cache(kind: str, batch: int, context: int, seed: int = 0):
    int8, nz = kind.startswith("int8"), kind.endswith("_nz")
    per = -(-context // BLOCK)
    cache = PagedLatentCache(batch * per + 1, BLOCK, C, D_R, fa_k=FA_K if int8 else None, nz=nz)
    g = torch.Generator().manual_seed(seed)
    if int8:
        cache.c.copy_(torch.randint(-127, 128, cache.c.shape, generator=g, dtype=torch.int8))
    else:
        cache.c.copy_(torch.randn(cache.c.shape, generator=g))
    cache.pe.copy_(torch.randn(cache.pe.shape, generator=g))
    ids = list(range(cache.num_blocks))
    random.Random(seed).shuffle(ids)
    tables = [[ids.pop() for _ in range(per)] for _ in range(batch)]
    q = torch.randn(batch, H, C, generator=g) * 0.05
    qp = torch.randn(batch, H, D_R, generator=g) * 0.3
    return cache, DecodeBatch.build(tables, [context] * batch, BLOCK, cache.num_blocks), q, qp


def interleaved(fns: dict, repeat: int) -> dict:
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: {"median_ms": round(1e3 * statistics.median(v), 4), "min_ms": round(1e3 * min(v), 4)}
            for k, v in times.items()}


def attention_points(args) -> list[dict]:
    rows = []
    for kind in args.kinds.split(","):
        for context in (int(x) for x in args.contexts.split(",")):
            for batch in (int(x) for x in args.batches.split(",")):
                cache, db, q, qp = make_cache(kind, batch, context)
                ref = batched_decode_attention(q, qp, cache, db, SOFTMAX_SCALE)
                got = cpu_attention.decode_attention(q, qp, cache, db, SOFTMAX_SCALE)
                t = interleaved({"torch": lambda: batched_decode_attention(q, qp, cache, db, SOFTMAX_SCALE),
                                 "native": lambda: cpu_attention.decode_attention(q, qp, cache, db, SOFTMAX_SCALE)},
                                args.repeat)
                row = {"kind": kind, "batch": batch, "context": context, "torch": t["torch"], "native": t["native"],
                       "speedup": round(t["torch"]["median_ms"] / t["native"]["median_ms"], 2),
                       "max_rel_diff": float(f"{((got - ref).abs().max() / ref.abs().max()).item():.3g}")}
                print(f"{kind:8s} B={batch:3d} ctx={context:5d}  torch {t['torch']['median_ms']:8.3f} ms  native "
                      f"{t['native']['median_ms']:7.3f} ms  x{row['speedup']:.2f}", flush=True)
                rows.append(row)
    return rows


def write_points(args) -> list[dict]:
    rows = []
    for nz in (False, True):
        for n in (1, 16, 32):
            g = torch.Generator().manual_seed(n)
            c, pe = torch.randn(n, C, generator=g).bfloat16(), torch.randn(n, D_R, generator=g).bfloat16()
            slots = torch.randperm(2048 * BLOCK, generator=g)[:n]
            caches = {}
            for kernels in ("torch", "native"):
                os.environ[engine_config.ENV] = kernels
                caches[kernels] = PagedLatentCache(2048, BLOCK, C, D_R, fa_k=FA_K, nz=nz)
                caches[kernels].write_slots(slots, c, pe)
            os.environ.pop(engine_config.ENV)
            same = all(torch.equal(getattr(caches["torch"], a), getattr(caches["native"], a)) for a in ("c", "pe"))
            t = interleaved({k: (lambda cc=cc: cc.write_slots(slots, c, pe)) for k, cc in caches.items()},
                            args.repeat * 10)
            rows.append({"layout": "nz" if nz else "nd", "tokens": n, "torch": t["torch"], "native": t["native"],
                         "bit_identical": same})
            print(f"write {'NZ' if nz else 'ND'} S={n:3d}  torch {t['torch']['median_ms']:.4f} ms  native "
                  f"{t['native']['median_ms']:.4f} ms  identical={same}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--contexts", default="190,1000")
    ap.add_argument("--kinds", default="int8_nd,int8_nz,bf16_nd")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine runs one per core)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "cpu_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_attention.library() is None or cpu_attention.write_library() is None:
        raise SystemExit(f"no native kernels: {cpu_attention.status()}")
    before = loadavg()
    att = attention_points(args)
    wr = write_points(args)
    res = {"what": "one layer's decode attention (H=4, C=512, d_r=64, block 16) and cache write, torch vs native",
           "threads": args.threads, "repeat": args.repeat, "kernels": cpu_attention.status(),
           "cpu": cpu_description()["cpu"],
           "loadavg_before": before, "loadavg_after": loadavg(), "attention": att, "cache_write": wr}
    write_result(args.out, res, hide=("attention", "cache_write"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
