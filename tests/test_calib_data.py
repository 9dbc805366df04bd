"""Calibration data loading: the three formats agree, and every bad input names file and sample."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.quant.calibration.calib_data import CalibDataError, load_texts, tokenize
from pipeline.text.tokenizer import Tokenizer
from tiny import FIXTURES

TEXTS = ["The assert statement.", "What does json.dumps do?", "ünïcode ok"]


def test_default_is_the_embedded_models_texts():
    texts = load_texts()
    assert len(texts) == 64 and all(isinstance(t, str) and t for t in texts)


def test_msmodelslim_fixture_calib_json():
    texts = load_texts(str(FIXTURES / "calib.json"))
    assert len(texts) == 16
    assert load_texts(str(FIXTURES / "calib8.json")) == texts[:8]   # the distributed tests' texts


def test_formats_agree(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(TEXTS))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)) + "\n\n")
    pq.write_table(pa.table({"text": TEXTS, "n": [1, 2, 3]}), tmp_path / "c.parquet")
    for name in ("c.json", "c.jsonl", "c.parquet"):
        assert load_texts(str(tmp_path / name)) == TEXTS
    assert load_texts(f"file://{tmp_path}/c.parquet") == TEXTS


@pytest.mark.parametrize("name, content, message", [
    ("a.json", "[]", "no calibration samples"),
    ("a.json", "{broken", "not valid JSON"),
    ("a.json", '{"text": "x"}', "expected a JSON list of strings, got dict"),
    ("a.json", '["ok", 3]', "sample 1 is int, expected a string"),
    ("a.json", '["ok", "   "]', "sample 1 is empty"),
    ("a.jsonl", '{"text": "a"}\n{"txt": "b"}\n', "line 2 has no 'text' field"),
    ("a.jsonl", '{"text": "a"}\nnot json\n', "line 2: not valid JSON"),
    ("a.txt", "hello", "unknown calibration format"),
])
def test_bad_input_named(tmp_path, name, content, message):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(CalibDataError, match=message) as e:
        load_texts(str(p))
    assert str(p) in str(e.value)


def test_bad_parquet(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": TEXTS}), p)
    with pytest.raises(CalibDataError, match=r"no 'text' column \(columns: \['body'\]\)"):
        load_texts(str(p))
    p.write_bytes(b"PAR1 garbage")
    with pytest.raises(CalibDataError, match="not a readable Parquet file"):
        load_texts(str(p))
    with pytest.raises(CalibDataError, match="calibration file not found"):
        load_texts(str(tmp_path / "missing.json"))


def test_too_long_sample():
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    ids = tokenize(TEXTS, tok, max_tokens=64)
    assert all(i[0] == tok.bos_id for i in ids)
    with pytest.raises(CalibDataError, match=r"sample 1 has \d+ tokens, more than the limit of 3"):
        tokenize(["a", "a much longer sample text"], tok, max_tokens=3)
    assert [len(i) for i in tokenize(["a much longer sample text"], tok, max_tokens=3, truncate=True)] == [3]
