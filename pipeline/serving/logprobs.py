"""Logprobs in OpenAI's response shapes, pure: the engine's ``sampling.TokenLogprobs`` (raw logprobs, see
pipeline.engine.core.sampling) become

- for /v1/completions OpenAI's legacy object ``{tokens, token_logprobs, top_logprobs, text_offset}``:
  per token its string, its logprob, a dict of the top-N tokens' strings to their logprobs plus the
  chosen token (so up to N + 1 entries, as OpenAI documents and vLLM does; tokens whose strings are equal
  share one key, a limit of the format), and the character offset of the token in the choice's text;
- for /v1/chat/completions ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}``, the top-N most likely first.

A token's string is its bytes decoded as UTF-8 (a byte-level BPE token holding part of a multi-byte
character shows U+FFFD, as in vLLM), a special token's its text; ``bytes`` are the token's exact bytes
(read through the byte-level alphabet, so the parts of a character add up to it). ``text_offset`` counts
the characters of the decoded text before the token (special tokens add none: the text skips them).
Logprobs are clamped at -9999.0 (JSON has no -inf), as vLLM does. A token the engine sent without
logprobs (a disaggregated decode deployment that does not pass on the prefill's first-token logprobs)
gets vLLM's placeholders: ``null`` for completions, logprob -9999.0 and no alternatives for chat.
"""

from __future__ import annotations

import codecs
from typing import Optional, Sequence

FLOOR = -9999.0


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte as the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()


def clamp(x: float) -> float:
    return x if x >= FLOOR else FLOOR  # NaN compares false: the floor too


class TokenStrings:
    """Per token id (cached): its string, its bytes, the bytes it adds to the decoded text (none for a
    special token), and its vocabulary entry (``raw``, e.g. ``Ġx``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._tk = getattr(tokenizer, "_tk", None)   # the tokenizers.Tokenizer, for the vocabulary entries
        self._cache: dict[int, tuple[str, bytes, bytes]] = {}

    def raw(self, token_id: int) -> str:
        entry = self._tk.id_to_token(token_id) if self._tk is not None else None
        return entry if entry is not None else self.tokenizer.decode([token_id], skip_special=False)

    def get(self, token_id: int) -> tuple[str, bytes, bytes]:
        got = self._cache.get(token_id)
        if got is None:
            full = self.tokenizer.decode([token_id], skip_special=False)
            special = bool(full) and not self.tokenizer.decode([token_id])
            raw = self.raw(token_id)
            if special:
                data = full.encode("utf-8")
            elif raw and all(c in _BYTE_OF for c in raw):
                data = bytes(_BYTE_OF[c] for c in raw)
            else:
                data = full.encode("utf-8")
            got = self._cache[token_id] = (full if special else data.decode("utf-8", errors="replace"), data,
                                           b"" if special else data)
        return got

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self.get(token_id)[1])


class TextOffsets:
    """Character offsets of consecutive tokens in their decoded text: UTF-8 decoded incrementally, so a
    token holding part of a character sits at that character's offset (constant work per token)."""

    def __init__(self, strings: TokenStrings, start: int = 0):
        self.strings, self.chars = strings, start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> int:
        at = self.chars
        self.chars += len(self._utf8.decode(self.strings.get(token_id)[2]))
        return at


class LogprobsBuilder:
    """One choice's logprobs, in its API's shape: :meth:`add` gives the payload of some new tokens (a
    streaming chunk's), :attr:`payload` all of them so far (the non-streaming response's)."""

    def __init__(self, chat: bool, strings: TokenStrings, top_n: int, text_start: int = 0):
        self.chat, self.strings, self.top_n = chat, strings, top_n
        self.offsets = TextOffsets(strings, text_start)
        self.payload = self._empty()

    def _empty(self) -> dict:
        if self.chat:
            return {"content": []}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, token_ids: Sequence[int], entries: Optional[Sequence]) -> dict:
        """``entries``: the TokenLogprobs of ``token_ids`` (None when the engine sent none)."""
        part = self._empty()
        for i, t in enumerate(token_ids):
            e = entries[i] if entries is not None and i < len(entries) else None
            if self.chat:
                part["content"].append(self._chat_entry(t, e))
            else:
                self._completion_entry(part, t, e)
        for k, v in part.items():
            self.payload[k].extend(v)
        return part

    def _chat_entry(self, token_id: int, e) -> dict:
        s = self.strings
        if e is None:
            return {"token": s.text(token_id), "logprob": FLOOR, "bytes": s.bytes(token_id), "top_logprobs": []}
        return {"token": s.text(e.token_id), "logprob": clamp(e.logprob), "bytes": s.bytes(e.token_id),
                "top_logprobs": [{"token": s.text(t), "logprob": clamp(x), "bytes": s.bytes(t)}
                                 for t, x in e.top[:self.top_n]]}

    def _completion_entry(self, part: dict, token_id: int, e) -> None:
        s = self.strings
        part["tokens"].append(s.text(token_id))
        part["text_offset"].append(self.offsets.add(token_id))
        if e is None:
            part["token_logprobs"].append(None)
            part["top_logprobs"].append(None)
            return
        top = {s.text(t): clamp(x) for t, x in e.top[:self.top_n]}
        top.setdefault(s.text(e.token_id), clamp(e.logprob))
        part["token_logprobs"].append(clamp(e.logprob))
        part["top_logprobs"].append(top)
