"""The inference engine: a quantized directory run with int8 linears over a paged int8-latent cache, with
continuous batching (pipeline.engine.core.scheduler) and sampling. The serving layer drives it step by step::

    eng = LLMEngine.from_dir("out/dsv3-tiny-pydoc-w8a8-fa3", num_blocks=256)
    seq = eng.add_request(prompt_ids, SamplingParams(max_new_tokens=32))
    while eng.has_work:
        for seq, new_token in eng.step(): ...        # tokens as they come; seq.status == "finished" at the end

or :meth:`LLMEngine.generate` for a list of prompts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pipeline.engine.cache.blocks import BlockAllocator
from pipeline.engine.worker.loader import LoadedModel, load_model
from pipeline.engine.core import kv_handoff
from pipeline.engine.core.kv_handoff import KVHandoff, latest_logprobs  # noqa: F401 (re-exported)
from pipeline.engine import malloc_tuning
from pipeline.engine.native.cpu_float import argmax_rows
from pipeline.engine.cache.prefix_cache import PrefixCachingAllocator
from pipeline.engine.worker.runner import ModelRunner, Span
from pipeline.engine.core.scheduler import FINISHED, RUNNING, Scheduler
from pipeline.engine.core.scheduler import Sequence as Seq
from pipeline.engine.core.sampling import (SamplingParams, StopText, TokenLogprobs, adjust_logits, cut_at_stop,
                                      generator_on, piece_logprobs, plain_greedy, sample)


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
    mtp: bool = False                       # speculative decoding with the MTP layer (one draft token)
    fa3: bool = True                        # int8 latent cache on FA3 layers (False: the latent in bf16)
    compile: bool = False                   # torch.compile the layers' work around attention (engine.regions)
    prefix_caching: bool = True             # reuse cached full blocks across requests (engine.prefix_cache)
    decode_graph: bool = True               # replay pure decode steps (engine.decode_graph; False: eager)


STEP_TIMES_KEPT = 10_000


def make_runner(loaded: LoadedModel, config: EngineConfig, cls=ModelRunner, **kw) -> ModelRunner:
    """The model runner (``cls``) of ``loaded`` as ``config`` sets its cache (``kw``: ModelRunner's others)."""
    return cls(loaded, config.num_blocks, config.block_size, config.nz, config.device,
               getattr(torch, config.cache_dtype) if config.cache_dtype else None, config.mtp, config.fa3,
               compile=config.compile, decode_graph=config.decode_graph, **kw)


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    drafts: int = 0                 # MTP draft tokens proposed (and verified)
    accepted: int = 0               # ... and accepted
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0      # ... found there (their prefill skipped)
    prefix_cache_recompute_hits: int = 0  # tokens a preempted sequence found there when recomputed
    step_seconds: deque = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))  # the latest steps'

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (0 before any)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class StepWork:
    """One step between its phases (LLMEngine.step)."""

    t0: float
    batch: object
    events: list
    spans: list
    offsets: list
    rows: list
    before: dict = field(default_factory=dict)


@dataclass
class DraftWork:
    """The MTP layer's part of a step: spans, the main hidden rows they read, the logit rows, the drafters."""

    spans: list
    hidden_rows: list
    rows: list
    drafting: list


