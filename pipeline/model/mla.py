"""Multi-head Latent Attention, in the naive form (what transformers runs) and the absorbed form (decode).

Shapes: B batch, S new tokens, T cached + new tokens, H heads, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim,
d_v = v_head_dim, C = kv_lora_rank.

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))      -> [B, S, H, d_n + d_r]
    c, k_pe      = split(kv_a_proj_with_mqa(x), [C, d_r]);  c = kv_a_layernorm(c)       # cached: c, rope(k_pe)
    naive:       k_nope, v = split(kv_b_proj(c).view(B, T, H, d_n + d_v), [d_n, d_v])
                 scores = (q_nope . k_nope + q_pe . k_pe) * softmax_scale
    absorbed:    W_UK, W_UV = kv_b_proj.weight.view(H, d_n + d_v, C) split on dim 1
                 q_abs = q_nope @ W_UK  [B, S, H, C];  scores = (q_abs . c + q_pe . k_pe) * softmax_scale
                 o = (softmax(scores) @ c) @ W_UV^T  [B, S, H, d_v]
    out = o_proj(o.flatten(H, d_v))

softmax_scale includes YaRN's mscale^2 in both forms. Softmax is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import DeepseekV3Config
from pipeline.model.cache import LatentCache
from pipeline.model.norm import RMSNorm
from pipeline.model.rope import apply_rope


def causal_mask(S: int, T: int, start: int, device=None) -> torch.Tensor:
    """[S, T] bool, True where query s (at position start + s) may attend key t (at position t)."""
    q_pos = torch.arange(start, start + S, device=device).unsqueeze(1)
    return torch.arange(T, device=device).unsqueeze(0) <= q_pos


class MLA(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        h, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.d_n, self.d_r, self.d_v, self.C = (
            H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        self.scale = cfg.softmax_scale
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, device, dtype)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, **kw)
        else:
            self.q_proj = nn.Linear(h, H * cfg.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.C + self.d_r, **kw)
        self.kv_a_layernorm = RMSNorm(self.C, cfg.rms_norm_eps, device, dtype)
        self.kv_b_proj = nn.Linear(self.C, H * (self.d_n + self.d_v), **kw)
        self.o_proj = nn.Linear(H * self.d_v, h, **kw)

    # ----- projections ------------------------------------------------------------------------------
    def query(self, x: torch.Tensor, cos, sin, rope=apply_rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, h] -> q_nope [B, S, H, d_n], rotated q_pe [B, S, H, d_r]. ``rope``: apply_rope or a
        function giving its bits (the engine's C one)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.unflatten(-1, (self.H, self.d_n + self.d_r)).split([self.d_n, self.d_r], dim=-1)
        return q_nope, rope(q_pe, cos, sin)

    def latent(self, x: torch.Tensor, cos, sin, rope=apply_rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, h] -> the cache entries: normed latent c [B, S, C], rotated k_pe [B, S, d_r]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.C, self.d_r], dim=-1)
        return self.kv_a_layernorm(c), rope(k_pe, cos, sin)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, d_n, C] and W_UV [H, d_v, C], views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.H, self.d_n + self.d_v, self.C)
        return w[:, :self.d_n], w[:, self.d_n:]

    # ----- attention --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None, absorb: bool = False) -> torch.Tensor:
        """x [B, S, h]; cos/sin [B, S, d_r/2] of the new tokens' positions. With a cache, the new tokens
        are appended and attend to everything cached before them."""
        q_nope, q_pe = self.query(x, cos, sin)
        c, k_pe = self.latent(x, cos, sin)
        start = 0
        if cache is not None:
            c, k_pe, start = cache.append(c, k_pe)
        o = (self._absorbed if absorb else self._naive)(q_nope, q_pe, c, k_pe, start)
        return self.o_proj(o.flatten(-2))

    def _naive(self, q_nope, q_pe, c, k_pe, start: int) -> torch.Tensor:
        B, S, H, _ = q_nope.shape
        T = c.shape[1]
        k_nope, v = self.kv_b_proj(c).unflatten(-1, (H, self.d_n + self.d_v)).split([self.d_n, self.d_v], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)                                   # [B, H, S, d]
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, self.d_r)], dim=-1).transpose(1, 2)
        if start == 0 and S == T:
            o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale)
        else:
            mask = causal_mask(S, T, start, q.device)
            o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2)                                                                # [B, S, H, d_v]

    def _absorbed(self, q_nope, q_pe, c, k_pe, start: int) -> torch.Tensor:
        S, T = q_nope.shape[1], c.shape[1]
        w_uk, w_uv = self.absorbed_weights()
        q_abs = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
        scores = (torch.einsum("bshc,btc->bsht", q_abs, c) + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * self.scale
        scores = scores.float().masked_fill(~causal_mask(S, T, start, c.device)[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(c.dtype)
        o_lat = torch.einsum("bsht,btc->bshc", probs, c)
        return torch.einsum("bshc,hdc->bshd", o_lat, w_uv)
