"""Absorbed-MLA attention over a paged latent cache (docs/serving.md, "Decode attention with the int8 latent").

Per query row r (a head of a query token) and cached token t, with ``s_k`` the cache's FA3 scale
(``s_k = 1`` for a cache that holds the latent in the model dtype)::

    score[r, t] = softmax_scale * (s_k * <q_abs[r], c_q[t]> + <q_pe[r], k_pe[t]>)
    o_lat[r]    = s_k * sum_t softmax_t(score[r, :]) * c_q[t]

where ``c_q`` is what the cache stores (``c_int8`` or the model-dtype latent). That is the contiguous
absorbed form of ``pipeline.model.mla.MLA._absorbed`` on the dequantized latent ``s_k * c_int8``: the scale
factors out of both products, so it is applied once to each product, never to the cache.

The computation streams over a sequence's blocks (``blocks_per_step`` blocks at a time, each upcast to
float32 on its own) with an online softmax kept in float32 — running max ``m``, running sum ``l`` and an
unnormalised accumulator ``acc``::

    m' = max(m, max_t score);  a = exp(m - m');  p = exp(score - m')
    l' = a * l + sum_t p;      acc' = a * acc + p @ c_q;            finally  o_lat = s_k * acc / l

so no float copy of more than ``blocks_per_step`` blocks exists at any time. The per-step math is one
matmul over all heads (``[rows, C] x [C, T_step]``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from pipeline.engine.cache.blocks import BlockTable
from pipeline.engine.cache.paged_cache import PagedLatentCache

Table = Union[BlockTable, Sequence[int]]

#: Blocks upcast and multiplied together per step when not given: ~512 tokens per step amortises the
#: per-step Python work while keeping the float32 working set near 1 MiB (V3: 512 x 512 x 4 bytes).
DEFAULT_STEP_TOKENS = 512
#: Query rows (tokens x heads) per tile in prefill: bounds the score tile to rows x step tokens floats.
DEFAULT_PREFILL_ROWS = 2048


def _blocks_of(table: Table, cache: PagedLatentCache, n_tokens: int, what: str) -> list[int]:
    """The block ids holding ``n_tokens`` tokens of a sequence, checked against the cache."""
    blocks = list(table.blocks if isinstance(table, BlockTable) else table)
    if isinstance(table, BlockTable) and table.block_size != cache.block_size:
        raise ValueError(f"{what}: block table block_size {table.block_size} is not the cache's "
                         f"{cache.block_size}")
    need = -(-n_tokens // cache.block_size)
    if len(blocks) < need:
        raise ValueError(f"{what}: {n_tokens} token(s) need {need} block(s) of {cache.block_size}, "
                         f"the block table has {len(blocks)}")
    blocks = blocks[:need]
    for b in blocks:
        cache.check_block(b)
    return blocks


def _step_blocks(cache: PagedLatentCache, blocks_per_step: Optional[int]) -> int:
    if blocks_per_step is None:
        return max(1, DEFAULT_STEP_TOKENS // cache.block_size)
    if isinstance(blocks_per_step, bool) or not isinstance(blocks_per_step, int) or blocks_per_step < 1:
        raise ValueError(f"blocks_per_step must be an integer >= 1, got {blocks_per_step!r}")
    return blocks_per_step


def _check_queries(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache, what: str) -> None:
    if q_abs.dim() != 3 or q_abs.shape[-1] != cache.C:
        raise ValueError(f"{what}: q_abs must be [N, H, C={cache.C}], got {tuple(q_abs.shape)}")
    if q_pe.shape != (*q_abs.shape[:2], cache.d_r):
        raise ValueError(f"{what}: q_pe must be [{q_abs.shape[0]}, {q_abs.shape[1]}, d_r={cache.d_r}], "
                         f"got {tuple(q_pe.shape)}")


class _OnlineSoftmax:
    """Streaming softmax-weighted sum over key chunks for ``rows`` query rows, all in float32."""

    def __init__(self, rows: int, width: int, device=None):
        self.m = torch.full((rows,), float("-inf"), device=device)
        self.l = torch.zeros(rows, device=device)
        self.acc = torch.zeros(rows, width, device=device)

    def update(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Fold in ``scores`` [rows, T] (-inf where masked; consumed in place) and ``values`` [T, width]."""
        m_new = torch.maximum(self.m, scores.amax(dim=1))
        m_new = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # rows with nothing yet
        alpha = torch.exp(self.m - m_new)
        p = scores.sub_(m_new.unsqueeze(1)).exp_()
        self.l.mul_(alpha).add_(p.sum(dim=1))
        self.acc.mul_(alpha.unsqueeze(1)).addmm_(p, values)
        self.m = m_new

    def result(self, out_scale: float) -> torch.Tensor:
        """``out_scale * acc / l``: [rows, width] float32."""
        return self.acc.mul_((out_scale / self.l).unsqueeze(1))


def _scores(q: torch.Tensor, qp: torch.Tensor, c: torch.Tensor, pe: torch.Tensor, s_k: float,
            softmax_scale: float) -> torch.Tensor:
    """``softmax_scale * (s_k * q @ c^T + qp @ pe^T)`` [rows, T], the scales applied to the products."""
    return torch.addmm(qp @ pe.T, q, c.T, beta=softmax_scale, alpha=s_k * softmax_scale)


