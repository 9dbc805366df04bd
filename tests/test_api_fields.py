"""The OpenAI / vLLM request fields beyond sampling, pure: ``n``, ``logprobs`` / ``top_logprobs``, ``echo``,
``stream_options`` (validation, each refusal a 400 naming the field), the logprobs' response shapes, a
choice's chunks (the finish reason rides on the chunk with the last text), and /tokenize and /detokenize.
Over HTTP against the real Serve app: tests/test_api_http.py."""

from __future__ import annotations

import pytest

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.engine.protocol import EngineOutput
from pipeline.engine.protocol import TokenLogprobs
from pipeline.serving.endpoints import openai_api as api
from pipeline.serving.endpoints import tokenize_api
from pipeline.serving.api_options import choice_seed
from pipeline.serving.endpoints.choices import ChoiceState
from pipeline.serving.logprobs import FLOOR, LogprobsBuilder, TokenStrings
from pipeline.text.tokenizer import Tokenizer

MODEL = "m"
CTX = 256


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(EMBEDDED_MODEL_DIR)


def completion(tok, **kw) -> api.GenerateRequest:
    return api.parse_completion({"model": MODEL, "prompt": "The os module", **kw}, tok, MODEL, CTX)


def chat(tok, **kw) -> api.GenerateRequest:
    return api.parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}, tok, MODEL, CTX)


def refused(fn, tok, **kw) -> api.ApiError:
    with pytest.raises(api.ApiError) as e:
        fn(tok, **kw)
    assert e.value.status == 400
    return e.value


# ----- parsing ------------------------------------------------------------------------------------------

