"""The serving application on Ray Serve: an OpenAI-compatible ingress and the engine it streams from.

- :class:`~actors.serving.engine.llm_server.LLMServer` (actors/serving/engine/llm_server.py) owns one engine: by
  default stepping in a child process of its own (vLLM v1's EngineCore split), a sharded replica (or ``engine_process: false``) on
  a background thread.
- :class:`~actors.serving.app.serve_ingress.OpenAIIngress` (FastAPI through ``@serve.ingress``): the OpenAI routes,
  /health and /metrics, validation, auth and backpressure.

Where the engine sits (``ServeConfig.engine_in_ingress``): by default each ingress replica builds its own
``LLMServer`` in its process and reads the engine core's events directly (one pipe message per engine
step, no Ray call per token: the app is ONE deployment, ``OpenAIIngress``, with the llm's replicas and the
CPUs of both); a sharded engine, or ``engine_in_ingress: false``, is an ``LLMServer`` deployment behind the
ingress, each event a Serve streaming item. In the disaggregated mode the prefill deployment stays apart
and the decode engine sits where the colocated one would.

``build_app(ServeConfig(...))`` returns the bound application for ``serve.run``. :class:`ServeConfig` is a
dataclass that can be built in code or read from a JSON or YAML file (:meth:`ServeConfig.from_file`).

Per-replica figures: ``/metrics`` shows the ingress replica that answered and the engine replica that
answered its stats call (the same replica when the ingress owns the engine).
"""

from __future__ import annotations

from typing import Any, Mapping, Union

from actors.serving.engine.engine_replica import placement
from actors.serving.engine.llm_server import LLMServer
from actors.serving.serve_config import DEFAULT_ENGINE, DeploymentOptions, ServeConfig, check_fits  # noqa: F401
from actors.serving.app.serve_ingress import OpenAIIngress

ADMIN_HEADROOM = 16     # calls beyond max_in_flight a replica accepts: health, metrics, stats, refusals

def _check_cluster_fits(config: ServeConfig) -> None:
    """Refuse now, naming what to change, a config the connected Ray cluster cannot schedule."""
    import ray

    if not ray.is_initialized():
        return  # `serve run` builds the app before connecting: Serve reports what does not fit
    nodes = [n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    check_fits(config, sum(nodes), nodes)


# ----- the application ---------------------------------------------------------------------------------

#: A replica being stopped checks for open requests every 0.1 s (Serve's default waits 2 s before the first
#: check) and gives them 2.5 s: jobs.serve stops within 5 s of a signal (tests/test_serve_shutdown.py).
FAST_STOP = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 2.5}


def build_app(config: Union[ServeConfig, Mapping[str, Any]]):
    """The bound application (the ingress owning its engine, or ingress -> LLMServer) for ``serve.run``. ``config``:
    a ServeConfig or its mapping (so ``serve run actors.serving.app.serve_app:build_app model_path=...`` works too)."""
    from ray.serve.config import BackpressureConfig

    if not isinstance(config, ServeConfig):
        config = ServeConfig.from_dict(config)
    _check_cluster_fits(config)
    in_flight = config.max_in_flight * config.ingress.num_replicas
    prefill = None
    if config.mode == "disaggregated":
        from actors.serving.engine.prefill_server import PrefillServer

        prefill = PrefillServer.options(
            num_replicas=config.prefill.num_replicas, ray_actor_options=dict(config.prefill.ray_actor_options),
            max_ongoing_requests=in_flight + ADMIN_HEADROOM, **FAST_STOP, **placement(config, "prefill"),
        ).bind(config)
    if config.fused:    # each ingress replica owns its engine: no Ray hop per token
        ingress, bound = config.fused_ingress(), (None, config, prefill)
    else:
        llm = LLMServer.options(
            num_replicas=config.llm.num_replicas, ray_actor_options=dict(config.llm.ray_actor_options),
            max_ongoing_requests=in_flight + ADMIN_HEADROOM, **FAST_STOP, **placement(config, "llm"),
        ).bind(config, prefill)
        ingress, bound = config.ingress, (llm, config)
    return OpenAIIngress.options(
        num_replicas=ingress.num_replicas, ray_actor_options=dict(ingress.ray_actor_options),
        max_ongoing_requests=config.max_in_flight + ADMIN_HEADROOM,
        max_queued_requests=config.max_in_flight,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1), **FAST_STOP,
    ).bind(*bound)
