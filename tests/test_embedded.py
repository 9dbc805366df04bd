"""The embedded default model: its shape contract, its agreement with transformers, its recorded
held-out perplexity, and the README's first command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import layout
from pipeline.text import corpus
from pipeline.io.checkpoint import CheckpointReader
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.model.loading import load_model
from pipeline.model.perplexity import perplexity, token_stream
from pipeline.text.tokenizer import Tokenizer

ASSETS = Path(EMBEDDED_MODEL_DIR)
REPO = Path(__file__).resolve().parents[1]
# logits of the absorbed MLA form against the plain one (float32): measured <= 2e-5 on an AVX2 CPU, 2.6e-5
# on an AVX-512 + AMX one (its GEMMs sum in another order)
ABSORB_ATOL = 6e-5
PPL_RTOL = 1e-3      # re-evaluating the shipped weights reproduces the recorded perplexity (fp32, CPU)


@pytest.fixture(scope="module")
def model():
    return load_model(EMBEDDED_MODEL_DIR, dtype="float32", device="cpu")


def test_architecture_contract():
    reader = CheckpointReader(EMBEDDED_MODEL_DIR)
    cfg = reader.config
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (512, 64)              # V3's real MLA widths
    assert reader.header("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")[1] == (576, cfg.hidden_size)
    assert cfg.first_k_dense_replace >= 1 and cfg.num_hidden_layers > cfg.first_k_dense_replace
    assert cfg.n_group > 1 and cfg.n_shared_experts >= 1 and cfg.num_nextn_predict_layers == 1
    assert cfg.rope_scaling is not None and cfg.torch_dtype == "bfloat16"
    assert set(reader.tensor_names()) == set(layout.checkpoint_shapes(cfg))
    assert reader.header("model.embed_tokens.weight")[0] == "BF16"
    assert (ASSETS / "model.safetensors").stat().st_size < 30 * 1024 * 1024


@torch.no_grad()
def test_matches_transformers(model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        EMBEDDED_MODEL_DIR, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    _, held = corpus.load_heldout(EMBEDDED_MODEL_DIR)
    long = [d.text for d in held if len(tok.encode(d.text)) >= 96][:2]
    ids = torch.tensor([tok.encode(t)[:96] for t in long])
    diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    assert (model(ids, absorb=True) - model(ids)).abs().max().item() <= ABSORB_ATOL


def test_recorded_heldout_perplexity_reproduces(model):
    report = json.loads((ASSETS / "training_report.json").read_text())
    recorded = report["final_heldout_bf16_weights"]
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    _, held = corpus.load_heldout(EMBEDDED_MODEL_DIR)
    got = perplexity(model, token_stream(tok, [d.text for d in held]), seq=report["heldout_eval_seq"])
    assert got["tokens"] == recorded["tokens"]
    assert got["perplexity"] == pytest.approx(recorded["perplexity"], rel=PPL_RTOL)
    assert got["mtp_top1"] == pytest.approx(recorded["mtp_top1"], rel=PPL_RTOL)
    # it learned something: far below the uniform vocabulary's perplexity
    assert got["perplexity"] < model.config.vocab_size / 50


def run_job(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "jobs.generate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_readme_main_job_answers():
    r = run_job("What's deep learning?", "--max-new-tokens", "24")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "> What's deep learning?"
    assert len(" ".join(lines[1:]).split()) >= 3          # a non-trivial answer


def test_job_error_is_clear(tmp_path):
    r = run_job("hi", "--model-path", str(tmp_path / "nowhere"))
    assert r.returncode == 2
    assert "nowhere: not a checkpoint directory" in r.stderr
