"""The DeepSeek-V3/R1 model configuration, read strictly from an HF ``config.json``.

One frozen dataclass. ``from_dict`` raises :class:`ConfigError` naming the field for anything missing,
mistyped or inconsistent; keys this project does not interpret are kept in ``extra`` so that
``to_dict`` round-trips the file (the quantizer copies config.json and adds to it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

# model_type values seen in the field for this architecture: HF's, and what msModelSlim writes for MindIE.
ACCEPTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "deepseekv2", "deepseekv3")
_DTYPES = ("bfloat16", "float16", "float32")
MAX_INT = 2 ** 63 - 1     # an integer field beyond int64 cannot size a tensor (nor be written back as one)


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V3 model; the message names the file and field."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope_scaling`` with type/rope_type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def to_dict(self) -> dict:
        return {"type": "yarn", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[YarnScaling] = None
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    model_type: str = "deepseek_v3"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # FP8 block size of the source checkpoint ([128, 128] for the release); None when not FP8.
    fp8_block_size: Optional[tuple] = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ----- derived shapes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 when rope scaling is YaRN (also in the absorbed form)."""
        scale = self.qk_head_dim ** -0.5
        ys = self.rope_scaling
        if ys is not None and ys.mscale_all_dim:
            m = yarn_mscale(ys.factor, ys.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def mtp_layer_ids(self) -> list[int]:
        """Indices of the MTP layers in the checkpoint (61 for V3): after the main layers."""
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers < first_k_dense_replace are dense; so is any layer off the moe_layer_freq grid.
        The MTP layer (id >= num_hidden_layers) is a MoE layer, as in V3."""
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    # ----- I/O --------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "DeepseekV3Config":
        return _parse(raw, source)

    def to_dict(self) -> dict:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name in ("extra", "fp8_block_size"):
                continue
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, YarnScaling) else v
        if self.rope_scaling is None:
            out.pop("rope_scaling", None)
        return out


def yarn_mscale(factor: float, mscale: float) -> float:
    """0.1 * mscale * ln(factor) + 1 for factor > 1 (1.368888 for V3's factor 40, mscale_all_dim 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# ----- parsing ---------------------------------------------------------------------------------------
_INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
    "topk_group", "first_k_dense_replace", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "max_position_embeddings",
)
_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")


def _need(raw: Mapping[str, Any], key: str, source: str):
    if key not in raw:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    return raw[key]


def _int(raw, key, source, default=None, optional=False):
    v = raw.get(key, default) if (default is not None or optional) else _need(raw, key, source)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{source}: field '{key}' must be an integer, got {v!r}")
    if v < 0:
        raise ConfigError(f"{source}: field '{key}' must be >= 0, got {v}")
    if v > MAX_INT:
        raise ConfigError(f"{source}: field '{key}' is {v}, larger than any size can be (at most {MAX_INT})")
    return v


def _float(raw, key, source, default=None):
    v = raw.get(key, default) if default is not None else _need(raw, key, source)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{source}: field '{key}' must be a finite number, got {v!r}")
    return float(v)


def _parse_rope_scaling(raw: Mapping[str, Any], source: str) -> Optional[YarnScaling]:
    rs = raw.get("rope_scaling")
    if rs is None:
        rp = raw.get("rope_parameters")  # transformers >= 5 spelling
        if isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) not in (None, "default"):
            rs = rp
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (DeepSeek-V3 uses 'yarn')")
    where = f"{source} rope_scaling"
    for f in ("factor", "original_max_position_embeddings"):
        if isinstance(rs.get(f), (int, float)) and not isinstance(rs.get(f), bool) and rs[f] <= 0:
            raise ConfigError(f"{where}: field '{f}' must be > 0, got {rs[f]}")
    return YarnScaling(
        factor=_float(rs, "factor", where),
        original_max_position_embeddings=_int(rs, "original_max_position_embeddings", where),
        beta_fast=_float(rs, "beta_fast", where, 32.0),
        beta_slow=_float(rs, "beta_slow", where, 1.0),
        mscale=_float(rs, "mscale", where, 1.0),
        mscale_all_dim=_float(rs, "mscale_all_dim", where, 0.0),
    )


