"""The engine side of the serving application: :class:`LLMServer` owns one
:class:`~pipeline.engine.core.engine.LLMEngine` and streams each
:class:`~pipeline.engine.protocol.EngineRequest`'s :class:`~pipeline.engine.protocol.EngineOutput` s.

By default the engine steps in a child process of its own (:class:`~pipeline.engine.core.core_process.EngineCoreClient`,
vLLM v1's EngineCore split: no interpreter lock shared with HTTP and streaming, one message per step), a
sharded replica (or ``engine_process: false``) on a background thread (:class:`EngineLoop`).

The same class serves in two places (actors/serving/app/serve_app.py picks): as the ``LLMServer`` deployment behind
the ingress (its :meth:`LLMServer.generate` is an async generator called through
``handle.options(stream=True)``), or inside each ingress replica (``engine_in_ingress``: the ingress reads
:class:`EngineStream` s directly, no Ray hop per token). Either way a stream the caller stops reading (a
client went away) aborts its sequence and frees its cache blocks. ``info()``, ``stats()`` and
``check_health()`` complete it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from functools import partial
from typing import AsyncIterator, Optional

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.serving.engine.engine_replica import make_engine
from actors.cluster.ray_errors import app_error
from actors.serving.serve_config import ServeConfig
from pipeline.engine.core.engine_loop import EngineLoop
from pipeline.engine.protocol import EngineDead, EngineOutput, EngineRequest, PrefillFailed

log = logging.getLogger(__name__)
PREFILL_FAILURES_UNHEALTHY = 3  # prefills failed in a row (disaggregated): /health says so until one succeeds


def build_engine(config: ServeConfig, deployment: str, own_process: bool = False):
    """The engine of one replica of ``deployment``, built where it will step (this process or the engine
    core's child process: module level, so it pickles). ``own_process``: the engine core's child, which is
    then pinned to its CPUs (``config.engine_cpus``) before the engine and its thread start."""
    import torch

    from pipeline.engine import cpu_pinning
    from pipeline.text.tokenizer import Tokenizer

    torch.set_num_threads(config.torch_threads)
    if own_process:
        cpus = cpu_pinning.pin(config.engine_cpus, config.torch_threads)
        if cpus:
            log.info("engine core (pid %d) pinned to CPU(s) %s", os.getpid(), cpus)
    return make_engine(config, deployment, Tokenizer.from_dir(config.model_path))


def engine_info(engine) -> dict:
    """What the replica needs to know about its engine, wherever the engine runs."""
    return {"max_model_len": engine.max_model_len, "layout": engine.kv_layout()}


class LoopSink:
    """A request's event sink bound to the asyncio loop that reads it: called from the engine's thread
    (``sink(ev)``: one wake-up of the loop per event), or, by a deliverer that has a whole step's events,
    grouped by :attr:`loop` and put in one call on that loop (:func:`pipeline.engine.core.engine_loop.deliver_all`)."""

    __slots__ = ("loop", "put")

    def __init__(self, loop: asyncio.AbstractEventLoop, put):
        self.loop, self.put = loop, put

    def __call__(self, ev) -> None:
        self.loop.call_soon_threadsafe(self.put, ev)


class EngineStream:
    """One request's outputs, read on the event loop that made it: ``await stream.__anext__()`` gives the
    next :class:`EngineOutput` (StopAsyncIteration after the one with a finish reason), raises what the
    engine raised for it (its ValueError for a request it refuses, EngineDead, RequestFailed, PrefillFailed).
    :meth:`cancel` (any time, idempotent) aborts the sequence unless it has finished. In the disaggregated
    mode the first read waits for the prefill deployment (its first token is the first event), then the
    handed-over blocks are decoded here."""

    __slots__ = ("_server", "_request", "_submitted", "_queue", "_waiter", "_finished", "_cancelled", "_started")

    def __init__(self, server: "LLMServer", request: EngineRequest):
        self._server, self._request = server, request
        self._submitted = False
        self._queue: collections.deque = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._finished = self._cancelled = self._started = False

    def _put(self, ev) -> None:             # on the reading loop
        self._queue.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _sink(self) -> LoopSink:
        return LoopSink(asyncio.get_running_loop(), self._put)

    async def _start(self) -> Optional[EngineOutput]:
        self._started = True
        server, request = self._server, self._request
        if server.prefill is None:
            server.loop.submit(request, self._sink())
            self._submitted = True
            return None
        try:
            kv = await server._prefilled(request)
        except BaseException:
            self._finished = True
            raise
        first = EngineOutput(request.request_id, () if kv.first_token is None else (kv.first_token,),
                             kv.finish_reason, kv.first_logprobs, kv.first_text)
        if kv.finish_reason is not None or self._cancelled:
            self._finished = kv.finish_reason is not None
            return first
        server.loop.submit_prefilled(request, kv, self._sink())
        self._submitted = True
        return first

    def __aiter__(self):
        return self

    async def __anext__(self) -> EngineOutput:
        if self._finished or self._cancelled:
            raise StopAsyncIteration
        if not self._started:
            first = await self._start()
            if first is not None:
                return first
        while not self._queue:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        ev = self._queue.popleft()
        if isinstance(ev, BaseException):
            self._finished = True
            raise ev
        if ev.finish_reason is not None:
            self._finished = True
        return ev

    def cancel(self) -> None:
        """Stop: the sequence is aborted (its blocks freed) unless it finished."""
        if self._cancelled or self._finished:
            return
        self._cancelled = True
        if self._submitted:
            self._server.loop.abort(self._request.request_id)


@serve.deployment(name="LLMServer")
class LLMServer:
    """One engine replica. Interface (all async, through a DeploymentHandle, or called in the ingress's
    process): ``generate(EngineRequest)`` (stream=True) -> EngineOutput*, or :meth:`stream` -> an
    :class:`EngineStream`; ``info()`` -> dict with ``max_model_len``, ``num_blocks``, ``block_size``,
    ``model``; ``stats()`` -> the loop's snapshot; ``check_health()``."""

    def __init__(self, config: ServeConfig, prefill: Optional[DeploymentHandle] = None):
        self.config, self.prefill = config, prefill
        self.handoffs, self.handoff_bytes, self.prefill_failures = 0, 0, 0
        self.prefill_failing: Optional[str] = None  # the last error, once PREFILL_FAILURES_UNHEALTHY in a row
        self._failures_in_row = 0
        if config.engine_process and config.parallel_of("llm").single:
            from pipeline.engine.core.core_process import EngineCoreClient

            self.loop = EngineCoreClient(partial(build_engine, config, "llm", True), engine_info)
            info = self.loop.ready
        else:
            engine = build_engine(config, "llm")
            info = engine_info(engine)
            self.loop = EngineLoop(engine)
        self.max_model_len, self.layout = info["max_model_len"], info["layout"]

    async def _prefilled(self, request: EngineRequest):
        """Ask the prefill deployment for the prompt's first token and cache blocks (disaggregated mode)."""
        try:
            kv = await asyncio.wait_for(self.prefill.prefill.remote(request), self.config.prefill_timeout_s)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - unavailable, timed out, failed: this request only
            cause = app_error(e)
            if isinstance(cause, ValueError):
                raise cause from None
            self.prefill_failures += 1
            self._failures_in_row += 1
            why = f"prefill failed: {type(cause).__name__}: {cause}"
            log.warning("request %s: %s", request.request_id, why)
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

    def stream(self, request: EngineRequest) -> EngineStream:
        """The request's event stream, read on the calling event loop (nothing is submitted before the
        first read)."""
        return EngineStream(self, request)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's outputs until one carries a finish reason (an :class:`EngineStream` as an
        async generator, for a streaming DeploymentHandle call). Closed early: the sequence is aborted."""
        stream = EngineStream(self, request)
        try:
            async for ev in stream:
                yield ev
        finally:
            stream.cancel()

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

    def close(self) -> None:
        """Stop the engine (its child process, or its loop thread and, sharded, its other ranks)."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=1.0)
            engine = getattr(loop, "engine", None)
            close = getattr(engine.runner, "close", None) if engine is not None else None
            if close is not None:   # a sharded replica: stop its other ranks
                close()

    def __del__(self):
        self.close()
