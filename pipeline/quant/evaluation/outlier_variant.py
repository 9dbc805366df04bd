"""An outlier-bearing variant of a checkpoint with the same float function, bit for bit.

DeepSeek's activations carry a few channels of huge magnitude; small trained models do not. A variant
that has them, and computes exactly what the source computes, is made per layer and per RMSNorm: pick a
few channels j, multiply the norm's weight there by a power of two f_j = 2^e_j, and divide column j of
every linear that reads the norm's output by the same f_j::

    norm                              linears reading it (input columns divided)
    input_layernorm                   self_attn.q_a_proj (or q_proj), self_attn.kv_a_proj_with_mqa
    post_attention_layernorm          mlp.{gate,up}_proj, or in an MoE layer mlp.gate (the router),
                                      mlp.shared_experts.{gate,up}_proj, mlp.experts.*.{gate,up}_proj
    self_attn.q_a_layernorm           self_attn.q_b_proj
    self_attn.kv_a_layernorm          self_attn.kv_b_proj   (the latent the FA3 cache holds)
    MTP: enorm / hnorm                eh_proj columns [0, h) / [h, 2h)
    MTP: shared_head.norm             shared_head.head

The norm's output channel j grows by f_j, the linears' products ``x_j * W[:, j]`` keep their exact value,
and multiplying by a power of two is exact in binary floating point unless it overflows or leaves the
normal range (a subnormal loses bits). So the variant's logits equal the source's bit for bit; the maker
checks every scaled weight is exact in its dtype before anything is written, and the logits afterwards.
``model.norm`` is never touched: its output also feeds the MTP layer's hnorm, which would see it.

A :class:`VariantSpec` says what to change (seed, channels per norm, exponent range, norms, layers); the
picks depend only on (seed, layer, norm), so two specs that differ in other layers pick the same channels
in the layers they share.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from pipeline import layout
from pipeline.config import DeepseekV3Config

# Norm kinds a spec can name, in the order they are applied: kind -> module path relative to the layer.
NORMS = {
    "input": "input_layernorm",
    "post_attention": "post_attention_layernorm",
    "q_a": "self_attn.q_a_layernorm",
    "kv_a": "self_attn.kv_a_layernorm",
    "mtp_enorm": "enorm",
    "mtp_hnorm": "hnorm",
    "mtp_head": "shared_head.norm",
}
MTP_ONLY_NORMS = ("mtp_enorm", "mtp_hnorm", "mtp_head")


class VariantError(ValueError):
    """An option or a tensor that makes a function-preserving variant impossible; names it."""


@dataclass(frozen=True)
class VariantSpec:
    """What the variant changes. ``channels``: per norm kind (keys of :data:`NORMS`), how many channels;
    ``log2_range``: (lo, hi), each picked channel's exponent drawn uniformly from lo..hi; ``layers``:
    the layers to change (None: every layer, MTP included); ``shared_channels``: one draw per norm kind
    used in every layer (the same residual channels carrying outliers throughout, as in DeepSeek) instead
    of one per layer."""

    seed: int = 0
    channels: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(NORMS, 4))
    log2_range: tuple[int, int] = (4, 6)
    layers: Optional[tuple[int, ...]] = None
    shared_channels: bool = False

    def __post_init__(self):
        bad = [k for k in self.channels if k not in NORMS]
        if bad:
            raise VariantError(f"norms: unknown {bad}; choose from {', '.join(NORMS)}")
        for k, n in self.channels.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise VariantError(f"norms: channel count for {k!r} must be an integer >= 0, got {n!r}")
        lo, hi = self.log2_range
        if not (isinstance(lo, int) and isinstance(hi, int)) or not 1 <= lo <= hi <= 30:
            raise VariantError(f"factor-log2: expected integers 1 <= lo <= hi <= 30, got {lo}..{hi}")

    def check_config(self, cfg: DeepseekV3Config) -> None:
        ids = layout.all_layer_ids(cfg)
        bad = [i for i in (self.layers or ()) if i not in ids]
        if bad:
            raise VariantError(f"layers: {bad} not in the model (layers 0..{ids[-1]}, MTP included)")
        for kind, n in self.channels.items():
            width = _norm_width(cfg, kind)
            if width is not None and n > width:
                raise VariantError(f"norms: {n} channels asked of {kind!r}, which has only {width}")

    def to_dict(self) -> dict:
        return {"seed": self.seed, "channels": dict(self.channels), "log2_range": list(self.log2_range),
                "layers": None if self.layers is None else list(self.layers),
                "shared_channels": self.shared_channels}


def _norm_width(cfg: DeepseekV3Config, kind: str) -> Optional[int]:
    if kind == "q_a":
        return cfg.q_lora_rank or None
    if kind == "kv_a":
        return cfg.kv_lora_rank
    return cfg.hidden_size


def readers(cfg: DeepseekV3Config, layer_id: int, kind: str) -> list[tuple[str, int]]:
    """(weight name, first input column) of every linear reading norm ``kind``'s output in layer
    ``layer_id``; column j of the norm is column first + j of the weight. Empty when the layer has no
    such norm."""
    p = layout.layer_prefix(layer_id)
    is_mtp = layer_id >= cfg.num_hidden_layers
    a = p + "self_attn."
    if kind == "input":
        q = [a + "q_a_proj.weight"] if cfg.q_lora_rank else [a + "q_proj.weight"]
        return [(n, 0) for n in q + [a + "kv_a_proj_with_mqa.weight"]]
    if kind == "post_attention":
        if not cfg.is_moe_layer(layer_id):
            return [(p + f"mlp.{m}.weight", 0) for m in ("gate_proj", "up_proj")]
        names = [p + "mlp.gate.weight"]
        if cfg.n_shared_experts:
            names += [p + f"mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj")]
        names += [p + f"mlp.experts.{e}.{m}.weight" for e in range(cfg.n_routed_experts) for m in ("gate_proj", "up_proj")]
        return [(n, 0) for n in names]
    if kind == "q_a":
        return [(a + "q_b_proj.weight", 0)] if cfg.q_lora_rank else []
    if kind == "kv_a":
        return [(a + "kv_b_proj.weight", 0)]
    if not is_mtp:
        return []
    if kind == "mtp_enorm":
        return [(p + "eh_proj.weight", 0)]
    if kind == "mtp_hnorm":
        return [(p + "eh_proj.weight", cfg.hidden_size)]
    if kind == "mtp_head":
        return [(p + "shared_head.head.weight", 0)]
    raise VariantError(f"unknown norm kind {kind!r}")


def _generator(seed: int, layer_id: Optional[int], kind: str) -> torch.Generator:
    key = f"{seed}/{'all' if layer_id is None else layer_id}/{kind}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def pick(spec: VariantSpec, layer_id: int, kind: str, norm_weight: torch.Tensor) -> tuple[list[int], list[int]]:
    """(channels, log2 factors) for norm ``kind`` of ``layer_id``: ``spec.channels[kind]`` distinct
    channels among those whose weight is not zero (a zero weight would carry no outlier), sorted."""
    n = spec.channels.get(kind, 0)
    if n == 0:
        return [], []
    g = _generator(spec.seed, None if spec.shared_channels else layer_id, kind)
    order = torch.randperm(norm_weight.numel(), generator=g)
    lo, hi = spec.log2_range
    exps = torch.randint(lo, hi + 1, (norm_weight.numel(),), generator=g)
    live = [int(c) for c in order if norm_weight[int(c)] != 0][:n]
    if len(live) < n:
        raise VariantError(f"layer {layer_id} {NORMS[kind]}: only {len(live)} channels with a nonzero weight, "
                           f"{n} asked")
    live.sort()
    return live, [int(exps[c]) for c in live]


def _exact_scale(t: torch.Tensor, factor: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """``t * factor`` (factor: powers of two, broadcast), refused unless exactly invertible in t's dtype."""
    out = t * factor.to(t.dtype)
    back = out / factor.to(t.dtype)
    if not torch.isfinite(out).all():
        raise VariantError(f"{name}: {what} overflows {t.dtype} (largest |value| {t.abs().max().item():.4g}); "
                           "use smaller factors (--factor-log2)")
    bad = int((back != t).sum())
    if bad:
        raise VariantError(f"{name}: {what} is not exact in {t.dtype} ({bad} values would lose bits, "
                           f"e.g. {t[back != t].flatten()[0].item():.4g}); use smaller factors (--factor-log2) or "
                           "a wider dtype")
    return out


