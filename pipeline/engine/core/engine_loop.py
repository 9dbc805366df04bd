"""The engine's step loop on a thread of its own, fed through a command queue (used by the engine
deployment): requests (new, or prefilled elsewhere and handed over), aborts, and per-request sinks that
receive the request's :class:`~pipeline.engine.protocol.EngineOutput` s."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pipeline.engine.cache.blocks import OutOfBlocks
from pipeline.engine.core.kv_handoff import KVHandoff
from pipeline.engine.protocol import (ABORT, ERROR, EngineDead, EngineOutput, EngineRequest, ReplicaBroken,
                                      RequestFailed, StepFailed)

log = logging.getLogger("dsquant.engine")
# A step that raises fails the requests in it; this many in a row means the engine itself is broken.
MAX_FAILED_STEPS = 3

Sink = Callable[[Union[EngineOutput, BaseException]], None]


# ----- the commands (from any thread, applied by the loop between steps) --------------------------------

@dataclass(frozen=True)
class Add:
    request: EngineRequest
    sink: Sink


@dataclass(frozen=True)
class AddPrefilled:
    """A request another engine prefilled (its KVHandoff), decoded here."""

    request: EngineRequest
    kv: KVHandoff
    sink: Sink


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes the loop (to see that it must stop)."""


Command = Union[Add, AddPrefilled, Abort, Wake]


