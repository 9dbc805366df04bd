"""The corpus split, the shipped tokenizer assets and pipeline.text.tokenizer, checked against transformers."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import fsspec
import pytest

from pipeline.text import corpus
from tiny import TINY_FIXTURE
from pipeline.text.tokenizer import (
    ASSISTANT, BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, USER, Tokenizer, TokenizerError, render_chat_template,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ASSETS = Path(corpus.ASSET_DIR)
FIXTURE = TINY_FIXTURE
ROOT = Path(__file__).resolve().parents[1]

CHATS = [
    [{"role": "user", "content": "What does json.dumps do?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain the \"with\" statement."},
     {"role": "assistant", "content": "It wraps a block:\n\n   with open(p) as f:\n       pass"},
     {"role": "user", "content": "And async with?"}],
    [{"role": "system", "content": "One."}, {"role": "system", "content": "Two."},
     {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hm</think>Hello — ünïcode ✓"}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(str(ASSETS))


@pytest.fixture(scope="module")
def docs() -> list[corpus.Doc]:
    return corpus.documents()


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ASSETS))


def _same_python() -> None:
    recorded, _ = corpus.load_heldout()
    if recorded != platform.python_version():
        pytest.skip(f"assets were made by Python {recorded}, this is {platform.python_version()}: "
                    "the stdlib docstrings differ between versions")


# --------------------------------------------------------------------------------------------- corpus


def test_documents_unique_and_sized(docs):
    assert len({d.id for d in docs}) == len(docs)
    assert len({d.text for d in docs}) == len(docs)
    assert {d.kind for d in docs} == {"topics", "module", "class", "function", "method", "attribute"}
    assert sum(len(d.text) for d in docs) > 1_000_000


def test_split_disjoint_deterministic_by_id(docs):
    train, heldout = corpus.split(docs)
    assert {d.id for d in train}.isdisjoint(d.id for d in heldout)
    assert len(train) + len(heldout) == len(docs)
    assert corpus.split(docs) == (train, heldout)
    assert 0.03 < len(heldout) / len(docs) < 0.07
    # sha256 of the id, not the salted hash(): these hold in every process and version.
    assert [corpus.is_heldout(i) for i in ("topics/assert", "function/json.dumps")] == [False, False]
    held_id = next(i for i in (f"function/m.f{n}" for n in range(1000)) if corpus.is_heldout(i))
    text = ("Return a copy of the string with its first character capitalized and the rest lowercased. "
            "Characters that have no case are left as they are, and the result is always a new object, "
            "even when nothing had to change, so that callers may rely on identity.")
    near = corpus.Doc(held_id, text.replace("string", "bytes"))
    assert corpus.split([corpus.Doc("function/m.g", text), near]) == ([corpus.Doc("function/m.g", text), near], [])
    other = corpus.Doc(held_id, "Wait until the thread terminates, or until the optional timeout occurs.")
    assert corpus.split([corpus.Doc("function/m.g", text), other])[1] == [other]


def test_heldout_not_near_duplicate_of_train(docs):
    train, heldout = corpus.split(docs)
    seen = set().union(*(corpus._shingles(d.text) for d in train))
    for doc in heldout:
        shingles = corpus._shingles(doc.text)
        assert len(shingles & seen) < corpus.MAX_SHARED_SHINGLES * len(shingles), doc.id


def test_chat_samples_from_given_docs(docs):
    train, _ = corpus.split(docs)
    samples = corpus.chat_samples(train)
    assert samples == corpus.chat_samples(train)
    assert len(samples) > 0.9 * len(train)
    for messages in samples:
        assert [m["role"] for m in messages][-2:] == ["user", "assistant"]
        assert all(m["content"].strip() for m in messages)
        assert len(messages[-1]["content"]) <= corpus.MAX_ANSWER_CHARS + 3
    (sample,) = corpus.chat_samples([corpus.Doc("function/m.f", "m.f()\n\nReturn the thing:\n\n    code")])
    assert sample[-1] == {"role": "assistant", "content": "Return the thing."}
    assert "m.f" in sample[-2]["content"]
    topic = corpus.Doc("topics/x", "The Ellipsis Object\n*******\n\nNew in version 3.5.\n\nIt is a singleton.")
    assert "the ellipsis object" in corpus.chat_samples([topic])[0][-2]["content"]
    assert corpus.chat_samples([topic])[0][-1]["content"] == "It is a singleton."


def test_shipped_heldout_and_calib_match_this_python(docs):
    _same_python()
    train, heldout = corpus.split(docs)
    assert corpus.load_heldout()[1] == heldout

    def render(messages):
        return render_chat_template(CHAT_TEMPLATE, messages, bos_token="", eos_token=EOS, add_generation_prompt=False)

    assert corpus.load_calib() == corpus.calibration_texts(train, render, 64)


def test_calib_form():
    calib = corpus.load_calib()
    assert len(calib) == 64 and all(isinstance(t, str) and 200 <= len(t) <= 800 for t in calib)
    assert not any(t.startswith(BOS) for t in calib)  # the quantizer's encode adds the bos
    assert sum(t.startswith((USER, "You", "Answer")) for t in calib) == 32


# ------------------------------------------------------------------------------------------- tokenizer


def test_special_tokens_single_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    for i, text in enumerate(SPECIAL_TOKENS):
        assert tok.encode(text, add_bos=False) == [i]
    assert tok.vocab_size == 4096
    assert tok.decode([0, 3, 4, 1], skip_special=False) == BOS + USER + ASSISTANT + EOS


def test_round_trip_heldout(tok):
    _, heldout = corpus.load_heldout()
    for doc in heldout:
        ids = tok.encode(doc.text)
        assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
        assert tok.decode(ids) == doc.text, doc.id
    odd = "tabs\t\tand  spaces \n\n end — ünïcode 日本 🐍 \x00"
    assert tok.decode(tok.encode(odd, add_bos=False)) == odd


def test_tokenizer_json_small():
    assert (ASSETS / "tokenizer.json").stat().st_size < 1_000_000


def test_chat_template_matches_transformers(tok, hf_tok):
    for messages in CHATS:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            hf_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
            assert tok.encode_chat(messages, add_generation_prompt=gen) == hf_ids
            assert hf_ids.count(tok.bos_id) == 1 and hf_ids[0] == tok.bos_id
    assert tok.apply_chat_template(CHATS[0]) == f"{BOS}{USER}What does json.dumps do?{ASSISTANT}"


def test_encode_matches_transformers(tok, hf_tok):
    text = corpus.load_calib()[1]
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_bos=False) == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_fixture_tokenizer():
    fixture = Tokenizer.from_dir(str(FIXTURE))
    assert (fixture.bos_id, fixture.eos_id, fixture.pad_id, fixture.vocab_size) == (0, 1, None, 512)
    assert fixture.decode(fixture.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json has no chat_template"):
        fixture.apply_chat_template(CHATS[0])


def test_from_fsspec_url():
    fs = fsspec.filesystem("memory")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        fs.pipe(f"/tok-test/{name}", (ASSETS / name).read_bytes())
    assert Tokenizer.from_dir("memory://tok-test").encode("Hello") == Tokenizer.from_dir(str(ASSETS)).encode("Hello")


# ------------------------------------------------------------------------------------------------ errors


def _copy_assets(tmp_path: Path, config: object | None = None) -> Path:
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "tokenizer.json")
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return tmp_path


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(str(tmp_path))
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json not found"):
        Tokenizer.from_dir(str(tmp_path))


@pytest.mark.parametrize("config, message", [
    ("{not json", r"tokenizer_config\.json: not valid JSON"),
    ([1, 2], r"tokenizer_config\.json: expected a JSON object, got list"),
    ({"eos_token": EOS}, r"tokenizer_config\.json: bos_token is missing"),
    ({"bos_token": "<s>", "eos_token": EOS}, r"tokenizer_config\.json: bos_token '<s>' is not in the"),
    ({"bos_token": 7, "eos_token": EOS}, r"tokenizer_config\.json: bos_token must be a string"),
    ({"bos_token": BOS, "eos_token": EOS, "chat_template": [{"name": "x"}]}, r"chat_template must be a string"),
])
def test_malformed_config(tmp_path, config, message):
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(str(_copy_assets(tmp_path, config)))


def test_malformed_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a tokenizers file"):
        Tokenizer.from_dir(str(tmp_path))


def test_added_token_dict_config(tmp_path):
    config = {"bos_token": {"__type": "AddedToken", "content": BOS}, "eos_token": EOS}
    assert Tokenizer.from_dir(str(_copy_assets(tmp_path, config))).bos_id == 0


def test_bad_messages(tok):
    with pytest.raises(TokenizerError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match="message 0 needs string 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user"}])


# ------------------------------------------------------------------------------------------ regeneration


@pytest.mark.slow
def _corpus_fingerprint(docs) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps([d.id, d.text]).encode())
    return h.hexdigest()


def test_script_reproduces_assets(tmp_path, docs):
    """Retraining gives the committed bytes (same Python only). The corpus embeds the interpreter's path in
    one signature (platform.architecture), so where the venv lives differs from where the assets were made,
    the BPE merge order may differ in ties: then every other file must still be identical, the corpus must
    differ only in documents naming that path, and the tokenizer must keep its size and special ids."""
    _same_python()
    spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "scripts" / "train_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    recorded = json.loads((ASSETS / "corpus_fingerprint.json").read_text())
    same_corpus = _corpus_fingerprint(docs) == recorded["sha256"]
    names = ("tokenizer.json", "tokenizer_config.json", "heldout.json", "calib.json")
    for name in names if same_corpus else names[1:]:
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), name
    if not same_corpus:
        here = [d for d in docs if sys.executable in d.text]
        assert here, "the corpus differs from the recorded one for a reason other than the interpreter path"
        normalised = [corpus.Doc(d.id, d.text.replace(sys.executable, recorded["interpreter"])) for d in docs]
        assert _corpus_fingerprint(normalised) == recorded["sha256"]
        new, old = Tokenizer.from_dir(str(tmp_path)), Tokenizer.from_dir(str(ASSETS))
        assert (new.vocab_size, new.bos_id, new.eos_id, new.pad_id) == (old.vocab_size, old.bos_id, old.eos_id, old.pad_id)


def test_documents_ignore_this_process(docs, monkeypatch):
    """Read in a fresh interpreter: a library patching the stdlib here (as transformers does) changes nothing."""
    import logging

    def warn_twice(self):
        """A method a library added to logging.Logger, long enough to count as a document."""

    monkeypatch.setattr(logging.Logger, "warn_twice", warn_twice, raising=False)
    assert corpus.documents() == docs
