"""The engine on a float checkpoint (the embedded bf16 model, pipeline.engine.worker.loader.load_float): float
linears, no fa_k, the latent cached in the model's dtype, the MTP layer; against the float model's own
cached generation (pipeline.engine.core.reference.generate_ids, absorbed form) and its full forward.

- float32 compute with a float32 cache: the engine is the reference token for token (batched, chunked
  prefill, MTP on, preemption) and its logits (prefill, decode, MTP) within F32_LOGIT_TOL of it;
- the default (float32 compute, the latent and k_pe stored bf16 as served): logits within
  BF16_CACHE_LOGIT_TOL, and the greedy tokens the reference's wherever the reference is not a near-tie
  (where it is, the engine's token must be within 2 x that tolerance of the reference's best);
  batching, chunked prefill, MTP on/off and ND/NZ change no token;
- bfloat16 compute (``dtype="bfloat16"``): the same invariances, and agreement with the bf16 reference;
- an FP8 block-quantized copy (jobs.make_fp8's) loads dequantized and runs;
- served over HTTP (the official openai client, the real Serve app): the same text as the engine;
- a directory that is neither kind is refused, naming it.
"""

from __future__ import annotations


import pytest
import torch

from pipeline.assets import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine, greedy_agreement
from pipeline.engine.worker.loader import FLOAT_CHECKPOINT, QUANTIZED, dir_kind, load_model
from pipeline.engine.core.reference import generate_ids
from pipeline.engine.worker.runner import Span
from pipeline.engine.protocol import SamplingParams
from pipeline.model.loading import load_model as load_float_model
from pipeline.text.tokenizer import Tokenizer

QUESTIONS = ["What's deep learning?", "What does the os module do?", "Explain list comprehensions.",
             "How do I open a file?", "What is a decorator?", "Describe the json module."]
GREEDY = SamplingParams(max_new_tokens=32)
# max |engine - reference| over every logit of the prompts + their 32-token answers (logits up to ~20),
# measured: 1.24e-05 with a float32 cache (summation order only), 0.052 (main) and 0.030 (MTP) with the
# bf16 cache (the latent rounded to bf16 on storing). A broken engine is off by whole units.
F32_LOGIT_TOL = 1e-4
BF16_CACHE_LOGIT_TOL = 0.15
# bf16 compute: the engine's attention runs in float32, the reference's bf16 einsums do not, so near-ties
# go either way (and one flips an expert). Measured greedy agreement with the bf16 reference 0.88.
BF16_AGREE_MIN = 0.6
RAW = "The os module provides"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def f32():
    return load_model(EMBEDDED_MODEL_DIR)           # the default on the CPU: float32


@pytest.fixture(scope="module")
def reference(f32, prompts, tok):
    return [generate_ids(f32.model, p, GREEDY, eos_id=tok.eos_id) for p in prompts]


def engine(loaded, tok, **kw) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**{"num_blocks": 64, "block_size": 16, **kw}), tok)


