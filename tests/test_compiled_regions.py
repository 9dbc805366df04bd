"""EngineConfig.compile: the layers' work around attention through torch.compile (pipeline/engine/layers/decoder.py)
against the eager reference on the embedded quantized model: logits within a stated tolerance at every
step shape (prefill chunk, a decode batch, one token), and the same greedy tokens under batching."""

from __future__ import annotations

import shutil

import pytest
import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.worker.runner import Span
from pipeline.engine.protocol import SamplingParams
from pipeline.text.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow,    # compiling takes ~40-90 s on 2 cores
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="torch.compile's CPU backend needs a C++ compiler")]

# Compiled vs eager logits (float32, |logits| up to ~20): fused float arithmetic reassociates sums and
# fuses SiLU; measured max |diff| ~1e-5 on these prompts. Stated bound:
LOGITS_ATOL = 1e-3
PROMPTS = ["What's deep learning?", "The os module provides", "def main():"]


@pytest.fixture(scope="module")
def engines(embedded_quantized):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(embedded_quantized)
    lm = load_quantized(embedded_quantized)
    cfg = dict(num_blocks=64, block_size=16, nz=True)
    yield tok, LLMEngine(lm, EngineConfig(**cfg), tok), LLMEngine(lm, EngineConfig(**cfg, compile=True), tok)
    torch.set_num_threads(threads)


def test_compiled_logits_are_eager_within_tolerance(engines):
    tok, eager, compiled = engines
    assert compiled.runner.ops.compiled and not eager.runner.ops.compiled
    ids = [tok.encode(p) for p in PROMPTS]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(ids))]   # the same blocks in both caches
    outs = {}
    for name, eng in (("eager", eager), ("compiled", compiled)):  # prefill all three, a decode step, one row
        spans = [Span(p, 0, tables[i]) for i, p in enumerate(ids)]
        rows, k = [], 0
        for p in ids:
            k += len(p)
            rows.append(k - 1)
        prefill, _ = eng.runner.forward(spans, rows)
        nxt = prefill.argmax(-1).tolist()
        decode, _ = eng.runner.forward([Span([t], len(p), tables[i]) for i, (t, p) in enumerate(zip(nxt, ids))],
                                       list(range(len(ids))))
        one, _ = eng.runner.forward([Span([nxt[0]], len(ids[0]), tables[0])], [0])
        outs[name] = (prefill, decode, one)
    for a, b in zip(outs["eager"], outs["compiled"]):
        assert a.shape == b.shape and (a - b).abs().max().item() <= LOGITS_ATOL


def test_compiled_greedy_tokens_equal_eager(engines):
    tok, eager, compiled = engines
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=16)
    assert compiled.generate(prompts, params) == eager.generate(prompts, params)
