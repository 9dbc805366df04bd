"""pipeline.serving.endpoints.openai_api and pipeline.serving.endpoints.openai_responses: request validation
(status, type, param, code and a message naming what is wrong), response and chunk shapes, and incremental
detokenization (streamed pieces add up to the full text, never send an incomplete character or a stop
string's beginning)."""

from __future__ import annotations

import json

import pytest

from pipeline.engine.core.detokenizer import Detokenizer
from pipeline.serving.endpoints import openai_api as api
from pipeline.serving.endpoints import openai_responses as resp
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.engine.protocol import SamplingParams
from pipeline.text.tokenizer import Tokenizer

MODEL = "dsv3-tiny-pydoc-w8a8-fa3"
CTX = 256


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(EMBEDDED_MODEL_DIR)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What's deep learning?"}], **kw}


def completion_body(**kw) -> dict:
    return {"model": MODEL, "prompt": "The os module", **kw}


def refused(parse, body, tok, ctx: int = CTX) -> api.ApiError:
    with pytest.raises(api.ApiError) as e:
        parse(body, tok, MODEL, ctx)
    return e.value


# ----- parsing ------------------------------------------------------------------------------------------

def test_chat_defaults(tok):
    req = api.parse_chat(chat_body(), tok, MODEL, CTX)
    ids = tok.encode_chat([{"role": "user", "content": "What's deep learning?"}])
    assert req.kind == api.CHAT and req.model == MODEL and req.prompt_ids == tuple(ids)
    assert req.params == SamplingParams(max_new_tokens=CTX - len(ids), temperature=1.0)  # the whole room left
    assert req.stream is False and req.include_usage is False
    assert req.request_id.startswith("chatcmpl-") and len(req.request_id) == len("chatcmpl-") + 32


