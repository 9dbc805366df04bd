"""Reference engines for the serving tests: the engine a Serve replica runs, built in the test's own process
with the replica's one torch thread, so its outputs are what the server must answer."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.protocol import EngineOutput, EngineRequest, SamplingParams

#: The EngineConfig fields a ServeConfig's engine passes on to the replica's engine.
REPLICA_FIELDS = ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens", "nz")


@contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """``n`` intra-op torch threads inside the block (a replica runs one), restored after it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def replica_engine(qdir: str, tok, config: EngineConfig) -> LLMEngine:
    """An LLMEngine over ``qdir`` with the replica-relevant fields of ``config``."""
    return LLMEngine.from_dir(qdir, tokenizer=tok, **{k: getattr(config, k) for k in REPLICA_FIELDS})


_ids = itertools.count()


def request(prompt: Sequence[int], params: SamplingParams = SamplingParams(), rid: Optional[str] = None
            ) -> EngineRequest:
    """An EngineRequest with a fresh id (``rid`` when given)."""
    return EngineRequest(rid or f"test-{next(_ids)}", tuple(prompt), params)


def submit(engine, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> str:
    """Add a request for ``prompt`` to ``engine``; its id."""
    req = request(prompt, params)
    engine.add(req)
    return req.request_id


@dataclass
class Result:
    """A request's outputs, joined: its tokens, its text (the engine's, with stop strings), its logprobs."""

    tokens: list = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    outputs: list = field(default_factory=list)

    def add(self, out: EngineOutput) -> None:
        self.outputs.append(out)
        self.tokens += out.token_ids
        self.text += out.text or ""
        self.logprobs += out.logprobs or ()
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error


def drain(engine, results: Optional[dict] = None) -> dict[str, Result]:
    """Step ``engine`` until it has no work; every request's Result by id (added to ``results``)."""
    results = {} if results is None else results
    while engine.has_work:
        for out in engine.step():
            results.setdefault(out.request_id, Result()).add(out)
    return results
#: Each step of an engine that a test needs to keep busy sleeps this long first (actors.serving.engine.engine_replica's
#: ``step_delay_s``), so that a request of N tokens lasts at least N * SLOW_STEP_S seconds on any machine:
#: a client's time-out, an abort or a drain then meets it running, however fast the CPU is.
SLOW_STEP_S = 0.01


def slowed(engine: LLMEngine, delay_s: float = SLOW_STEP_S) -> LLMEngine:
    """``engine`` with every step delayed by ``delay_s`` (as a served app's ``step_delay_s`` does)."""
    from actors.serving.engine.engine_replica import _delayed

    engine.step = _delayed(engine.step, delay_s)
    return engine
