"""The colocated serving app (actors/serving/app/serve_app.py) on the simulated Ray cluster, spoken to over HTTP with
the official ``openai`` client: chat and completions, streamed and not (same text), greedy output equal to
the engine run in-process, concurrency, every refusal with its status and message, the API key (401),
backpressure (429), and a client that disconnects mid-stream freeing its cache blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

from serve_apps import deployed  # noqa: E402
from engine_ref import SLOW_STEP_S, replica_engine, slowed, torch_threads  # noqa: E402
from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.core.engine import LLMEngine  # noqa: E402
from pipeline.engine.protocol import SamplingParams  # noqa: E402

MODEL = "tiny-w8a8"
KEY = "sk-test-123"
ENGINE = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_batched_tokens=256, nz=True)
CTX = 64 * 16                     # the main app's context: the cache's tokens (under the model's 2048)
QUESTION = "What's deep learning?"
MAX_TOKENS = 24
LOGPROB_TOL = 1e-4   # a logprob decoded on the decode deployment against one engine's (float32 rounding)
RAW = "The os module provides"    # plain text: the model continues it for long (no early eos)
ANSWER_LIMIT = 64 * 1024          # the keyed app's ingress believes its proxy passes answers up to this


@pytest.fixture(scope="module")
def server(serve_http, qdir):
    """The session's Serve (conftest's ``serve_http``) with these apps: ``main`` (colocated, no key, 32 in
    flight; the ingress replica owns the engine) at /, ``keyed`` (API key, 2 in flight) at /keyed,
    ``disagg`` (prefill and decode deployments apart) at /disagg, ``slowprefill`` (its prefill always too
    late), ``split`` (main with the engine in an LLMServer deployment behind the ingress) at /split. Only
    ``main`` and ``disagg`` run their engines in a core process of their own (each costs a process start);
    the others on a thread. Yields the base URL."""
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig

    cpu = DeploymentOptions(1, {"num_cpus": 0.5})  # both apps fit one 2-CPU worker node
    small = DeploymentOptions(1, {"num_cpus": 0.1})
    # the apps whose tests need a request still running (a time-out, an abort, backpressure) step slowly
    main = ServeConfig(qdir, MODEL, ENGINE, max_in_flight=32, llm=cpu, ingress=small, step_delay_s=SLOW_STEP_S)
    # keyed's ingress sees what a replica behind a gRPC proxy with a small message limit sees
    behind_grpc = DeploymentOptions(1, {"num_cpus": 0.1, "runtime_env": {"env_vars": {
        "RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(ANSWER_LIMIT)}}})
    keyed = ServeConfig(qdir, MODEL, EngineConfig(num_blocks=64, block_size=16, nz=True), api_key=KEY,
                        max_in_flight=2, llm=cpu, ingress=behind_grpc, engine_process=False,
                        step_delay_s=SLOW_STEP_S)
    disagg = ServeConfig(qdir, MODEL, ENGINE, max_in_flight=32, llm=cpu, ingress=small, mode="disaggregated",
                         prefill=cpu)
    slow = dataclasses.replace(disagg, prefill_timeout_s=0.001, prefill=small, llm=small,  # prefill always late
                               engine_process=False)
    split = dataclasses.replace(main, engine_in_ingress=False, llm=small,  # an LLMServer deployment apart
                                engine_process=False)
    with deployed({"main": (main, "/"), "keyed": (keyed, "/keyed"), "disagg": (disagg, "/disagg"),
                   "slowprefill": (slow, "/slowprefill"), "split": (split, "/split")}):
        yield serve_http


def client(server: str, prefix: str = "", key: str = "none", timeout: float = 60) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server}{prefix}/v1", api_key=key, max_retries=0, timeout=timeout)


def aclient(server: str, prefix: str = "", key: str = "none") -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=f"{server}{prefix}/v1", api_key=key, max_retries=0, timeout=120)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics(server: str, prefix: str = "") -> dict[str, float]:
    status, text = http("GET", f"{server}{prefix}/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_metric(server: str, name: str, want: float, prefix: str = "", timeout: float = 20) -> dict:
    deadline = time.time() + timeout
    while True:
        m = metrics(server, prefix)
        if m.get(name) == want or time.time() > deadline:
            return m
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(qdir, tok) -> dict:
    """The engine's greedy output in this process (one torch thread, as in the replica)."""
    with torch_threads(1):
        eng = replica_engine(qdir, tok, ENGINE)
        chat_ids = tok.encode_chat([{"role": "user", "content": QUESTION}])
        raw_ids = tok.encode(RAW)
        chat_out, raw_out = eng.generate([chat_ids, raw_ids], SamplingParams(max_new_tokens=MAX_TOKENS))
    return {"chat": (tok.decode(chat_out), len(chat_out), len(chat_ids)),
            "raw": (tok.decode(raw_out), len(raw_out), len(raw_ids)), "raw_ids": raw_out}


