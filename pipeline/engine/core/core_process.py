"""The engine core in a process of its own (vLLM v1's EngineCore split): the serving replica keeps only
HTTP and streaming, the engine steps in a child process that shares no interpreter lock with it.

The child (``spawn``: no thread or lock of the parent's is inherited) builds the engine with a picklable
``factory()``, drives it with an :class:`~pipeline.engine.core.engine_loop.EngineLoop`, and after every step
sends ONE message back (:class:`StepMessage`): that step's outputs of every request (an EngineOutput, or the
exception that ended it) and the loop's snapshot. The parent's :class:`EngineCoreClient` has the EngineLoop's
interface (``submit``, ``submit_prefilled``, ``abort``, ``stop``, ``alive``, ``error``, ``snapshot``), so the
serving code does not care where the engine runs. Commands go down one pipe, messages come up another; both
are the dataclasses below, pickled (protocol 5; a KV handoff's tensors are copied by value, no shared-memory
handles), requests named by their request id on both sides.

A child that dies (killed, out of memory) ends every open request with :class:`EngineDead` and the client
reports itself dead (health checks fail; Serve replaces the replica). A parent that goes away closes the
command pipe, and the child stops at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pipeline.engine.core.engine_loop import Sink, deliver, deliver_all
from pipeline.engine.core.kv_handoff import KVHandoff
from pipeline.engine.protocol import EngineDead, EngineOutput, EngineRequest

START_TIMEOUT_S = 600.0      # building the engine (loading the checkpoint) may take this long


# ----- parent -> child ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Submit:
    request: EngineRequest


@dataclass(frozen=True)
class SubmitPrefilled:
    request: EngineRequest
    kv: KVHandoff


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Stop:
    pass


# ----- child -> parent ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    info: dict          # the pid and what ``info(engine)`` gave
    snapshot: dict      # the loop's first snapshot: alive from the start


@dataclass(frozen=True)
class BuildFailed:
    traceback: str


@dataclass(frozen=True)
class Delivery:
    """What a request's sink gets: an output, or the exception that ends the request."""

    request_id: str
    item: Union[EngineOutput, BaseException]


@dataclass(frozen=True)
class StepMessage:
    deliveries: list[Delivery]
    snapshot: dict


def _send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=5))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _core_main(cmd_conn, evt_conn, factory: Callable[[], Any], info: Optional[Callable[[Any], dict]]) -> None:
    """The child: build the engine, report ready (or the error), then relay commands until told to stop or
    until the parent closes the pipe."""
    from pipeline.engine.core.engine_loop import EngineLoop

    try:
        engine = factory()
        ready = {"pid": os.getpid(), **(info(engine) if info else {})}
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        _send(evt_conn, BuildFailed(traceback.format_exc()))
        return
    outbox: list[Delivery] = []
    lock = threading.Lock()

    def sink_for(request_id: str) -> Sink:
        def sink(item) -> None:
            with lock:
                outbox.append(Delivery(request_id, item))
        return sink

    def flush(loop) -> None:                # on the loop's thread, after each step: one message
        with lock:
            deliveries = outbox[:]
            outbox.clear()
        _send(evt_conn, StepMessage(deliveries, loop.snapshot))

    loop = EngineLoop(engine, after_step=flush)
    _send(evt_conn, Ready(ready, dict(loop.snapshot)))
    try:
        while True:
            try:
                cmd = _recv(cmd_conn)
            except (EOFError, OSError):
                return                      # the parent is gone
            if isinstance(cmd, Submit):
                loop.submit(cmd.request, sink_for(cmd.request.request_id))
            elif isinstance(cmd, SubmitPrefilled):
                loop.submit_prefilled(cmd.request, cmd.kv, sink_for(cmd.request.request_id))
            elif isinstance(cmd, AbortRequest):
                loop.abort(cmd.request_id)
            elif isinstance(cmd, Stop):
                return
    finally:
        loop.stop()


def _terminal(item) -> bool:
    return isinstance(item, BaseException) or (isinstance(item, EngineOutput) and item.finished)


