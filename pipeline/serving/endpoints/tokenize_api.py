"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, pure: validation (a 400 naming the field, unknown
fields refused, ``model`` optional but, when given, the served one, else 404) and the responses.

- ``/tokenize`` takes ``{model?, prompt, add_special_tokens?, return_token_strs?}`` (a completions
  prompt string: ``add_special_tokens``, default true, puts the bos first, as /v1/completions does) or
  ``{model?, messages, add_generation_prompt?, add_special_tokens?, return_token_strs?}`` (the chat
  template, which writes the bos itself: ``add_special_tokens``, default false, would add another, as in
  vLLM); it answers ``{count, max_model_len, tokens}`` (and ``token_strs``, the vocabulary entries, when
  ``return_token_strs``).
- ``/detokenize`` takes ``{model?, tokens}`` (ids in the vocabulary) and answers ``{prompt}``, the text
  with special tokens shown (as vLLM decodes).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from pipeline.serving.endpoints import openai_api as api
from pipeline.serving.api_errors import invalid
from pipeline.serving.logprobs import TokenStrings

_TOKENIZE_PROMPT = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT = {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
_DETOKENIZE = {"model", "tokens"}


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean, got {v!r}", name)
    return v


def _model(body: Mapping[str, Any], served_model: str) -> None:
    if body.get("model") is not None:
        api._check_model(body, served_model)


def parse_tokenize(body: Mapping[str, Any], tokenizer, served_model: str) -> tuple[list[int], bool]:
    """The token ids of a /tokenize body, and whether to return their strings."""
    if "messages" in body and "prompt" in body:
        raise invalid("give prompt or messages, not both", "messages")
    chat = "messages" in body
    api._check_fields(body, _TOKENIZE_CHAT if chat else _TOKENIZE_PROMPT)
    _model(body, served_model)
    strs = _flag(body, "return_token_strs", False)
    if chat:
        messages = api._chat_messages(body.get("messages"))
        bos = _flag(body, "add_special_tokens", False)
        try:
            ids = tokenizer.encode_chat(messages, _flag(body, "add_generation_prompt", True))
        except ValueError as e:
            raise invalid(f"messages cannot be formatted with the chat template: {e}", "messages") from None
        return ([tokenizer.bos_id] if bos else []) + ids, strs
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt (or messages) is required", "prompt")
    if not isinstance(prompt, str):
        raise invalid(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    return tokenizer.encode(prompt, add_bos=_flag(body, "add_special_tokens", True)), strs


def tokenize_response(ids: list[int], max_model_len: int, strings: Optional[TokenStrings] = None) -> dict:
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if strings is not None:
        out["token_strs"] = [strings.raw(t) for t in ids]
    return out


def parse_detokenize(body: Mapping[str, Any], tokenizer, served_model: str) -> list[int]:
    api._check_fields(body, _DETOKENIZE)
    _model(body, served_model)
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("tokens is required", "tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid(f"tokens must be a list of token ids (integers), got {tokens!r:.80}", "tokens")
    vocab = tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"tokens must be ids in [0, {vocab}), got {bad}", "tokens")
    return tokens


def detokenize_response(tokenizer, ids: list[int]) -> dict:
    return {"prompt": tokenizer.decode(ids, skip_special=False)}
