"""The engine core in its own process (pipeline/engine/core/core_process.py), spoken to as the serving replica
does: the same tokens as the engine in this process, refusals and aborts crossing the pipe, one message per
step, a child that cannot build its engine reported with its traceback, and a killed child ending every
open request with EngineDead."""

from __future__ import annotations

import os
import queue
import signal
import time
from functools import partial

import pytest

from pipeline.engine.core.core_process import EngineCoreClient
from pipeline.engine.core.engine import LLMEngine
from engine_ref import request
from pipeline.engine.protocol import EngineDead, EngineOutput, SamplingParams
from pipeline.text.tokenizer import Tokenizer

from engine_ref import slowed

PROMPT = "The os module provides"
NUM_BLOCKS = 16


def build(qdir: str, slow: bool = False) -> LLMEngine:
    """The child's factory (module level: it pickles); ``slow``: every step delayed (engine_ref.slowed), so
    that a long request is still running when the test aborts it or kills the child, on any machine."""
    import torch

    torch.set_num_threads(1)
    eng = LLMEngine.from_dir(qdir, tokenizer=Tokenizer.from_dir(qdir), num_blocks=NUM_BLOCKS, block_size=16)
    return slowed(eng) if slow else eng


def info(engine) -> dict:
    return {"max_model_len": engine.max_model_len}


def collect(q: queue.Queue, timeout: float = 60) -> list:
    out = [q.get(timeout=timeout)]
    while isinstance(out[-1], EngineOutput) and out[-1].finish_reason is None:
        out.append(q.get(timeout=timeout))
    return out


@pytest.fixture(scope="module")
def reference(qdir) -> list[int]:
    import torch

    threads = torch.get_num_threads()
    try:
        eng = build(qdir)
        return eng.generate([eng.tokenizer.encode(PROMPT)], SamplingParams(max_new_tokens=12))[0]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def core(qdir):
    client = EngineCoreClient(partial(build, qdir, True), info)
    yield client
    client.stop()


def test_tokens_equal_the_engine_in_this_process(core, qdir, reference):
    tok = Tokenizer.from_dir(qdir)
    assert core.ready["max_model_len"] == NUM_BLOCKS * 16 and core.pid != os.getpid() and core.alive
    qs = [queue.Queue() for _ in range(3)]
    reqs = [request(tok.encode(PROMPT), SamplingParams(max_new_tokens=12)) for _ in qs]
    for r, q in zip(reqs, qs):   # three at once: batched in the child, each stream intact
        core.submit(r, q.put)
    for r, q in zip(reqs, qs):
        events = collect(q)
        assert all(isinstance(e, EngineOutput) and e.request_id == r.request_id for e in events)
        assert [t for e in events for t in e.token_ids] == reference
        assert events[-1].finish_reason == "length" and events[-1].token_ids  # the last token carries it


def test_the_snapshot_says_alive_as_soon_as_the_client_is_built(qdir):
    """The ready message carries the loop's first snapshot: /health reads ``alive`` from it, and before the
    first step's message (up to the loop's 0.5 s idle wait) it used to find an empty one and answer 503."""
    client = EngineCoreClient(partial(build, qdir), info)
    try:
        snap = client.snapshot
        assert snap["alive"] is True and snap["running"] == 0 and snap["cache_blocks_free"] == NUM_BLOCKS
    finally:
        client.stop()


def test_refusal_and_abort_cross_the_pipe(core, qdir):
    tok = Tokenizer.from_dir(qdir)
    bad, long = queue.Queue(), queue.Queue()
    core.submit(request(list(range(10, 10 + 300)), SamplingParams(max_new_tokens=5)), bad.put)
    err = bad.get(timeout=60)
    assert isinstance(err, ValueError) and "the prompt has 300 tokens" in str(err)
    running = request(tok.encode(PROMPT), SamplingParams(max_new_tokens=200))
    core.submit(running, long.put)
    assert long.get(timeout=60).finish_reason is None      # running in the child now
    again = queue.Queue()
    core.submit(running, again.put)                        # its id is taken: refused, the first one goes on
    assert isinstance(err := again.get(timeout=60), ValueError) and "is already in this engine" in str(err)
    aborted = core.snapshot.get("aborted", 0)
    core.abort(running.request_id)
    deadline = time.time() + 20
    while core.snapshot.get("aborted") != aborted + 1 and time.time() < deadline:
        time.sleep(0.05)
    snap = core.snapshot
    assert snap["aborted"] == aborted + 1 and snap["running"] == 0
    assert snap["cache_blocks_free"] == snap["cache_blocks_total"] == NUM_BLOCKS and core.alive


def broken_factory():
    raise FileNotFoundError("no checkpoint at /nonexistent")


def test_a_factory_that_fails_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match="could not build the engine") as e:
        EngineCoreClient(broken_factory)
    assert "FileNotFoundError: no checkpoint at /nonexistent" in str(e.value)


def test_a_killed_child_ends_open_requests_with_engine_dead(qdir):
    tok = Tokenizer.from_dir(qdir)
    client = EngineCoreClient(partial(build, qdir, True), info)
    try:
        q = queue.Queue()
        client.submit(request(tok.encode(PROMPT), SamplingParams(max_new_tokens=200)), q.put)
        assert q.get(timeout=60).finish_reason is None
        os.kill(client.pid, signal.SIGKILL)
        ev = q.get(timeout=30)
        while isinstance(ev, EngineOutput):
            ev = q.get(timeout=30)
        assert isinstance(ev, EngineDead) and "exited" in str(ev)
        assert not client.alive and client.snapshot["alive"] is False
        late = queue.Queue()
        client.submit(request(tok.encode(PROMPT), SamplingParams(max_new_tokens=2)), late.put)
        assert isinstance(late.get(timeout=5), EngineDead)
    finally:
        client.stop()
