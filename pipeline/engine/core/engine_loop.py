"""The engine's step loop on a thread of its own, fed through a command queue (used by the engine
deployment): requests (new, or prefilled elsewhere and handed over), aborts, and per-request event sinks."""

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pipeline.engine.cache.blocks import OutOfBlocks
from pipeline.engine.sharding.dist_runner import ReplicaBroken
from pipeline.engine.core.kv_handoff import latest_logprobs
from pipeline.engine.worker.kernels import chosen


@dataclass(frozen=True)
class TokenEvent:
    """What the engine side yields for a request: the tokens produced since the last event (possibly
    none), and ``finish_reason`` ("stop", "length" or "abort") on the last event only. ``logprobs``: when
    the request asks for them (SamplingParams.logprobs), one ``sampling.TokenLogprobs`` per token of
    ``token_ids``, in order; else None."""

    token_ids: tuple[int, ...] = ()
    finish_reason: Optional[str] = None
    logprobs: Optional[tuple] = None


class PrefillFailed(RuntimeError):
    """The prefill side could not prefill a request (unavailable, timed out, failed); that request only."""


class EngineDead(RuntimeError):
    """The engine's step loop stopped on an error; the message carries it."""


class RequestFailed(RuntimeError):
    """The engine failed this request (its sampling, or a step it was in); the others go on."""


# A step that raises fails the requests in it; this many in a row means the engine itself is broken.
MAX_FAILED_STEPS = 3


Sink = Callable[[Union[TokenEvent, BaseException]], None]


