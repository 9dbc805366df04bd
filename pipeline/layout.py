"""HF tensor names and shapes of a DeepSeek-V3 checkpoint, derived from the config alone.

The checkpoint reader checks shapes against this, the planner sizes work with it, the model loads by it.
Shapes are [out, in] for linears. The MTP layer is ``model.layers.{num_hidden_layers}``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from pipeline.config import DeepseekV3Config

GLOBAL_PREFIX = "model."
# Modules only the MTP layer has, relative to its prefix (each holds one ``.weight``).
MTP_ONLY_MODULES = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")


def layer_prefix(layer_id: int) -> str:
    return f"model.layers.{layer_id}."


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple]:
    return {
        f"{prefix}gate_proj.weight": (inter, hidden),
        f"{prefix}up_proj.weight": (inter, hidden),
        f"{prefix}down_proj.weight": (hidden, inter),
    }


def attention_shapes(cfg: DeepseekV3Config, prefix: str) -> dict[str, tuple]:
    h, H = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple] = {}
    if cfg.q_lora_rank:
        out[f"{prefix}q_a_proj.weight"] = (cfg.q_lora_rank, h)
        out[f"{prefix}q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[f"{prefix}q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
    else:
        out[f"{prefix}q_proj.weight"] = (H * cfg.qk_head_dim, h)
    out[f"{prefix}kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
    out[f"{prefix}kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    out[f"{prefix}kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[f"{prefix}o_proj.weight"] = (h, H * cfg.v_head_dim)
    return out


def layer_shapes(cfg: DeepseekV3Config, layer_id: int) -> dict[str, tuple]:
    """Every tensor of decoder layer ``layer_id`` (an MTP layer included) with its shape."""
    p = layer_prefix(layer_id)
    h = cfg.hidden_size
    out: dict[str, tuple] = {
        f"{p}input_layernorm.weight": (h,),
        f"{p}post_attention_layernorm.weight": (h,),
    }
    out.update(attention_shapes(cfg, f"{p}self_attn."))
    if cfg.is_moe_layer(layer_id):
        E = cfg.n_routed_experts
        out[f"{p}mlp.gate.weight"] = (E, h)
        out[f"{p}mlp.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            out.update(_mlp(f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            out.update(_mlp(f"{p}mlp.shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts))
    else:
        out.update(_mlp(f"{p}mlp.", h, cfg.intermediate_size))
    if layer_id >= cfg.num_hidden_layers:  # MTP
        mtp_shapes = {"embed_tokens": (cfg.vocab_size, h), "enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h),
                      "shared_head.norm": (h,), "shared_head.head": (cfg.vocab_size, h)}
        out.update({f"{p}{m}.weight": mtp_shapes[m] for m in MTP_ONLY_MODULES})
    return out


def global_shapes(cfg: DeepseekV3Config) -> dict[str, tuple]:
    out = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def all_layer_ids(cfg: DeepseekV3Config) -> list[int]:
    return list(range(cfg.num_hidden_layers)) + cfg.mtp_layer_ids


def without_mtp(cfg: DeepseekV3Config) -> DeepseekV3Config:
    """``cfg`` with no MTP layer (``num_nextn_predict_layers`` 0): the model a job or a reader runs when the
    MTP layer is not read (msModelSlim's ``--quant_mtp none``)."""
    return dataclasses.replace(cfg, num_nextn_predict_layers=0) if cfg.num_nextn_predict_layers else cfg


def carried_config(cfg: DeepseekV3Config, names: Iterable[str]) -> DeepseekV3Config:
    """The model a checkpoint holding tensors ``names`` carries: ``cfg``, or :func:`without_mtp` when not one
    tensor of an MTP layer is there (an output of msModelSlim's ``--quant_mtp none``, whose config.json
    is the source's). A checkpoint holding some of an MTP layer's tensors keeps ``cfg``: the rest are
    then missing."""
    mtp = set(cfg.mtp_layer_ids)
    if not mtp or any(layer_of(n) in mtp for n in names):
        return cfg
    return without_mtp(cfg)


def checkpoint_shapes(cfg: DeepseekV3Config) -> dict[str, tuple]:
    """Every tensor of the full checkpoint (FP8 scale tensors not included)."""
    out = global_shapes(cfg)
    for i in all_layer_ids(cfg):
        out.update(layer_shapes(cfg, i))
    return out


def layer_of(name: str) -> int | None:
    """The layer index of a tensor name, or None for a global tensor."""
    if name.startswith("model.layers."):
        rest = name[len("model.layers."):]
        idx = rest.split(".", 1)[0]
        if idx.isdigit():
            return int(idx)
    return None


def is_fp8_quantizable(name: str) -> bool:
    """Tensors the DeepSeek release stores as FP8 e4m3 with a ``_scale_inv`` sibling: every
    ``*_proj.weight`` under self_attn and mlp, ``kv_a_proj_with_mqa.weight`` included (not the router,
    norms, eh_proj, embeddings or heads)."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and (".self_attn." in name or ".mlp." in name)


def is_quantizable_linear(module: str) -> bool:
    """Whether ``module`` (no ``.weight``) is a linear this format can quantize: a ``*_proj`` under
    ``self_attn`` or ``mlp`` of a layer (not the router ``mlp.gate``, eh_proj, embeddings or heads)."""
    return is_fp8_quantizable(module + ".weight")
