"""A request's output text, decoded incrementally and cut at its stop strings, decoded once: by the engine
for a request with stop strings (it must see the text to stop it: ``LLMEngine``, the text rides in each
``EngineOutput.text``), by the serving side for the others (``pipeline.serving.endpoints.choices``).

:class:`StopText` decodes a growing list of token ids a window at a time and cuts the text at the first
stop string; :class:`Detokenizer` returns only the text that is stable: a trailing incomplete multi-byte
character, or a tail that may still grow into a stop string, is held back until it is settled."""

from __future__ import annotations

from typing import Iterable, Sequence


def cut_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any (non-empty) stop string, and whether one occurs."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class StopText:
    """The text of a growing list of token ids, decoded incrementally, cut at the first stop string.

    Each :meth:`add` decodes only the tokens since the last settled point (plus the one before, for
    context) and searches for the stop strings only in the new text and the ``longest stop - 1``
    characters before it: the work per call is bounded by the new tokens and the stop strings' length,
    never by the output so far. A decode ending in a replacement character (an incomplete multi-byte
    character) is not settled: those tokens are decoded again with the next ones. :attr:`text` is the
    settled text (cut before a stop string once :attr:`stopped`); :meth:`finish` settles the rest."""

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self._prefix = 0        # ids[_prefix:_read] were decoded already: the context of the next decode
        self._read = 0          # ids[_read:] are not settled yet
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new token ids; returns the text settled by them (cut before a stop string)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        return self._settle(final=False)

    def finish(self) -> str:
        """Settle whatever is pending (a trailing incomplete character included)."""
        return "" if self.stopped else self._settle(final=True)

    def _settle(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = decode(self.ids[self._prefix:])
        if len(self.ids) == self._read or (not final and window.endswith("\ufffd")):
            return ""  # nothing new, or an incomplete character: wait for more tokens
        new = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._append(new)

    def _append(self, new: str) -> str:
        if self.stop:
            start = max(0, len(self.text) - self._longest + 1)
            tail = self.text[start:] + new
            cut_tail, self.stopped = cut_at_stop(tail, self.stop)
            if self.stopped:
                new = cut_tail[len(self.text) - start:] if len(cut_tail) >= len(self.text) - start else ""
                self.text = self.text[:start] + cut_tail
                return new
        self.text += new
        return new

    def held_back(self) -> int:
        """How many characters at the end of :attr:`text` could still begin a stop string."""
        if self.stopped or not self.stop:
            return 0
        tail = self.text[-(self._longest - 1):] if self._longest > 1 else ""
        for k in range(len(tail), 0, -1):
            end = tail[len(tail) - k:]
            if any(s.startswith(end) for s in self.stop if len(s) > k):
                return k
        return 0


class Detokenizer:
    """Text of a growing list of token ids, sent only once stable: :class:`StopText` decodes it
    incrementally and cuts it at the first stop string; what :meth:`add` returns also holds back a
    trailing incomplete multi-byte character and any tail that could still grow into a stop string.
    :meth:`finish` returns whatever was held back. The concatenation of all returned pieces equals
    :attr:`text`, the full output cut at its first stop string (what ``LLMEngine.text`` returns). The
    work per call is bounded by the new tokens and the stop strings' length, not by the output so far."""

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self._text = StopText(tokenizer, stop)
        self.sent = 0           # characters of the text returned so far

    @property
    def ids(self) -> list[int]:
        return self._text.ids

    @property
    def stopped(self) -> bool:
        return self._text.stopped

    @property
    def text(self) -> str:
        self._text.finish()
        return self._text.text

    def add(self, token_ids: Iterable[int]) -> str:
        self._text.add(list(token_ids))
        return self._emit(len(self._text.text) - self._text.held_back())

    def finish(self) -> str:
        self._text.finish()
        return self._emit(len(self._text.text))

    def _emit(self, upto: int) -> str:
        new = self._text.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return new
