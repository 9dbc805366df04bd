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
import dataclasses
import hmac
import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from pipeline import openai_api as api
from pipeline.engine.engine import EngineConfig
from pipeline.openai_api import ApiError, GenerateRequest, TokenEvent

ADMIN_HEADROOM = 16     # calls beyond max_in_flight a replica accepts: health, metrics, stats, refusals
STATS_TIMEOUT_S = 5.0


# ----- configuration -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeploymentOptions:
    """Replica count and Ray actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``, ...)."""

    num_replicas: int = 1
    ray_actor_options: Mapping[str, Any] = field(default_factory=lambda: {"num_cpus": 1})

    def __post_init__(self):
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if not isinstance(self.ray_actor_options, Mapping):
            raise ValueError(f"ray_actor_options must be a mapping, got {self.ray_actor_options!r}")


DEFAULT_ENGINE = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=16, max_batched_tokens=256, nz=True)


@dataclass(frozen=True)
class ServeConfig:
    """Everything the application needs. ``model_path``: a quantized directory (every replica reads it;
    use an absolute or shared path). ``served_model_name``: the OpenAI model id (default: the directory's
    name). ``engine``: the engine's options. ``api_key``: required bearer token on ``/v1`` (None: open).
    ``max_in_flight``: generation requests per ingress replica before 429. ``torch_threads``: per engine
    replica. ``host``/``port``/``app_name``/``route_prefix``: where ``jobs.serve`` serves it."""

    model_path: str
    served_model_name: Optional[str] = None
    engine: EngineConfig = DEFAULT_ENGINE
    api_key: Optional[str] = None
    max_in_flight: int = 64
    torch_threads: int = 1
    llm: DeploymentOptions = field(default_factory=lambda: DeploymentOptions(1, {"num_cpus": 1}))
    ingress: DeploymentOptions = field(default_factory=lambda: DeploymentOptions(1, {"num_cpus": 0.1}))
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "dsquant"
    route_prefix: str = "/"

    def __post_init__(self):
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a non-empty string, got {self.model_path!r}")
        for f in ("max_in_flight", "torch_threads"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an integer >= 1, got {v!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or null")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path.rstrip("/")).name

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ServeConfig":
        """From plain data (a parsed JSON/YAML file); unknown keys are refused by name."""
        d = dict(d)
        _no_unknown(d, cls, "serve config")
        if isinstance(d.get("engine"), Mapping):
            _no_unknown(d["engine"], EngineConfig, "engine")
            d["engine"] = EngineConfig(**d["engine"])
        for key in ("llm", "ingress"):
            if isinstance(d.get(key), Mapping):
                _no_unknown(d[key], DeploymentOptions, key)
                d[key] = DeploymentOptions(**d[key])
        if "model_path" not in d:
            raise ValueError("serve config: model_path is required")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str) -> "ServeConfig":
        """Read a ``.json``, ``.yaml`` or ``.yml`` file holding :meth:`from_dict`'s mapping."""
        text = Path(path).read_text()
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping of serve options, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _no_unknown(d: Mapping[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")


# ----- the engine loop ---------------------------------------------------------------------------------

class EngineDead(RuntimeError):
    """The engine's step loop stopped on an error; the message carries it."""


Sink = Callable[[Union[TokenEvent, BaseException]], None]


class EngineLoop:
    """An LLMEngine driven by its own thread. :meth:`submit` and :meth:`abort` may be called from any
    thread; they only enqueue commands, which the loop applies between steps, so the engine is touched by
    one thread only. Each request's events go to its sink (called on the loop thread); a request the
    engine refuses gets the ValueError instead, and every open request gets :class:`EngineDead` if the
    loop fails."""

    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._sinks: dict[int, Sink] = {}
        self._seqs: dict[int, Any] = {}       # key -> engine Sequence
        self._key_of: dict[int, int] = {}     # seq_id -> key
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.aborted = 0
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.snapshot: dict = {}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt_ids, params, sink: Sink) -> int:
        key = next(self._keys)
        self._cmds.put(("add", key, list(prompt_ids), params, sink))
        return key

    def abort(self, key: int) -> None:
        self._cmds.put(("abort", key))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, key, prompt_ids, params, sink = cmd
            try:
                seq = self.engine.add_request(prompt_ids, params)
            except ValueError as e:
                _deliver(sink, e)
                return
            self._sinks[key], self._seqs[key], self._key_of[seq.seq_id] = sink, seq, key
        elif cmd[0] == "abort":
            seq = self._seqs.pop(cmd[1], None)
            self._sinks.pop(cmd[1], None)
            if seq is not None:
                self._key_of.pop(seq.seq_id, None)
                if seq.status != "finished":
                    self.engine.abort(seq)
                    self.aborted += 1
                    self.finished["abort"] += 1

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        self._apply(cmd)
        while True:
            try:
                self._apply(self._cmds.get_nowait())
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    for seq, new in self.engine.step():
                        key = self._key_of.get(seq.seq_id)
                        done = seq.status == "finished"
                        if key is None:
                            continue
                        _deliver(self._sinks[key], TokenEvent(tuple(new), seq.finish_reason if done else None))
                        if done:
                            self.finished[seq.finish_reason] = self.finished.get(seq.finish_reason, 0) + 1
                            del self._sinks[key], self._seqs[key], self._key_of[seq.seq_id]
                self._publish()
        except BaseException as e:  # noqa: BLE001 - reported to every open request and to health checks
            self.error = e
            for sink in self._sinks.values():
                _deliver(sink, EngineDead(f"the engine loop stopped: {type(e).__name__}: {e}"))
            self._sinks.clear()
            self._publish()

    def _publish(self) -> None:
        eng = self.engine
        free, total = eng.allocator.num_free, eng.config.num_blocks
        self.snapshot = {
            "running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
            "cache_blocks_total": total, "cache_blocks_free": free, "cache_blocks_used": total - free,
            "steps": eng.stats.steps, "prompt_tokens": eng.stats.prompt_tokens,
            "generated_tokens": eng.stats.generated_tokens, "preemptions": eng.stats.preemptions,
            "mtp_drafts": eng.stats.drafts, "mtp_accepted": eng.stats.accepted,
            "aborted": self.aborted, "finished": dict(self.finished), "alive": self.error is None,
        }


def _deliver(sink: Sink, item) -> None:
    try:
        sink(item)
    except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
        pass


# ----- the engine deployment ---------------------------------------------------------------------------

@serve.deployment(name="LLMServer")
class LLMServer:
    """One engine replica. Interface (all async, through a DeploymentHandle):
    ``generate(GenerateRequest)`` (stream=True) -> TokenEvent*; ``info()`` -> dict with ``max_model_len``,
    ``num_blocks``, ``block_size``, ``model``; ``stats()`` -> the loop's snapshot; ``check_health()``."""

    def __init__(self, config: ServeConfig):
        import torch

        from pipeline.engine.engine import LLMEngine
        from pipeline.tokenizer import Tokenizer

        torch.set_num_threads(config.torch_threads)
        self.config = config
        tok = Tokenizer.from_dir(config.model_path)
        engine = LLMEngine(_load(config), config.engine, tok)
        self.max_model_len = engine.scheduler.max_model_len
        self.loop = EngineLoop(engine)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Token events for the request until one carries a finish reason. Raises the engine's ValueError
        for a request it refuses. Cancelled or closed early: the sequence is aborted (blocks freed)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        key = self.loop.submit(request.prompt_ids, request.params,
                               lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
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
        return dict(self.loop.snapshot)

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


# ----- metrics -----------------------------------------------------------------------------------------

class ServeMetrics:
    """The ingress's Prometheus metrics (its own registry) plus the engine's figures, fetched per scrape."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("dsquant_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("dsquant_prompt_tokens", "prompt tokens of accepted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("dsquant_generation_tokens", "tokens generated and sent",
                                         registry=self.registry)
        self.finished = Counter("dsquant_requests_finished", "generation requests by finish reason",
                                ["reason"], registry=self.registry)
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("dsquant_time_to_first_token_seconds", "time from request to first token",
                              buckets=lat, registry=self.registry)
        self.itl = Histogram("dsquant_inter_token_latency_seconds", "gap between consecutive token events",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                             registry=self.registry)
        self.e2e = Histogram("dsquant_e2e_request_latency_seconds", "time from request to last token",
                             buckets=lat, registry=self.registry)
        self.in_flight = Gauge("dsquant_requests_in_flight", "generation requests in flight on this ingress",
                               registry=self.registry)
        self.engine: dict = {}
        self.registry.register(_EngineCollector(self))

    def render(self, engine_stats: Optional[dict]) -> bytes:
        from prometheus_client import generate_latest

        self.engine = engine_stats or {}
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine replica's snapshot as gauges and counters."""

    GAUGES = {"running": "sequences running in the engine", "waiting": "sequences waiting in the engine",
              "cache_blocks_used": "KV cache blocks in use", "cache_blocks_free": "KV cache blocks free",
              "cache_blocks_total": "KV cache blocks in all"}
    COUNTERS = {"aborted": "sequences aborted (client gone)", "preemptions": "sequences preempted",
                "steps": "engine steps", "mtp_drafts": "MTP draft tokens proposed",
                "mtp_accepted": "MTP draft tokens accepted"}

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.metrics.engine
        yield GaugeMetricFamily("dsquant_engine_up", "1 when the engine answered this scrape and its loop runs",
                                value=1.0 if s.get("alive") else 0.0)
        for k, doc in self.GAUGES.items():
            if k in s:
                yield GaugeMetricFamily(f"dsquant_engine_{k}", doc, value=float(s[k]))
        for k, doc in self.COUNTERS.items():
            if k in s:
                yield CounterMetricFamily(f"dsquant_engine_{k}", doc, value=float(s[k]))


# ----- the ingress -------------------------------------------------------------------------------------

openai_app = FastAPI(title="dsquant OpenAI-compatible API")


def _error(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _cause(err: BaseException) -> BaseException:
    """The application exception inside a Ray task error."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


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
        return api.models_response(self.model, info["max_model_len"], self.created)

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
        detok = api.IncrementalDetokenizer(self.tokenizer, req.params.stop)
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
        return api.response(req, detok.text, reason, n)

    async def _stream(self, req: GenerateRequest, gen, first: TokenEvent, t0: float, route: str) -> AsyncIterator[str]:
        detok = api.IncrementalDetokenizer(self.tokenizer, req.params.stop)
        created = int(time.time())
        last, n, complete = None, 0, False
        try:
            if req.kind == api.CHAT:
                yield api.sse(api.stream_chunk(req, created, "", first=True))
            try:
                async for ev in self._events(gen, first):
                    if ev.token_ids:
                        last = self._observe(t0, last, time.perf_counter())
                        n += len(ev.token_ids)
                        self.metrics.generation_tokens.inc(len(ev.token_ids))
                        text = detok.add(ev.token_ids)
                        if text:
                            yield api.sse(api.stream_chunk(req, created, text))
                    if ev.finish_reason is not None:
                        tail = detok.finish()
                        if tail:
                            yield api.sse(api.stream_chunk(req, created, tail))
                        yield api.sse(api.stream_chunk(req, created, None, ev.finish_reason))
                        if req.include_usage:
                            yield api.sse(api.usage_chunk(req, created, n))
                        self.metrics.finished.labels(reason=ev.finish_reason).inc()
                        self.metrics.e2e.observe(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - headers are out: report in the stream
                cause = _cause(e)
                yield api.sse(ApiError(500, f"the engine failed: {type(cause).__name__}: {cause}",
                                       "server_error").body())
            yield api.DONE_LINE
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
    llm = LLMServer.options(
        num_replicas=config.llm.num_replicas, ray_actor_options=dict(config.llm.ray_actor_options),
        max_ongoing_requests=in_flight + ADMIN_HEADROOM,
    ).bind(config)
    return OpenAIIngress.options(
        num_replicas=config.ingress.num_replicas, ray_actor_options=dict(config.ingress.ray_actor_options),
        max_ongoing_requests=config.max_in_flight + ADMIN_HEADROOM,
        max_queued_requests=config.max_in_flight,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
    ).bind(llm, config)
