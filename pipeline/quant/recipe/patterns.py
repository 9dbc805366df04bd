"""Module-name patterns as msModelSlim's recipes write them (``include`` / ``exclude`` lists).

msModelSlim matches a module name against each pattern with shell-style wildcards plus brace expansion
(wcmatch's ``fnmatch`` with its BRACE flag): ``*`` any run of characters (dots included), ``?`` one
character, ``[seq]`` / ``[!seq]`` a character class, ``{a,b}`` alternatives (nestable). Matching is
case-sensitive and covers the whole name.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import Callable, Iterable, Optional, Sequence

from pipeline.quant.numerics.qparams import QuantError


class PatternError(QuantError):
    """A pattern that cannot be used; the message names it."""


MAX_ALTERNATIVES = 4096   # strings one pattern's braces may expand to (16 {a,b} groups would be 65536)
MAX_PATTERN_CHARS = 1024
MAX_BRACE_DEPTH = 16
WILDCARDS = frozenset("*?[")


def expand_braces(pattern: str) -> list[str]:
    """``"a.{q,kv}_proj"`` -> ``["a.q_proj", "a.kv_proj"]``; nested braces expand from the inside out.
    A brace without its partner is an error (msModelSlim's matcher would take it literally, which no
    module name can match by accident: better said than silently matching nothing), and so is a pattern
    longer than MAX_PATTERN_CHARS, nested deeper than MAX_BRACE_DEPTH or expanding to more than
    MAX_ALTERNATIVES strings (counted before anything is expanded)."""
    return list(_checked(pattern))


def _checked(pattern: str) -> tuple[str, ...]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"pattern {pattern[:40]!r}...: {len(pattern)} characters, more than {MAX_PATTERN_CHARS}")
    n = _count(pattern)
    if n > MAX_ALTERNATIVES:
        shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
        raise PatternError(f"pattern {shown!r}: its braces expand to {n} alternatives, more than "
                           f"{MAX_ALTERNATIVES}; use wildcards or fewer {{a,b}} groups")
    return _expand(pattern)


def _first_group(pattern: str) -> Optional[tuple[str, list[str], str]]:
    """(head, top-level alternatives, tail) of the first brace group, None without one; PatternError for
    an unpaired brace or braces nested too deeply."""
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                raise PatternError(f"pattern {pattern[:80]!r}: braces nested deeper than {MAX_BRACE_DEPTH}")
        elif ch == "}":
            if depth == 0:
                raise PatternError(f"pattern {pattern!r}: '}}' without '{{'")
            depth -= 1
            if depth == 0:
                return pattern[:start], _split_top(pattern[start + 1:i]), pattern[i + 1:]
    if depth:
        raise PatternError(f"pattern {pattern!r}: '{{' without '}}'")
    return None


@functools.lru_cache(maxsize=4096)
def _count(pattern: str) -> int:
    group = _first_group(pattern)
    if group is None:
        return 1
    head, alts, tail = group
    return sum(_count(alt) for alt in alts) * _count(tail)


@functools.lru_cache(maxsize=1024)
def _expand(pattern: str) -> tuple[str, ...]:
    group = _first_group(pattern)
    if group is None:
        return (pattern,)
    head, alts, tail = group
    rests = _expand(tail)
    return tuple(head + mid + rest for alt in alts for mid in _expand(alt) for rest in rests)


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


@functools.lru_cache(maxsize=256)
def matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """One test for a whole pattern list, built once per list: names without a wildcard in a set, the
    rest in one compiled regular expression, so a name costs one lookup and one match whatever the
    list's length."""
    literal: set[str] = set()
    regexes: list[str] = []
    for pat in patterns:
        for p in _checked(pat):
            if WILDCARDS.isdisjoint(p):
                literal.add(p)
            else:
                regexes.append(fnmatch.translate(p))
    combined = re.compile("|".join(regexes)).match if regexes else None
    if combined is None:
        return literal.__contains__
    return lambda name: name in literal or combined(name) is not None


_by_identity: dict[int, tuple[tuple[str, ...], Callable[[str], bool]]] = {}


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Does ``name`` match any of ``patterns``? A recipe's tuple is looked up by identity (hashing a tuple
    of tens of thousands of patterns per name would cost what compiling once saves)."""
    if not isinstance(patterns, tuple):
        return matcher(tuple(patterns))(name)
    hit = _by_identity.get(id(patterns))
    if hit is None or hit[0] is not patterns:
        if len(_by_identity) >= 1024:
            _by_identity.clear()
        hit = _by_identity[id(patterns)] = (patterns, matcher(patterns))   # the tuple kept: its id stays its own
    return hit[1](name)


def selected(name: str, include: Optional[Sequence[str]], exclude: Optional[Sequence[str]]) -> bool:
    """msModelSlim's rule: included (``include`` empty or None means ``["*"]``) and not excluded."""
    return matches(name, include or ("*",)) and not matches(name, exclude or ())


def check_patterns(patterns, where: str) -> tuple[str, ...]:
    """A recipe's pattern list as a tuple of strings, or PatternError naming ``where`` (the recipe file and
    field) and the pattern."""
    if patterns is None:
        return ()
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise PatternError(f"{where}: expected a list of patterns, got {type(patterns).__name__}")
    for k, p in enumerate(patterns):
        if not isinstance(p, str) or not p:
            raise PatternError(f"{where}[{k}]: every pattern must be a non-empty string, got {p!r}")
        try:
            _checked(p)
        except PatternError as e:
            raise PatternError(f"{where}[{k}]: {e}") from None
    return tuple(patterns)
