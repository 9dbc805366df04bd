"""Write a random-weight DeepSeek-V3 checkpoint at the real width (7168 wide, 128 heads, experts of 2048)
with fewer layers and experts: the model a benchmark or a test needs when the 671B release is not at hand.

    python -m jobs.make_checkpoint --save-path DIR [--layers 3] [--experts 16] [--top-k 8] [--dense 1]
                                   [--mtp 1] [--vocab 4096] [--fp8] [--seed 0]

Its function is noise; a layer costs what the release's costs (a decode step with --top-k 8 reads per layer
what the real model's reads). bf16, or with --fp8 the release's e4m3 128x128 blocks with weight_scale_inv;
the embedded model's tokenizer. Exit status: 0 written, 2 bad input (one line naming the flag or path).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from pipeline.io.release_layout.synthetic import Shape, config, layer_bytes, make_checkpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.make_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--save-path", "--save_path", dest="save_path", required=True,
                   help="new directory for the checkpoint (required; no default)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers, MTP not counted (default: %(default)s)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (default: %(default)s)")
    p.add_argument("--top-k", dest="top_k", type=int, default=8, help="routed experts per token (default: %(default)s)")
    p.add_argument("--dense", type=int, default=1, help="leading layers with a dense MLP (default: %(default)s)")
    p.add_argument("--mtp", type=int, default=1, choices=(0, 1), help="MTP layers (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=4096,
                   help="embedding and head rows (default: %(default)s, the embedded tokenizer's: a larger one emits "
                        "ids that detokenize to nothing, and clients that count tokens by re-tokenizing, as vLLM's "
                        "does for llama-server, undercount them)")
    p.add_argument("--fp8", action="store_true",
                   help="the release's FP8 block layout instead of bf16 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint this job wrote, kept until the new one is whole "
                        "(default: %(default)s)")
    return p


OWN = {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"}


def _is_own(entries: list[str]) -> bool:
    """Whether a directory's entries are a checkpoint this job wrote: its config, index, tokenizer and shards."""
    return OWN <= set(entries) and all(e in OWN or (e.startswith("model-") and e.endswith(".safetensors"))
                                       for e in entries)


def _refuse_existing(dst: Path, overwrite: bool) -> Optional[str]:
    """None when ``dst`` may be (re)written, else why not (pipeline/io/destination/rule.py): only a checkpoint this
    job wrote is replaced, only with --overwrite, and it stays whole until the new one is in place."""
    from pipeline.io.destination.rule import check_destination

    try:
        check_destination(str(dst), kind="a checkpoint this job wrote", is_own=_is_own, overwrite=overwrite)
    except (OSError, ValueError) as e:
        return f"--save-path {e}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    shape = Shape(layers=args.layers, experts=args.experts, top_k=args.top_k, dense=args.dense, mtp=args.mtp,
                  vocab=args.vocab)
    dst = Path(args.save_path)
    try:
        cfg = config(shape, args.fp8)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why = _refuse_existing(dst, args.overwrite)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    sizes = layer_bytes(cfg, args.fp8)
    need = sum(sizes.values())
    free = shutil.disk_usage(dst.parent if dst.parent.exists() else Path.cwd()).free
    if need > free:
        print(f"error: --save-path {dst}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free", file=sys.stderr)
        return 2
    print(f"{dst}: {args.layers} layers ({args.dense} dense) + {args.mtp} MTP, {args.experts} experts "
          f"(top-{args.top_k} of {cfg['n_group']} groups, {cfg['topk_group']} kept), "
          f"{'fp8' if args.fp8 else 'bf16'}, {need / 1e9:.2f} GB", flush=True)
    t0 = time.perf_counter()
    from pipeline.io.destination.lock import DestinationBusy, DestinationLock

    try:
        with DestinationLock(str(dst)):    # one writer; an earlier checkpoint is replaced only once the new one is whole
            total = make_checkpoint(dst, shape, fp8=args.fp8, seed=args.seed,
                                    progress=lambda s: print(f"  {s}", flush=True))
    except (DestinationBusy, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{dst}: {total} bytes in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