def finish(n: int) -> str:
    return "length" if n == MAX_TOKENS else "stop"


# ----- generation ---------------------------------------------------------------------------------------

def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == CTX
    status, body = http("GET", f"{server}/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_chat_greedy_equals_engine_and_stream_equals_non_stream(server, reference):
    text, n, n_prompt = reference["chat"]
    c = client(server)
    msgs = [{"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish(n)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, n, n_prompt + n)

    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == finish(n)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 3  # really streamed


def test_disaggregated_answers_equal_colocated(server, reference):
    """Prefill on its deployment, the int8-NZ blocks handed to decode through the object store: the same
    greedy text as the colocated path (and the in-process engine), streamed or not, chat and completion."""
    text, n, n_prompt = reference["chat"]
    msgs = [{"role": "user", "content": QUESTION}]
    d, m = client(server, "/disagg"), client(server)
    got = d.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    col = m.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].message.content == col.choices[0].message.content == text
    assert got.usage.completion_tokens == n and got.choices[0].finish_reason == finish(n)
    chunks = d.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    rtext, rn, _ = reference["raw"]
    r = d.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == rtext and r.usage.completion_tokens == rn
    stats = metrics(server, "/disagg")
    assert stats["dsquant_engine_kv_handoffs_total"] >= 3 and stats["dsquant_engine_kv_handoff_bytes_total"] > 0
    assert stats["dsquant_engine_cache_blocks_used"] == 0


def test_split_engine_deployment_answers_equal_and_frees_blocks_on_disconnect(server, reference):
    """engine_in_ingress false: the engine is an LLMServer deployment and every event crosses a Serve
    streaming call. Same greedy text as the in-ingress engine, streamed or not; a client that goes away
    mid-stream aborts its sequence there too."""
    text, n, _ = reference["chat"]
    msgs = [{"role": "user", "content": QUESTION}]
    c = client(server, "/split")
    assert c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].message.content == text
    chunks = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    aborted0 = wait_metric(server, "dsquant_engine_running", 0, "/split")["dsquant_engine_aborted_total"]
    stream = c.completions.create(model=MODEL, prompt=RAW, max_tokens=900, temperature=0, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    m = wait_metric(server, "dsquant_engine_aborted_total", aborted0 + 1, "/split", timeout=15)
    assert m["dsquant_engine_aborted_total"] == aborted0 + 1
    assert (m["dsquant_engine_running"], m["dsquant_engine_cache_blocks_used"]) == (0, 0)


def test_seeded_sampling_disaggregated_equals_colocated(server):
    """The decode deployment continues the prefill's generator: the same sampled text as one engine."""
    col, dis = client(server), client(server, "/disagg")
    msgs = [{"role": "user", "content": QUESTION}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=0.8, seed=5)
    a, b = col.chat.completions.create(**kw), dis.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens > 1
    kw = dict(model=MODEL, prompt=RAW, max_tokens=16, temperature=0.8, seed=6, n=2, logprobs=1)
    a, b = col.completions.create(**kw), dis.completions.create(**kw)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    for x, y in zip(a.choices, b.choices):
        # the tokens the decode deployment sampled carry the same logprobs; the first one's come from the
        # prefill deployment (KVHandoff.first_logprobs), forwarded only where actors/serving/app/serve_app.py passes them
        assert max(abs(p - q) for p, q in zip(x.logprobs.token_logprobs[1:], y.logprobs.token_logprobs[1:])) <= LOGPROB_TOL
        assert y.logprobs.tokens == x.logprobs.tokens


def test_prefill_timeout_is_503_for_the_request(server):
    status, body = http("POST", f"{server}/slowprefill/v1/chat/completions",
                        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                    "max_tokens": 4}).encode(), {"Content-Type": "application/json"})
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == "prefill_unavailable" and "prefill failed: TimeoutError" in err["message"]
    assert metrics(server, "/slowprefill")["dsquant_engine_prefill_failures_total"] >= 1
    ok = client(server, "/disagg").chat.completions.create(  # the other app's prefill still answers
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0)
    assert ok.choices[0].message.content


