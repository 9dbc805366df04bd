"""Benchmark: the weight-only quantization phase against the I/O floor, on an FP8 checkpoint with
DeepSeek-V3's real layer shapes (hidden 7168, 128 heads, MLA 1536/512/64, expert width 2048).

    python scripts/bench_quantize_weights.py [--layers 4] [--experts 8] [--repeat 5] [--dir /tmp/bench]
                                             [--out FILE]

1. generates (once, cached in --dir) an FP8 e4m3 checkpoint in the release layout: layer 0 dense, the
   rest MoE with --experts routed experts + 1 shared, plus embeddings/head cut to 16k rows;
2. I/O floor: read every tensor's stored bytes and write the same bytes into a safetensors file;
3. weight phase: the library's ``pipeline.quant.job.run.quantize_weights`` (what quantize_checkpoint runs
   after calibration): read each layer (the next one prefetched), quantize it module by module (W8A8
   static attention, W8A8_DYNAMIC MLP/experts straight from the FP8 codes, FA3 scales) with given
   statistics, stream each piece into the writer (which writes and sha256-hashes on its own threads),
   then ``finish``;
each in a fresh process, timing wall clock and the process's peak RSS. Before each run the page cache is
flushed (``os.sync()``) and the source files are evicted from it (``posix_fadvise(POSIX_FADV_DONTNEED)``
on each), so that both runs read the source from disk, as a real run does; what they write lands in the
page cache as usual. With --repeat N the two runs alternate N times and the figures are the median time
and the largest peak RSS (every run's time is kept too), plus the median of each weight run's ratio to
the floor run just before it: on a small shared VM a single run can be off by half, and the disk's speed
drifts over minutes. The JSON says which kernel ran (native or torch ops). Prints the figures and writes them as JSON
to --out (default benchmarks/quantize_weights.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import write_result  # noqa: E402

V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
          q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
          first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, num_experts_per_tok=2,
          vocab_size=16384)


def bench_config(layers: int, experts: int) -> dict:
    import copy

    sys.path.insert(0, str(REPO / "tests"))
    from tiny import TINY

    cfg = copy.deepcopy(TINY)
    cfg.update(V3, num_hidden_layers=layers, n_routed_experts=experts, n_group=min(4, experts // 2),
               topk_group=min(2, experts // 2), num_nextn_predict_layers=0)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    return cfg


def generate(path: Path, layers: int, experts: int) -> None:
    """Random FP8 checkpoint, one layer at a time (memory: one layer)."""
    import torch

    from pipeline import layout
    from pipeline.config import DeepseekV3Config
    from pipeline.io.fp8 import quantize_fp8_blocks
    from pipeline.io.release_layout.fp8_copy import shard_name
    from pipeline.io.safetensors_io import save_safetensors

    cfg_dict = bench_config(layers, experts)
    cfg = DeepseekV3Config.from_dict(cfg_dict)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    units = [None] + list(range(layers))
    weight_map = {}
    total = 0
    for n, lid in enumerate(units, start=1):
        shapes = layout.global_shapes(cfg) if lid is None else layout.layer_shapes(cfg, lid)
        tensors = {}
        for name, shape in shapes.items():
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.rand(shape, generator=g) * 0.01
            elif name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            elif layout.is_fp8_quantizable(name):
                w = torch.randn(shape, generator=g).mul_(shape[1] ** -0.5).to(torch.bfloat16)
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(w)
            else:
                tensors[name] = torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)
        fname = shard_name(n, len(units))
        total += save_safetensors(tensors, str(path / fname))
        weight_map.update({k: fname for k in tensors})
        print(f"  generated {fname}", flush=True)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=1))


def synthetic_stats(cfg, recipe):
    """Plausible statistics for every W8A8-static linear and FA3 branch (values do not affect speed)."""
    from pipeline import layout
    from pipeline.quant.numerics.observers import MinMax, RecallWindow, Stats

    st = Stats()
    for i in layout.all_layer_ids(cfg):
        for mod, kind in recipe.layer_types(cfg, i).items():
            if kind == "W8A8":
                st = st.add(mod, MinMax(-3.0, 4.0, 1))
        if recipe.fa_layer(cfg, i):
            p = f"model.layers.{i}.self_attn."
            H = cfg.num_attention_heads
            st = st.add(p + "fa_q", RecallWindow(recipe.q_ratio, (-5.0,) * H, (5.0,) * H, 1))
            st = st.add(p + "fa_k", RecallWindow(recipe.k_ratio, (-2.0,), (2.0,), 1))
            st = st.add(p + "fa_v", RecallWindow(recipe.v_ratio, (-2.5,), (2.5,), 1))
    return st


def io_floor(src: str, dst: str) -> dict:
    """Read every stored tensor (no dequantization) and write the same bytes, one unit at a time."""
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.io.safetensors_io import read_header, read_tensors, save_safetensors

    reader = CheckpointReader(src)
    nbytes = 0
    for n, f in enumerate(reader.files):
        header = read_header(f)
        tensors = read_tensors(header, list(header.tensors))
        nbytes += save_safetensors(tensors, os.path.join(dst, f"copy-{n:05d}.safetensors"))
    return {"bytes_written": nbytes}


def weight_phase(src: str, dst: str) -> dict:
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.config import model_dtype
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import quantize_weights
    from pipeline.quant.writing.writer import QuantizedWriter

    reader = CheckpointReader(src)
    cfg = reader.config
    recipe = Recipe()
    stats = synthetic_stats(cfg, recipe)
    with QuantizedWriter(dst, "seed", model_dtype=model_dtype(cfg), overwrite=True) as w:
        quantize_weights(reader, w, stats, recipe)
        w.finish(json.loads(Path(src, "config.json").read_text()), src_dir=src)
    return {"bytes_written": sum(f.stat().st_size for f in Path(dst).glob("*.safetensors"))}


def child(which: str, src: str, dst: str) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 2)
    t = time.perf_counter()
    res = (io_floor if which == "io" else weight_phase)(src, dst)
    res["seconds"] = time.perf_counter() - t
    res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    print(json.dumps(res))


def drop_from_page_cache(src: Path) -> None:
    """Flush dirty pages, then evict the source files from the page cache: the next read is from disk."""
    os.sync()
    for f in sorted(src.iterdir()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_child(which: str, src: Path, dst: Path) -> dict:
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    drop_from_page_cache(src)
    out = subprocess.run([sys.executable, __file__, "--child", which, str(src), str(dst)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    """The median time and the largest peak RSS of repeated runs, with every run's time."""
    import statistics

    return {"bytes_written": runs[0]["bytes_written"], "seconds": statistics.median(r["seconds"] for r in runs),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in runs), "runs_s": [round(r["seconds"], 3) for r in runs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5, help="alternate the two runs this many times (median)")
    ap.add_argument("--dir", default="/tmp/dsquant-bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "quantize_weights.json"))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    src = Path(args.dir) / f"v3shapes-L{args.layers}-E{args.experts}-fp8"
    if not (src / "model.safetensors.index.json").exists():
        print(f"generating {src} ...", flush=True)
        generate(src, args.layers, args.experts)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    from pipeline.io.checkpoint import CheckpointReader

    cfg = CheckpointReader(str(src)).config
    from pipeline import layout

    layer_bytes = max(sum(__import__("math").prod(s) for s in layout.layer_shapes(cfg, i).values())
                      for i in range(cfg.num_hidden_layers))
    runs: dict[str, list[dict]] = {"io": [], "weights": []}
    for _ in range(args.repeat):
        runs["io"].append(run_child("io", src, Path(args.dir) / "io-copy"))
        runs["weights"].append(run_child("weights", src, Path(args.dir) / "quantized"))
    io, wp = (summarize(runs[k]) for k in ("io", "weights"))
    import statistics

    from pipeline.quant.numerics import native

    pairs = [w["seconds"] / i["seconds"] for i, w in zip(runs["io"], runs["weights"])]
    res = {
        "checkpoint": {"layers": args.layers, "experts": args.experts, "fp8_bytes": src_bytes,
                       "largest_layer_params": layer_bytes, "largest_layer_bf16_gib": layer_bytes * 2 / 1024 ** 3,
                       "largest_layer_fp8_gib": layer_bytes / 1024 ** 3},
        "io_floor": io, "weight_phase": wp,
        "ratio_to_io_floor": wp["seconds"] / io["seconds"],
        # each weight run against the floor run just before it: the VM's disk and page-cache speed drift
        # over minutes, so adjacent pairs compare like with like
        "ratio_of_adjacent_pairs": {"median": statistics.median(pairs), "runs": [round(r, 3) for r in pairs]},
        "kernel": native.status(),
        "repeat": args.repeat, "machine": {"cpus": os.cpu_count()},
    }
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
