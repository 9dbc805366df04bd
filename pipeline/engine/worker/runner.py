"""One engine step of the quantized model over a batch of pieces of different sequences.

The pieces' tokens are laid end to end (one row of N tokens, each with its own position); everything
but attention runs on all of them at once (the int8 linears, norms, MoE). Attention is per sequence over
the paged cache: each layer first writes the pieces' latents (int8 with the layer's fa_k on FA3 layers)
and rotated k_pe into their reserved slots, then single-token pieces attend in one batched decode call
and longer pieces attend causally, both block by block over the cache (pipeline.engine.attention.paged), in
the absorbed form::

    q_abs = q_nope @ W_UK;  o_lat = attention(q_abs, q_pe; cache);  o = o_proj(o_lat @ W_UV^T)

The MTP layer (speculative decoding) is a decoder layer with its own paged cache, run the same way on
``eh_proj([enorm(embed(next token)), hnorm(main hidden)])`` (:meth:`ModelRunner.mtp_forward`).

A pure decode step (every piece one token, logits at every row) on the CPU's C kernels is replayed instead
(pipeline.engine.worker.decode_graph: the same calls bound once to persistent tensors, the same bits); the eager
code below stays the reference and runs every other step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pipeline.engine.attention.paged import paged_prefill_attention
from pipeline.engine.attention import mha_prefill
from pipeline.engine.attention.mha_prefill import kv_weights, mha_prefill_attention
from pipeline.engine.attention.batched import DecodeBatch, batched_decode_attention
from pipeline.engine.worker import decode_graph
from pipeline.engine.worker.decode_graph import DecodeGraph
from pipeline.engine.layers.regions import Regions
from pipeline.engine.worker.kernels import NATIVE, TRITON, backend
from pipeline.engine.native import cpu_attention, cpu_float
from pipeline.engine.native.cpu_attention import decode_attention as native_decode_attention
from pipeline.engine.worker.loader import LoadedModel
from pipeline.engine.cache.paged_cache import PagedLatentCache
from pipeline.config import model_dtype
from pipeline.model.ffn import MLP

log = logging.getLogger("dsquant.engine")
#: Replayed decode steps kept per runner (one per row count; each holds its step's activations).
MAX_GRAPHS = 64


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one model call reads (ModelRunner._positions builds it once per call)."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor                 # int64 [N]: each token's flat cache slot
    decode: Optional[DecodeBatch]       # the single-token pieces' block table, lengths
    decode_rows: torch.Tensor           # int64 [B]: their rows in the flat token row
    all_decode: bool                    # every token is a decode row (in order): no scatter needed
    multi: list                         # (span, a, b) of each longer piece (prefill chunks, MTP verifies)


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
                 fa3: bool = True, scratch: bool = False, compile: bool = False, mha_prefill: bool = True,
                 decode_graph: bool = True):
        """``scratch``: one more cache block, ``scratch_block`` (= num_blocks), that no scheduler hands out:
        a DP-attention group with no work runs a one-token step there to join the others' collectives.
        ``compile``: the layers' work around attention through torch.compile (pipeline.engine.layers.regions).
        ``mha_prefill``: multi-token pieces attend in the non-absorbed form (pipeline.engine.attention.mha_prefill);
        False: the absorbed form over the latent (the reference). ``decode_graph``: replay pure decode steps
        (pipeline.engine.worker.decode_graph: the same bits; False: every step eager, the reference)."""
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
        self.kernels = backend(device)      # decode attention: Triton on CUDA, the C kernel on a CPU, else torch
        self._w_abs: dict[int, tuple[torch.Tensor, ...]] = {}    # id(attn) -> absorbed weights, kv_weights
        self.regions = Regions(compile, rope=cpu_float.rope if self.kernels == NATIVE else None)
        self.mha_prefill = mha_prefill
        self.decode_graph = decode_graph
        self._graphs: dict[int, DecodeGraph] = {}           # row count -> its replayed decode step
        self._graph_why: Optional[str] = None                # why steps stay eager ("" : they need not)
        self.graph_timer = None                              # a profiler's (region, seconds) callback
        self._graph_switches: Optional[tuple] = None         # decode_graph.switches() the graphs were made under
        self.caches = {
            i: PagedLatentCache(num_blocks, block_size, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim,
                                dtype=cache_dtype, fa_k=loaded.fa_k.get(i) if fa3 else None, nz=nz, device=device)
            for i in ids}

    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.caches.values())

    def _absorbed(self, attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """W_UK [H, d_n, C], W_UV^T [H, C, d_v] and mha_prefill's kv_weights [H, C, d_n + d_v] of ``attn`` as
        contiguous float32, and the C prefill's packed form of the last (None when that call does not run
        here), made once per layer."""
        w = self._w_abs.get(id(attn))
        if w is None:
            w_uk, w_uv = attn.absorbed_weights()
            # torch's prefill ops where the C loops are plain (neither AVX-512 nor AVX2) and the compute is
            # float32; a bf16 model keeps the C call (torch's bf16 ops change tokens between whole and chunked
            # prefill)
            lib = mha_prefill.serving_library() if w_uk.dtype == torch.float32 else mha_prefill.library()
            w_uk, w_uv_t = w_uk.float().contiguous(), w_uv.float().transpose(1, 2).contiguous()
            w_kv = kv_weights(w_uk, w_uv_t)
            native = self.mha_prefill and self.kernels == NATIVE and lib is not None
            w = self._w_abs[id(attn)] = (w_uk, w_uv_t, w_kv, mha_prefill.native_weights(w_kv) if native else None)
        return w

    def _layer(self, layer, cache: PagedLatentCache, h: torch.Tensor, st: "StepInputs") -> torch.Tensor:
        attn, rg = layer.self_attn, self.regions
        w_uk, w_uv_t, w_kv, w_pack = self._absorbed(attn)
        native = self.kernels == NATIVE and cpu_attention.serving_library() is not None   # absorbs itself
        need_abs = not native or bool(st.multi and not self.mha_prefill)
        q_nope, q_abs, qp, c, k_pe = rg.attn_in(layer, h, st.cos, st.sin, w_uk if need_abs else None)
        cache.write_slots(st.slots, c, k_pe)                     # the step's tokens, one write per layer
        if st.decode is not None and st.all_decode:                # every token a decode row, in order
            o = self._decode_out(native, q_nope, q_abs, qp, cache, attn, st, w_uk, w_uv_t)
        else:
            o = torch.empty(*q_nope.shape[:2], w_uv_t.shape[2], dtype=torch.float32, device=self.device)
            if st.decode is not None:
                rows = st.decode_rows
                o[rows] = self._decode_out(native, q_nope[rows], None if q_abs is None else q_abs[rows], qp[rows],
                                           cache, attn, st, w_uk, w_uv_t)
            if w_pack is not None:
                if st.multi:                           # every chunk in one C call, the blocks read there
                    mha_prefill.native_prefill_chunks(q_nope, qp, cache, [(sp.blocks, sp.start, a, b)
                                                                          for sp, a, b in st.multi],
                                                      w_pack, w_uv_t.shape[2], attn.scale, o)
            else:
                for sp, a, b in st.multi:
                    if self.mha_prefill:
                        o[a:b] = mha_prefill_attention(q_nope[a:b], qp[a:b], cache, sp.blocks, sp.start, w_uk,
                                                       w_uv_t, attn.scale, w_kv)
                    else:
                        o[a:b] = self._absorbed_out(paged_prefill_attention(q_abs[a:b], qp[a:b], cache, sp.blocks,
                                                                            sp.start, attn.scale), w_uv_t)
        h, x = rg.attn_out(layer, h, o)
        return (rg.dense_mlp if isinstance(layer.mlp, MLP) else rg.moe_mlp)(layer, h, x)

    @staticmethod
    def _absorbed_out(o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """o_lat [n, H, C] -> o = o_lat @ W_UV^T [n, H, d_v] (float32)."""
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)

    def _decode_out(self, native: bool, q_nope, q_abs, qp, cache: PagedLatentCache, attn, st: "StepInputs",
                    w_uk: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """The decode rows' attention output before o_proj, o [B, H, d_v] float32: the C kernel takes q_nope
        and does the absorption itself; the other backends attend with q_abs, then o_lat @ W_UV^T."""
        if native:
            return native_decode_attention(q_nope, qp, cache, st.decode, attn.scale, w_uk=w_uk, w_uv_t=w_uv_t)
        return self._absorbed_out(self._decode(q_abs, qp, cache, attn, st), w_uv_t)

    def _decode(self, q_abs, qp, cache: PagedLatentCache, attn, st: "StepInputs") -> torch.Tensor:
        if self.kernels == TRITON:
            from pipeline.engine.triton.mla_decode import paged_mla_decode_cache

            return paged_mla_decode_cache(q_abs, qp, cache, st.decode.table.to(torch.int32),
                                          st.decode.lengths.to(torch.int32), attn.scale)
        return batched_decode_attention(q_abs, qp, cache, st.decode, attn.scale)

    def _positions(self, spans: Sequence[Span]) -> "StepInputs":
        """Everything the layers need about the step, built once: (cos, sin) of every token, each token's
        cache slot (block * block_size + offset, checked against its span's blocks), the decode rows'
        block table (:class:`DecodeBatch`) and the longer spans' [a, b) in the flat row."""
        dev, bs = self.device, self.block_size
        pos, slots, k = [], [], 0
        decode_rows, tables, lengths, multi = [], [], [], []
        for sp in spans:
            if -(-(sp.start + sp.n) // bs) > len(sp.blocks):
                raise ValueError(f"positions {sp.start}..{sp.start + sp.n - 1} need "
                                 f"{-(-(sp.start + sp.n) // bs)} block(s), the span has {len(sp.blocks)}")
            for p in range(sp.start, sp.start + sp.n):
                pos.append(p)
                slots.append(sp.blocks[p // bs] * bs + p % bs)
            if sp.n == 1:
                decode_rows.append(k)
                tables.append(sp.blocks)
                lengths.append(sp.start + 1)
            else:
                multi.append((sp, k, k + sp.n))
            k += sp.n
        num_blocks = next(iter(self.caches.values())).num_blocks
        if any(not 0 <= s < num_blocks * bs for s in slots):
            raise ValueError(f"a span names a block outside the cache's {num_blocks}")
        cos, sin = self.model.rotary.cos_sin(torch.tensor(pos, device=dev)[None])
        decode = DecodeBatch.build(tables, lengths, bs, num_blocks, dev) if decode_rows else None
        return StepInputs(cos, sin, torch.tensor(slots, dtype=torch.long, device=dev), decode,
                          torch.tensor(decode_rows, dtype=torch.long, device=dev), not multi, multi)

    @torch.no_grad()
    def forward(self, spans: Sequence[Span], rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over ``spans`` (their cache slots reserved); returns (logits [R, V] float32,
        final normed hidden [N, h] of every token) with logits at the flat token ``rows``."""
        model = self.model
        st = self._positions(spans)
        graph = self._graph(st, rows)
        if graph is not None:
            return graph.run([sp.ids[0] for sp in spans], st.cos, st.sin, st.slots, st.decode, self.graph_timer)
        h = model.embed(torch.tensor([t for sp in spans for t in sp.ids], device=self.device)[None])
        for i in range(self.cfg.num_hidden_layers):
            h = self._layer(model.model.layers[i], self.caches[i], h, st)
        hidden = model.model.norm(h)
        return model.lm_head(hidden[:, list(rows)]).float()[0], hidden[0]

    def _graph(self, st: "StepInputs", rows: Sequence[int]) -> Optional[DecodeGraph]:
        """The replayed step for ``st`` when it is a pure decode step with logits at every row (made on first
        use per row count), else None."""
        if not self.decode_graph or st.decode is None or not st.all_decode:
            return None
        sw = decode_graph.switches()
        if sw != self._graph_switches:         # a kernel switch flipped: what the eager path calls may differ
            self.drop_graphs()
            self._graph_switches = sw
        if sw[0] == "0":
            return None
        n = st.decode.size
        if len(rows) != n or any(r != i for i, r in enumerate(rows)):
            return None
        g = self._graphs.get(n)
        if g is None:
            if self._graph_why is None:
                self._graph_why = decode_graph.ineligible(self) or ""
                if self._graph_why:
                    log.info("decode steps stay eager: %s", self._graph_why)
            if self._graph_why:
                return None
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))     # the oldest made
            g = self._graphs[n] = DecodeGraph(self, n)
            if g.unbound:
                log.info("decode graph (%d rows) calls %s as eager does", n, ", ".join(sorted(set(g.unbound))))
        return g

    def drop_graphs(self) -> None:
        """Forget the replayed decode steps (after changing the model's weights: they point at the packed ones)."""
        self._graphs.clear()
        self._graph_why = None

    @torch.no_grad()
    def mtp_forward(self, spans: Sequence[Span], hidden: torch.Tensor, hidden_rows: Sequence[int],
                    rows: Sequence[int]) -> torch.Tensor:
        """The MTP layer: ``spans[k].ids`` are the NEXT tokens (t+1) of positions ``start ..`` and
        ``hidden[hidden_rows]`` [N, h] the main model's normed hidden state at those positions (``hidden``:
        what :meth:`forward` returned); returns logits [R, V] float32 (for tokens t+2) at the flat ``rows``."""
        hidden = hidden[list(hidden_rows)]
        layer = self.model.mtp_layers[0]
        st = self._positions(spans)
        nxt = torch.tensor([t for sp in spans for t in sp.ids], device=self.device)[None]
        x = layer.eh_proj(torch.cat([layer.enorm(layer.embed_tokens(nxt)), layer.hnorm(hidden[None])], dim=-1))
        x = self._layer(layer, self.caches[self.mtp_id], x, st)
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
