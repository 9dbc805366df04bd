"""The colocated serving application on Ray Serve: an OpenAI-compatible ingress and an engine deployment.

- :class:`LLMServer` owns one :class:`~pipeline.engine.engine.LLMEngine` and runs its step loop on a
  background thread (:class:`EngineLoop`). Its one generation method, :meth:`LLMServer.generate`, takes a
  validated :class:`~pipeline.openai_api.GenerateRequest` and is an async generator of
  :class:`~pipeline.openai_api.TokenEvent` (call it through ``handle.options(stream=True)``); when the
  caller stops consuming it (a client went away: the generator is cancelled or closed) the sequence is
  aborted and its cache blocks freed. ``info()``, ``stats()`` and ``check_health()`` complete it.
- :class:`OpenAIIngress` (FastAPI through ``@serve.ingress``): ``GET /v1/models``, ``POST /v1/completions``,
  ``POST /v1/chat/completions`` (``stream`` true: ``text/event-stream``), ``GET /health``, ``GET /metrics``
  (Prometheus text). Every request is validated here (:mod:`pipeline.openai_api`); a bad one never reaches
  the engine. With ``api_key`` set, the ``/v1`` routes need ``Authorization: Bearer <key>`` (401
  otherwise). At most ``max_in_flight`` generation requests run per ingress replica; one more is refused at
  once with 429 (and Serve's own queue in front of the ingress is bounded too): there is no unbounded queue.

``build_app(ServeConfig(...))`` returns the bound application for ``serve.run``. :class:`ServeConfig` is a
dataclass that can be built in code or read from a JSON or YAML file (:meth:`ServeConfig.from_file`).

Per-replica figures: ``/metrics`` shows the ingress replica that answered and the engine replica that
answered its stats call; with one replica of each (the default) that is everything.
"""

# No ``from __future__ import annotations`` here: Serve rebuilds the route signatures of the class-based
# FastAPI view, and FastAPI cannot resolve string annotations (``request: "Request"``) in them.

import asyncio
import hmac
import time
from typing import Any, AsyncIterator, Mapping, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.engine_loop import EngineDead, EngineLoop, PrefillFailed, task_cause as _cause  # noqa: F401
from actors.serve_config import DEFAULT_ENGINE, DeploymentOptions, ServeConfig  # noqa: F401 (re-exported)
from actors.serve_metrics import ServeMetrics
from pipeline import openai_api as api
from pipeline import openai_responses as resp
from pipeline.openai_api import ApiError, GenerateRequest, TokenEvent

ADMIN_HEADROOM = 16     # calls beyond max_in_flight a replica accepts: health, metrics, stats, refusals
STATS_TIMEOUT_S = 5.0


# ----- the engine deployment ---------------------------------------------------------------------------

@serve.deployment(name="LLMServer")
class LLMServer:
    """One engine replica. Interface (all async, through a DeploymentHandle):
    ``generate(GenerateRequest)`` (stream=True) -> TokenEvent*; ``info()`` -> dict with ``max_model_len``,
    ``num_blocks``, ``block_size``, ``model``; ``stats()`` -> the loop's snapshot; ``check_health()``."""

    def __init__(self, config: ServeConfig, prefill: Optional[DeploymentHandle] = None):
        import torch

        from pipeline.engine.engine import LLMEngine
        from pipeline.tokenizer import Tokenizer

        torch.set_num_threads(config.torch_threads)
        self.config, self.prefill = config, prefill
        tok = Tokenizer.from_dir(config.model_path)
        engine = LLMEngine(_load(config), config.engine, tok)
        self.max_model_len = engine.scheduler.max_model_len
        self.layout = engine.kv_layout()
        self.handoffs, self.handoff_bytes, self.prefill_failures = 0, 0, 0
        self.loop = EngineLoop(engine)

    async def _prefilled(self, request: GenerateRequest):
        """Ask the prefill deployment for the prompt's first token and cache blocks (disaggregated mode)."""
        try:
            kv = await asyncio.wait_for(self.prefill.prefill.remote(request.prompt_ids, request.params),
                                        self.config.prefill_timeout_s)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - unavailable, timed out, failed: this request only
            cause = _cause(e)
            if isinstance(cause, ValueError):
                raise cause from None
            self.prefill_failures += 1
            raise PrefillFailed(f"prefill failed: {type(cause).__name__}: {cause}") from None
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
            yield TokenEvent(() if kv.first_token is None else (kv.first_token,), kv.finish_reason)
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
        if self.prefill is not None:
            out.update(kv_handoffs=self.handoffs, kv_handoff_bytes=self.handoff_bytes,
                       prefill_failures=self.prefill_failures)
        return out

    def check_health(self) -> None:
        if not self.loop.alive:
            raise EngineDead(f"the engine loop is not running: {self.loop.error!r}")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=1.0)


