"""The engine's kernel choice (pipeline.engine.worker.kernels): the C kernels on the CPU by default (torch
where there is no compiler, or with DSQUANT_NATIVE=0), visible in the engine loop's snapshot (which /metrics
renders); and the Triton path wired into the engine end to end — decode attention and the fused MoE run through
Triton's interpreter on the CPU (``DSQUANT_KERNELS=triton``, ``TRITON_INTERPRET=1``, in a subprocess so the variables
do not leak) give the torch path's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.core.engine_loop import EngineLoop
from pipeline.engine import config as engine_config
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.worker.loader import load_quantized

SCRIPT = """
import json, sys
from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.protocol import SamplingParams
from pipeline.text.tokenizer import Tokenizer
tok = Tokenizer.from_dir(sys.argv[1])
ids = tok.encode_chat([{"role": "user", "content": "What's deep learning?"}])
eng = LLMEngine(load_quantized(sys.argv[1]), EngineConfig(num_blocks=16, nz=True), tok)
print(json.dumps({"kernels": eng.runner.kernels, "out": eng.generate([ids], SamplingParams(max_new_tokens=3))[0]}))
"""


@pytest.mark.parametrize("native_env", ["1", "0"])
def test_cpu_kernels_are_chosen_and_said(embedded_quantized, monkeypatch, native_env):
    env_before = os.environ.get("DSQUANT_KERNELS")
    assert env_before in (None, "", "auto", "torch")
    monkeypatch.setenv("DSQUANT_NATIVE", native_env)
    want = "native" if native_env == "1" and engine_config.native_available() and env_before != "torch" else "torch"
    eng = LLMEngine(load_quantized(embedded_quantized), EngineConfig(num_blocks=16))
    assert eng.runner.kernels == eng.config.kernels.backend == want      # chosen once, recorded in the config
    monkeypatch.setenv("DSQUANT_NATIVE", "1" if native_env == "0" else "0")   # a later flip changes nothing
    loop = EngineLoop(eng)
    try:
        loop._publish()
        assert loop.snapshot["kernels"]["device"] == "cpu" and loop.snapshot["kernels"]["backend"] == want
    finally:
        loop.stop(timeout=5)
    assert eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)) and eng.runner.kernels == want


@pytest.mark.slow
def test_triton_path_through_the_interpreter_gives_the_same_greedy_tokens(embedded_quantized):
    pytest.importorskip("triton")

    def start(**env) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", SCRIPT, embedded_quantized], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **env})

    def result(p: subprocess.Popen) -> dict:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    # the two independent processes side by side (the interpreter's is the long one)
    procs = [start(DSQUANT_KERNELS="torch"), start(DSQUANT_KERNELS="triton", TRITON_INTERPRET="1")]
    try:
        torch_path, triton_path = map(result, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert (torch_path["kernels"], triton_path["kernels"]) == ("torch", "triton")
    assert triton_path["out"] == torch_path["out"] and len(torch_path["out"]) == 3
