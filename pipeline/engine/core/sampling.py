"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator; log-probabilities of the
sampled tokens and their most likely alternatives (:func:`token_logprobs`, :class:`TokenLogprobs`); and
stop strings, matched incrementally on text decoded a window of tokens at a time (:class:`StopText`); a
sequence's seeded generator on the logits' device (:func:`generator_on`) and restored from a KV handoff's
state (:func:`restored_generator`).

Logprobs are vLLM v1's default "raw logprobs": ``log_softmax`` of the model's float32 logits of that
position, before penalties, ``min_tokens``, temperature and the top-k / top-p filters (so they say what the
model predicts, whatever the sampling settings: a greedy request without penalties picks the top-1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would overflow.
MIN_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes [-2**63, 2**64); outside it raises "Overflow when unpacking long".
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)
# The most alternatives a request may ask for per token (vLLM's default max_logprobs; OpenAI's top_logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) is greedy. top_k 0 and top_p 1.0 disable those filters.
    ``stop``: strings that end generation (the text is cut before them). ``ignore_eos``: generate through
    the end-of-sequence token (it stays in the output), to ``max_new_tokens``; ``min_tokens``: the
    end-of-sequence token cannot be sampled before that many tokens. Penalties (vLLM's and OpenAI's
    meaning, applied before temperature, greedy included): ``repetition_penalty`` r divides a positive
    logit, multiplies a negative one, of every token in the prompt or the output; ``presence_penalty`` and
    ``frequency_penalty`` subtract ``presence * (count > 0) + frequency * count`` over the output.
    ``logprobs``: None, no logprobs (no work at all); k in [0, MAX_LOGPROBS], each generated token's raw
    logprob and the k most likely tokens at its position (:class:`TokenLogprobs`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64). Numerically safe for every valid ``p``: non-finite logits
    are clamped, the most likely token always survives the filters, and a row whose probabilities are
    still unusable falls back to greedy."""
    if p.greedy:
        return logits.argmax(-1)
    x = torch.nan_to_num(logits.float(), nan=float("-inf"))
    x = (x / p.temperature).clamp(min=torch.finfo(torch.float32).min)  # -inf stays finite-but-tiny
    if p.top_k:
        kth = x.topk(min(p.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p; the first token always stays (a
        # top_p below float32's range compares as 0, which would otherwise drop every token)
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[:, 0] = False
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    usable = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    if not bool(usable.all()):
        probs = torch.where(usable[:, None], probs, torch.nn.functional.one_hot(
            logits.argmax(-1), probs.shape[-1]).to(probs.dtype))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's raw logprob and the ``k`` most likely tokens at its position, (id, logprob)
    pairs most likely first (ties in torch.topk's order); the token itself may be among them or not."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Row i of ``logits`` [R, V] (the raw logits of the position that produced ``token_ids[i]``): its
    token's logprob and its ``ks[i]`` most likely tokens, ``log_softmax`` in float32. One batched
    log_softmax and topk for all the rows, one copy to the host."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    k = min(max(ks, default=0), lp.shape[-1])
    if k:
        values, indices = lp.topk(k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
    out = []
    for i, (t, x, ki) in enumerate(zip(token_ids, chosen, ks)):
        top = tuple(zip(indices[i][:ki], values[i][:ki])) if k and ki else ()
        out.append(TokenLogprobs(int(t), x, top))
    return out


def piece_logprobs(logits: torch.Tensor, asking: list[tuple[Any, int]],
                   sampled: dict[int, list[int]]) -> dict[int, tuple[Any, list[TokenLogprobs]]]:
    """The engine's step (LLMEngine.sampled): the logprobs of the tokens sampled for the sequences that
    ask, ``asking`` (sequence, its first row of ``logits``), ``sampled`` (seq_id -> its tokens; an MTP
    piece's second token is read at the next row), in one batch; seq_id -> (sequence, its TokenLogprobs)."""
    rows, tokens, ks, owners = [], [], [], []
    for seq, r in asking:
        for j, t in enumerate(sampled[seq.seq_id]):
            rows.append(r + j)
            tokens.append(t)
            ks.append(seq.params.logprobs)
            owners.append(seq)
    out: dict[int, tuple[Any, list[TokenLogprobs]]] = {}
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    for seq, lp in zip(owners, token_logprobs(logits.index_select(0, idx), tokens, ks)):
        out.setdefault(seq.seq_id, (seq, []))[1].append(lp)
    return out


def generator_on(seq, device: torch.device) -> Optional[torch.Generator]:
    """The sequence's generator on ``device`` (the logits'): the scheduler seeds one on the CPU, which is
    never drawn from when the logits are elsewhere, so it is replaced by one seeded alike on ``device``
    (a generator moved between devices of one kind keeps its state)."""
    gen = seq.generator
    if gen is None or (gen.device.type == device.type and (gen.device.index or 0) == (device.index or 0)):
        return gen
    moved = torch.Generator(device=device)
    if gen.device.type == device.type:
        moved.set_state(gen.get_state())
    else:
        moved.manual_seed(seq.params.seed)
    seq.generator = moved
    return moved


def restored_generator(state: torch.Tensor, state_device: Optional[str], device: str) -> torch.Generator:
    """A generator on ``device`` continuing ``state`` (a KVHandoff's, of a generator on ``state_device``)."""
    kind = torch.device(state_device or "cpu").type
    if kind != torch.device(device).type:
        raise ValueError(f"KV handoff: the seeded generator's state is for a {kind} generator but this engine "
                         f"samples on {device}")
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


def plain_greedy(seq) -> bool:
    """Whether ``seq``'s next tokens are the raw logits' argmax: greedy, no penalty, and no eos to block
    (``min_tokens`` reached; it stays reached as the output grows)."""
    p = seq.params
    return p.greedy and not p.penalized and (seq.eos_id is None or len(seq.output) >= p.min_tokens)


def adjust_logits(logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                  eos_id: int | None) -> torch.Tensor:
    """The logits [1, V] of a sequence's next token after its penalties and ``min_tokens`` (see
    SamplingParams); the same tensor when neither applies."""
    block_eos = eos_id is not None and len(output) < p.min_tokens
    if not (p.penalized or block_eos):
        return logits
    x = logits.float().clone()
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=x.device)
        v = x[0, seen]
        x[0, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(list(output), dtype=torch.long, device=x.device).unique(return_counts=True)
        x[0, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    if block_eos:
        x[0, eos_id] = float("-inf")
    return x


def cut_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any (non-empty) stop string, and whether one occurs."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class StopText:
    """The text of a growing list of token ids, decoded incrementally, cut at the first stop string.

    Each :meth:`add` decodes only the tokens since the last settled point (plus the one before, for
    context) and searches for the stop strings only in the new text and the ``longest stop - 1``
    characters before it: the work per call is bounded by the new tokens and the stop strings' length,
    never by the output so far. A decode ending in a replacement character (an incomplete multi-byte
    character) is not settled: those tokens are decoded again with the next ones. :attr:`text` is the
    settled text (cut before a stop string once :attr:`stopped`); :meth:`finish` settles the rest."""

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self._prefix = 0        # ids[_prefix:_read] were decoded already: the context of the next decode
        self._read = 0          # ids[_read:] are not settled yet
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new token ids; returns the text settled by them (cut before a stop string)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        return self._settle(final=False)

    def finish(self) -> str:
        """Settle whatever is pending (a trailing incomplete character included)."""
        return "" if self.stopped else self._settle(final=True)

    def _settle(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = decode(self.ids[self._prefix:])
        if len(self.ids) == self._read or (not final and window.endswith("\ufffd")):
            return ""  # nothing new, or an incomplete character: wait for more tokens
        new = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._append(new)

    def _append(self, new: str) -> str:
        if self.stop:
            start = max(0, len(self.text) - self._longest + 1)
            tail = self.text[start:] + new
            cut_tail, self.stopped = cut_at_stop(tail, self.stop)
            if self.stopped:
                new = cut_tail[len(self.text) - start:] if len(cut_tail) >= len(self.text) - start else ""
                self.text = self.text[:start] + cut_tail
                return new
        self.text += new
        return new

    def held_back(self) -> int:
        """How many characters at the end of :attr:`text` could still begin a stop string."""
        if self.stopped or not self.stop:
            return 0
        tail = self.text[-(self._longest - 1):] if self._longest > 1 else ""
        for k in range(len(tail), 0, -1):
            end = tail[len(tail) - k:]
            if any(s.startswith(end) for s in self.stop if len(s) > k):
                return k
        return 0
