"""pipeline.engine.native.cpu_attention: the C decode attention against the batched torch path and the
per-sequence reference (int8 and 16-bit / float32 latents, ND and NZ, ragged lengths, block sizes 16 and
128, the vectorized and the plain C code), the C cache write byte for byte against the torch code, the
fallbacks to torch, and the engine's greedy tokens with the native kernels against the torch ones."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.cbuild import NativeLibrary
from pipeline.engine.native import cpu_attention
from pipeline.engine.attention import backends
from pipeline.engine.attention.paged import paged_decode_attention
from pipeline.engine.attention.batched import DecodeBatch, batched_decode_attention
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine import config as engine_config
from pipeline.engine.cache.paged_cache import PagedLatentCache
from pipeline.engine.protocol import SamplingParams

SCALE = 0.1352338
# Native vs torch: the same float32 arithmetic summed in another order (tiles of 32 tokens, 16-lane dot
# products, FMA). Measured max |diff| <= 3.4e-7 of max |ref| (~1e-6 absolute) at these shapes.
RTOL = 1e-5        # of max |ref|
ATOL = 1e-6

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_native = pytest.mark.skipif(not engine_config.native_available() or cpu_attention.library() is None,
                                  reason=f"no native kernels here: {cpu_attention.status()}")


def _close(got, ref) -> None:
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item() + ATOL, err


def _setup(lengths, nz, int8, dtype=torch.bfloat16, C=64, R=16, H=4, bs=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    lat = [torch.randn(L, C, generator=g).to(dtype) for L in lengths]
    fa_k = max(x.float().abs().max() for x in lat) / 127 if int8 else None
    cache = PagedLatentCache(sum(-(-L // bs) for L in lengths) + 3, bs, C, R, dtype=dtype, fa_k=fa_k, nz=nz)
    ids = list(range(cache.num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for L, c in zip(lengths, lat):
        tables.append([ids.pop() for _ in range(-(-L // bs))])
        cache.write(tables[-1], c, torch.randn(L, R, generator=g).to(dtype), 0)
    q = torch.randn(len(lengths), H, C, generator=g) * 0.3
    qp = torch.randn(len(lengths), H, R, generator=g) * 0.3
    return cache, tables, q, qp


KINDS = [(False, True, torch.bfloat16), (True, True, torch.bfloat16), (False, False, torch.bfloat16),
         (True, False, torch.bfloat16), (True, False, torch.float16), (False, False, torch.float32)]


@needs_native
@pytest.mark.parametrize("nz,int8,dtype", KINDS)
@pytest.mark.parametrize("bs,lengths", [(16, [1, 5, 16, 17, 64, 200, 33]), (128, [1, 129, 300]), (16, [37])])
def test_native_equals_batched_and_per_sequence(nz, int8, dtype, bs, lengths):
    cache, tables, q, qp = _setup(lengths, nz, int8, dtype, bs=bs, C=72, R=24, H=5)  # padded columns, odd H
    batch = DecodeBatch.build(tables, lengths, bs, cache.num_blocks)
    got = cpu_attention.decode_attention(q, qp, cache, batch, SCALE)
    _close(got, batched_decode_attention(q, qp, cache, batch, SCALE))
    _close(got, paged_decode_attention(q, qp, cache, tables, lengths, SCALE))
    for tile in (1, 7, 64):
        _close(cpu_attention.decode_attention(q, qp, cache, batch, SCALE, tile=tile), got)


@needs_native
@pytest.mark.parametrize("nz,int8", [(True, True), (False, False)])
def test_a_head_does_not_depend_on_the_others(nz, int8):
    """Each head's output is the same bits whatever heads share the call (a tensor-parallel rank holds H/tp
    of them, and its logits must be the one-rank engine's bit for bit: tests/test_sharded.py)."""
    lengths = [1, 40, 77]
    cache, tables, q, qp = _setup(lengths, nz, int8, H=6)
    batch = DecodeBatch.build(tables, lengths, 16, cache.num_blocks)
    full = cpu_attention.decode_attention(q, qp, cache, batch, SCALE)
    for heads in (slice(0, 1), slice(0, 2), slice(2, 4), slice(1, 6), slice(5, 6)):
        part = cpu_attention.decode_attention(q[:, heads].contiguous(), qp[:, heads].contiguous(), cache, batch, SCALE)
        assert torch.equal(part, full[:, heads]), heads


