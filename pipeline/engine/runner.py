"""One engine step of the quantized model over a batch of pieces of different sequences.

The pieces' tokens are laid end to end (one row of N tokens, each with its own position); everything
but attention runs on all of them at once (the int8 linears, norms, MoE). Attention is per sequence over
the paged cache: each layer first writes the pieces' latents (int8 with the layer's fa_k on FA3 layers)
and rotated k_pe into their reserved slots, then decoding pieces (one token) attend in one batched call
and prompt chunks attend causally, both block by block over the cache (pipeline.engine.attention), in the
absorbed form::

    q_abs = q_nope @ W_UK;  o_lat = attention(q_abs, q_pe; cache);  o = o_proj(o_lat @ W_UV^T)

Only the last token of each piece that samples goes through the final norm and lm_head.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipeline.engine.attention import paged_decode_attention, paged_prefill_attention
from pipeline.engine.loader import LoadedModel
from pipeline.engine.paged_cache import PagedLatentCache
from pipeline.engine.scheduler import Piece
from pipeline.quant.quantize_layer import model_dtype


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16, nz: bool = False,
                 device: str = "cpu", cache_dtype: torch.dtype | None = None):
        self.loaded, self.model, self.cfg = loaded, loaded.model, loaded.config
        self.block_size, self.device = block_size, device
        cache_dtype = cache_dtype or model_dtype(self.cfg)  # k_pe (and a non-FA3 latent): the model's dtype
        self.caches = {
            i: PagedLatentCache(num_blocks, block_size, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim,
                                dtype=cache_dtype, fa_k=loaded.fa_k.get(i), nz=nz, device=device)
            for i in range(self.cfg.num_hidden_layers)}

    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.caches.values())

    @torch.no_grad()
    def forward(self, pieces: Sequence[Piece]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [P, V] float32, final normed hidden [P, h]) at the last token of each piece that
        samples, in piece order. The pieces' cache slots must be reserved (the scheduler does)."""
        model, dev = self.model, self.device
        ids = torch.tensor([t for p in pieces for t in p.seq.tokens[p.start:p.start + p.n]], device=dev)
        pos = torch.cat([torch.arange(p.start, p.start + p.n, device=dev) for p in pieces])
        cos, sin = model.rotary.cos_sin(pos[None])
        h = model.embed(ids[None])
        bounds, k = [], 0
        for p in pieces:
            bounds.append((k, k + p.n))
            k += p.n
        decode = [j for j, p in enumerate(pieces) if p.n == 1]
        for i in range(self.cfg.num_hidden_layers):
            layer, cache = model.model.layers[i], self.caches[i]
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q_nope, q_pe = attn.query(x, cos, sin)
            c, k_pe = attn.latent(x, cos, sin)
            for p, (a, b) in zip(pieces, bounds):
                cache.write(p.seq.table, c[0, a:b], k_pe[0, a:b], p.start)
            w_uk, w_uv = attn.absorbed_weights()
            q_abs = torch.einsum("nhd,hdc->nhc", q_nope[0].float(), w_uk.float())
            qp = q_pe[0].float()
            o_lat = torch.empty(q_abs.shape, dtype=torch.float32, device=dev)
            if decode:
                rows = [bounds[j][0] for j in decode]
                o_lat[rows] = paged_decode_attention(
                    q_abs[rows], qp[rows], cache, [pieces[j].seq.table.blocks for j in decode],
                    [pieces[j].start + 1 for j in decode], attn.scale)
            for j, (p, (a, b)) in enumerate(zip(pieces, bounds)):
                if p.n > 1:
                    o_lat[a:b] = paged_prefill_attention(q_abs[a:b], qp[a:b], cache, p.seq.table.blocks,
                                                         p.start, attn.scale)
            o = torch.einsum("nhc,hdc->nhd", o_lat, w_uv.float()).to(h.dtype)
            h = h + attn.o_proj(o.flatten(-2)[None])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = [b - 1 for p, (a, b) in zip(pieces, bounds) if p.samples]
        logits, hidden = model.head(h[:, last], return_hidden=True)
        return logits[0], hidden[0]
