"""The flags of ``python -m jobs.serve`` and the ServeConfig they make: a ``--config`` file's options (or a
MindIE config's ModelConfig block), then each flag given on the command line on top."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from actors.serving.api_keys import check_key, env_key
from jobs._serve_env import HTTP_PROXIES
from pipeline.io import storage
from jobs._sharding_flags import add_sharding_flags, parallel_config

DEFAULT_MODEL = os.path.join("out", "dsv3-tiny-pydoc-w8a8-fa3")
KEY_FILE_BYTES = 64 * 1024       # a key file holds one line; a FIFO or /dev/zero is refused, not read
DESCRIPTION = ("Serve a quantized model or a float checkpoint with an OpenAI-compatible API on Ray Serve: "
               "``python -m jobs.serve``.")


def build_parser() -> argparse.ArgumentParser:
    """The flags; each one overrides the --config file's value (the defaults stated are ServeConfig's)."""
    from actors.serving.serve_config import DEFAULT_ENGINE as E, ServeConfig

    dd = ServeConfig(model_path="-")   # its defaults, stated in the help
    ap = argparse.ArgumentParser(prog="python -m jobs.serve", description=DESCRIPTION)
    ap.add_argument("--config", default=None, help="JSON or YAML file of ServeConfig options (default: none)")
    ap.add_argument("--model-path", "--model_path", dest="model_path", default=None,
                    help=f"quantized directory or float checkpoint (default: {DEFAULT_MODEL}, made from the "
                         "embedded model if missing)")
    ap.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                    help="compute dtype of a float checkpoint (of a quantized directory's float parts) "
                         "(default: auto: float32 on CPU, measured faster there; the checkpoint's on CUDA)")
    ap.add_argument("--served-model-name", dest="served_model_name", default=None,
                    help="model id clients send (default: the directory's name)")
    ap.add_argument("--host", default=None, help=f"HTTP host (default: {dd.host})")
    ap.add_argument("--port", type=int, default=None, help=f"HTTP port (default: {dd.port})")
    ap.add_argument("--api-key", dest="api_key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1; a command line is visible to every user "
                         "(ps): prefer --api-key-file or DSQUANT_API_KEY (default: --api-key-file's, else "
                         "$DSQUANT_API_KEY, else the --config file's, else open)")
    ap.add_argument("--api-key-file", dest="api_key_file", default=None,
                    help="read the API key from this file's first line (default: none)")
    ap.add_argument("--max-in-flight", dest="max_in_flight", type=int, default=None,
                    help=f"generation requests in flight per ingress replica before 429 (default: {dd.max_in_flight})")
    ap.add_argument("--llm-replicas", dest="llm_replicas", type=int, default=None,
                    help=f"engine (decode) replicas (default: {dd.llm.num_replicas})")
    ap.add_argument("--llm-num-cpus", dest="llm_num_cpus", type=float, default=None,
                    help=f"CPUs per engine replica (default: {dd.llm.ray_actor_options.get('num_cpus', 0)})")
    ap.add_argument("--llm-num-gpus", dest="llm_num_gpus", type=float, default=None,
                    help=f"GPUs per engine replica (default: {dd.llm.ray_actor_options.get('num_gpus', 0)})")
    ap.add_argument("--ingress-replicas", dest="ingress_replicas", type=int, default=None,
                    help=f"OpenAI ingress (HTTP) replicas (default: {dd.ingress.num_replicas})")
    ap.add_argument("--torch-threads", dest="torch_threads", type=int, default=None,
                    help=f"torch threads per engine replica (default: {dd.torch_threads})")
    ap.add_argument("--engine-cpus", dest="engine_cpus", default=None,
                    help=f"CPUs the engine core process is pinned to: auto (CPUs of its own, the highest free "
                         f"ones, one per torch thread), none, or a list such as 3 or 2-3 (default: {dd.engine_cpus})")
    ap.add_argument("--num-blocks", dest="num_blocks", type=int, default=None,
                    help=f"KV cache blocks per engine replica (default: {E.num_blocks})")
    ap.add_argument("--block-size", dest="block_size", type=int, default=None,
                    help=f"tokens per KV cache block (default: {E.block_size})")
    ap.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=None,
                    help=f"sequences an engine step batches at most (default: {E.max_num_seqs})")
    ap.add_argument("--max-batched-tokens", dest="max_batched_tokens", type=int, default=None,
                    help=f"prompt tokens an engine step prefills at most (default: {E.max_batched_tokens})")
    ap.add_argument("--max-model-len", dest="max_model_len", type=int, default=None,
                    help="longest prompt + completion in tokens (default: what the cache holds, capped by the "
                         "model's positions)")
    ap.add_argument("--nz", dest="nz", action=argparse.BooleanOptionalAction, default=None,
                    help=f"NZ (fractal) latent cache layout, as on Ascend (default: {'on' if E.nz else 'off'})")
    ap.add_argument("--mtp", dest="mtp", action=argparse.BooleanOptionalAction, default=None,
                    help=f"MTP speculative decoding, one draft token; needs the model's MTP layer "
                         f"(default: {'on' if E.mtp else 'off'})")
    ap.add_argument("--prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction, default=None,
                    help=f"reuse cached full blocks of shared prompt prefixes across requests "
                         f"(default: {'on' if E.prefix_caching else 'off'})")
    ap.add_argument("--compile", dest="compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the layers' work around attention (start-up takes a minute or two "
                         f"longer; default: {'on' if E.compile else 'off'})")
    ap.add_argument("--decode-graph", dest="decode_graph", action=argparse.BooleanOptionalAction, default=None,
                    help="replay pure decode steps' C kernel calls on persistent tensors (the same bits as eager; "
                         f"default: {'on' if E.decode_graph else 'off'})")
    ap.add_argument("--engine-process", dest="engine_process", action=argparse.BooleanOptionalAction, default=None,
                    help=f"step the engine in a child process of the replica, not on its thread "
                         f"(default: {'on' if dd.engine_process else 'off'})")
    ap.add_argument("--engine-in-ingress", dest="engine_in_ingress", action=argparse.BooleanOptionalAction,
                    default=None, help="each ingress replica owns its engine (no Ray hop per token between the "
                                       "engine and the HTTP stream); off: an LLMServer deployment behind the ingress "
                                       "(default: on when the engine is one process per replica and there are as "
                                       "many ingress replicas as llm replicas)")
    ap.add_argument("--device", default=None, help=f"cpu or cuda (default: {E.device})")
    ap.add_argument("--mindie-config", dest="mindie_config", default=None,
                    help="a MindIE config.json (or its ModelConfig block) to serve as it says; sizes the hardware "
                         "cannot honour are refused (default: none)")
    ap.add_argument("--reasoning-parser", dest="reasoning_parser", choices=("deepseek_r1", "none"), default=None,
                    help="split R1's reasoning into reasoning_content (deepseek_r1) or not (none); default: on for "
                         "a chat template that opens <think> (R1-family checkpoints)")
    ap.add_argument("--constrain-reasoning", dest="constrain_reasoning", action="store_true", default=None,
                    help="with a reasoning parser, structured outputs and forced tool calls constrain the reasoning "
                         "too (vLLM's enable_in_reasoning); default: they start after </think>")
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default=None,
                    help=f"prefill and decode in one deployment or apart (default: {dd.mode})")
    add_sharding_flags(ap, default_combine=None)
    ap.add_argument("--http-proxy", dest="http_proxy", choices=HTTP_PROXIES, default="auto",
                    help="what listens on the port of a private Ray: Serve's HTTP proxy, or Ray's HAProxy ingress "
                         "(forwards to the ingress replica's own HTTP server: faster under load; see "
                         "jobs/_serve_env.py for its caveat); auto: haproxy where Ray has it and no API key is "
                         "set (Serve's proxy guards /-/routes with the key), else serve; a joined cluster: its "
                         "own (default: %(default)s)")
    ap.add_argument("--serve-throughput", dest="serve_throughput", action=argparse.BooleanOptionalAction,
                    default=True, help="a private Ray's Serve runs with gRPC between its proxy and replicas and "
                                       "user code on each replica's main loop (Ray's throughput settings) "
                                       "(default: on)")
    ap.add_argument("--address", default=None,
                    help="Ray cluster to join (default: RAY_ADDRESS if set, else a private local Ray started here)")
    ap.add_argument("--object-store-mb", dest="object_store_mb", type=int, default=256,
                    help="object store of the private local Ray, MiB (default: 256)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def api_key(args: argparse.Namespace):
    """The key of --api-key, else of --api-key-file (its first line), else of DSQUANT_API_KEY; None when
    none is given (the --config file's then stands). ValueError naming the flag for an unusable one."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        return check_key(args.api_key, "--api-key")
    if args.api_key_file is not None:
        where = f"--api-key-file {args.api_key_file}"
        try:
            lines = storage.read_small(args.api_key_file, KEY_FILE_BYTES, "key file").decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"{where}: cannot read it ({why})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"{where}: its first line is empty")
        return check_key(key, f"{where}: its first line")
    return env_key()


def make_config(args: argparse.Namespace):
    """The ServeConfig: the file's (if any), then the flags given on top."""
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig

    if args.mindie_config:
        import torch

        from pipeline.io.json_input import parse_json

        block = parse_json(Path(args.mindie_config).read_bytes(), f"--mindie-config {args.mindie_config}")
        gpus = torch.cuda.device_count()   # none: CPU serving, one process per rank on this machine's cores
        cfg = ServeConfig.from_mindie(block, gpus or (os.cpu_count() or 1), cpu=not gpus,
                                      warn=lambda m: print(f"warning: --mindie-config: {m}", file=sys.stderr))
    else:
        cfg = ServeConfig.from_file(args.config) if args.config else ServeConfig(model_path=DEFAULT_MODEL)
    key = api_key(args)
    if key is not None:
        args.api_key = key
    top = {k: getattr(args, k) for k in ("model_path", "served_model_name", "host", "port", "api_key",
                                         "max_in_flight", "torch_threads", "mode", "dtype", "engine_process",
                                         "engine_in_ingress", "engine_cpus", "reasoning_parser",
                                         "constrain_reasoning")
           if getattr(args, k) is not None}
    engine = {k: getattr(args, k) for k in ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens",
                                            "max_model_len", "nz", "mtp", "prefix_caching", "compile", "decode_graph",
                                            "device")
              if getattr(args, k) is not None}
    llm_opts = dict(cfg.llm.ray_actor_options)
    if args.llm_num_cpus is not None:
        llm_opts["num_cpus"] = args.llm_num_cpus
    if args.llm_num_gpus is not None:
        llm_opts["num_gpus"] = args.llm_num_gpus
    llm = DeploymentOptions(args.llm_replicas or cfg.llm.num_replicas, llm_opts)
    ingress = DeploymentOptions(args.ingress_replicas or cfg.ingress.num_replicas, cfg.ingress.ray_actor_options)
    if (args.tp, args.dp, args.moe_ep, args.moe_tp) != (1, 1, 1, 0):   # the flags given: they win
        top["parallel"] = parallel_config(args).to_dict()
    if args.moe_combine is not None:
        top["moe_combine"] = args.moe_combine
    cfg = dataclasses.replace(cfg, **top, engine=dataclasses.replace(cfg.engine, **engine), llm=llm, ingress=ingress)
    if "://" not in cfg.model_path:  # replicas may start elsewhere: an absolute path
        cfg = dataclasses.replace(cfg, model_path=str(Path(cfg.model_path).resolve()))
    return cfg
