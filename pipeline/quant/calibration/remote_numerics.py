"""One DeepSeek-V3 decoder layer with the arithmetic of DeepSeek's own modeling code, which msModelSlim
calibrates with (docs/recipes.md, "Calibration"): functions over a layer's HF-named tensors, every linear
called through a ``Linears`` object so that a calibration pass can observe or fake-quantize it.

Where the rounding differs from this project's float model (pipeline.model), and why it matters: msModelSlim's
activation parameters are min/max of bf16 activations, and a single rounding moved upstream changes them.

- RMSNorm ``w * md(x / rms(x))`` (two roundings, as pipeline.model); a norm with a ``.bias`` (iter_smooth's
  shift) adds the float32 bias and rounds to md.
- RoPE from md cos / sin tables (YaRN's mscale folded in, the table in float32 first), q_pe / k_pe
  de-interleaved, ``q * cos + rotate_half(q) * sin`` in md.
- Eager attention (the linears' calibration pass): keys and values through kv_b_proj, ``q @ k^T * scale``
  in md, the causal mask added, softmax in float32 then md, ``@ v`` in md.
- Absorbed attention (the FA3 pass): ``q_nope @ W_UK`` in md (what fa_q observes), the latent (what fa_k /
  fa_v observe), ``q_pe @ k_pe^T + q_nope @ c^T`` in md, softmax as above, ``einsum(aw, c) @ W_UV^T``.
- MoE: router logits in float32, sigmoid, the correction bias, the best ``topk_group`` groups (the others
  masked to 0.0, not -inf), top-k, weights normalised and scaled; experts run on their tokens sorted by
  expert; the weighted sum over top-k in float32, rounded once; plus the shared experts in md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.config import DeepseekV3Config

FaHook = Callable[[str, Tensor, float], None]  # (fa module name, tensor [B, rows, S, C], recall ratio)
FA_RATIOS = {"fa_q": 0.9999, "fa_k": 0.9999, "fa_v": 1.0}


class Linears(Protocol):
    def __call__(self, name: str, x: Tensor) -> Tensor:
        """Linear ``name`` (``model.layers.0.self_attn.q_a_proj``, no ``.weight``) applied to ``x``."""


def rms_norm(x: Tensor, weight: Tensor, eps: float, bias: Optional[Tensor] = None) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return y if bias is None else (y + bias).to(x.dtype)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class RopeTables:
    """cos / sin [positions, rope_dim] in float32 (YaRN's mscale folded in), and the softmax scale."""

    cos: Tensor
    sin: Tensor
    softmax_scale: float

    @classmethod
    def of(cls, cfg: DeepseekV3Config, positions: int) -> "RopeTables":
        dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
        rs = cfg.rope_scaling.to_dict() if cfg.rope_scaling is not None else None
        exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        if rs is None:
            inv, ms = 1.0 / (base ** exps), 1.0
        else:
            fac = float(rs["factor"])
            extra, inter = 1.0 / (base ** exps), 1.0 / (fac * base ** exps)
            omax = rs["original_max_position_embeddings"]

            def corr(rot: float) -> float:
                return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

            low = max(math.floor(corr(rs.get("beta_fast", 32))), 0)
            high = min(math.ceil(corr(rs.get("beta_slow", 1))), dim - 1)
            if low == high:
                high += 0.001
            ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
            keep = 1.0 - ramp
            inv = inter * (1 - keep) + extra * keep
            ms = float(_yarn_mscale(fac, rs.get("mscale", 1)) / _yarn_mscale(fac, rs.get("mscale_all_dim", 0)))
            if rs.get("mscale_all_dim", 0):
                m = _yarn_mscale(fac, rs["mscale_all_dim"])
                scale = scale * m * m
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return cls(emb.cos() * ms, emb.sin() * ms, scale)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: Tensor, k: Tensor, rope: RopeTables, pos: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, H, S, d], k [B, 1, S, d] (interleaved pairs, as stored) at positions ``pos`` [B, S]."""
    cos = rope.cos.to(q.dtype)[pos].unsqueeze(1)
    sin = rope.sin.to(q.dtype)[pos].unsqueeze(1)

    def deinterleave(t: Tensor) -> Tensor:
        b, h, s, d = t.shape
        return t.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    q, k = deinterleave(q), deinterleave(k)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def causal_mask(s: int, dtype: torch.dtype) -> Tensor:
    """[1, 1, S, S]: 0 where a query may attend, the dtype's minimum above the diagonal."""
    m = torch.full((s, s), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return m[None, None]


def attention(t: Mapping[str, Tensor], cfg: DeepseekV3Config, p: str, x: Tensor, pos: Tensor, rope: RopeTables,
              lin: Linears, absorbed: bool, mask_dtype: torch.dtype, fa: Optional[FaHook] = None) -> Tensor:
    """The MLA block of prefix ``p`` (``model.layers.N.self_attn.``) on normed ``x`` [B, S, h]."""
    b, s, _ = x.shape
    H, dn, dr, dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        qa = lin(p + "q_a_proj", x)
        q = lin(p + "q_b_proj", rms_norm(qa, t[p + "q_a_layernorm.weight"], 1e-6, t.get(p + "q_a_layernorm.bias")))
    else:
        q = lin(p + "q_proj", x)
    q = q.view(b, s, H, dn + dr).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
    ckv, k_pe = torch.split(lin(p + "kv_a_proj_with_mqa", x), [C, dr], dim=-1)
    k_pe = k_pe.view(b, s, 1, dr).transpose(1, 2)
    c = rms_norm(ckv, t[p + "kv_a_layernorm.weight"], 1e-6, t.get(p + "kv_a_layernorm.bias"))
    mask = causal_mask(s, mask_dtype)
    q_pe, k_pe = apply_rope(q_pe, k_pe, rope, pos)
    if not absorbed:
        kv = lin(p + "kv_b_proj", c).view(b, s, H, dn + dv).transpose(1, 2)
        k_nope, v = torch.split(kv, [dn, dv], dim=-1)
        qs = torch.cat([q_nope, q_pe], dim=-1)
        ks = torch.cat([k_nope, k_pe.expand(b, H, s, dr)], dim=-1)
        aw = torch.matmul(qs, ks.transpose(2, 3)) * rope.softmax_scale + mask
        aw = F.softmax(aw, dim=-1, dtype=torch.float32).to(qs.dtype)
        o = torch.matmul(aw, v)
    else:
        kvb = t[p + "kv_b_proj.weight"].view(H, dn + dv, C)
        w_uk, w_uv = kvb[:, :dn, :], kvb[:, dn:, :]
        q_abs = torch.matmul(q_nope, w_uk)                                     # [B, H, S, C]
        latent = c.unsqueeze(1)                                                # [B, 1, S, C]
        if fa is not None:
            fa(p + "fa_q", q_abs, FA_RATIOS["fa_q"])
            fa(p + "fa_k", latent, FA_RATIOS["fa_k"])
            fa(p + "fa_v", latent, FA_RATIOS["fa_v"])
        aw = torch.matmul(q_pe, k_pe.mT) + torch.matmul(q_abs, latent.mT)
        aw = aw * rope.softmax_scale + mask
        aw = F.softmax(aw, dim=-1, dtype=torch.float32).to(q_pe.dtype)
        o = torch.matmul(torch.einsum("bhql,blc->bhqc", aw, c), w_uv.mT)
    return lin(p + "o_proj", o.transpose(1, 2).reshape(b, s, H * dv))


def mlp(p: str, x: Tensor, lin: Linears) -> Tensor:
    return lin(p + "down_proj", F.silu(lin(p + "gate_proj", x)) * lin(p + "up_proj", x))


def moe(t: Mapping[str, Tensor], cfg: DeepseekV3Config, p: str, x: Tensor, lin: Linears) -> Tensor:
    """The routed experts and the shared experts of prefix ``p`` (``model.layers.N.mlp.``)."""
    b, s, h = x.shape
    flat = x.reshape(-1, h)
    n = flat.shape[0]
    scores = F.linear(flat.float(), t[p + "gate.weight"].float()).sigmoid()
    E, groups, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    choice = scores + t[p + "gate.e_score_correction_bias"].float().unsqueeze(0)
    group_scores = choice.view(n, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand(n, groups, E // groups).reshape(n, -1)
    _, idx = torch.topk(choice.masked_fill(~keep.bool(), 0.0), k=k, dim=-1, sorted=False)
    w = scores.gather(1, idx)
    if k > 1 and cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    order = idx.view(-1).argsort()
    tokens = flat[order // k]
    counts = torch.bincount(idx.view(-1), minlength=E).tolist()
    outs, start = [], 0
    for e, cnt in enumerate(counts):
        if cnt:
            outs.append(mlp(f"{p}experts.{e}.", tokens[start:start + cnt], lin))
            start += cnt
    routed = torch.cat(outs, 0)
    back = torch.empty_like(routed)
    back[order] = routed
    y = back.view(n, k, h).float().mul_(w.unsqueeze(-1)).sum(dim=1).to(back.dtype).view(b, s, h)
    if cfg.n_shared_experts:
        y = y + mlp(p + "shared_experts.", x, lin)
    return y


def decoder_layer(t: Mapping[str, Tensor], cfg: DeepseekV3Config, layer_id: int, x: Tensor, pos: Tensor,
                  rope: RopeTables, lin: Linears, absorbed: bool, mask_dtype: torch.dtype,
                  fa: Optional[FaHook] = None, attention_only: bool = False) -> Optional[Tensor]:
    """Layer ``layer_id`` on its input ``x`` [B, S, h] (None with ``attention_only``: the calibration pass
    whose output nobody reads stops after o_proj)."""
    p = f"model.layers.{layer_id}."
    eps = cfg.rms_norm_eps
    h = x + attention(t, cfg, p + "self_attn.", rms_norm(x, t[p + "input_layernorm.weight"], eps,
                                                          t.get(p + "input_layernorm.bias")),
                      pos, rope, lin, absorbed, mask_dtype, fa)
    if attention_only:
        return None
    y = rms_norm(h, t[p + "post_attention_layernorm.weight"], eps, t.get(p + "post_attention_layernorm.bias"))
    y = moe(t, cfg, p + "mlp.", y, lin) if cfg.is_moe_layer(layer_id) else mlp(p + "mlp.", y, lin)
    return h + y


def mtp_input(t: Mapping[str, Tensor], g: Mapping[str, Tensor], cfg: DeepseekV3Config, layer_id: int,
              pre: Tensor, ids: Tensor, md: torch.dtype) -> tuple[Tensor, Tensor]:
    """(input [1, T, h] in md, positions [1, T]) of the MTP layer ``layer_id`` for one sample, as
    msModelSlim feeds it: ``pre`` the last main layer's output before the final norm; the ids shifted by
    one, the last replaced by the argmax of the main model's last logits; positions 1..T-1, 0; the MTP
    layer's embedding, norms and eh_proj in float32 (msModelSlim builds them so), the result in md."""
    p = f"model.layers.{layer_id}."
    eps = cfg.rms_norm_eps
    logits = F.linear(rms_norm(pre, g["model.norm.weight"], eps), g["lm_head.weight"]).float()
    shifted = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=ids.dtype, device=ids.device)], 1)
    shifted[:, -1] = logits[:, -1, :].argmax(dim=1)
    pos = torch.roll(torch.arange(ids.shape[1], device=ids.device), -1)[None]
    f32 = {n: t[p + n + ".weight"].float() for n in ("embed_tokens", "enorm", "hnorm", "eh_proj")}
    e = rms_norm(f32["embed_tokens"][shifted], f32["enorm"], eps)
    hn = f32["hnorm"] * rms_norm(pre, torch.ones((), dtype=pre.dtype), eps).float()
    return F.linear(torch.cat([e, hn], -1), f32["eh_proj"]).to(md), pos