def paged_decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache,
                           block_tables: Sequence[Table], lengths: Sequence[int], softmax_scale: float,
                           blocks_per_step: Optional[int] = None) -> torch.Tensor:
    """One decode step of B sequences of different lengths: ``q_abs`` [B, H, C], ``q_pe`` [B, H, d_r] (the
    query of each sequence's newest token, whose own entry is already in the cache), ``block_tables[b]``
    the block ids of sequence b and ``lengths[b]`` its cached tokens (>= 1). Returns ``o_lat`` [B, H, C]
    float32 (see the module docstring), before W_UV."""
    _check_queries(q_abs, q_pe, cache, "paged_decode_attention")
    B, H, C = q_abs.shape
    if len(block_tables) != B or len(lengths) != B:
        raise ValueError(f"paged_decode_attention: {B} queries but {len(block_tables)} block table(s) and "
                         f"{len(lengths)} length(s)")
    step = _step_blocks(cache, blocks_per_step)
    bs = cache.block_size
    s_k = cache.scale.item() if cache.is_int8 else 1.0
    out = torch.empty(B, H, C, dtype=torch.float32, device=cache.c.device)
    for b in range(B):
        L = lengths[b]
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise ValueError(f"paged_decode_attention: length of sequence {b} must be an integer >= 1, got {L!r}")
        blocks = _blocks_of(block_tables[b], cache, L, f"paged_decode_attention (sequence {b})")
        q, qp = q_abs[b].float(), q_pe[b].float()
        acc = _OnlineSoftmax(H, C, out.device)
        for j in range(0, len(blocks), step):
            chunk = blocks[j:j + step]
            c, pe = cache.read_f32(chunk, min(len(chunk) * bs, L - j * bs))
            acc.update(_scores(q, qp, c, pe, s_k, softmax_scale), c)
        out[b] = acc.result(s_k)
    return out


def paged_prefill_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache,
                            block_table: Table, start: int, softmax_scale: float,
                            blocks_per_step: Optional[int] = None, tile_rows: int = DEFAULT_PREFILL_ROWS
                            ) -> torch.Tensor:
    """S new tokens of ONE sequence at positions ``start .. start + S - 1``, already written into the cache:
    ``q_abs`` [S, H, C], ``q_pe`` [S, H, d_r]. Query s attends causally to cached tokens ``0 .. start + s``.
    Queries are taken ``max(1, tile_rows // H)`` tokens at a time; key steps that lie wholly at or before
    a tile's first query position need no mask, those past its last one are skipped. Returns [S, H, C]
    float32."""
    _check_queries(q_abs, q_pe, cache, "paged_prefill_attention")
    S, H, C = q_abs.shape
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"paged_prefill_attention: start must be an integer >= 0, got {start!r}")
    if S < 1:
        raise ValueError("paged_prefill_attention: no query tokens (S = 0)")
    if not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"paged_prefill_attention: tile_rows must be an integer >= 1, got {tile_rows!r}")
    blocks = _blocks_of(block_table, cache, start + S, "paged_prefill_attention")
    step = _step_blocks(cache, blocks_per_step)
    bs = cache.block_size
    s_k = cache.scale.item() if cache.is_int8 else 1.0
    q_all, qp_all = q_abs.float().reshape(S * H, C), q_pe.float().reshape(S * H, cache.d_r)
    out = torch.empty(S, H, C, dtype=torch.float32, device=cache.c.device)
    tile = max(1, tile_rows // H)
    for s0 in range(0, S, tile):
        s1 = min(S, s0 + tile)
        q, qp = q_all[s0 * H:s1 * H], qp_all[s0 * H:s1 * H]
        q_pos = torch.arange(start + s0, start + s1, device=out.device)
        n_keys = start + s1                                   # keys 0 .. start + s1 - 1 are visible to some query
        acc = _OnlineSoftmax((s1 - s0) * H, C, out.device)
        for j in range(0, -(-n_keys // bs), step):
            chunk = blocks[j:j + step]
            p0 = j * bs
            n = min(len(chunk) * bs, n_keys - p0)
            c, pe = cache.read_f32(chunk, n)
            scores = _scores(q, qp, c, pe, s_k, softmax_scale)
            if p0 + n - 1 > start + s0:                       # some key is after the tile's first query
                visible = torch.arange(p0, p0 + n, device=out.device).unsqueeze(0) <= q_pos.unsqueeze(1)
                scores.view(s1 - s0, H, n).masked_fill_(~visible.unsqueeze(1), float("-inf"))
            acc.update(scores, c)
        out[s0:s1] = acc.result(s_k).view(s1 - s0, H, C)
    return out


def reference_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                        softmax_scale: float, start: Optional[int] = None) -> torch.Tensor:
    """The contiguous absorbed attention of ``MLA._absorbed`` in float32, for one sequence: ``q_abs``
    [S, H, C], ``q_pe`` [S, H, d_r], the (dequantized) latent ``c`` [T, C] and ``k_pe`` [T, d_r]; query s at
    position ``start + s`` (default ``T - S``) attends to keys ``0 .. start + s``::

        scores = (q_abs . c + q_pe . k_pe) * softmax_scale;  o_lat = softmax(scores) @ c    -> [S, H, C]
    """
    S, T = q_abs.shape[0], c.shape[0]
    start = T - S if start is None else start
    if start < 0 or start + S > T:
        raise ValueError(f"reference_attention: queries at {start}..{start + S - 1} need {start + S} keys, "
                         f"got {T}")
    cf = c.float()
    scores = (torch.einsum("shc,tc->sht", q_abs.float(), cf)
              + torch.einsum("shr,tr->sht", q_pe.float(), k_pe.float())) * softmax_scale
    visible = torch.arange(T).unsqueeze(0) <= torch.arange(start, start + S).unsqueeze(1)     # [S, T]
    probs = scores.masked_fill(~visible.unsqueeze(1), float("-inf")).softmax(dim=-1)
    return torch.einsum("sht,tc->shc", probs, cf)
