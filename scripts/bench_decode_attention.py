"""Benchmark: one decode step of ONE attention layer's cache attention at DeepSeek-V3's real shapes
(128 heads, kv_lora_rank C = 512, qk_rope_head_dim d_r = 64, block_size 128), int8 latent (FA3) in the NZ
layout against a bf16 cache.

    python scripts/bench_decode_attention.py [--contexts 4096,8192,16384,32768] [--batches 1,4,16]
        [--repeat 5] [--big-repeat 3] [--big-tokens 131072] [--kinds int8_nz,bf16_nd,int8_nd]
        [--max-batch-tokens N] [--threads N] [--retries 1] [--budget-s 300]
        [--out benchmarks/decode_attention.json]

What is timed: ``pipeline.engine.attention.paged.paged_decode_attention`` for B sequences of ``context`` cached
tokens each (one query token per sequence, o_lat [B, 128, 512] out), i.e. the part of the decode step that
reads the KV cache; the projections around it are the same for every cache kind and not included.

Cache kinds (every one computed the same way: blocks upcast to float32 a few at a time, float32 GEMMs,
online softmax; on this CPU bf16 and int8 arithmetic is far slower than converting to fp32, as measured
on the 2-core development machine, so this is the fair bf16 baseline):

* ``int8_nz``: FA3 layer, int8 latent + bf16 k_pe, NZ layout (what MindIE's enable_nz + FA3 serve);
* ``bf16_nd``: layer without FA3, bf16 latent + bf16 k_pe, ND layout;
* ``int8_nd``: int8 latent in ND (to show what NZ costs or saves).

One cache per kind holds the sequences on shuffled (non-contiguous) blocks; a (context, B) point reads
the first ``context`` tokens of the first B sequences. Latent ~ N(0, 1)
(what kv_a_layernorm gives), fa_k = 5 / 127 (~max |c| of a Gaussian this size); the values do not change
the time. Each point: one warm-up per kind, then --repeat rounds (--big-repeat for points of more than
--big-tokens cached tokens) that time each kind once, interleaved, so that load from other processes hits
every kind alike; the figure is the median (the minimum is kept too). This machine is shared: a point
whose repeats spread more than 1.5x is timed again (--retries) and the calmer attempt kept, flagged
``noisy`` if it still spreads; the 1-minute load average is recorded. Points whose caches would not fit in
half the available memory, above --max-batch-tokens, or that would take the run past --budget-s, are
skipped and listed. Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import write_result  # noqa: E402

import torch  # noqa: E402

from pipeline.config import DeepseekV3Config  # noqa: E402
from pipeline.engine.attention.paged import paged_decode_attention  # noqa: E402
from pipeline.quant.recipe.recipe import kv_bytes_per_token  # noqa: E402
from pipeline.engine.cache.paged_cache import PagedLatentCache  # noqa: E402
from pipeline.serving.sharding.replica import DEEPSEEK_V3_CONFIG  # noqa: E402
from pipeline.quant.recipe.recipe import Recipe  # noqa: E402

H, C, D_R, BLOCK = 128, 512, 64, 128
SOFTMAX_SCALE = 0.1352338           # V3: 192^-0.5 * mscale^2
FA_K = 5.0 / 127
NOISY_SPREAD = 1.5
KINDS = {"int8_nz": dict(fa_k=FA_K, nz=True), "bf16_nd": dict(fa_k=None, nz=False),
         "int8_nd": dict(fa_k=FA_K, nz=False)}


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cpu_name() -> str:
    from pipeline.cbuild import cpu_description

    return cpu_description()["cpu"]


def build_caches(kinds: list[str], seq_lens: list[int], seed: int = 0):
    """One cache per kind holding sequences of ``seq_lens`` tokens (the same data in every kind) on shuffled
    blocks; returns the caches and each sequence's block ids."""
    per_seq = [n // BLOCK for n in seq_lens]
    n_blocks = sum(per_seq)
    caches = {k: PagedLatentCache(n_blocks, BLOCK, C, D_R, torch.bfloat16, **KINDS[k]) for k in kinds}
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    starts = [sum(per_seq[:i]) for i in range(len(per_seq))]
    tables = [perm[s:s + n] for s, n in zip(starts, per_seq)]
    step = 4096
    for table, ctx in zip(tables, seq_lens):
        for p in range(0, ctx, step):
            n = min(step, ctx - p)
            c = torch.randn(n, C, generator=g).bfloat16()
            pe = torch.randn(n, D_R, generator=g).bfloat16()
            for cache in caches.values():
                cache.write(table, c, pe, p)
    return caches, tables


def time_point(caches: dict, kinds: list[str], q, qp, tables, lengths, repeats: int
               ) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """One warm-up per kind, then ``repeats`` rounds that time every kind once each, interleaved, so that a
    burst of load from other processes hits all kinds alike. Returns seconds per kind and the outputs."""
    outs = {k: paged_decode_attention(q, qp, caches[k], tables, lengths, SOFTMAX_SCALE) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for k in kinds:
            t0 = time.perf_counter()
            outs[k] = paged_decode_attention(q, qp, caches[k], tables, lengths, SOFTMAX_SCALE)
            times[k].append(time.perf_counter() - t0)
    return times, outs


def pick_threads(caches: dict, kind: str, tables, max_threads: int) -> tuple[int, dict[int, float]]:
    """The faster of ``max_threads`` and 1 intra-op threads right now, on a 4096-token B=1 step (median of
    3 after a warm-up). On a shared machine whose other processes keep the cores busy, 2 OpenMP threads
    that spin-wait on each other can be 100x slower than one thread; on a quiet one they are ~1.7x faster."""
    per = min(4096 // BLOCK, len(tables[0]))
    g = torch.Generator().manual_seed(2)
    q, qp = torch.randn(1, H, C, generator=g) * 0.3, torch.randn(1, H, D_R, generator=g) * 0.3
    ms = {}
    for n in sorted({max_threads, 1}, reverse=True):
        torch.set_num_threads(n)
        paged_decode_attention(q, qp, caches[kind], [tables[0][:per]], [per * BLOCK], SOFTMAX_SCALE)
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            paged_decode_attention(q, qp, caches[kind], [tables[0][:per]], [per * BLOCK], SOFTMAX_SCALE)
            t.append(time.perf_counter() - t0)
        ms[n] = statistics.median(t) * 1e3
    best = min(ms, key=ms.get)
    torch.set_num_threads(best)
    return best, ms


def spread(times: dict[str, list[float]]) -> float:
    """Largest max/min over the kinds' repeats: > NOISY_SPREAD means another process got in the way."""
    return max(max(t) / min(t) for t in times.values())


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    import math
    return 10 * math.log10(ref.double().pow(2).sum().item() / (x.double() - ref.double()).pow(2).sum().item())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--kinds", default="int8_nz,bf16_nd,int8_nd")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--big-repeat", type=int, default=3)
    ap.add_argument("--big-tokens", type=int, default=131072, help="points above B x context get --big-repeat")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="skip points above this B x context")
    ap.add_argument("--threads", default="auto",
                    help="intra-op threads, or 'auto': the faster of all cores and 1, probed at the start and "
                         "again before re-timing a noisy point")
    ap.add_argument("--retries", type=int, default=1,
                    help=f"re-time a point whose repeats spread more than {NOISY_SPREAD}x (other processes)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="skip (and list) the remaining points once they would take the run past this")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "decode_attention.json"))
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r} (known: {', '.join(KINDS)})")
    for ctx in contexts:
        if ctx % BLOCK:
            ap.error(f"context {ctx} is not a multiple of the block size {BLOCK}")
    auto_threads = args.threads == "auto"
    max_threads = (os.cpu_count() or 1) if auto_threads else int(args.threads)
    torch.set_num_threads(max_threads)
    t_start = time.perf_counter()

    # What fits: every kind's cache for the largest batch x context, within half the available memory.
    probe = {k: PagedLatentCache(1, BLOCK, C, D_R, torch.bfloat16, **KINDS[k]).bytes_per_token() for k in kinds}
    mem_budget = mem_available() // 2
    points, skipped = [], []
    for ctx in contexts:
        for B in batches:
            tokens = B * ctx
            if args.max_batch_tokens is not None and tokens > args.max_batch_tokens:
                skipped.append({"context": ctx, "batch": B, "why": f"B x context {tokens} > --max-batch-tokens"})
            elif tokens * sum(probe.values()) > mem_budget:
                skipped.append({"context": ctx, "batch": B,
                                "why": f"caches need {tokens * sum(probe.values()) / 2**30:.1f} GiB > half the "
                                       f"available memory ({mem_budget / 2**30:.1f} GiB)"})
            else:
                points.append((ctx, B))
    if not points:
        raise SystemExit("nothing to run: every point was skipped")
    # sequence b holds the longest context of the points that read it (B > b): nothing a point skips.
    seq_lens = [max(ctx for ctx, B in points if B > b) for b in range(max(B for _, B in points))]
    t0 = time.perf_counter()
    caches, tables = build_caches(kinds, seq_lens)
    fill_s = time.perf_counter() - t0
    probes = []
    if auto_threads:
        probes.append(pick_threads(caches, kinds[0], tables, max_threads))
    print(f"caches filled: {len(seq_lens)} sequences, {sum(seq_lens)} tokens, kinds {kinds}, {fill_s:.1f} s; "
          f"torch {torch.__version__}; threads {torch.get_num_threads()}"
          + (f" (probe ms by threads: {probes[-1][1]})" if probes else ""), flush=True)

    g = torch.Generator().manual_seed(1)
    rows = []
    sec_per_token = None                     # per kind-call, from the points so far (their fastest runs)
    for ctx, B in points:
        repeats = args.repeat if B * ctx <= args.big_tokens else args.big_repeat
        elapsed = time.perf_counter() - t_start
        if sec_per_token is not None:
            estimate = sec_per_token * B * ctx * len(kinds) * (repeats + 1)
            if elapsed + estimate > args.budget_s:
                skipped.append({"context": ctx, "batch": B, "why": f"time budget: {elapsed:.0f} s spent, this "
                                f"point needs ~{estimate:.0f} s more than --budget-s {args.budget_s:.0f}"})
                print(f"ctx {ctx:6d} B {B:3d} skipped (time budget)", flush=True)
                continue
        q = torch.randn(B, H, C, generator=g) * 0.3
        qp = torch.randn(B, H, D_R, generator=g) * 0.3
        per = ctx // BLOCK
        tabs, lengths = [t[:per] for t in tables[:B]], [ctx] * B
        attempts = []
        for attempt in range(1 + args.retries):
            if attempt and auto_threads:
                probes.append(pick_threads(caches, kinds[0], tables, max_threads))
            load0 = os.getloadavg()[0]
            times, outs = time_point(caches, kinds, q, qp, tabs, lengths, repeats)
            attempts.append({"times": times, "load1": [load0, os.getloadavg()[0]], "spread": spread(times),
                             "threads": torch.get_num_threads()})
            if attempts[-1]["spread"] <= NOISY_SPREAD:
                break
        best = min(attempts, key=lambda a: sum(statistics.median(t) for t in a["times"].values()))
        row = {"context": ctx, "batch": B, "repeats": repeats, "attempts": len(attempts),
               "noisy": best["spread"] > NOISY_SPREAD, "spread": best["spread"], "load1": best["load1"],
               "threads": best["threads"]}
        flops = B * ctx * H * 2 * (2 * C + D_R)              # scores (C + d_r wide) and output (C) products
        for k in kinds:
            med = statistics.median(best["times"][k])
            row[k] = {"ms": med * 1e3, "min_ms": min(best["times"][k]) * 1e3,
                      "times_ms": [t * 1e3 for t in best["times"][k]], "gflops": flops / med / 1e9,
                      "cache_gb_per_s": B * ctx * probe[k] / med / 1e9, "cache_mib": B * ctx * probe[k] / 2**20}
        fastest = min(min(t) for t in best["times"].values()) / (B * ctx)
        sec_per_token = fastest if sec_per_token is None else max(sec_per_token, fastest)
        if "int8_nz" in outs and "int8_nd" in outs:
            row["nz_equals_nd"] = bool(torch.equal(outs["int8_nz"], outs["int8_nd"]))
        if "int8_nz" in outs and "bf16_nd" in outs:
            row["int8_over_bf16_time"] = row["int8_nz"]["ms"] / row["bf16_nd"]["ms"]
            row["sqnr_int8_vs_bf16_db"] = sqnr_db(outs["int8_nz"], outs["bf16_nd"])
        rows.append(row)
        print(" ".join([f"ctx {ctx:6d} B {B:3d}"] + [f"{k} {row[k]['ms']:9.1f} ms" for k in kinds]
                       + [f"(spread {row['spread']:.2f}, {len(attempts)} attempt(s))"]), flush=True)

    v3 = DeepseekV3Config.from_dict(DEEPSEEK_V3_CONFIG)
    _, model_fa3 = kv_bytes_per_token(v3, Recipe())
    _, model_bf16 = kv_bytes_per_token(v3, None)
    memory = {
        "bytes_per_token_layer": probe,
        "capacity_ratio_layer": (probe["bf16_nd"] / probe["int8_nz"]
                                 if {"bf16_nd", "int8_nz"} <= set(probe) else None),
        "bytes_per_token_model_fa3": model_fa3, "bytes_per_token_model_bf16": model_bf16,
        "capacity_ratio_model": model_bf16 / model_fa3,
        "note": "model: 61 layers + the MTP layer; the default recipe keeps the MTP layer's cache in bf16",
    }
    result = {
        "what": "paged_decode_attention, one layer, one decode step of B sequences (o_lat only)",
        "shapes": {"heads": H, "kv_lora_rank": C, "qk_rope_head_dim": D_R, "block_size": BLOCK,
                   "softmax_scale": SOFTMAX_SCALE, "fa_k": FA_K},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "thread_probes_ms": [{str(n): ms for n, ms in p[1].items()} for p in probes],
                    "torch": torch.__version__, "python": platform.python_version()},
        "kinds": kinds, "points": rows, "skipped": skipped, "memory": memory,
        "fill_s": fill_s, "total_s": time.perf_counter() - t_start,
    }
    print_table(result)
    write_result(args.out, result, show=False)
    print(f"wrote {args.out}")
    return result


