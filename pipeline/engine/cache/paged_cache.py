"""One layer's paged MLA cache (docs/serving.md, "The KV cache"): the latent c and the rotated k_pe.

Storage is ``num_blocks`` blocks of ``block_size`` token slots; a sequence addresses its tokens through a
block table (``pipeline.engine.cache.blocks``): token ``p`` lives in slot ``(blocks[p // block_size],
p % block_size)``. Per token the cache holds

* the latent ``c`` [C = kv_lora_rank]: int8 on an FA3 layer, with one static per-layer scale ``fa_k``::

      c_int8 = clamp(round(float32(c) / float32(fa_k)), -127, 127)       (round half to even)

  bit for bit what the fake-quant reference's ``fa3_latent`` computes (it returns ``fa_k * c_int8``);
  on a layer excluded from FA3, ``c`` in the model dtype;
* ``k_pe`` [d_r = qk_rope_head_dim] in the model dtype on every layer.

So ``bytes_per_token = C * 1 + d_r * 2`` (V3: 512 + 128 = 640) on an FA3 layer against
``(C + d_r) * 2 = 1152`` in bf16.

Layouts: ND stores ``c`` as ``[num_blocks, block_size, C]`` and ``k_pe`` as ``[num_blocks, block_size, d_r]``;
NZ (``nz=True``, MindIE's ``enable_nz``) stores each block as its FRACTAL_NZ form (``pipeline.engine.cache.nz``):
int8 ``c`` as ``[num_blocks, C1, R', 32]`` and 16-bit ``k_pe`` as ``[num_blocks, C1', R', 16]``, with
``R' = ceil(block_size / 16) * 16``; padding is zero. Writing into the NZ cache gives exactly
``nd_to_nz`` of what the ND cache holds.

Attention reads blocks with ``read_f32``: a few blocks at a time upcast to float32 (the int8 values
unscaled; the scale is applied by the caller to its products), never the whole cache.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from pipeline.engine.cache.blocks import BlockTable
from pipeline.engine.cache.nz import c0_of, nz_rows, nz_shape

INT8_MAX = 127

#: Where tokens go: a BlockTable or a sequence's block ids.
Where = Union[BlockTable, Sequence[int]]


def fa3_scale(fa_k: Union[torch.Tensor, float]) -> torch.Tensor:
    """The per-layer scale as fakequant.fa3_latent uses it: a float32 scalar tensor. ValueError unless it
    is one positive finite number."""
    s = torch.as_tensor(fa_k)
    if s.numel() != 1:
        raise ValueError(f"fa_k must be one scalar per layer, got shape {tuple(s.shape)}")
    s = s.float().reshape(())
    if not (math.isfinite(s.item()) and s.item() > 0):
        raise ValueError(f"fa_k must be a positive finite scale, got {s.item()}")
    return s


def quantize_latent(c: torch.Tensor, fa_k: Union[torch.Tensor, float]) -> torch.Tensor:
    """``clamp(round(c.float() / fa_k), -127, 127)`` as int8: the integers inside ``fa3_latent(c, fa_k)``
    (same float32 operations, so ``fa_k * result`` cast to ``c.dtype`` equals ``fa3_latent`` exactly)."""
    return _to_int8(c, fa3_scale(fa_k))


def _to_int8(c: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """quantize_latent's arithmetic on a scale already checked by fa3_scale."""
    return torch.clamp(torch.round(c.float() / scale), -INT8_MAX, INT8_MAX).to(torch.int8)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class PagedLatentCache:
    """Paged latent + k_pe storage of ONE attention layer. ``fa_k`` given: an FA3 layer (int8 latent, that
    scale); ``fa_k=None``: the latent in ``dtype``. ``nz=True``: blocks stored in NZ form (needs a 16-bit
    ``dtype``: NZ is defined for int8 and 16-bit types only)."""

    def __init__(self, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype = torch.bfloat16, fa_k: Union[torch.Tensor, float, None] = None,
                 nz: bool = False, device: Union[str, torch.device, None] = None):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"PagedLatentCache: {name} must be an integer >= 1, got {v!r}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"PagedLatentCache: dtype must be the model's floating dtype, got {dtype!r}")
        self.num_blocks, self.block_size, self.C, self.d_r = num_blocks, block_size, kv_lora_rank, rope_dim
        self.dtype = dtype
        self.scale: Optional[torch.Tensor] = None if fa_k is None else fa3_scale(fa_k)
        self.scale_value = 1.0 if self.scale is None else self.scale.item()   # s_k as attention applies it
        self.latent_dtype = torch.int8 if self.scale is not None else dtype
        self.nz = bool(nz)
        if self.nz:
            for what, dt in (("latent", self.latent_dtype), ("k_pe", dtype)):
                try:
                    c0_of(dt)
                except ValueError:
                    raise ValueError(f"PagedLatentCache: NZ layout has no form for the {what} dtype {dt} "
                                     f"(int8 or a 16-bit dtype needed); use nz=False") from None
            self.c = torch.zeros(num_blocks, *nz_shape(block_size, kv_lora_rank, self.latent_dtype),
                                 dtype=self.latent_dtype, device=device)
            self.pe = torch.zeros(num_blocks, *nz_shape(block_size, rope_dim, dtype), dtype=dtype, device=device)
        else:
            self.c = torch.zeros(num_blocks, block_size, kv_lora_rank, dtype=self.latent_dtype, device=device)
            self.pe = torch.zeros(num_blocks, block_size, rope_dim, dtype=dtype, device=device)

    def __repr__(self) -> str:
        kind = f"int8 fa_k={self.scale.item():.6g}" if self.is_int8 else str(self.dtype)
        return (f"PagedLatentCache({self.num_blocks} blocks x {self.block_size}, C={self.C}, d_r={self.d_r}, "
                f"latent {kind}, k_pe {self.dtype}, {'NZ' if self.nz else 'ND'})")

    @property
    def is_int8(self) -> bool:
        return self.scale is not None

    # ----- sizes ------------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes one token takes (padding of partial NZ fractals not counted): ``C * size(latent) +
        d_r * size(model dtype)``; V3: 640 on an FA3 layer, 1152 in bf16."""
        return (self.C * torch.empty((), dtype=self.latent_dtype).element_size()
                + self.d_r * torch.empty((), dtype=self.dtype).element_size())

    def storage_bytes(self) -> int:
        """Bytes of the allocated tensors (padding included)."""
        return self.c.numel() * self.c.element_size() + self.pe.numel() * self.pe.element_size()

    # ----- addressing -------------------------------------------------------------------------------
    def check_block(self, block: int) -> None:
        if not _is_int(block) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block!r} is not a block of this cache (ids 0..{self.num_blocks - 1})")

    def _runs(self, where: Where, start: int, n: int) -> list[tuple[int, int, int, int]]:
        """``(block, offset0, offset1, token0)`` runs: tokens ``token0 .. token0 + offset1 - offset0 - 1`` of
        the write go to slots ``offset0 .. offset1 - 1`` of ``block``."""
        if not _is_int(start) or start < 0:
            raise ValueError(f"write: start_position must be an integer >= 0, got {start!r}")
        bs = self.block_size
        if isinstance(where, BlockTable):
            if where.block_size != bs:
                raise ValueError(f"write: the block table's block_size {where.block_size} is not the cache's {bs}")
            if start + n > where.num_tokens:
                raise ValueError(f"write: positions {start}..{start + n - 1} are beyond the table's "
                                 f"{where.num_tokens} token(s); append_tokens first")
            where = where.blocks
        items = list(where)
        if not all(_is_int(x) for x in items):
            raise TypeError("write: where must be a BlockTable or a list of block ids; got "
                            f"{type(where).__name__} with items {items[:3]!r}...")
        if start + n > len(items) * bs:
            raise ValueError(f"write: positions {start}..{start + n - 1} need {-(-(start + n) // bs)} block(s), "
                             f"the table has {len(items)}")
        runs = []
        p = start
        while p < start + n:
            b, o = items[p // bs], p % bs
            self.check_block(b)
            o1 = min(bs, o + start + n - p)
            runs.append((b, o, o1, p - start))
            p += o1 - o
        return runs

    # ----- writing ----------------------------------------------------------------------------------
    def write(self, where: Where, c: torch.Tensor, k_pe: torch.Tensor, start_position: int = 0) -> None:
        """Store ``c`` [S, C] and ``k_pe`` [S, d_r] of tokens at positions ``start_position ..
        start_position + S - 1`` of the sequence ``where`` addresses. On an FA3 layer
        ``c`` is quantized with ``quantize_latent`` as given: pass the latent in the model dtype to match
        ``fa3_latent`` on the model exactly. ``k_pe`` (and a non-FA3 latent) are cast to the model dtype."""
        if c.dim() != 2 or c.shape[1] != self.C:
            raise ValueError(f"write: c must be [S, {self.C}], got {tuple(c.shape)}")
        if k_pe.dim() != 2 or k_pe.shape != (c.shape[0], self.d_r):
            raise ValueError(f"write: k_pe must be [S={c.shape[0]}, {self.d_r}], got {tuple(k_pe.shape)}")
        if not (c.dtype.is_floating_point and k_pe.dtype.is_floating_point):
            raise ValueError(f"write: c and k_pe must be floating point, got {c.dtype} and {k_pe.dtype}")
        n = c.shape[0]
        runs = self._runs(where, start_position, n)
        cq = quantize_latent(c, self.scale) if self.is_int8 else c.to(self.dtype)
        cq = cq.to(self.c.device)
        pe = k_pe.to(dtype=self.dtype, device=self.pe.device)
        for b, o0, o1, i0 in runs:
            i1 = i0 + o1 - o0
            if self.nz:
                _nz_put_rows(self.c[b], o0, cq[i0:i1])
                _nz_put_rows(self.pe[b], o0, pe[i0:i1])
            else:
                self.c[b, o0:o1] = cq[i0:i1]
                self.pe[b, o0:o1] = pe[i0:i1]

    def write_slots(self, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store the latents of one step's tokens, whatever sequences they belong to, in one go: token i
        goes to flat slot ``slots[i]`` = block * block_size + offset (int64 [S], distinct, not checked
        here: the runner builds them from block tables the scheduler handed out). Same values as
        :meth:`write` (the latent quantized with ``quantize_latent`` on an FA3 layer); the torch code, the
        reference of the C write (pipeline.engine.native.cpu_attention.write_slots: the same bytes)."""
        n = c.shape[0]
        if c.shape != (n, self.C) or k_pe.shape != (n, self.d_r) or slots.shape != (n,):
            raise ValueError(f"write_slots: c [S, {self.C}], k_pe [S, {self.d_r}] and slots [S] expected, got "
                             f"{tuple(c.shape)}, {tuple(k_pe.shape)}, {tuple(slots.shape)}")
        cq = (_to_int8(c, self.scale) if self.is_int8 else c.to(self.dtype)).to(self.c.device)
        pe = k_pe.to(dtype=self.dtype, device=self.pe.device)
        bs = self.block_size
        if not self.nz:
            self.c.view(-1, self.C).index_copy_(0, slots, cq)
            self.pe.view(-1, self.d_r).index_copy_(0, slots, pe)
            return
        block, offset = slots // bs, slots % bs
        for store, rows in ((self.c, cq), (self.pe, pe)):
            _, c1, _, c0 = store.shape
            cols = rows.shape[1]
            if cols != c1 * c0:
                rows = torch.cat([rows, rows.new_zeros(n, c1 * c0 - cols)], dim=1)
            store[block[:, None], torch.arange(c1, device=store.device)[None, :], offset[:, None]] = rows.view(n, c1, c0)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every slot of block ``src`` into ``dst`` (the copy-on-write of ``BlockTable.append_tokens``)."""
        self.check_block(src)
        self.check_block(dst)
        self.c[dst] = self.c[src]
        self.pe[dst] = self.pe[src]

    # ----- reading ----------------------------------------------------------------------------------
    def read_block(self, block: int, n_tokens: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n_tokens`` (default all) slots of ``block`` in ND form and their stored dtypes:
        ``(c [n, C] int8 or model dtype, k_pe [n, d_r] model dtype)``."""
        self.check_block(block)
        n = self.block_size if n_tokens is None else n_tokens
        if not _is_int(n) or not 0 <= n <= self.block_size:
            raise ValueError(f"read_block: n_tokens must be in 0..{self.block_size}, got {n_tokens!r}")
        if self.nz:
            return nz_rows(self.c[block], 0, n, self.C), nz_rows(self.pe[block], 0, n, self.d_r)
        return self.c[block, :n].clone(), self.pe[block, :n].clone()

    def read_f32(self, blocks: Sequence[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n_tokens`` tokens held by ``blocks`` (in that order: token ``i`` in slot ``i %
        block_size`` of ``blocks[i // block_size]``), upcast to float32 in ND form: ``(c [n, C], k_pe
        [n, d_r])``. The int8 latent comes back as its integer values, NOT multiplied by ``scale``. Only
        these blocks are converted (one copy, layout change and upcast together); block ids are not checked
        here (callers check them once)."""
        k, bs = len(blocks), self.block_size
        if not 0 <= n_tokens <= k * bs:
            raise ValueError(f"read_f32: {n_tokens} token(s) do not fit in {k} block(s) of {bs}")
        if k == 1:
            c, pe = self.c[blocks[0]].unsqueeze(0), self.pe[blocks[0]].unsqueeze(0)
        else:
            idx = torch.as_tensor(blocks, dtype=torch.long, device=self.c.device)
            c, pe = self.c.index_select(0, idx), self.pe.index_select(0, idx)
        if self.nz:
            return _nz_blocks_f32(c, bs, self.C, n_tokens), _nz_blocks_f32(pe, bs, self.d_r, n_tokens)
        return (c.reshape(k * bs, self.C)[:n_tokens].float(), pe.reshape(k * bs, self.d_r)[:n_tokens].float())


def _nz_put_rows(nz: torch.Tensor, t0: int, rows: torch.Tensor) -> None:
    """Write ND ``rows`` [n, cols] as rows ``t0 .. t0 + n - 1`` of the NZ matrix ``nz`` [C1, R', c0] in
    place: ``X[i, j] -> NZ[j // c0, i, j % c0]``; the padding columns (j >= cols) are written as zero."""
    c1, _, c0 = nz.shape
    n, cols = rows.shape
    if cols != c1 * c0:
        padded = rows.new_zeros(n, c1 * c0)
        padded[:, :cols] = rows
        rows = padded
    nz[:, t0:t0 + n, :] = rows.view(n, c1, c0).transpose(0, 1)


def _nz_blocks_f32(nz: torch.Tensor, block_size: int, cols: int, n_tokens: int) -> torch.Tensor:
    """NZ blocks [k, C1, R', c0] -> float32 ND rows [n_tokens, cols] of the blocks' tokens in order (row
    padding R' > block_size and column padding dropped). The layout change and the upcast are one copy."""
    k, c1, rp, c0 = nz.shape
    out = torch.empty(k, rp, c1, c0, dtype=torch.float32, device=nz.device)
    out.copy_(nz.permute(0, 2, 1, 3))
    nd = out.view(k, rp, c1 * c0)
    if rp != block_size or c1 * c0 != cols:
        nd = nd[:, :block_size, :cols]
    return nd.reshape(k * block_size, cols)[:n_tokens]