def test_output_fields_parse(tok):
    r = completion(tok, n=3, seed=7, logprobs=4, best_of=3, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert (r.n, r.params.logprobs, r.include_usage, r.continuous_usage, r.echo) == (3, 4, True, True, None)
    assert [r.engine_request(i).params.seed for i in range(3)] == [7, 8, 9]
    assert [r.engine_request(i).request_id for i in range(3)] == [f"{r.request_id}-{i}" for i in range(3)]
    assert completion(tok, logprobs=0).params.logprobs == 0 and completion(tok, logprobs=False).params.logprobs is None
    plain = completion(tok)
    assert plain.params.logprobs is None and plain.n == 1
    one = plain.engine_request(0)                          # n 1: the request's own id and params
    assert (one.request_id, one.prompt_ids, one.params) == (plain.request_id, plain.prompt_ids, plain.params)
    c = chat(tok, logprobs=True, top_logprobs=5, n=2)
    assert (c.params.logprobs, c.n) == (5, 2)
    assert chat(tok, logprobs=True).params.logprobs == 0
    assert chat(tok, logprobs=False, top_logprobs=0).params.logprobs is None
    # continuous usage only with include_usage, as in vLLM
    assert completion(tok, stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage is False


def test_choice_seeds_wrap_like_torch():
    """seed + i stays in torch's range, wrapped mod 2**64, which is how torch reads a negative seed."""
    import torch

    assert choice_seed(None, 3) is None and choice_seed(-5, 2) == -3 and choice_seed(7, 0) == 7
    assert choice_seed(2 ** 64 - 1, 2) == 1                 # (2**64 + 1) mod 2**64
    assert choice_seed(2 ** 63, 0) == 2 ** 63
    a, b = torch.Generator().manual_seed(-1), torch.Generator().manual_seed(2 ** 64 - 1)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_echo_text(tok):
    assert completion(tok, echo=True).echo == "The os module"
    assert completion(tok, echo=True, prompt=["Hello"]).echo == "Hello"
    ids = tok.encode("import os")
    r = api.parse_completion({"model": MODEL, "prompt": ids, "echo": True}, tok, MODEL, CTX)
    assert r.echo == tok.decode(ids, skip_special=False) and r.echo.startswith(tok.bos_token)
    assert r.engine_request(0).prompt_ids == tuple(ids)


@pytest.mark.parametrize("fn, kw, param, message", [
    ("completion", {"n": 17}, "n", "n must be in [1, 16], got 17"),
    ("chat", {"n": True}, "n", "n must be an integer, got True"),
    ("completion", {"n": 2, "best_of": 3}, "best_of",
     "best_of must equal n (2) on this server (it does not rank choices), got 3"),
    ("completion", {"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
    ("completion", {"logprobs": -1}, "logprobs", "logprobs must be in [0, 20], got -1"),
    ("completion", {"logprobs": True}, "logprobs",
     "logprobs must be an integer in [0, 20] for /v1/completions (the number of alternatives per token), got true"),
    ("completion", {"logprobs": "yes"}, "logprobs", "logprobs must be an integer, got 'yes'"),
    ("chat", {"logprobs": 3}, "logprobs",
     "logprobs must be a boolean for /v1/chat/completions (top_logprobs gives the alternatives), got 3"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
    ("completion", {"echo": "yes"}, "echo", "echo must be a boolean, got 'yes'"),
    ("completion", {"echo": True, "logprobs": 0}, "echo",
     "echo with logprobs needs the prompt tokens' logprobs, which this server does not compute: send echo or "
     "logprobs, not both"),
    ("chat", {"echo": True}, "echo", "unrecognized request argument(s): echo"),
    ("completion", {"prompt_logprobs": 1}, "prompt_logprobs", "unrecognized request argument(s): prompt_logprobs"),
    ("completion", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
     "stream_options.include_usage must be a boolean, got 1"),
    ("chat", {"stream": True, "stream_options": {"usage": True}}, "stream_options",
     "stream_options: unrecognized option(s) usage (known: include_usage, continuous_usage_stats)"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed with stream=true"),
])
def test_refusals_name_the_field(tok, fn, kw, param, message):
    e = refused(completion if fn == "completion" else chat, tok, **kw)
    assert (e.param, e.message, e.type) == (param, message, "invalid_request_error")


# ----- logprobs shapes ----------------------------------------------------------------------------------

def test_token_strings_bytes_add_up_to_the_text(tok):
    s = TokenStrings(tok)
    text = "Déjà 🙂 x"
    ids = tok.encode(text, add_bos=False)
    assert b"".join(bytes(s.bytes(t)) for t in ids).decode() == text      # exact bytes, parts of characters too
    assert any(s.text(t) == "\ufffd" for t in ids)                        # a part of a character shows U+FFFD
    assert s.text(tok.eos_id) == tok.eos_token and s.bytes(tok.eos_id) == list(tok.eos_token.encode())
    assert s.raw(ids[-1]) == "Ġx" and s.text(ids[-1]) == " x"


def test_completion_and_chat_logprob_shapes(tok):
    s = TokenStrings(tok)
    ids = tok.encode("é x", add_bos=False) + [tok.eos_id]   # 'é' is two tokens, ' x' one; eos adds no text
    assert len(ids) == 4
    entries = [TokenLogprobs(t, -0.5 - i, ((t, -0.5 - i), (7, -3.0))) for i, t in enumerate(ids)]
    entries[1] = TokenLogprobs(ids[1], float("-inf"), ((7, -0.1), (8, -0.2)))   # not in its top
    b = LogprobsBuilder(chat=False, strings=s, top_n=2)
    first, rest = b.add(ids[:2], entries[:2]), b.add(ids[2:], entries[2:])
    assert b.payload["tokens"] == first["tokens"] + rest["tokens"] == [s.text(t) for t in ids]
    assert b.payload["token_logprobs"] == [-0.5, FLOOR, -2.5, -3.5]
    assert b.payload["text_offset"] == [0, 0, 1, 3]           # both parts of 'é' at 0; eos after ' x'
    assert [s.text(t) for t in ids[:2]] == ["\ufffd"] * 2
    top1 = b.payload["top_logprobs"][1]
    assert list(top1.items()) == [(s.text(7), -0.1), (s.text(8), -0.2), (s.text(ids[1]), FLOOR)]  # N + 1 entries
    assert b.payload["top_logprobs"][0] == {s.text(ids[0]): -0.5, s.text(7): -3.0}
    c = LogprobsBuilder(chat=True, strings=s, top_n=1)
    part = c.add(ids[:1], entries[:1])
    assert part == {"content": [{"token": s.text(ids[0]), "logprob": -0.5, "bytes": s.bytes(ids[0]),
                                 "top_logprobs": [{"token": s.text(ids[0]), "logprob": -0.5,
                                                   "bytes": s.bytes(ids[0])}]}]}
    # tokens the engine sent without logprobs: vLLM's placeholders
    assert c.add([ids[2]], None)["content"][0]["logprob"] == FLOOR
    assert b.add([ids[2]], None)["token_logprobs"] == [None]


# ----- a choice's chunks --------------------------------------------------------------------------------

def chunks(state: ChoiceState, events) -> list[dict]:
    out = [state.chunk(ev, 1, 0) for ev in events]
    return [c["choices"][0] for c in out if c is not None]


def test_the_finish_reason_rides_on_the_last_tokens_chunk(tok):
    ids = tok.encode("alpha beta gamma", add_bos=False)
    req = completion(tok, stream=True)
    got = chunks(ChoiceState(req, 0, tok), [EngineOutput("r", tuple(ids[:2])), EngineOutput("r", tuple(ids[2:]), "length")])
    assert [c["finish_reason"] for c in got] == [None, "length"] and got[-1]["text"]
    assert "".join(c["text"] for c in got) == "alpha beta gamma"
    # an event without a token ends the choice: an empty chunk carries the reason
    got = chunks(ChoiceState(req, 2, tok), [EngineOutput("r", tuple(ids)), EngineOutput("r", (), "stop")])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in got] == [(2, "alpha beta gamma", None),
                                                                          (2, "", "stop")]
    # text held back (an incomplete character) goes out with the finish reason
    emoji = tok.encode("ok 🙂", add_bos=False)
    creq = chat(tok, stream=True)
    got = chunks(ChoiceState(creq, 0, tok), [EngineOutput("r", tuple(emoji[:-1])), EngineOutput("r", tuple(emoji[-1:]), "stop")])
    assert got[-1]["finish_reason"] == "stop" and got[-1]["delta"]["content"].endswith("🙂")
    assert "".join(c["delta"].get("content", "") for c in got) == "ok 🙂"


def test_chunks_with_logprobs_go_out_while_the_text_is_held_back(tok):
    emoji = tok.encode("🙂", add_bos=False)
    assert len(emoji) > 1
    req = chat(tok, stream=True, logprobs=True, top_logprobs=1)
    lps = tuple(TokenLogprobs(t, -1.0, ((t, -1.0),)) for t in emoji)
    st = ChoiceState(req, 1, tok)
    first = st.chunk(EngineOutput("r", emoji[:1], None, lps[:1]), 1, 1)["choices"][0]
    assert first["delta"] == {} and len(first["logprobs"]["content"]) == 1 and first["index"] == 1
    last = st.chunk(EngineOutput("r", tuple(emoji[1:]), "stop", lps[1:]), 1, len(emoji))["choices"][0]
    assert last["delta"] == {"content": "🙂"} and last["finish_reason"] == "stop"
    result = st.result()
    assert result["message"]["content"] == "🙂" and len(result["logprobs"]["content"]) == len(emoji)
    assert bytes(b for e in result["logprobs"]["content"] for b in e["bytes"]).decode() == "🙂"


def test_the_engines_text_is_taken_as_it_is(tok):
    """A request with stop strings is detokenized by the engine (EngineOutput.text): the choice takes that
    text and decodes nothing itself; an output without text is decoded here."""
    req = completion(tok, stop=["gamma"])
    st = ChoiceState(req, 0, tok)
    st.add(EngineOutput("r", (1, 2), None, None, "alpha "))
    st.add(EngineOutput("r", (3,), "stop", None, "beta"))
    assert st.result()["text"] == "alpha beta" and st.tokens == 3
    ids = tok.encode("alpha beta", add_bos=False)
    st = ChoiceState(completion(tok), 0, tok)
    st.add(EngineOutput("r", tuple(ids), "length"))
    assert st.result()["text"] == "alpha beta"


def test_request_ids_come_from_the_header_when_they_are_plain(tok):
    assert api.request_id(api.COMPLETION, "abc-1.2:3") == "cmpl-abc-1.2:3"
    assert api.request_id(api.CHAT, "x" * 128) == "chatcmpl-" + "x" * 128
    for bad in (None, "", "x" * 129, "a b", "é"):
        rid = api.request_id(api.COMPLETION, bad)
        assert rid.startswith("cmpl-") and len(rid) == len("cmpl-") + 32
    assert completion(tok).request_id.startswith("cmpl-")
    assert api.parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, tok, MODEL, CTX,
                          "chatcmpl-given").request_id == "chatcmpl-given"


def test_echo_opens_the_stream_and_prefixes_the_text(tok):
    req = completion(tok, echo=True, stream=True, stream_options={"include_usage": True})
    st = ChoiceState(req, 0, tok)
    head = st.opening(5)
    assert head["choices"][0]["text"] == "The os module" and head["usage"] is None
    st.add(EngineOutput("r", tuple(tok.encode(" provides", add_bos=False)), "length"))
    assert st.result()["text"] == "The os module provides"
    cont = completion(tok, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    c = ChoiceState(cont, 0, tok).chunk(EngineOutput("r", (5, 6)), 5, 4)
    assert c["usage"] == {"prompt_tokens": cont.num_prompt_tokens, "completion_tokens": 4,
                          "total_tokens": cont.num_prompt_tokens + 4}


# ----- /tokenize and /detokenize ------------------------------------------------------------------------

def test_tokenize_and_detokenize(tok):
    ids, strs = tokenize_api.parse_tokenize({"prompt": "import os"}, tok, MODEL)
    assert ids == tok.encode("import os") and strs is False
    assert tokenize_api.parse_tokenize({"prompt": "import os", "add_special_tokens": False}, tok, MODEL)[0] \
        == tok.encode("import os", add_bos=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert tokenize_api.parse_tokenize({"model": MODEL, "messages": msgs}, tok, MODEL)[0] == tok.encode_chat(msgs)
    assert tokenize_api.parse_tokenize({"messages": msgs, "add_generation_prompt": False}, tok, MODEL)[0] \
        == tok.encode_chat(msgs, add_generation_prompt=False)
    out = tokenize_api.tokenize_response(ids, CTX, TokenStrings(tok))
    assert out == {"count": len(ids), "max_model_len": CTX, "tokens": ids,
                   "token_strs": [tok.bos_token, "import", "Ġos"]}
    assert tokenize_api.parse_detokenize({"tokens": ids}, tok, MODEL) == ids
    assert tokenize_api.detokenize_response(tok, ids) == {"prompt": tok.bos_token + "import os"}


@pytest.mark.parametrize("route, body, param, message", [
    ("tokenize", {}, "prompt", "prompt (or messages) is required"),
    ("tokenize", {"prompt": 3}, "prompt", "prompt must be a string, got int"),
    ("tokenize", {"prompt": "x", "messages": []}, "messages", "give prompt or messages, not both"),
    ("tokenize", {"messages": []}, "messages", "messages is empty"),
    ("tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens",
     "add_special_tokens must be a boolean, got 'no'"),
    ("tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt",
     "unrecognized request argument(s): add_generation_prompt"),
    ("detokenize", {}, "tokens", "tokens is required"),
    ("detokenize", {"tokens": "abc"}, "tokens", "tokens must be a list of token ids (integers), got 'abc'"),
    ("detokenize", {"tokens": [1, 4096]}, "tokens", "tokens must be ids in [0, 4096), got 4096"),
    ("detokenize", {"tokens": [1], "prompt": "x"}, "prompt", "unrecognized request argument(s): prompt"),
])
def test_tokenizer_routes_refuse_bad_input(tok, route, body, param, message):
    parse = tokenize_api.parse_tokenize if route == "tokenize" else tokenize_api.parse_detokenize
    with pytest.raises(api.ApiError) as e:
        parse(body, tok, MODEL)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)
    with pytest.raises(api.ApiError) as e:
        parse({**body, "model": "other"}, tok, MODEL)
    assert e.value.status in (400, 404)