def teacher_forced(eng: LLMEngine, ids: list[int], n_prompt: int):
    """The engine's logits at every position of ``ids`` (the prompt prefilled in one span, then one
    decode step per token) and its MTP layer's over the whole sequence: (main [n, V], mtp [n - 1, V])."""
    blocks = list(range(-(-len(ids) // eng.config.block_size)))
    rows, hidden = [], []
    for a, b in [(0, n_prompt)] + [(j, j + 1) for j in range(n_prompt, len(ids))]:
        lg, h = eng.runner.forward([Span(ids[a:b], a, blocks)], list(range(b - a)))
        rows.append(lg)
        hidden.append(h)
    hid = torch.cat(hidden)
    mtp = eng.runner.mtp_forward([Span(ids[1:], 0, blocks)], hid, range(len(ids) - 1), range(len(ids) - 1))
    return torch.cat(rows), mtp


@torch.no_grad()
def reference_logits(model, ids: list[int]):
    logits, hidden = model(torch.tensor([ids]), return_hidden=True)
    mtp, _ = model.mtp(hidden[:, :-1], torch.tensor([ids[1:]]))
    return logits[0], mtp[0]


# ----- loading ----------------------------------------------------------------------------------------

def test_load_model_picks_the_loader_by_what_the_directory_holds(f32, tmp_path):
    from torch import nn

    from pipeline.engine.layers.qlinear import Int8Linear
    from pipeline.io.safetensors_io import CheckpointError

    assert dir_kind(EMBEDDED_MODEL_DIR) == FLOAT_CHECKPOINT
    (tmp_path / "quant_model_description.json").write_text("{}")
    assert dir_kind(str(tmp_path)) == QUANTIZED
    with pytest.raises(CheckpointError, match="not a valid quantized directory"):   # load_quantized's checker
        load_model(str(tmp_path))
    m = f32.model
    assert f32.fa_k == {} and f32.quantized_linears == 0 and f32.path == EMBEDDED_MODEL_DIR
    assert not any(isinstance(x, Int8Linear) for x in m.modules())
    assert m.lm_head.weight.dtype == torch.float32 and len(m.mtp_layers) == 1       # MTP layer included
    linears = [n[: -len(".weight")] for n, w in m.state_dict().items() if w.dim() == 2 and "embed_tokens" not in n
               and not n.endswith("mlp.gate.weight")]                                # the router is no linear
    assert len(linears) > 100 and all(isinstance(m.get_submodule(n), nn.Linear) for n in linears)
    bf = load_model(EMBEDDED_MODEL_DIR, dtype="bfloat16").model
    assert bf.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(bf.lm_head.weight.float(), m.lm_head.weight)               # bf16 widened exactly
    eng = engine(f32, None, nz=True, mtp=True)
    for i, c in eng.runner.caches.items():   # no FA3: the latent and k_pe in the model's dtype (bf16)
        assert (c.latent_dtype, c.dtype, c.scale) == (torch.bfloat16, torch.bfloat16, None), i
    assert sorted(eng.runner.caches) == [0, 1, 2, 3]                                  # layer 3: MTP


def test_a_directory_of_neither_kind_is_refused_naming_it(tmp_path):
    from jobs import serve

    (tmp_path / "notes.txt").write_text("no model here")
    for call in (lambda: load_model(str(tmp_path)), lambda: LLMEngine.from_dir(str(tmp_path))):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(f"{tmp_path}: neither a quantized directory (no quant_model_description.json) "
                                       "nor a float checkpoint (config.json and *.safetensors weights: no config.json)")
        assert "notes.txt" in str(e.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="nor a float checkpoint \\(config.json and \\*.safetensors weights\\); "
                                         "it holds"):
        dir_kind(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'missing'}: not a directory"):
        load_model(str(tmp_path / "missing"))
    assert serve.main(["--model-path", str(tmp_path)]) == 2      # refused before any Ray is started


def test_a_sharded_float_replica_is_refused():
    from actors.serving.serve_config import ServeConfig, check_model_dir

    assert check_model_dir(ServeConfig(EMBEDDED_MODEL_DIR)) == FLOAT_CHECKPOINT
    with pytest.raises(ValueError, match=f"{EMBEDDED_MODEL_DIR}: a float checkpoint is served by one process "
                                         "per replica; drop the llm sharding \\(2 rank"):
        check_model_dir(ServeConfig(EMBEDDED_MODEL_DIR, parallel={"tp": 2}))
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, 'auto' or null"):
        ServeConfig(EMBEDDED_MODEL_DIR, dtype="fp8")


# ----- float32 compute, float32 cache: the reference token for token ---------------------------------------

@pytest.mark.parametrize("kw, n", [({}, 6), ({"max_batched_tokens": 16, "mtp": True}, 6),
                                   ({"num_blocks": 5, "max_batched_tokens": 64}, 4)],
                         ids=["batched", "chunked-mtp", "preempted"])
def test_float32_cache_is_the_reference_token_for_token(f32, tok, prompts, reference, kw, n):
    eng = engine(f32, tok, cache_dtype="float32", **kw)
    assert eng.generate(prompts[:n], GREEDY) == reference[:n]
    assert eng.allocator.num_free == eng.config.num_blocks
    if kw.get("mtp"):
        assert eng.stats().mtp_drafts > 0 and eng.stats().acceptance_rate >= 0.4, eng.stats()   # measured 0.65
    if kw.get("num_blocks") == 5:
        assert eng.stats().preemptions > 0


@pytest.mark.parametrize("cache, tol", [("float32", F32_LOGIT_TOL), (None, BF16_CACHE_LOGIT_TOL)],
                         ids=["float32-cache", "bf16-cache"])
def test_logits_prefill_decode_and_mtp_are_the_references(f32, prompts, reference, cache, tol):
    worst = worst_mtp = 0.0
    for p, out in list(zip(prompts, reference))[:3]:
        eng = engine(f32, None, cache_dtype=cache, mtp=True)
        got, got_mtp = teacher_forced(eng, p + out, len(p))
        want, want_mtp = reference_logits(f32.model, p + out)
        worst = max(worst, (got - want).abs().max().item())
        worst_mtp = max(worst_mtp, (got_mtp - want_mtp).abs().max().item())
    assert worst <= tol and worst_mtp <= tol, (worst, worst_mtp)
    if cache is None:   # the bf16 latent is a real rounding: not the float32 cache's agreement
        assert worst > F32_LOGIT_TOL


# ----- the default (bf16 cache), as served ----------------------------------------------------------------

def test_default_greedy_tokens_are_the_references_but_for_near_ties(f32, tok, prompts, reference):
    nd = engine(f32, tok).generate(prompts, GREEDY)
    for p, got, want in zip(prompts, nd, reference):
        j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is None:
            assert len(got) == len(want)
            continue
        row = reference_logits(f32.model, p + want[:j])[0][-1]     # the reference's logits where they part
        assert row.max() - row[got[j]] <= 2 * BF16_CACHE_LOGIT_TOL, (j, float(row.max() - row[got[j]]))
    # measured: all six identical to the reference
    assert sum(greedy_agreement(a, b) for a, b in zip(nd, reference)) / len(nd) >= 0.8
    for kw in ({"nz": True}, {"nz": True, "mtp": True, "max_batched_tokens": 16},
               {"mtp": True, "max_batched_tokens": 16}):
        eng = engine(f32, tok, **kw)
        assert eng.generate(prompts, GREEDY) == nd, kw          # NZ, MTP, chunked prefill change no token
        assert eng.allocator.num_free == 64


def test_bfloat16_compute_is_invariant_and_agrees_with_the_bf16_reference(tok, prompts):
    bf = load_model(EMBEDDED_MODEL_DIR, dtype="bfloat16")
    alone = [engine(bf, tok).generate([p], GREEDY)[0] for p in prompts[:2]]
    batched = engine(bf, tok).generate(prompts, GREEDY)
    assert batched[:2] == alone
    assert engine(bf, tok, nz=True, mtp=True, max_batched_tokens=16).generate(prompts, GREEDY) == batched
    ref = [generate_ids(bf.model, p, GREEDY, eos_id=tok.eos_id) for p in prompts]
    agree = sum(greedy_agreement(a, b) for a, b in zip(batched, ref)) / len(ref)
    assert agree >= BF16_AGREE_MIN, agree


def test_an_fp8_checkpoint_loads_dequantized_and_is_its_reference(tmp_path, tok, prompts, f32):
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.io.release_layout.fp8_copy import write_fp8_copy

    fp8 = str(tmp_path / "fp8")
    write_fp8_copy(EMBEDDED_MODEL_DIR, fp8, shards=2)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    reader = CheckpointReader(fp8)
    assert reader.header(name)[0] == "F8_E4M3" and dir_kind(fp8) == FLOAT_CHECKPOINT
    loaded = load_model(fp8)
    w = loaded.model.get_submodule(name[: -len(".weight")]).weight
    assert torch.equal(w, reader.read_tensor(name, torch.float32))            # dequantized as the quantizer reads it
    assert not torch.equal(w, f32.model.get_submodule(name[: -len(".weight")]).weight)  # FP8, not the bf16 weights
    want = [generate_ids(load_float_model(fp8, dtype=torch.float32, device="cpu"), p, GREEDY, eos_id=tok.eos_id)
            for p in prompts[:3]]
    assert LLMEngine.from_dir(fp8, tokenizer=Tokenizer.from_dir(fp8), num_blocks=64, cache_dtype="float32",
                              mtp=True).generate(prompts[:3], GREEDY) == want


def test_generate_job_runs_the_float_checkpoint_in_the_engine(capsys, f32, tok):
    from jobs import generate

    assert generate.main(["--model-path", EMBEDDED_MODEL_DIR, "--engine", "--raw", RAW, "--max-new-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    eng = engine(f32, tok, nz=True, mtp=True)
    text = tok.decode(eng.generate([tok.encode(RAW)], SamplingParams(max_new_tokens=16))[0])
    assert out.splitlines() == [f"> {RAW}"] + text.strip().splitlines()
    assert "engine: float linears (float32), bfloat16-NZ latent cache, MTP acceptance" in err


# ----- served over HTTP --------------------------------------------------------------------------------

SERVED_ENGINE = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_batched_tokens=256, nz=True, mtp=True)


@pytest.fixture(scope="module")
def float_server(serve_http):
    """The colocated app on the float checkpoint (the name clients see: the directory's), on the session's
    Serve (conftest's ``serve_http``)."""
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig
    from serve_apps import deployed

    cfg = ServeConfig(EMBEDDED_MODEL_DIR, engine=SERVED_ENGINE, llm=DeploymentOptions(1, {"num_cpus": 0.5}),
                      ingress=DeploymentOptions(1, {"num_cpus": 0.1}))
    with deployed({"float": (cfg, "/")}):
        yield serve_http


@pytest.mark.slow
def test_served_float_checkpoint_answers_the_engines_greedy_text(float_server, f32, tok):
    openai = pytest.importorskip("openai")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as in the replica: a CPU GEMM's summation order depends on the thread count
    try:
        chat_ids = tok.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        want_chat, want_raw = engine(f32, tok, **{k: getattr(SERVED_ENGINE, k) for k in (
            "num_blocks", "max_num_seqs", "max_batched_tokens", "nz", "mtp")}).generate(
            [chat_ids, tok.encode(RAW)], SamplingParams(max_new_tokens=24))
    finally:
        torch.set_num_threads(threads)
    assert len(want_raw) == 24 and len(want_chat) > 3      # measured 24 and 24: not an empty comparison
    c = openai.OpenAI(base_url=f"{float_server}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in c.models.list().data] == [EMBEDDED_MODEL_NAME]
    r = c.completions.create(model=EMBEDDED_MODEL_NAME, prompt=RAW, max_tokens=24, temperature=0)
    assert r.choices[0].text == tok.decode(want_raw) and r.usage.completion_tokens == len(want_raw)
    ch = c.chat.completions.create(model=EMBEDDED_MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                   max_tokens=24, temperature=0)
    assert ch.choices[0].message.content == tok.decode(want_chat)