class EngineLoop:
    """An LLMEngine driven by its own thread. :meth:`submit` and :meth:`abort` may be called from any
    thread; they only enqueue commands, which the loop applies between steps, so the engine is touched by
    one thread only. Each request's events go to its sink (called on the loop thread); a request the
    engine refuses gets the ValueError instead, a request the engine fails (its sampling, or a step it
    was in raised) gets :class:`RequestFailed` and the loop goes on; only after ``MAX_FAILED_STEPS``
    failed steps in a row (or a failure outside a step) does every open request get :class:`EngineDead`
    and the loop stop (health checks then fail, and Serve replaces the replica)."""

    def __init__(self, engine, after_step: Optional[Callable[["EngineLoop"], None]] = None):
        """``after_step(loop)``: called on the loop's thread after every iteration (a step, or a wait with
        nothing to do) once its events are delivered and the snapshot published, and once more when the
        loop stops on an error (pipeline.engine.core.core_process sends each step's events in one message)."""
        self.engine = engine
        self._after_step = after_step
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._sinks: dict[int, Sink] = {}
        self._seqs: dict[int, Any] = {}       # key -> engine Sequence
        self._key_of: dict[int, int] = {}     # seq_id -> key
        self._prefilled: list[tuple] = []     # handed-over requests waiting for cache blocks
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

    def submit(self, prompt_ids, params, sink: Sink) -> int:
        key = next(self._keys)
        self._cmds.put(("add", key, list(prompt_ids), params, sink))
        return key

    def submit_prefilled(self, kv, params, sink: Sink) -> int:
        """A request another engine prefilled (a KVHandoff): decoded here from the next step; it waits
        (in order) while the cache has no room for its blocks."""
        key = next(self._keys)
        self._cmds.put(("prefilled", key, kv, params, sink))
        return key

    def abort(self, key: int) -> None:
        self._cmds.put(("abort", key))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    def _admit_prefilled(self) -> None:
        while self._prefilled:
            key, kv, params, sink = self._prefilled[0]
            try:
                seq = self.engine.add_prefilled(kv, params)
            except OutOfBlocks as e:
                if self.engine.has_work:
                    return  # retried after the next step frees blocks
                deliver(sink, ValueError(f"the prompt's cache blocks do not fit this engine's cache: {e}"))
            except ValueError as e:
                deliver(sink, e)
            except Exception as e:  # noqa: BLE001 - a handoff the engine cannot take fails that request only
                deliver(sink, RequestFailed(f"the engine could not take the prefilled request: "
                                             f"{type(e).__name__}: {e}"))
            else:
                self._register(key, seq, sink)
            self._prefilled.pop(0)

    def _register(self, key: int, seq, sink: Sink) -> None:
        self._sinks[key], self._seqs[key], self._key_of[seq.seq_id] = sink, seq, key

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "prefilled":
            _, key, kv, params, sink = cmd
            self._prefilled.append((key, kv, params, sink))
        elif cmd[0] == "add":
            _, key, prompt_ids, params, sink = cmd
            try:
                seq = self.engine.add_request(prompt_ids, params)
            except ValueError as e:
                deliver(sink, e)
                return
            except Exception as e:  # noqa: BLE001 - a request the engine cannot take fails alone
                deliver(sink, RequestFailed(f"the engine could not take the request: {type(e).__name__}: {e}"))
                return
            self._register(key, seq, sink)
        elif cmd[0] == "abort":
            self._prefilled = [p for p in self._prefilled if p[0] != cmd[1]]
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
                self._drain(block=not self.engine.has_work and not self._prefilled)
                self._admit_prefilled()
                if self.engine.has_work:
                    self._step()
                self._publish()
                if self._after_step is not None:
                    self._after_step(self)
        except BaseException as e:  # noqa: BLE001 - reported to every open request and to health checks
            self.error = e
            for sink in self._sinks.values():
                deliver(sink, EngineDead(f"the engine loop stopped: {type(e).__name__}: {e}"))
            self._sinks.clear()
            self._publish()
            if self._after_step is not None:
                self._after_step(self)

    def _step(self) -> None:
        """One engine step, its events delivered. A step that raises fails the requests running in it."""
        try:
            events = self.engine.step()
        except ReplicaBroken:
            raise                   # a rank of a sharded replica is gone: the loop stops, health fails
        except Exception as e:  # noqa: BLE001 - fail the requests in this step, keep serving the rest
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            self._fail_running(f"an engine step failed: {type(e).__name__}: {e}")
            return
        self.failed_steps = 0
        for seq, new in events:
            key = self._key_of.get(seq.seq_id)
            done = seq.status == "finished"
            if key is None:
                if done:
                    self.engine.pop_error(seq)
                continue
            if done and seq.finish_reason == "error":
                deliver(self._sinks[key], RequestFailed(self.engine.pop_error(seq) or "the request failed"))
            else:
                lps = latest_logprobs(self.engine, seq) if new and seq.params.logprobs is not None else None
                deliver(self._sinks[key], TokenEvent(tuple(new), seq.finish_reason if done else None, lps))
            if done:
                self.finished[seq.finish_reason] = self.finished.get(seq.finish_reason, 0) + 1
                del self._sinks[key], self._seqs[key], self._key_of[seq.seq_id]

    def _fail_running(self, why: str) -> None:
        for seq in list(self.engine.scheduler.running):
            self.engine.abort(seq)
            key = self._key_of.pop(seq.seq_id, None)
            if key is not None:
                self._seqs.pop(key, None)
                deliver(self._sinks.pop(key), RequestFailed(why))
                self.finished["error"] = self.finished.get("error", 0) + 1

    def _publish(self) -> None:
        eng = self.engine
        free, total = eng.allocator.num_free, eng.config.num_blocks
        self.snapshot = {
            "running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
            "cache_blocks_total": total, "cache_blocks_free": free, "cache_blocks_used": total - free,
            "steps": eng.stats.steps, "prompt_tokens": eng.stats.prompt_tokens,
            "generated_tokens": eng.stats.generated_tokens, "preemptions": eng.stats.preemptions,
            "mtp_drafts": eng.stats.drafts, "mtp_accepted": eng.stats.accepted,
            "prefix_cache_queries": eng.stats.prefix_cache_queries, "prefix_cache_hits": eng.stats.prefix_cache_hits,
            "prefix_cache_hit_rate": eng.stats.prefix_cache_hit_rate,
            "prefix_cache_recompute_hits": eng.stats.prefix_cache_recompute_hits,
            "prefix_cache_blocks": getattr(eng.allocator, "num_cached", 0),
            "aborted": self.aborted, "finished": dict(self.finished), "alive": self.error is None,
            "kernels": chosen(),
        }


def deliver(sink: Sink, item) -> None:
    """Give ``item`` to ``sink``; a sink whose consumer is gone (its event loop closed) is ignored."""
    try:
        sink(item)
    except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
        pass


def deliver_all(pairs) -> None:
    """Give each ``(sink, item)`` of one step its item. Sinks bound to an event loop (a ``loop`` attribute
    and an in-loop ``put(item)``, as actors/llm_server.LoopSink) get theirs in ONE call per loop (one
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
