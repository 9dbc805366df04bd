"""The OpenAI / vLLM fields beyond sampling over HTTP, with the official ``openai`` client against the real
Serve app on the simulated Ray cluster (a keyed colocated app): logprobs equal to the engine's own (run in
this process), streamed and not; ``n`` choices equal to ``n`` separate requests seeded ``seed + i``;
``echo``; usage chunks; the finish reason on the chunk of the last token; /tokenize and /detokenize behind
the key; every refusal a 400 naming the field with the server still up. (A seeded sampled request giving
the same text and logprobs colocated and disaggregated: tests/test_serve.py, whose app has both.)"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

from engine_ref import drain, replica_engine, submit, torch_threads  # noqa: E402
from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.protocol import SamplingParams  # noqa: E402
from pipeline.serving.logprobs import TokenStrings  # noqa: E402
from serve_apps import deployed  # noqa: E402
from test_serve import http  # noqa: E402

MODEL = "tiny-w8a8"
KEY = "sk-fields"
ENGINE = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_batched_tokens=256, nz=True)
CTX = 64 * 16
MAX_IN_FLIGHT = 8
RAW = "The os module provides"
QUESTION = "What's deep learning?"
MAX_TOKENS = 12
# The replica's logprobs against this process's engine (the same model, config and one torch thread):
# measured equal; the tolerance covers float noise of another batch composition, not a wrong row or token.
TOL = 1e-4
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(serve_http, qdir):
    """``keyed`` (colocated, API key, 8 in flight) at / (disaggregated serving's fields: tests/test_serve.py)."""
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig

    cpu, small = DeploymentOptions(1, {"num_cpus": 0.5}), DeploymentOptions(1, {"num_cpus": 0.1})
    keyed = ServeConfig(qdir, MODEL, ENGINE, api_key=KEY, max_in_flight=MAX_IN_FLIGHT, llm=cpu, ingress=small)
    with deployed({"keyed": (keyed, "/")}):
        yield serve_http


def client(server: str, prefix: str = "", key: str = KEY) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server}{prefix}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(qdir, tok) -> dict:
    """Greedy outputs and their logprobs (top 3) from the engine in this process (one torch thread)."""
    with torch_threads(1):
        eng = replica_engine(qdir, tok, ENGINE)
        params = SamplingParams(max_new_tokens=MAX_TOKENS, logprobs=3)
        rids = {"raw": submit(eng, tok.encode(RAW), params),
                "chat": submit(eng, tok.encode_chat([{"role": "user", "content": QUESTION}]), params)}
        got = drain(eng)
    return {k: (got[r].tokens, got[r].logprobs, tok.decode(got[r].tokens)) for k, r in rids.items()}


def sse_chunks(server: str, path: str, body: dict, headers: dict = AUTH) -> list[dict]:
    status, raw = http("POST", f"{server}{path}", json.dumps(body).encode(), headers)
    assert status == 200, raw
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


# ----- logprobs -----------------------------------------------------------------------------------------

def test_completion_logprobs_are_the_engines(server, reference, tok):
    ids, want, text = reference["raw"]
    strings = TokenStrings(tok)
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and r.usage.completion_tokens == len(ids) == len(lp.tokens)
    assert lp.tokens == [strings.text(t) for t in ids]
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs, want)) <= TOL
    for tok_str, top, w in zip(lp.tokens, lp.top_logprobs, want):
        assert tok_str in top and len(top) <= 4                                   # the top 3 and the chosen one
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert max(abs(top[strings.text(t)] - x) for t, x in w.top) <= TOL
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(text[o:o + len(s)] == s for o, s in zip(lp.text_offset, lp.tokens))   # plain ASCII here
    chunks = list(c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
                                       stream=True))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert [t for p in streamed for t in p.tokens] == lp.tokens
    assert [o for p in streamed for o in p.text_offset] == lp.text_offset
    assert max(abs(a - b) for a, b in zip([x for p in streamed for x in p.token_logprobs], lp.token_logprobs)) <= TOL
    assert "".join(ch.choices[0].text for ch in chunks) == text


def test_chat_logprobs_are_the_engines(server, reference, tok):
    ids, want, text = reference["chat"]
    c = client(server)
    msgs = [{"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == text and len(content) == len(ids) == r.usage.completion_tokens
    assert bytes(b for e in content for b in e.bytes).decode() == text
    for e, w in zip(content, want):
        assert abs(e.logprob - w.logprob) <= TOL and len(e.top_logprobs) == 2
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) <= 1e-6  # greedy
        assert max(abs(t.logprob - x) for t, (_, x) in zip(e.top_logprobs, w.top)) <= TOL
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= TOL
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


# ----- n, echo, usage, finish reasons -------------------------------------------------------------------

def test_n_choices_are_n_requests_seeded_seed_plus_i(server):
    c = client(server)
    kw = dict(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95)
    r = c.completions.create(n=3, seed=123, **kw)
    alone = [c.completions.create(seed=123 + i, **kw) for i in range(3)]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone]
    assert len({ch.text for ch in r.choices}) > 1                                 # really sampled apart
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    chunks = list(c.completions.create(n=3, seed=123, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    for i in range(3):
        mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == i]
        assert "".join(m.text for m in mine) == r.choices[i].text
        assert [m.finish_reason for m in mine][-1] == r.choices[i].finish_reason and \
            all(m.finish_reason is None for m in mine[:-1])
    msgs = [{"role": "user", "content": QUESTION}]
    rc = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, n=2, seed=9)
    assert [ch.message.content for ch in rc.choices] == [
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, seed=9 + i)
        .choices[0].message.content for i in range(2)]


