"""Calibration data through fsspec: msModelSlim's ``calib_prompt.json`` form (a JSON list of strings),
JSONL with a text field, or Parquet with a text column. The default is the embedded model's texts.

Every problem is a :class:`CalibDataError` naming the file and the sample (index or line) at fault.
"""

from __future__ import annotations

import io
from typing import Sequence

from pipeline.io import storage
from pipeline.io.json_input import parse_json

FORMATS = (".json", ".jsonl", ".parquet")


class CalibDataError(ValueError):
    """Calibration input that cannot be used; the message names the file and the sample."""


def default_calib_path() -> str:
    from pipeline.assets import EMBEDDED_MODEL_DIR

    return storage.join(EMBEDDED_MODEL_DIR, "calib.json")


def load_texts(path: str | None = None, text_field: str = "text") -> list[str]:
    """The calibration texts of ``path`` (default: the embedded model's), in file order."""
    path = path or default_calib_path()
    suffix = next((s for s in FORMATS if path.lower().endswith(s)), None)
    if suffix is None:
        raise CalibDataError(f"{path}: unknown calibration format; use one of {', '.join(FORMATS)}")
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise CalibDataError(f"{path}: calibration file not found") from None
    except OSError as e:  # a directory, a symlink loop, no permission
        raise CalibDataError(f"{path}: calibration file cannot be read ({e.strerror or e})") from None
    if suffix == ".json":
        texts = _from_json(path, raw, text_field)
    elif suffix == ".jsonl":
        texts = _from_jsonl(path, raw, text_field)
    else:
        texts = _from_parquet(path, raw, text_field)
    if not texts:
        raise CalibDataError(f"{path}: no calibration samples")
    for i, t in enumerate(texts):
        if not t.strip():
            raise CalibDataError(f"{path}: sample {i} is empty")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON "\ud800" escape: a str no tokenizer takes
            raise CalibDataError(f"{path}: sample {i} holds a lone surrogate (U+{ord(t[e.start]):04X}) at "
                                 f"character {e.start}, not valid Unicode text") from None
    return texts


def _text_of(path: str, where: str, item, text_field: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if text_field not in item:
            raise CalibDataError(f"{path}: {where} has no '{text_field}' field (keys: {sorted(item)[:6]})")
        item = item[text_field]
        if isinstance(item, str):
            return item
    raise CalibDataError(f"{path}: {where} is {type(item).__name__}, expected a string")


def _from_json(path: str, raw: bytes, text_field: str) -> list[str]:
    data = parse_json(raw, path, CalibDataError)
    if not isinstance(data, list):
        raise CalibDataError(f"{path}: expected a JSON list of strings, got {type(data).__name__}")
    return [_text_of(path, f"sample {i}", x, text_field) for i, x in enumerate(data)]


def _from_jsonl(path: str, raw: bytes, text_field: str) -> list[str]:
    out = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CalibDataError(f"{path}: line {n} is not UTF-8 text (byte {e.start} of the line)") from None
        if not text.strip():
            continue
        item = parse_json(text, f"{path}: line {n}", CalibDataError)
        out.append(_text_of(path, f"line {n}", item, text_field))
    return out


def _from_parquet(path: str, raw: bytes, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(raw))
    except (pa.ArrowInvalid, OSError) as e:
        raise CalibDataError(f"{path}: not a readable Parquet file ({e})") from None
    if text_field not in table.column_names:
        raise CalibDataError(f"{path}: no '{text_field}' column (columns: {table.column_names})")
    col = table.column(text_field)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise CalibDataError(f"{path}: column '{text_field}' is {col.type}, expected strings")
    values = col.to_pylist()
    for i, v in enumerate(values):
        if v is None:
            raise CalibDataError(f"{path}: sample {i} is null")
    return values


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest vocabulary entry: no token stands for more of a text (a byte-level entry
    spells each byte as one character of at most 2 bytes, so this bounds it from above). 0: unknown."""
    tk = getattr(tokenizer, "_tk", None)
    if tk is None or not hasattr(tk, "get_vocab"):
        return 0
    return max((len(t.encode("utf-8")) for t in tk.get_vocab(with_added_tokens=True)), default=0)


LENGTH_MARGIN = 2   # a text is refused by its length alone only beyond this many times the bound


def tokenize(texts: Sequence[str], tokenizer, max_tokens: int, truncate: bool = False,
             add_bos: bool = True, source: str = "calibration data") -> list[list[int]]:
    """Token ids per sample. A sample longer than ``max_tokens`` is an error naming it, unless
    ``truncate`` (then it is cut to ``max_tokens``). A sample whose length alone shows it is too long
    (more bytes than ``max_tokens`` of the longest token could hold, with a margin) is refused before it
    is tokenized, and with ``truncate`` only its beginning is tokenized: a huge line costs nothing."""
    out = []
    longest = longest_token_bytes(tokenizer)
    cap = LENGTH_MARGIN * longest * max_tokens if longest else 0   # characters that surely hold the limit
    for i, t in enumerate(texts):
        if cap and len(t) > cap:
            if not truncate:
                raise CalibDataError(f"{source}: sample {i} has {len(t)} characters, more than {max_tokens} tokens "
                                     f"can hold (the longest token is {longest} bytes): over the limit of "
                                     f"{max_tokens} tokens (raise the limit or truncate)")
            t = t[:cap]     # still more than max_tokens tokens: the cut below is far from this one
        ids = tokenizer.encode(t, add_bos=add_bos)
        if len(ids) > max_tokens:
            if not truncate:
                raise CalibDataError(f"{source}: sample {i} has {len(ids)} tokens, more than the limit of "
                                     f"{max_tokens} (raise the limit or truncate)")
            ids = ids[:max_tokens]
        out.append(ids)
    return out