@dataclass
class Change:
    """One norm's change: its layer, kind, channels, log2 factors and the weights whose columns moved."""

    layer: int
    norm: str
    channels: list[int]
    log2_factors: list[int]
    linears: list[str]

    def to_dict(self) -> dict:
        return {"layer": self.layer, "norm": NORMS[self.norm], "channels": self.channels,
                "log2_factors": self.log2_factors, "linears": self.linears}


def apply_to_layer(cfg: DeepseekV3Config, layer_id: int, tensors: dict[str, torch.Tensor],
                   spec: VariantSpec) -> list[Change]:
    """Change one layer's tensors (HF names, as read) in place; returns what changed. Raises
    VariantError, naming the tensor, before changing anything if a scaled weight would not be exact."""
    if spec.layers is not None and layer_id not in spec.layers:
        return []
    p = layout.layer_prefix(layer_id)
    is_mtp = layer_id >= cfg.num_hidden_layers
    new: dict[str, torch.Tensor] = {}
    changes: list[Change] = []
    for kind in NORMS:
        if kind in MTP_ONLY_NORMS and not is_mtp:
            continue
        lins = readers(cfg, layer_id, kind)
        norm_name = f"{p}{NORMS[kind]}.weight"
        if not lins or norm_name not in tensors:
            continue
        norm_w = new.get(norm_name, tensors[norm_name])
        chans, exps = pick(spec, layer_id, kind, norm_w)
        if not chans:
            continue
        idx = torch.tensor(chans)
        f = torch.tensor([2.0 ** e for e in exps], dtype=torch.float64)
        w = norm_w.clone()
        w[idx] = _exact_scale(norm_w[idx], f, norm_name, f"multiplying channels {chans} by 2^{exps}")
        new[norm_name] = w
        for name, first in lins:
            cur = new.get(name, tensors[name])
            cols = idx + first
            out = cur.clone()
            out[:, cols] = _exact_scale(cur[:, cols], 1.0 / f, name, f"dividing columns {cols.tolist()} by 2^{exps}")
            new[name] = out
        changes.append(Change(layer_id, kind, chans, exps, [n[: -len(".weight")] for n, _ in lins]))
    tensors.update(new)
    return changes


