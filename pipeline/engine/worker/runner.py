"""One engine step of the model over a batch of pieces of different sequences: the model runner turns the
scheduler's pieces (plain token ids, positions, block ids) into tensors and runs the model on them.

The pieces' tokens are laid end to end (one row of N tokens, each with its own position); everything
but attention runs on all of them at once (the int8 linears, norms, MoE). Each decoder layer is
pipeline.engine.layers.decoder.forward: its attention backend (pipeline.engine.attention.backends, chosen
from the engine's kernels) writes the pieces' latents (int8 with the layer's fa_k on FA3 layers) and
rotated k_pe into their reserved slots, then attends: single-token pieces in one batched decode call,
longer pieces causally, in the absorbed form for decode::

    q_abs = q_nope @ W_UK;  o_lat = attention(q_abs, q_pe; cache);  o = o_proj(o_lat @ W_UV^T)

The MTP layer (speculative decoding) is a decoder layer with its own paged cache, run the same way on
``eh_proj([enorm(embed(next token)), hnorm(main hidden)])`` (:meth:`ModelRunner.mtp_forward`).

A pure decode step (every piece one token, logits at every row) on the CPU's C kernels is replayed instead
(pipeline.engine.worker.decode_graph: the same layer forward captured once, its calls bound to persistent
tensors, the same bits); the eager run stays the reference and runs every other step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pipeline.config import model_dtype
from pipeline.engine.attention.backends import StepInputs, attention_backend
from pipeline.engine.attention.batched import DecodeBatch
from pipeline.engine.cache.paged_cache import PagedLatentCache
from pipeline.engine.layers import decoder
from pipeline.engine.native import cpu_float, cpu_linear
from pipeline.engine.worker import decode_graph
from pipeline.engine.worker.decode_graph import DecodeGraph
from pipeline.engine.worker.loader import LoadedModel

log = logging.getLogger("dsquant.engine")
#: Replayed decode steps kept per runner (one per row count; each holds its step's activations).
MAX_GRAPHS = 64


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
        ``compile``: the layers' work around attention through torch.compile (pipeline.engine.layers.decoder).
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
                raise ValueError(f"{loaded.path}: MTP speculative decoding (--mtp) needs the MTP layer, which this "
                                 "checkpoint does not carry; run without --mtp")
            ids.append(self.model.mtp_layers[0].layer_id)
        self.mtp_id = ids[-1] if mtp else None
        kernels = loaded.kernels            # chosen when the model was loaded (pipeline.engine.config)
        self.kernels = kernels.backend      # decode attention: Triton on CUDA, the C kernel on a CPU, else torch
        self.attention = attention_backend(kernels, mha_prefill)     # write, decode, prefill
        self.ops = decoder.EagerOps(self.attention, rope=cpu_float.rope if kernels.float_ops else None,
                                    compile=compile)
        self.mha_prefill = mha_prefill
        self.decode_graph = decode_graph
        self._graphs: dict[int, DecodeGraph] = {}           # row count -> its replayed decode step
        self._graph_threads = torch.get_num_threads()        # the int8 linears' ``auto`` choice reads it
        self._graph_why: Optional[str] = None                # why steps stay eager ("" : they need not)
        self.graph_timer = None                              # a profiler's (region, seconds) callback
        self.caches = {
            i: PagedLatentCache(num_blocks, block_size, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim,
                                dtype=cache_dtype, fa_k=loaded.fa_k.get(i) if fa3 else None, nz=nz, device=device)
            for i in ids}

    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.caches.values())

    def _layer(self, layer, cache: PagedLatentCache, h: torch.Tensor, st: StepInputs) -> torch.Tensor:
        return decoder.forward(self.ops, layer, cache, h, st)

    def _positions(self, spans: Sequence[Span]) -> StepInputs:
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
        if self.loaded.kernels.linears or self.loaded.kernels.float_ops:
            cpu_linear.follow_torch()       # the C kernels' threads: torch's (--torch-threads)
        st = self._positions(spans)
        graph = self._graph(st, rows)
        if graph is not None:
            return graph.run([sp.ids[0] for sp in spans], st.cos, st.sin, st.slots, st.decode, self.graph_timer)
        h = model.embed(torch.tensor([t for sp in spans for t in sp.ids], device=self.device)[None])
        for i in range(self.cfg.num_hidden_layers):
            h = self._layer(model.model.layers[i], self.caches[i], h, st)
        hidden = model.model.norm(h)
        return model.lm_head(hidden[:, list(rows)]).float()[0], hidden[0]

    def _graph(self, st: StepInputs, rows: Sequence[int]) -> Optional[DecodeGraph]:
        """The replayed step for ``st`` when it is a pure decode step with logits at every row (made on first
        use per row count), else None."""
        if not self.decode_graph or st.decode is None or not st.all_decode:
            return None
        threads = torch.get_num_threads()
        if threads != self._graph_threads:     # the graphs bound the linears' choice for the old count
            self.drop_graphs()
            self._graph_threads = threads
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