def test_chat_all_fields(tok):
    body = chat_body(messages=[{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
                     max_completion_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=11, stop="\n", stream=True,
                     stream_options={"include_usage": True}, n=1, user="u1", presence_penalty=0)
    req = api.parse_chat(body, tok, MODEL, CTX)
    assert req.prompt_ids == tuple(tok.encode_chat([{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi there"}]))
    assert req.params == SamplingParams(max_new_tokens=7, temperature=0.0, top_k=3, top_p=0.5, seed=11, stop=("\n",))
    assert req.stream is True and req.include_usage is True


def test_completion_defaults_and_prompt_forms(tok):
    req = api.parse_completion(completion_body(), tok, MODEL, CTX)
    assert req.kind == api.COMPLETION and req.prompt_ids == tuple(tok.encode("The os module"))
    assert req.params.max_new_tokens == 16 and req.request_id.startswith("cmpl-")
    assert api.parse_completion(completion_body(prompt=["abc"]), tok, MODEL, CTX).prompt_ids == tuple(tok.encode("abc"))
    assert api.parse_completion(completion_body(prompt=[5, 6, 7]), tok, MODEL, CTX).prompt_ids == (5, 6, 7)
    assert api.parse_completion(completion_body(prompt=[[5, 6]]), tok, MODEL, CTX).prompt_ids == (5, 6)
    # the default 16 shrinks to the room left; top_k -1 disables the filter
    ids = list(range(10, 10 + CTX - 4))
    req = api.parse_completion(completion_body(prompt=ids, top_k=-1), tok, MODEL, CTX)
    assert req.params.max_new_tokens == 4 and req.params.top_k == 0


def test_stop_forms(tok):
    assert api.parse_completion(completion_body(stop=["a", "bc"]), tok, MODEL, CTX).params.stop == ("a", "bc")
    e = refused(api.parse_completion, completion_body(stop=["a", "b", "c", "d", "e"]), tok)
    assert (e.status, e.param, e.message) == (400, "stop", "stop takes at most 4 strings, got 5")
    e = refused(api.parse_completion, completion_body(stop=[""]), tok)
    assert (e.param, e.message) == ("stop", "stop strings must not be empty")
    e = refused(api.parse_completion, completion_body(stop=3), tok)
    assert (e.param, e.message) == ("stop", "stop must be a string or a list of strings, got 3")


@pytest.mark.parametrize("field, value, param, message", [
    ("max_tokens", -1, "max_tokens", "max_tokens must be >= 1, got -1"),
    ("max_tokens", 0, "max_tokens", "max_tokens must be >= 1, got 0"),
    ("max_tokens", 10**9, "max_tokens", f"max_tokens is 1000000000 but this model's context is {CTX} tokens"),
    ("max_tokens", "10", "max_tokens", "max_tokens must be an integer, got '10'"),
    ("max_tokens", 2.5, "max_tokens", "max_tokens must be an integer, got 2.5"),
    ("max_tokens", True, "max_tokens", "max_tokens must be an integer, got True"),
    ("temperature", 5, "temperature", "temperature must be in [0, 2], got 5"),
    ("temperature", -0.1, "temperature", "temperature must be in [0, 2], got -0.1"),
    ("temperature", "hot", "temperature", "temperature must be a number, got 'hot'"),
    ("top_p", 0, "top_p", "top_p must be in (0, 1], got 0"),
    ("top_p", 1.5, "top_p", "top_p must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k", "top_k must be >= 0 (or -1 to disable it), got -2"),
    ("seed", "x", "seed", "seed must be an integer, got 'x'"),
    ("n", 17, "n", "n must be in [1, 16], got 17"),
    ("n", 0, "n", "n must be in [1, 16], got 0"),
    ("n", "2", "n", "n must be an integer, got '2'"),
    ("stream", "yes", "stream", "stream must be a boolean, got 'yes'"),
    ("frequency_penalty", 2.5, "frequency_penalty", "frequency_penalty must be in [-2, 2], got 2.5"),
    ("presence_penalty", "x", "presence_penalty", "presence_penalty must be a number, got 'x'"),
    ("repetition_penalty", 0, "repetition_penalty", "repetition_penalty must be in (0, 2], got 0"),
    ("ignore_eos", "yes", "ignore_eos", "ignore_eos must be a boolean, got 'yes'"),
    ("min_tokens", "x", "min_tokens", "min_tokens must be an integer, got 'x'"),
    ("logprobs", "yes", "logprobs", None),   # the message differs by route: tests/test_api_fields.py
    ("logit_bias", {"5": 101}, "logit_bias", "logit_bias['5'] must be a number in [-100, 100], got 101"),
    ("stream_options", {"include_usage": True}, "stream_options", "stream_options is only allowed with stream=true"),
    ("bogus", 1, "bogus", "unrecognized request argument(s): bogus"),
])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_bad_fields_are_400_naming_the_field(tok, kind, field, value, param, message):
    parse, body = (api.parse_chat, chat_body) if kind == "chat" else (api.parse_completion, completion_body)
    e = refused(parse, body(**{field: value}), tok)
    message = e.message if message is None else message
    assert (e.status, e.type, e.param, e.message) == (400, "invalid_request_error", param, message)
    assert e.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": None}}


def test_echo_with_logprobs_and_suffix_refused(tok):
    e = refused(api.parse_completion, completion_body(echo=True, logprobs=1), tok)
    assert (e.status, e.param, e.message) == (400, "echo", "echo with logprobs needs the prompt tokens' logprobs, "
                                                           "which this server does not compute: send echo or "
                                                           "logprobs, not both")
    assert api.parse_completion(completion_body(echo=False), tok, MODEL, CTX).echo is None  # false is fine
    e = refused(api.parse_completion, completion_body(suffix="x"), tok)
    assert (e.status, e.param) == (400, "suffix")


def test_unknown_and_missing_model(tok):
    e = refused(api.parse_chat, chat_body(model="gpt-4"), tok)
    assert (e.status, e.type, e.param, e.code) == (404, "invalid_request_error", "model", "model_not_found")
    assert e.message == f"the model 'gpt-4' does not exist; this server serves '{MODEL}'"
    e = refused(api.parse_completion, {"prompt": "x"}, tok)
    assert (e.status, e.param, e.message) == (400, "model", f"model is required (this server serves '{MODEL}')")


@pytest.mark.parametrize("messages, message", [
    (None, "messages is required"),
    ([], "messages is empty"),
    ("hi", "messages must be a list, got str"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role must be one of system, developer, user, assistant, "
                                           "tool, got 'wizard'"),
    ([{"role": "user"}], "messages[0].content is required"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string or a list of text parts, got int"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0] must be a text part ({'type': 'text', 'text': ...}); got 'image_url'"),
    ([{"role": "system", "content": "x"}], "messages needs at least one message with role 'user'"),
    (["hi"], "messages[0] must be an object, got str"),
])
def test_bad_messages(tok, messages, message):
    body = chat_body()
    if messages is None:
        del body["messages"]
    else:
        body["messages"] = messages
    e = refused(api.parse_chat, body, tok)
    assert (e.status, e.param, e.message) == (400, "messages", message)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    (None, "prompt is required"),
    (["a", "b"], "prompt holds 2 prompts; this server takes one prompt per request"),
    ([1, 99999], "prompt token ids must be in [0, 4096), got 99999"),
    ({"text": "x"}, "prompt must be a string, a list of token ids, or a list holding one of either, got dict"),
])
def test_bad_prompts(tok, prompt, message):
    assert tok.vocab_size == 4096
    body = completion_body(prompt=prompt)
    if prompt is None:
        del body["prompt"]
    e = refused(api.parse_completion, body, tok)
    assert (e.status, e.param, e.message) == (400, "prompt", message)


def test_context_limits(tok):
    ids = list(range(10, 10 + CTX))
    e = refused(api.parse_completion, completion_body(prompt=ids), tok)
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    assert e.message == (f"the prompt has {CTX} tokens but this model's context is {CTX} tokens (at most {CTX - 1} "
                         "prompt tokens, to leave room for one generated token); shorten the prompt")
    e = refused(api.parse_completion, completion_body(prompt=ids[:CTX - 10], max_tokens=20), tok)
    assert (e.status, e.param, e.code) == (400, "max_tokens", "context_length_exceeded")
    assert e.message == (f"this model's context is {CTX} tokens; the request has {CTX - 10} prompt tokens and asks "
                         f"for 20 more (max_tokens), {CTX + 10} in all; lower max_tokens to at most 10 or shorten "
                         "the prompt")
    assert api.parse_completion(completion_body(prompt=ids[:CTX - 10], max_tokens=10), tok, MODEL,
                                CTX).params.max_new_tokens == 10
    long_chat = chat_body(messages=[{"role": "user", "content": "word " * 400}])
    e = refused(api.parse_chat, long_chat, tok)
    n = len(tok.encode_chat(long_chat["messages"]))
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
    assert e.message.startswith(f"the prompt has {n} tokens but this model's context is {CTX} tokens")
    e = refused(api.parse_chat, chat_body(max_tokens=5, max_completion_tokens=5), tok)
    assert (e.param, e.message) == ("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")


def test_json_body():
    assert api.parse_json_body(b'{"a": 1}') == {"a": 1}
    with pytest.raises(api.ApiError) as e:
        api.parse_json_body(b'{"model": ')
    assert e.value.status == 400 and e.value.message.startswith("the request body is not valid JSON: Expecting value")
    with pytest.raises(api.ApiError) as e:
        api.parse_json_body(b"[1, 2]")
    assert e.value.message == "the request body must be a JSON object, got list"


# ----- responses ----------------------------------------------------------------------------------------

def test_response_shapes(tok):
    req = api.parse_chat(chat_body(), tok, MODEL, CTX)
    r = resp.response(req, "Hello", "length", 3, created=100)
    n = req.num_prompt_tokens
    assert r == {"id": req.request_id, "object": "chat.completion", "created": 100, "model": MODEL,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                              "finish_reason": "length"}],
                 "usage": {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}}
    creq = api.parse_completion(completion_body(), tok, MODEL, CTX)
    r = resp.response(creq, "abc", "stop", 2, created=5)
    assert r["object"] == "text_completion" and r["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                                                   "finish_reason": "stop"}]
    assert r["usage"]["total_tokens"] == creq.num_prompt_tokens + 2


def test_chunks_and_sse(tok):
    req = api.parse_chat(chat_body(stream=True), tok, MODEL, CTX)
    first = resp.stream_chunk(req, 7, "", first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert resp.stream_chunk(req, 7, "lo")["choices"][0]["delta"] == {"content": "lo"}
    last = resp.stream_chunk(req, 7, None, "length")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    u = resp.usage_chunk(req, 7, 4)
    assert u["choices"] == [] and u["usage"]["completion_tokens"] == 4
    line = resp.sse({"a": "é"})
    assert line == 'data: {"a":"é"}\n\n' and json.loads(line[len("data: "):]) == {"a": "é"}
    assert resp.DONE_LINE == "data: [DONE]\n\n"
    creq = api.parse_completion(completion_body(stream=True), tok, MODEL, CTX)
    assert resp.stream_chunk(creq, 7, "x")["choices"] == [{"index": 0, "text": "x", "logprobs": None,
                                                          "finish_reason": None}]
    assert resp.models_response(MODEL, CTX)["data"][0]["id"] == MODEL


# ----- incremental detokenization -----------------------------------------------------------------------

def pieces(tok, ids, stop=(), step=1):
    d = Detokenizer(tok, stop)
    out = [d.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    out.append(d.finish())
    return d, out


def test_detokenizer_pieces_add_up(tok):
    text = "Déjà vu: naïve café — 日本語 and emoji 🙂 in one string."
    ids = tok.encode(text, add_bos=False)
    for step in (1, 2, 3):
        d, out = pieces(tok, ids, step=step)
        assert "".join(out) == tok.decode(ids) == d.text
        assert not any("\ufffd" in p for p in out)
    # byte-level BPE splits the emoji over several tokens: some step sends nothing while it is incomplete
    d = Detokenizer(tok)
    sent = [d.add([t]) for t in ids]
    assert "" in sent


def test_detokenizer_holds_back_stop_prefix_and_cuts(tok):
    ids = tok.encode("alpha beta gamma delta", add_bos=False)
    d, out = pieces(tok, ids, stop=("gamma",))
    assert "".join(out) == "alpha beta " == d.text and d.stopped
    assert not any("gam" in p for p in out)
    d, out = pieces(tok, ids, stop=("gamma x",))  # never completed: the held tail is sent at the end
    assert "".join(out) == "alpha beta gamma delta" and not d.stopped
    d = Detokenizer(tok, ("a beta",))
    assert d.add(tok.encode("alph", add_bos=False)) == "alph"
    assert d.add(tok.encode("a", add_bos=False)) == ""  # 'a' may start 'a beta'


def test_detokenizer_matches_engine_text_rule(tok):
    ids = tok.encode("one. two. three.", add_bos=False)
    d, out = pieces(tok, ids, stop=("three", "two"))
    assert "".join(out) == "one. "  # cut at the earliest stop string, whichever it is


def test_the_fields_vllms_benchmark_client_sends(tok):
    """vllm bench serve always sends ignore_eos and repetition_penalty; both map to sampling params, and so
    do min_tokens and the OpenAI penalties."""
    body = completion_body(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.0, stream=True,
                           stream_options={"include_usage": True})
    p = api.parse_completion(body, tok, MODEL, CTX).params
    assert (p.ignore_eos, p.repetition_penalty, p.min_tokens, p.penalized) == (True, 1.0, 0, False)
    p = api.parse_chat(chat_body(max_tokens=8, min_tokens=3, repetition_penalty=1.3, presence_penalty=-0.5,
                                 frequency_penalty=0.25), tok, MODEL, CTX).params
    assert (p.min_tokens, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (3, 1.3, -0.5, 0.25)
    e = refused(api.parse_completion, completion_body(max_tokens=4, min_tokens=5), tok)
    assert (e.param, e.message) == ("min_tokens", "min_tokens must be in [0, max_tokens=4], got 5")