class LLMEngine:
    # seq_id -> the TokenLogprobs of the tokens it kept in the latest step that sampled, for the sequences
    # that ask (SamplingParams.logprobs); each such step replaces the dict (this empty one is never mutated)
    step_logprobs: dict[int, list[TokenLogprobs]] = {}

    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), tokenizer=None,
                 runner: Optional[ModelRunner] = None):
        """``runner``: a model runner already built for ``loaded`` and ``config`` (a sharded replica's rank
        0, actors.rank_group); default one in this process."""
        cfg = loaded.config
        self.config, self.loaded, self.tokenizer = config, loaded, tokenizer
        if torch.device(config.device).type == "cpu":
            malloc_tuning.tune()        # steps reuse freed activations' pages (malloc_tuning)
        cap = config.num_blocks * config.block_size
        max_len = min(config.max_model_len or cap, cfg.max_position_embeddings)
        self.allocator = (PrefixCachingAllocator if config.prefix_caching else BlockAllocator)(config.num_blocks)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.allocator, config.block_size, max_len, config.max_num_seqs,
                                   config.max_batched_tokens, mtp=config.mtp, stats=self.stats)
        self.runner = runner or make_runner(loaded, config)
        self._stop_texts: dict[int, StopText] = {}      # seq_id -> its output's text, for stop strings
        self.errors: dict[int, str] = {}                # seq_id -> why it failed (finish_reason "error")
        self.eos_id = getattr(tokenizer, "eos_id", None) if tokenizer is not None else cfg.eos_token_id
        self._layout = self._make_layout()

    @classmethod
    def from_dir(cls, path: str, tokenizer=None, dtype=None, **config) -> "LLMEngine":
        """The engine on a quantized directory or a float checkpoint (``loader.load_model`` picks by what
        the directory holds); ``dtype``: the float compute dtype (default: the loader's); ``config``:
        EngineConfig's fields."""
        ec = EngineConfig(**config)
        return cls(load_model(path, dtype=dtype, device=ec.device), ec, tokenizer)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def warm_up(self, tokens: Optional[int] = None) -> int:
        """Run one prompt step's worth of tokens (``tokens``, default max_batched_tokens, over up to
        max_num_seqs sequences, as many as the free blocks and max_model_len allow) through the model and
        the MTP layer on blocks taken and given back: nothing is scheduled, sampled, cached or counted.
        The first big step pays one-time costs (fresh pages for its activations and the kernels' scratch,
        first calls): measured in serving, the first 16 x 128-token step took 236 ms against ~70 for the
        next ones. vLLM's engine runs such a step at start-up too (its profile run). Returns the tokens
        run (0 when the engine is busy or has no room)."""
        if self.has_work:
            return 0
        work = self.warm_up_work(tokens)
        if work is None:
            return 0
        spans, rows, blocks = work
        n = sum(sp.n for sp in spans)
        try:
            _, hidden = self.runner.forward(spans, rows)
            if self.runner.mtp_id is not None:
                self.runner.mtp_forward(spans, hidden, range(n), rows)
        finally:
            self.allocator.free_all(blocks)
        return n

    def warm_up_work(self, tokens: Optional[int] = None) -> Optional[tuple[list[Span], list[int], list[int]]]:
        """:meth:`warm_up`'s step (spans, last rows, the blocks taken for them: the caller gives them
        back), or None when there is no room."""
        cfg, bs = self.config, self.config.block_size
        total = min(tokens or cfg.max_batched_tokens, cfg.max_batched_tokens)
        seqs = max(1, min(cfg.max_num_seqs, total))
        per = min(-(-total // seqs), self.scheduler.max_model_len)
        nb = -(-per // bs)                      # blocks per sequence
        seqs = min(seqs, self.allocator.num_free // nb)
        if seqs < 1 or per < 1:
            return None
        blocks = self.allocator.allocate_many(seqs * nb)
        vocab = self.loaded.config.vocab_size
        spans = [Span([(7 * i + j) % vocab for j in range(per)], 0, blocks[i * nb:(i + 1) * nb]) for i in range(seqs)]
        return spans, [(i + 1) * per - 1 for i in range(seqs)], blocks

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Seq:
        seq = self.scheduler.add(prompt_ids, params, self.eos_id)
        self.stats.prompt_tokens += len(seq.prompt)
        return seq

    def abort(self, seq: Seq) -> None:
        self.scheduler.abort(seq)
        self._forget(seq)

    def _forget(self, seq: Seq) -> None:
        """Drop the per-sequence state kept for a finished sequence (its failure stays until popped)."""
        self._stop_texts.pop(seq.seq_id, None)

    def pop_error(self, seq: Seq) -> Optional[str]:
        """Why a sequence finished with reason "error" (a failure of that request only), once."""
        return self.errors.pop(seq.seq_id, None)

    # ----- prefill/decode disaggregation ----------------------------------------------------------
    def kv_layout(self) -> dict:
        """What a KV handoff between two engines must agree on (fixed once the engine is built)."""
        return self._layout

    def _make_layout(self) -> dict:
        return kv_handoff.cache_layout(self)

    def prefill(self, prompt_ids: Sequence[int], params: SamplingParams, step=None, read=None) -> KVHandoff:
        """:func:`pipeline.engine.core.kv_handoff.prefill` on this engine."""
        return kv_handoff.prefill(self, prompt_ids, params, step, read)

    def add_prefilled(self, kv: KVHandoff, params: SamplingParams, write=None) -> Seq:
        """:func:`pipeline.engine.core.kv_handoff.add_prefilled` on this engine."""
        return kv_handoff.add_prefilled(self, kv, params, write)

    def step(self) -> list[tuple[Seq, list[int]]]:
        """One engine step; returns (sequence, its new tokens: one, two when an MTP draft was accepted,
        or none when it just finished without one) for every sequence that produced a token or finished.

        In phases (a DP-attention replica runs them for all its groups in lockstep, dp_engine): ``begin``
        (schedule: the spans and logit rows), the model, ``sampled`` (sample, update; the MTP work),
        the MTP layer, ``end`` (events, stop strings, stats)."""
        st = self.begin_step()
        if not st.spans:
            return st.events
        logits, hidden = self.runner.forward(st.spans, st.rows)
        draft = self.sampled(st, logits)
        if draft is not None:
            self.drafted(draft, self.runner.mtp_forward(draft.spans, hidden, draft.hidden_rows, draft.rows))
        return self.end_step(st)

    def begin_step(self) -> "StepWork":
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        events: list[tuple[Seq, list[int]]] = [(s, []) for s in batch.finished]
        spans = [Span(p.token_ids, p.start, p.seq.table.blocks) for p in batch.pieces]
        offsets = [0]
        for sp in spans:
            offsets.append(offsets[-1] + sp.n)
        rows: list[int] = []
        for p, a, b in zip(batch.pieces, offsets, offsets[1:]):
            if p.samples:
                rows += [b - 2, b - 1] if p.draft is not None else [b - 1]
        return StepWork(t0, batch, events, spans, offsets, rows)

    def sampled(self, st: "StepWork", logits: torch.Tensor) -> Optional["DraftWork"]:
        """Sample every sampling piece's tokens from ``logits`` (its rows), update the scheduler; returns
        the MTP layer's work for this step (None without MTP or with nothing to draft). The logprobs of
        the sequences that ask for them go to :attr:`step_logprobs` (:func:`latest_logprobs`); with none
        asking, nothing is computed."""
        batch = st.batch
        sampled: dict[int, list[int]] = {}
        failed: list[Seq] = []
        asking: list[tuple[Seq, int]] = []     # (sequence, its first logit row) of those that want logprobs
        # every plain greedy row's token from ONE argmax over all rows (the same ids as row by row)
        plain = {p.seq.seq_id for p in batch.pieces if p.samples and plain_greedy(p.seq)}
        best = argmax_rows(logits) if plain else None
        r = 0
        for p in batch.pieces:
            if not p.samples:
                continue
            rows_of = 1 if p.draft is None else 2
            try:
                sampled[p.seq.seq_id] = self._sample_piece(
                    p, logits[r:r + rows_of], best[r:r + rows_of] if p.seq.seq_id in plain else None)
            except Exception as e:  # noqa: BLE001 - one request's sampling failure fails that request only
                self.errors[p.seq.seq_id] = f"sampling failed: {type(e).__name__}: {e}"
                failed.append(p.seq)
            else:
                if p.seq.params.logprobs is not None:
                    asking.append((p.seq, r))
            r += rows_of
        st.before = {p.seq.seq_id: len(p.seq.output) for p in batch.pieces}
        got = piece_logprobs(logits, asking, sampled) if asking else {}
        self.scheduler.update(batch, sampled)
        for seq in failed:
            self.scheduler.finish(seq, "error")
        if got or self.step_logprobs:  # only the tokens the sequence kept (not an eos that ended it)
            self.step_logprobs = {sid: lps[:len(seq.output) - st.before[sid]] for sid, (seq, lps) in got.items()}
        return self._draft_work(batch.pieces, st.offsets) if self.runner.mtp_id is not None else None

    def end_step(self, st: "StepWork") -> list[tuple[Seq, list[int]]]:
        events = st.events
        for p in st.batch.pieces:
            seq = p.seq
            new = seq.output[st.before[seq.seq_id]:]
            self.stats.generated_tokens += len(new)
            if new:
                self._check_stop(seq)
            if new or seq.status == FINISHED:
                events.append((seq, new))
            if seq.status == FINISHED:
                self._forget(seq)
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.step_seconds.append(time.perf_counter() - st.t0)
        return events

    def _sample_piece(self, p, logits: torch.Tensor, best: Optional[list[int]] = None) -> list[int]:
        """The tokens a sampling piece yields: one, or with an MTP draft the verification and, when the
        draft is accepted, one more. ``best``: the rows' argmax, already known (a plain greedy sequence)."""
        seq = p.seq
        out = list(seq.output)
        generator = generator_on(seq, logits.device) if best is None else None

        def next_token(row: int) -> int:
            if best is not None:
                return best[row]
            x = adjust_logits(logits[row:row + 1], seq.params, seq.prompt, out, seq.eos_id)
            return int(sample(x, seq.params, generator)[0])

        first = next_token(0)
        if p.draft is None:
            return [first]
        self.stats.drafts += 1
        if first != p.draft:
            return [first]
        self.stats.accepted += 1
        out.append(first)
        return [first, next_token(1)]

    def _draft_work(self, pieces, offsets: list[int]) -> Optional["DraftWork"]:
        """The MTP layer's work: every position computed this step (with the token after it, now known),
        filling its cache; the last position of each running greedy sequence gives its next draft."""
        spans, rows_h, draft_rows, drafting, k = [], [], [], [], 0
        for p, a in zip(pieces, offsets):
            seq = p.seq
            if seq.status != RUNNING and not seq.hold:
                continue
            end = seq.num_computed  # positions p.start .. end - 1 are in the main cache now
            spans.append(Span([seq.tokens[i + 1] for i in range(p.start, end)], p.start, seq.table.blocks))
            rows_h += range(a, a + end - p.start)
            k += end - p.start
            if end == len(seq.tokens) - 1 and seq.params.greedy:
                draft_rows.append(k - 1)
                drafting.append(seq)
        return DraftWork(spans, rows_h, draft_rows, drafting) if spans else None

    @staticmethod
    def drafted(work: "DraftWork", logits: torch.Tensor) -> None:
        for seq, row in zip(work.drafting, logits.argmax(-1).tolist()):
            seq.draft = int(row)

    @property
    def acceptance_rate(self) -> float:
        return self.stats.accepted / self.stats.drafts if self.stats.drafts else 0.0

    def _check_stop(self, seq: Seq) -> None:
        """Finish ``seq`` once its output holds a stop string; the output's text is decoded and searched
        incrementally (StopText): constant work per new token, whatever the output's length."""
        if not seq.params.stop or self.tokenizer is None or seq.status == FINISHED:
            return
        text = self._stop_texts.get(seq.seq_id)
        if text is None:
            text = self._stop_texts[seq.seq_id] = StopText(self.tokenizer, seq.params.stop)
        text.add(seq.output[len(text.ids):])
        if text.stopped:
            self.scheduler.finish(seq, "stop")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """Run the prompts to completion together; each one's generated token ids (eos excluded)."""
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_work:
            self.step()
        errors = [(i, self.pop_error(s)) for i, s in enumerate(seqs) if s.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"prompt {errors[0][0]} failed: {errors[0][1]}")
        return [s.output for s in seqs]

    def text(self, seq: Seq) -> str:
        """The sequence's output text, cut at its first stop string."""
        return cut_at_stop(self.tokenizer.decode(seq.output), seq.params.stop)[0]


def greedy_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions (over the longer output) at which two greedy outputs hold the same token."""
    n = max(len(a), len(b), 1)
    return sum(1 for x, y in zip(a, b) if x == y) / n
