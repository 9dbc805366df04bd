"""The request fields that shape the response rather than the sampling, pure: ``n`` (and ``best_of``),
``logprobs`` / ``top_logprobs``, ``echo`` and ``stream_options``, validated into :class:`OutputOptions`
for :mod:`pipeline.serving.endpoints.openai_api` (a bad value is a 400 naming the field).

- ``n`` in [1, ``MAX_N``]: each choice is a sequence of its own in the engine, holding cache blocks, and
  an engine runs 16 sequences at once by default (``EngineConfig.max_num_seqs``): 16 choices still run
  side by side. ``best_of``, when given, must equal ``n`` (no server-side ranking of choices).
- ``logprobs``: for /v1/completions an integer in [0, ``MAX_LOGPROBS``] (OpenAI's legacy form: the top
  alternatives per token); for /v1/chat/completions a boolean, with ``top_logprobs`` in [0, 20] (which
  needs ``logprobs: true`` when above 0).
- ``echo`` (completions): a boolean; with ``logprobs`` it would need the prompt tokens' logprobs, which
  the engine does not compute (its model runner returns the logits of the sampled rows only): refused.
- ``stream_options`` (only with ``stream: true``): ``include_usage`` (a last chunk with the usage and no
  choices) and vLLM's ``continuous_usage_stats`` (every chunk carries the usage so far; as in vLLM, only
  together with ``include_usage``), both booleans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pipeline.engine.protocol import MAX_LOGPROBS, SEED_RANGE
from pipeline.serving.api_errors import invalid

MAX_N = 16
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


@dataclass(frozen=True)
class OutputOptions:
    n: int = 1
    logprobs: Optional[int] = None      # top alternatives per token; None: no logprobs
    echo: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


def choice_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed + index``, as vLLM seeds its
    parallel samples, wrapped into torch's range (the same generator state as ``(seed + index) mod 2**64``)."""
    if seed is None:
        return None
    s = seed + index
    return s - 2 ** 64 if s > SEED_RANGE[1] else s


def _int_field(body: Mapping[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name} must be an integer, got {v!r}", name)
    if not lo <= v <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}], got {v}", name)
    return v


def _bool_field(body: Mapping[str, Any], name: str, what: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean{what}, got {v!r}", name)
    return v


def parse_output_options(body: Mapping[str, Any], chat: bool, stream: bool) -> OutputOptions:
    n = _int_field(body, "n", 1, MAX_N) or 1
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):
        raise invalid(f"best_of must equal n ({n}) on this server (it does not rank choices), got {best_of!r}",
                      "best_of")
    if chat:
        wants = _bool_field(body, "logprobs", " for /v1/chat/completions (top_logprobs gives the alternatives)")
        top = _int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top and not wants:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (top or 0) if wants else None
        echo = False
    else:
        lp = body.get("logprobs")
        if lp is True:
            raise invalid(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] for /v1/completions (the number of "
                          "alternatives per token), got true", "logprobs")
        logprobs = None if lp is False else _int_field(body, "logprobs", 0, MAX_LOGPROBS)
        echo = _bool_field(body, "echo")
        if echo and logprobs is not None:
            raise invalid("echo with logprobs needs the prompt tokens' logprobs, which this server does not compute: "
                          "send echo or logprobs, not both", "echo")
    include_usage = continuous = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid(f"stream_options must be an object like {{'include_usage': true}}, got {options!r}",
                          "stream_options")
        unknown = sorted(k for k in options if k not in STREAM_OPTIONS)
        if unknown:
            raise invalid(f"stream_options: unrecognized option(s) {', '.join(map(str, unknown))} (known: "
                          f"{', '.join(STREAM_OPTIONS)})", "stream_options")
        for k in STREAM_OPTIONS:
            if not isinstance(options.get(k, False), bool):
                raise invalid(f"stream_options.{k} must be a boolean, got {options[k]!r}", "stream_options")
        if not stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        include_usage = options.get("include_usage", False)
        continuous = include_usage and options.get("continuous_usage_stats", False)  # as vLLM: needs both
    return OutputOptions(n, logprobs, echo, include_usage, continuous)
