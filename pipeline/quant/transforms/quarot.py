"""QuaRot for DeepSeek-V3, as msModelSlim 26.1.0's ``quarot`` step does it (docs/quarot.md).

Every RMSNorm weight is folded into the linears that read it (the norm becomes all ones), then orthogonal
rotations are folded into the weights, leaving the float model's function unchanged:

    hidden   H (block-diagonal random Hadamard): the residual stream.  Readers ``W @ H``: q_a / q / kv_a,
             MLP and expert gate / up, the router, lm_head, the MTP's embed_tokens / shared_head.head and
             both halves of eh_proj's input; embed_tokens ``E @ H``; writers ``H^T @ W``: o_proj,
             down_proj, eh_proj.  Saved as ``global_rotation`` (optional/quarot.safetensors).
    q_lora   Q (shifted block-Hadamard): q_a_proj's output ``Q^T @ W``, q_b_proj's input ``W @ Q``.
    kv_lora  K (block-diagonal): kv_a_proj_with_mqa's latent rows ``[K, I_rope]^T @ W``, kv_b_proj's
             input ``W @ K``.
    v        V (block-diagonal, per head): kv_b_proj's value rows ``[I_nope, V]^T @ W`` of every head,
             o_proj's input ``W @ blockdiag(V, .., V)``.

(RMSNorm with weight one commutes with an orthogonal rotation, so q_a_layernorm / kv_a_layernorm may sit
between a pair.) The pairwise rotations are not saved. msModelSlim never rotates anything at run time;
neither does a loader of the output.

Arithmetic, as msModelSlim: a fold is ``dtype(float32(W) * float32(g))`` over W's input columns; each
rotation is a float32 product rounded back to W's dtype, in msModelSlim's order (below, ``_RULES``). The
MTP layer's own modules (embed_tokens, enorm, hnorm, eh_proj, shared_head) are float32 in msModelSlim
and come out float32. ``reference=True`` multiplies by the full matrices (msModelSlim's products),
the default block by block (same formula, b / dim of the work).

Streaming: :func:`rotate_layer` takes one layer's tensors (any subset whose norms are included) and
:func:`rotate_globals` the embedding, final norm and head; nothing else is held.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

from pipeline.config import DeepseekV3Config
from pipeline.io.finite import all_finite
from pipeline.layout import layer_prefix
from pipeline.quant.transforms.hadamard import (
    FULL, SEED, Rotation, block_hadamard, check_block_size, identity, shifted_block_hadamard)
from pipeline.quant.numerics.qparams import QuantError

QUAROT_FILE = "optional/quarot.safetensors"
GLOBAL_ROTATION = "global_rotation"


@dataclass(frozen=True)
class QuarotRotations:
    """The rotations of one model (see the module doc); built by :func:`build_rotations`."""

    hidden: Rotation
    q_lora: Optional[Rotation]      # None without q_lora_rank (q_proj reads the stream directly)
    kv_a_out: Rotation              # [K, I_rope] on kv_a_proj_with_mqa's output rows
    kv_lora: Rotation               # K on kv_b_proj's input
    kv_b_out: Rotation              # [I_nope, V] per head on kv_b_proj's output rows
    o_in: Rotation                  # blockdiag(V, .., V) on o_proj's input
    eh_in: Rotation                 # blockdiag(H, H) on eh_proj's input

    def global_rotation(self) -> Tensor:
        """The residual-stream rotation, float32 [hidden, hidden]."""
        return self.hidden.matrix()


def build_rotations(cfg: DeepseekV3Config, block_size: int = 32, *, shrink: bool = False,
                    seed: int = SEED) -> QuarotRotations:
    """The rotations for ``cfg`` with QuaRot's ``block_size`` (-1 or a power of two).

    A block size that does not divide a rotated dimension (hidden_size, q_lora_rank, kv_lora_rank,
    v_head_dim) is a QuantError naming every such dimension; with ``shrink`` those dimensions use the
    largest power of two dividing them and the block size instead (logged; msModelSlim has no such mode)."""
    dims = {"hidden_size": cfg.hidden_size, "kv_lora_rank": cfg.kv_lora_rank, "v_head_dim": cfg.v_head_dim}
    if cfg.q_lora_rank:
        dims["q_lora_rank"] = cfg.q_lora_rank
    check_block_size(block_size)
    if block_size != FULL and not shrink:
        bad = [f"{what} {dim}" for what, dim in dims.items() if dim % block_size]
        if bad:
            raise QuantError(f"quarot block_size {block_size} does not divide {', '.join(bad)} (it must divide "
                             f"every rotated dimension: {', '.join(f'{k} {v}' for k, v in dims.items())})")
    H, C, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    hidden = block_hadamard(cfg.hidden_size, block_size, "hidden_size", shrink, seed)
    kv = block_hadamard(C, block_size, "kv_lora_rank", shrink, seed)
    v = block_hadamard(cfg.v_head_dim, block_size, "v_head_dim", shrink, seed)
    q = (shifted_block_hadamard(cfg.q_lora_rank, block_size, "q_lora_rank", shrink, seed)
         if cfg.q_lora_rank else None)
    return QuarotRotations(
        hidden=hidden, q_lora=q,
        kv_a_out=Rotation(kv.pieces + (identity(r),)),
        kv_lora=kv,
        kv_b_out=Rotation((identity(cfg.qk_nope_head_dim),) + v.pieces, repeat=H),
        o_in=v.tiled(H),
        eh_in=hidden.tiled(2))


# ----- the optional export ---------------------------------------------------------------------------
def optional_tensors(rot: QuarotRotations) -> dict[str, Tensor]:
    """The content of ``optional/quarot.safetensors``: ``{"global_rotation": float32 [hidden, hidden]}``."""
    return {GLOBAL_ROTATION: rot.global_rotation().contiguous()}


def description_entry() -> dict:
    """The description's entry for that file, to merge at the top level of quant_model_description.json."""
    return {"optional": {"quarot": {"rotation_map": {GLOBAL_ROTATION: QUAROT_FILE}}}}


