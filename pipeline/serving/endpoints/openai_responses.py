"""OpenAI responses, pure: the completion / chat.completion objects (one choice per ``index``, logprobs in the
shapes of :mod:`pipeline.serving.logprobs`), streaming chunks as SSE lines (each names its choice's
``index``; with ``stream_options.include_usage`` every chunk has ``usage``: null, or with
``continuous_usage_stats`` the usage so far, and a last chunk without choices carries the total), usage
(prompt tokens once, completion tokens summed over the choices), and the model list. Requests are
validated in :mod:`pipeline.serving.endpoints.openai_api`; a choice's events become its text and chunks in
:mod:`pipeline.serving.endpoints.choices`."""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Optional

from pipeline.serving.endpoints.openai_api import COMPLETION, GenerateRequest

DONE_LINE = "data: [DONE]\n\n"


# ----- responses --------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_finish_reason(reason: Optional[str]) -> Optional[str]:
    """The engine's finish reason as OpenAI names it ("abort" never reaches a client that is still there)."""
    return {"stop": "stop", "length": "length", "abort": "stop"}.get(reason, reason) if reason else None


def choice(req: GenerateRequest, index: int, text: Optional[str], finish_reason: Optional[str],
           logprobs: Optional[dict] = None, reasoning: Any = False, tool_calls: Optional[list] = None) -> dict:
    """One choice of a non-streaming response: a completion's ``text``, or a chat's assistant message
    (with ``reasoning_content`` when a reasoning parser runs, ``reasoning`` not False; with
    ``tool_calls`` when the output made any)."""
    reason = openai_finish_reason(finish_reason)
    if req.kind == COMPLETION:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    message: dict = {"role": "assistant", "content": text}
    if reasoning is not False:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def choices_response(req: GenerateRequest, choices: list[dict], completion_tokens: int,
                     created: Optional[int] = None) -> dict:
    """The non-streaming response for the request's kind (``text_completion`` or ``chat.completion``);
    ``completion_tokens``: all the choices'."""
    return {"id": req.request_id, "object": "text_completion" if req.kind == COMPLETION else "chat.completion",
            "created": created or int(time.time()), "model": req.model, "choices": choices,
            "usage": usage(req.num_prompt_tokens, completion_tokens)}


def response(req: GenerateRequest, text: str, finish_reason: str, completion_tokens: int,
             created: Optional[int] = None, logprobs: Optional[dict] = None) -> dict:
    """The non-streaming response of one choice."""
    return choices_response(req, [choice(req, 0, text, finish_reason, logprobs)], completion_tokens, created)


def sse(payload: Mapping[str, Any]) -> str:
    """One server-sent event line: ``data: {json}`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stream_chunk(req: GenerateRequest, created: int, text: Optional[str], finish_reason: Optional[str] = None,
                 first: bool = False, index: int = 0, logprobs: Optional[dict] = None,
                 completion_tokens: int = 0, reasoning: str = "", tool_calls: Optional[list] = None) -> dict:
    """A streaming chunk of choice ``index``: ``text_completion`` with ``text``, or
    ``chat.completion.chunk`` with a ``delta`` (the first one carries the role; an empty text, an empty
    delta). ``finish_reason`` rides on the chunk of the choice's last text, ``logprobs`` are those of the
    chunk's tokens. ``completion_tokens``: all the choices' so far, for ``continuous_usage_stats``."""
    reason = openai_finish_reason(finish_reason)
    if req.kind == COMPLETION:
        out = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None and (text or first):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        out = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    chunk = {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [out]}
    if req.include_usage:
        chunk["usage"] = usage(req.num_prompt_tokens, completion_tokens) if req.continuous_usage else None
    return chunk


def usage_chunk(req: GenerateRequest, created: int, completion_tokens: int) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    obj = "text_completion" if req.kind == COMPLETION else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(req.num_prompt_tokens, completion_tokens)}


def models_response(served_model: str, max_model_len: int, created: int = 0) -> dict:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                        "owned_by": "dsquant", "max_model_len": max_model_len}]}
