"""Logprobs and seeded sampling in the engine (the embedded model, quantized): every token's logprob and
top alternatives are log_softmax of the model's raw logits (checked against the fake-quant reference's
full forward, which the engine with a float32 k_pe cache reproduces token for token), carried on the
engine loop's EngineOutputs, one per token also when an MTP draft yields two tokens a step; a step with no
request asking computes none; and a seeded sampled request decodes the same tokens prefilled on one
engine and decoded on another (the generator's state travels in the KV handoff) as in one engine."""

from __future__ import annotations

import dataclasses
import queue

import pytest
import torch

import pipeline.engine.core.sampling as sampling_mod
from pipeline.engine.core.engine import LLMEngine
from engine_ref import request
from pipeline.engine.core.engine_loop import EngineLoop
from pipeline.engine.protocol import EngineOutput, SamplingParams
from pipeline.engine.core.sampling import token_logprobs

QUESTIONS = ["What's deep learning?", "How do I open a file?", "What is a decorator?"]
# The engine's logprobs against the fake-quant model's full forward (float32 k_pe cache: the same tokens):
# measured 4e-6 at most; the engine computes the same float32 logits in another order (paged, chunked).
REFERENCE_TOL = 1e-4
# The same engine's logprobs with and without MTP (a draft piece computes two rows at once): measured 2e-6.
MTP_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def engine(qdir, tok, **kw) -> LLMEngine:
    return LLMEngine.from_dir(qdir, tokenizer=tok, **{"num_blocks": 64, "block_size": 16, **kw})


def run(eng: LLMEngine, reqs) -> tuple[list, int, list]:
    """Step to the end (``reqs`` added already); each request's logprobs (aligned with its new tokens), how
    many outputs carried two tokens, and each request's tokens."""
    got, toks, pairs = {r.request_id: [] for r in reqs}, {r.request_id: [] for r in reqs}, 0
    asks = {r.request_id: r.params.logprobs is not None for r in reqs}
    while eng.has_work:
        for out in eng.step():
            new, lps = list(out.token_ids), out.logprobs
            toks[out.request_id] += new
            if not new or not asks[out.request_id]:
                assert not new or lps is None
                continue
            assert lps is not None and len(lps) == len(new) and [e.token_id for e in lps] == new
            got[out.request_id] += lps
            pairs += len(new) == 2
    return [got[r.request_id] for r in reqs], pairs, [toks[r.request_id] for r in reqs]


def added(eng: LLMEngine, prompts, params) -> list:
    """Requests for ``prompts`` (``params``: one for all, or one each), added to ``eng``."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [request(p, sp) for p, sp in zip(prompts, each)]
    for r in reqs:
        eng.add(r)
    return reqs


def test_token_logprobs_by_hand():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    out = token_logprobs(x, [2, 3], [2, 0])
    lp = torch.log_softmax(x, -1)
    assert out[0].token_id == 2 and out[0].logprob == pytest.approx(lp[0, 2].item(), abs=1e-7)
    assert [t for t, _ in out[0].top] == [1, 2] and out[0].top[0][1] == pytest.approx(lp[0, 1].item(), abs=1e-7)
    assert out[1].top == () and out[1].logprob == pytest.approx(lp[1, 3].item(), abs=1e-7)
    with pytest.raises(ValueError, match="logprobs must be None or in \\[0, 20\\], got 21"):
        SamplingParams(logprobs=21)


def test_logprobs_are_log_softmax_of_the_reference_logits_on_the_loops_events(qdir, tok, prompts):
    """Sampled (temperature 0.8, top_p 0.9: the logprobs are still the raw ones), through the engine loop:
    each EngineOutput carries one TokenLogprobs per token, equal to log_softmax of the fake-quant model's
    logits at that position; the top 5 sorted, the reference's top 5."""
    from pipeline.quant.evaluation.fakequant import load_fakequant_model

    loop = EngineLoop(engine(qdir, tok, cache_dtype="float32"))
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5, logprobs=5)
    try:
        sinks = [queue.Queue() for _ in prompts]
        for p, q in zip(prompts, sinks):
            loop.submit(request(p, params), q.put)
        events = []
        for q in sinks:
            evs = [q.get(timeout=60)]
            while evs[-1].finish_reason is None:
                evs.append(q.get(timeout=60))
            events.append(evs)
    finally:
        loop.stop()
    fq = load_fakequant_model(qdir)
    for prompt, evs in zip(prompts, events):
        assert all(isinstance(e, EngineOutput) for e in evs)
        assert all((e.logprobs is None) == (not e.token_ids) for e in evs)
        out = [t for e in evs for t in e.token_ids]
        lps = [x for e in evs for x in (e.logprobs or ())]
        assert len(lps) == len(out) > 0 and [x.token_id for x in lps] == out
        with torch.no_grad():
            ref = torch.log_softmax(fq(torch.tensor([prompt + out]))[0].float(), -1)[len(prompt) - 1:-1]
        want = ref.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([x.logprob for x in lps]), want, atol=REFERENCE_TOL, rtol=0)
        top_v, top_i = ref.topk(5, -1)
        for x, v, i in zip(lps, top_v, top_i):
            values = [lp for _, lp in x.top]
            assert len(x.top) == 5 and values == sorted(values, reverse=True)
            assert torch.allclose(torch.tensor(values), v, atol=REFERENCE_TOL, rtol=0)
            assert [t for t, _ in x.top] == i.tolist()
            if x.token_id in dict(x.top):  # the chosen token's entry is its logprob
                assert dict(x.top)[x.token_id] == pytest.approx(x.logprob, abs=1e-6)
            else:
                assert x.logprob <= values[-1] + REFERENCE_TOL


