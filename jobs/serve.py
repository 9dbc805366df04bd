"""Serve a quantized model or a float checkpoint with an OpenAI-compatible API on Ray Serve: ``python -m jobs.serve``.

With no arguments it serves ``out/dsv3-tiny-pydoc-w8a8-fa3`` (quantizing the embedded model there first
when that directory is missing or incomplete) on http://127.0.0.1:8000/v1 until Ctrl-C. ``--model-path``
may also name a float HF-layout checkpoint (config.json + safetensors, bf16 or the FP8 release), e.g. the
embedded ``pipeline/assets/dsv3-tiny-pydoc``: the same engine runs it with float linears and the latent
cached in the model's dtype, for comparing float and quantized side by side. Ray: the cluster
at ``--address`` / RAY_ADDRESS when given, else a private local one started here (object store capped) and
stopped on exit; SIGINT and SIGTERM stop it within seconds. ``--config FILE`` (JSON or YAML, see
``actors.serve_app.ServeConfig``) gives every option; flags given on the command line override it.

    python -m jobs.serve --port 8000 --api-key sk-local --max-in-flight 32 --num-blocks 512 --mtp
    python -m jobs.serve --model-path pipeline/assets/dsv3-tiny-pydoc --port 8001     # the float model
    python -m jobs.chat "What's deep learning?"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from jobs._serve_env import HTTP_PROXIES, apply as apply_serve_env, haproxy_binary, resolve_http_proxy, serve_environment
from jobs._sharding_flags import add_sharding_flags, parallel_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL = os.path.join("out", "dsv3-tiny-pydoc-w8a8-fa3")
MiB = 1024 ** 2


def build_parser() -> argparse.ArgumentParser:
    """The flags; each one overrides the --config file's value (the defaults stated are ServeConfig's)."""
    from actors.serve_config import DEFAULT_ENGINE as E, ServeConfig

    dd = ServeConfig(model_path="-")   # its defaults, stated in the help
    ap = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__.split("\n")[0])
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
    ap.add_argument("--api-key", dest="api_key", default=os.environ.get("DSQUANT_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 (default: $DSQUANT_API_KEY, else open)")
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


def make_config(args: argparse.Namespace):
    """The ServeConfig: the file's (if any), then the flags given on top."""
    from actors.serve_app import DeploymentOptions, ServeConfig

    if args.mindie_config:
        import json

        import torch

        block = json.loads(Path(args.mindie_config).read_text())
        gpus = torch.cuda.device_count()   # none: CPU serving, one process per rank on this machine's cores
        cfg = ServeConfig.from_mindie(block, gpus or (os.cpu_count() or 1), cpu=not gpus)
    else:
        cfg = ServeConfig.from_file(args.config) if args.config else ServeConfig(model_path=DEFAULT_MODEL)
    top = {k: getattr(args, k) for k in ("model_path", "served_model_name", "host", "port", "api_key",
                                         "max_in_flight", "torch_threads", "mode", "dtype", "engine_process",
                                         "engine_in_ingress", "engine_cpus")
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
    """Join the cluster at ``address`` / RAY_ADDRESS, else start a private local Ray; True when private."""
    from actors.ray_start import init_ray

    return init_ray(address, num_cpus=max(2, os.cpu_count() or 1), object_store_memory=object_store_mb * MiB,
                    log=lambda m: print(m, file=sys.stderr, flush=True), logging_level="ERROR")


EXISTING_SERVE = "Connecting to existing Serve app"


@contextlib.contextmanager
def dropped_log_line(logger: str, text: str):
    """Within the block, ``logger`` drops records whose message contains ``text``."""
    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return text not in record.getMessage()

    f, log = Drop(), logging.getLogger(logger)
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


class RayOwner(threading.Thread):
    """Starts Ray (connect_ray) off the main thread and stays alive until :meth:`release`. Off the main
    thread, ray.init keeps our SIGTERM handler (from the main thread it installs its own, a sys.exit that a
    start-up in progress may swallow); staying alive matters because Linux kills the processes ray.init
    starts when the *thread* that started them ends (their parent-death signal)."""

    def __init__(self, address, object_store_mb: int):
        super().__init__(name="ray-owner", daemon=True)
        self.args, self.private, self.error = (address, object_store_mb), False, None
        self.ready, self.released = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            self.private = connect_ray(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            self.error = e
        finally:
            self.ready.set()
        self.released.wait()

    def start_ray(self) -> bool:
        """Start, wait (signals are handled meanwhile), re-raise its error; True when the Ray is private."""
        with dropped_log_line("ray._private.worker", "SIGTERM handler is not set"):
            self.start()
            while not self.ready.wait(0.1):
                pass
        if self.error is not None:
            raise self.error
        return self.private

    def release(self) -> None:
        self.released.set()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, or a service manager's stop: the same path
FRONT_DOORS = {"haproxy": "HAProxy", "serve": "Serve's proxy", "cluster's": "the cluster's"}
ROUTE_WAIT_S = 60.0   # seconds the HAProxy front door may take to route to a started app
DRAIN_S = 3.0   # seconds a stop gives the app's replicas to finish what is in flight before Ray goes


class Stopper:
    """SIGINT and SIGTERM both stop the server. Until :meth:`arm` (while Ray starts) a signal is only
    recorded, so that Ray is never left half-started; after it, a signal raises KeyboardInterrupt in the
    main thread; during the stop itself further signals are ignored, so a second Ctrl-C cannot cut it."""

    def __init__(self):
        self.requested = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._hold)

    def _hold(self, signum, frame) -> None:
        self.requested = True

    @staticmethod
    def _interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    def arm(self) -> None:
        """From now on a signal interrupts; one that came while held interrupts now."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._interrupt)
        if self.requested:
            raise KeyboardInterrupt

    def disarm(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def wait_answering(url: str, timeout_s: float = ROUTE_WAIT_S) -> None:
    """Until ``url`` answers with any HTTP status (401 without the key counts), at most ``timeout_s``."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except urllib.error.HTTPError as e:
            if e.code != 404 and e.code < 500:    # 404 / 503: HAProxy has no route to the app yet
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            print(f"warning: {url} did not answer within {timeout_s:.0f} s of the app's start", file=sys.stderr)
            return
        time.sleep(0.2)


def stop(app_name: str, private: bool) -> None:
    """Delete the app: Serve drains each replica (what is in flight is answered or ends; the replicas'
    shutdown hooks run). On a private Ray, wait for that at most DRAIN_S, then stop the Ray and wait for
    all its processes; on a joined cluster only disconnect (its controller finishes the deletion)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    deadline = time.monotonic() + DRAIN_S
    try:  # open streams end now with an error event and [DONE] (every replica also does it when stopped)
        serve.get_deployment_handle("OpenAIIngress", app_name).drain.remote().result(timeout_s=1.0)
    except Exception:  # noqa: BLE001 - no app yet, or it cannot answer: the deletion below still drains
        pass
    try:
        serve.delete(app_name, _blocking=False)
        while private and app_name in serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - no Serve yet (stopped during start-up), Ray going away: nothing to drain
        pass
    ray.shutdown(wait_for_processes=private)


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
    from actors.serve_config import check_model_dir

    try:
        kind = check_model_dir(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from actors.ray_start import join_address

    from actors import serve_proxy

    # Serve's proxies (started by a private Ray, from this environment) clean request ids and guard
    # /-/routes with the key; on a joined cluster set both variables where its raylets start.
    os.environ.setdefault(serve_proxy.CALLBACK_ENV, serve_proxy.CALLBACK)
    if cfg.api_key:
        os.environ["DSQUANT_API_KEY"] = cfg.api_key
    stopper, owner, private = Stopper(), RayOwner(args.address, args.object_store_mb), False
    joining = join_address(args.address)
    if joining and args.http_proxy == "haproxy":
        print("error: --http-proxy haproxy needs RAY_SERVE_ENABLE_HA_PROXY=1 where the cluster's raylets start "
              "(a joined cluster's Serve is already configured)", file=sys.stderr)
        return 2
    front = "cluster's" if joining else resolve_http_proxy(args.http_proxy, cfg.api_key)
    if args.http_proxy == "haproxy" and not haproxy_binary():
        print("error: --http-proxy haproxy needs Ray >= 2.56 with an HAProxy binary (ray[serve] installs one; "
              "or RAY_SERVE_HAPROXY_BINARY_PATH)", file=sys.stderr)
        return 2
    if not joining:  # the private Ray's Serve processes inherit these (jobs/_serve_env.py)
        apply_serve_env(serve_environment(front, args.serve_throughput))
    try:
        if joining:
            stopper.arm()  # joining starts no process here: a signal may interrupt it at once
        private = owner.start_ray()
        stopper.arm()
        from ray import serve

        from actors.serve_app import build_app

        t0 = time.time()
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        try:
            app = build_app(cfg)
        except ValueError as e:  # a config the cluster cannot schedule: what to lower
            print(f"error: {e}", file=sys.stderr)
            return 2
        with dropped_log_line("ray.serve", EXISTING_SERVE):  # serve.run finds the instance just started
            serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix)
        base = f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1"
        if front == "haproxy":      # HAProxy learns the app's route after serve.run returns
            wait_answering(f"http://{_local(cfg.host)}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1/models")
        print(f"serving {cfg.model_name!r} ({kind}) from {cfg.model_path} at {base} (ready in {time.time() - t0:.0f}s; "
              f"{'API key required' if cfg.api_key else 'no API key'}; front door: {FRONT_DOORS.get(front, front)}); "
              "Ctrl-C stops",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
    finally:
        stopper.disarm()
        stop(cfg.app_name, private)
        owner.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