def _parse(raw: Mapping[str, Any], source: str) -> DeepseekV3Config:
    mt = _need(raw, "model_type", source)
    if mt not in ACCEPTED_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {mt!r} is not a DeepSeek-V3 model (accepted: {ACCEPTED_MODEL_TYPES})")
    kw: dict[str, Any] = {f: _int(raw, f, source) for f in _INT_FIELDS}
    for f in _POSITIVE:
        if kw[f] == 0:
            raise ConfigError(f"{source}: field '{f}' must be > 0")
    kw["q_lora_rank"] = _int(raw, "q_lora_rank", source, optional=True)
    kw["moe_layer_freq"] = _int(raw, "moe_layer_freq", source, default=1)
    kw["num_nextn_predict_layers"] = _int(raw, "num_nextn_predict_layers", source, default=0)
    kw["routed_scaling_factor"] = _float(raw, "routed_scaling_factor", source)
    kw["rms_norm_eps"] = _float(raw, "rms_norm_eps", source)
    rope_theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    kw["rope_theta"] = _float({"rope_theta": rope_theta}, "rope_theta", source) if rope_theta is not None \
        else _float(raw, "rope_theta", source)
    for f in ("rope_theta", "rms_norm_eps"):
        if kw[f] <= 0:
            raise ConfigError(f"{source}: field '{f}' must be > 0, got {kw[f]}")
    kw["norm_topk_prob"] = bool(_need(raw, "norm_topk_prob", source))
    kw["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    kw["rope_scaling"] = _parse_rope_scaling(raw, source)
    kw["model_type"] = mt
    kw["bos_token_id"] = raw.get("bos_token_id")
    kw["eos_token_id"] = raw.get("eos_token_id")
    dtype = raw.get("torch_dtype", raw.get("dtype", "bfloat16"))
    if dtype not in _DTYPES:
        raise ConfigError(f"{source}: torch_dtype {dtype!r} is not one of {_DTYPES}")
    kw["torch_dtype"] = dtype

    # The router this project implements is V3's; anything else would silently compute wrong results.
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{source}: scoring_func {raw['scoring_func']!r} unsupported (DeepSeek-V3 uses 'sigmoid')")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"{source}: topk_method {raw['topk_method']!r} unsupported (DeepSeek-V3 uses 'noaux_tc')")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} unsupported (DeepSeek-V3 uses 'silu')")
    if raw.get("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias=true is not part of DeepSeek-V3")
    if kw["moe_layer_freq"] == 0:
        raise ConfigError(f"{source}: field 'moe_layer_freq' must be > 0")
    if kw["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim must be even (interleaved RoPE), got {kw['qk_rope_head_dim']}")
    if kw["n_routed_experts"]:
        e, g = kw["n_routed_experts"], kw["n_group"]
        if g == 0 or e % g:
            raise ConfigError(f"{source}: n_routed_experts ({e}) must be a multiple of n_group ({g})")
        if not 0 < kw["topk_group"] <= g:
            raise ConfigError(f"{source}: topk_group ({kw['topk_group']}) must be in 1..n_group ({g})")
        if e // g < 2:
            raise ConfigError(f"{source}: noaux_tc group score needs >= 2 experts per group, got {e // g}")
        if not 0 < kw["num_experts_per_tok"] <= kw["topk_group"] * (e // g):
            raise ConfigError(
                f"{source}: num_experts_per_tok ({kw['num_experts_per_tok']}) must be in "
                f"1..topk_group*experts_per_group ({kw['topk_group'] * (e // g)})")
        if kw["moe_intermediate_size"] == 0:
            raise ConfigError(f"{source}: field 'moe_intermediate_size' must be > 0 for a MoE model")
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{source}: quantization_config.fmt {qc.get('fmt')!r} unsupported (only e4m3)")
        bs = qc.get("weight_block_size", [128, 128])
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise ConfigError(f"{source}: quantization_config.weight_block_size must be [rows, cols], got {bs!r}")
        kw["fp8_block_size"] = tuple(bs)
    known = {f.name for f in dataclasses.fields(DeepseekV3Config)}
    kw["extra"] = {k: v for k, v in raw.items() if k not in known}
    return DeepseekV3Config(**kw)


def model_dtype(cfg: DeepseekV3Config) -> torch.dtype:
    """The torch dtype of the model's weights, from ``torch_dtype`` (bfloat16, float16 or float32)."""
    if cfg.torch_dtype not in _DTYPES:
        raise ConfigError(f"config torch_dtype {cfg.torch_dtype!r} is not one of {_DTYPES}")
    return getattr(torch, cfg.torch_dtype)
