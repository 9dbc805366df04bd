"""The inference engine: a quantized directory run with int8 linears over a paged int8-latent cache, with
continuous batching (pipeline.engine.scheduler) and sampling. The serving layer drives it step by step::

    eng = LLMEngine.from_dir("out/dsv3-tiny-pydoc-w8a8-fa3", num_blocks=256)
    seq = eng.add_request(prompt_ids, SamplingParams(max_new_tokens=32))
    while eng.has_work:
        for seq, new_token in eng.step(): ...        # tokens as they come; seq.status == "finished" at the end

or :meth:`LLMEngine.generate` for a list of prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pipeline.engine.blocks import BlockAllocator
from pipeline.engine.loader import LoadedModel, load_quantized
from pipeline.engine.runner import ModelRunner
from pipeline.engine.scheduler import FINISHED, Scheduler
from pipeline.engine.scheduler import Sequence as Seq
from pipeline.sampling import SamplingParams, sample


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 16
    max_batched_tokens: int = 256
    max_model_len: Optional[int] = None     # default: what the cache holds, capped by the model's positions
    nz: bool = False
    device: str = "cpu"
    cache_dtype: Optional[str] = None       # k_pe / non-FA3 latent storage; default the model's dtype


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    step_seconds: list = field(default_factory=list)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), tokenizer=None):
        cfg = loaded.config
        self.config, self.loaded, self.tokenizer = config, loaded, tokenizer
        cap = config.num_blocks * config.block_size
        max_len = min(config.max_model_len or cap, cfg.max_position_embeddings)
        self.allocator = BlockAllocator(config.num_blocks)
        self.scheduler = Scheduler(self.allocator, config.block_size, max_len, config.max_num_seqs,
                                   config.max_batched_tokens)
        self.runner = ModelRunner(loaded, config.num_blocks, config.block_size, config.nz, config.device,
                                  getattr(torch, config.cache_dtype) if config.cache_dtype else None)
        self.stats = EngineStats()
        self.eos_id = getattr(tokenizer, "eos_id", None) if tokenizer is not None else cfg.eos_token_id

    @classmethod
    def from_dir(cls, path: str, tokenizer=None, **config) -> "LLMEngine":
        return cls(load_quantized(path, device=config.get("device", "cpu")), EngineConfig(**config), tokenizer)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Seq:
        seq = self.scheduler.add(prompt_ids, params, self.eos_id)
        self.stats.prompt_tokens += len(seq.prompt)
        return seq

    def abort(self, seq: Seq) -> None:
        self.scheduler.abort(seq)

    def step(self) -> list[tuple[Seq, Optional[int]]]:
        """One engine step; returns (sequence, its new token or None when it just finished without one)
        for every sequence that produced a token or finished."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        events: list[tuple[Seq, Optional[int]]] = [(s, None) for s in batch.finished]
        if not batch.pieces:
            return events
        logits, _ = self.runner.forward(batch.pieces)
        samplers = [p for p in batch.pieces if p.samples]
        sampled = {}
        for row, p in enumerate(samplers):
            sampled[p.seq.seq_id] = int(sample(logits[row:row + 1], p.seq.params, p.seq.generator)[0])
        before = {p.seq.seq_id: len(p.seq.output) for p in samplers}
        self.scheduler.update(batch, sampled)
        for p in samplers:
            seq = p.seq
            new = seq.output[-1] if len(seq.output) > before[seq.seq_id] else None
            if new is not None:
                self.stats.generated_tokens += 1
                self._check_stop(seq)
            if new is not None or seq.status == FINISHED:
                events.append((seq, new))
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.step_seconds.append(time.perf_counter() - t0)
        return events

    def _check_stop(self, seq: Seq) -> None:
        if not seq.params.stop or self.tokenizer is None or seq.status == FINISHED:
            return
        text = self.tokenizer.decode(seq.output)
        if any(s and s in text for s in seq.params.stop):
            self.scheduler.finish(seq, "stop")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """Run the prompts to completion together; each one's generated token ids (eos excluded)."""
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_work:
            self.step()
        return [s.output for s in seqs]

    def text(self, seq: Seq) -> str:
        """The sequence's output text, cut at its first stop string."""
        text = self.tokenizer.decode(seq.output)
        for s in seq.params.stop:
            if s and s in text:
                text = text[: text.index(s)]
        return text


def greedy_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions (over the longer) where two greedy outputs agree, up to the first divergence
    counted position by position."""
    n = max(len(a), len(b), 1)
    return sum(1 for x, y in zip(a, b) if x == y) / n
