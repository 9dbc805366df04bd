"""Continuous batching over a paged cache: which tokens of which sequences each engine step computes.

Every step (:meth:`Scheduler.schedule`) fills a budget of ``max_batched_tokens``:

1. the running sequences, oldest first: a decoding sequence computes its one new token; a sequence still
   in its prompt computes the next chunk of it (chunked prefill: a long prompt takes several steps and
   never stalls the decodes, which come first);
2. then waiting sequences are admitted while fewer than ``max_num_seqs`` run, the budget lasts, and the
   cache has free blocks for their first chunk (admission is bounded by free blocks).

Fair between requests (a request's ``n`` choices share ``SamplingParams.group``; a sequence without one
is a request of its own), so that a small request beside a big one starts within a step or two:

- the prompt work of a step (the next chunks of running prompts, the admission of waiting sequences)
  goes first to the requests with the fewest other sequences running, then to the prompts needing the
  fewest tokens, first come first served among equals: a short prompt is not stuck behind long ones. A
  waiting sequence whose first chunk does not fit the free blocks is passed over; one that later
  sequences have overtaken ``max_num_seqs`` times goes first, and nothing overtakes it any more;
- when a waiting request cannot be admitted for lack of a slot or of blocks and another request holds
  at least two more sequences (or, by its sequences, more blocks) than it would, sequences of the
  request holding the most are preempted for it (those with the least computed first; each sequence at
  most once: the work redone for fairness is bounded).

Each scheduled piece reserves its cache slots first. When a running sequence needs a block and none is
free, another running sequence is preempted: for a decode, the most recently admitted one still in its
prompt, else the most recently admitted one of the request with the most running sequences; a prompt
chunk only preempts a prompt admitted after its own that has no piece in this step, and otherwise waits
(it never stops a decode, nor a short prompt admitted ahead of it). Its blocks are freed and it goes
back to the head of the queue, to be recomputed from its tokens so far (prompt and output) when there is
room again; its output so far is kept, so preemption changes timing, never tokens. After the step,
:meth:`Scheduler.update` takes the sampled token of every sequence whose tokens are all computed, applies
the stop conditions (eos, max tokens, the model's length), and frees the blocks of finished sequences.

A prompt that cannot fit the model's length, or whose blocks exceed the whole cache, is refused at
:meth:`Scheduler.add` with a ValueError that says so; nothing else raises for lack of cache.

Prefix caching (with a :class:`~pipeline.engine.cache.prefix_cache.PrefixCachingAllocator`; keys and eviction
are described there). Registered: a sequence's full blocks once their tokens' KV is computed, at
:meth:`Scheduler.update` of the step that computed them -- prompt and output blocks alike, chunk by
chunk, blocks received with a prefilled prompt (``add_running``) included, at their first step here.
Taken: when a waiting sequence is admitted (a new one, or a preempted one to recompute), the longest run
of cached blocks its tokens' keys find is shared read-only (reference counted) and its computation
starts after them; at most ``(len(tokens) - 1) // block_size`` blocks, so its last token is always
computed (its logits give the next token) and a partial last block is never shared: shared blocks are
full and never written, no copy-on-write. With ``mtp`` (the MTP layer drafts, and its cache has an
entry per position computed from the token after it) keys look one token ahead, and a block is
registered only at the update after the step whose MTP pass wrote its entries: blocks computed in a
sequence's last step are not cached then, except a held prompt's (a prefill engine's, whose MTP pass
runs for it: ``LLMEngine.prefill`` calls :meth:`Scheduler.register_final` before freeing them). Both
ways a hit is exact: the blocks taken hold what the sequence would have computed itself.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from pipeline.engine.cache.blocks import BlockAllocator, BlockTable
from pipeline.engine.cache.prefix_cache import PrefixCacheStats, PrefixCachingAllocator, extend_keys
from pipeline.engine.protocol import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Sequence:
    """One request as the scheduler tracks it (``seq_id``: the scheduler's own handle; ``request_id``:
    the request's, EngineRequest.request_id)."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    eos_id: Optional[int]
    block_size: int
    tokens: list[int] = field(default_factory=list)     # prompt + sampled tokens
    num_computed: int = 0                               # tokens whose KV is in the cache
    status: str = WAITING
    finish_reason: Optional[str] = None
    preemptions: int = 0
    generator: Optional[torch.Generator] = None
    draft: Optional[int] = None                         # MTP's proposal for the token after the last one
    hold: bool = False                                  # keep the blocks when finished (a prefill to hand off)
    block_keys: list = field(default_factory=list)      # prefix-cache keys of its first full blocks
    num_registered: int = 0                             # its first blocks that are in the prefix cache
    request_id: str = ""
    overtaken: int = 0                                  # later sequences admitted before it (it did not fit)
    yielded: bool = False                               # preempted once for another request's fair share

    @property
    def group(self):
        """The request it belongs to (SamplingParams.group), else its own id."""
        return self.params.group if self.params.group is not None else self.seq_id

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.table = BlockTable(self.block_size)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.remaining > 1


@dataclass(frozen=True)
class Piece:
    """Compute ``seq.tokens[start:start + n]``; ``samples``: the step ends with all of the sequence's
    tokens computed, so its logits at the last one give the next token. With ``draft`` (speculative
    decoding), the piece is the last token and the draft after it (n == 2): its logits at both give the
    verification and, when the draft is accepted, one more token."""

    seq: Sequence
    start: int
    n: int
    draft: Optional[int] = None

    @property
    def samples(self) -> bool:
        return self.start + self.n == len(self.seq.tokens) + (self.draft is not None)

    @property
    def token_ids(self) -> list[int]:
        ids = self.seq.tokens[self.start:self.start + self.n]
        return ids + [self.draft] if self.draft is not None else ids


@dataclass
class Batch:
    pieces: list[Piece]
    preempted: list[Sequence]
    finished: list[Sequence] = field(default_factory=list)  # ended here: the cache cannot hold them

    @property
    def num_tokens(self) -> int:
        return sum(p.n for p in self.pieces)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_model_len: int, max_num_seqs: int = 16,
                 max_batched_tokens: int = 256, mtp: bool = False, stats: Optional[PrefixCacheStats] = None):
        """Prefix caching is on when ``allocator`` is a PrefixCachingAllocator; ``mtp``: the engine runs
        the MTP layer (keys look ahead one token); ``stats``: where the prefix-cache counters go (an
        object with PrefixCacheStats's fields, e.g. the engine's EngineStats)."""
        if max_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be >= 1")
        self.allocator, self.block_size, self.max_model_len = allocator, block_size, max_model_len
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.caching = isinstance(allocator, PrefixCachingAllocator)
        self.lookahead = int(mtp)    # MTP: a block's key covers the token after it too
        self.stats = stats if stats is not None else PrefixCacheStats()

    def number_ids(self, first: int, stride: int) -> None:
        """Give new sequences the ids first, first + stride, ... (a DP group's share of one id space, so
        that ``seq_id % groups`` names the group holding it)."""
        self._ids = itertools.count(first, stride)

    # ----- requests --------------------------------------------------------------------------------
    def add(self, prompt: Iterable[int], params: SamplingParams, eos_id: Optional[int] = None,
            request_id: str = "") -> Sequence:
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model takes at most "
                             f"{self.max_model_len - 1} prompt tokens ({self.max_model_len} in all)")
        blocks = -(-(len(prompt) + 1) // self.block_size)  # the prompt and its first sampled token
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"the prompt needs {blocks} cache blocks of {self.block_size} tokens but the "
                             f"cache has {self.allocator.num_blocks} in all")
        seq = Sequence(next(self._ids), prompt, params, eos_id, self.block_size, request_id=request_id)
        self.waiting.append(seq)
        return seq

    def add_running(self, tokens: Iterable[int], num_prompt: int, num_cached: int, params: SamplingParams,
                    eos_id: Optional[int] = None, request_id: str = "") -> Sequence:
        """A sequence whose first ``num_cached`` tokens' KV another engine computed (prefill/decode
        disaggregation): blocks for them are allocated now (OutOfBlocks when the cache cannot take them:
        the caller retries later) and the sequence runs from the next step; the caller fills the blocks."""
        tokens = list(tokens)
        if not 0 < num_cached < len(tokens) or not 0 < num_prompt <= num_cached:
            raise ValueError(f"add_running: {num_cached} cached of {len(tokens)} tokens ({num_prompt} prompt)")
        if len(tokens) >= self.max_model_len:
            raise ValueError(f"the sequence has {len(tokens)} tokens; this model takes at most {self.max_model_len}")
        seq = Sequence(next(self._ids), tokens[:num_prompt], params, eos_id, self.block_size, request_id=request_id)
        seq.tokens = tokens
        seq.table.append_tokens(num_cached, self.allocator)
        seq.num_computed, seq.status = num_cached, RUNNING
        self.running.append(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Stop a sequence now (a client went away): its blocks are freed."""
        if seq.status == FINISHED:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- scheduling ------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Reserve cache slots for ``n`` more tokens of ``seq``, preempting younger running sequences
        when blocks run out. False when even that cannot make room."""
        while True:
            need = seq.table.slots_needed(n, self.allocator)
            if need <= self.allocator.num_free:
                copies = seq.table.append_tokens(n, self.allocator)
                assert not copies, "sequences never share blocks here"
                return True
            victim = self._victim(seq)
            if victim is None:
                return False
            self._preempt(victim)

    def _victim(self, seq: Sequence) -> Optional[Sequence]:
        """The running sequence to preempt for ``seq``'s blocks. For a prompt chunk: the most recently
        admitted prompt admitted after ``seq`` that has no piece in this step (None: ``seq`` waits; a prompt
        chunk never stops a decode, nor a prompt this step computes). For a decode: the most recently
        admitted prompt (those with no piece in this step first), else the most recently admitted
        sequence of the request with the most running sequences (ties: the request of the most recent)."""
        pool = [s for s in self.running if s is not seq]
        if seq.in_prefill:
            younger = self.running[self.running.index(seq) + 1:] if seq in self.running else []
            return next((s for s in reversed(younger) if s.in_prefill and s.seq_id not in self._scheduled), None)
        prompts = sorted((s for s in pool if s.in_prefill), key=lambda s: s.seq_id not in self._scheduled)
        if prompts:
            return prompts[-1]      # stable: the most recently admitted of those with no piece yet
        if not pool:
            return None
        count = Counter(s.group for s in pool)
        most = max(count.values())
        return next(s for s in reversed(pool) if count[s.group] == most)

    def _preempt(self, seq: Sequence) -> None:
        seq.table.release(self.allocator)
        seq.num_computed = seq.num_registered = 0
        seq.draft = None
        seq.status = WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self._preempted.append(seq)

    def schedule(self) -> Batch:
        budget = self.max_batched_tokens
        pieces: list[Piece] = []
        finished: list[Sequence] = []
        self._preempted: list[Sequence] = []
        self._scheduled: set[int] = set()       # the sequences with a piece in this step
        if self.waiting and self.running:
            self._share_fairly()
        for seq in [s for s in self.running if not s.in_prefill]:  # decodes first
            budget = self._schedule_running(seq, budget, pieces, finished)
        admitting = True
        for running, seq in self._prompt_order():
            if budget == 0:
                break
            if running:
                budget = self._schedule_running(seq, budget, pieces, finished)
            elif admitting and len(self.running) < self.max_num_seqs and seq not in self._preempted:
                taken = self._admit(seq, budget, pieces)
                budget -= taken
                for w in self.waiting if taken else ():
                    if w.seq_id < seq.seq_id:
                        w.overtaken += 1
                        admitting &= w.overtaken < self.max_num_seqs   # it has waited long enough:
                if not taken and seq.overtaken >= self.max_num_seqs:  # nothing else goes first
                    admitting = False
        pieces = [p for p in pieces if p.seq.status == RUNNING]  # a scheduled one may have been preempted since
        return Batch(pieces, self._preempted, finished)

    def _schedule_running(self, seq: Sequence, budget: int, pieces: list, finished: list) -> int:
        """Schedule a running sequence's next piece within ``budget``; the budget left."""
        if seq.status != RUNNING or budget == 0:
            return budget
        draft = seq.draft if seq.remaining == 1 and budget >= 2 else None
        n = min(seq.remaining, budget) + (draft is not None)
        if self._reserve(seq, n):
            pieces.append(Piece(seq, seq.num_computed, n, draft))
            self._scheduled.add(seq.seq_id)
            return budget - n
        if len(self.running) == 1:  # alone and still too long for the whole cache
            self._finish(seq, "length")
            finished.append(seq)
        return budget

    def _admit(self, seq: Sequence, budget: int, pieces: list) -> int:
        """Admit a waiting sequence with its first chunk (at most ``budget`` tokens) when the cache has the
        blocks for it; the tokens scheduled (0: not admitted)."""
        hits = self._lookup(seq)
        n = min(len(seq.tokens) - len(hits) * self.block_size, budget)
        need = -(-n // self.block_size) + (self.allocator.cost(hits) if hits else 0)
        if need > self.allocator.num_free:
            return 0
        self.waiting.remove(seq)
        if self.caching:
            self._take(seq, hits)
        seq.table.append_tokens(n, self.allocator)
        seq.status = RUNNING
        self.running.append(seq)
        pieces.append(Piece(seq, seq.num_computed, n))
        self._scheduled.add(seq.seq_id)
        return n

    def _prompt_order(self) -> list[tuple[bool, Sequence]]:
        """(running, sequence) for the prompt work of a step: running sequences still in their prompt and
        waiting ones, those of requests with the fewest other sequences running first, then those needing
        the fewest prompt tokens (a waiting one overtaken max_num_seqs times counts as needing none),
        running before waiting, first come first served."""
        count = Counter(s.group for s in self.running)
        work = [(count[s.group] - 1, s.remaining, 0, i, s) for i, s in enumerate(self.running) if s.in_prefill]
        work += [(count[s.group], 0 if s.overtaken >= self.max_num_seqs else len(s.tokens), 1, i, s)
                 for i, s in enumerate(self.waiting)]
        return [(w[2] == 0, w[4]) for w in sorted(work, key=lambda w: w[:4])]

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences, those of the requests with the fewest running sequences first (a stable
        sort: first come first served among equals; a preempted sequence waits at the head)."""
        count = Counter(s.group for s in self.running)
        return sorted(self.waiting, key=lambda s: count[s.group])

    def _share_fairly(self) -> None:
        """Preempt for each waiting request that cannot be admitted now (no slot, or too few free blocks
        for its first chunk) while another request holds at least two more sequences (slots), or more
        blocks by its sequences, than it would (module doc)."""
        seqs, blocks = Counter(), Counter()
        for s in self.running:
            seqs[s.group] += 1
            blocks[s.group] += len(s.table.blocks)
        seen = set()
        for seq in self._admission_order():
            g = seq.group
            if g in seen or seq.yielded:    # a request's first waiting sequence; one preempted for fairness waits
                continue
            seen.add(g)
            need = -(-min(len(seq.tokens), self.max_batched_tokens) // self.block_size)
            while True:
                slots = len(self.running) >= self.max_num_seqs
                if not slots and need <= self.allocator.num_free:
                    break
                richer = [s for s in self.running if s.group != g and not s.yielded and
                          (seqs[s.group] >= seqs[g] + 2 if slots else blocks[s.group] - len(s.table.blocks) >= blocks[g] + need)]
                if not richer:
                    break
                top = max((seqs[s.group], blocks[s.group]) for s in richer)
                victim = min((s for s in richer if (seqs[s.group], blocks[s.group]) == top),
                             key=lambda s: s.num_computed)
                seqs[victim.group] -= 1
                blocks[victim.group] -= len(victim.table.blocks)
                victim.yielded = True
                self._preempt(victim)

    # ----- prefix caching ---------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence (it holds no blocks) would start with."""
        if not self.caching:
            return []
        n = (len(seq.tokens) - 1) // self.block_size  # its last token is computed, whatever is cached
        return self.allocator.lookup(extend_keys(seq.block_keys, seq.tokens, self.block_size, n, self.lookahead))

    def _take(self, seq: Sequence, hits: list[int]) -> None:
        """Admit ``seq`` onto the cached blocks ``hits``: shared, its computation starts after them."""
        self.allocator.acquire(hits)
        seq.table = BlockTable(self.block_size, list(hits), len(hits) * self.block_size)
        seq.num_computed = len(hits) * self.block_size
        seq.num_registered = len(hits)
        if seq.preemptions:
            self.stats.prefix_cache_recompute_hits += seq.num_computed
        else:
            self.stats.prefix_cache_queries += len(seq.prompt)
            self.stats.prefix_cache_hits += seq.num_computed

    def _register(self, seq: Sequence, start: int) -> None:
        """Register the sequence's full blocks whose cache entries are final: those computed (without
        MTP), or those computed before this step's piece at ``start`` (with MTP: their MTP entries were
        written in the MTP pass of the step that computed them)."""
        done = start if self.lookahead else seq.num_computed
        n = min(done, len(seq.tokens) - self.lookahead) // self.block_size
        if n <= seq.num_registered:
            return
        keys = extend_keys(seq.block_keys, seq.tokens, self.block_size, n, self.lookahead)
        for b in range(seq.num_registered, n):
            self.allocator.register(seq.table.blocks[b], keys[b])
        seq.num_registered = n

    def register_final(self, seq: Sequence) -> None:
        """Register every computed full block of a held sequence whose step's MTP pass (if any) is done:
        its cache entries are final (LLMEngine.prefill, before it frees the prompt's blocks)."""
        if self.caching:
            self._register(seq, seq.num_computed)

    def update(self, batch: Batch, sampled: dict[int, "int | list[int]"]) -> list[Sequence]:
        """After the step: every piece's tokens are computed; ``sampled``: seq_id -> the next token of each
        piece that samples, or for a draft piece the tokens it yields in order: ``[t]`` (draft rejected:
        ``t`` replaces it, whose slot is given back) or ``[draft, t]`` (accepted). Returns the sequences
        that finished in this step."""
        done = []
        for p in batch.pieces:
            seq = p.seq
            if seq.status != RUNNING:
                continue
            seq.draft = None
            got = sampled.get(seq.seq_id) if p.samples else None
            toks = [got] if isinstance(got, int) else list(got or [])
            if p.draft is not None:
                accepted = len(toks) == 2
                seq.num_computed = p.start + (2 if accepted else 1)
                if not accepted:
                    seq.table.truncate(seq.num_computed, self.allocator)
            else:
                seq.num_computed = p.start + p.n
            if self.caching:
                self._register(seq, p.start)
            for tok in toks:
                if seq.eos_id is not None and tok == seq.eos_id and not seq.params.ignore_eos:
                    self._finish(seq, "stop")
                    break
                seq.tokens.append(tok)
                if len(seq.output) >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_model_len:
                    self._finish(seq, "length")
                    break
            if seq.status == FINISHED:
                done.append(seq)
        return done

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence for a reason found outside (a stop string)."""
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.hold:
            seq.table.release(self.allocator)
            seq.num_registered = 0
        seq.status, seq.finish_reason = FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
