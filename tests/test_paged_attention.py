"""pipeline.engine.cache.paged_cache + pipeline.engine.attention.paged: the paged (int8 / NZ) latent cache of one layer
and absorbed-MLA attention over it, against the contiguous reference (MLA._absorbed's math)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pipeline.engine.attention.paged import paged_decode_attention, paged_prefill_attention, reference_attention
from pipeline.engine.cache.blocks import BlockAllocator, BlockTable
from pipeline.engine.cache.nz import nd_to_nz
from pipeline.engine.cache.paged_cache import PagedLatentCache, quantize_latent
from pipeline.quant.evaluation.fakequant import fa3_latent

# Paged vs contiguous, both float32 on the same (dequantized) latent: only the summation order differs
# (blocked online softmax vs one softmax). Measured max |diff| / max |ref|: 6.4e-7 at worst in these
# tests. Stated bound:
PAGED_RTOL = 1e-5
# o_lat from the int8 cache against o_lat from a bf16 cache of the same float latent (fa_k = max|c| / 127),
# measured here (SQNR = 10 log10(sum ref^2 / sum err^2)):
#   random Gaussian latent (no outliers, max|c| ~ 4.7-5.0 sigma), H=16, C=512, d_r=64, T=1000, 3 seeds:
#     q_std 0.3 (scores' std ~1, the softmax moderately peaked): 38.4 / 39.0 / 39.0 dB
#     q_std 1.0 (scores' std ~3, a sharp softmax: score errors are amplified): 32.1 / 32.3 / 33.3 dB
#   the tiny fixture's real normed latents (C=48, so NZ pads columns; max|c| ~ 4.1-4.4 std) with its
#   real queries (scores' std ~0.36), every position of 2 x 48 tokens: layer 0 39.5, layer 1 40.9, layer 2 40.0 dB
# Thresholds sit ~3 dB under the lowest measurement of each case.
SQNR_RANDOM_DB = {0.3: 35.0, 1.0: 29.0}
SQNR_REAL_DB = 36.5
# The bf16 cache itself against the float32 latent, for scale: measured 46.7-56.2 dB on the cases above.
SQNR_BF16_DB = 43.0
# Paged attention times W_UV against MLA._absorbed of the float32 tiny model (same math, float32; outputs
# ~1 in size): measured max |diff| 2.1e-7.
MLA_ATOL = 1e-5

SCALE = 0.1352338          # V3's softmax_scale (192^-0.5 * mscale^2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (x - ref)^2)."""
    return 10 * math.log10(ref.double().pow(2).sum().item() / (x.double() - ref.double()).pow(2).sum().item())


def _latents(T: int, C: int, R: int, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, C, generator=g).to(dtype), torch.randn(T, R, generator=g).to(dtype)


def _queries(N: int, H: int, C: int, R: int, seed: int, q_std: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, C, generator=g) * q_std, torch.randn(N, H, R, generator=g) * q_std


def _fill(cache: PagedLatentCache, c: torch.Tensor, pe: torch.Tensor, seed: int = 0,
          chunks: tuple[int, ...] = (7, 1, 30)) -> list[int]:
    """Write c/pe as one sequence on shuffled (scattered) blocks, in uneven chunks; returns its block ids."""
    T, bs = c.shape[0], cache.block_size
    ids = list(range(cache.num_blocks))
    random.Random(seed).shuffle(ids)
    blocks = ids[:-(-T // bs)]
    p, k = 0, 0
    while p < T:
        n = min(chunks[k % len(chunks)], T - p)
        cache.write(blocks, c[p:p + n], pe[p:p + n], p)
        p, k = p + n, k + 1
    return blocks


def _dequant(cache: PagedLatentCache, c: torch.Tensor) -> torch.Tensor:
    """The latent the cache gives back, float32: fa_k * c_int8 (int8 layer) or c in the model dtype."""
    if cache.is_int8:
        return quantize_latent(c, cache.scale).float() * cache.scale
    return c.to(cache.dtype).float()


# ----- write / read ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("nz", [False, True])
def test_int8_round_trip_is_fa3_latent_exactly(nz):
    s = torch.tensor(0.0625)            # a power of two: k.5 * s is exact, so round-half-to-even shows
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, -127.5, 300.0, -1e4]) * s
    c = torch.randn(40, 64) * 4
    c[0, :10] = halves
    c = c.bfloat16()
    pe = torch.randn(40, 16).bfloat16()
    cache = PagedLatentCache(6, 16, 64, 16, torch.bfloat16, fa_k=s, nz=nz)
    blocks = [4, 1, 5]
    cache.write(blocks, c, pe, 0)
    got_c = torch.cat([cache.read_block(b, n)[0] for b, n in zip(blocks, (16, 16, 8))])
    got_pe = torch.cat([cache.read_block(b, n)[1] for b, n in zip(blocks, (16, 16, 8))])
    assert got_c.dtype == torch.int8 and got_pe.dtype == torch.bfloat16
    assert got_c[0, :10].tolist() == [0, 2, 2, 0, -2, 126, 127, -127, 127, -127]    # half to even, clamped
    assert torch.equal((got_c.float() * s).bfloat16(), fa3_latent(c, s))            # bit for bit
    assert torch.equal(got_c, quantize_latent(c, s))
    assert torch.equal(got_pe, pe)


