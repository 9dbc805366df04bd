"""Prefill in the non-absorbed (MHA) form (pipeline/engine/attention/mha_prefill.py) against the absorbed reference
(attention.paged_prefill_attention times W_UV^T): ND and NZ, int8 and bf16 latents, a whole prompt and a
chunk after cached tokens, the torch ops (scores held whole, torch's flash kernel) and the C call (the AMX
tiles where the CPU has them, the FMA loops, and the plain C loops of a build without -march); and the
engine's logits with either form."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.attention.paged import paged_prefill_attention
from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import make_runner
from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.attention.mha_prefill import mha_prefill_attention
from pipeline.engine.worker.runner import Span

SCALE = 0.1352338
# The two forms are the same sums reassociated, in float32: measured max |diff| / max |ref| 5.6e-7 here.
FORM_RTOL = 2e-5
# Engine logits (|logits| up to ~20) with the MHA prefill vs the absorbed one: measured max |diff| ~1e-5.
LOGITS_ATOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")
_PLAIN: list = []


def _plain_library():
    from pipeline.cbuild import BASE_FLAGS, NativeLibrary
    from pipeline.engine.attention import mha_prefill

    if not _PLAIN:
        _PLAIN.append(NativeLibrary(mha_prefill._LIB.source, mha_prefill._declare,
                                    tuple(f for f in BASE_FLAGS if not f.startswith("-march=")), what="plain C"))
    assert _PLAIN[0].library() is not None and _PLAIN[0].library().mha_prefill_has_bf16_dot() == 0
    return _PLAIN[0]


@pytest.mark.parametrize("nz", [False, True])
@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("start, S", [(0, 40), (21, 30), (50, 2)])
@pytest.mark.parametrize("scores", ["whole", "flash", "native-amx", "native-fma", "native-plain"])
def test_mha_form_equals_the_absorbed_form(nz, int8, start, S, scores, monkeypatch):
    """Every way of attending: the scores held whole, torch's flash kernel past WHOLE_SCORES_MAX, the C call
    (its decompression product on bf16 dot products -- the AMX tiles, or AVX512-BF16 without AMX -- or in
    FMA loops; the weights rounded to bf16 values, as a checkpoint's are)."""
    from pipeline.engine.attention import mha_prefill
    from pipeline.engine.cache.paged_cache import PagedLatentCache

    if scores == "flash":
        monkeypatch.setattr(mha_prefill, "WHOLE_SCORES_MAX", 0)
    if scores.startswith("native") and mha_prefill.library() is None:
        pytest.skip("no C compiler: the torch forms only")
    if scores == "native-plain":          # the same source built for any CPU (no -march: the plain C loops)
        monkeypatch.setattr(mha_prefill, "_LIB", _plain_library())

    g = torch.Generator().manual_seed(start + S)
    H, d_n, d_v, C, R, bs = 4, 32, 32, 64, 16, 16
    T = start + S
    lat = torch.randn(T, C, generator=g).bfloat16()
    cache = PagedLatentCache(8, bs, C, R, fa_k=lat.float().abs().max() / 127 if int8 else None, nz=nz)
    blocks = [5, 2, 7, 0, 3][: -(-T // bs)]
    cache.write(blocks, lat, torch.randn(T, R, generator=g).bfloat16(), 0)
    w_uk, w_uv = torch.randn(H, d_n, C, generator=g) * 0.1, torch.randn(H, d_v, C, generator=g) * 0.1
    w_uk, w_uv = w_uk.bfloat16().float(), w_uv.bfloat16().float()
    w_uv_t = w_uv.transpose(1, 2).contiguous()
    q_nope, q_pe = torch.randn(S, H, d_n, generator=g), torch.randn(S, H, R, generator=g) * 0.3
    q_abs = torch.einsum("shd,hdc->shc", q_nope, w_uk)
    ref = torch.bmm(paged_prefill_attention(q_abs, q_pe, cache, blocks, start, SCALE).transpose(0, 1),
                    w_uv_t).transpose(0, 1)
    if scores.startswith("native"):
        w_pack = mha_prefill.native_weights(mha_prefill.kv_weights(w_uk, w_uv_t))
        got = mha_prefill.native_prefill_attention(q_nope, q_pe, cache, blocks, start, w_pack, d_v, SCALE,
                                                   amx=scores == "native-amx")
    else:
        got = mha_prefill_attention(q_nope, q_pe, cache, blocks, start, w_uk, w_uv_t, SCALE)
    assert got.shape == (S, H, d_v)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= FORM_RTOL


@pytest.mark.parametrize("kind, nz", [("int8", False), ("int8", True), ("bf16", False), ("bf16", True),
                                      ("float32", False)])          # (NZ has no float32 form)
def test_one_call_for_every_chunk_equals_a_call_per_chunk(kind, nz):
    """mha_prefill.native_prefill_chunks (the runner's: every chunk of a layer's step in one C call that
    reads the cache blocks itself) gives each chunk's rows the bits of native_prefill_attention on that
    chunk alone (torch's float32 copy of the blocks), for chunks of several sequences at several starts;
    rows of no chunk are left as they were; a block outside the cache is refused before anything runs."""
    from pipeline.engine.attention import mha_prefill
    from pipeline.engine.cache.paged_cache import PagedLatentCache

    if mha_prefill.library() is None:
        pytest.skip("no C compiler: the torch forms only")
    g = torch.Generator().manual_seed(11)
    H, d_n, d_v, C, R, bs = 4, 32, 32, 64, 16, 16
    dtype = {"int8": None, "bf16": torch.bfloat16, "float32": torch.float32}[kind]
    cache = PagedLatentCache(16, bs, C, R, dtype=dtype or torch.bfloat16,
                             fa_k=torch.tensor(0.03) if kind == "int8" else None, nz=nz)
    seqs = [([5, 2, 7], 0, 40), ([9, 1], 21, 9), ([12, 3, 4, 0], 50, 2), ([6], 0, 16)]   # blocks, start, S
    for blocks, start, S in seqs:
        T = start + S
        cache.write(blocks, torch.randn(T, C, generator=g).bfloat16(), torch.randn(T, R, generator=g).bfloat16(), 0)
    w_uk, w_uv = (torch.randn(H, d_n, C, generator=g) * 0.1).bfloat16().float(), \
        (torch.randn(H, d_v, C, generator=g) * 0.1).bfloat16().float()
    w_pack = mha_prefill.native_weights(mha_prefill.kv_weights(w_uk, w_uv.transpose(1, 2).contiguous()))
    N = sum(S for _, _, S in seqs) + 3                      # 3 rows that belong to no chunk (decode rows)
    q_nope, q_pe = torch.randn(N, H, d_n, generator=g), torch.randn(N, H, R, generator=g) * 0.3
    chunks, a = [], 3
    for blocks, start, S in seqs:
        chunks.append((blocks, start, a, a + S))
        a += S
    out = torch.full((N, H, d_v), 7.0)
    mha_prefill.native_prefill_chunks(q_nope, q_pe, cache, chunks, w_pack, d_v, SCALE, out)
    assert torch.equal(out[:3], torch.full((3, H, d_v), 7.0))
    for blocks, start, a, b in chunks:
        one = mha_prefill.native_prefill_attention(q_nope[a:b], q_pe[a:b], cache, blocks, start, w_pack, d_v, SCALE)
        assert torch.equal(out[a:b], one), (blocks, start)
    before = out.clone()
    with pytest.raises(ValueError, match="a block outside the cache's 16"):
        mha_prefill.native_prefill_chunks(q_nope, q_pe, cache, chunks[:1] + [([99], 0, 3, 5)], w_pack, d_v, SCALE, out)
    with pytest.raises(ValueError, match="does not fit its blocks"):
        mha_prefill.native_prefill_chunks(q_nope, q_pe, cache, [([1], 10, 3, 13)], w_pack, d_v, SCALE, out)
    assert torch.equal(out, before)


def test_engine_logits_with_either_form(embedded_quantized, tok):
    lm = load_quantized(embedded_quantized)
    cfg = EngineConfig(num_blocks=32, block_size=16, nz=True)
    ids = [tok.encode(p) for p in ("What's deep learning?", "The os module provides", "def main():")]
    outs = []
    for mha in (True, False):
        runner = make_runner(lm, cfg, mha_prefill=mha)
        tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(ids))]
        rows = [sum(map(len, ids[:i + 1])) - 1 for i in range(len(ids))]
        whole, _ = runner.forward([Span(p, 0, t) for p, t in zip(ids, tables)], rows)
        chunk, _ = runner.forward([Span(p[3:], 3, t) for p, t in zip(ids, tables)],     # a chunk after 3 cached
                                  [sum(len(p) - 3 for p in ids[:i + 1]) - 1 for i in range(len(ids))])
        outs.append((whole, chunk))
    for a, b in zip(*outs):
        assert (a - b).abs().max().item() <= LOGITS_ATOL
