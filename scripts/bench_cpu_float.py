"""Per-call time of the engine's float work on the CPU: the torch modules against the C kernels
(pipeline.engine.native.cpu_float).

    python scripts/bench_cpu_float.py [--model-dir DIR] [--threads 1] [--reps 300] [--out FILE]

lm_head: the embedded model's (float32 [4096, 256], bf16 values) as ``nn.Linear`` against
``NativeHeadLinear`` (its bf16 bits) at m = 1, 2, 4, 8, 16 rows, and a wide one (8192 x 7168, random bf16
values: 235 MB float32, 117 MB bf16, beyond the caches) at m = 1, 4. RMSNorm: the embedded model's norms
(q_a 128, hidden 256, kv_a 512) and a 7168-wide one, at 1, 16, 128 rows, float32. Router: layer 1's (16
experts, hidden 256, real weights) and a DeepSeek-V3-shaped one (256 experts, 7168, 8 groups, 4 kept,
top 8; random) at 1, 16, 128 rows. Linears ("linears"): the float model's shapes (lm_head, kv_a, q_b, the
dense MLP's gate+up and down) at 1 to 2048 rows, F.linear against the C kernel built without AMX (the FMA
chains) and, on an AMX CPU, as it runs (the tiles, csrc/bf16_gemm.h). Medians of ``--reps`` calls after a warm-up, in
microseconds, with torch.no_grad; /proc/loadavg before and after (the 2 cores are shared: read the figures with it).
Writes JSON to --out (default benchmarks/cpu_float.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import loadavg, median_us, write_result  # noqa: E402


def pair(ref, new, x, reps: int, **what) -> dict:
    t, n = median_us(lambda: ref(x), reps, 2), median_us(lambda: new(x), reps, 2)
    row = {**what, "torch_us": t, "native_us": n, "speedup": round(t / n, 2)}
    print(row, flush=True)
    return row


def linears(reps: int, g) -> list[dict]:
    import torch
    from torch import nn

    from pipeline.cbuild import EXACT_FLAGS, NativeLibrary
    from pipeline.engine.native import cpu_float
    from pipeline.engine.native.cpu_float import NativeLinear

    tiles = cpu_float._LIB
    fma = NativeLibrary(cpu_float.CSRC / "float_ops_cpu.c", cpu_float._declare,
                        EXACT_FLAGS + ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"), what="FMA-only float ops")
    amx = bool(tiles.library().bf16_linear_has_amx())
    rows = []
    for n, k in ((4096, 256), (576, 256), (384, 128), (1536, 256), (256, 768)):
        lin = nn.Linear(k, n, bias=False)
        lin.weight.data = (torch.randn(n, k, generator=g) * 0.05).bfloat16().float()
        nat = NativeLinear(lin)
        for m in (1, 4, 16, 128, 2048):
            x, r = torch.randn(m, k, generator=g), max(5, reps * 4 // (4 + m))
            row = {"shape": [n, k], "m": m, "torch_us": median_us(lambda: lin(x), r, 2)}
            try:
                cpu_float._LIB = fma
                row["fma_us"] = median_us(lambda: nat(x), r, 2)
            finally:
                cpu_float._LIB = tiles
            row["amx_us"] = median_us(lambda: nat(x), r, 2) if amx else None
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(REPO / "out" / "dsv3-tiny-pydoc-w8a8-fa3"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "cpu_float.json"))
    args = ap.parse_args()
    os.environ["DSQUANT_KERNELS"] = "torch"          # load the torch modules; the C ones are built from them
    import torch
    from torch import nn

    from pipeline.engine.native import cpu_float
    from pipeline.engine.native.cpu_float import NativeHeadLinear, NativeRMSNorm, NativeRouter
    from pipeline.engine.worker.loader import load_quantized
    from pipeline.model.norm import RMSNorm

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if cpu_float.library() is None:
        raise SystemExit(f"no C kernels: {cpu_float.status()}")
    model = load_quantized(args.model_dir).model
    g = torch.Generator().manual_seed(0)
    res = {"model_dir": Path(args.model_dir).name, "threads": args.threads, "reps": args.reps,
           "library": cpu_float.status(), "loadavg_before": loadavg()}

    heads = [(model.lm_head, (1, 2, 4, 8, 16), "embedded [4096, 256]")]
    wide = nn.Linear(7168, 8192, bias=False)
    wide.weight.data = (torch.randn(8192, 7168, generator=g) * 0.02).bfloat16().float()
    heads.append((wide, (1, 4), "wide [8192, 7168]"))
    res["lm_head"] = [pair(lin, NativeHeadLinear(lin), torch.randn(m, lin.in_features, generator=g),
                           args.reps if lin is model.lm_head else max(5, args.reps // 30), head=name, m=m)
                      for lin, ms, name in heads for m in ms]

    norms = {128: model.model.layers[0].self_attn.q_a_layernorm, 256: model.model.layers[0].input_layernorm,
             512: model.model.layers[0].self_attn.kv_a_layernorm}
    big = RMSNorm(7168, 1e-6)
    big.weight.data = torch.randn(7168, generator=g)
    norms[7168] = big
    res["rms_norm"] = [pair(n, NativeRMSNorm(n), torch.randn(rows, dim, generator=g), args.reps, dim=dim, rows=rows)
                       for dim, n in norms.items() for rows in (1, 16, 128)]

    from pipeline.model.ffn import Router

    class V3:
        n_routed_experts, hidden_size, n_group, topk_group = 256, 7168, 8, 4
        num_experts_per_tok, norm_topk_prob, routed_scaling_factor = 8, True, 2.5

    v3 = Router(V3())
    v3.weight.data = torch.randn(256, 7168, generator=g) * 0.02
    v3.e_score_correction_bias.copy_(torch.randn(256, generator=g) * 0.01)
    routers = [(model.model.layers[1].mlp.gate, "embedded layer 1 (16 experts, 256)"),
               (v3, "DeepSeek-V3 shape (256 experts, 7168)")]
    res["router"] = [pair(r, NativeRouter(r), torch.randn(n, r.weight.shape[1], generator=g), args.reps,
                          router=name, rows=n) for r, name in routers for n in (1, 16, 128)]
    res["linears"] = linears(args.reps, g)
    res["loadavg_after"] = loadavg()
    write_result(args.out, res, show=False)
    print("wrote", args.out, "loadavg", res["loadavg_before"], "->", res["loadavg_after"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
