"""The OpenAI-compatible HTTP front of the serving application (FastAPI through ``@serve.ingress``):
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true:
``text/event-stream``), ``GET /health``, ``GET /metrics`` (Prometheus text), and the API's own
description (``/openapi.json``, ``/docs``, ``/redoc``). Every request is validated here
(:mod:`pipeline.serving.openai_api`); a bad one never reaches the engine. With ``api_key`` set, the ``/v1``
routes and the API description need ``Authorization: Bearer <key>`` (401 otherwise); ``/health`` and
``/metrics`` stay open, as in vLLM, for load balancers and Prometheus scrapers that hold no key (they tell
nothing but liveness and counts). A request body larger than ``max_body_bytes`` is refused with 413 (at
once when its Content-Length says so), one that takes longer than ``body_timeout_s`` to arrive with 408;
the body is parsed and tokenized on a worker thread, never on the event loop. :meth:`OpenAIIngress.drain`
(called at shutdown) ends every open stream with an OpenAI-style error event and ``data: [DONE]``, and
refuses new requests with 503. At most ``max_in_flight`` generation requests
run per ingress replica; one more is refused at once with 429 (and Serve's own queue in front of the
ingress is bounded too): there is no unbounded queue. :func:`actors.serve_app.build_app` binds it to the
engine deployment.
"""

# No ``from __future__ import annotations`` here: Serve rebuilds the route signatures of the class-based
# FastAPI view, and FastAPI cannot resolve string annotations (``request: "Request"``) in them.

import asyncio
import hmac
import time
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.ray_errors import app_error
from pipeline.engine.engine_loop import EngineDead, PrefillFailed
from actors.serve_config import ServeConfig
from actors.serve_metrics import ServeMetrics
from pipeline.serving import openai_api as api
from pipeline.serving import openai_responses as resp
from pipeline.engine.engine_loop import TokenEvent
from pipeline.serving.openai_api import ApiError, GenerateRequest

STATS_TIMEOUT_S = 5.0


# ----- the ingress -------------------------------------------------------------------------------------

# FastAPI's own docs routes answer everyone; they are re-added below behind the API key
openai_app = FastAPI(title="dsquant OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)


class ShuttingDown(Exception):
    """The ingress is draining for shutdown: open streams end, new requests are refused."""


def engine_failed(cause: BaseException) -> ApiError:
    """A request the engine failed: 503 when the engine replica itself is down (its loop stopped, e.g. a
    rank of a sharded replica died: Serve replaces it, a retry can succeed), else 500."""
    status = 503 if isinstance(cause, EngineDead) else 500
    return ApiError(status, f"the engine failed: {type(cause).__name__}: {cause}", "server_error")


def shutdown_error() -> ApiError:
    return ApiError(503, "the server is shutting down; retry the request", "server_error", None,
                    "server_shutting_down")


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
        from pipeline.text.tokenizer import Tokenizer

        self.llm, self.config = llm, config
        self.model = config.model_name
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.metrics = ServeMetrics()
        self.in_flight = 0
        self._draining = asyncio.Event()
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

    async def _read_body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes`` (413 beyond) and within ``body_timeout_s`` (408)."""
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                             "invalid_request_error", None, "request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise too_large

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                           "invalid_request_error", None, "request_timeout") from None

    def _parse(self, raw: bytes, parse, max_model_len: int) -> GenerateRequest:
        """JSON, validation and tokenization (run on a worker thread: a large prompt takes a while)."""
        return parse(api.parse_json_body(raw), self.tokenizer, self.model, max_model_len)

    async def drain(self) -> int:
        """Shutdown: every open stream ends with an error event and ``data: [DONE]``, new generation
        requests get 503. Returns the number of requests in flight when called."""
        self._draining.set()
        return self.in_flight

    async def __del__(self):
        """Serve calls this when it stops the replica: whatever is still open ends cleanly."""
        self._draining.set()

    async def _next_event(self, it: AsyncIterator[TokenEvent]) -> TokenEvent:
        """The next event of ``it``, or ShuttingDown as soon as :meth:`drain` is called."""
        nxt = asyncio.ensure_future(it.__anext__())
        drain = asyncio.ensure_future(self._draining.wait())
        try:
            done, _ = await asyncio.wait({nxt, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
        if nxt in done:
            return nxt.result()
        nxt.cancel()
        raise ShuttingDown()

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
        if stats.get("prefill_failing"):  # disaggregated: every request would fail at prefill now
            return JSONResponse({"status": "unhealthy", "error": stats["prefill_failing"]}, status_code=503)
        return {"status": "ok"}

    @openai_app.get("/metrics")
    async def metrics(self):
        try:
            stats = await asyncio.wait_for(self.llm.stats.remote(), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the scrape still answers, with dsquant_engine_up 0
            stats = None
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(stats), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @openai_app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        err = self._auth(request)
        return self._reply("docs", err) if err is not None else JSONResponse(openai_app.openapi())

    @openai_app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        err = self._auth(request)
        if err is not None:
            return self._reply("docs", err)
        return get_swagger_ui_html(openapi_url=f"{request.scope.get('root_path', '')}/openapi.json",
                                   title=openai_app.title)

    @openai_app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request):
        err = self._auth(request)
        if err is not None:
            return self._reply("docs", err)
        return get_redoc_html(openapi_url=f"{request.scope.get('root_path', '')}/openapi.json",
                              title=openai_app.title)

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
        if self._draining.is_set():
            return self._reply(route, shutdown_error())
        try:
            raw = await self._read_body(request)
            info = await self._engine_info()
            req = await asyncio.to_thread(self._parse, raw, parse, info["max_model_len"])
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
                cause = app_error(e)
                if isinstance(cause, ValueError):
                    return self._reply(route, api.invalid(str(cause)))
                if isinstance(cause, PrefillFailed):
                    return self._reply(route, ApiError(503, str(cause), "server_error", None, "prefill_unavailable"))
                return self._reply(route, engine_failed(cause))
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
        while True:
            try:
                ev = await self._next_event(gen)
            except StopAsyncIteration:
                raise EngineDead("the engine's event stream ended without a finish reason") from None
            yield ev
            if ev.finish_reason is not None:
                return

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
        except ShuttingDown:
            return self._reply(route, shutdown_error())
        except Exception as e:  # noqa: BLE001
            cause = app_error(e)
            return self._reply(route, engine_failed(cause))
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
            except ShuttingDown:  # headers are out: say so in the stream, and stop generating for it
                gen.cancel()
                yield resp.sse(shutdown_error().body())
            except Exception as e:  # noqa: BLE001 - headers are out: report in the stream
                cause = app_error(e)
                yield resp.sse(engine_failed(cause).body())
            yield resp.DONE_LINE
            complete = True
        finally:
            if not complete:  # the client went away: stop generating for it
                gen.cancel()
                self.metrics.finished.labels(reason="abort").inc()
            self._done(route, 200)
            self._release()