class EngineLoop:
    """An engine (LLMEngine or DPEngine: add, abort, step, stats) driven by its own thread. :meth:`submit`,
    :meth:`submit_prefilled` and :meth:`abort` may be called from any thread; they only enqueue commands,
    which the loop applies between steps, so the engine is touched by one thread only. Each request's
    outputs go to its sink (called on the loop thread); a request the engine refuses gets the ValueError
    instead, a request the engine fails (its sampling, or a step it was in raised) gets
    :class:`RequestFailed` and the loop goes on; only after ``MAX_FAILED_STEPS`` failed steps in a row (or
    a failure outside a step) does every open request get :class:`EngineDead` and the loop stop (health
    checks then fail, and Serve replaces the replica)."""

    def __init__(self, engine, after_step: Optional[Callable[["EngineLoop"], None]] = None):
        """``after_step(loop)``: called on the loop's thread after every iteration (a step, or a wait with
        nothing to do) once its outputs are delivered and the snapshot published, and once more when the
        loop stops on an error (pipeline.engine.core.core_process sends each step's outputs in one message)."""
        self.engine = engine
        self._after_step = after_step
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}     # request_id -> sink, while the engine holds the request
        self._prefilled: list[AddPrefilled] = []  # handed-over requests waiting for cache blocks
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.aborted = 0
        self.failed_steps = 0                 # in a row
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.snapshot: dict = {}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        self._cmds.put(Add(request, sink))

    def submit_prefilled(self, request: EngineRequest, kv: KVHandoff, sink: Sink) -> None:
        """A request another engine prefilled: decoded here from the next step; it waits (in order) while
        the cache has no room for its blocks."""
        self._cmds.put(AddPrefilled(request, kv, sink))

    def abort(self, request_id: str) -> None:
        self._cmds.put(Abort(request_id))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put(Wake())
        self._thread.join(timeout)

    def _admit_prefilled(self) -> None:
        while self._prefilled:
            cmd = self._prefilled[0]
            rid = cmd.request.request_id
            try:
                self._open(cmd.request, cmd.sink)
            except ValueError as e:
                deliver(cmd.sink, e)
                self._prefilled.pop(0)
                continue
            try:
                self.engine.add_prefilled(cmd.request, cmd.kv)
            except OutOfBlocks as e:
                del self._sinks[rid]
                if self.engine.has_work:
                    return  # retried after the next step frees blocks
                deliver(cmd.sink, ValueError(f"the prompt's cache blocks do not fit this engine's cache: {e}"))
            except ValueError as e:
                del self._sinks[rid]
                deliver(cmd.sink, e)
            except Exception as e:  # noqa: BLE001 - a handoff the engine cannot take fails that request only
                del self._sinks[rid]
                deliver(cmd.sink, RequestFailed(f"the engine could not take the prefilled request: "
                                                f"{type(e).__name__}: {e}"))
            self._prefilled.pop(0)

    def _open(self, request: EngineRequest, sink: Sink) -> None:
        if request.request_id in self._sinks:
            raise ValueError(f"request id {request.request_id!r} is already in this engine")
        self._sinks[request.request_id] = sink

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, AddPrefilled):
            self._prefilled.append(cmd)
        elif isinstance(cmd, Add):
            rid = cmd.request.request_id
            try:
                self._open(cmd.request, cmd.sink)
                self.engine.add(cmd.request)
            except ValueError as e:
                if self._sinks.get(rid) is cmd.sink:
                    del self._sinks[rid]
                deliver(cmd.sink, e)
            except Exception as e:  # noqa: BLE001 - a request the engine cannot take fails alone
                self._sinks.pop(rid, None)
                deliver(cmd.sink, RequestFailed(f"the engine could not take the request: {type(e).__name__}: {e}"))
        elif isinstance(cmd, Abort):
            self._prefilled = [p for p in self._prefilled if p.request.request_id != cmd.request_id]
            if self._sinks.pop(cmd.request_id, None) is not None:
                self.engine.abort(cmd.request_id)
                self.aborted += 1
                self.finished[ABORT] += 1

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
                self._drain(block=not self.engine.has_work and not self._prefilled)
                self._admit_prefilled()
                if self.engine.has_work:
                    self._step()
                self._publish()
                if self._after_step is not None:
                    self._after_step(self)
        except BaseException as e:  # noqa: BLE001 - reported to every open request and to health checks
            self.error = e
            log.error("the engine loop stopped: %s: %s", type(e).__name__, e)
            for sink in self._sinks.values():
                deliver(sink, EngineDead(f"the engine loop stopped: {type(e).__name__}: {e}"))
            self._sinks.clear()
            self._publish()
            if self._after_step is not None:
                self._after_step(self)

    def _step(self) -> None:
        """One engine step, its outputs delivered. A step that raises fails the requests running in it."""
        try:
            outputs = self.engine.step()
        except ReplicaBroken:
            raise                   # a rank of a sharded replica is gone: the loop stops, health fails
        except StepFailed as e:
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            self._deliver(e.outputs)
            return
        self.failed_steps = 0
        self._deliver(outputs)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finish_reason == ERROR:
                deliver(sink, RequestFailed(out.error or "the request failed"))
            else:
                deliver(sink, out)
            if out.finished:
                self.finished[out.finish_reason] = self.finished.get(out.finish_reason, 0) + 1
                del self._sinks[out.request_id]

    def _publish(self) -> None:
        self.snapshot = {**self.engine.stats().to_dict(), "aborted": self.aborted, "finished": dict(self.finished),
                         "alive": self.error is None, "kernels": self.engine.config.kernels.labels()}


def deliver(sink: Sink, item: Any) -> None:
    """Give ``item`` to ``sink``; a sink whose consumer is gone (its event loop closed) is ignored."""
    try:
        sink(item)
    except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
        pass


def deliver_all(pairs) -> None:
    """Give each ``(sink, item)`` of one step its item. Sinks bound to an event loop (a ``loop`` attribute
    and an in-loop ``put(item)``, as actors.serving.engine.llm_server.LoopSink) get theirs in ONE call per loop (one
    wake-up of the loop per step, not per request); the others are called one by one."""
    by_loop: dict = {}
    for sink, item in pairs:
        loop = getattr(sink, "loop", None)
        if loop is None:
            deliver(sink, item)
        else:
            by_loop.setdefault(loop, []).append((sink.put, item))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_each, puts)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            pass


def _put_each(puts) -> None:
    for put, item in puts:
        put(item)
