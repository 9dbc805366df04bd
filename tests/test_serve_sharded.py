"""Sharded engine replicas behind the OpenAI server, on the simulated Ray cluster, spoken to with the official
``openai`` client: a MindIE block of worldSize 2 (tp 2, moe_ep 2) served colocated, the same block
disaggregated with a DP-attention prefill replica (dp 2 x moe_ep 2: its groups hand their blocks to the
tp 2 x moe_ep 2 decode replica), and a colocated DP-attention replica (two groups with their own sequences
and caches). Greedy text
equals the single-rank engine's. A rank killed (SIGKILL) takes its replica down as a unit: the request in
flight fails with 503, /health says so, Serve replaces the replica and the service answers again."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

from serve_apps import deployed  # noqa: E402
from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.core.engine import LLMEngine  # noqa: E402
from pipeline.engine.protocol import SamplingParams  # noqa: E402
from pipeline.text.tokenizer import Tokenizer  # noqa: E402

ENGINE = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8, "max_batched_tokens": 256, "nz": True, "mtp": True}
QUESTION = "What's deep learning?"
MAX_TOKENS = 24
REPLACED_WITHIN_S = 120      # Serve's health check (10 s period) plus a new replica's ranks loading


def mindie_block(path: str) -> dict:
    return {"ModelConfig": [{"modelName": "tiny-sharded", "modelWeightPath": path, "worldSize": 2, "tp": 2, "dp": 1,
                             "moe_ep": 2, "moe_tp": 1, "sp": 1,
                             "plugin_params": "{\"plugin_type\":\"mtp\",\"num_speculative_tokens\": 1}",
                             "models": {"deepseekv2": {"kv_cache_options": {"enable_nz": True}}}}]}


@pytest.fixture(scope="module")
def server(serve_http, embedded_quantized):
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig

    rank = {"num_cpus": 0.5}
    colo = ServeConfig.from_mindie(mindie_block(embedded_quantized), 2, cpu=True, engine=ENGINE,
                                   llm={"ray_actor_options": rank},
                                   ingress=DeploymentOptions(1, {"num_cpus": 0.1}))
    assert colo.parallel == {"tp": 2, "dp": 1, "moe_ep": 2, "moe_tp": 1} and colo.engine.mtp
    disagg = ServeConfig.from_mindie(mindie_block(embedded_quantized), 2, cpu=True, engine=ENGINE,
                                     mode="disaggregated", prefill_parallel={"dp": 2, "moe_ep": 2},
                                     llm={"ray_actor_options": rank}, prefill=DeploymentOptions(1, rank),
                                     ingress=DeploymentOptions(1, {"num_cpus": 0.1}))
    dp = ServeConfig(embedded_quantized, "tiny-sharded", EngineConfig(**ENGINE), parallel={"dp": 2, "moe_ep": 2},
                     llm=DeploymentOptions(1, rank), ingress=DeploymentOptions(1, {"num_cpus": 0.1}))
    with deployed({"colo": (colo, "/"), "dp": (dp, "/dp"), "disagg": (disagg, "/disagg")}):
        yield serve_http


@pytest.fixture(scope="module")
def reference(embedded_quantized) -> str:
    """The single-rank engine's greedy answer, in this process with one thread (as each rank runs)."""
    import torch

    tok = Tokenizer.from_dir(embedded_quantized)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = LLMEngine.from_dir(embedded_quantized, tokenizer=tok, **ENGINE)
        ids = tok.encode_chat([{"role": "user", "content": QUESTION}])
        return tok.decode(eng.generate([ids], SamplingParams(max_new_tokens=MAX_TOKENS))[0])
    finally:
        torch.set_num_threads(threads)


def client(server: str, prefix: str = "") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server}{prefix}/v1", api_key="none", max_retries=0, timeout=120)


def ask(server: str, prefix: str = "", stream: bool = False) -> str:
    c = client(server, prefix)
    msgs = [{"role": "user", "content": QUESTION}]
    if stream:
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny-sharded", messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True) if ch.choices)
    return c.chat.completions.create(model="tiny-sharded", messages=msgs, max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].message.content


@pytest.mark.parametrize("prefix", ["", "/disagg", "/dp"],
                         ids=["colocated-mindie", "disaggregated-mindie-dp-prefill", "dp-attention"])
def test_sharded_replicas_answer_as_one_rank(server, reference, prefix):
    assert ask(server, prefix) == reference
    assert ask(server, prefix, stream=True) == reference


def test_dp_attention_replica_spreads_concurrent_requests_over_its_groups(server, reference):
    import concurrent.futures

    from ray import serve

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: ask(server, "/dp"), range(4)))
    assert answers == [reference] * 4
    stats = serve.get_deployment_handle("LLMServer", app_name="dp").stats.remote().result()
    assert [r["rank"] for r in stats["ranks"]] == [0, 1] and stats["running"] == 0


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_killed_rank_takes_its_replica_down_and_serve_replaces_it(server, reference):
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name="colo")
    ranks = handle.stats.remote().result()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as e:       # the replica cannot run a step any more
        ask(server)
    assert e.value.status_code == 503
    deadline = time.time() + REPLACED_WITHIN_S
    while True:                                            # Serve replaces the replica, ranks and all
        try:
            text = ask(server)
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            assert time.time() < deadline, "the replica was not replaced"
            time.sleep(2)
    assert text == reference
    new = handle.stats.remote().result()["ranks"]
    assert new[1]["pid"] != ranks[1]["pid"] and _status(f"{server}/health") == 200
