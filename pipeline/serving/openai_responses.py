"""OpenAI responses, pure: the text of a growing output sent only once stable
(:class:`IncrementalDetokenizer`: a trailing replacement character, or a tail that may still become a stop
string, is held back), the completion / chat.completion objects, streaming chunks as SSE lines, usage, and
the model list. Requests are validated in :mod:`pipeline.serving.openai_api`."""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping, Optional

from pipeline.engine.sampling import cut_at_stop
from pipeline.serving.openai_api import CHAT, COMPLETION, GenerateRequest

DONE_LINE = "data: [DONE]\n\n"


# ----- incremental detokenization --------------------------------------------------------------------

class IncrementalDetokenizer:
    """Text of a growing list of token ids, sent only once stable. Each :meth:`add` decodes the whole
    output and returns the new suffix, holding back a trailing replacement character (an incomplete
    multi-byte character) and any tail that could still grow into a stop string; once a stop string
    appears the text is cut before it and :attr:`stopped` is set. :meth:`finish` returns whatever was held
    back. The concatenation of all returned pieces equals :attr:`text`, the full output cut at its first
    stop string (what ``LLMEngine.text`` returns)."""

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    @property
    def text(self) -> str:
        return cut_at_stop(self.tokenizer.decode(self.ids), self.stop)[0]

    def add(self, token_ids: Iterable[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text, self.stopped = cut_at_stop(self.tokenizer.decode(self.ids), self.stop)
        if not self.stopped:
            text = text.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._emit(text)

    def finish(self) -> str:
        return self._emit(self.text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent):  # a decode that rewrote earlier text: send nothing until it settles
            return ""
        new = text[len(self.sent):]
        self.sent = text
        return new


# ----- responses --------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_finish_reason(reason: Optional[str]) -> Optional[str]:
    """The engine's finish reason as OpenAI names it ("abort" never reaches a client that is still there)."""
    return {"stop": "stop", "length": "length", "abort": "stop"}.get(reason, reason) if reason else None


def completion_response(req: GenerateRequest, text: str, finish_reason: str, completion_tokens: int,
                        created: Optional[int] = None) -> dict:
    """A ``text_completion`` object (one choice)."""
    return {"id": req.request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": openai_finish_reason(finish_reason)}],
            "usage": usage(req.num_prompt_tokens, completion_tokens)}


def chat_response(req: GenerateRequest, text: str, finish_reason: str, completion_tokens: int,
                  created: Optional[int] = None) -> dict:
    """A ``chat.completion`` object (one choice, the assistant's message)."""
    return {"id": req.request_id, "object": "chat.completion", "created": created or int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": openai_finish_reason(finish_reason)}],
            "usage": usage(req.num_prompt_tokens, completion_tokens)}


def response(req: GenerateRequest, text: str, finish_reason: str, completion_tokens: int,
             created: Optional[int] = None) -> dict:
    """The non-streaming response for the request's kind."""
    build = chat_response if req.kind == CHAT else completion_response
    return build(req, text, finish_reason, completion_tokens, created)


def sse(payload: Mapping[str, Any]) -> str:
    """One server-sent event line: ``data: {json}`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stream_chunk(req: GenerateRequest, created: int, text: Optional[str], finish_reason: Optional[str] = None,
                 first: bool = False) -> dict:
    """A streaming chunk: ``text_completion`` with ``text``, or ``chat.completion.chunk`` with a ``delta``
    (the first one carries the role; the one with ``finish_reason`` an empty delta)."""
    reason = openai_finish_reason(finish_reason)
    if req.kind == COMPLETION:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None and (text or first):
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenerateRequest, created: int, completion_tokens: int) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    obj = "text_completion" if req.kind == COMPLETION else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(req.num_prompt_tokens, completion_tokens)}


def models_response(served_model: str, max_model_len: int, created: int = 0) -> dict:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                        "owned_by": "dsquant", "max_model_len": max_model_len}]}
