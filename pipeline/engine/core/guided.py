"""Constrained decoding on the engine's side: the token masks of the sequences whose
``SamplingParams.grammar`` is set, computed for a whole step at once and applied to their logit rows.

The grammar engine is llguidance (PyPI ``llguidance``: one abi3 CPU wheel, no Python dependencies; Lark
grammars, JSON schemas and regexes; what vLLM's ``guidance`` backend runs). Per engine:

- :class:`GrammarCompiler` builds llguidance's tokenizer once (from the engine tokenizer's
  ``tokenizer.json``, over the model's vocabulary width) and keeps the compiled matcher of each grammar
  text in an LRU cache: a request for a grammar seen before gets a copy of its compiled matcher
  (``LLMatcher.deep_copy``, microseconds) instead of a new compilation;
- :class:`Guides` holds each constrained sequence's matcher. When a step is scheduled,
  :meth:`Guides.prefetch` brings every matcher of the step's constrained sequences up to its sequence's
  output (the tokens sampled since: the matcher follows the output, so preemption and a KV handoff need
  nothing special) and fills their bitmasks, one pass over them into one bitmask (llguidance computes a
  mask without the GIL, ~20 us for this vocabulary; its own thread pool, ``fill_next_token_bitmask_par``,
  was not used: its spinning workers took CPU from the model's threads on a small machine), on a worker
  thread, while the model computes the logits;
  before sampling, :meth:`Guides.masked` waits for them and applies them to the constrained rows in one
  batched tensor operation. Unconstrained rows are not touched, nor copied.

The logprobs stay raw (the model's, before the mask), as with penalties. A matcher in error (a token
outside the grammar, which the mask prevents, or a grammar llguidance gives up on) fails its request
only. Constrained sequences get no MTP draft (engine._draft_work): a draft's second row would need the
mask after a token not yet known.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

GRAMMAR_CACHE_SIZE = 256        # compiled grammars kept per engine (a request's schema is usually reused)


def _llguidance():
    import llguidance
    import llguidance.torch

    return llguidance


class GrammarError(ValueError):
    """A grammar the grammar engine cannot compile; the message is llguidance's."""


class GrammarCompiler:
    """llguidance's tokenizer for ``tokenizer`` (a pipeline.text.tokenizer.Tokenizer) over ``vocab_size``
    ids (the model's logits' width; ids past the tokenizer's are never allowed) and the compiled
    grammars, cached. Thread-safe (the API validates on worker threads)."""

    def __init__(self, tokenizer, vocab_size: Optional[int] = None, cache_size: int = GRAMMAR_CACHE_SIZE):
        llg = _llguidance()
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.tokenizer = llg.LLTokenizer(tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=tokenizer.eos_id)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0               # compilations done (cache misses), for the tests and the benchmark

    def check(self, grammar: str) -> None:
        """GrammarError with llguidance's message when ``grammar`` does not compile."""
        self.matcher(grammar)

    def matcher(self, grammar: str):
        """A fresh matcher for ``grammar`` at its start (a copy of the cached compiled one)."""
        with self._lock:
            m = self._cache.get(grammar)
            if m is not None:
                self._cache.move_to_end(grammar)
                return m.deep_copy()
        llg = _llguidance()
        err = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise GrammarError(err)
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        with self._lock:
            self.compiled += 1
            self._cache[grammar] = m
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return m.deep_copy()


def masked_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
                use_numpy: Optional[bool] = None) -> torch.Tensor:
    """Rows ``rows`` of ``logits`` [N, V], copied as float32, with every token whose bit is 0 in
    ``bitmask`` [len(rows), ceil(V / 32)] (int32, llguidance's layout: token t is bit t % 32 of word
    t // 32) set to -inf: one batched operation for all the rows. On the CPU in numpy (unpackbits,
    putmask: a few hundred microseconds for 16 rows of 4096, whatever torch's thread count; torch's
    elementwise ops split over threads cost milliseconds on a busy machine), elsewhere in torch on the
    logits' device (``use_numpy``: force one or the other; default: numpy for CPU logits)."""
    v = logits.shape[-1]
    if use_numpy if use_numpy is not None else logits.device.type == "cpu":
        x = logits.float().numpy()[np.asarray(rows)]          # fancy indexing: a copy
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little", count=v)
        np.putmask(x, allowed == 0, -np.inf)
        return torch.from_numpy(x)
    x = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device)).float()
    bm = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=bm.device)
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).reshape(bm.shape[0], -1)[:, :v]
    return x.masked_fill_(allowed == 0, float("-inf"))