@pytest.mark.parametrize("nz", [False, True])
def test_model_dtype_round_trip_and_block_ids(nz):
    c, pe = _latents(21, 48, 16, seed=1)
    cache = PagedLatentCache(4, 16, 48, 16, torch.bfloat16, nz=nz)
    table = BlockTable(16)
    alloc = BlockAllocator(4)
    alloc.allocate()                                       # block 0 taken by someone else
    table.append_tokens(21, alloc)
    cache.write(table, c[:9], pe[:9], 0)
    cache.write(table.blocks, c[9:], pe[9:], 9)                                           # by block ids
    got = [cache.read_block(b, n) for b, n in zip(table.blocks, (16, 5))]
    assert torch.equal(torch.cat([g[0] for g in got]), c) and torch.equal(torch.cat([g[1] for g in got]), pe)
    cache.copy_block(table.blocks[0], 0)
    assert torch.equal(cache.read_block(0)[0], got[0][0])


@pytest.mark.parametrize("bs, C, R", [(16, 64, 16), (20, 40, 24), (128, 512, 64)])
@pytest.mark.parametrize("int8", [True, False])
def test_nz_write_equals_nd_write_then_convert(bs, C, R, int8):
    c, pe = _latents(3 * bs + 5, C, R, seed=bs)
    fa_k = c.float().abs().max() / 127 if int8 else None
    nd = PagedLatentCache(5, bs, C, R, torch.bfloat16, fa_k=fa_k)
    nz = PagedLatentCache(5, bs, C, R, torch.bfloat16, fa_k=fa_k, nz=True)
    blocks = _fill(nd, c, pe, seed=3, chunks=(bs // 2 + 1, 3))      # chunks that start mid-block
    assert _fill(nz, c, pe, seed=3, chunks=(bs // 2 + 1, 3)) == blocks
    assert torch.equal(nz.c, nd_to_nz(nd.c)) and torch.equal(nz.pe, nd_to_nz(nd.pe))
    if (bs, C, R) == (128, 512, 64):
        assert tuple(nz.c.shape[1:]) == ((16, 128, 32) if int8 else (32, 128, 16))   # serving.md's shapes
        assert tuple(nz.pe.shape[1:]) == (4, 128, 16)


def test_bytes_per_token_v3_shapes():
    int8 = PagedLatentCache(2, 128, 512, 64, torch.bfloat16, fa_k=0.01, nz=True)
    bf16 = PagedLatentCache(2, 128, 512, 64, torch.bfloat16)
    assert int8.bytes_per_token() == 512 + 64 * 2 == 640
    assert bf16.bytes_per_token() == (512 + 64) * 2 == 1152
    assert PagedLatentCache(2, 128, 512, 64, torch.bfloat16, fa_k=0.01).bytes_per_token() == 640
    for cache in (int8, bf16):                             # no padding at these shapes
        assert cache.storage_bytes() == 2 * 128 * cache.bytes_per_token()
    assert round(1152 / 640, 2) == 1.8


def test_clear_errors():
    with pytest.raises(ValueError, match="NZ layout has no form for the latent dtype torch.float32"):
        PagedLatentCache(2, 16, 32, 16, torch.float32, nz=True)
    with pytest.raises(ValueError, match="fa_k must be a positive finite scale"):
        PagedLatentCache(2, 16, 32, 16, fa_k=0.0)
    cache = PagedLatentCache(2, 16, 32, 16, fa_k=0.1)
    c, pe = _latents(20, 32, 16, seed=0)
    with pytest.raises(ValueError, match="need 2 block"):
        cache.write([0], c, pe, 0)
    with pytest.raises(ValueError, match="block 7 is not a block of this cache"):
        cache.write([0, 7], c, pe, 0)
    with pytest.raises(ValueError, match=r"c must be \[S, 32\]"):
        cache.write([0, 1], c[:, :8], pe, 0)
    cache.write([0, 1], c, pe, 0)
    q, qp = _queries(1, 2, 32, 16, seed=0)
    with pytest.raises(ValueError, match="20 token\\(s\\) need 2 block"):
        paged_decode_attention(q, qp, cache, [[0]], [20], SCALE)
    with pytest.raises(ValueError, match="length of sequence 0 must be an integer >= 1"):
        paged_decode_attention(q, qp, cache, [[0]], [0], SCALE)
    with pytest.raises(ValueError, match="q_pe must be"):
        paged_decode_attention(q, qp[..., :8], cache, [[0, 1]], [20], SCALE)


# ----- attention against the contiguous reference -----------------------------------------------------------
@pytest.mark.parametrize("kind", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("blocks_per_step", [1, None])
def test_decode_over_scattered_blocks_equals_contiguous(kind, blocks_per_step):
    T, H, C, R, bs = 150, 8, 64, 16, 16
    c, pe = _latents(T, C, R, seed=5, dtype=torch.float32 if kind == "fp32" else torch.bfloat16)
    fa_k = c.float().abs().max() / 127 if kind == "int8" else None
    cache = PagedLatentCache(20, bs, C, R, c.dtype, fa_k=fa_k)
    blocks = _fill(cache, c, pe, seed=7)
    assert blocks != sorted(blocks)
    q, qp = _queries(1, H, C, R, seed=6)
    got = paged_decode_attention(q, qp, cache, [blocks], [T], SCALE, blocks_per_step)
    ref = reference_attention(q, qp, _dequant(cache, c), pe.float(), SCALE)
    assert got.dtype == torch.float32 and got.shape == (1, H, C)
    assert _rel(got, ref) <= PAGED_RTOL


@pytest.mark.parametrize("int8", [True, False])
def test_nz_attention_equals_nd(int8):
    T, H, C, R, bs = 77, 4, 64, 32, 16
    c, pe = _latents(T, C, R, seed=8)
    fa_k = c.float().abs().max() / 127 if int8 else None
    nd = PagedLatentCache(8, bs, C, R, fa_k=fa_k)
    nz = PagedLatentCache(8, bs, C, R, fa_k=fa_k, nz=True)
    blocks = _fill(nd, c, pe, seed=9)
    _fill(nz, c, pe, seed=9)
    q, qp = _queries(1, H, C, R, seed=10)
    for bps in (1, 3):
        assert torch.equal(paged_decode_attention(q, qp, nz, [blocks], [T], SCALE, bps),
                           paged_decode_attention(q, qp, nd, [blocks], [T], SCALE, bps))
    qs, qps = _queries(20, H, C, R, seed=11)
    assert torch.equal(paged_prefill_attention(qs, qps, nz, blocks, T - 20, SCALE),
                       paged_prefill_attention(qs, qps, nd, blocks, T - 20, SCALE))


@pytest.mark.parametrize("nz", [False, True])
def test_batch_of_different_lengths_equals_each_alone(nz):
    lengths = [1, 5, 17, 64, 200]
    H, C, R, bs = 4, 64, 16, 16
    n_blocks = sum(-(-L // bs) for L in lengths)
    g = torch.Generator().manual_seed(12)
    c_all = torch.randn(sum(lengths), C, generator=g).bfloat16()
    cache = PagedLatentCache(n_blocks + 3, bs, C, R, fa_k=c_all.float().abs().max() / 127, nz=nz)
    ids = list(range(cache.num_blocks))
    random.Random(13).shuffle(ids)
    tables, seqs = [], []
    for L in lengths:
        tables.append([ids.pop() for _ in range(-(-L // bs))])
        c, pe = torch.randn(L, C, generator=g).bfloat16(), torch.randn(L, R, generator=g).bfloat16()
        cache.write(tables[-1], c, pe, 0)
        seqs.append((c, pe))
    q, qp = _queries(len(lengths), H, C, R, seed=14)
    batch = paged_decode_attention(q, qp, cache, tables, lengths, SCALE)
    for b, L in enumerate(lengths):
        alone = paged_decode_attention(q[b:b + 1], qp[b:b + 1], cache, [tables[b]], [L], SCALE)
        assert torch.equal(batch[b:b + 1], alone)
        ref = reference_attention(q[b:b + 1], qp[b:b + 1], _dequant(cache, seqs[b][0]), seqs[b][1].float(), SCALE)
        assert _rel(alone, ref) <= PAGED_RTOL


@pytest.mark.parametrize("start, S", [(21, 30), (0, 40), (35, 1)])
@pytest.mark.parametrize("int8", [True, False])
def test_prefill_chunk_equals_causal_reference(start, S, int8):
    H, C, R, bs = 4, 64, 16, 16                     # start 21 and 35: the chunk begins mid-block
    T = start + S
    c, pe = _latents(T, C, R, seed=15)
    fa_k = c.float().abs().max() / 127 if int8 else None
    cache = PagedLatentCache(8, bs, C, R, fa_k=fa_k)
    blocks = _fill(cache, c[:start], pe[:start], seed=16) if start else []
    ids = [b for b in range(8) if b not in blocks]
    blocks += ids[:-(-T // bs) - len(blocks)]
    cache.write(blocks, c[start:], pe[start:], start)            # the chunk itself, then its attention
    q, qp = _queries(S, H, C, R, seed=17)
    ref = reference_attention(q, qp, _dequant(cache, c), pe.float(), SCALE, start)
    for bps, tile_rows in ((1, 3 * H), (None, 2048), (2, H)):
        got = paged_prefill_attention(q, qp, cache, blocks, start, SCALE, bps, tile_rows)
        assert got.shape == (S, H, C) and _rel(got, ref) <= PAGED_RTOL, (bps, tile_rows)
    last = paged_decode_attention(q[-1:], qp[-1:], cache, [blocks], [T], SCALE)
    assert _rel(last, ref[-1:]) <= PAGED_RTOL


# ----- int8 against bf16 --------------------------------------------------------------------------------------
def _int8_and_bf16_o_lat(c: torch.Tensor, pe: torch.Tensor, q: torch.Tensor, qp: torch.Tensor, scale: float,
                         fa_k: torch.Tensor, bs: int = 16, nz: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill o_lat of every position of one sequence from an int8 cache and from a bf16 cache of ``c``."""
    T, C = c.shape
    outs = []
    for fk in (fa_k, None):
        cache = PagedLatentCache(-(-T // bs), bs, C, pe.shape[1], torch.bfloat16, fa_k=fk, nz=nz)
        blocks = _fill(cache, c.bfloat16(), pe, seed=18)
        outs.append(paged_prefill_attention(q, qp, cache, blocks, 0, scale))
    return outs[0], outs[1]


@pytest.mark.parametrize("q_std", sorted(SQNR_RANDOM_DB))
def test_int8_vs_bf16_sqnr_random_latent(q_std):
    H, C, R, T = 16, 512, 64, 1000
    worst = float("inf")
    for seed in range(3):
        c, pe = _latents(T, C, R, seed=seed, dtype=torch.float32)
        fa_k = c.abs().max() / 127
        q, qp = _queries(1, H, C, R, seed=100 + seed, q_std=q_std)
        caches = {}
        for name, fk in (("int8", fa_k), ("bf16", None)):
            caches[name] = PagedLatentCache(-(-T // 128), 128, C, R, torch.bfloat16, fa_k=fk, nz=True)
            blocks = _fill(caches[name], c.bfloat16(), pe.bfloat16(), seed=seed)
        o8, o16 = (paged_decode_attention(q, qp, caches[k], [blocks], [T], SCALE) for k in ("int8", "bf16"))
        ref = reference_attention(q, qp, c, pe.bfloat16().float(), SCALE)
        assert sqnr_db(o16, ref) >= SQNR_BF16_DB
        worst = min(worst, sqnr_db(o8, o16))
    assert worst >= SQNR_RANDOM_DB[q_std], worst


@pytest.fixture(scope="module")
def tiny_latents():
    """Per main layer of the tiny fixture's float32 model, on 2 x 48 real tokens: (mla, c [B, T, C],
    k_pe [B, T, d_r], q_nope, q_pe [B, T, H, .]) captured from a forward with a ModelCache."""
    from pipeline.model.loading import load_model
    from pipeline.model.cache import ModelCache
    from tiny import TINY_FIXTURE

    model = load_model(str(TINY_FIXTURE), dtype="float32", device="cpu", with_mtp=False)
    cfg = model.config
    g = torch.Generator().manual_seed(19)
    ids = torch.randint(2, cfg.vocab_size, (2, 48), generator=g)
    inputs, hooks = {}, []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda mod, args, i=layer.layer_id: inputs.__setitem__(i, args[:3])))
    cache = ModelCache(cfg, 2, 48, torch.float32, layer_ids=list(range(cfg.num_hidden_layers)))
    with torch.no_grad():
        model(ids, cache, absorb=True)
        for h in hooks:
            h.remove()
        out = {}
        for layer in model.model.layers:
            mla = layer.self_attn
            q_nope, q_pe = mla.query(*inputs[layer.layer_id])
            out[layer.layer_id] = (mla, cache[layer.layer_id].c.clone(), cache[layer.layer_id].pe.clone(),
                                   q_nope, q_pe)
    return cfg, out


def test_paged_equals_mla_absorbed_on_tiny_model(tiny_latents):
    cfg, layers = tiny_latents
    for i, (mla, c, pe, q_nope, q_pe) in layers.items():
        w_uk, w_uv = mla.absorbed_weights()
        ref = mla._absorbed(q_nope, q_pe, c, pe, 0)                                  # [B, T, H, d_v]
        for b in range(c.shape[0]):
            cache = PagedLatentCache(4, 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32)
            blocks = _fill(cache, c[b], pe[b], seed=b)
            q_abs = torch.einsum("shd,hdc->shc", q_nope[b], w_uk)
            o_lat = paged_prefill_attention(q_abs, q_pe[b], cache, blocks, 0, cfg.softmax_scale, 1)
            o = torch.einsum("shc,hdc->shd", o_lat, w_uv)
            assert (o - ref[b]).abs().max().item() <= MLA_ATOL, i


def test_int8_vs_bf16_sqnr_real_latents(tiny_latents):
    cfg, layers = tiny_latents
    for i, (mla, c, pe, q_nope, q_pe) in layers.items():
        w_uk, _ = mla.absorbed_weights()
        fa_k = c.abs().max() / 127                       # the real per-layer scale: max |c| / 127 over the batch
        o8s, o16s = [], []
        for b in range(c.shape[0]):
            q_abs = torch.einsum("shd,hdc->shc", q_nope[b], w_uk)
            o8, o16 = _int8_and_bf16_o_lat(c[b], pe[b].bfloat16(), q_abs, q_pe[b], cfg.softmax_scale, fa_k)
            o8s.append(o8)
            o16s.append(o16)
        db = sqnr_db(torch.stack(o8s), torch.stack(o16s))
        assert db >= SQNR_REAL_DB, (i, db)


@pytest.mark.parametrize("nz", [False, True])
@pytest.mark.parametrize("int8", [True, False])
def test_one_write_per_step_equals_writes_per_sequence(nz, int8):
    """write_slots (every token of a step, several sequences, one call) stores what write() stores per
    sequence, bit for bit, padding included."""
    C, R, bs = 48, 16, 16
    c, pe = _latents(40, C, R, seed=21)
    fa_k = c.float().abs().max() / 127 if int8 else None
    a = PagedLatentCache(6, bs, C, R, fa_k=fa_k, nz=nz)
    b = PagedLatentCache(6, bs, C, R, fa_k=fa_k, nz=nz)
    spans = [([4, 1], 13, 5), ([0], 0, 16), ([5, 3], 20, 1), ([2], 3, 12)]   # (blocks, start, n)
    slots, k = [], 0
    for blocks, start, n in spans:
        a.write(blocks, c[k:k + n], pe[k:k + n], start)
        slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        k += n
    b.write_slots(torch.tensor(slots), c[:k], pe[:k])
    assert torch.equal(a.c, b.c) and torch.equal(a.pe, b.pe)
    with pytest.raises(ValueError, match="write_slots: c .S, 48., k_pe .S, 16. and slots .S. expected"):
        b.write_slots(torch.tensor(slots[:-1]), c[:k], pe[:k])