def test_echo_puts_the_prompt_first(server, reference, tok):
    _, _, text = reference["raw"]
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, echo=True, n=2)
    assert [ch.text for ch in r.choices] == [RAW + text] * 2
    chunks = list(c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, echo=True,
                                       stream=True))
    assert chunks[0].choices[0].text == RAW and "".join(ch.choices[0].text for ch in chunks) == RAW + text
    ids = tok.encode(RAW)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert r.choices[0].text == tok.decode(ids, skip_special=False) + text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": RAW}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}]}),
])
def test_the_finish_reason_rides_on_the_last_tokens_chunk(server, path, body):
    """max_tokens 5: the engine's last event carries the fifth token and "length"; one chunk carries both.
    With continuous usage stats every chunk carries the usage so far."""
    chunks = sse_chunks(server, path, {"model": MODEL, **body, "max_tokens": 5, "temperature": 0, "stream": True,
                                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    with_choices = [ch for ch in chunks if ch["choices"]]
    last = with_choices[-1]["choices"][0]
    text = last.get("text") if "text" in last else last["delta"].get("content")
    assert last["finish_reason"] == "length" and text
    assert all(ch["choices"][0]["finish_reason"] is None for ch in with_choices[:-1])
    used = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert used == sorted(used) and used[-1] == 5 and chunks[-1]["choices"] == []


# ----- the tokenizer routes -----------------------------------------------------------------------------

def test_tokenize_and_detokenize_behind_the_key(server, tok):
    def post(path, body, headers=AUTH):
        status, out = http("POST", f"{server}{path}", json.dumps(body).encode(), headers)
        return status, json.loads(out)

    assert post("/tokenize", {"model": MODEL, "prompt": RAW}) == (200, {
        "count": len(tok.encode(RAW)), "max_model_len": CTX, "tokens": tok.encode(RAW)})
    msgs = [{"role": "user", "content": QUESTION}]
    status, out = post("/tokenize", {"messages": msgs, "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.encode_chat(msgs) and len(out["token_strs"]) == out["count"]
    assert post("/detokenize", {"tokens": tok.encode(RAW)}) == (200, {"prompt": tok.bos_token + RAW})
    status, out = post("/tokenize", {"prompt": ["x"]})
    assert (status, out["error"]["param"]) == (400, "prompt")
    status, out = post("/detokenize", {"tokens": [1, -1]})
    assert (status, out["error"]["param"], out["error"]["message"]) == (400, "tokens",
                                                                         "tokens must be ids in [0, 4096), got -1")
    status, out = post("/detokenize", {"model": "gpt-4", "tokens": [1]})
    assert (status, out["error"]["code"]) == (404, "model_not_found")
    for path in ("/tokenize", "/detokenize"):
        status, out = post(path, {"prompt": RAW, "tokens": [1]}, {"Content-Type": "application/json"})
        assert (status, out["error"]["code"]) == (401, "invalid_api_key")
    assert http("GET", f"{server}/health")[0] == 200


# ----- refusals -----------------------------------------------------------------------------------------

def test_bad_fields_are_400_naming_them_and_the_server_stays_up(server):
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (lambda: c.completions.create(model=MODEL, prompt=RAW, n=MAX_IN_FLIGHT + 1), "n",
         f"n is {MAX_IN_FLIGHT + 1} but this server runs at most {MAX_IN_FLIGHT} generations at once (each choice "
         "is one)"),
        (lambda: c.completions.create(model=MODEL, prompt=RAW, n=17), "n", "n must be in [1, 16], got 17"),
        (lambda: c.completions.create(model=MODEL, prompt=RAW, echo=True, logprobs=2), "echo",
         "echo with logprobs needs the prompt tokens' logprobs, which this server does not compute: send echo or "
         "logprobs, not both"),
        (lambda: c.chat.completions.create(model=MODEL, messages=msgs, top_logprobs=3), "top_logprobs",
         "top_logprobs needs logprobs=true"),
        (lambda: c.completions.create(model=MODEL, prompt=RAW, logprobs=21), "logprobs",
         "logprobs must be in [0, 20], got 21"),
    ]
    for call, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert (e.value.body["param"], e.value.body["message"]) == (param, message)
    assert c.completions.create(model=MODEL, prompt=RAW, max_tokens=2).usage.completion_tokens == 2
