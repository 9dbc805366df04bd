"""Train the tiny model's byte-level BPE tokenizer and write it, with the shipped evaluation data.

    .venv/bin/python scripts/train_tokenizer.py [--vocab-size 4096] [--out pipeline/assets/dsv3-tiny-pydoc]

Trains on the train split of :mod:`pipeline.text.corpus` (documents + rendered chat samples) and writes to
``--out``: ``tokenizer.json``, ``tokenizer_config.json`` (DeepSeek-V3 special tokens and chat template),
``heldout.json`` (the held-out documents with the Python version that produced them) and ``calib.json``
(calibration texts in msModelSlim's calib_prompt.json form). The same Python writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
from pathlib import Path
from typing import Iterator, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pipeline.text import corpus
from pipeline.text.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, render_chat_template

_SPECIAL_SPLIT = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))


def training_texts(train: Sequence[corpus.Doc]) -> Iterator[str]:
    """Train documents, then each rendered chat cut at its special tokens (those are single ids already,
    and the BPE trainer would otherwise learn merges inside them)."""
    for doc in train:
        yield doc.text
    for messages in corpus.chat_samples(train):
        rendered = render_chat_template(CHAT_TEMPLATE, messages, bos_token=BOS, eos_token=EOS,
                                        add_generation_prompt=False)
        yield from (piece for piece in _SPECIAL_SPLIT.split(rendered) if piece)


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (every byte in the base alphabet: no unknown token) with the special tokens at ids
    0..4 and a post-processor that puts bos in front, as DeepSeek-V3's tokenizer.json does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--model-max-length", type=int, default=4096)
    parser.add_argument("--calib-size", type=int, default=64)
    parser.add_argument("--out", default=corpus.ASSET_DIR)
    args = parser.parse_args(argv)

    docs = corpus.documents()
    train, heldout = corpus.split(docs)
    tokenizer = train_bpe(training_texts(train), args.vocab_size)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(args.model_max_length))
    _write_json(out / "heldout.json", {
        "python_version": platform.python_version(),
        "documents": [{"id": d.id, "text": d.text} for d in heldout],
    })

    def render(messages: list[dict[str, str]]) -> str:  # no bos: the quantizer's encode adds it
        return render_chat_template(CHAT_TEMPLATE, messages, bos_token="", eos_token=EOS, add_generation_prompt=False)

    _write_json(out / "calib.json", corpus.calibration_texts(train, render, args.calib_size))

    chars = sum(len(d.text) for d in heldout)
    tokens = sum(len(tokenizer.encode(d.text, add_special_tokens=False).ids) for d in heldout)
    print(f"python {platform.python_version()}: {len(docs)} documents, {sum(len(d.text) for d in docs)} chars; "
          f"train {len(train)}, heldout {len(heldout)} ({chars} chars)")
    print(f"vocab {tokenizer.get_vocab_size()}; heldout {tokens} tokens, {tokens / chars:.3f} tokens/char; "
          f"wrote {out}")


if __name__ == "__main__":
    main()
