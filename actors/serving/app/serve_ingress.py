"""The OpenAI-compatible HTTP front of the serving application (FastAPI through ``@serve.ingress``):
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true:
``text/event-stream``), vLLM's ``POST /tokenize`` and ``POST /detokenize``
(:mod:`pipeline.serving.endpoints.tokenize_api`), ``GET /health``, ``GET /metrics`` (Prometheus text), and the
API's own description (``/openapi.json``, ``/docs``, ``/redoc``). Every request is validated here
(:mod:`pipeline.serving.endpoints.openai_api`); a bad one never reaches the engine. Each request gets its id here
(``openai_api.request_id``, from its X-Request-ID): the response's ``id``, its engine requests', its log
line, its metrics' exemplars. A request for ``n`` choices is ``n`` engine requests (choice i seeded
``seed + i``), their output streams merged
(:mod:`actors.serving.app.serve_streams`), each choice's events turned into its text, logprobs and chunks by
:class:`~pipeline.serving.endpoints.choices.ChoiceState`. With ``api_key`` set, the ``/v1`` routes, the tokenizer
routes and the API description need ``Authorization: Bearer <key>`` (401 otherwise); ``/health`` and
``/metrics`` stay open, as in vLLM, for load balancers and Prometheus scrapers that hold no key (they tell
nothing but liveness and counts). A request body larger than ``max_body_bytes`` is refused with 413 (at
once when its Content-Length says so), one that takes longer than ``body_timeout_s`` to arrive with 408;
the body is parsed and tokenized on a worker thread, never on the event loop. :meth:`OpenAIIngress.drain`
(called at shutdown) ends every open stream with an OpenAI-style error event and ``data: [DONE]``, and
refuses new requests with 503. At most ``max_in_flight`` generations (a request counts its ``n`` choices)
run per ingress replica; one more is refused at once with 429 (and Serve's own queue in front of the
ingress is bounded too): there is no unbounded queue; ``n`` above ``max_in_flight`` is a 400.
:func:`actors.serving.app.serve_app.build_app` binds it to the engine deployment.
"""

# No ``from __future__ import annotations`` here: Serve rebuilds the route signatures of the class-based
# FastAPI view, and FastAPI cannot resolve string annotations (``request: "Request"``) in them.

import asyncio
import functools
import logging
import time
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.serving.api_keys import authorized
from actors.serving.app.engine_client import LocalEngine, RemoteEngine
from actors.cluster.ray_errors import app_error
from actors.serving.serve_config import ServeConfig
from actors.serving.app.serve_limits import answer_bound, longest_token, proxy_limit
from actors.serving.app.serve_metrics import ServeMetrics
from actors.serving.app.serve_streams import ShuttingDown, engine_failed, first_error, first_event, merge_events, shutdown_error
from pipeline.serving.endpoints import openai_api as api
from pipeline.serving.endpoints import openai_responses as resp
from pipeline.serving.endpoints import tokenize_api
from pipeline.serving.endpoints.choices import ChoiceState
from pipeline.serving.logprobs import TokenStrings
from pipeline.serving.endpoints.openai_api import ApiError, GenerateRequest
from pipeline.serving.reasoning import parser_for

STATS_TIMEOUT_S = 5.0
log = logging.getLogger("dsquant.serve")


# ----- the ingress -------------------------------------------------------------------------------------

