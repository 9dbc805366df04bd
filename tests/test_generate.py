"""Generation on the float model: cached absorbed decode reproduces the naive full forward token by token;
sampling filters and seeds behave; bad parameters are named."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.core.reference import generate_ids, generate_text
from pipeline.model.loading import load_model
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.core.sampling import sample
from pipeline.text.tokenizer import Tokenizer
from tiny import TINY_FIXTURE


@pytest.fixture(scope="module")
def model():
    return load_model(str(TINY_FIXTURE), dtype="float32", device="cpu", with_mtp=False)


@torch.no_grad()
def test_greedy_equals_argmax_of_full_forward(model):
    prompt = [0, 17, 99, 250, 3]
    got = generate_ids(model, prompt, SamplingParams(max_new_tokens=12))
    seq = list(prompt)
    for _ in range(12):                                  # the reference: no cache, naive form, whole sequence
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    prompt = [0, 5, 6, 7]
    p = SamplingParams(max_new_tokens=10, temperature=1.0, seed=123)
    a, b = generate_ids(model, prompt, p), generate_ids(model, prompt, p)
    assert a == b
    assert a != generate_ids(model, prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=124))
    greedy = generate_ids(model, prompt, SamplingParams(max_new_tokens=10))
    assert generate_ids(model, prompt, SamplingParams(max_new_tokens=10, temperature=0.7, top_k=1, seed=5)) == greedy
    assert generate_ids(model, prompt, SamplingParams(max_new_tokens=10, temperature=0.7, top_p=1e-6, seed=5)) == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.8)
    g = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, p, g)) for _ in range(400)}
    assert seen == {0, 1}                                 # 0.5 + 0.3 reaches 0.8; 2 and 3 are cut


def test_top_k_restricts_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, SamplingParams(temperature=5.0, top_k=2), g)) for _ in range(300)}
    assert seen == {0, 1}


def test_eos_stops_generation(model):
    prompt = [0, 9, 8]
    first = generate_ids(model, prompt, SamplingParams(max_new_tokens=1))[0]
    assert generate_ids(model, prompt, SamplingParams(max_new_tokens=5), eos_id=first) == []


def test_stop_strings_cut_text(model):
    tok = Tokenizer.from_dir(str(TINY_FIXTURE))
    full = generate_text(model, tok, "hello world", SamplingParams(max_new_tokens=16), chat=False)
    assert len(full) > 4
    stop = full[2:4]
    cut = generate_text(model, tok, "hello world", SamplingParams(max_new_tokens=16, stop=(stop,)), chat=False)
    assert cut == full[: full.index(stop)]


@pytest.mark.parametrize("kw, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k must be >= 0"),
])
def test_bad_sampling_params(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_prompt_errors(model):
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate_ids(model, [], SamplingParams())
    too_long = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"exceeds max_position_embeddings \(163840\)"):
        generate_ids(model, [1] * too_long, SamplingParams(max_new_tokens=1))
