"""Decode attention for every decode row of a step in one call over a padded block table (the torch path;
the Triton kernel, pipeline.engine.triton.mla_decode, takes the same table on CUDA).

The step's single-token pieces are described once per step by a :class:`DecodeBatch`: the block table
``[B, W]`` (each row a sequence's blocks, padded with block 0, whose slots are masked out), the lengths
``[B]`` and the longest length. Every layer then runs the same arithmetic as
:func:`pipeline.engine.attention.paged.paged_decode_attention` (module docstring there) for all B rows at once:
the key positions are taken ``step_tokens`` at a time across the batch, each tile's int8 (or bf16) blocks
gathered and upcast on their own (never a float copy of a whole context), NZ blocks turned to rows in the
same copy, and an online softmax in float32 carried across tiles::

    scores[b, h, t] = softmax_scale * (s_k * <q_abs[b, h], c_q[b, t]> + <q_pe[b, h], k_pe[b, t]>),  t < L_b
    o_lat[b, h]     = s_k * sum_t softmax_t(scores[b, h, :]) * c_q[b, t]

Positions at or past a row's length score ``-inf`` (they add exactly zero). The tiles start at the same
positions as the per-sequence path's, so the two agree within float32 rounding of the GEMMs' summation
order (tests/test_batched_attention.py measures it); the per-sequence path stays as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.engine.attention.paged import DEFAULT_STEP_TOKENS
from pipeline.engine.cache.paged_cache import PagedLatentCache


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode rows: ``table`` int64 [B, W] (padded with block 0), ``lengths`` int64 [B] (tokens
    cached per row, its newest included), ``max_len`` / ``min_len`` (their maximum and minimum), on the cache's device."""

    table: torch.Tensor
    lengths: torch.Tensor
    max_len: int
    min_len: int

    @classmethod
    def build(cls, tables: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int,
              num_blocks: int, device=None) -> "DecodeBatch":
        """From each row's block ids (at least ceil(length / block_size) of them; only those are kept) and
        length (>= 1); block ids are checked against ``num_blocks`` once here, not per layer."""
        if len(tables) != len(lengths) or not lengths:
            raise ValueError(f"DecodeBatch: {len(tables)} block table(s) for {len(lengths)} length(s)")
        rows = []
        for i, (blocks, n) in enumerate(zip(tables, lengths)):
            need = -(-n // block_size)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or len(blocks) < need:
                raise ValueError(f"DecodeBatch: row {i} has length {n!r} and {len(blocks)} block(s) of "
                                 f"{block_size}")
            rows.append(list(blocks[:need]))
        width = max(len(r) for r in rows)
        flat = [b for r in rows for b in r]
        if any(not 0 <= b < num_blocks for b in flat):
            raise ValueError(f"DecodeBatch: a block id outside the cache's {num_blocks}")
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        return cls(table, torch.tensor(list(lengths), dtype=torch.long, device=device), max(lengths), min(lengths))

    @property
    def size(self) -> int:
        return self.table.shape[0]


def _gather_f32(store: torch.Tensor, blocks: torch.Tensor, cache: PagedLatentCache, cols: int) -> torch.Tensor:
    """Blocks ``blocks`` [B, k] of ``store`` as float32 ND rows [B, k * block_size, cols]."""
    B, k = blocks.shape
    bs = cache.block_size
    g = store[blocks]                                   # [B, k, bs, cols] (ND) or [B, k, C1, R', c0] (NZ)
    if not cache.nz:
        return g.view(B, k * bs, cols).float()
    _, _, c1, rp, c0 = g.shape
    out = torch.empty(B, k, rp, c1, c0, dtype=torch.float32, device=g.device)
    out.copy_(g.permute(0, 1, 3, 2, 4))                  # layout change and upcast in one copy
    nd = out.view(B, k, rp, c1 * c0)
    if rp != bs or c1 * c0 != cols:
        nd = nd[:, :, :bs, :cols]
    return nd.reshape(B, k * bs, cols)


def batched_decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache,
                             batch: DecodeBatch, softmax_scale: float,
                             step_tokens: int = DEFAULT_STEP_TOKENS) -> torch.Tensor:
    """``q_abs`` [B, H, C], ``q_pe`` [B, H, d_r] (float32) of the batch's rows -> ``o_lat`` [B, H, C]
    float32, before W_UV (module docstring)."""
    B, H, C = q_abs.shape
    if B != batch.size or C != cache.C or q_pe.shape != (B, H, cache.d_r):
        raise ValueError(f"batched_decode_attention: q_abs {tuple(q_abs.shape)}, q_pe {tuple(q_pe.shape)} for "
                         f"{batch.size} row(s), C={cache.C}, d_r={cache.d_r}")
    bs = cache.block_size
    per = max(1, step_tokens // bs)
    s_k = cache.scale_value
    dev = q_abs.device
    m = torch.full((B, H, 1), float("-inf"), device=dev)
    l = torch.zeros(B, H, 1, device=dev)
    acc = torch.zeros(B, H, C, device=dev)
    width = -(-batch.max_len // bs)
    for j in range(0, width, per):
        blocks = batch.table[:, j:j + per]
        c = _gather_f32(cache.c, blocks, cache, C)                               # [B, T, C]
        pe = _gather_f32(cache.pe, blocks, cache, cache.d_r)                     # [B, T, d_r]
        scores = torch.baddbmm(torch.bmm(q_pe, pe.transpose(1, 2)), q_abs, c.transpose(1, 2),
                               beta=softmax_scale, alpha=s_k * softmax_scale)    # [B, H, T]
        pos = torch.arange(j * bs, j * bs + c.shape[1], device=dev)
        if j * bs + c.shape[1] > batch.min_len:                      # some row ends in this tile
            scores.masked_fill_((pos[None, :] >= batch.lengths[:, None])[:, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=2, keepdim=True))
        m_new = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # rows with nothing yet
        alpha = torch.exp(m - m_new)
        p = scores.sub_(m_new).exp_()
        l.mul_(alpha).add_(p.sum(dim=2, keepdim=True))
        acc.mul_(alpha).baddbmm_(p, c)
        m = m_new
    return acc.mul_(s_k / l)