# ----- folding ---------------------------------------------------------------------------------------
_IN, _OUT = "input", "output"
_MLP_IN = r"mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate|up)_proj\.weight"
_MLP_OUT = r"mlp\.(?:experts\.\d+\.|shared_experts\.)?down_proj\.weight"
_NORMS = ("input_layernorm.weight", "self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight",
          "post_attention_layernorm.weight")
_MTP_NORMS = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")

# relative name pattern -> (norm weights folded in, in order; rotations applied, in msModelSlim's order)
_RULES: list[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]] = [
    (r"self_attn\.q_a_proj\.weight", ("input_layernorm.weight",), ((_IN, "hidden"), (_OUT, "q_lora"))),
    (r"self_attn\.q_proj\.weight", ("input_layernorm.weight",), ((_IN, "hidden"),)),
    (r"self_attn\.kv_a_proj_with_mqa\.weight", ("input_layernorm.weight",), ((_IN, "hidden"), (_OUT, "kv_a_out"))),
    (r"self_attn\.q_b_proj\.weight", ("self_attn.q_a_layernorm.weight",), ((_IN, "q_lora"),)),
    (r"self_attn\.kv_b_proj\.weight", ("self_attn.kv_a_layernorm.weight",), ((_OUT, "kv_b_out"), (_IN, "kv_lora"))),
    (r"self_attn\.o_proj\.weight", (), ((_OUT, "hidden"), (_IN, "o_in"))),
    (_MLP_IN, ("post_attention_layernorm.weight",), ((_IN, "hidden"),)),
    (_MLP_OUT, (), ((_OUT, "hidden"),)),
    (r"mlp\.gate\.weight", ("post_attention_layernorm.weight",), ((_IN, "hidden"),)),
]
_MTP_RULES: list[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]] = [
    (r"embed_tokens\.weight", (), ((_IN, "hidden"),)),
    (r"eh_proj\.weight", ("enorm.weight", "hnorm.weight"), ((_OUT, "hidden"), (_IN, "eh_in"))),
    (r"shared_head\.head\.weight", ("shared_head.norm.weight",), ((_IN, "hidden"),)),
]
_UNCHANGED = (r"mlp\.gate\.e_score_correction_bias",)