def test_completion_greedy_equals_engine_and_stream_equals_non_stream(server, reference):
    text, n, n_prompt = reference["raw"]
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert r.choices[0].finish_reason == finish(n)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n)
    streamed = list(c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == text
    assert streamed[-1].choices[0].finish_reason == finish(n)


def test_stop_string_cuts_the_text(server, reference):
    text, _, _ = reference["raw"]
    stop = text.strip().split()[2]  # a word the greedy output contains
    c = client(server)
    want = text[: text.index(stop)]
    r = c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    streamed = list(c.completions.create(model=MODEL, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == want


def test_one_request_id_from_the_header_to_the_response_and_the_metrics(server, reference):
    """The request's X-Request-ID is its id: the response's ``id`` (``cmpl-`` before it), the response's
    X-Request-ID header, and the exemplar of its latency samples in the OpenMetrics exposition."""
    text, _, _ = reference["raw"]
    body = json.dumps({"model": MODEL, "prompt": RAW, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(f"{server}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-ID": "rid-test-7"})
    with urllib.request.urlopen(req, timeout=30) as r:
        got, header = json.loads(r.read()), r.headers.get("X-Request-ID")
    assert (got["id"], got["choices"][0]["text"], header) == ("cmpl-rid-test-7", text, "rid-test-7")
    req = urllib.request.Request(f"{server}/metrics", headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(req, timeout=30) as r:
        exposition = r.read().decode()
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
    assert 'request_id="cmpl-' in exposition                        # the latest requests' exemplars
    assert 'dsquant_engine_kernels{' in exposition and 'backend="' in exposition


def test_eight_concurrent_requests_all_complete_with_the_greedy_answer(server, reference):
    text, n, _ = reference["chat"]

    async def run():
        c = aclient(server)
        msgs = [{"role": "user", "content": QUESTION}]
        return await asyncio.gather(*[c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS,
                                                                temperature=0) for _ in range(8)])

    results = asyncio.run(run())
    assert [r.choices[0].message.content for r in results] == [text] * 8
    assert [r.usage.completion_tokens for r in results] == [n] * 8
    assert len({r.id for r in results}) == 8


def test_sampling_with_a_seed_is_reproducible(server):
    c = client(server)
    kw = dict(model=MODEL, prompt=RAW, max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    kw["extra_body"] = {"top_k": kw.pop("top_k")}
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 12


# ----- refusals -----------------------------------------------------------------------------------------

def api_error(fn, cls) -> dict:
    with pytest.raises(cls) as e:
        fn()
    return e.value.body


def test_bad_requests_get_their_status_and_message(server, tok):
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    before = metrics(server).get("dsquant_engine_steps_total")

    status, body = http("POST", f"{server}/v1/chat/completions", b'{"model": "tiny-w8a8", "messages": [',
                        {"Content-Type": "application/json"})
    err = json.loads(body)["error"]
    assert status == 400 and err["type"] == "invalid_request_error"
    assert err["message"].startswith("the request body is not valid JSON: Expecting value")

    err = api_error(lambda: c.chat.completions.create(model="gpt-4o", messages=msgs), openai.NotFoundError)
    assert err == {"message": f"the model 'gpt-4o' does not exist; this server serves '{MODEL}'",
                   "type": "invalid_request_error", "param": "model", "code": "model_not_found"}

    long = [{"role": "user", "content": "word " * 1500}]
    n_long = len(tok.encode_chat(long))
    err = api_error(lambda: c.chat.completions.create(model=MODEL, messages=long), openai.BadRequestError)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"] == (f"the prompt has {n_long} tokens but this model's context is {CTX} tokens (at most "
                              f"{CTX - 1} prompt tokens, to leave room for one generated token); shorten the prompt")

    cases = [
        (dict(messages=msgs, max_tokens=-1), "max_tokens", "max_tokens must be >= 1, got -1"),
        (dict(messages=msgs, temperature=5), "temperature", "temperature must be in [0, 2], got 5"),
        (dict(messages=msgs, top_p=0), "top_p", "top_p must be in (0, 1], got 0"),
        (dict(messages=msgs, n=17), "n", "n must be in [1, 16], got 17"),
        (dict(messages=[{"role": "robot", "content": "x"}]), "messages",
         "messages[0].role must be one of system, developer, user, assistant, tool, got 'robot'"),
        (dict(messages=[]), "messages", "messages is empty"),
    ]
    for kw, param, message in cases:
        err = api_error(lambda: c.chat.completions.create(model=MODEL, **kw), openai.BadRequestError)
        assert (err["param"], err["message"]) == (param, message)

    status, body = http("POST", f"{server}/v1/chat/completions", json.dumps({"model": MODEL}).encode(),
                        {"Content-Type": "application/json"})
    assert (status, json.loads(body)["error"]["message"]) == (400, "messages is required")
    err = api_error(lambda: c.completions.create(model=MODEL, prompt="x", echo=True, logprobs=1),
                    openai.BadRequestError)
    assert err["param"] == "echo"
    # none of these reached the engine
    assert metrics(server).get("dsquant_engine_steps_total") == before
    m = metrics(server)
    assert m['dsquant_requests_total{route="chat",status="400"}'] >= 9
    assert m['dsquant_requests_total{route="chat",status="404"}'] >= 1


def test_api_key(server):
    err = api_error(lambda: client(server, "/keyed", key="wrong").models.list(), openai.AuthenticationError)
    assert err == {"message": "the API key provided is not valid for this server", "type": "invalid_request_error",
                   "param": None, "code": "invalid_api_key"}
    status, body = http("POST", f"{server}/keyed/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
    assert status == 401
    assert json.loads(body)["error"]["message"] == "no API key was provided: send 'Authorization: Bearer <key>'"
    r = client(server, "/keyed", key=KEY).completions.create(model=MODEL, prompt=RAW, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    status, _ = http("GET", f"{server}/keyed/health")  # health and metrics stay open
    assert status == 200


def test_overload_is_429_and_clears(server):
    c = client(server, "/keyed", key=KEY)
    streams = [c.completions.create(model=MODEL, prompt=RAW, max_tokens=600, temperature=0, stream=True)
               for _ in range(2)]
    try:
        for s in streams:
            next(iter(s))  # both are in flight now
        assert metrics(server, "/keyed")["dsquant_requests_in_flight"] == 2

        async def burst():
            ac = aclient(server, "/keyed", key=KEY)
            return await asyncio.gather(*[ac.completions.create(model=MODEL, prompt=RAW, max_tokens=2)
                                          for _ in range(3)], return_exceptions=True)

        errors = asyncio.run(burst())
        assert [type(e) for e in errors] == [openai.RateLimitError] * 3
        assert errors[0].body == {"message": "the server is at its limit of 2 requests in flight; retry later",
                                  "type": "rate_limit_error", "param": None, "code": "too_many_requests_in_flight"}
        assert errors[0].response.headers["retry-after"] == "1"
    finally:
        for s in streams:
            s.close()
    m = wait_metric(server, "dsquant_requests_in_flight", 0, "/keyed")
    assert m["dsquant_requests_in_flight"] == 0
    assert c.completions.create(model=MODEL, prompt=RAW, max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_aborts_and_frees_blocks(server):
    m0 = wait_metric(server, "dsquant_engine_running", 0)
    assert (m0["dsquant_engine_running"], m0["dsquant_engine_cache_blocks_used"]) == (0, 0)
    aborted0 = m0["dsquant_engine_aborted_total"]
    c = client(server)
    stream = c.completions.create(model=MODEL, prompt=RAW, max_tokens=900, temperature=0, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    m1 = metrics(server)
    assert m1["dsquant_engine_running"] == 1 and m1["dsquant_engine_cache_blocks_used"] >= 1
    stream.close()  # the client goes away mid-stream
    m2 = wait_metric(server, "dsquant_engine_aborted_total", aborted0 + 1, timeout=15)
    assert m2["dsquant_engine_aborted_total"] == aborted0 + 1
    assert (m2["dsquant_engine_running"], m2["dsquant_engine_waiting"]) == (0, 0)
    assert m2["dsquant_engine_cache_blocks_used"] == 0
    assert m2["dsquant_engine_cache_blocks_free"] == m2["dsquant_engine_cache_blocks_total"] == 64


def test_client_timeout_on_a_non_streamed_request_aborts_it(server):
    aborted0 = wait_metric(server, "dsquant_engine_running", 0)["dsquant_engine_aborted_total"]
    timeout = 1.0
    assert 900 * SLOW_STEP_S > 4 * timeout      # the request lasts longer than the client waits, on any machine
    with pytest.raises(openai.APITimeoutError):
        client(server, timeout=timeout).completions.create(model=MODEL, prompt=RAW, max_tokens=900, temperature=0)
    m = wait_metric(server, "dsquant_engine_aborted_total", aborted0 + 1, timeout=15)
    assert m["dsquant_engine_aborted_total"] == aborted0 + 1
    assert (m["dsquant_engine_running"], m["dsquant_engine_cache_blocks_used"]) == (0, 0)


def test_metrics_exposition(server):
    m = wait_metric(server, "dsquant_requests_in_flight", 0)
    assert (m["dsquant_requests_in_flight"], m["dsquant_engine_up"]) == (0, 1)
    with urllib.request.urlopen(f"{server}/metrics", timeout=30) as r:
        assert r.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
    for name in ("dsquant_time_to_first_token_seconds_count", "dsquant_inter_token_latency_seconds_count",
                 "dsquant_generation_tokens_total", "dsquant_prompt_tokens_total", "dsquant_engine_up"):
        assert m[name] > 0, name
    assert m["dsquant_requests_finished_total{reason=\"abort\"}"] == m["dsquant_engine_aborted_total"] == 2


def test_a_small_request_beside_one_of_every_slot_starts_at_once(server, reference, tok):
    """n = max_num_seqs: the big request holds every engine slot; a small one sent beside it does not wait
    for it: its (greedy) answer comes while the big one still runs. Observed in order (the engine still runs
    the big one when the small answer is in), not in seconds: the big one lasts 300 slow steps."""
    slots = ENGINE.max_num_seqs
    c = client(server)
    big = c.completions.create(model=MODEL, prompt=RAW, max_tokens=300, temperature=0.8, seed=1, n=slots,
                               stream=True, extra_body={"ignore_eos": True})
    try:
        it = iter(big)
        for _ in range(2 * slots):
            next(it)
        assert metrics(server)["dsquant_engine_running"] == slots     # it holds every slot
        small = c.completions.create(model=MODEL, prompt=RAW, max_tokens=4, temperature=0)
        assert small.choices[0].text == tok.decode(reference["raw_ids"][:4])
        assert metrics(server)["dsquant_engine_running"] >= slots - 1  # the big one is still being generated
    finally:
        big.close()
    wait_metric(server, "dsquant_engine_running", 0)


def test_unknown_routes_and_methods_are_openai_errors_and_head_health_answers(server):
    for method, path in (("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("GET", "/v2/models")):
        status, body = http(method, f"{server}{path}", b"{}" if method == "POST" else None,
                            {"Content-Type": "application/json"})
        err = json.loads(body)["error"]
        assert status == 404 and err["type"] == "invalid_request_error" and err["code"] == "not_found", body
        assert err["message"].startswith(f"Invalid URL ({method} {path})") and "/v1/chat/completions" in err["message"]
    status, body = http("DELETE", f"{server}/v1/models")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
    status, body = http("HEAD", f"{server}/health")
    assert (status, body) == (200, b"")


def test_an_answer_too_large_for_the_proxy_is_refused_before_any_work(server, tok):
    """The keyed app's ingress runs as behind Serve's gRPC proxy with an ANSWER_LIMIT message limit: a
    non-streamed request whose answer could exceed it is a 400 saying so (nothing reaches the engine); the
    same streamed, or a small one, is answered, within the bound."""
    from actors.serving.app.serve_limits import answer_bound, longest_token

    c = client(server, "/keyed", key=KEY)
    prompt0 = metrics(server, "/keyed")["dsquant_prompt_tokens_total"]
    for kw in (dict(n=2, logprobs=5, max_tokens=60), dict(logprobs=20, max_tokens=20), dict(max_tokens=400)):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=RAW, temperature=0, **kw)
        assert e.value.body["param"] == "stream" and "MiB a non-streamed answer can have behind this server's " \
            "proxy: stream it" in e.value.body["message"], e.value.body
    assert metrics(server, "/keyed")["dsquant_prompt_tokens_total"] == prompt0     # no work was done
    chunks = list(c.completions.create(model=MODEL, prompt=RAW, temperature=0, logprobs=20, max_tokens=20, stream=True))
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices) == 20
    status, body = http("POST", f"{server}/keyed/v1/completions", json.dumps(
        {"model": MODEL, "prompt": RAW, "temperature": 0, "logprobs": 3, "max_tokens": 8}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert status == 200 and len(body) <= answer_bound(1, 8, 3, longest_token(tok)) <= ANSWER_LIMIT


# ----- the engine loop, in process ---------------------------------------------------------------------

def test_engine_loop_streams_refuses_and_aborts(qdir, tok, reference):
    import queue

    from engine_ref import request
    from pipeline.engine.core.engine_loop import EngineLoop
    from pipeline.engine.protocol import EngineOutput

    with torch_threads(1):
        loop = EngineLoop(slowed(LLMEngine.from_dir(qdir, tokenizer=tok, num_blocks=16, block_size=16)))
        try:
            ok, bad, long = queue.Queue(), queue.Queue(), queue.Queue()
            loop.submit(request(tok.encode(RAW), SamplingParams(max_new_tokens=5)), ok.put)
            loop.submit(request(list(range(10, 10 + 300)), SamplingParams(max_new_tokens=5)), bad.put)
            running = request(tok.encode(RAW), SamplingParams(max_new_tokens=200))
            loop.submit(running, long.put)
            events = [ok.get(timeout=30)]
            while events[-1].finish_reason is None:
                events.append(ok.get(timeout=30))
            assert all(isinstance(e, EngineOutput) for e in events) and events[-1].finish_reason == "length"
            assert [t for e in events for t in e.token_ids] == reference["raw_ids"][:5]
            err = bad.get(timeout=30)
            assert isinstance(err, ValueError) and str(err) == (
                "the prompt has 300 tokens; this model takes at most 255 prompt tokens (256 in all)")
            assert long.get(timeout=30).finish_reason is None  # running now
            loop.abort(running.request_id)
            deadline = time.time() + 10
            while loop.snapshot["aborted"] != 1 and time.time() < deadline:
                time.sleep(0.05)
            snap = loop.snapshot
            assert (snap["aborted"], snap["running"], snap["waiting"]) == (1, 0, 0)
            assert snap["cache_blocks_free"] == snap["cache_blocks_total"] == 16
            assert snap["finished"] == {"stop": 0, "length": 1, "abort": 1} and loop.alive
        finally:
            loop.stop()
    assert not loop.alive


# ----- configuration ------------------------------------------------------------------------------------

def test_config_file_json_and_yaml(tmp_path):
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig

    data = {"model_path": "/models/q", "served_model_name": "m", "api_key": "k", "max_in_flight": 8,
            "engine": {"num_blocks": 32, "mtp": True}, "llm": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 2}}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text("model_path: /models/q\nserved_model_name: m\napi_key: k\nmax_in_flight: 8\n"
                                     "engine: {num_blocks: 32, mtp: true}\n"
                                     "llm: {num_replicas: 2, ray_actor_options: {num_cpus: 2}}\n")
    want = ServeConfig("/models/q", "m", EngineConfig(num_blocks=32, mtp=True), api_key="k", max_in_flight=8,
                       llm=DeploymentOptions(2, {"num_cpus": 2}))
    assert ServeConfig.from_file(str(tmp_path / "c.json")) == want == ServeConfig.from_file(str(tmp_path / "c.yaml"))
    assert ServeConfig.from_dict(want.to_dict()) == want
    assert ServeConfig("/models/q/").model_name == "q"
    (tmp_path / "bad.json").write_text(json.dumps({"model_path": "x", "engine": {"num_block": 3}}))
    with pytest.raises(ValueError) as e:
        ServeConfig.from_file(str(tmp_path / "bad.json"))
    assert str(e.value).startswith(f"{tmp_path / 'bad.json'}: engine: unknown key(s) ['num_block'] (known: [")
    with pytest.raises(ValueError, match="max_in_flight must be an integer >= 1, got 0"):
        ServeConfig("x", max_in_flight=0)


def test_a_killed_decode_replica_is_replaced_and_the_service_keeps_answering(server, reference):
    """Kill the replica that holds the main app's engine (as a crash would; by default the ingress replica
    owns it, engine_in_ingress): Serve starts a new one, and requests answer again, with the same greedy
    text. (Last in the module: it disturbs the main app.)"""
    import ray

    def replicas() -> list[str]:
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == "serve" and "main#OpenAIIngress" in a["name"])

    before = replicas()
    assert len(before) == 1, before
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    text, _, _ = reference["chat"]
    deadline, answer = time.time() + 120, None
    while time.time() < deadline:
        try:
            r = client(server, timeout=30).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0)
            answer = r.choices[0].message.content
            if replicas() and replicas() != before:
                break
        except openai.APIError:
            pass
        time.sleep(1)
    assert answer == text
    after = replicas()
    assert len(after) == 1 and after != before