def _absorbed_weights(H, dn, C, dv, seed=11):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, dn, C, generator=g) * 0.2, torch.randn(H, C, dv, generator=g) * 0.2)


@needs_native
@pytest.mark.parametrize("nz", [False, True])
def test_plain_c_without_avx512_agrees(monkeypatch, nz):
    """The fallback loops (built without -march=native: no AVX-512, fp16 by bit manipulation)."""
    plain = NativeLibrary(cpu_attention.CSRC / "mla_decode_cpu.c", cpu_attention._declare_attention,
                          ("-O2", "-shared", "-fPIC"), what="plain C decode attention")
    assert plain.library() is not None, plain.status()
    for int8, dtype in ((True, torch.bfloat16), (False, torch.float16)):
        cache, tables, q, qp = _setup([1, 40, 3], nz, int8, dtype, C=64, R=16, H=4)
        batch = DecodeBatch.build(tables, [1, 40, 3], 16, cache.num_blocks)
        ref = batched_decode_attention(q, qp, cache, batch, SCALE)
        w_uk, w_uv_t = _absorbed_weights(4, 8, 64, 24)
        q_nope = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(2))
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
        ref_o = torch.bmm(batched_decode_attention(q_abs, qp, cache, batch, SCALE).transpose(0, 1), w_uv_t).transpose(0, 1)
        monkeypatch.setattr(cpu_attention, "_ATTENTION", plain)
        got = cpu_attention.decode_attention(q, qp, cache, batch, SCALE)
        got_o = cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk, w_uv_t=w_uv_t)
        monkeypatch.undo()
        _close(got, ref)
        _close(got_o, ref_o)


@needs_native
@pytest.mark.parametrize("nz,int8,dtype", KINDS[:4])
def test_absorbed_call_equals_attention_between_the_bmms(nz, int8, dtype):
    """With W_UK / W_UV^T the C call takes q_nope and returns o: the torch path's q_nope @ W_UK, attention,
    o_lat @ W_UV^T (ModelRunner's reference form) within float32 rounding; a head's bits do not depend on
    the other heads of the call (a tensor-parallel rank's heads)."""
    lengths = [1, 5, 16, 17, 64, 200, 33]
    H, dn, C, dv = 5, 24, 72, 40
    cache, tables, _, qp = _setup(lengths, nz, int8, dtype, C=C, R=24, H=H)
    w_uk, w_uv_t = _absorbed_weights(H, dn, C, dv)
    q_nope = torch.randn(len(lengths), H, dn, generator=torch.Generator().manual_seed(4))
    batch = DecodeBatch.build(tables, lengths, 16, cache.num_blocks)
    q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
    ref = torch.bmm(batched_decode_attention(q_abs, qp, cache, batch, SCALE).transpose(0, 1), w_uv_t).transpose(0, 1)
    got = cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk, w_uv_t=w_uv_t)
    assert got.shape == (len(lengths), H, dv)
    _close(got, ref)
    for heads in (slice(0, 1), slice(1, 3), slice(4, 5)):
        part = cpu_attention.decode_attention(q_nope[:, heads].contiguous(), qp[:, heads].contiguous(), cache, batch,
                                              SCALE, w_uk=w_uk[heads], w_uv_t=w_uv_t[heads])
        assert torch.equal(part, got[:, heads]), heads


@needs_native
@pytest.mark.parametrize("nz,int8,dtype", KINDS[:2])
def test_bf16_absorbed_weights_give_their_float32_copies_bits(nz, int8, dtype):
    """W_UK / W_UV^T of bf16 values, passed as bf16 (what NativeAttention keeps: the kernel widens each value
    exactly and runs the same FMA chains) or as their float32 copies: the same bits."""
    lengths = [1, 17, 64, 200]
    H, dn, C, dv = 4, 24, 72, 40
    cache, tables, _, qp = _setup(lengths, nz, int8, dtype, C=C, R=24, H=H)
    w_uk, w_uv_t = (w.bfloat16() for w in _absorbed_weights(H, dn, C, dv))
    q_nope = torch.randn(len(lengths), H, dn, generator=torch.Generator().manual_seed(6))
    batch = DecodeBatch.build(tables, lengths, 16, cache.num_blocks)
    wide = cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk.float(), w_uv_t=w_uv_t.float())
    assert torch.equal(cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk, w_uv_t=w_uv_t), wide)