def _transform(name: str, w: Tensor, norms: list[Tensor], steps, rot: QuarotRotations, dtype: torch.dtype,
               reference: bool) -> Tensor:
    """Fold ``norms`` (concatenated) into ``w``'s input columns, then apply ``steps``, each rounded to ``dtype``."""
    if not w.is_floating_point():
        raise QuantError(f"{name}: quarot needs a float weight, got {w.dtype} (dequantize it first)")
    w = w.to(dtype)
    if norms:
        g = torch.cat([n.to(torch.float32) for n in norms]) if len(norms) > 1 else norms[0].to(torch.float32)
        if g.shape[0] != w.shape[1]:
            raise QuantError(f"{name}: {w.shape[1]} input columns, but the norm weights folded in have {g.shape[0]}")
        w = (w.to(torch.float32) * g).to(dtype)
    for side, which in steps:
        r: Rotation = getattr(rot, which)
        dim = w.shape[1] if side == _IN else w.shape[0]
        if dim != r.dim:
            raise QuantError(f"{name}: shape {list(w.shape)} does not match the {which} rotation of size {r.dim}")
        w = (r.input_side(w, reference) if side == _IN else r.output_side(w, reference)).to(dtype)
    if not all_finite(w):
        raise QuantError(f"{name}: non-finite values after folding the norms and rotations into {dtype}")
    return w


def _apply(tensors: Mapping[str, Tensor], prefix: str, rules, norm_names: tuple[str, ...], unchanged,
           rot: QuarotRotations, reference: bool, dtype_of) -> dict[str, Tensor]:
    rel = {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            raise QuantError(f"{name}: not a tensor of {prefix.rstrip('.') or 'the globals'}")
        rel[name[len(prefix):]] = t
    out: dict[str, Tensor] = {}
    for r, t in rel.items():
        name = prefix + r
        if r in norm_names:
            if t.dim() != 1:
                raise QuantError(f"{name}: an RMSNorm weight must be 1-D, got shape {list(t.shape)}")
            out[name] = torch.ones(t.shape, dtype=dtype_of(r, t))
            continue
        if any(re.fullmatch(p, r) for p in unchanged):
            out[name] = t
            continue
        rule = next(((ns, steps) for p, ns, steps in rules if re.fullmatch(p, r)), None)
        if rule is None:
            raise QuantError(f"{name}: quarot does not know this tensor (no rule to fold or rotate it)")
        ns, steps = rule
        missing = [prefix + n for n in ns if n not in rel]
        if missing:
            raise QuantError(f"{name}: quarot needs {', '.join(missing)} in the same call to fold it")
        out[name] = _transform(name, t, [rel[n] for n in ns], steps, rot, dtype_of(r, t), reference)
    return out


def rotate_layer(tensors: Mapping[str, Tensor], layer_id: int, cfg: DeepseekV3Config, rot: QuarotRotations,
                 *, reference: bool = False) -> dict[str, Tensor]:
    """One layer's float tensors (HF names ``model.layers.{layer_id}.*``: dense MLP or MoE, or the MTP layer
    with its own modules) -> the same names with norms folded (all ones) and rotations folded in.

    Any subset may be given (e.g. a group of experts), provided the norms its linears read are in it.
    Outputs keep each input's dtype, except the MTP layer's own modules: float32, as msModelSlim keeps them.
    The router's e_score_correction_bias passes unchanged; an unknown tensor is a QuantError."""
    mtp = layer_id >= cfg.num_hidden_layers

    def dtype_of(rel: str, t: Tensor) -> torch.dtype:
        own = any(re.fullmatch(p, rel) for p, _, _ in _MTP_RULES) or rel in _MTP_NORMS
        return torch.float32 if mtp and own else t.dtype

    rules = _RULES + (_MTP_RULES if mtp else [])
    norms = _NORMS + (_MTP_NORMS if mtp else ())
    return _apply(tensors, layer_prefix(layer_id), rules, norms, _UNCHANGED, rot, reference, dtype_of)


_GLOBAL_RULES = [
    (r"model\.embed_tokens\.weight", (), ((_IN, "hidden"),)),
    (r"lm_head\.weight", ("model.norm.weight",), ((_IN, "hidden"),)),
]


def rotate_globals(tensors: Mapping[str, Tensor], cfg: DeepseekV3Config, rot: QuarotRotations,
                   *, reference: bool = False) -> dict[str, Tensor]:
    """``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` -> embed_tokens rotated,
    model.norm all ones, lm_head with model.norm folded in and rotated (dtypes kept).

    With tied embeddings and no ``lm_head.weight`` given, the head is built from embed_tokens and returned
    as ``lm_head.weight``: after folding the two differ, so the output must store it."""
    tensors = dict(tensors)
    if "lm_head.weight" not in tensors and cfg.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return _apply(tensors, "", _GLOBAL_RULES, ("model.norm.weight",), (), rot, reference, lambda _, t: t.dtype)
