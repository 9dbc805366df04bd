"""Frozen dataclasses from plain data (parsed JSON/YAML) that refuse what they do not know: a misspelt
key in a recipe, a plan or a serving config is an error naming it, never a silently ignored setting."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def check_keys(raw: Any, cls: type, where: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """``raw`` as a dict, after checking that it is a mapping whose keys are all fields of ``cls``;
    raises ``error`` naming ``where`` and the unknown keys otherwise."""
    if not isinstance(raw, Mapping):
        raise error(f"{where}: expected an object, got {type(raw).__name__}")
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise error(f"{where}: unknown key(s) {unknown} (known: {known})")
    return dict(raw)


def build(cls: type[T], raw: Any, where: str, error: type[Exception] = ValueError) -> T:
    """``cls(**raw)`` after :func:`check_keys`, JSON lists turned into tuples (the dataclasses are frozen);
    a missing or mistyped argument raises ``error`` too."""
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in check_keys(raw, cls, where, error).items()}
    try:
        return cls(**kw)
    except TypeError as e:
        raise error(f"{where}: {e}") from None
