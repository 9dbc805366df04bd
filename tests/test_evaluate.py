"""Fake-quant evaluation: the quantized arithmetic of a directory (ours or msModelSlim's) against the
float model, the perplexity variants, and the accuracy target on the embedded (trained) model."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.text import corpus
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.model.loading import load_model
from pipeline.model.perplexity import token_stream
from pipeline.quant.evaluate import evaluate, sqnr_db, write_parquet
from pipeline.quant.fakequant import QuantLinear, load_fakequant_model
from pipeline.quant.run import QuantizeOptions
from pipeline.text.tokenizer import Tokenizer
from tiny import FIXTURES, TINY_FIXTURE

CALIB = str(FIXTURES / "calib.json")
# Measured on the fixture (random weights): every module's own error stays above this SQNR.
MIN_MODULE_SQNR_DB = 20.0
# The target for the trained embedded model: W8A8 + FA3 perplexity within 2% of float.
PPL_TARGET_PCT = 2.0


@pytest.mark.parametrize("name", ["msmodelslim-v1-bf16", "msmodelslim-v1-fp16"])
@torch.no_grad()
def test_msmodelslim_output_runs_close_to_float(name):
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = load_model(str(TINY_FIXTURE), dtype="float32", device="cpu")(ids)
    model = load_fakequant_model(str(FIXTURES / name))
    # 4 attention blocks (MTP too), the dense MLP, 3 MoE layers
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * 4 + 3 + 3 * 27
    assert sqnr_db(ref, model(ids)) > 25.0


def test_fixture_evaluation_rows(tmp_path):
    tok = Tokenizer.from_dir(str(TINY_FIXTURE))
    held = token_stream(tok, json.loads(open(CALIB).read())[:4])
    ppl, sqnr = evaluate(str(TINY_FIXTURE), str(tmp_path), held, opts=QuantizeOptions(calib_path=CALIB),
                         seq=128, log=lambda m: None)
    assert [(r["variant"], r["smooth"]) for r in ppl] == [
        ("float", False), ("W8A8 + FA3", False), ("W8A8 only", False), ("FA3 only", False),
        ("W8A8 + FA3", True), ("W8A8 only", True), ("FA3 only", True)]
    assert all(abs(r["delta_pct"]) < 1.0 for r in ppl)
    linear = [r for r in sqnr if r["type"] != "attention"]
    assert len(linear) == 2 * (4 * 3 + 27 * 2 + 3)     # per smoothing: 3 layers' attention + dense + experts
    assert min(r["sqnr_db"] for r in sqnr) > MIN_MODULE_SQNR_DB
    write_parquet(sqnr, str(tmp_path / "s.parquet"))
    assert pq.read_table(tmp_path / "s.parquet").num_rows == len(sqnr)


@pytest.mark.slow
def test_embedded_model_accuracy_target(tmp_path):
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    _, held = corpus.load_heldout(EMBEDDED_MODEL_DIR)
    stream = token_stream(tok, [d.text for d in held])[: 4 * 256 + 1]
    ppl, sqnr = evaluate(EMBEDDED_MODEL_DIR, str(tmp_path), stream, seq=256, log=lambda m: None, full_only=True)
    assert [(r["variant"], r["smooth"]) for r in ppl] == [("float", False), ("W8A8 + FA3", False),
                                                          ("W8A8 + FA3", True)] and sqnr == []
    full = [r for r in ppl if r["variant"] == "W8A8 + FA3"]
    assert all(r["delta_pct"] < PPL_TARGET_PCT for r in full), full
