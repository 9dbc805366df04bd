"""One engine step of the quantized model over a batch of pieces of different sequences.

The pieces' tokens are laid end to end (one row of N tokens, each with its own position); everything
but attention runs on all of them at once (the int8 linears, norms, MoE). Attention is per sequence over
the paged cache: each layer first writes the pieces' latents (int8 with the layer's fa_k on FA3 layers)
and rotated k_pe into their reserved slots, then single-token pieces attend in one batched decode call
and longer pieces attend causally, both block by block over the cache (pipeline.engine.attention), in
the absorbed form::

    q_abs = q_nope @ W_UK;  o_lat = attention(q_abs, q_pe; cache);  o = o_proj(o_lat @ W_UV^T)

The MTP layer (speculative decoding) is a decoder layer with its own paged cache, run the same way on
``eh_proj([enorm(embed(next token)), hnorm(main hidden)])`` (:meth:`ModelRunner.mtp_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.engine.attention import paged_decode_attention, paged_prefill_attention
from pipeline.engine.kernels.dispatch import TRITON, backend
from pipeline.engine.loader import LoadedModel
from pipeline.engine.paged_cache import PagedLatentCache
from pipeline.config import model_dtype


@dataclass(frozen=True)
class Span:
    """Tokens ``ids`` of one sequence at positions ``start ..``, written to the cache through ``blocks``."""

    ids: list[int]
    start: int
    blocks: list[int]

    @property
    def n(self) -> int:
        return len(self.ids)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16, nz: bool = False,
                 device: str = "cpu", cache_dtype: torch.dtype | None = None, mtp: bool = False,
                 fa3: bool = True, scratch: bool = False):
        """``scratch``: one more cache block, ``scratch_block`` (= num_blocks), that no scheduler hands out:
        a DP-attention group with no work runs a one-token step there to join the others' collectives."""
        self.loaded, self.model, self.cfg = loaded, loaded.model, loaded.config
        self.scratch_block = num_blocks if scratch else None
        num_blocks += 1 if scratch else 0
        self.block_size, self.device = block_size, device
        cache_dtype = cache_dtype or model_dtype(self.cfg)  # k_pe (and a non-FA3 latent): the model's dtype
        ids = list(range(self.cfg.num_hidden_layers))
        if mtp:
            if not self.model.mtp_layers:
                raise ValueError(f"{loaded.path}: speculative decoding needs the MTP layer, which this model lacks")
            ids.append(self.model.mtp_layers[0].layer_id)
        self.mtp_id = ids[-1] if mtp else None
        self.kernels = backend(device)      # decode attention: the Triton kernel on CUDA, else torch
        self.caches = {
            i: PagedLatentCache(num_blocks, block_size, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim,
                                dtype=cache_dtype, fa_k=loaded.fa_k.get(i) if fa3 else None, nz=nz, device=device)
            for i in ids}

    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.caches.values())

    def _layer(self, layer, cache: PagedLatentCache, h: torch.Tensor, cos, sin, spans: Sequence[Span],
               bounds: list[tuple[int, int]], slots: torch.Tensor) -> torch.Tensor:
        attn, dev = layer.self_attn, self.device
        x = layer.input_layernorm(h)
        q_nope, q_pe = attn.query(x, cos, sin)
        c, k_pe = attn.latent(x, cos, sin)
        cache.write_slots(slots, c[0], k_pe[0])                  # the step's tokens, one write per layer
        w_uk, w_uv = attn.absorbed_weights()
        q_abs = torch.einsum("nhd,hdc->nhc", q_nope[0].float(), w_uk.float())
        qp = q_pe[0].float()
        o_lat = torch.empty(q_abs.shape, dtype=torch.float32, device=dev)
        single = [j for j, sp in enumerate(spans) if sp.n == 1]
        if single:
            rows = [bounds[j][0] for j in single]
            tables, lengths = [spans[j].blocks for j in single], [spans[j].start + 1 for j in single]
            if self.kernels == TRITON:
                from pipeline.engine.kernels.mla_decode import block_table_tensor, paged_mla_decode_cache

                table, lens = block_table_tensor(tables, lengths, self.block_size, dev)
                o_lat[rows] = paged_mla_decode_cache(q_abs[rows], qp[rows], cache, table, lens, attn.scale)
            else:
                o_lat[rows] = paged_decode_attention(q_abs[rows], qp[rows], cache, tables, lengths, attn.scale)
        for sp, (a, b) in zip(spans, bounds):
            if sp.n > 1:
                o_lat[a:b] = paged_prefill_attention(q_abs[a:b], qp[a:b], cache, sp.blocks, sp.start, attn.scale)
        o = torch.einsum("nhc,hdc->nhd", o_lat, w_uv.float()).to(h.dtype)
        h = h + attn.o_proj(o.flatten(-2)[None])
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _positions(self, spans: Sequence[Span]):
        """(cos, sin) of every token, each span's [a, b) in the flat row, and each token's cache slot
        (block * block_size + offset), checked against its span's blocks."""
        dev, bs = self.device, self.block_size
        pos, slots, bounds, k = [], [], [], 0
        for sp in spans:
            if -(-(sp.start + sp.n) // bs) > len(sp.blocks):
                raise ValueError(f"positions {sp.start}..{sp.start + sp.n - 1} need "
                                 f"{-(-(sp.start + sp.n) // bs)} block(s), the span has {len(sp.blocks)}")
            for p in range(sp.start, sp.start + sp.n):
                pos.append(p)
                slots.append(sp.blocks[p // bs] * bs + p % bs)
            bounds.append((k, k + sp.n))
            k += sp.n
        num_blocks = next(iter(self.caches.values())).num_blocks
        if any(not 0 <= s < num_blocks * bs for s in slots):
            raise ValueError(f"a span names a block outside the cache's {num_blocks}")
        pos_t = torch.tensor(pos, device=dev)
        return self.model.rotary.cos_sin(pos_t[None]), bounds, torch.tensor(slots, dtype=torch.long, device=dev)

    @torch.no_grad()
    def forward(self, spans: Sequence[Span], rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over ``spans`` (their cache slots reserved); returns (logits [R, V] float32,
        final normed hidden [N, h] of every token) with logits at the flat token ``rows``."""
        model = self.model
        (cos, sin), bounds, slots = self._positions(spans)
        h = model.embed(torch.tensor([t for sp in spans for t in sp.ids], device=self.device)[None])
        for i in range(self.cfg.num_hidden_layers):
            h = self._layer(model.model.layers[i], self.caches[i], h, cos, sin, spans, bounds, slots)
        hidden = model.model.norm(h)
        return model.lm_head(hidden[:, list(rows)]).float()[0], hidden[0]

    @torch.no_grad()
    def mtp_forward(self, spans: Sequence[Span], hidden: torch.Tensor, hidden_rows: Sequence[int],
                    rows: Sequence[int]) -> torch.Tensor:
        """The MTP layer: ``spans[k].ids`` are the NEXT tokens (t+1) of positions ``start ..`` and
        ``hidden[hidden_rows]`` [N, h] the main model's normed hidden state at those positions (``hidden``:
        what :meth:`forward` returned); returns logits [R, V] float32 (for tokens t+2) at the flat ``rows``."""
        hidden = hidden[list(hidden_rows)]
        layer = self.model.mtp_layers[0]
        (cos, sin), bounds, slots = self._positions(spans)
        nxt = torch.tensor([t for sp in spans for t in sp.ids], device=self.device)[None]
        x = layer.eh_proj(torch.cat([layer.enorm(layer.embed_tokens(nxt)), layer.hnorm(hidden[None])], dim=-1))
        x = self._layer(layer, self.caches[self.mtp_id], x, cos, sin, spans, bounds, slots)
        return layer.shared_head.head(layer.shared_head.norm(x[:, list(rows)])).float()[0]

    def read_blocks(self, blocks: Sequence[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of ``blocks`` of every layer's cache in their stored form: layer id -> (c, pe)."""
        return {i: (c.c[blocks].clone(), c.pe[blocks].clone()) for i, c in self.caches.items()}

    def write_blocks(self, blocks: Sequence[int], data: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store ``data`` (as :meth:`read_blocks` gives it; at least len(blocks) blocks) into ``blocks``."""
        n = len(blocks)
        for i, cache in self.caches.items():
            c, pe = data[i]
            cache.c[blocks] = c[:n].to(cache.c.device)
            cache.pe[blocks] = pe[:n].to(cache.pe.device)