def print_table(r: dict) -> None:
    kinds = r["kinds"]
    head = (["context", "B"] + [f"{k} ms" for k in kinds]
            + ["int8/bf16", "GFLOP/s int8_nz", "SQNR dB", "threads", "spread", "load"])
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for p in r["points"]:
        cells = [str(p["context"]), str(p["batch"])] + [f"{p[k]['ms']:.1f}" for k in kinds]
        cells.append(f"{p['int8_over_bf16_time']:.2f}" if "int8_over_bf16_time" in p else "-")
        cells.append(f"{p['int8_nz']['gflops']:.0f}" if "int8_nz" in p else "-")
        cells.append(f"{p['sqnr_int8_vs_bf16_db']:.1f}" if "sqnr_int8_vs_bf16_db" in p else "-")
        cells.append(str(p["threads"]))
        cells.append(f"{p['spread']:.2f}" + (" noisy" if p["noisy"] else ""))
        cells.append(f"{max(p['load1']):.1f}")
        print("| " + " | ".join(cells) + " |")
    m = r["memory"]
    ratio = m["capacity_ratio_layer"]
    print(f"\nbytes per token and layer: {m['bytes_per_token_layer']}"
          + (f"; capacity ratio {ratio:.2f}" if ratio else ""))
    print(f"whole model: {m['bytes_per_token_model_fa3']} (FA3) vs {m['bytes_per_token_model_bf16']} (bf16) bytes "
          f"per token, ratio {m['capacity_ratio_model']:.3f}")
    for s in r["skipped"]:
        print(f"skipped: context {s['context']} B {s['batch']}: {s['why']}")
    print(f"fill {r['fill_s']:.1f} s, total {r['total_s']:.1f} s")


if __name__ == "__main__":
    main()
