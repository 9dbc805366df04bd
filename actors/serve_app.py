"""The colocated serving application on Ray Serve: an OpenAI-compatible ingress and an engine deployment.

- :class:`LLMServer` owns one :class:`~pipeline.engine.engine.LLMEngine`: by default the engine steps in a
  child process of its own (:class:`~pipeline.engine.core_process.EngineCoreClient`, vLLM v1's EngineCore
  split: no interpreter lock shared with HTTP and streaming, one message per step), a sharded replica (or
  ``engine_process: false``) on a background thread of the replica (:class:`EngineLoop`). Its one generation method, :meth:`LLMServer.generate`, takes a
  validated :class:`~pipeline.serving.openai_api.GenerateRequest` and is an async generator of
  :class:`~pipeline.serving.openai_api.TokenEvent` (call it through ``handle.options(stream=True)``); when the
  caller stops consuming it (a client went away: the generator is cancelled or closed) the sequence is
  aborted and its cache blocks freed. ``info()``, ``stats()`` and ``check_health()`` complete it.
- :class:`~actors.serve_ingress.OpenAIIngress` (FastAPI through ``@serve.ingress``, in its own module):
  the OpenAI routes, /health and /metrics, validation, auth and backpressure in front of it.

``build_app(ServeConfig(...))`` returns the bound application for ``serve.run``. :class:`ServeConfig` is a
dataclass that can be built in code or read from a JSON or YAML file (:meth:`ServeConfig.from_file`).

Per-replica figures: ``/metrics`` shows the ingress replica that answered and the engine replica that
answered its stats call; with one replica of each (the default) that is everything.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, AsyncIterator, Mapping, Optional, Union

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.ray_errors import app_error
from pipeline.engine.engine_loop import EngineDead, EngineLoop, PrefillFailed  # noqa: F401
from actors.serve_config import DEFAULT_ENGINE, DeploymentOptions, ServeConfig, check_fits  # noqa: F401
from actors.engine_replica import make_engine, placement
from actors.serve_ingress import OpenAIIngress
from pipeline.engine.engine_loop import TokenEvent
from pipeline.serving.openai_api import GenerateRequest

ADMIN_HEADROOM = 16     # calls beyond max_in_flight a replica accepts: health, metrics, stats, refusals
PREFILL_FAILURES_UNHEALTHY = 3  # prefills failed in a row (disaggregated): /health says so until one succeeds

# ----- the engine deployment ---------------------------------------------------------------------------

def build_engine(config: ServeConfig, deployment: str):
    """The engine of one replica of ``deployment``, built where it will step (this process or the engine
    core's child process: module level, so it pickles)."""
    import torch

    from pipeline.text.tokenizer import Tokenizer

    torch.set_num_threads(config.torch_threads)
    return make_engine(config, deployment, Tokenizer.from_dir(config.model_path))


def engine_info(engine) -> dict:
    """What the replica needs to know about its engine, wherever the engine runs."""
    return {"max_model_len": engine.scheduler.max_model_len, "layout": engine.kv_layout()}


@serve.deployment(name="LLMServer")
class LLMServer:
    """One engine replica. Interface (all async, through a DeploymentHandle):
    ``generate(GenerateRequest)`` (stream=True) -> TokenEvent*; ``info()`` -> dict with ``max_model_len``,
    ``num_blocks``, ``block_size``, ``model``; ``stats()`` -> the loop's snapshot; ``check_health()``."""

    def __init__(self, config: ServeConfig, prefill: Optional[DeploymentHandle] = None):
        self.config, self.prefill = config, prefill
        self.handoffs, self.handoff_bytes, self.prefill_failures = 0, 0, 0
        self.prefill_failing: Optional[str] = None  # the last error, once PREFILL_FAILURES_UNHEALTHY in a row
        self._failures_in_row = 0
        if config.engine_process and config.parallel_of("llm").single:
            from pipeline.engine.core_process import EngineCoreClient

            self.loop = EngineCoreClient(partial(build_engine, config, "llm"), engine_info)
            info = self.loop.ready
        else:
            engine = build_engine(config, "llm")
            info = engine_info(engine)
            self.loop = EngineLoop(engine)
        self.max_model_len, self.layout = info["max_model_len"], info["layout"]

    async def _prefilled(self, request: GenerateRequest):
        """Ask the prefill deployment for the prompt's first token and cache blocks (disaggregated mode)."""
        try:
            kv = await asyncio.wait_for(self.prefill.prefill.remote(request.prompt_ids, request.params),
                                        self.config.prefill_timeout_s)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - unavailable, timed out, failed: this request only
            cause = app_error(e)
            if isinstance(cause, ValueError):
                raise cause from None
            self.prefill_failures += 1
            self._failures_in_row += 1
            why = f"prefill failed: {type(cause).__name__}: {cause}"
            if self._failures_in_row >= PREFILL_FAILURES_UNHEALTHY:
                self.prefill_failing = why
            raise PrefillFailed(why) from None
        self._failures_in_row, self.prefill_failing = 0, None
        if kv.layout != self.layout:
            raise PrefillFailed("prefill and decode disagree on the KV cache layout "
                                f"({sorted(k for k in kv.layout if kv.layout[k] != self.layout.get(k))})")
        self.handoffs += 1
        self.handoff_bytes += kv.nbytes
        return kv

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Token events for the request until one carries a finish reason. Raises the engine's ValueError
        for a request it refuses. Cancelled or closed early: the sequence is aborted (blocks freed). In the
        disaggregated mode the prompt is prefilled by the prefill deployment first (its first token is the
        first event) and the handed-over blocks are decoded here."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(ev):
            loop.call_soon_threadsafe(events.put_nowait, ev)

        if self.prefill is None:
            key = self.loop.submit(request.prompt_ids, request.params, sink)
        else:
            kv = await self._prefilled(request)
            yield TokenEvent(() if kv.first_token is None else (kv.first_token,), kv.finish_reason,
                             kv.first_logprobs)
            if kv.finish_reason is not None:
                return
            key = self.loop.submit_prefilled(kv, request.params, sink)
        done = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, BaseException):
                    done = True
                    raise ev
                if ev.finish_reason is not None:
                    done = True
                yield ev
                if done:
                    return
        finally:
            if not done:
                self.loop.abort(key)

    async def info(self) -> dict:
        cfg = self.config.engine
        return {"model": self.config.model_name, "max_model_len": self.max_model_len, "num_blocks": cfg.num_blocks,
                "block_size": cfg.block_size, "nz": cfg.nz, "mtp": cfg.mtp}

    async def stats(self) -> dict:
        out = dict(self.loop.snapshot)
        engine = getattr(self.loop, "engine", None)     # None: the engine steps in its own process
        ranks = getattr(engine.runner, "rank_info", None) if engine is not None else None
        if ranks:
            out.update(ranks=[{k: r[k] for k in ("rank", "pid") if k in r} for r in ranks],
                       rank_bytes_sent=self.loop.engine.runner.comm.bytes_sent)
        if self.prefill is not None:
            out.update(kv_handoffs=self.handoffs, kv_handoff_bytes=self.handoff_bytes,
                       prefill_failures=self.prefill_failures, prefill_failing=self.prefill_failing)
        return out

    def check_health(self) -> None:
        if not self.loop.alive:
            raise EngineDead(f"the engine loop is not running: {self.loop.error!r}")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=1.0)
            engine = getattr(loop, "engine", None)
            close = getattr(engine.runner, "close", None) if engine is not None else None
            if close is not None:   # a sharded replica: stop its other ranks
                close()


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
    """The bound application (ingress -> LLMServer) for ``serve.run``. ``config``: a ServeConfig or its
    mapping (so ``serve run actors.serve_app:build_app model_path=...`` works too)."""
    from ray.serve.config import BackpressureConfig

    if not isinstance(config, ServeConfig):
        config = ServeConfig.from_dict(config)
    _check_cluster_fits(config)
    in_flight = config.max_in_flight * config.ingress.num_replicas
    prefill = None
    if config.mode == "disaggregated":
        from actors.prefill_server import PrefillServer

        prefill = PrefillServer.options(
            num_replicas=config.prefill.num_replicas, ray_actor_options=dict(config.prefill.ray_actor_options),
            max_ongoing_requests=in_flight + ADMIN_HEADROOM, **FAST_STOP, **placement(config, "prefill"),
        ).bind(config)
    llm = LLMServer.options(
        num_replicas=config.llm.num_replicas, ray_actor_options=dict(config.llm.ray_actor_options),
        max_ongoing_requests=in_flight + ADMIN_HEADROOM, **FAST_STOP, **placement(config, "llm"),
    ).bind(config, prefill)
    return OpenAIIngress.options(
        num_replicas=config.ingress.num_replicas, ray_actor_options=dict(config.ingress.ray_actor_options),
        max_ongoing_requests=config.max_in_flight + ADMIN_HEADROOM,
        max_queued_requests=config.max_in_flight,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1), **FAST_STOP,
    ).bind(llm, config)
