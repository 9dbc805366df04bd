"""Answer a prompt: ``python -m jobs.generate [--model-path DIR] "What's deep learning?"``.

With no --model-path it runs the embedded default model (float). A quantized directory (one with
quant_model_description.json, ours or msModelSlim's) runs in the inference engine: int8 linears, the
int8 latent cache (NZ), MTP speculative decoding when the model has the layer. A float checkpoint
(config.json + safetensors) runs on the float model's own generator, or with --engine in the same
inference engine (float linears, the latent cached in the model's dtype, NZ, MTP when present).
A directory that is neither is refused, naming it. Greedy by default; --temperature/--top-p/--top-k/--seed
sample.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from jobs._sharding_flags import add_sharding_flags, parallel_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.generate", description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="What's deep learning?",
                    help="the prompt (default: %(default)r)")
    ap.add_argument("--model-path", "--model_path", dest="model_path", default=None,
                    help="checkpoint directory or fsspec URL (default: the embedded model)")
    ap.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=64,
                    help="most tokens generated (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature; 0 is greedy (default: %(default)s)")
    ap.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0,
                    help="nucleus sampling: keep the smallest set of tokens of this total probability "
                         "(default: %(default)s, all)")
    ap.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0,
                    help="sample among the k most likely tokens (default: %(default)s, no limit)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible samples (default: random)")
    ap.add_argument("--raw", action="store_true",
                    help="no chat template: continue the text as is (default: off, the chat template)")
    ap.add_argument("--dtype", default="auto",
                    help="float32, bfloat16, float16 or auto, for a float model (default: %(default)s)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--engine", action="store_true",
                    help="run a float checkpoint in the inference engine, as jobs.serve does (default: off, the "
                         "float model's own generator; a quantized directory always runs in the engine)")
    add_parallel_args(ap)
    return ap


def add_parallel_args(ap: argparse.ArgumentParser) -> None:
    g = add_sharding_flags(ap)
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to run the ranks on (default: RAY_ADDRESS, else a private local Ray)")


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dataclasses import replace

    from pipeline.io import storage
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.engine.worker.loader import QUANTIZED, dir_kind
    from pipeline.engine.core.reference import generate_text
    from pipeline.model.loading import load_model
    from pipeline.engine.protocol import SamplingParams
    from pipeline.text.tokenizer import Tokenizer

    from pipeline.engine.device import check_device

    path = args.model_path or EMBEDDED_MODEL_DIR
    stack = contextlib.ExitStack()
    try:
        check_device(args.device)
        check_prompt(args.prompt)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        t0 = time.time()
        storage.check_reachable(path)        # a mute object store: seconds, not minutes
        if not storage.isdir(path):
            raise FileNotFoundError(f"{path}: not a checkpoint directory")
        kind = dir_kind(path)
        tok = Tokenizer.from_dir(path)
        if (kind == QUANTIZED or args.engine) and _parallel(args) is None:
            from pipeline.engine.worker.memory import check_fits

            check_fits(path)
        if kind == QUANTIZED or args.engine:
            from pipeline.engine.core.engine import LLMEngine

            parallel = _parallel(args)
            if parallel is None:
                eng = LLMEngine.from_dir(path, tokenizer=tok, dtype=args.dtype, nz=True, device=args.device or "cpu")
                eng = LLMEngine(eng.loaded, replace(eng.config, mtp=bool(eng.loaded.model.mtp_layers)), tok)
            elif kind != QUANTIZED:
                raise ValueError(f"{path}: a float checkpoint runs in one process; drop --tp/--dp/--moe-ep/--moe-tp")
            else:
                eng = _sharded_engine(path, parallel, args, tok, stack)
            t1 = time.time()
            ids = tok.encode(args.prompt) if args.raw else tok.encode_chat([{"role": "user", "content": args.prompt}])
            text = tok.decode(eng.generate([ids], params)[0])     # (no stop strings here)
            where = "" if parallel is None else f", {parallel.describe()}"
            latent = next(iter(eng.runner.caches.values())).latent_dtype
            what = "int8 linears, int8" if kind == QUANTIZED else \
                f"float linears ({str(eng.loaded.model.lm_head.weight.dtype)[6:]}), {str(latent)[6:]}"
            path = f"{path} (engine: {what}-NZ latent cache{where}" + (
                f", MTP acceptance {eng.stats().acceptance_rate:.2f})" if eng.config.mtp else ")")
        else:
            model = load_model(path, dtype=args.dtype, device=args.device, with_mtp=False)
            t1 = time.time()
            text = generate_text(model, tok, args.prompt, params, chat=not args.raw)
    except (ValueError, OSError) as e:
        print(f"error: {storage.describe_os_error(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    finally:
        stack.close()
    print(f"> {args.prompt}\n{text.strip()}")
    print(f"[{path}: loaded in {t1 - t0:.1f}s, generated in {time.time() - t1:.1f}s]", file=sys.stderr)
    return 0


def check_prompt(prompt: str) -> None:
    """ValueError for a prompt argument that is not valid UTF-8 (Python keeps such bytes of the command
    line as lone surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"the prompt is not valid UTF-8: byte 0x{bad.hex()} at character {e.start}") from None


def _parallel(args):
    p = parallel_config(args)
    return None if p.single else p


def _sharded_engine(path, parallel, args, tok, stack: contextlib.ExitStack):
    """The engine over ``parallel.world`` ranks: this process is rank 0, the others Ray actors (a private
    Ray unless --ray-address / RAY_ADDRESS names a cluster). ``stack`` closes the engine's ranks, then
    stops the private Ray."""
    from dataclasses import replace

    import ray

    from actors.rank_group import build_sharded_engine
    from actors.ray_start import init_ray
    from pipeline.engine.config import EngineConfig
    from pipeline.format.reader import QuantizedSource

    src = QuantizedSource(path)
    cfg = src.config
    parallel.check_config(cfg)
    started = init_ray(args.ray_address, num_cpus=max(parallel.world, 2), object_store_memory=256 * 2**20,
                       flag="--ray-address", log=lambda m: print(m, file=sys.stderr))
    if started:
        stack.callback(ray.shutdown)   # the ranks share this machine's cores: one thread each when they are few
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.world))
    config = replace(EngineConfig(nz=True, device=args.device or "cpu"), mtp=bool(cfg.mtp_layer_ids))
    eng = build_sharded_engine(path, parallel, config, tok, combine=args.moe_combine,
                               log=lambda m: print(m, file=sys.stderr))
    stack.callback(eng.runner.close)   # runs before ray.shutdown (an ExitStack unwinds last-in first)
    return eng


if __name__ == "__main__":
    sys.exit(main())
