"""Module-name patterns as msModelSlim's recipes write them (``include`` / ``exclude`` lists).

msModelSlim matches a module name against each pattern with shell-style wildcards plus brace expansion
(wcmatch's ``fnmatch`` with its BRACE flag): ``*`` any run of characters (dots included), ``?`` one
character, ``[seq]`` / ``[!seq]`` a character class, ``{a,b}`` alternatives (nestable). Matching is
case-sensitive and covers the whole name.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Iterable, Optional, Sequence

from pipeline.quant.numerics.qparams import QuantError


class PatternError(QuantError):
    """A pattern that cannot be used; the message names it."""


def expand_braces(pattern: str) -> list[str]:
    """``"a.{q,kv}_proj"`` -> ``["a.q_proj", "a.kv_proj"]``; nested braces expand from the inside out.
    A brace without its partner is an error (msModelSlim's matcher would take it literally, which no
    module name can match by accident: better said than silently matching nothing)."""
    return list(_expand(pattern))


@functools.lru_cache(maxsize=1024)
def _expand(pattern: str) -> tuple[str, ...]:
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            if depth == 0:
                raise PatternError(f"pattern {pattern!r}: '}}' without '{{'")
            depth -= 1
            if depth == 0:
                head, body, tail = pattern[:start], pattern[start + 1:i], pattern[i + 1:]
                out: list[str] = []
                for alt in _split_top(body):
                    for mid in _expand(alt):
                        out += [head + mid + rest for rest in _expand(tail)]
                return tuple(out)
    if depth:
        raise PatternError(f"pattern {pattern!r}: '{{' without '}}'")
    return (pattern,)


def _split_top(body: str) -> list[str]:
    """Split a brace body on its top-level commas."""
    parts, depth, cur = [], 0, []
    for ch in body:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Does ``name`` match any of ``patterns``?"""
    return any(fnmatch.fnmatchcase(name, p) for pat in patterns for p in _expand(pat))


def selected(name: str, include: Optional[Sequence[str]], exclude: Optional[Sequence[str]]) -> bool:
    """msModelSlim's rule: included (``include`` empty or None means ``["*"]``) and not excluded."""
    return matches(name, include or ("*",)) and not matches(name, exclude or ())


def check_patterns(patterns, where: str) -> tuple[str, ...]:
    """A recipe's pattern list as a tuple of strings, or PatternError naming ``where``."""
    if patterns is None:
        return ()
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise PatternError(f"{where}: expected a list of patterns, got {type(patterns).__name__}")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise PatternError(f"{where}: every pattern must be a non-empty string, got {p!r}")
        _expand(p)
    return tuple(patterns)
