"""Which linears a recipe quantizes, and how: msModelSlim's ``linear_quant`` entries as rules.

A rule has a type (W8A8: static per-tensor asymmetric int8 activations; W8A8_DYNAMIC: per-token symmetric
int8 activations; both with per-channel symmetric int8 minmax weights) and include / exclude patterns
matched against the whole module name with shell wildcards and ``{a,b}`` (pipeline.quant.recipe.patterns, case-sensitive:
``*self_attn*`` matches ``model.layers.3.self_attn.q_a_proj``, ``*gate`` matches ``mlp.gate`` but not
``gate_proj``). The first rule whose include matches and whose exclude does not decides a linear's type.

The qconfigs this format can hold are exactly the two above; any other (int4 weights, ssz or other
methods, per-group or per-block scopes, mx/fp8 dtypes) is refused with the field that differs, since the
output could not be written in msModelSlim's W8A8 layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

from pipeline.format.description import W8A8, W8A8_DYNAMIC
from pipeline.quant.recipe.patterns import selected
from pipeline.quant.numerics.qparams import QuantError

WEIGHT = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
ACTS = {
    W8A8: {"scope": "per_tensor", "dtype": "int8", "symmetric": False, "method": "minmax"},
    W8A8_DYNAMIC: {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
}
QCONFIG_KEYS = ("scope", "dtype", "symmetric", "method")


@dataclass(frozen=True)
class LinearRule:
    kind: str
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in ACTS:
            raise QuantError(f"linear rule: kind must be one of {sorted(ACTS)}, got {self.kind!r}")
        for f in ("include", "exclude"):
            v = getattr(self, f)
            if isinstance(v, str) or not all(isinstance(p, str) and p for p in v):
                raise QuantError(f"linear rule: {f} must be a list of module-name patterns, got {v!r}")
            object.__setattr__(self, f, tuple(v))

    def matches(self, name: str) -> bool:
        return selected(name, self.include, self.exclude)

    def dynamic(self) -> "LinearRule":
        return LinearRule(W8A8_DYNAMIC, self.include, self.exclude)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "include": list(self.include), "exclude": list(self.exclude)}

    def qconfig(self) -> dict:
        """The rule's msModelSlim qconfig (``act`` / ``weight``)."""
        return {"act": dict(ACTS[self.kind]), "weight": dict(WEIGHT)}


def rule_from_dict(raw: Any, where: str) -> LinearRule:
    if not isinstance(raw, Mapping) or set(raw) - {"kind", "include", "exclude"}:
        raise QuantError(f"{where}: expected {{kind, include, exclude}}, got {raw!r}")
    return LinearRule(raw.get("kind"), tuple(raw.get("include", ("*",))), tuple(raw.get("exclude", ())))


@functools.cache   # asked for every linear a recipe without rules of its own types (immutable: frozen rules)
def default_rules() -> tuple[LinearRule, ...]:
    """msModelSlim's DeepSeek mix: static W8A8 attention except kv_b_proj, dynamic MLP except the router."""
    return (LinearRule(W8A8, ("*self_attn*",), ("*kv_b_proj",)), LinearRule(W8A8_DYNAMIC, ("*mlp*",), ("*gate",)))


def _side(raw: Any, where: str) -> dict:
    if not isinstance(raw, Mapping):
        raise QuantError(f"{where}: expected a mapping with {list(QCONFIG_KEYS)}, got {raw!r}")
    unknown = sorted(set(raw) - set(QCONFIG_KEYS))
    if unknown:
        raise QuantError(f"{where}: unknown key(s) {unknown} (known: {list(QCONFIG_KEYS)})")
    return {k: raw.get(k) for k in QCONFIG_KEYS}


def kind_of_qconfig(qconfig: Any, where: str) -> str:
    """W8A8 or W8A8_DYNAMIC for a ``linear_quant`` qconfig; a clear error for any other."""
    if not isinstance(qconfig, Mapping) or set(qconfig) - {"act", "weight"} or "act" not in qconfig \
            or "weight" not in qconfig:
        raise QuantError(f"{where}: expected a mapping with 'act' and 'weight', got {qconfig!r}")
    weight = _side(qconfig["weight"], f"{where}.weight")
    for k, want in WEIGHT.items():
        if weight[k] != want:
            raise QuantError(f"{where}.weight.{k}: {weight[k]!r} is not supported (this format stores per-channel "
                             f"symmetric int8 minmax weights: {WEIGHT})")
    act = _side(qconfig["act"], f"{where}.act")
    for kind, want in ACTS.items():
        if act == want:
            return kind
    diff = {k: act[k] for k in QCONFIG_KEYS if act[k] not in {a[k] for a in ACTS.values()}}
    raise QuantError(f"{where}.act: {diff or act} is not supported (W8A8: {ACTS[W8A8]}; W8A8_DYNAMIC: "
                     f"{ACTS[W8A8_DYNAMIC]})")
