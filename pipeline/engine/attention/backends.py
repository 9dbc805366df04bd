"""The attention backends: how a decoder layer's step writes its tokens' latents into the paged cache and
attends over it, behind one small protocol (:class:`AttentionBackend`), chosen once per engine from its
kernels (:func:`attention_backend`):

- :class:`TorchAttention`, the reference: the cache write in torch (PagedLatentCache.write_slots), decode rows
  in one batched call over the step's block table (pipeline.engine.attention.batched) in the absorbed form,
  prefill chunks in the MHA form (pipeline.engine.attention.mha_prefill; ``mha_prefill=False``: the absorbed
  form, pipeline.engine.attention.paged);
- :class:`NativeAttention` (a CPU with the C kernels): the write, the decode rows (absorbing q itself) and
  all of a layer's prefill chunks each in one C call (pipeline.engine.native.cpu_attention, mha_prefill),
  each where its library runs here, else torch's;
- :class:`TritonAttention` (CUDA): decode rows through the Triton kernel (pipeline.engine.triton.mla_decode).

A step's tokens lie end to end in one row; :meth:`TorchAttention.attend` gives each kind of piece its call:
single-token pieces (decode rows) together, longer pieces (prefill chunks, MTP verifies) chunk by chunk or
together, and assembles o [N, H, d_v] float32 (before o_proj). Where a decode step's attention runs: the
``decode`` of the engine's backend (replayed decode steps bind the C decode call once: worker.decode_graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from pipeline.engine.attention import mha_prefill as mha
from pipeline.engine.attention.batched import DecodeBatch, batched_decode_attention
from pipeline.engine.attention.mha_prefill import kv_weights, mha_prefill_attention
from pipeline.engine.attention.paged import paged_prefill_attention
from pipeline.engine.cache.paged_cache import PagedLatentCache
from pipeline.engine.config import NATIVE, TRITON, Kernels
from pipeline.engine.native import cpu_attention, hugepages
from pipeline.engine.native.bf16_pack import bf16_representable
from pipeline.engine.native.cpu_float import NativeLinear


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one model call reads (the runner builds it once per call)."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor                 # int64 [N]: each token's flat cache slot
    decode: Optional[DecodeBatch]       # the single-token pieces' block table, lengths
    decode_rows: torch.Tensor           # int64 [B]: their rows in the flat token row
    all_decode: bool                    # every token is a decode row (in order): no scatter needed
    multi: list                         # (span, a, b) of each longer piece (prefill chunks, MTP verifies)


@dataclass(frozen=True)
class LayerWeights:
    """A layer's absorbed weights, contiguous: W_UK [H, d_n, C], W_UV^T [H, C, d_v], the MHA prefill's
    kv_weights [H, C, d_n + d_v], and the C prefill's packed form of the last (None where that call does not
    run). float32, except where the C kernels do both the decode and the prefill (NativeAttention): then the
    first two are in the checkpoint's dtype (bf16 where they hold bf16 values), kv_weights is None, and the
    packed form is kv_b_proj's own bits where the C float linear holds them."""

    w_uk: torch.Tensor
    w_uv_t: torch.Tensor
    w_kv: Optional[torch.Tensor]
    w_pack: Optional[torch.Tensor] = None


