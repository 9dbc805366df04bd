"""The engine's request contract: what a request asks (:class:`EngineRequest`, with its
:class:`SamplingParams`), what the engine answers for it (:class:`EngineOutput`, with
:class:`TokenLogprobs`), and the errors a request or an engine can end with.

One id names a request from the HTTP request to the engine and back: the ingress takes it from the
request (``pipeline.serving.endpoints.openai_api.request_id``), the OpenAI response's ``id`` is built on it, the
engine request of each choice carries it (``<id>`` for one choice, ``<id>-<i>`` for choice ``i`` of
``n > 1``), every :class:`EngineOutput` names it, and the logs and the metrics' exemplars show it.

Logprobs are vLLM v1's default "raw logprobs": ``log_softmax`` of the model's float32 logits of that
position, before penalties, ``min_tokens``, temperature and the top-k / top-p filters (so they say what the
model predicts, whatever the sampling settings: a greedy request without penalties picks the top-1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would overflow.
MIN_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes [-2**63, 2**64); outside it raises "Overflow when unpacking long".
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)
# The most alternatives a request may ask for per token (vLLM's default max_logprobs; OpenAI's top_logprobs).
MAX_LOGPROBS = 20
# Why a request finished: its stop condition (eos or a stop string), its length (max_new_tokens, the
# model's or the cache's), an abort (the client went away), or an error of that request only.
STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"


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
    logprob and the k most likely tokens at its position (:class:`TokenLogprobs`). ``group``: scheduling only
    (which client request the sequence is part of), never the tokens. ``logit_bias``: (token id, bias)
    pairs added to those tokens' logits before sampling (OpenAI's ``logit_bias``; after the penalties, the
    logprobs stay raw). ``grammar``: constrained decoding, an llguidance grammar (Lark text or its JSON
    form, :mod:`pipeline.engine.core.guided`): only tokens that keep the output in the grammar can be
    sampled, and once it is complete only the end-of-sequence token."""

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
    # the client request the sequence belongs to (an API request's ``n`` choices share one): the scheduler
    # shares its slots and cache blocks between groups (pipeline.engine.core.scheduler); None: a group of its own
    group: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None

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
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or not math.isfinite(b):
                raise ValueError(f"logit_bias takes (token id >= 0, finite bias) pairs, got {(t, b)!r}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def biased(self) -> bool:
        """Whether the raw logits are changed before sampling by more than penalties: a logit bias or a
        grammar's mask."""
        return bool(self.logit_bias) or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's raw logprob and the ``k`` most likely tokens at its position, (id, logprob)
    pairs most likely first (ties in torch.topk's order); the token itself may be among them or not."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """Generate from ``prompt_ids`` with ``params``; ``request_id`` names the request in every output,
    log line and abort (unique among the requests an engine holds at once)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()

    def __post_init__(self):
        if not isinstance(self.prompt_ids, tuple):
            object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))


@dataclass(frozen=True)
class EngineOutput:
    """What one engine step gives a request: the tokens it produced since the last output (possibly none:
    it just finished), ``finish_reason`` (STOP, LENGTH, ABORT or ERROR) on its last output only, with
    ``error`` saying why when ERROR. ``logprobs``: one TokenLogprobs per token of ``token_ids`` when the
    request asks for them, else None. ``text``: the text these tokens settle when the engine detokenizes
    the request (it has stop strings: the engine must see the text to stop; the whole settled text once
    the request finishes, cut before the stop string), else None (the caller detokenizes)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: Optional[str] = None
    logprobs: Optional[tuple[TokenLogprobs, ...]] = None
    text: Optional[str] = None
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """An engine's figures now (``stats()``): what it holds (sequences, cache blocks) and its counters since
    it was built (steps, tokens, preemptions, MTP drafts, prefix-cache lookups)."""

    running: int = 0
    waiting: int = 0
    cache_blocks_total: int = 0
    cache_blocks_free: int = 0
    prefix_cache_blocks: int = 0        # blocks holding a prefix-cache entry (in use or evictable)
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    mtp_drafts: int = 0                 # MTP draft tokens proposed (and verified)
    mtp_accepted: int = 0               # ... and accepted
    prefix_cache_queries: int = 0       # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0          # ... found there (their prefill skipped)
    prefix_cache_recompute_hits: int = 0  # tokens a preempted sequence found there when recomputed

    @property
    def cache_blocks_used(self) -> int:
        return self.cache_blocks_total - self.cache_blocks_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (0 before any)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def acceptance_rate(self) -> float:
        """MTP drafts accepted / drafts proposed (0 before any)."""
        return self.mtp_accepted / self.mtp_drafts if self.mtp_drafts else 0.0

    def to_dict(self) -> dict:
        """The fields and the derived figures (what /metrics renders)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "cache_blocks_used": self.cache_blocks_used,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


class RequestFailed(RuntimeError):
    """The engine failed this request (its sampling, or a step it was in); the others go on."""


class PrefillFailed(RuntimeError):
    """The prefill side could not prefill a request (unavailable, timed out, failed); that request only."""


class EngineDead(RuntimeError):
    """The engine's step loop stopped on an error; the message carries it."""


class ReplicaBroken(RuntimeError):
    """A rank of a sharded replica failed; the replica cannot run another step."""


class StepFailed(RuntimeError):
    """A step raised: the requests that were running in it are failed (``outputs``: their last outputs,
    finish reason ERROR); the engine can go on with the others."""

    def __init__(self, message: str, outputs: list[EngineOutput]):
        super().__init__(message)
        self.outputs = outputs
