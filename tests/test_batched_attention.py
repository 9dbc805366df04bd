"""pipeline.engine.attention.batched: every decode row of a step in one call over a padded block table,
against the per-sequence reference path (pipeline.engine.attention.paged.paged_decode_attention) and the
contiguous reference, ND and NZ, int8 and bf16 latents, ragged lengths and tiles."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.engine.attention.paged import paged_decode_attention, reference_attention
from pipeline.engine.attention.batched import DecodeBatch, batched_decode_attention
from pipeline.engine.cache.paged_cache import PagedLatentCache

SCALE = 0.1352338
# Batched vs per-sequence, same float32 math and the same tiles: only the GEMMs' summation order differs
# (a padded batch, masked columns adding exact zeros). Measured max |diff| / max |ref| <= 3e-7 here.
BATCHED_RTOL = 2e-6
PAGED_RTOL = 1e-5      # against the contiguous reference (tests/test_paged_attention.py's bound)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rel(x, ref) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


def _setup(lengths, nz: bool, int8: bool, C=64, R=16, H=4, bs=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lengths)
    lat = [torch.randn(L, C, generator=g).bfloat16() for L in lengths]
    fa_k = max(x.float().abs().max() for x in lat) / 127 if int8 else None
    cache = PagedLatentCache(n_blocks + 5, bs, C, R, fa_k=fa_k, nz=nz)
    ids = list(range(cache.num_blocks))
    random.Random(seed).shuffle(ids)
    tables, pes = [], []
    for L, c in zip(lengths, lat):
        tables.append([ids.pop() for _ in range(-(-L // bs))])
        pes.append(torch.randn(L, R, generator=g).bfloat16())
        cache.write(tables[-1], c, pes[-1], 0)
    q = torch.randn(len(lengths), H, C, generator=g) * 0.3
    qp = torch.randn(len(lengths), H, R, generator=g) * 0.3
    return cache, tables, lat, pes, q, qp


@pytest.mark.parametrize("nz", [False, True])
@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("step_tokens", [512, 32, 16])
def test_batched_equals_per_sequence_and_reference(nz, int8, step_tokens):
    lengths = [1, 5, 16, 17, 64, 200, 33]
    cache, tables, lat, pes, q, qp = _setup(lengths, nz, int8)
    batch = DecodeBatch.build(tables, lengths, cache.block_size, cache.num_blocks)
    got = batched_decode_attention(q, qp, cache, batch, SCALE, step_tokens=step_tokens)
    per_seq = paged_decode_attention(q, qp, cache, tables, lengths, SCALE,
                                     blocks_per_step=max(1, step_tokens // cache.block_size))
    assert got.shape == per_seq.shape and got.dtype == torch.float32
    assert _rel(got, per_seq) <= BATCHED_RTOL
    for b in range(len(lengths)):
        c = lat[b].float()
        if int8:
            c = torch.clamp(torch.round(c / cache.scale), -127, 127) * cache.scale
        ref = reference_attention(q[b:b + 1], qp[b:b + 1], c, pes[b].float(), SCALE)
        assert _rel(got[b:b + 1], ref) <= PAGED_RTOL, b


def test_batch_of_one_and_a_row_alone_agree():
    lengths = [40, 3]
    cache, tables, _, _, q, qp = _setup(lengths, nz=True, int8=True)
    both = batched_decode_attention(q, qp, cache, DecodeBatch.build(tables, lengths, 16, cache.num_blocks), SCALE)
    for b in range(2):
        alone = batched_decode_attention(q[b:b + 1], qp[b:b + 1], cache,
                                         DecodeBatch.build([tables[b]], [lengths[b]], 16, cache.num_blocks), SCALE)
        assert _rel(both[b:b + 1], alone) <= BATCHED_RTOL


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="row 0 has length 20 and 1 block"):
        DecodeBatch.build([[0]], [20], 16, 4)
    with pytest.raises(ValueError, match="outside the cache's 4"):
        DecodeBatch.build([[7]], [3], 16, 4)
    with pytest.raises(ValueError, match="length 0"):
        DecodeBatch.build([[0]], [0], 16, 4)
    cache = PagedLatentCache(4, 16, 64, 16)
    with pytest.raises(ValueError, match="for 1 row"):
        batched_decode_attention(torch.zeros(2, 4, 64), torch.zeros(2, 4, 16), cache,
                                 DecodeBatch.build([[0]], [3], 16, 4), SCALE)
