"""Reference engines for the serving tests: the engine a Serve replica runs, built in the test's own process
with the replica's one torch thread, so its outputs are what the server must answer."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from pipeline.engine.core.engine import EngineConfig, LLMEngine

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
