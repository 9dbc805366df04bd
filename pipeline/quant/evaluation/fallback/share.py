"""The share of a model's linear weights kept above int8: the figure the accuracy goals bound.

Counted over the linears of the main layers that this format can quantize (every ``*_proj`` under
``self_attn`` or ``mlp``), ``kv_b_proj`` left out (runtimes keep it float), as the router and the MTP layer
are: weight elements typed FLOAT against all of them. :func:`output_share` reads it from a written output
(its description and safetensors headers only).
"""

from __future__ import annotations

from typing import Mapping

from pipeline import layout
from pipeline.format.description import FLOAT, W8A8, W8A8_DYNAMIC


def counted(module: str, n_layers: int) -> bool:
    """Whether linear ``module`` (no ``.weight``) counts in the share."""
    lid = layout.layer_of(module)
    return (lid is not None and lid < n_layers and layout.is_quantizable_linear(module)
            and not module.endswith(".kv_b_proj"))


def linear_share(types: Mapping[str, str], numel: Mapping[str, int], n_layers: int) -> dict:
    """From module -> type and module -> weight elements (modules the share does not count are skipped):
    elements per type, the elements above int8 and their ``share``."""
    by = {W8A8: 0, W8A8_DYNAMIC: 0, FLOAT: 0}
    for m, n in numel.items():
        if counted(m, n_layers):
            by[types.get(m, FLOAT)] += n
    total = sum(by.values())
    return {"weights": by, "above_int8": by[FLOAT], "share": by[FLOAT] / total if total else 0.0}


def output_share(path: str) -> dict:
    """:func:`linear_share` of the written output ``path``."""
    from pipeline.format.reader import QuantizedSource

    src = QuantizedSource(path)
    mods = {n[: -len(".weight")] for n in src.where if n.endswith(".weight")}
    numel = {}
    for m in mods:
        shape = src.shape(m + ".weight")
        numel[m] = shape[0] * shape[1] if len(shape) == 2 else 0
    types = {m: src.types.get(m + ".weight", FLOAT) for m in mods}
    return linear_share(types, numel, src.config.num_hidden_layers)
