"""pipeline.engine.worker.memory: a server or job whose engines cannot fit in free memory is refused up front
in one line naming the model directory, the bytes needed and the bytes free; jobs.generate says so with exit
status 2 and loads nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.engine.worker import memory


def test_estimate_and_refusal(tmp_path, monkeypatch):
    monkeypatch.delenv("DSQUANT_SKIP_MEMORY_CHECK", raising=False)   # the session's (conftest) is off here
    (tmp_path / "a.safetensors").write_bytes(b"\0" * 1000)       # unreadable headers: counted as float
    (tmp_path / "b.safetensors").write_bytes(b"\0" * 3000)
    assert memory.weight_bytes(str(tmp_path)) == 4000
    assert memory.engine_bytes(str(tmp_path)) == 4000 * memory.FLOAT_MODEL_FACTOR // 2 + memory.FIXED_BYTES
    assert memory.weight_bytes("s3://bucket/model") is None
    need = memory.engine_bytes(str(tmp_path))
    monkeypatch.setattr(memory, "available_bytes", lambda: 2 * need)
    memory.check_fits(str(tmp_path), engines=2)                  # exactly fits
    with pytest.raises(ValueError) as e:
        memory.check_fits(str(tmp_path), engines=3)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and "3 engine(s)" in msg and "GB is free" in msg
    monkeypatch.setenv("DSQUANT_SKIP_MEMORY_CHECK", "1")
    memory.check_fits(str(tmp_path), engines=3)


def test_int8_weights_are_held_once_float_ones_by_what_they_become_and_the_largest_layer_once_more(tmp_path):
    """What the loader holds (the module docstring): int8 bytes once; a quantized output's bias-free bf16
    float linear as bf16 bits (kv_b_proj also as the attention's forms), every other float value as
    float32, each float linear as float32 where the C float kernels do not run; a float checkpoint's the
    same way where they run (its linears read as bits: float_bits), else its values as float32 and a bf16
    copy; and the largest layer once more while it is read and packed."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.w": torch.zeros(1000, dtype=torch.int8),
               "model.layers.1.mlp.w": torch.zeros(3000, dtype=torch.int8),
               "model.layers.1.mlp.s": torch.zeros(10, dtype=torch.float32),
               "model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(4, 5, dtype=torch.bfloat16),
               "model.layers.1.mlp.gate.weight": torch.zeros(2, 5, dtype=torch.bfloat16),     # the router
               "model.layers.1.eh_proj.weight": torch.zeros(3, 5, dtype=torch.float16),       # not bf16
               "model.layers.1.o_proj.weight": torch.zeros(3, 5, dtype=torch.bfloat16),       # with a bias
               "model.layers.1.o_proj.bias": torch.zeros(3, dtype=torch.float32),
               "model.embed_tokens.weight": torch.zeros(7, 5, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(100, 5, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))
    layer1 = 3000 + 40 + 40 + 20 + 30 + 30 + 12
    floats = 10 + 2 * 5 + 3 * 5 + 3 * 5 + 3 + 7 * 5           # the values held as float32 either way
    as_bits = 1000 + 3000 + floats * memory.FLOAT_FACTOR + 20 * memory.KV_B_FACTOR + 500 * memory.BITS_FACTOR
    as_float = memory.tensor_bytes(str(tmp_path), bits=True)   # no description: a float checkpoint
    assert (as_float.total, as_float.largest_layer) == (1000 + layer1 + 70 + 1000, layer1)
    assert as_float.held == as_bits
    as_float = memory.tensor_bytes(str(tmp_path), bits=False)
    assert as_float.held == 1000 + 3000 + (floats + 20 + 500) * memory.FLOAT_MODEL_FACTOR
    (tmp_path / "quant_model_description.json").write_text("{}")
    w = memory.tensor_bytes(str(tmp_path), bits=True)
    assert w.held == as_bits
    assert memory.engine_bytes(str(tmp_path)) == memory.tensor_bytes(str(tmp_path)).held + layer1 + memory.FIXED_BYTES
    wide = memory.tensor_bytes(str(tmp_path), bits=False)
    assert wide.held == 1000 + 3000 + (floats + 500) * memory.FLOAT_FACTOR + 20 * memory.KV_B_WIDE_FACTOR


def test_available_bytes_reads_the_machine():
    free = memory.available_bytes()
    assert free is None or free > 0


def test_generate_refuses_a_model_that_does_not_fit(embedded_quantized, monkeypatch):
    """A limit far below the weights (a fake MemAvailable is not possible from outside: the fixed part is raised
    instead) gives one error line and status 2."""
    monkeypatch.delenv("DSQUANT_SKIP_MEMORY_CHECK", raising=False)   # the session's (conftest) is off here
    code = ("import sys; from pipeline.engine.worker import memory; memory.FIXED_BYTES = 10**15; "
            "from jobs.generate import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "--model-path", str(embedded_quantized), "hello"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and "GB is free" in lines[-1] and "Traceback" not in out.stderr


def test_without_the_mtp_layer_its_tensors_are_not_counted(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    save_file({"model.layers.2.w": torch.zeros(100, dtype=torch.int8),
               "model.layers.3.w": torch.zeros(1000, dtype=torch.int8),
               "lm_head.weight": torch.zeros(10, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))
    assert memory.weight_bytes(str(tmp_path), with_mtp=False) == 100 + 20
    assert memory.weight_bytes(str(tmp_path)) == 100 + 1000 + 20



def test_a_float_checkpoint_with_fp8_weights_counts_float32_and_a_bf16_copy(tmp_path):
    """An FP8 checkpoint is dequantized to float32 values (not read as bits: float_bits.takes)."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
               "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(1, 1, dtype=torch.float32),
               "lm_head.weight": torch.zeros(10, 2, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))
    assert memory.tensor_bytes(str(tmp_path), bits=True).held == (16 + 1 + 20) * memory.FLOAT_MODEL_FACTOR