class EngineCoreClient:
    """The parent's side. ``factory``: a picklable callable that builds the engine in the child (e.g. a
    module-level function with ``functools.partial``); ``info``: a picklable callable of the engine whose
    dict comes back in :attr:`ready` (what the parent needs to know about the engine, e.g. its
    ``max_model_len`` and KV layout). Raises RuntimeError with the child's traceback if the engine cannot
    be built."""

    def __init__(self, factory: Callable[[], Any], info: Optional[Callable[[Any], dict]] = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._evt, evt_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_core_main, args=(cmd_r, evt_w, factory, info), daemon=True,
                                name="llm-engine-core")
        self.proc.start()
        cmd_r.close()
        evt_w.close()
        self._sinks: dict[str, Sink] = {}     # request_id -> sink, while the request is open
        self._sinks_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self.snapshot: dict = {}
        if not self._evt.poll(start_timeout_s):
            self._kill()
            raise RuntimeError(f"the engine core process did not start within {start_timeout_s:.0f} s")
        try:
            msg = _recv(self._evt)
        except (EOFError, OSError):
            self.proc.join(5)
            raise RuntimeError(f"the engine core process exited while starting (exit code "
                               f"{self.proc.exitcode})") from None
        if isinstance(msg, BuildFailed):
            self.proc.join(5)
            raise RuntimeError(f"the engine core process could not build the engine:\n{msg.traceback}")
        self.ready: dict = msg.info
        self.snapshot = msg.snapshot    # until the first step's message: health checks answer from this one
        self._reader = threading.Thread(target=self._read, name="llm-engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive()

    @property
    def pid(self) -> int:
        return self.ready["pid"]

    def _command(self, cmd) -> None:
        with self._send_lock:
            _send(self._cmd, cmd)

    def _register(self, request_id: str, sink: Sink) -> bool:
        with self._sinks_lock:
            if self.error is not None:
                deliver(sink, EngineDead(f"the engine core is not running: {self.error}"))
                return False
            if request_id in self._sinks:
                deliver(sink, ValueError(f"request id {request_id!r} is already in this engine"))
                return False
            self._sinks[request_id] = sink
        return True

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        if self._register(request.request_id, sink):
            self._guarded(Submit(request))

    def submit_prefilled(self, request: EngineRequest, kv: KVHandoff, sink: Sink) -> None:
        if self._register(request.request_id, sink):
            self._guarded(SubmitPrefilled(request, kv))

    def abort(self, request_id: str) -> None:
        with self._sinks_lock:
            open_ = self._sinks.pop(request_id, None) is not None
        if open_ and self.error is None:
            self._guarded(AbortRequest(request_id))

    def _guarded(self, cmd) -> None:
        try:
            self._command(cmd)
        except (OSError, ValueError, BrokenPipeError) as e:
            self._die(EngineDead(f"the engine core process is gone ({type(e).__name__}: {e})"))

    def _read(self) -> None:
        while True:
            try:
                msg = _recv(self._evt)
            except (EOFError, OSError):
                break
            if not isinstance(msg, StepMessage):
                continue
            snapshot = self.snapshot = msg.snapshot
            pairs = []
            with self._sinks_lock:
                for d in msg.deliveries:
                    sink = self._sinks.get(d.request_id)
                    if sink is not None:
                        pairs.append((sink, d.item))
                        if _terminal(d.item):
                            del self._sinks[d.request_id]
            deliver_all(pairs)      # one wake-up per event loop for the whole step
            if not snapshot.get("alive", True):
                self._die(EngineDead(f"the engine loop stopped in the engine core process (pid {self.pid})"))
        self.proc.join(1.0)
        self._die(EngineDead(f"the engine core process (pid {self.pid}) exited"
                             + ("" if self.proc.exitcode is None else f" with code {self.proc.exitcode}")))

    def _die(self, err: EngineDead) -> None:
        with self._sinks_lock:
            if self.error is None:
                self.error = err
            sinks = list(self._sinks.values())
            self._sinks.clear()
        snap = dict(self.snapshot)
        snap["alive"] = False
        self.snapshot = snap
        for sink in sinks:
            deliver(sink, err)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.is_alive():
            try:
                self._command(Stop())
            except (OSError, ValueError):
                pass
            self.proc.join(timeout)
        self._kill()

    def _kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for conn in (self._cmd, self._evt):
            try:
                conn.close()
            except OSError:
                pass
