"""ignore_eos, min_tokens and the penalties: their arithmetic against a hand computation, and the engine
honouring them (the same tokens as the float reference generator where both apply them)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.core.sampling import adjust_logits
from pipeline.text.tokenizer import Tokenizer


def test_adjust_logits_by_hand():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = adjust_logits(x, p, prompt=[0, 1], output=[3, 3, 1], eos_id=4)
    # token 0: prompt, positive -> /2; token 1: prompt+output (once), negative -> *2, then -0.5 - 0.25;
    # token 3: output twice, positive -> /2, then -0.5 - 0.5; tokens 2, 4: untouched
    assert got.tolist() == [[1.0, -2.75, 0.5, 0.5, -2.0]]
    assert adjust_logits(x, SamplingParams(), [0], [1], 4) is x                          # nothing to apply
    blocked = adjust_logits(x, SamplingParams(min_tokens=2, max_new_tokens=4), [0], [3], eos_id=4)
    assert blocked[0, 4] == float("-inf") and torch.equal(blocked[0, :4], x[0, :4])
    assert adjust_logits(x, SamplingParams(min_tokens=2, max_new_tokens=4), [0], [3, 1], eos_id=4) is x
    for bad, msg in (({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
                     ({"min_tokens": 5, "max_new_tokens": 4}, "min_tokens must be in .0, max_new_tokens=4."),
                     ({"presence_penalty": float("nan")}, "presence_penalty must be finite")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def eng(embedded_quantized):
    tok = Tokenizer.from_dir(embedded_quantized)
    return LLMEngine.from_dir(embedded_quantized, tokenizer=tok, num_blocks=64, block_size=16), tok


def test_ignore_eos_and_min_tokens_in_the_engine(eng):
    engine, tok = eng
    prompt = tok.encode_chat([{"role": "user", "content": "What's deep learning?"}])
    (plain,) = engine.generate([prompt], SamplingParams(max_new_tokens=64))
    assert len(plain) < 64                       # the model ends its answer with eos well before 64 tokens
    (through,) = engine.generate([prompt], SamplingParams(max_new_tokens=len(plain) + 8, ignore_eos=True))
    assert len(through) == len(plain) + 8 and through[:len(plain)] == plain and through[len(plain)] == tok.eos_id
    (longer,) = engine.generate([prompt], SamplingParams(max_new_tokens=64, min_tokens=len(plain) + 3))
    assert longer[:len(plain)] == plain and len(longer) >= len(plain) + 3 and tok.eos_id not in longer[:len(plain) + 3]


def test_repetition_penalty_changes_greedy_output_as_the_reference_does(eng, embedded_quantized):
    """Greedy with a penalty: the engine's tokens are the argmax of the penalized logits, step by step,
    which the fake-quant model through the reference generator also computes."""
    from pipeline.engine.core.reference import generate_ids
    from pipeline.quant.evaluation.fakequant import load_fakequant_model

    engine, tok = eng
    prompt = tok.encode("The os module provides", add_bos=True)
    params = SamplingParams(max_new_tokens=24, repetition_penalty=1.8, frequency_penalty=0.5, ignore_eos=True)
    (plain,) = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
    (pen,) = engine.generate([prompt], params)
    assert pen != plain
    ref = generate_ids(load_fakequant_model(embedded_quantized, dtype=torch.float32), prompt, params, tok.eos_id)
    agree = sum(a == b for a, b in zip(pen, ref)) / len(ref)
    # measured 1.0 on this prompt; the engine's bf16 k_pe cache against the float32 reference may part at a
    # near-tie, so one token in ten may differ
    assert pen[:4] == ref[:4] and agree >= 0.9, (pen, ref)
