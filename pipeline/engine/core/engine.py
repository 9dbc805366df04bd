"""The inference engine: a model (a quantized directory with int8 linears, or a float checkpoint) run over a
paged latent cache, with continuous batching (:mod:`pipeline.engine.core.scheduler`) and sampling. Its
interface is four calls::

    eng = LLMEngine.from_dir("out/dsv3-tiny-pydoc-w8a8-fa3", tokenizer=tok, num_blocks=256)
    eng.add(EngineRequest("r1", prompt_ids, SamplingParams(max_new_tokens=32)))
    while eng.has_work:
        for out in eng.step(): ...        # EngineOutputs: new tokens per request, a finish reason at the end
    eng.abort("r1");  eng.stats()

(:meth:`LLMEngine.generate` runs a list of prompts to the end.) The scheduler decides what each step
computes (plain ids and counts); the model runner (:mod:`pipeline.engine.worker.runner`) turns that into
tensors and runs the model; the engine samples, applies the stop conditions and reports. Requests with
stop strings are detokenized here, once (:mod:`pipeline.engine.core.detokenizer`): their text rides in
``EngineOutput.text``. Prefill/decode disaggregation: :meth:`LLMEngine.prefill` and
:meth:`LLMEngine.add_prefilled` (:mod:`pipeline.engine.core.kv_handoff`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pipeline.io import heap
from pipeline.engine.cache.blocks import BlockAllocator
from pipeline.engine.cache.prefix_cache import PrefixCachingAllocator
from pipeline.engine.config import EngineConfig
from pipeline.engine.core import kv_handoff
from pipeline.engine.core.detokenizer import Detokenizer
from pipeline.engine.core.guided import Guides
from pipeline.engine.core.kv_handoff import KVHandoff
from pipeline.engine.core.sampling import adjust_logits, generator_on, piece_logprobs, plain_greedy, sample
from pipeline.engine.core.scheduler import FINISHED, RUNNING, Scheduler
from pipeline.engine.core.scheduler import Sequence as Seq
from pipeline.engine.native.cpu_float import argmax_rows
from pipeline.engine.protocol import (ABORT, ERROR, STOP, EngineOutput, EngineRequest, EngineStats, ReplicaBroken,
                                      SamplingParams, StepFailed, TokenLogprobs)
from pipeline.engine.worker.loader import LoadedModel, load_model
from pipeline.engine.worker.runner import ModelRunner, Span

log = logging.getLogger("dsquant.engine")
STEP_TIMES_KEPT = 10_000


def make_runner(loaded: LoadedModel, config: EngineConfig, cls=ModelRunner, **kw) -> ModelRunner:
    """The model runner (``cls``) of ``loaded`` as ``config`` sets its cache (``kw``: ModelRunner's others)."""
    return cls(loaded, config.num_blocks, config.block_size, config.nz, config.device,
               getattr(torch, config.cache_dtype) if config.cache_dtype else None, config.mtp, config.fa3,
               compile=config.compile, decode_graph=config.decode_graph, **kw)


@dataclass
class Counters:
    """An engine's counters (the scheduler adds the prefix cache's to them)."""

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


@dataclass
class StepWork:
    """One step between its phases (LLMEngine.step)."""

    t0: float
    batch: object
    finished: list                  # sequences the scheduler ended (the cache cannot hold them)
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
        0, actors.serving.engine.rank_group); default one in this process. ``tokenizer``: for the stop strings (and the
        eos id); without one, stop strings are not looked for."""
        cfg = loaded.config
        config = config.resolved(loaded.kernels)    # the kernels and modes, chosen once: recorded here
        self.config, self.loaded, self.tokenizer = config, loaded, tokenizer
        if runner is None:
            log.info("engine on %s: kernels %s; decode graph %s", config.device, config.kernels.describe(),
                     "on" if config.decode_graph else "off")
        if torch.device(config.device).type == "cpu":
            heap.tune()        # steps reuse freed activations' pages (pipeline.io.heap)
        cap = config.num_blocks * config.block_size
        max_len = min(config.max_model_len or cap, cfg.max_position_embeddings)
        self.allocator = (PrefixCachingAllocator if config.prefix_caching else BlockAllocator)(config.num_blocks)
        self.counters = Counters()
        self.scheduler = Scheduler(self.allocator, config.block_size, max_len, config.max_num_seqs,
                                   config.max_batched_tokens, mtp=config.mtp, stats=self.counters)
        self.runner = runner or make_runner(loaded, config)
        self._requests: dict[str, Seq] = {}             # request_id -> its sequence, until it finishes
        self._detok: dict[int, Detokenizer] = {}        # seq_id -> its output's text, for stop strings
        self._errors: dict[int, str] = {}               # seq_id -> why it failed (finish_reason "error")
        self.guides = Guides(tokenizer, cfg.vocab_size)  # the constrained sequences' matchers (guided)
        self.eos_id = getattr(tokenizer, "eos_id", None) if tokenizer is not None else cfg.eos_token_id
        self._layout = kv_handoff.cache_layout(self)

    @classmethod
    def from_dir(cls, path: str, tokenizer=None, dtype=None, **config) -> "LLMEngine":
        """The engine on a quantized directory or a float checkpoint (``loader.load_model`` picks by what
        the directory holds); ``dtype``: the float compute dtype (default: the loader's); ``config``:
        EngineConfig's fields."""
        ec = EngineConfig(**config)
        return cls(load_model(path, dtype=dtype, device=ec.device, kernels=ec.kernels), ec, tokenizer)

    # ----- the interface: add, abort, step, stats ---------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        """Queue ``request``; ValueError (nothing queued) when the engine refuses it: a prompt that does not
        fit the model or the cache, an id already in the engine, or a grammar that does not compile
        (guided.GrammarError)."""
        matcher = self.guides.matcher(request.params.grammar) if request.params.grammar is not None else None
        self._admit(request, self.scheduler.add(request.prompt_ids, request.params, self.eos_id,
                                                self._new_id(request)), matcher)

    def abort(self, request_id: str) -> None:
        """Stop a request now (its client went away): its blocks are freed, no more output comes for it."""
        seq = self._requests.get(request_id)
        if seq is not None:
            self.scheduler.abort(seq, ABORT)
            self._forget(seq)

    def step(self) -> list[EngineOutput]:
        """One engine step: the outputs of every request that produced tokens (one, or two when an MTP draft
        was accepted) or finished. StepFailed when the model or the sampling raised: the requests running
        in the step are failed (its ``outputs``), the others stay queued.

        In phases (a DP-attention replica runs them for all its groups in lockstep, dp_engine): ``begin``
        (schedule: the spans and logit rows), the model, ``sampled`` (sample, update; the MTP work),
        the MTP layer, ``end`` (stop strings, outputs, stats)."""
        st = self.begin_step()
        if not st.spans:
            return self.end_step(st)
        try:
            logits, hidden = self.runner.forward(st.spans, st.rows)
            draft = self.sampled(st, logits)
            if draft is not None:
                self.drafted(draft, self.runner.mtp_forward(draft.spans, hidden, draft.hidden_rows, draft.rows))
        except ReplicaBroken:
            raise
        except Exception as e:
            raise self.step_failed(e) from e
        return self.end_step(st)

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            cache_blocks_total=self.config.num_blocks, cache_blocks_free=self.allocator.num_free,
            prefix_cache_blocks=getattr(self.allocator, "num_cached", 0), steps=c.steps,
            prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens, preemptions=c.preemptions,
            mtp_drafts=c.drafts, mtp_accepted=c.accepted, prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits, prefix_cache_recompute_hits=c.prefix_cache_recompute_hits)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ----- requests ---------------------------------------------------------------------------------------
    def _new_id(self, request: EngineRequest) -> str:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in this engine")
        return request.request_id

    def _admit(self, request: EngineRequest, seq: Seq, matcher=None) -> Seq:
        if request.params.grammar is not None:
            self.guides.add(seq.seq_id, matcher or self.guides.matcher(request.params.grammar))
        self._requests[request.request_id] = seq
        self.counters.prompt_tokens += len(seq.prompt)
        if request.params.stop and self.tokenizer is not None:
            self._detok[seq.seq_id] = Detokenizer(self.tokenizer, request.params.stop)
        return seq

    def _forget(self, seq: Seq) -> None:
        """Drop the per-request state kept for a finished request."""
        self._requests.pop(seq.request_id, None)
        self._detok.pop(seq.seq_id, None)
        self._errors.pop(seq.seq_id, None)
        self.guides.forget(seq.seq_id)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """Run the prompts to completion together; each one's generated token ids (eos excluded)."""
        return generate(self, prompts, params)

    def warm_up(self, tokens: Optional[int] = None) -> int:
        """Run one prompt step's worth of tokens (``tokens``, default max_batched_tokens, over up to
        max_num_seqs sequences, as many as the free blocks and max_model_len allow) through the model and
        the MTP layer on blocks taken and given back: nothing is scheduled, sampled, cached or counted.
        The first big step pays one-time costs (fresh pages for its activations and the kernels' scratch,
        first calls), as vLLM's engine does at start-up (its profile run). Returns the tokens run (0 when
        the engine is busy or has no room)."""
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

    # ----- prefill/decode disaggregation ----------------------------------------------------------
    def kv_layout(self) -> dict:
        """What a KV handoff between two engines must agree on (fixed once the engine is built)."""
        return self._layout

    def prefill(self, request: EngineRequest, step=None, read=None) -> KVHandoff:
        """:func:`pipeline.engine.core.kv_handoff.prefill` on this engine."""
        return kv_handoff.prefill(self, request, step, read)

    def add_prefilled(self, request: EngineRequest, kv: KVHandoff, write=None) -> None:
        """:func:`pipeline.engine.core.kv_handoff.add_prefilled` on this engine."""
        kv_handoff.add_prefilled(self, request, kv, write)

    # ----- a step, in phases ------------------------------------------------------------------------
    def begin_step(self) -> "StepWork":
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        spans = [Span(p.token_ids, p.start, p.seq.table.blocks) for p in batch.pieces]
        offsets = [0]
        for sp in spans:
            offsets.append(offsets[-1] + sp.n)
        rows: list[int] = []
        for p, b in zip(batch.pieces, offsets[1:]):
            if p.samples:
                rows += [b - 2, b - 1] if p.draft is not None else [b - 1]
        guided = [p.seq for p in batch.pieces if p.samples and p.seq.seq_id in self.guides]
        if guided:      # their masks are filled while the model runs (guided.Guides.prefetch)
            self.guides.prefetch(guided)
        return StepWork(t0, batch, list(batch.finished), spans, offsets, rows)

    def sampled(self, st: "StepWork", logits: torch.Tensor) -> Optional["DraftWork"]:
        """Sample every sampling piece's tokens from ``logits`` (its rows), update the scheduler; returns
        the MTP layer's work for this step (None without MTP or with nothing to draft). The logprobs of
        the sequences that ask for them go to :attr:`step_logprobs`; with none asking, nothing is
        computed."""
        batch = st.batch
        sampled: dict[int, list[int]] = {}
        failed: list[Seq] = []
        asking: list[tuple[Seq, int]] = []     # (sequence, its first logit row) of those that want logprobs
        # every plain greedy row's token from ONE argmax over all rows (the same ids as row by row)
        plain = {p.seq.seq_id for p in batch.pieces if p.samples and plain_greedy(p.seq)}
        best = argmax_rows(logits, self.config.kernels.float_ops) if plain else None
        masked, refused = self._masked(batch.pieces, logits)
        r = 0
        for p in batch.pieces:
            if not p.samples:
                continue
            rows_of = 1 if p.draft is None else 2
            try:
                if p.seq.seq_id in refused:
                    raise RuntimeError(refused[p.seq.seq_id])
                sampled[p.seq.seq_id] = self._sample_piece(p, masked.get(p.seq.seq_id, logits[r:r + rows_of]),
                                                           best[r:r + rows_of] if p.seq.seq_id in plain else None)
            except Exception as e:  # noqa: BLE001 - one request's sampling failure fails that request only
                self._errors[p.seq.seq_id] = f"sampling failed: {type(e).__name__}: {e}"
                log.warning("request %s: sampling failed: %s: %s", p.seq.request_id, type(e).__name__, e)
                failed.append(p.seq)
            else:
                if p.seq.params.logprobs is not None:
                    asking.append((p.seq, r))
            r += rows_of
        st.before = {p.seq.seq_id: len(p.seq.output) for p in batch.pieces}
        got = piece_logprobs(logits, asking, sampled) if asking else {}
        self.scheduler.update(batch, sampled)
        for seq in failed:
            self.scheduler.finish(seq, ERROR)
        if got or self.step_logprobs:  # only the tokens the sequence kept (not an eos that ended it)
            self.step_logprobs = {sid: lps[:len(seq.output) - st.before[sid]] for sid, (seq, lps) in got.items()}
        return self._draft_work(batch.pieces, st.offsets) if self.runner.mtp_id is not None else None

    def _masked(self, pieces, logits: torch.Tensor) -> tuple[dict, dict]:
        """The constrained sampling pieces' logit rows with their grammars' masks, all in one batch
        (:meth:`pipeline.engine.core.guided.Guides.masked`); nothing to do without any."""
        seqs, rows, r = [], [], 0
        for p in pieces:
            if not p.samples:
                continue
            if p.seq.seq_id in self.guides:
                seqs.append(p.seq)
                rows.append(r)
            r += 1 if p.draft is None else 2
        return self.guides.masked(seqs, rows, logits) if seqs else ({}, {})

    def end_step(self, st: "StepWork") -> list[EngineOutput]:
        """The step's outputs: the stop strings looked for in the new text, the counters updated (a step
        that computed nothing only reports the sequences the scheduler ended)."""
        outputs = [self._output(seq, ()) for seq in st.finished]
        if not st.spans:
            return outputs
        for p in st.batch.pieces:
            seq = p.seq
            new = tuple(seq.output[st.before.get(seq.seq_id, len(seq.output)):])
            self.counters.generated_tokens += len(new)
            if new or seq.status == FINISHED:
                outputs.append(self._output(seq, new))
        self.counters.steps += 1
        self.counters.preemptions = self.scheduler.num_preemptions
        self.counters.step_seconds.append(time.perf_counter() - st.t0)
        return outputs

    def _output(self, seq: Seq, new: tuple[int, ...]) -> EngineOutput:
        """``seq``'s output for its ``new`` tokens: a request with stop strings gets the text they settle
        (and is finished with STOP when a stop string appears in it); a finished one is forgotten."""
        det, text = self._detok.get(seq.seq_id), None
        if det is not None:
            text = det.add(new) if new else ""
            if det.stopped and seq.status != FINISHED:
                self.scheduler.finish(seq, STOP)
            if seq.status == FINISHED and not seq.hold:
                text += det.finish()
        done = seq.status == FINISHED
        lps = self.step_logprobs.get(seq.seq_id) if new and seq.params.logprobs is not None else None
        out = EngineOutput(seq.request_id, new, seq.finish_reason if done else None, tuple(lps) if lps else None,
                           text, self._errors.get(seq.seq_id) if done else None)
        if done and not seq.hold:
            self._forget(seq)
        return out

    def step_failed(self, e: BaseException) -> StepFailed:
        """After a step raised ``e``: the running requests are failed (their blocks freed), as StepFailed."""
        why = f"an engine step failed: {type(e).__name__}: {e}"
        log.warning("%s; failing the %d request(s) in it", why, len(self.scheduler.running))
        outputs = []
        for seq in list(self.scheduler.running):
            self.scheduler.abort(seq, ERROR)
            self._errors[seq.seq_id] = why
            outputs.append(self._output(seq, ()))
        return StepFailed(why, outputs)

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
        self.counters.drafts += 1
        if first != p.draft:
            return [first]
        self.counters.accepted += 1
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
            if end == len(seq.tokens) - 1 and seq.params.greedy and seq.params.grammar is None:
                draft_rows.append(k - 1)
                drafting.append(seq)
        return DraftWork(spans, rows_h, draft_rows, drafting) if spans else None

    @staticmethod
    def drafted(work: "DraftWork", logits: torch.Tensor) -> None:
        for seq, row in zip(work.drafting, logits.argmax(-1).tolist()):
            seq.draft = int(row)


_generate_ids = itertools.count()


def generate(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
    """Run the prompts through ``engine`` (its add and step) to completion together; each one's generated
    token ids (eos excluded). RuntimeError naming the prompt when one fails."""
    ids = [f"generate-{next(_generate_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add(EngineRequest(rid, tuple(p), params))
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_work:
        for o in engine.step():
            if o.finish_reason == ERROR:
                raise RuntimeError(f"prompt {ids.index(o.request_id)} failed: {o.error}")
            out[o.request_id] += o.token_ids
    return [out[rid] for rid in ids]


def greedy_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions (over the longer output) at which two greedy outputs hold the same token."""
    n = max(len(a), len(b), 1)
    return sum(1 for x, y in zip(a, b) if x == y) / n