def test_mtp_gives_each_of_two_tokens_its_own_logprobs(qdir, tok, prompts):
    params = SamplingParams(max_new_tokens=16, logprobs=3)
    plain = engine(qdir, tok, nz=True)
    want, _, want_tokens = run(plain, added(plain, prompts, params))
    mtp = engine(qdir, tok, nz=True, mtp=True)
    got, pairs, tokens = run(mtp, added(mtp, prompts, params))
    assert mtp.stats().mtp_accepted > 0 and pairs > 0               # drafts accepted: two tokens a step
    assert tokens == want_tokens
    for g, w in zip(got, want):
        assert [x.token_id for x in g] == [x.token_id for x in w]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(g, w)) <= MTP_TOL
        assert all([t for t, _ in a.top] == [t for t, _ in b.top] for a, b in zip(g, w))
        assert all(a.top[0][0] == a.token_id for a in g)              # greedy, no penalty: the top-1


def test_no_logprobs_asked_none_computed(qdir, tok, prompts, monkeypatch):
    calls = []

    def spy(logits, token_ids, ks):
        calls.append(len(token_ids))
        return token_logprobs(logits, token_ids, ks)

    monkeypatch.setattr(sampling_mod, "token_logprobs", spy)
    eng = engine(qdir, tok)
    eng.generate(prompts, SamplingParams(max_new_tokens=6))
    assert calls == [] and eng.step_logprobs is LLMEngine.step_logprobs == {}
    reqs = added(eng, prompts[:2], [SamplingParams(max_new_tokens=6, logprobs=0, ignore_eos=True),
                                    SamplingParams(max_new_tokens=6)])
    got, _, tokens = run(eng, reqs)
    assert calls == [1] * len(tokens[0])              # one batch a step, of the one row that asks
    assert len(got[0]) == len(tokens[0]) and got[1] == [] and all(x.top == () for x in got[0])


@pytest.mark.parametrize("kw", [{}, {"nz": True}], ids=["nd", "nz"])
def test_seeded_sampling_is_the_same_disaggregated(qdir, tok, prompts, kw):
    """Temperature 0.8, a seed per prompt: prefill on one engine, decode on another gives one engine's
    tokens (and the first token's logprobs travel too). Without the generator's state the decode engine
    would start the generator over: the test shows that changes the tokens."""
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, seed=11 + i, logprobs=2, min_tokens=3)
              for i in range(len(prompts))]
    one = engine(qdir, tok, **kw)
    want_lps, _, want = run(one, added(one, prompts, params))
    pre, dec = engine(qdir, tok, **kw), engine(qdir, tok, **kw)
    reqs = [request(p, sp) for p, sp in zip(prompts, params)]
    handoffs = [pre.prefill(r) for r in reqs]
    assert pre.allocator.num_free == 64 and all(h.generator_device == "cpu" for h in handoffs)
    for h, w in zip(handoffs, want_lps):
        assert h.first_token == w[0].token_id
        assert h.first_logprobs[0].logprob == pytest.approx(w[0].logprob, abs=MTP_TOL)
    for r, h in zip(reqs, handoffs):
        dec.add_prefilled(r, h)
    _, _, decoded = run(dec, reqs)
    assert [[h.first_token] + d for h, d in zip(handoffs, decoded)] == want
    assert dec.allocator.num_free == 64
    again = [request(r.prompt_ids, r.params) for r in reqs]
    for r, h in zip(again, handoffs):
        dec.add_prefilled(r, dataclasses.replace(h, generator_state=None))
    _, _, restarted = run(dec, again)
    assert [[h.first_token] + d for h, d in zip(handoffs, restarted)] != want
    with pytest.raises(ValueError, match="state is for a cuda generator but this engine samples on cpu"):
        dec.add_prefilled(request(prompts[0], params[0]),
                          dataclasses.replace(handoffs[0], generator_device="cuda:0"))
