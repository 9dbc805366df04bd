"""The OpenAI HTTP API, pure (no Ray, no FastAPI): request validation (responses, streaming chunks and
incremental detokenization are in :mod:`pipeline.serving.endpoints.openai_responses`; /tokenize and /detokenize in
:mod:`pipeline.serving.endpoints.tokenize_api`).

Requests (``/v1/completions``, ``/v1/chat/completions``) are parsed by :func:`parse_completion` and
:func:`parse_chat` into a frozen :class:`GenerateRequest` (prompt token ids, :class:`SamplingParams`,
stream flag, the output options), or refused with an :class:`ApiError` whose :meth:`ApiError.body` is
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``:

- 400 ``invalid_request_error``: a malformed or out-of-range field (the message names it), an empty
  prompt or message list, an unknown role, a field this server does not support (``suffix``, ``echo``
  together with ``logprobs``, ``best_of`` other than ``n``) or does not know (vLLM's ``prompt_logprobs``
  among them), a schema, grammar or tool the grammar engine cannot compile, and a prompt that does not fit
  the context (code ``context_length_exceeded``, with the token counts and the limit);
- 404 ``invalid_request_error`` with code ``model_not_found`` for a model this server does not serve.

Output (:mod:`pipeline.serving.api_options`): ``n`` choices in [1, 16] (choice i of a seeded request uses
``seed + i``, as vLLM does), ``logprobs`` (completions: 0..20 alternatives; chat: ``logprobs: true`` and
``top_logprobs`` 0..20; raw logprobs, before temperature and penalties, see pipeline.engine.core.sampling),
``echo`` (completions: the prompt text before each choice's text), ``stream_options`` (``include_usage``,
``continuous_usage_stats``).

Sampling: ``max_tokens`` (chat also ``max_completion_tokens``) defaults to 16 for completions (capped by
the room left in the context) and to the whole room left for chat; an explicit value with the prompt must
fit the context. ``temperature`` in [0, 2] (0, or below ``sampling.MIN_TEMPERATURE``, is greedy), ``top_p``
in (0, 1], ``top_k`` (an extension, 0 or -1 disables it), ``seed`` (in torch's range, [-2**63, 2**64)),
``stop`` (a string or up to 4 strings, each at most ``MAX_STOP_CHARS`` characters); vLLM's extensions
that its benchmark client always sends and users rely on: ``ignore_eos`` (boolean), ``min_tokens`` (in
[0, max_tokens]), ``repetition_penalty`` (in (0, 2]); and OpenAI's ``presence_penalty`` and
``frequency_penalty`` (in [-2, 2]); ``logit_bias`` as OpenAI defines it (token ids, as strings or
integers, in the vocabulary; values in [-100, 100]; at most ``MAX_LOGIT_BIAS`` entries), added to the
logits before sampling.

Structured outputs (:mod:`pipeline.serving.structured_outputs`: ``response_format``, vLLM's
``guided_*`` and ``structured_outputs``), tools (chat: :mod:`pipeline.serving.tool_calls`: ``tools``,
``tool_choice``, ``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages) and R1's
reasoning split (chat: :mod:`pipeline.serving.reasoning`) are parsed here too: a constraint becomes
``SamplingParams.grammar``, the tools and the reasoning parser ride in the request for its responses.

Text: a chat message's content is tokenized as plain text (a special-token string in it, such as
``<｜Assistant｜>``, becomes ordinary tokens: only the chat template's structure yields special ids). A
completions ``prompt`` string is the model's raw input, as in vLLM: special-token strings in it are
honoured (the caller could send the ids themselves anyway). A body must be a JSON object nested at most
``MAX_JSON_DEPTH`` deep, whose strings are valid Unicode (no lone surrogate): else 400, naming the field.

A request's id is made here, once (:func:`request_id`, called by the ingress for each HTTP request):
``cmpl-`` or ``chatcmpl-`` and the request's X-Request-ID (the client's, or the one Serve's HTTP proxy
gave it). It is the response's ``id`` and the engine requests' (:meth:`GenerateRequest.engine_request`:
each choice's ``EngineRequest``), whose ``EngineOutput`` s the ingress turns into text, logprobs and
responses with :mod:`pipeline.serving.endpoints.choices` and :mod:`pipeline.serving.endpoints.openai_responses`.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from pipeline.engine.protocol import SEED_RANGE, EngineRequest, SamplingParams
from pipeline.serving.api_errors import ApiError, invalid
from pipeline.serving.api_options import OutputOptions, choice_seed, parse_output_options
from pipeline.serving.structured_outputs import FIELDS as STRUCTURED_FIELDS
from pipeline.serving.structured_outputs import parse_structured
from pipeline.serving.tool_calls import ToolSpec, call_grammar, check_messages_tools, dialect_of, parse_tools
from pipeline.serving.tool_calls import with_tools_prompt

COMPLETION, CHAT = "completion", "chat"
DEFAULT_COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4                    # OpenAI's limit
MAX_STOP_CHARS = 256                    # per stop string: bounds the matching work per token
MAX_JSON_DEPTH = 32                     # an OpenAI body needs 5 levels; deeper is refused, not recursed into
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGIT_BIAS = 300                    # OpenAI's limit on logit_bias entries
LOGIT_BIAS_RANGE = 100.0                # ... and on each value, [-100, 100]

# An X-Request-ID taken as the request's id (the rule of actors.serving.app.serve_proxy, which cleans it in Serve's proxy)
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

_IGNORED = {"user"}                     # accepted, not used
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
           "ignore_eos", "min_tokens", "repetition_penalty"}   # the last three: vLLM's extensions
_COMMON |= set(STRUCTURED_FIELDS)
_COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt", "echo", "suffix", "best_of"}
_CHAT_FIELDS = _COMMON | _IGNORED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                     "parallel_tool_calls"}


@dataclass(frozen=True)
class GenerateRequest:
    """A validated request, what the engine-owning deployment takes: generate from ``prompt_ids`` with
    ``params``. The rest is for the ingress (response shape and streaming); ``n`` choices are ``n``
    engine requests, :meth:`choice` (each its own seed)."""

    kind: str                       # COMPLETION or CHAT
    model: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False     # stream_options.include_usage: a last chunk with the usage
    request_id: str = ""
    n: int = 1
    echo: Optional[str] = None      # completions with echo: the prompt text, before each choice's text
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far on every chunk
    reasoning: Optional[str] = None     # chat: the reasoning parser ("deepseek_r1") splitting the output
    tools: Optional[ToolSpec] = None    # chat: the tools whose calls are parsed from the output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def engine_request(self, index: int) -> EngineRequest:
        """The engine's request for choice ``index``: the request's id (``<id>-<index>`` when n > 1), its
        prompt, its sampling parameters with seed ``seed + index`` (api_options.choice_seed); the choices of
        one request share a scheduling group (the request id: the engine shares its slots fairly between
        requests)."""
        if self.n == 1:
            return EngineRequest(self.request_id, self.prompt_ids, self.params)
        return EngineRequest(f"{self.request_id}-{index}", self.prompt_ids,
                             replace(self.params, seed=choice_seed(self.params.seed, index), group=self.request_id))


def request_id(kind: str, given: Optional[str] = None) -> str:
    """The id of one HTTP request (its response's ``id``, its engine requests', its log lines): ``cmpl-``
    for a completion, ``chatcmpl-`` for a chat, then ``given`` (the request's X-Request-ID) when it is
    1-128 of ``A-Za-z0-9._:-``, else a fresh random hex id."""
    prefix = "cmpl" if kind == COMPLETION else "chatcmpl"
    return f"{prefix}-{given if given and VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex}"


# ----- parsing -----------------------------------------------------------------------------------------

def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying why not."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_json_values(body)
    return body


def _check_json_values(body: dict) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH, or holding a string (or key) that is not valid
    Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes allow): a 400 naming where. Iterative,
    so no depth can overflow the stack."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"the request body is nested too deeply at {path} (at most {MAX_JSON_DEPTH} levels)",
                          path.split(".")[0].split("[")[0] or None)
        if isinstance(value, dict):
            for k, v in value.items():
                _check_unicode(k, f"{path}.{k!r}" if path else repr(k))
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))  # k is valid Unicode now
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        name = where.split(".")[0].split("[")[0]
        raise invalid(f"{where} is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}",
                      name) from None


def parse_completion(body: Mapping[str, Any], tokenizer, served_model: str, max_model_len: int,
                     rid: Optional[str] = None) -> GenerateRequest:
    """Validate a ``/v1/completions`` body (prompt: a string, a list of token ids, or a list of one of
    either; encoded with bos, as the engine's own tests encode plain text). ``rid``: the request's id
    (:func:`request_id`; a fresh one when None)."""
    _check_fields(body, _COMPLETION_FIELDS)
    model = _check_model(body, served_model)
    if body.get("suffix") not in (None, ""):
        raise invalid("suffix (insertion) is not supported by this server", "suffix")
    prompt_ids = _completion_prompt(body.get("prompt"), tokenizer)
    structured = parse_structured(body, tokenizer)
    req = _finish_parse(body, COMPLETION, model, prompt_ids, max_model_len, DEFAULT_COMPLETION_MAX_TOKENS,
                        rid=rid or request_id(COMPLETION), logit_bias=_logit_bias(body, tokenizer),
                        grammar=structured[0] if structured else None)
    if req.echo is not None:  # a text prompt as sent; token ids decoded as the model reads them (specials shown)
        raw = body["prompt"]
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
            raw = raw[0]  # a batch of one
        req = replace(req, echo=raw if isinstance(raw, str) else tokenizer.decode(prompt_ids, skip_special=False))
    return req


def parse_chat(body: Mapping[str, Any], tokenizer, served_model: str, max_model_len: int,
               rid: Optional[str] = None, reasoning: Optional[str] = None,
               constrain_reasoning: bool = False) -> GenerateRequest:
    """Validate a ``/v1/chat/completions`` body; the messages go through the model's chat template with
    the generation prompt (``<｜Assistant｜>``) added (with tools, or tool calls and results in the
    messages, through a template with DeepSeek's tool branches: the checkpoint's own when it has them,
    else chat_templates.DEEPSEEK_V3_TOOLS). ``rid``: as parse_completion's; ``reasoning``: the reasoning
    parser in use (reasoning.parser_for), None for none; with one, a constraint starts after the reasoning
    unless ``constrain_reasoning`` (vLLM's ``enable_in_reasoning``: the whole output is constrained)."""
    _check_fields(body, _CHAT_FIELDS)
    model = _check_model(body, served_model)
    messages = _chat_messages(body.get("messages"))
    tools, choice = parse_tools(body, tokenizer)
    structured = parse_structured(body, tokenizer)
    own = dialect_of(tokenizer.chat_template)
    dialect = own or "v3"
    uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    template = None
    if uses_tools and own is None:
        from pipeline.text.chat_templates import DEEPSEEK_V3_TOOLS
        template = DEEPSEEK_V3_TOOLS
    offered = tools and choice != "none"
    if offered and "tools" not in (template or tokenizer.chat_template or ""):
        messages = with_tools_prompt(messages, tools, dialect)
    try:
        prompt_ids = tokenizer.encode_chat(messages, template=template, **({"tools": tools} if offered else {}))
    except ValueError as e:
        raise invalid(f"messages cannot be formatted with the chat template: {e}", "messages") from None
    grammar = structured[0] if structured else None
    spec = None
    if offered:
        spec = ToolSpec(tuple(t["name"] for t in tools), choice, dialect, named=choice not in ("auto", "required"))
        if choice != "auto":
            if structured:
                raise invalid(f"tool_choice {choice!r} forces a tool call: it cannot be combined with "
                              f"{structured[1]}", "tool_choice")
            from pipeline.serving.structured_outputs import compile_or_400
            grammar = compile_or_400(tokenizer, _lark(call_grammar(tools, choice, body.get("parallel_tool_calls")
                                                                   is not False, dialect, tokenizer)),
                                     "tool_choice", "tool_choice")
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] is not None \
            and body["max_completion_tokens"] is not None:
        raise invalid("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
        param = "max_completion_tokens"
    else:
        param = "max_tokens"
    if grammar is not None and reasoning and not constrain_reasoning:  # the reasoning before the answer is free
        from pipeline.serving.structured_outputs import after_reasoning, compile_or_400
        grammar = compile_or_400(tokenizer, after_reasoning(grammar), structured[1] if structured else "tool_choice",
                                 structured[1] if structured else "tool_choice")
    req = _finish_parse(body, CHAT, model, prompt_ids, max_model_len, None, max_tokens_param=param,
                        rid=rid or request_id(CHAT), logit_bias=_logit_bias(body, tokenizer), grammar=grammar)
    return replace(req, reasoning=reasoning, tools=spec)


def _lark(text: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(text)


def _logit_bias(body: Mapping[str, Any], tokenizer) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {token id (a string or integer): bias in [-100, 100]}, at most
    MAX_LOGIT_BIAS entries, ids in the vocabulary; a 400 naming logit_bias otherwise."""
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise invalid(f"logit_bias must be an object mapping token ids to biases, got {lb!r}", "logit_bias")
    if len(lb) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(lb)}", "logit_bias")
    vocab = tokenizer.vocab_size
    out = []
    for k, v in lb.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise invalid(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not 0 <= t < vocab:
            raise invalid(f"logit_bias token ids must be in [0, {vocab}), got {t}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
            raise invalid(f"logit_bias[{k!r}] must be a number in [-100, 100], got {v!r}", "logit_bias")
        out.append((t, float(v)))
    return tuple(sorted(out))


def _check_fields(body: Mapping[str, Any], known: set) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise invalid(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])


def _check_model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None:
        raise invalid(f"model is required (this server serves {served_model!r})", "model")
    if not isinstance(model, str):
        raise invalid(f"model must be a string, got {type(model).__name__}", "model")
    if model != served_model:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served_model!r}",
                       "invalid_request_error", "model", "model_not_found")
    return model


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _completion_prompt(prompt: Any, tokenizer) -> tuple[int, ...]:
    if prompt is None:
        raise invalid("prompt is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt is empty", "prompt")
        return tuple(tokenizer.encode(prompt))
    if _is_token_list(prompt):
        vocab = tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise invalid(f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt")
        return tuple(prompt)
    if isinstance(prompt, list) and not prompt:
        raise invalid("prompt is empty", "prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request", "prompt")
    raise invalid("prompt must be a string, a list of token ids, or a list holding one of either, got "
                  f"{type(prompt).__name__}", "prompt")


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"messages[{i}].content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                              f"got {kind!r}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}",
                  "messages")


def _chat_messages(messages: Any) -> list[dict]:
    if messages is None:
        raise invalid("messages is required", "messages")
    if not isinstance(messages, list):
        raise invalid(f"messages must be a list, got {type(messages).__name__}", "messages")
    if not messages:
        raise invalid("messages is empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object, got {type(m).__name__}", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", "messages")
        calls = m.get("tool_calls") if role == "assistant" else None
        if m.get("content") is None and not calls:
            raise invalid(f"messages[{i}].content is required", "messages")
        msg = {"role": "system" if role == "developer" else role,
               "content": None if m.get("content") is None else _message_text(m["content"], i)}
        if calls is not None:
            msg["tool_calls"] = [{"type": "function", **c} if isinstance(c, dict) else c for c in calls]
        out.append(msg)
    check_messages_tools(out)
    if not any(m["role"] == "user" for m in out):
        raise invalid("messages needs at least one message with role 'user'", "messages")
    return out


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"{name} must be a number, got {v!r}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise invalid(f"{name} must be in {interval}, got {v:g}", name)
    return float(v)


def _integer(body: Mapping[str, Any], name: str) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name} must be an integer, got {v!r}", name)
    return v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise invalid("stop strings must not be empty", "stop")
    longest = max(range(len(stop)), key=lambda i: len(stop[i]))
    if len(stop[longest]) > MAX_STOP_CHARS:
        raise invalid(f"stop strings may have at most {MAX_STOP_CHARS} characters; stop[{longest}] has "
                      f"{len(stop[longest])}", "stop")
    return tuple(stop)


def _finish_parse(body: Mapping[str, Any], kind: str, model: str, prompt_ids: Sequence[int], max_model_len: int,
                  default_max_tokens: Optional[int], max_tokens_param: str = "max_tokens",
                  rid: str = "", logit_bias: tuple = (), grammar: Optional[str] = None) -> GenerateRequest:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid(f"stream must be a boolean, got {stream!r}", "stream")
    out: OutputOptions = parse_output_options(body, kind == CHAT, bool(stream))
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < -1:
        raise invalid(f"top_k must be >= 0 (or -1 to disable it), got {top_k}", "top_k")
    seed = _integer(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise invalid(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}", "seed")
    stop = _stop(body)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid(f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    penalties = {"repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
                 "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
                 "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0)}
    min_tokens = _integer(body, "min_tokens") or 0
    max_tokens = _integer(body, "max_tokens")
    n_prompt = len(prompt_ids)
    if n_prompt >= max_model_len:
        raise invalid(f"the prompt has {n_prompt} tokens but this model's context is {max_model_len} tokens "
                      f"(at most {max_model_len - 1} prompt tokens, to leave room for one generated token); "
                      "shorten the prompt", "messages" if kind == CHAT else "prompt", "context_length_exceeded")
    room = max_model_len - n_prompt
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens < 1:
        raise invalid(f"{max_tokens_param} must be >= 1, got {max_tokens}", max_tokens_param)
    elif max_tokens > max_model_len:
        raise invalid(f"{max_tokens_param} is {max_tokens} but this model's context is {max_model_len} tokens",
                      max_tokens_param)
    elif n_prompt + max_tokens > max_model_len:
        raise invalid(f"this model's context is {max_model_len} tokens; the request has {n_prompt} prompt tokens "
                      f"and asks for {max_tokens} more ({max_tokens_param}), {n_prompt + max_tokens} in all; "
                      f"lower {max_tokens_param} to at most {room} or shorten the prompt", max_tokens_param,
                      "context_length_exceeded")
    if not 0 <= min_tokens <= max_tokens:
        raise invalid(f"min_tokens must be in [0, {max_tokens_param}={max_tokens}], got {min_tokens}", "min_tokens")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                            top_k=0 if top_k in (None, -1) else top_k, top_p=top_p, seed=seed, stop=stop,
                            ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=out.logprobs,
                            logit_bias=logit_bias, grammar=grammar, **penalties)
    return GenerateRequest(kind, model, tuple(prompt_ids), params, bool(stream), out.include_usage, rid, out.n,
                           "" if out.echo else None, out.continuous_usage)