class AttentionBackend(Protocol):
    name: str

    def weights(self, attn) -> LayerWeights: ...
    def write(self, cache: PagedLatentCache, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None: ...
    def decode(self, q_nope, q_abs, q_pe, cache: PagedLatentCache, batch: DecodeBatch, w: LayerWeights,
               scale: float) -> torch.Tensor: ...
    def prefill(self, q_nope, q_abs, q_pe, cache: PagedLatentCache, chunks: list, w: LayerWeights, scale: float,
                out: torch.Tensor) -> None: ...
    def attend(self, attn, cache: PagedLatentCache, step: StepInputs, q_nope: torch.Tensor,
               q_pe: torch.Tensor) -> torch.Tensor: ...


def absorbed_out(o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
    """o_lat [n, H, C] -> o = o_lat @ W_UV^T [n, H, d_v] (float32)."""
    return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)


class TorchAttention:
    """The reference (module docstring). ``mha_prefill``: prefill chunks in the MHA form (False: absorbed)."""

    name = "torch"
    absorbs = False         # decode reads q_abs = q_nope @ W_UK (a backend that absorbs takes q_nope)

    def __init__(self, mha_prefill: bool = True):
        self.mha_prefill = mha_prefill
        self._weights: dict[int, LayerWeights] = {}     # id(attn) -> its weights, made on first use

    def weights(self, attn) -> LayerWeights:
        w = self._weights.get(id(attn))
        if w is None:
            w = self._weights[id(attn)] = self._layer_weights(attn)
        return w

    def _layer_weights(self, attn) -> LayerWeights:
        return self._make_weights(*attn.absorbed_weights())

    def _make_weights(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> LayerWeights:
        w_uk, w_uv_t = w_uk.float().contiguous(), w_uv.float().transpose(1, 2).contiguous()
        return LayerWeights(w_uk, w_uv_t, kv_weights(w_uk, w_uv_t))

    def needs_q_abs(self, step: StepInputs) -> bool:
        return not self.absorbs or bool(step.multi and not self.mha_prefill)

    def write(self, cache, slots, c, k_pe) -> None:
        cache.write_slots(slots, c, k_pe)           # the step's tokens, one write per layer

    def decode(self, q_nope, q_abs, q_pe, cache, batch, w, scale) -> torch.Tensor:
        return absorbed_out(batched_decode_attention(q_abs, q_pe, cache, batch, scale), w.w_uv_t)

    def prefill(self, q_nope, q_abs, q_pe, cache, chunks, w, scale, out) -> None:
        for sp, a, b in chunks:
            if self.mha_prefill:
                out[a:b] = mha_prefill_attention(q_nope[a:b], q_pe[a:b], cache, sp.blocks, sp.start, w.w_uk,
                                                 w.w_uv_t, scale, w.w_kv)
            else:
                out[a:b] = absorbed_out(paged_prefill_attention(q_abs[a:b], q_pe[a:b], cache, sp.blocks, sp.start,
                                                                scale), w.w_uv_t)

    def attend(self, attn, cache, step, q_nope, q_pe) -> torch.Tensor:
        """q_nope [1, N, H, d_n], rotated q_pe [1, N, H, d_r] of the step's tokens -> o [N, H, d_v] float32:
        the decode rows in one ``decode``, the longer pieces in ``prefill``."""
        w = self.weights(attn)
        q_nope = q_nope[0].float()
        q_abs = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1).contiguous() \
            if self.needs_q_abs(step) else None
        qp = q_pe[0].float().contiguous()
        if step.decode is not None and step.all_decode:            # every token a decode row, in order
            return self.decode(q_nope, q_abs, qp, cache, step.decode, w, attn.scale)
        o = torch.empty(*q_nope.shape[:2], w.w_uv_t.shape[2], dtype=torch.float32, device=q_nope.device)
        if step.decode is not None:
            rows = step.decode_rows
            o[rows] = self.decode(q_nope[rows], None if q_abs is None else q_abs[rows], qp[rows], cache,
                                  step.decode, w, attn.scale)
        if step.multi:
            self.prefill(q_nope, q_abs, qp, cache, step.multi, w, attn.scale, o)
        return o


class NativeAttention(TorchAttention):
    """The CPU's C kernels (module docstring): ``decode_c`` the decode rows in C (it absorbs q itself),
    ``write_c`` the cache write in C; the prefill chunks in C where the MHA prefill library serves this
    layer's weights (float32: its vector loops; bf16: any build, torch's bf16 ops changing tokens between
    whole and chunked prefill)."""

    name = NATIVE

    def __init__(self, mha_prefill: bool = True, decode_c: bool = True, write_c: bool = True):
        super().__init__(mha_prefill)
        self.absorbs, self.write_c = decode_c, write_c
        # the MHA prefill's library (its vector loops built, for float32; any build, for bf16): chosen now
        self._prefill_libs = (mha.serving_library(), mha.library()) if mha_prefill else (None, None)

    def _layer_weights(self, attn) -> LayerWeights:
        kv_b = getattr(attn, "kv_b_proj", None)       # its bf16 bits, where the C float linear holds them
        return self._make_weights(*attn.absorbed_weights(), kv_b.packed() if isinstance(kv_b, NativeLinear) else None)

    def _make_weights(self, w_uk, w_uv, bits: Optional[torch.Tensor] = None) -> LayerWeights:
        """``bits``: kv_b_proj's packed bf16 bits (cpu_float.NativeLinear), which are the MHA prefill's packed
        form (mha.native_weights packs the same [H * (d_n + d_v), C] matrix), taken instead of a second copy."""
        lib = self._prefill_libs[0] if w_uk.dtype == torch.float32 else self._prefill_libs[1]
        w = super()._make_weights(w_uk, w_uv)
        if not (self.mha_prefill and lib is not None):
            return w
        w_pack = bits if bits is not None else mha.native_weights(w.w_kv)
        if w_pack is None or not self.absorbs or w_uk.dtype not in (torch.float32, torch.bfloat16):
            return LayerWeights(w.w_uk, w.w_uv_t, w.w_kv, w_pack)
        # C decode and C prefill: the decode reads the absorbed weights as the checkpoint stores them, bf16
        # (float32 weights of bf16 values narrowed exactly: the kernel widens each value back and runs the
        # same FMA chains, so the same bits as from float32 copies, half the bytes a step reads), the
        # prefill its packed form; no float32 copy is kept
        if w_uk.dtype == torch.float32 and bf16_representable(w_uk) and bf16_representable(w_uv):
            w_uk, w_uv = w_uk.bfloat16(), w_uv.bfloat16()
        return LayerWeights(hugepages.copy(w_uk), hugepages.copy(w_uv.transpose(1, 2)), None, w_pack)

    def write(self, cache, slots, c, k_pe) -> None:
        if not (self.write_c and cpu_attention.write_slots(cache, slots, c, k_pe)):
            super().write(cache, slots, c, k_pe)

    def decode(self, q_nope, q_abs, q_pe, cache, batch, w, scale) -> torch.Tensor:
        if self.absorbs:
            return cpu_attention.decode_attention(q_nope, q_pe, cache, batch, scale, w_uk=w.w_uk, w_uv_t=w.w_uv_t)
        return super().decode(q_nope, q_abs, q_pe, cache, batch, w, scale)

    def prefill(self, q_nope, q_abs, q_pe, cache, chunks, w, scale, out) -> None:
        if w.w_pack is None:
            return super().prefill(q_nope, q_abs, q_pe, cache, chunks, w, scale, out)
        # every chunk in one C call, the blocks read there
        mha.native_prefill_chunks(q_nope, q_pe, cache, [(sp.blocks, sp.start, a, b) for sp, a, b in chunks],
                                          w.w_pack, w.w_uv_t.shape[2], scale, out)


class TritonAttention(TorchAttention):
    """Decode rows through the Triton kernel (CUDA, or its interpreter on a CPU)."""

    name = TRITON

    def decode(self, q_nope, q_abs, q_pe, cache, batch, w, scale) -> torch.Tensor:
        from pipeline.engine.triton.mla_decode import paged_mla_decode_cache

        return absorbed_out(paged_mla_decode_cache(q_abs, q_pe, cache, batch.table.to(torch.int32),
                                                   batch.lengths.to(torch.int32), scale), w.w_uv_t)


def attention_backend(kernels: Kernels, mha_prefill: bool = True) -> TorchAttention:
    """The backend of an engine running ``kernels`` (pipeline.engine.config)."""
    if kernels.backend == NATIVE:
        return NativeAttention(mha_prefill, decode_c=kernels.attention, write_c=kernels.cache_write)
    if kernels.backend == TRITON:
        return TritonAttention(mha_prefill)
    return TorchAttention(mha_prefill)