@needs_native
def test_the_backend_keeps_bf16_forms_and_kv_b_projs_bits():
    """NativeAttention with C decode and prefill: a float32 kv_b_proj of bf16 values gives bf16 absorbed
    forms equal to its values, and the prefill's pack is the C float linear's own bits (no second copy),
    the same bits mha.native_weights packs."""
    from types import SimpleNamespace

    from torch import nn

    from pipeline.engine.attention import mha_prefill as mha
    from pipeline.engine.attention.backends import NativeAttention
    from pipeline.engine.native.cpu_float import NativeLinear

    H, dn, dv, C = 4, 16, 8, 32
    lin = nn.Linear(C, H * (dn + dv), bias=False)
    lin.weight.data = torch.randn(H * (dn + dv), C, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    kv_b = NativeLinear(lin)
    assert kv_b.compact()
    w = kv_b.weight.view(H, dn + dv, C)
    attn = SimpleNamespace(kv_b_proj=kv_b, absorbed_weights=lambda: (w[:, :dn], w[:, dn:]))
    backend = NativeAttention()
    if backend._prefill_libs[0] is None:
        pytest.skip("no vectorized MHA prefill library here: the torch prefill keeps the float32 forms")
    got = backend.weights(attn)
    assert got.w_pack is kv_b.packed() and got.w_kv is None
    assert torch.equal(got.w_pack, mha.native_weights(mha.kv_weights(w[:, :dn].float(), w[:, dn:].transpose(1, 2))))
    assert got.w_uk.dtype == got.w_uv_t.dtype == torch.bfloat16
    assert torch.equal(got.w_uk.float(), w[:, :dn]) and torch.equal(got.w_uv_t.float(), w[:, dn:].transpose(1, 2))


@needs_native
def test_absorbed_call_refuses_mismatched_weights():
    cache, tables, _, qp = _setup([20, 3], nz=False, int8=True)
    batch = DecodeBatch.build(tables, [20, 3], 16, cache.num_blocks)
    w_uk, w_uv_t = _absorbed_weights(4, 8, 64, 16)
    q_nope = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="go together"):
        cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk)
    with pytest.raises(ValueError, match="w_uk"):
        cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk[:, :4], w_uv_t=w_uv_t)
    with pytest.raises(ValueError, match="w_uk"):
        cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk.double(), w_uv_t=w_uv_t)
    with pytest.raises(ValueError, match="q_nope"):
        cpu_attention.decode_attention(q_nope, qp[:1], cache, batch, SCALE, w_uk=w_uk, w_uv_t=w_uv_t)


@needs_native
def test_bad_input_is_refused():
    cache, tables, q, qp = _setup([20, 3], nz=False, int8=True)
    batch = DecodeBatch.build(tables, [20, 3], 16, cache.num_blocks)
    with pytest.raises(ValueError, match="q_abs"):
        cpu_attention.decode_attention(q[:, :, :10], qp, cache, batch, SCALE)
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.decode_attention(q.double(), qp, cache, batch, SCALE)
    too_long = DecodeBatch(batch.table, torch.tensor([20, 40]), 40, 20)       # 40 tokens on 2 blocks of 16
    with pytest.raises(ValueError, match="length outside"):
        cpu_attention.decode_attention(q, qp, cache, too_long, SCALE)
    bad_block = DecodeBatch(torch.full_like(batch.table, cache.num_blocks), batch.lengths, 20, 3)
    with pytest.raises(ValueError, match="block id outside"):
        cpu_attention.decode_attention(q, qp, cache, bad_block, SCALE)