def _load(config: ServeConfig):
    from pipeline.engine.loader import load_quantized

    return load_quantized(config.model_path, device=config.engine.device)


# ----- the ingress -------------------------------------------------------------------------------------

openai_app = FastAPI(title="dsquant OpenAI-compatible API")


def _error(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _prepend(head: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """``head`` then ``rest``; ``rest`` is closed however this ends."""
    try:
        yield head
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


# Serve captures the module-level names the ingress uses when the class is decorated: define them above.
@serve.deployment(name="OpenAIIngress")
@serve.ingress(openai_app)
class OpenAIIngress:
    """The HTTP front: validation, auth, backpressure, detokenization, responses, metrics."""

    def __init__(self, llm: DeploymentHandle, config: ServeConfig):
        from pipeline.tokenizer import Tokenizer

        self.llm, self.config = llm, config
        self.model = config.model_name
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.metrics = ServeMetrics()
        self.in_flight = 0
        self._info: Optional[dict] = None
        self.created = int(time.time())

    # -- helpers ---------------------------------------------------------------------------------------
    async def _engine_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await asyncio.wait_for(self.llm.info.remote(), STATS_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - no engine replica answers
                raise ApiError(503, f"the engine is not available: {type(e).__name__}: {e}", "server_error") from None
        return self._info

    def _auth(self, request: Request) -> Optional[ApiError]:
        key = self.config.api_key
        if key is None:
            return None
        header = request.headers.get("authorization", "")
        if not header:
            return ApiError(401, "no API key was provided: send 'Authorization: Bearer <key>'",
                            "invalid_request_error", None, "invalid_api_key")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            return ApiError(401, "the API key provided is not valid for this server", "invalid_request_error",
                            None, "invalid_api_key")
        return None

    def _done(self, route: str, status: int) -> None:
        self.metrics.requests.labels(route=route, status=str(status)).inc()

    def _reply(self, route: str, err: ApiError) -> JSONResponse:
        self._done(route, err.status)
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return _error(err, headers)

    # -- routes ----------------------------------------------------------------------------------------
    @openai_app.get("/health")
    async def health(self):
        try:
            stats = await asyncio.wait_for(self.llm.stats.remote(), STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure to reach the engine is unhealthy
            return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)
        if not stats.get("alive"):
            return JSONResponse({"status": "unhealthy", "error": "the engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @openai_app.get("/metrics")
    async def metrics(self):
        try:
            stats = await asyncio.wait_for(self.llm.stats.remote(), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the scrape still answers, with dsquant_engine_up 0
            stats = None
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(stats), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @openai_app.get("/v1/models")
    async def models(self, request: Request):
        err = self._auth(request)
        if err is not None:
            return self._reply("models", err)
        try:
            info = await self._engine_info()
        except ApiError as e:
            return self._reply("models", e)
        self._done("models", 200)
        return resp.models_response(self.model, info["max_model_len"], self.created)

    @openai_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, "completions", api.parse_completion)

    @openai_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, "chat", api.parse_chat)

    # -- generation ------------------------------------------------------------------------------------
    async def _generate(self, request: Request, route: str, parse):
        t0 = time.perf_counter()
        err = self._auth(request)
        if err is not None:
            return self._reply(route, err)
        try:
            body = api.parse_json_body(await request.body())
            info = await self._engine_info()
            req = parse(body, self.tokenizer, self.model, info["max_model_len"])
        except ApiError as e:
            return self._reply(route, e)
        if self.in_flight >= self.config.max_in_flight:
            return self._reply(route, ApiError(
                429, f"the server is at its limit of {self.config.max_in_flight} requests in flight; retry later",
                "rate_limit_error", None, "too_many_requests_in_flight"))
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
        gen = self.llm.options(stream=True).generate.remote(req)
        handed_over = False
        try:
            try:
                first = await gen.__anext__()  # before any header goes out: a refusal can still be a 400
            except StopAsyncIteration:
                return self._reply(route, ApiError(500, "the engine's event stream ended without a token or a finish "
                                                        "reason", "server_error"))
            except Exception as e:  # noqa: BLE001
                cause = _cause(e)
                if isinstance(cause, ValueError):
                    return self._reply(route, api.invalid(str(cause)))
                if isinstance(cause, PrefillFailed):
                    return self._reply(route, ApiError(503, str(cause), "server_error", None, "prefill_unavailable"))
                return self._reply(route, ApiError(500, f"the engine failed: {type(cause).__name__}: {cause}",
                                                   "server_error"))
            if req.stream:
                # From here the stream generator owns the cleanup (abort, in-flight count). It is started
                # (primed) before it is handed over, so its ``finally`` runs however it ends: finished,
                # closed by Starlette, cancelled, or collected when the response never started.
                handed_over = True
                stream = self._stream(req, gen, first, t0, route)
                head = await stream.__anext__()
                return StreamingResponse(_prepend(head, stream), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await self._collect(req, gen, first, t0, route)
        finally:
            if not handed_over:
                gen.cancel()  # no-op when it finished; aborts the sequence when this request was cancelled
                self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)

    def _observe(self, t0: float, last: Optional[float], now: float) -> float:
        if last is None:
            self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.itl.observe(now - last)
        return now

    async def _events(self, gen, first: TokenEvent) -> AsyncIterator[TokenEvent]:
        yield first
        if first.finish_reason is not None:
            return
        async for ev in gen:
            yield ev
            if ev.finish_reason is not None:
                return
        raise EngineDead("the engine's event stream ended without a finish reason")

    async def _collect(self, req: GenerateRequest, gen, first: TokenEvent, t0: float, route: str):
        detok = resp.IncrementalDetokenizer(self.tokenizer, req.params.stop)
        last, n, reason = None, 0, None
        try:
            async for ev in self._events(gen, first):
                if ev.token_ids:
                    last = self._observe(t0, last, time.perf_counter())
                    n += len(ev.token_ids)
                    detok.add(ev.token_ids)
                reason = ev.finish_reason
        except asyncio.CancelledError:  # the client went away; the caller's finally aborts the sequence
            self.metrics.finished.labels(reason="abort").inc()
            raise
        except Exception as e:  # noqa: BLE001
            cause = _cause(e)
            return self._reply(route, ApiError(500, f"the engine failed: {type(cause).__name__}: {cause}",
                                               "server_error"))
        self.metrics.e2e.observe(time.perf_counter() - t0)
        self.metrics.generation_tokens.inc(n)
        self.metrics.finished.labels(reason=reason).inc()
        self._done(route, 200)
        return resp.response(req, detok.text, reason, n)

    async def _stream(self, req: GenerateRequest, gen, first: TokenEvent, t0: float, route: str) -> AsyncIterator[str]:
        detok = resp.IncrementalDetokenizer(self.tokenizer, req.params.stop)
        created = int(time.time())
        last, n, complete = None, 0, False
        try:
            if req.kind == api.CHAT:
                yield resp.sse(resp.stream_chunk(req, created, "", first=True))
            try:
                async for ev in self._events(gen, first):
                    if ev.token_ids:
                        last = self._observe(t0, last, time.perf_counter())
                        n += len(ev.token_ids)
                        self.metrics.generation_tokens.inc(len(ev.token_ids))
                        text = detok.add(ev.token_ids)
                        if text:
                            yield resp.sse(resp.stream_chunk(req, created, text))
                    if ev.finish_reason is not None:
                        tail = detok.finish()
                        if tail:
                            yield resp.sse(resp.stream_chunk(req, created, tail))
                        yield resp.sse(resp.stream_chunk(req, created, None, ev.finish_reason))
                        if req.include_usage:
                            yield resp.sse(resp.usage_chunk(req, created, n))
                        self.metrics.finished.labels(reason=ev.finish_reason).inc()
                        self.metrics.e2e.observe(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - headers are out: report in the stream
                cause = _cause(e)
                yield resp.sse(ApiError(500, f"the engine failed: {type(cause).__name__}: {cause}",
                                       "server_error").body())
            yield resp.DONE_LINE
            complete = True
        finally:
            if not complete:  # the client went away: stop generating for it
                gen.cancel()
                self.metrics.finished.labels(reason="abort").inc()
            self._done(route, 200)
            self._release()


# ----- the application ---------------------------------------------------------------------------------

def build_app(config: Union[ServeConfig, Mapping[str, Any]]):
    """The bound application (ingress -> LLMServer) for ``serve.run``. ``config``: a ServeConfig or its
    mapping (so ``serve run actors.serve_app:build_app model_path=...`` works too)."""
    from ray.serve.config import BackpressureConfig

    if not isinstance(config, ServeConfig):
        config = ServeConfig.from_dict(config)
    in_flight = config.max_in_flight * config.ingress.num_replicas
    prefill = None
    if config.mode == "disaggregated":
        from actors.prefill_server import PrefillServer

        prefill = PrefillServer.options(
            num_replicas=config.prefill.num_replicas, ray_actor_options=dict(config.prefill.ray_actor_options),
            max_ongoing_requests=in_flight + ADMIN_HEADROOM,
        ).bind(config)
    llm = LLMServer.options(
        num_replicas=config.llm.num_replicas, ray_actor_options=dict(config.llm.ray_actor_options),
        max_ongoing_requests=in_flight + ADMIN_HEADROOM,
    ).bind(config, prefill)
    return OpenAIIngress.options(
        num_replicas=config.ingress.num_replicas, ray_actor_options=dict(config.ingress.ray_actor_options),
        max_ongoing_requests=config.max_in_flight + ADMIN_HEADROOM,
        max_queued_requests=config.max_in_flight,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
    ).bind(llm, config)
