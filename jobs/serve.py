"""Serve a quantized model or a float checkpoint with an OpenAI-compatible API on Ray Serve: ``python -m jobs.serve``.

With no arguments it serves ``out/dsv3-tiny-pydoc-w8a8-fa3`` (quantizing the embedded model there first
when that directory is missing or incomplete) on http://127.0.0.1:8000/v1 until Ctrl-C. ``--model-path``
may also name a float HF-layout checkpoint (config.json + safetensors, bf16 or the FP8 release), e.g. the
embedded ``pipeline/assets/dsv3-tiny-pydoc``: the same engine runs it with float linears and the latent
cached in the model's dtype, for comparing float and quantized side by side. Ray: the cluster
at ``--address`` / RAY_ADDRESS when given, else a private local one started here (object store capped) and
stopped on exit. SIGINT and SIGTERM stop it within 5 s (``jobs._serve_lifecycle.STOP_S``), leaving no process
or port behind, also when they go to its whole process group or service (``timeout``, ``kill -TERM -PGID``,
systemd). The API key (``--api-key``) is better given in ``DSQUANT_API_KEY`` or ``--api-key-file``:
a command line is visible to every user of the machine. ``--config FILE`` (JSON or YAML, see
``actors.serving.app.serve_app.ServeConfig``) gives every option; flags given on the command line override it.

    python -m jobs.serve --port 8000 --api-key sk-local --max-in-flight 32 --num-blocks 512 --mtp
    python -m jobs.serve --model-path pipeline/assets/dsv3-tiny-pydoc --port 8001     # the float model
    python -m jobs.chat "What's deep learning?"
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from jobs._serve_env import (apply as apply_serve_env, haproxy_binary, haproxy_files, resolve_http_proxy,
                             serve_environment)
from pipeline.engine.device import check_device
from jobs._serve_flags import DEFAULT_MODEL, build_parser, make_config, parse_args
from jobs._serve_lifecycle import (EXISTING_SERVE, FRONT_DOORS, RayOwner, Stopper, _local, check_port,
                                   dropped_log_line, stop, wait_answering)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["DEFAULT_MODEL", "build_parser", "parse_args", "make_config", "ensure_default_model", "main"]


def ensure_default_model(path: str) -> None:
    """Quantize the embedded model into ``path`` when it has no complete output (no description file)."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.format.description import DESCRIPTION_NAME
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint

    if (Path(path) / DESCRIPTION_NAME).exists():
        return
    print(f"{path} is missing: quantizing the embedded model into it first", file=sys.stderr)
    quantize_checkpoint(str(EMBEDDED_MODEL_DIR), path, Recipe(), QuantizeOptions(overwrite=True))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.api_key is not None:
        print("warning: --api-key is visible to every user of this machine (ps); give it in DSQUANT_API_KEY "
              "or --api-key-file instead", file=sys.stderr)
    try:
        cfg = make_config(args)
        check_device(cfg.engine.device, "--device")
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from actors.cluster.ray_start import check_address, join_address

    from actors.serving.app import serve_proxy

    try:  # before anything starts or is built: a cluster that is not there, a port already taken
        check_address(args.address, "--address")
        if not join_address(args.address):
            check_port(cfg.host, cfg.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.model_path == str(Path(DEFAULT_MODEL).resolve()):
        ensure_default_model(cfg.model_path)
    elif "://" not in cfg.model_path and not Path(cfg.model_path).is_dir():
        print(f"error: --model-path {cfg.model_path} is not a directory", file=sys.stderr)
        return 2
    from actors.serving.serve_config import check_model_dir
    from pipeline.io import storage

    try:
        storage.check_reachable(cfg.model_path)      # a mute object store: seconds, not minutes
        kind = check_model_dir(cfg)
        if not join_address(args.address):           # this machine runs every engine: do they fit?
            from pipeline.engine.worker.memory import check_fits

            check_fits(cfg.model_path, sum(o.num_replicas for n, o in cfg.deployments().items()
                                           if n in ("llm", "prefill")), with_mtp=cfg.engine.mtp)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

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
    hap_dir = None
    if not joining:  # the private Ray's Serve processes inherit these (jobs/_serve_env.py)
        apply_serve_env(serve_environment(front, args.serve_throughput))
        if front == "haproxy":
            hap_dir, hap_env = haproxy_files(haproxy_binary(), cfg.host)
            os.environ.update(hap_env)
    rc = 0
    try:
        if joining:
            stopper.arm()  # joining starts no process here: a signal may interrupt it at once
        private = owner.start_ray()
        stopper.arm()
        from ray import serve

        from actors.serving.app.serve_app import build_app

        t0 = time.time()
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        try:
            app = build_app(cfg)
        except ValueError as e:  # a config the cluster cannot schedule: what to lower
            print(f"error: {e}", file=sys.stderr)
            rc = 2
            return rc
        with dropped_log_line("ray.serve", EXISTING_SERVE):  # serve.run finds the instance just started
            serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix)
        base = f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1"
        if not joining:  # the front door learns the app's route after serve.run returns: HAProxy from Serve,
            # Serve's proxy through its long poll of the controller (seconds on a loaded CPU; until then a 404)
            wait_answering(f"http://{_local(cfg.host)}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1/models")
        print(f"serving {cfg.model_name!r} ({kind}) from {cfg.model_path} at {base} (ready in {time.time() - t0:.0f}s; "
              f"{'API key required' if cfg.api_key else 'no API key'}; front door: {FRONT_DOORS.get(front, front)}); "
              "Ctrl-C stops",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a failure while starting: shown, then what started is stopped
        traceback.print_exc()
        rc = 1
    finally:
        stopper.disarm()
        stop(cfg.app_name, private, stopper.since)
        owner.release()
        if hap_dir is not None:
            shutil.rmtree(hap_dir, ignore_errors=True)
        # Leave now: what Ray's native exit hooks would do is done (the Ray stopped, or its processes
        # killed), and they take seconds (or hang, when the Ray was stopped from outside).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
