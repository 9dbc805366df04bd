"""Serve a quantized model with an OpenAI-compatible API on Ray Serve: ``python -m jobs.serve``.

With no arguments it serves ``out/dsv3-tiny-pydoc-w8a8-fa3`` (quantizing the embedded model there first
when that directory is missing or incomplete) on http://127.0.0.1:8000/v1 until Ctrl-C. Ray: the cluster
at ``--address`` / RAY_ADDRESS when given, else a local one started here (object store capped) and stopped
on exit. ``--config FILE`` (JSON or YAML, see ``actors.serve_app.ServeConfig``) gives every option; flags
given on the command line override it.

    python -m jobs.serve --port 8000 --api-key sk-local --max-in-flight 32 --num-blocks 512 --mtp
    python -m jobs.chat "What's deep learning?"
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL = os.path.join("out", "dsv3-tiny-pydoc-w8a8-fa3")
MiB = 1024 ** 2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="JSON or YAML file of ServeConfig options")
    ap.add_argument("--model-path", "--model_path", dest="model_path", default=None,
                    help=f"quantized directory (default: {DEFAULT_MODEL}, made from the embedded model if missing)")
    ap.add_argument("--served-model-name", dest="served_model_name", default=None,
                    help="model id clients send (default: the directory's name)")
    ap.add_argument("--host", default=None, help="HTTP host (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    ap.add_argument("--api-key", dest="api_key", default=os.environ.get("DSQUANT_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 (default: $DSQUANT_API_KEY, else open)")
    ap.add_argument("--max-in-flight", dest="max_in_flight", type=int, default=None,
                    help="generation requests in flight per ingress replica before 429 (default 64)")
    ap.add_argument("--llm-replicas", dest="llm_replicas", type=int, default=None, help="engine replicas")
    ap.add_argument("--llm-num-cpus", dest="llm_num_cpus", type=float, default=None, help="CPUs per engine replica")
    ap.add_argument("--llm-num-gpus", dest="llm_num_gpus", type=float, default=None, help="GPUs per engine replica")
    ap.add_argument("--ingress-replicas", dest="ingress_replicas", type=int, default=None)
    ap.add_argument("--torch-threads", dest="torch_threads", type=int, default=None)
    ap.add_argument("--num-blocks", dest="num_blocks", type=int, default=None, help="KV cache blocks per replica")
    ap.add_argument("--block-size", dest="block_size", type=int, default=None)
    ap.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=None)
    ap.add_argument("--max-batched-tokens", dest="max_batched_tokens", type=int, default=None)
    ap.add_argument("--max-model-len", dest="max_model_len", type=int, default=None)
    ap.add_argument("--nz", dest="nz", action=argparse.BooleanOptionalAction, default=None, help="NZ cache layout")
    ap.add_argument("--mtp", dest="mtp", action=argparse.BooleanOptionalAction, default=None,
                    help="MTP speculative decoding")
    ap.add_argument("--device", default=None, help="cpu or cuda")
    ap.add_argument("--mindie-config", dest="mindie_config", default=None,
                    help="a MindIE config.json (or its ModelConfig block) to serve as it says; sizes the hardware "
                         "cannot honour are refused")
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default=None,
                    help="prefill and decode in one deployment (default) or apart")
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    ap.add_argument("--object-store-mb", dest="object_store_mb", type=int, default=256,
                    help="object store of a local Ray started here, MiB")
    return ap.parse_args(argv)


def make_config(args: argparse.Namespace):
    """The ServeConfig: the file's (if any), then the flags given on top."""
    from actors.serve_app import DeploymentOptions, ServeConfig

    if args.mindie_config:
        import json

        import torch

        block = json.loads(Path(args.mindie_config).read_text())
        cfg = ServeConfig.from_mindie(block, torch.cuda.device_count())
    else:
        cfg = ServeConfig.from_file(args.config) if args.config else ServeConfig(model_path=DEFAULT_MODEL)
    top = {k: getattr(args, k) for k in ("model_path", "served_model_name", "host", "port", "api_key",
                                         "max_in_flight", "torch_threads", "mode") if getattr(args, k) is not None}
    engine = {k: getattr(args, k) for k in ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens",
                                            "max_model_len", "nz", "mtp", "device") if getattr(args, k) is not None}
    llm_opts = dict(cfg.llm.ray_actor_options)
    if args.llm_num_cpus is not None:
        llm_opts["num_cpus"] = args.llm_num_cpus
    if args.llm_num_gpus is not None:
        llm_opts["num_gpus"] = args.llm_num_gpus
    llm = DeploymentOptions(args.llm_replicas or cfg.llm.num_replicas, llm_opts)
    ingress = DeploymentOptions(args.ingress_replicas or cfg.ingress.num_replicas, cfg.ingress.ray_actor_options)
    cfg = dataclasses.replace(cfg, **top, engine=dataclasses.replace(cfg.engine, **engine), llm=llm, ingress=ingress)
    if "://" not in cfg.model_path:  # replicas may start elsewhere: an absolute path
        cfg = dataclasses.replace(cfg, model_path=str(Path(cfg.model_path).resolve()))
    return cfg


def ensure_default_model(path: str) -> None:
    """Quantize the embedded model into ``path`` when it has no complete output (no description file)."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.format.description import DESCRIPTION_NAME
    from pipeline.quant.recipe import Recipe
    from pipeline.quant.run import QuantizeOptions, quantize_checkpoint

    if (Path(path) / DESCRIPTION_NAME).exists():
        return
    print(f"{path} is missing: quantizing the embedded model into it first", file=sys.stderr)
    quantize_checkpoint(str(EMBEDDED_MODEL_DIR), path, Recipe(), QuantizeOptions(overwrite=True))


def connect_ray(address, object_store_mb: int) -> bool:
    """Join the given cluster or start a local one; True when started here."""
    import ray

    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, logging_level="ERROR")
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster: no token between processes
    ray.init(num_cpus=max(2, os.cpu_count() or 1), object_store_memory=object_store_mb * MiB,
             include_dashboard=False, logging_level="ERROR")
    return True


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = make_config(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.model_path == str(Path(DEFAULT_MODEL).resolve()):
        ensure_default_model(cfg.model_path)
    elif "://" not in cfg.model_path and not Path(cfg.model_path).is_dir():
        print(f"error: --model-path {cfg.model_path} is not a directory", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from actors.serve_app import build_app

    started = connect_ray(args.address, args.object_store_mb)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or a service manager's stop: shut down cleanly
        signal.signal(sig, _interrupt)
    try:
        t0 = time.time()
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix)
        base = f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1"
        print(f"serving {cfg.model_name!r} from {cfg.model_path} at {base} (ready in {time.time() - t0:.0f}s; "
              f"{'API key required' if cfg.api_key else 'no API key'}); Ctrl-C stops", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(cfg.app_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
