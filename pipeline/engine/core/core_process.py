"""The engine core in a process of its own (vLLM v1's EngineCore split): the serving replica keeps only
HTTP and streaming, the engine steps in a child process that shares no interpreter lock with it.

The child (``spawn``: no thread or lock of the parent's is inherited) builds the engine with a picklable
``factory()``, drives it with an :class:`~pipeline.engine.core.engine_loop.EngineLoop`, and after every step
sends ONE message back: that step's events of every request (``(key, TokenEvent | exception)`` pairs) and
the loop's snapshot. The parent's :class:`EngineCoreClient` has the EngineLoop's interface
(``submit``, ``submit_prefilled``, ``abort``, ``stop``, ``alive``, ``error``, ``snapshot``), so the serving
code does not care where the engine runs. Commands go down one pipe, events come up another; messages are
plain pickles (protocol 5; a KV handoff's tensors are copied by value, no shared-memory handles).

A child that dies (killed, out of memory) ends every open request with :class:`EngineDead` and the client
reports itself dead (health checks fail; Serve replaces the replica). A parent that goes away closes the
command pipe, and the child stops at once.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import pickle
import threading
import traceback
from typing import Any, Callable, Optional

from pipeline.engine.core.engine_loop import EngineDead, Sink, TokenEvent, deliver, deliver_all

START_TIMEOUT_S = 600.0      # building the engine (loading the checkpoint) may take this long


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
        _send(evt_conn, ("failed", traceback.format_exc()))
        return
    outbox: list = []
    lock = threading.Lock()
    child_key: dict[int, int] = {}          # the parent's key -> the loop's

    def sink_for(key: int) -> Sink:
        def sink(ev) -> None:
            with lock:
                outbox.append((key, ev))
                if _terminal(ev):
                    child_key.pop(key, None)
        return sink

    def flush(loop) -> None:                # on the loop's thread, after each step: one message
        with lock:
            events = outbox[:]
            outbox.clear()
        _send(evt_conn, ("step", events, loop.snapshot))

    loop = EngineLoop(engine, after_step=flush)
    _send(evt_conn, ("ready", ready, dict(loop.snapshot)))    # the loop's first snapshot: alive from the start
    try:
        while True:
            try:
                cmd = _recv(cmd_conn)
            except (EOFError, OSError):
                return                      # the parent is gone
            op = cmd[0]
            with lock:                       # (a sink cannot see the key before it is recorded)
                if op == "add":
                    _, key, prompt_ids, params = cmd
                    child_key[key] = loop.submit(prompt_ids, params, sink_for(key))
                elif op == "prefilled":
                    _, key, kv, params = cmd
                    child_key[key] = loop.submit_prefilled(kv, params, sink_for(key))
                elif op == "abort":
                    ck = child_key.pop(cmd[1], None)
                    if ck is not None:
                        loop.abort(ck)
            if op == "stop":
                return
    finally:
        loop.stop()


def _terminal(ev) -> bool:
    return isinstance(ev, BaseException) or (isinstance(ev, TokenEvent) and ev.finish_reason is not None)


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
        self._keys = itertools.count()
        self._sinks: dict[int, Sink] = {}
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
        if msg[0] == "failed":
            self.proc.join(5)
            raise RuntimeError(f"the engine core process could not build the engine:\n{msg[1]}")
        self.ready: dict = msg[1]
        self.snapshot = msg[2]     # until the first step's message: health checks answer from this one
        self._reader = threading.Thread(target=self._read, name="llm-engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive()

    @property
    def pid(self) -> int:
        return self.ready["pid"]

    def _command(self, *cmd) -> None:
        with self._send_lock:
            _send(self._cmd, cmd)

    def _register(self, sink: Sink) -> int:
        key = next(self._keys)
        with self._sinks_lock:
            if self.error is not None:
                deliver(sink, EngineDead(f"the engine core is not running: {self.error}"))
                return key
            self._sinks[key] = sink
        return key

    def submit(self, prompt_ids, params, sink: Sink) -> int:
        key = self._register(sink)
        if key in self._sinks:
            self._guarded(("add", key, list(prompt_ids), params))
        return key

    def submit_prefilled(self, kv, params, sink: Sink) -> int:
        key = self._register(sink)
        if key in self._sinks:
            self._guarded(("prefilled", key, kv, params))
        return key

    def abort(self, key: int) -> None:
        with self._sinks_lock:
            open_ = self._sinks.pop(key, None) is not None
        if open_ and self.error is None:
            self._guarded(("abort", key))

    def _guarded(self, cmd: tuple) -> None:
        try:
            self._command(*cmd)
        except (OSError, ValueError, BrokenPipeError) as e:
            self._die(EngineDead(f"the engine core process is gone ({type(e).__name__}: {e})"))

    def _read(self) -> None:
        while True:
            try:
                msg = _recv(self._evt)
            except (EOFError, OSError):
                break
            if msg[0] != "step":
                continue
            _, events, snapshot = msg
            self.snapshot = snapshot
            pairs = []
            with self._sinks_lock:
                for key, ev in events:
                    sink = self._sinks.get(key)
                    if sink is not None:
                        pairs.append((sink, ev))
                        if _terminal(ev):
                            del self._sinks[key]
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
                self._command("stop")
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
