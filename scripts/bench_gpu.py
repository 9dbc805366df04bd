"""Benchmark the Triton kernels (pipeline.engine.triton) on a CUDA GPU at DeepSeek-V3's shapes; on a CPU,
a self-check of each kernel through Triton's interpreter (no timings: they need a GPU).

    python scripts/bench_gpu.py [--peak-gbps 4800] [--contexts 4096,8192,16384,32768] [--batches 1,8,32,64]
        [--block-size 64] [--gemm-rows 1,8,32,64] [--experts 32] [--no-tune] [--budget-s 270]
        [--out benchmarks/gpu.json]

On CUDA, in order, printing a line per point (the whole run is bounded by --budget-s, ~5 minutes;
points past it are skipped and listed):

1. ``self_check``: every kernel at tiny shapes on the device against the torch path (the tests' checks:
   int32 accumulators and FAST-epilogue outputs bit for bit, attention within the stated tolerances).
2. ``tune``: MLA decode tile configs (BLOCK_H x BLOCK_T x warps) at one point (batch 32, context 8k) for
   the int8 and the bf16 latent; the fastest of each is used below (--no-tune: the defaults).
3. ``decode``: ``paged_mla_decode`` (precision bf16) at 128 heads, latent 512, rope 64, for int8 ND, int8
   NZ and bf16 ND caches, at every context x batch: time, cache bytes read (int8: 640, bf16: 1152 per
   token), achieved GB/s and its fraction of --peak-gbps (H200: ~4800), TFLOP/s of the two products.
4. ``gemm``: int8 W8A8 (static, quantization fused) and W8A8_DYNAMIC (per-token, fused) kernels against
   torch's bf16 ``x @ W.T`` and the engine's torch int8 path (qlinear FAST epilogue, ``torch._int_mm``) at
   V3's linears: q_a 7168->1536, kv_a 7168->576, q_b 1536->24576, o_proj 16384->7168, expert gate+up
   7168->4096, expert down 2048->7168; weight GB/s.
5. ``moe``: ``fused_moe`` with --experts local experts (EP of V3's 256) and top-8 among them (an upper
   bound: every routed slot on this GPU) against the torch per-expert loop.
6. ``engine_free``: one decoder layer's kernels back to back (q_a, q_b, kv_a, W_UK absorb, attention over
   the int8 NZ cache, W_UV, o_proj, routed + shared MoE), times 61 layers: the decode step and tokens/s
   with no engine, no launch overlap and no communication (one GPU holding a whole layer) -- a bound on
   what the kernels allow, not a serving number.

Times are ``triton.testing.do_bench`` medians (L2 flushed between runs). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before triton and the kernels are imported

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import write_result  # noqa: E402

H, C, D_R = 128, 512, 64
SOFTMAX_SCALE = 0.1352338
FA_K = 5.0 / 127
LAYERS = 61
HIDDEN, Q_LORA, MOE_INTER, NOPE = 7168, 1536, 2048, 128
#: name -> (out, in) of V3's linears
GEMMS = {"q_a": (Q_LORA, HIDDEN), "kv_a": (C + D_R, HIDDEN), "q_b": (H * (NOPE + D_R), Q_LORA),
         "o_proj": (HIDDEN, H * NOPE), "expert_gate_up": (2 * MOE_INTER, HIDDEN), "expert_down": (HIDDEN, MOE_INTER)}
# attention linears are W8A8 (static), every mlp linear W8A8_DYNAMIC (pipeline.quant.recipe.recipe)
STATIC = {"q_a", "kv_a", "q_b", "o_proj"}
#: (BLOCK_H, BLOCK_T, num_warps) tried by the tune step (each is one compile, ~seconds)
TUNE_CONFIGS = ((16, 32, 4), (16, 64, 4), (16, 32, 8), (32, 32, 8), (32, 64, 8), (64, 32, 8))
MLA_RTOL = {"ieee": 1e-5, "bf16": 1e-2}      # tests/test_triton_kernels.py's MLA_IEEE_RTOL, MLA_BF16_RTOL


def log(msg: str) -> None:
    print(msg, flush=True)


# ----- self-check (both devices) ----------------------------------------------------------------------------
def self_check(dev: str) -> dict:
    """Each kernel at tiny shapes against the torch path on ``dev``; returns {check: result}."""
    from pipeline.engine.attention.paged import paged_decode_attention
    from pipeline.engine.triton.int8_gemm import int8_gemm_dynamic, int8_gemm_static, int8_linear
    from pipeline.engine.triton.mla_decode import block_table_tensor, paged_mla_decode_cache
    from pipeline.engine.triton.moe_gemm import fused_moe
    from pipeline.engine.cache.paged_cache import PagedLatentCache
    from pipeline.engine.layers.qlinear import FAST, build_int8_linear, quantize_per_token, quantize_static
    from pipeline.format.description import W8A8, W8A8_DYNAMIC

    g = torch.Generator().manual_seed(0)
    out = {}
    lengths, tables = [1, 13, 40], [[3], [5, 7], [1, 2, 9, 11]]
    for kind, nz in (("int8", True), ("int8", False), ("bf16", False)):
        cache = PagedLatentCache(16, 12, 48, 16, fa_k=0.04 if kind == "int8" else None, nz=nz, device=dev)
        for t, n in zip(tables, lengths):
            cache.write(t, torch.randn(n, 48, generator=g).bfloat16(), torch.randn(n, 16, generator=g).bfloat16())
        q = (0.3 * torch.randn(3, 5, 48, generator=g)).to(dev)
        qp = (0.3 * torch.randn(3, 5, 16, generator=g)).to(dev)
        ref = paged_decode_attention(q, qp, cache, tables, lengths, SOFTMAX_SCALE)
        bt, ln = block_table_tensor(tables, lengths, 12, dev)
        for prec in ("ieee", "bf16"):
            o = paged_mla_decode_cache(q, qp, cache, bt, ln, SOFTMAX_SCALE, precision=prec, num_splits=2)
            rel = ((o - ref).abs().max() / ref.abs().max()).item()
            out[f"mla_{kind}_{'nz' if nz else 'nd'}_{prec}"] = {"rel_err": rel, "ok": rel <= MLA_RTOL[prec]}
    n, k = 40, 72
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    sp = dict(weight=w, input_scale=torch.tensor([0.02]), input_offset=torch.tensor([-3.0]),
              quant_bias=torch.randint(-3000, 3000, (n,), dtype=torch.int32, generator=g),
              deq_scale=torch.rand(n, generator=g) * 1e-3)
    dp = dict(weight=w, weight_scale=torch.rand(n, 1, generator=g) * 1e-2)
    sp, dp = ({a: b.to(dev) for a, b in p.items()} for p in (sp, dp))
    x = (2 * torch.randn(5, k, generator=g)).bfloat16().to(dev)
    acc = int8_gemm_static(x, w.to(dev), sp["input_scale"], sp["input_offset"], sp["quant_bias"], sp["deq_scale"],
                           return_acc=True)
    xq = quantize_static(x, sp["input_scale"].reshape(()), sp["input_offset"].reshape(()))
    out["gemm_static_acc_exact"] = {"ok": torch.equal(acc.cpu().long(), xq.cpu().long() @ w.long().T)}
    out["gemm_static_fast_bits"] = {"ok": torch.equal(int8_linear(build_int8_linear("s", W8A8, sp, epilogue=FAST), x),
                                                      build_int8_linear("s", W8A8, sp, epilogue=FAST)(x.float()))}
    xq, s = quantize_per_token(x)
    acc = int8_gemm_dynamic(x, w.to(dev), dp["weight_scale"], return_acc=True)
    out["gemm_dynamic_acc_exact"] = {"ok": torch.equal(acc.cpu().long(), xq.cpu().long() @ w.long().T)}
    dyn = build_int8_linear("d", W8A8_DYNAMIC, dp, epilogue=FAST)
    out["gemm_dynamic_fast_bits"] = {"ok": torch.equal(int8_linear(dyn, x), dyn(x.float()))}
    # MoE against the torch per-expert path (pipeline.engine.layers.moe's arithmetic)
    E, hid, inter, top = 4, 64, 32, 2
    st = _random_experts(E, hid, inter, dev, g)
    xm = torch.randn(9, hid, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:top] for _ in range(9)]).to(dev)
    wts = torch.rand(9, top, generator=g).to(dev)
    got, _ = fused_moe(xm, ids, wts, *st, dtype=torch.bfloat16)
    want = _moe_torch(xm, ids, wts, st, _expert_linears(st))
    rel = ((got - want).abs().max() / want.abs().max()).item()
    out["moe_vs_torch"] = {"rel_err": rel, "ok": rel <= 2 * 2 ** -7}
    return out


def _random_experts(E, hid, inter, dev, g=None):
    """Stacked int8 experts (w13 [E, 2I, H], scales, w2 [E, H, I], scales) with outputs of size ~1."""
    w13 = torch.randint(-127, 128, (E, 2 * inter, hid), dtype=torch.int8, generator=g).to(dev)
    w2 = torch.randint(-127, 128, (E, hid, inter), dtype=torch.int8, generator=g).to(dev)
    s13 = (torch.rand(E, 2 * inter, generator=g) * 0.03 / hid ** 0.5).to(dev)
    s2 = (torch.rand(E, hid, generator=g) * 0.03 / inter ** 0.5).to(dev)
    return w13, s13, w2, s2


def _expert_linears(st):
    from pipeline.engine.layers.qlinear import FAST, W8A8DynamicLinear
    w13, s13, w2, s2 = st
    return [(W8A8DynamicLinear("gu", w13[e], s13[e].reshape(-1, 1), epilogue=FAST),
             W8A8DynamicLinear("dn", w2[e], s2[e].reshape(-1, 1), epilogue=FAST)) for e in range(w13.shape[0])]


def _moe_torch(x, ids, wts, st, lins):
    """The routed experts as pipeline.engine.layers.moe.Int8MoE runs them (combine_experts over Int8Expert's math)."""
    import torch.nn.functional as F

    from pipeline.engine.layers.qlinear import quantize_per_token
    from pipeline.model.ffn import combine_experts
    inter = st[0].shape[1] // 2
    x_q, s_tok = quantize_per_token(x)

    def run(e, t):
        gu = lins[e][0].apply_quantized(x_q[t], s_tok[t])
        h = F.silu(gu[:, :inter].to(x.dtype)) * gu[:, inter:].to(x.dtype)
        return lins[e][1](h)

    return combine_experts(x, wts, ids, len(lins), run)[0]


# ----- GPU timings -------------------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds, self.skipped = time.time(), seconds, []

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)

    def ok(self, what: str) -> bool:
        if self.left() > 0:
            return True
        self.skipped.append(what)
        return False


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench, L2 flushed)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def make_caches(max_batch: int, max_ctx: int, bs: int, dev: str) -> dict:
    """One cache per kind holding max_batch sequences of max_ctx tokens on shuffled blocks (values random:
    they do not change the time). Returns kind -> (c, pe, nz, fa_k) and the block table."""
    from pipeline.engine.cache.nz import nz_shape
    per_seq = -(-max_ctx // bs)
    nb = max_batch * per_seq
    table = torch.randperm(nb, device=dev).to(torch.int32).view(max_batch, per_seq)
    pe = torch.randn(nb, bs, D_R, device=dev, dtype=torch.bfloat16)
    pe_nz = torch.randn(nb, *nz_shape(bs, D_R, torch.bfloat16), device=dev, dtype=torch.bfloat16)
    c8 = torch.randint(-127, 128, (nb, bs, C), device=dev, dtype=torch.int8)
    c8_nz = torch.randint(-127, 128, (nb, *nz_shape(bs, C, torch.int8)), device=dev, dtype=torch.int8)
    c16 = torch.randn(nb, bs, C, device=dev, dtype=torch.bfloat16)
    return {"int8_nd": (c8, pe, False, FA_K), "int8_nz": (c8_nz, pe_nz, True, FA_K),
            "bf16_nd": (c16, pe, False, None)}, table


def run_decode(fn_kw: dict, caches, table, B: int, ctx: int, bs: int, dev: str, kind: str) -> dict:
    from pipeline.engine.triton.mla_decode import paged_mla_decode
    c, pe, nz, fa_k = caches[kind]
    q = torch.randn(B, H, C, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(B, H, D_R, device=dev, dtype=torch.bfloat16)
    bt = table[:B, :-(-ctx // bs)].contiguous()
    lengths = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    ms = bench(lambda: paged_mla_decode(q, qp, c, pe, bt, lengths, SOFTMAX_SCALE, fa_k=fa_k, nz=nz,
                                        block_size=bs, check=False, **fn_kw))
    per_tok = (C * c.element_size()) + D_R * 2
    nbytes = B * ctx * per_tok
    return {"kind": kind, "batch": B, "context": ctx, "ms": ms, "cache_bytes": nbytes,
            "gbps": nbytes / ms / 1e6, "tflops": 2 * B * H * ctx * (2 * C + D_R) / ms / 1e9}


def tune(caches, table, bs, dev, budget) -> dict:
    best = {}
    for kind in ("int8_nz", "bf16_nd"):
        results = []
        for bh, bt, warps in TUNE_CONFIGS:
            if not budget.ok(f"tune {kind} {bh}/{bt}/{warps}"):
                continue
            kw = dict(block_h=bh, block_t=bt, num_warps=warps)
            try:
                r = run_decode(kw, caches, table, 32, 8192, bs, dev, kind)
            except Exception as e:                         # a config that does not fit (registers, smem)
                log(f"  tune {kind} {kw}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            results.append((r["ms"], kw))
            log(f"  tune {kind} {kw}: {r['ms']:.3f} ms")
        if results:
            best[kind] = min(results, key=lambda t: t[0])[1]
    best["int8_nd"] = best.get("int8_nz", {})
    return best


def gemm_points(rows, dev, budget) -> list:
    from pipeline.engine.triton.int8_gemm import int8_gemm_dynamic, int8_gemm_static
    from pipeline.engine.layers.qlinear import FAST, W8A8DynamicLinear, W8A8StaticLinear
    out = []
    for name, (n, k) in GEMMS.items():
        w = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        qb = torch.randint(-1000, 1000, (n,), device=dev, dtype=torch.int32)
        deq = torch.rand(n, device=dev) * 1e-4
        ws = torch.rand(n, 1, device=dev) * 1e-3
        s, o = torch.tensor([0.02], device=dev), torch.tensor([0.0], device=dev)
        mod = (W8A8StaticLinear(name, w, s, o, qb, deq, epilogue=FAST) if name in STATIC
               else W8A8DynamicLinear(name, w, ws, epilogue=FAST))
        for m in rows:
            if not budget.ok(f"gemm {name} m={m}"):
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if name in STATIC:
                t_k = bench(lambda: int8_gemm_static(x, w, s, o, qb, deq))
            else:
                t_k = bench(lambda: int8_gemm_dynamic(x, w, ws))
            t_bf16 = bench(lambda: x @ wb.T)
            t_torch = bench(lambda: mod(x))
            r = {"linear": name, "n": n, "k": k, "rows": m, "kind": "W8A8" if name in STATIC else "W8A8_DYNAMIC",
                 "triton_int8_ms": t_k, "torch_bf16_ms": t_bf16, "torch_int8_ms": t_torch,
                 "triton_int8_weight_gbps": n * k / t_k / 1e6, "torch_bf16_weight_gbps": 2 * n * k / t_bf16 / 1e6}
            out.append(r)
            log(f"  gemm {name:15s} m={m:4d}: triton int8 {t_k:.4f} ms, torch bf16 {t_bf16:.4f} ms, "
                f"torch int8 {t_torch:.4f} ms")
    return out


def moe_points(rows, experts, dev, budget) -> list:
    from pipeline.engine.triton.moe_gemm import fused_moe
    st = _random_experts(experts, HIDDEN, MOE_INTER, dev)
    lins = _expert_linears(st)
    out = []
    for m in rows:
        if not budget.ok(f"moe m={m}"):
            continue
        x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(m, experts, device=dev).topk(8, dim=1).indices
        wts = torch.rand(m, 8, device=dev)
        t_k = bench(lambda: fused_moe(x, ids, wts, *st))
        t_t = bench(lambda: _moe_torch(x, ids, wts, st, lins))
        out.append({"rows": m, "experts": experts, "top_k": 8, "triton_ms": t_k, "torch_ms": t_t})
        log(f"  moe m={m:4d} E={experts}: triton {t_k:.3f} ms, torch loop {t_t:.3f} ms")
    return out


def engine_free(batches, contexts, caches, table, bs, tuned, experts, dev, budget) -> list:
    """One layer's kernels back to back (see the module docstring), x 61 layers."""
    from pipeline.engine.triton.int8_gemm import int8_gemm_dynamic, int8_gemm_static
    from pipeline.engine.triton.mla_decode import paged_mla_decode
    from pipeline.engine.triton.moe_gemm import fused_moe
    lin = {}
    for name, (n, k) in GEMMS.items():
        lin[name] = (torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8),
                     torch.randint(-100, 100, (n,), device=dev, dtype=torch.int32),
                     torch.rand(n, device=dev) * 1e-4, torch.rand(n, 1, device=dev) * 1e-3)
    s, o = torch.tensor([0.02], device=dev), torch.tensor([0.0], device=dev)
    w_uk = torch.randn(H, NOPE, C, device=dev, dtype=torch.bfloat16)
    w_uv = torch.randn(H, C, NOPE, device=dev, dtype=torch.bfloat16)
    st = _random_experts(experts, HIDDEN, MOE_INTER, dev)
    c, pe, nz, fa_k = caches["int8_nz"]
    out = []
    for ctx in contexts:
        for B in batches:
            if not budget.ok(f"engine_free B={B} ctx={ctx}"):
                continue
            x = torch.randn(B, HIDDEN, device=dev, dtype=torch.bfloat16)
            xq_lora = torch.randn(B, Q_LORA, device=dev, dtype=torch.bfloat16)
            q_nope = torch.randn(H, B, NOPE, device=dev, dtype=torch.bfloat16)
            q_abs = torch.randn(B, H, C, device=dev, dtype=torch.bfloat16)
            q_pe = torch.randn(B, H, D_R, device=dev, dtype=torch.bfloat16)
            o_lat = torch.randn(H, B, C, device=dev, dtype=torch.bfloat16)
            attn_out = torch.randn(B, H * NOPE, device=dev, dtype=torch.bfloat16)
            ids = torch.rand(B, experts, device=dev).topk(8, dim=1).indices
            wts = torch.rand(B, 8, device=dev)
            bt = table[:B, :-(-ctx // bs)].contiguous()
            lengths = torch.full((B,), ctx, device=dev, dtype=torch.int32)

            def static(name, inp):
                w, qb, deq, _ = lin[name]
                return int8_gemm_static(inp, w, s, o, qb, deq)

            parts = {
                "q_a": lambda: static("q_a", x), "kv_a": lambda: static("kv_a", x),
                "q_b": lambda: static("q_b", xq_lora),
                "absorb_w_uk": lambda: torch.bmm(q_nope, w_uk),
                "attention": lambda: paged_mla_decode(q_abs, q_pe, c, pe, bt, lengths, SOFTMAX_SCALE, fa_k=fa_k,
                                                      nz=nz, block_size=bs, check=False, **tuned.get("int8_nz", {})),
                "w_uv": lambda: torch.bmm(o_lat, w_uv),
                "o_proj": lambda: static("o_proj", attn_out),
                "moe_routed": lambda: fused_moe(x, ids, wts, *st),
                "shared_gate_up": lambda: int8_gemm_dynamic(x, lin["expert_gate_up"][0], lin["expert_gate_up"][3]),
                "shared_down": lambda: int8_gemm_dynamic(x[:, :MOE_INTER], lin["expert_down"][0],
                                                         lin["expert_down"][3]),
            }
            ms = {k: bench(f) for k, f in parts.items()}
            layer = sum(ms.values())
            step = LAYERS * layer
            out.append({"batch": B, "context": ctx, "layer_ms": layer, "parts_ms": ms, "step_ms": step,
                        "tokens_per_s": B / step * 1e3})
            log(f"  engine-free B={B:3d} ctx={ctx:6d}: layer {layer:.3f} ms, step {step:.1f} ms, "
                f"{B / step * 1e3:.1f} tok/s (attention {ms['attention']:.3f} ms)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peak-gbps", type=float, default=4800.0, help="device peak memory bandwidth (H200 ~4800)")
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--block-size", type=int, default=64, help="cache block size (FlashMLA 64, vllm-ascend 128)")
    ap.add_argument("--gemm-rows", default="1,8,32,64")
    ap.add_argument("--experts", type=int, default=32, help="local experts of the MoE points (EP of 256)")
    ap.add_argument("--engine-contexts", default="4096,32768")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new points after this long")
    ap.add_argument("--out", default="benchmarks/gpu.json", help="JSON output (relative: to the repository)")
    a = ap.parse_args(argv)
    out_path = Path(a.out) if Path(a.out).is_absolute() else REPO / a.out
    t0 = time.time()
    ints = lambda s: [int(v) for v in s.split(",") if v]     # noqa: E731
    result = {"script": "scripts/bench_gpu.py", "args": vars(a)}
    import triton
    result["triton"] = triton.__version__
    result["torch"] = torch.__version__
    if not torch.cuda.is_available():
        log("no CUDA device: self-check of every kernel through Triton's interpreter (TRITON_INTERPRET=1)")
        torch.set_num_threads(1)
        result["device"] = "cpu (Triton interpreter)"
        result["self_check"] = self_check("cpu")
        for k, v in result["self_check"].items():
            err = f" (rel err {v['rel_err']:.2e})" if "rel_err" in v else ""
            log(f"  {k}: {'ok' if v['ok'] else 'FAILED'}{err}")
        result["timings"] = None
        result["note"] = "timings need a CUDA GPU: run this script on one (about 5 minutes)"
        log(result["note"])
        result["wall_s"] = time.time() - t0
        write_result(out_path, result, show=False)
        log(f"wrote {out_path}")
        return 0 if all(v["ok"] for v in result["self_check"].values()) else 1

    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    result["device"] = props.name
    result["peak_gbps"] = a.peak_gbps
    budget = Budget(a.budget_s)
    log(f"device {props.name}, {props.multi_processor_count} SMs; self-check")
    result["self_check"] = self_check(dev)
    bad = [k for k, v in result["self_check"].items() if not v["ok"]]
    log(f"  self-check: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
    contexts, batches, bs = ints(a.contexts), ints(a.batches), a.block_size
    caches, table = make_caches(max(batches + [32]), max(contexts + [8192]), bs, dev)
    tuned = {} if a.no_tune else tune(caches, table, bs, dev, budget)
    result["tuned"] = tuned
    log(f"  tuned: {tuned}")
    decode = []
    for ctx in contexts:
        for B in batches:
            for kind in ("int8_nz", "int8_nd", "bf16_nd"):
                if not budget.ok(f"decode {kind} B={B} ctx={ctx}"):
                    continue
                r = run_decode(tuned.get(kind, {}), caches, table, B, ctx, bs, dev, kind)
                r["peak_fraction"] = r["gbps"] / a.peak_gbps
                decode.append(r)
                log(f"  decode {kind} B={B:3d} ctx={ctx:6d}: {r['ms']:.3f} ms, {r['gbps']:.0f} GB/s "
                    f"({100 * r['peak_fraction']:.0f}% of peak), {r['tflops']:.0f} TFLOP/s")
    result["decode"] = decode
    by = {(r["kind"], r["batch"], r["context"]): r["ms"] for r in decode}
    result["decode_int8_speedup"] = [
        {"batch": B, "context": ctx, "int8_nz_vs_bf16": by[("bf16_nd", B, ctx)] / by[("int8_nz", B, ctx)]}
        for (kind, B, ctx) in by if kind == "int8_nz" and ("bf16_nd", B, ctx) in by]
    result["gemm"] = gemm_points(ints(a.gemm_rows), dev, budget)
    result["moe"] = moe_points(ints(a.gemm_rows), a.experts, dev, budget)
    result["engine_free"] = engine_free(batches, ints(a.engine_contexts), caches, table, bs, tuned, a.experts,
                                        dev, budget)
    result["skipped_over_budget"] = budget.skipped
    result["wall_s"] = time.time() - t0
    write_result(out_path, result, show=False)
    log(f"wrote {out_path} in {result['wall_s']:.0f} s; {len(budget.skipped)} point(s) skipped over budget")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