def _write_both(monkeypatch, nz, int8, dtype, bs, in_dtype, n=23, C=72, R=24, seed=5):
    """The same write_slots through the torch code and through the C kernel: the two caches."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, C, generator=g) * 3
    fa_k = 0.0625 if int8 else None                              # a power of 2: k + 1/2 exact below
    c[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, 2.5, -0.5, 3.5, 127.5]) * 0.0625
    c[1, :4] = torch.tensor([-1e-30, 0.5, -2.5, 126.5]) * 0.0625   # NaN, clamping, ties to even
    c = c.to(in_dtype)
    pe = (torch.randn(n, R, generator=g)).to(in_dtype)
    slots = torch.randperm(10 * bs, generator=g)[:n]
    caches = []
    for kernels in ("torch", "native"):
        cache = PagedLatentCache(10, bs, C, R, dtype=dtype, fa_k=fa_k, nz=nz)
        cache.c.fill_(7)                        # stale bytes: an NZ row's padding columns must become zero
        cache.pe.fill_(7)
        for rows in (slice(None), slice(3, 6)):  # then overwrite a few
            s = slots if rows == slice(None) else slots[-3:]
            if kernels == "native":
                assert cpu_attention.write_slots(cache, s, c[rows], pe[rows])   # the C kernel itself
            else:
                cache.write_slots(s, c[rows], pe[rows])
        caches.append(cache)
    return caches


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@needs_native
@pytest.mark.parametrize("nz,int8,dtype", KINDS)
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_cache_write_is_bit_identical(monkeypatch, nz, int8, dtype, bs, in_dtype):
    assert cpu_attention.write_library() is not None, cpu_attention.status()
    ref, got = _write_both(monkeypatch, nz, int8, dtype, bs, in_dtype)
    assert _same_bytes(got.c, ref.c) and _same_bytes(got.pe, ref.pe)
    assert ref.c.view(torch.uint8).count_nonzero() > 100    # the rows landed


def test_torch_fallbacks(monkeypatch):
    """DSQUANT_KERNELS=torch: an engine built then writes and attends with torch ops; DSQUANT_NATIVE=0: no
    library, backend torch."""
    monkeypatch.setenv(engine_config.ENV, "torch")
    k = engine_config.resolve("cpu")
    assert (k.backend, k.attention, k.cache_write, k.linears, k.float_ops) == ("torch", False, False, False, False)
    monkeypatch.delenv(engine_config.ENV)
    monkeypatch.setenv("DSQUANT_NATIVE", "0")
    cpu_attention.reset()
    try:
        assert cpu_attention.library() is None and cpu_attention.write_library() is None
        assert "DSQUANT_NATIVE=0" in cpu_attention.status() and engine_config.backend("cpu") == engine_config.TORCH
        assert not engine_config.resolve("cpu").cache_write
        cache = PagedLatentCache(4, 16, 64, 16, fa_k=0.1, nz=True)
        cache.write_slots(torch.tensor([3]), torch.ones(1, 64), torch.ones(1, 16))
        assert cache.c[0, :, 3].float().sum() == 64 * 10
    finally:
        monkeypatch.delenv("DSQUANT_NATIVE")
        cpu_attention.reset()


QUESTIONS = ["What's deep learning?", "Explain list comprehensions.", "What is a decorator?"]


def _generate(qdir, tok, monkeypatch, kernels, nz, decode_graph=False):
    """Greedy tokens of the embedded model with ``kernels``, and how many decode calls took each path (of
    the eager steps: a replayed decode step, ``decode_graph``, binds the C call once)."""
    monkeypatch.setenv(engine_config.ENV, kernels)
    # the engine serves with the C call only where its loops are vectorized (AVX-512); here it runs the C
    # call whatever this machine's build, so that its tokens are checked on every CPU
    monkeypatch.setattr(cpu_attention, "serving_library", cpu_attention.library)
    calls = {"torch": 0, "native": 0}
    for mod, name, key in ((backends, "batched_decode_attention", "torch"),
                           (cpu_attention, "decode_attention", "native")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    eng = LLMEngine.from_dir(qdir, tokenizer=tok, num_blocks=64, block_size=16, nz=nz, decode_graph=decode_graph)
    assert eng.runner.kernels == kernels
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    out = eng.generate(prompts, SamplingParams(max_new_tokens=16))
    monkeypatch.undo()
    return out, calls


@needs_native
@pytest.mark.parametrize("nz", [False, True])
def test_engine_gives_the_same_greedy_tokens(qdir, tok, monkeypatch, nz):
    ref, ref_calls = _generate(qdir, tok, monkeypatch, "torch", nz)
    got, calls = _generate(qdir, tok, monkeypatch, "native", nz)
    assert ref_calls["native"] == 0 and ref_calls["torch"] > 0
    assert calls["torch"] == 0 and calls["native"] == ref_calls["torch"]
    assert got == ref
    replayed, calls = _generate(qdir, tok, monkeypatch, "native", nz, decode_graph=True)
    assert replayed == ref and calls == {"torch": 0, "native": 0}       # every decode step replayed