# FastAPI's own docs routes answer everyone; they are re-added below behind the API key
openai_app = FastAPI(title="dsquant OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
ROUTES = "/v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health, /metrics"


@openai_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, a method the route does not take) in OpenAI's error shape."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message, code = f"Invalid URL ({where}): this server serves {ROUTES}", "not_found"
    elif exc.status_code == 405:
        message, code = f"Invalid method ({where}): the route does not take {request.method}", "method_not_allowed"
    else:
        message, code = f"{where}: {exc.detail}", None
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _error(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _cancel(gens) -> None:
    for g in gens:
        g.cancel()


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

    def __init__(self, llm: Optional[DeploymentHandle], config: ServeConfig,
                 prefill: Optional[DeploymentHandle] = None):
        """``llm``: the engine deployment's handle; None: this replica builds its own engine
        (``engine_in_ingress``; ``prefill``: the prefill deployment it hands prompts to, disaggregated)."""
        from pipeline.text.tokenizer import Tokenizer

        self.config = config
        self.engine = RemoteEngine(llm) if llm is not None else LocalEngine.build(config, prefill)
        self.model = config.model_name
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.strings = TokenStrings(self.tokenizer)     # token strings and bytes, for logprobs (cached)
        self.parse_chat = functools.partial(api.parse_chat, reasoning=parser_for(config.reasoning_parser,
                                                                                  self.tokenizer.chat_template),
                                            constrain_reasoning=config.constrain_reasoning)
        self.metrics = ServeMetrics()
        self.in_flight = 0
        self.answer_limit = proxy_limit()               # bytes a non-streamed answer may have (None: any)
        self._token_bytes: Optional[int] = None
        self._draining = asyncio.Event()
        self._info: Optional[dict] = None
        self.created = int(time.time())

    # -- helpers ---------------------------------------------------------------------------------------
    async def _engine_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await asyncio.wait_for(self.engine.info(), STATS_TIMEOUT_S)
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
        if not authorized(header, key):
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

    def _parse(self, raw: bytes, parse, max_model_len: int, rid: str) -> GenerateRequest:
        """JSON, validation and tokenization (run on a worker thread: a large prompt takes a while)."""
        return parse(api.parse_json_body(raw), self.tokenizer, self.model, max_model_len, rid)

    async def drain(self) -> int:
        """Shutdown: every open stream ends with an error event and ``data: [DONE]``, new generation
        requests get 503. Returns the number of requests in flight when called."""
        self._draining.set()
        return self.in_flight

    async def __del__(self):
        """Serve calls this when it stops the replica: whatever is still open ends cleanly, then an engine
        of this replica's own stops."""
        self._draining.set()
        if self.engine.local:
            await asyncio.sleep(0.05)   # the open streams read the drain first
            self.engine.close()

    def check_health(self) -> None:
        """Serve's health check: an engine of this replica's own must be running (else Serve replaces
        the replica)."""
        self.engine.check_health()

    def _done(self, route: str, status: int) -> None:
        self.metrics.requests.labels(route=route, status=str(status)).inc()

    def _reply(self, route: str, err: ApiError, rid: Optional[str] = None) -> JSONResponse:
        self._done(route, err.status)
        if rid is not None:
            (log.warning if err.status >= 500 else log.info)("request %s: %d %s", rid, err.status, err.message)
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return _error(err, headers)

    # -- routes ----------------------------------------------------------------------------------------
    @openai_app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self):
        try:
            stats = await asyncio.wait_for(self.engine.stats(), STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure to reach the engine is unhealthy
            return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)
        if not stats.get("alive"):
            return JSONResponse({"status": "unhealthy", "error": "the engine loop stopped"}, status_code=503)
        if stats.get("prefill_failing"):  # disaggregated: every request would fail at prefill now
            return JSONResponse({"status": "unhealthy", "error": stats["prefill_failing"]}, status_code=503)
        return {"status": "ok"}

    @openai_app.get("/metrics")
    async def metrics(self, request: Request):
        try:
            stats = await asyncio.wait_for(self.engine.stats(), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the scrape still answers, with dsquant_engine_up 0
            stats = None
        body, content_type = self.metrics.render(stats, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

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
        return await self._generate(request, "chat", self.parse_chat)

    @openai_app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._tokenizer_route(request, "tokenize")

    @openai_app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._tokenizer_route(request, "detokenize")

    def _tokenization(self, raw: bytes, route: str, max_model_len: int) -> dict:
        """A /tokenize or /detokenize answer (on a worker thread: a long text takes a while)."""
        body = api.parse_json_body(raw)
        if route == "tokenize":
            ids, strs = tokenize_api.parse_tokenize(body, self.tokenizer, self.model)
            return tokenize_api.tokenize_response(ids, max_model_len, self.strings if strs else None)
        return tokenize_api.detokenize_response(self.tokenizer,
                                                tokenize_api.parse_detokenize(body, self.tokenizer, self.model))

    async def _tokenizer_route(self, request: Request, route: str):
        err = self._auth(request)
        if err is not None:
            return self._reply(route, err)
        try:
            raw = await self._read_body(request)
            max_len = (await self._engine_info())["max_model_len"] if route == "tokenize" else 0
            out = await asyncio.to_thread(self._tokenization, raw, route, max_len)
        except ApiError as e:
            return self._reply(route, e)
        self._done(route, 200)
        return out

    # -- generation ------------------------------------------------------------------------------------
    async def _generate(self, request: Request, route: str, parse):
        t0 = time.perf_counter()
        rid = api.request_id(api.CHAT if route == "chat" else api.COMPLETION, request.headers.get("x-request-id"))
        err = self._auth(request)
        if err is not None:
            return self._reply(route, err)
        if self._draining.is_set():
            return self._reply(route, shutdown_error(), rid)
        try:
            raw = await self._read_body(request)
            info = await self._engine_info()
            req = await asyncio.to_thread(self._parse, raw, parse, info["max_model_len"], rid)
        except ApiError as e:
            return self._reply(route, e, rid)
        limit, n = self.config.max_in_flight, req.n
        if n > limit:
            return self._reply(route, api.invalid(f"n is {n} but this server runs at most {limit} generations at "
                                                  "once (each choice is one)", "n"), rid)
        err = self._too_large(req)
        if err is not None:
            return self._reply(route, err, rid)
        if self.in_flight + n > limit:
            return self._reply(route, ApiError(
                429, f"the server is at its limit of {limit} requests in flight; retry later",
                "rate_limit_error", None, "too_many_requests_in_flight"), rid)
        self._acquire(n)
        self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
        gens = [self.engine.stream(req.engine_request(i)) for i in range(n)]
        handed_over = False
        try:
            # before any header goes out: a refusal can still be a 400
            firsts = await asyncio.gather(*(first_event(g) for g in gens), return_exceptions=True)
            for f in firsts:
                if isinstance(f, asyncio.CancelledError):
                    raise f
                if isinstance(f, BaseException):
                    return self._reply(route, first_error(f), rid)
            if req.stream:
                # From here the stream generator owns the cleanup (abort, in-flight count). It is started
                # (primed) before it is handed over, so its ``finally`` runs however it ends: finished,
                # closed by Starlette, cancelled, or collected when the response never started.
                handed_over = True
                stream = self._stream(req, gens, firsts, t0, route)
                head = await stream.__anext__()
                return StreamingResponse(_prepend(head, stream), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await self._collect(req, gens, firsts, t0, route)
        finally:
            if not handed_over:
                _cancel(gens)  # no-op for the finished; aborts the sequences when this request was cancelled
                self._release(n)

    def _too_large(self, req: GenerateRequest) -> Optional[ApiError]:
        """A 400 for a non-streamed request whose answer could exceed what this server's proxy passes
        (actors.serving.app.serve_limits), before anything is computed; None when it cannot."""
        if req.stream or self.answer_limit is None:
            return None
        if self._token_bytes is None:
            self._token_bytes = longest_token(self.tokenizer)
        p = req.params
        bound = answer_bound(req.n, p.max_new_tokens, p.logprobs, self._token_bytes,
                             len(req.echo.encode()) if req.echo else 0)
        if bound <= self.answer_limit:
            return None
        mib = 1024 * 1024
        return api.invalid(f"this answer could take up to {bound / mib:.1f} MiB ({req.n} choice(s) of up to "
                           f"{p.max_new_tokens} tokens" + (f", {p.logprobs} logprobs each" if p.logprobs else "")
                           + f"), more than the {self.answer_limit / mib:g} MiB a non-streamed answer can have "
                           "behind this server's proxy: stream it (\"stream\": true), or ask for fewer choices, "
                           "tokens or logprobs", "stream")

    def _acquire(self, n: int) -> None:
        self.in_flight += n
        self.metrics.in_flight.set(self.in_flight)

    def _release(self, n: int) -> None:
        self.in_flight -= n
        self.metrics.in_flight.set(self.in_flight)

    def _observe(self, req: GenerateRequest, t0: float, last: Optional[float], now: float) -> float:
        if last is None:
            self.metrics.ttft.observe(now - t0, {"request_id": req.request_id})
        else:
            self.metrics.itl.observe(now - last)
        return now

    def _finished(self, req: GenerateRequest, choices: list[ChoiceState], tokens: int, t0: float) -> None:
        """The request's end-to-end latency (its id the exemplar) and its log line."""
        dt = time.perf_counter() - t0
        self.metrics.e2e.observe(dt, {"request_id": req.request_id})
        log.info("request %s: %s, %d prompt + %d generated tokens, %.3f s", req.request_id,
                 "/".join(str(c.finish_reason) for c in choices), req.num_prompt_tokens, tokens, dt)

    def _choices(self, req: GenerateRequest) -> list[ChoiceState]:
        return [ChoiceState(req, i, self.tokenizer, self.strings) for i in range(req.n)]

    async def _collect(self, req: GenerateRequest, gens, firsts, t0: float, route: str):
        choices, last = self._choices(req), [None] * req.n
        try:
            async for i, ev in merge_events(gens, firsts, self._draining):
                if ev.token_ids:
                    last[i] = self._observe(req, t0, last[i], time.perf_counter())
                choices[i].add(ev)
        except asyncio.CancelledError:  # the client went away; the caller's finally aborts the sequences
            self.metrics.finished.labels(reason="abort").inc(sum(not c.done for c in choices))
            raise
        except ShuttingDown:
            return self._reply(route, shutdown_error(), req.request_id)
        except Exception as e:  # noqa: BLE001
            return self._reply(route, engine_failed(app_error(e)), req.request_id)
        tokens = sum(c.tokens for c in choices)
        self._finished(req, choices, tokens, t0)
        self.metrics.generation_tokens.inc(tokens)
        for c in choices:
            self.metrics.finished.labels(reason=c.finish_reason).inc()
        self._done(route, 200)
        return resp.choices_response(req, [c.result() for c in choices], tokens)

    async def _stream(self, req: GenerateRequest, gens, firsts, t0: float, route: str) -> AsyncIterator[str]:
        choices, last = self._choices(req), [None] * req.n
        created = int(time.time())
        tokens, complete = 0, False
        try:
            for c in choices:  # the chat role, or a completion's echo
                head = c.opening(created)
                if head is not None:
                    yield resp.sse(head)
            try:
                async for i, ev in merge_events(gens, firsts, self._draining):
                    if ev.token_ids:
                        last[i] = self._observe(req, t0, last[i], time.perf_counter())
                        tokens += len(ev.token_ids)
                        self.metrics.generation_tokens.inc(len(ev.token_ids))
                    chunk = choices[i].chunk(ev, created, tokens)  # the finish reason rides on the last text
                    if chunk is not None:
                        yield resp.sse(chunk)
                    if ev.finish_reason is not None:
                        self.metrics.finished.labels(reason=ev.finish_reason).inc()
                if req.include_usage:
                    yield resp.sse(resp.usage_chunk(req, created, tokens))
                self._finished(req, choices, tokens, t0)
            except ShuttingDown:  # headers are out: say so in the stream, and stop generating for it
                _cancel(gens)
                log.info("request %s: ended by the shutdown", req.request_id)
                yield resp.sse(shutdown_error().body())
            except Exception as e:  # noqa: BLE001 - headers are out: report in the stream
                _cancel(gens)
                err = engine_failed(app_error(e))
                log.warning("request %s: %d %s", req.request_id, err.status, err.message)
                yield resp.sse(err.body())
            yield resp.DONE_LINE
            complete = True
        finally:
            if not complete:  # the client went away: stop generating for it
                _cancel(gens)
                self.metrics.finished.labels(reason="abort").inc(sum(not c.done for c in choices))
            self._done(route, 200)
            self._release(req.n)