_RANGE = re.compile(r"^\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?$")


def parse_log2_range(text: str) -> tuple[int, int]:
    """'4..6' -> (4, 6); '5' -> (5, 5)."""
    m = _RANGE.match(text)
    if not m:
        raise VariantError(f"factor-log2: expected N or LO..HI such as 4..6, got {text!r}")
    lo = int(m.group(1))
    return lo, int(m.group(2)) if m.group(2) else lo


def parse_norms(text: str, default_channels: int) -> dict[str, int]:
    """'input,kv_a:2' -> {'input': default_channels, 'kv_a': 2}; 'all' -> every kind."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        names = list(NORMS) if name == "all" else [name]
        if name != "all" and name not in NORMS:
            raise VariantError(f"norms: unknown {name!r}; choose from all, {', '.join(NORMS)}")
        try:
            n = int(count) if count else default_channels
        except ValueError:
            raise VariantError(f"norms: {item!r}: the channel count after ':' must be an integer") from None
        out.update(dict.fromkeys(names, n))
    if not out:
        raise VariantError("norms: no norm named")
    return out


def summarize(changes: Sequence[Change]) -> dict:
    """Counts for a one-line report."""
    return {"norms": len(changes), "channels": sum(len(c.channels) for c in changes),
            "linears": sum(len(c.linears) for c in changes)}

