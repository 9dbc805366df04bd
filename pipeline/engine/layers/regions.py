"""A decoder layer's work around attention, as functions of (layer, tensors) that ``torch.compile`` can take
whole (``EngineConfig.compile``; eager, the reference, by default).

Per layer and step::

    attn_in   norm -> q_a -> norm -> q_b -> rope;  kv_a -> norm -> rope;  q_abs = q_nope @ W_UK
    (eager)   the cache write and paged attention (data-dependent block tables: not compiled)
    attn_out  o (o_lat @ W_UV^T for decode rows, the MHA form's for prefill) -> o_proj -> + residual -> norm
    mlp       a dense MLP (+ residual); a MoE layer's routing and experts stay eager (their per-expert
              grouping reads the router's choice on the host, a graph break)

Compiled, each region is a few fused C++ loops instead of tens of small ops: measured on this 2-core
machine (the embedded model, one thread) a dense layer's MLP 285 -> 115 us at 1 token and 450 -> 175 us
at 8. The fused float arithmetic is not bit-identical to eager (reassociation, fused SiLU: max |diff|
~5e-7 on outputs of size ~1), so the tests compare compiled against eager with a stated tolerance, and
every exactness test runs eager. With ``inline_inbuilt_nn_modules`` (torch's default) the layers share
one graph per region, the parameters being inputs; sizes are dynamic (a second graph for one token).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from pipeline.model.rope import apply_rope


def attn_in(layer, h: torch.Tensor, cos, sin, w_uk: torch.Tensor | None, rope=apply_rope):
    """h [1, N, hidden] -> (q_nope [N, H, d_n], q_abs [N, H, C] (None without ``w_uk``: a caller that
    absorbs it itself), q_pe [N, H, d_r] (float32), c [N, C], k_pe [N, d_r]). ``rope``: apply_rope or a
    function with its bits."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    q_nope, q_pe = attn.query(x, cos, sin, rope)
    c, k_pe = attn.latent(x, cos, sin, rope)
    q_nope = q_nope[0].float()
    q_abs = None if w_uk is None else torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
    return q_nope, q_abs, q_pe[0].float().contiguous(), c[0], k_pe[0]


def attn_out(layer, h: torch.Tensor, o: torch.Tensor):
    """o [N, H, d_v] float32 (attention's output, before o_proj) -> (h + o_proj(o), its post-attention norm)."""
    o = o.to(h.dtype)
    h = h + layer.self_attn.o_proj(o.reshape(o.shape[0], -1)[None])
    return h, layer.post_attention_layernorm(h)


def mlp(layer, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return h + layer.mlp(x)


class Regions:
    """The three region functions, eager or compiled (``compile=True``; ``mode`` for torch.compile). ``rope``:
    eager attn_in's rotary embedding (apply_rope by default; the engine passes its C one, the same bits);
    compiled regions keep apply_rope, which torch.compile fuses."""

    def __init__(self, compile: bool = False, mode: str | None = None, rope: Callable | None = None):
        self.compiled = bool(compile)
        wrap: Callable = (lambda f: torch.compile(f, dynamic=True, mode=mode)) if compile else (lambda f: f)
        if compile:
            import torch._dynamo

            # one graph per region serves every layer (parameters as inputs); leave room for the sizes
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.attn_in, self.attn_out, self.dense_mlp = wrap(attn_in), wrap(attn_out), wrap(mlp)
        if rope is not None and not compile:
            self.attn_in = functools.partial(attn_in, rope=rope)
        self.moe_mlp = mlp
