"""R1's reasoning split from its answer, pure, as vLLM's ``deepseek_r1`` reasoning parser splits it: the
text up to ``</think>`` is ``reasoning_content``, the text after it ``content``; a ``<think>`` the model
writes at the start is dropped (R1's chat template may already have opened it in the prompt, so the
output often starts inside the reasoning); an output without ``</think>`` is all reasoning. The tags are
in neither part. Usage counts every generated token as before.

On for R1-family checkpoints (:func:`parser_for`: a chat template whose generation prompt opens
``<think>``, V3.1's thinking switch excepted) or with ``--reasoning-parser deepseek_r1``; off with ``--reasoning-parser none``.
"""

from __future__ import annotations

from typing import Optional

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "none")


def parser_for(setting: Optional[str], chat_template: Optional[str]) -> Optional[str]:
    """The reasoning parser in use: ``setting`` when given ("none": off), else deepseek_r1 for a chat
    template that writes ``<think>`` itself (R1's opens it after ``<｜Assistant｜>``; V3's only strips
    ``</think>`` from past turns), else None."""
    if setting is not None:
        if setting not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)} or null, got {setting!r}")
        return None if setting == "none" else setting
    if chat_template and START in chat_template.replace(END, "") and "thinking" not in chat_template:
        return "deepseek_r1"       # not V3.1's template, whose `thinking` switch closes </think> itself
    return None


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker`` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Splits a choice's text, as it arrives, into (reasoning, content) deltas; a possible start of a tag
    is held back until the next text tells."""

    def __init__(self):
        self.buf, self.started, self.done = "", False, False

    def add(self, text: str) -> tuple[str, str]:
        if self.done:
            return "", text
        self.buf += text
        if not self.started:            # a <think> the model writes first is dropped
            if START.startswith(self.buf) and len(self.buf) < len(START):
                return "", ""
            if self.buf.startswith(START):
                self.buf = self.buf[len(START):]
            self.started = True
        i = self.buf.find(END)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(END):]
            self.buf, self.done = "", True
            return reasoning, content
        k = held_back(self.buf, END)
        reasoning, self.buf = self.buf[:len(self.buf) - k], self.buf[len(self.buf) - k:]
        return reasoning, ""

    def finish(self) -> str:
        """The reasoning held back at the end."""
        rest, self.buf = self.buf, ""
        return rest


def split(text: str) -> tuple[Optional[str], Optional[str]]:
    """(reasoning_content, content) of a whole output (None for an empty part)."""
    s = ReasoningSplitter()
    r, c = s.add(text)
    r += s.finish()
    return r or None, (c if s.done else "") or None
