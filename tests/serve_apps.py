"""Deploying the Serve test modules' apps."""

from __future__ import annotations


def deploy(apps: dict) -> None:
    """Deploy ``{name: (ServeConfig, route prefix)}`` on the running Serve at once and wait until every app
    runs: their replicas start side by side (test_serve's five apps measured 26 s against 34 one after
    another)."""
    from ray import serve

    from actors.serve_app import build_app

    serve.run_many([serve.RunTarget(build_app(cfg), name=name, route_prefix=prefix)
                    for name, (cfg, prefix) in apps.items()])