class _Guide:
    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher):
        self.matcher, self.consumed = matcher, 0


class Guides:
    """The matchers of an engine's constrained sequences (seq_id -> matcher and how much of the output
    it has consumed)."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab = tokenizer, vocab_size
        self._compiler: Optional[GrammarCompiler] = None
        self._guides: dict[int, _Guide] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[tuple] = None             # (seq ids, future of _fill) of the step being run
        self.mask_seconds, self.masked_rows = 0.0, 0      # time in masked() and rows masked (benchmarks)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError("a constrained request (grammar) needs the engine to have a tokenizer")
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab)
        return self._compiler

    def matcher(self, grammar: str):
        """A matcher for ``grammar`` (compiled, or from the cache); GrammarError when it does not compile."""
        return self.compiler.matcher(grammar)

    def add(self, seq_id: int, matcher) -> None:
        self._guides[seq_id] = _Guide(matcher)

    def forget(self, seq_id: int) -> None:
        self._guides.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._guides

    def prefetch(self, seqs: list) -> None:
        """Start filling the masks of the constrained ``seqs`` of the step being run (in its sampling order)
        on a worker thread, while the model computes their logits (llguidance drops the GIL; so does the
        model): :meth:`masked` then only waits for them and applies them."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsquant-grammar")
        self._pending = (tuple(s.seq_id for s in seqs), self._pool.submit(self._fill, seqs))

    def masked(self, seqs: list, rows: list[int], logits: torch.Tensor) -> tuple[dict, dict]:
        """For the constrained ``seqs`` (each sampling from row ``rows[i]`` of ``logits``): ({seq_id: its
        masked logit row [1, V], float32}, {seq_id: why it failed}). One batched mask fill (started by
        :meth:`prefetch` for these sequences, else now) and one batched apply."""
        t0 = time.perf_counter()
        try:
            pending, self._pending = self._pending, None
            if pending is not None and pending[0] == tuple(s.seq_id for s in seqs):
                failed, live, bitmask = pending[1].result()
            else:
                if pending is not None:
                    pending[1].result()
                failed, live, bitmask = self._fill(seqs)
            if not live:
                return {}, failed
            row_of = dict(zip((s.seq_id for s in seqs), rows))
            x = masked_rows(logits, [row_of[sid] for sid in live], bitmask)
            self.masked_rows += len(live)
            return {sid: x[i:i + 1] for i, sid in enumerate(live)}, failed
        finally:
            self.mask_seconds += time.perf_counter() - t0

    def _fill(self, seqs: list) -> tuple[dict, list, Optional[torch.Tensor]]:
        """Bring each matcher up to its sequence's output, then fill the masks of those not in error in
        one call: ({seq_id: why it failed}, [seq_id of each mask row], bitmask [rows, words])."""
        llg = _llguidance()
        failed: dict[int, str] = {}
        live: list[tuple[int, object]] = []
        for seq in seqs:
            g = self._guides[seq.seq_id]
            out = seq.output
            for t in out[g.consumed:]:      # the tokens sampled since the last mask (the eos included)
                if not g.matcher.consume_token(t):
                    break
            g.consumed = len(out)
            if g.matcher.is_error():
                failed[seq.seq_id] = f"constrained decoding failed: {g.matcher.get_error()}"
                continue
            live.append((seq.seq_id, g.matcher))
        if not live:
            return failed, [], None
        bitmask = llg.torch.allocate_token_bitmask(len(live), self._vocab)
        for i, (_, m) in enumerate(live):
            llg.torch.fill_next_token_bitmask(m, bitmask, i)
        return failed, [sid for sid, _ in live], bitmask
