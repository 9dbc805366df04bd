"""pipeline.engine.cache.nz: the FRACTAL_NZ layout of docs/serving.md, exact both ways."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.cache.nz import c0_of, nd_to_nz, nz_rows, nz_shape, nz_to_nd

DTYPES = [torch.int8, torch.uint8, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (1, 16), (16, 16), (16, 32), (15, 31), (17, 33), (5, 576), (64, 512), (128, 512),
          (128, 64), (3, 64), (33, 17), (129, 513)]


def _rand(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int8, torch.uint8):
        lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
        x = torch.randint(lo, hi, shape, generator=g, dtype=torch.int16).to(dtype)
        x[x == 0] = 1   # no zeros in the data, so padding can be told apart
        return x
    x = torch.randn(shape, generator=g).to(dtype)
    x[x == 0] = 1
    return x


def _reference_nz(x: torch.Tensor) -> torch.Tensor:
    """Brute force: X[i, j] -> NZ[j // c0, i, j % c0], one element at a time."""
    r, c = x.shape
    c0 = {torch.int8: 32, torch.uint8: 32, torch.bfloat16: 16, torch.float16: 16}[x.dtype]
    out = torch.zeros((c + c0 - 1) // c0, (r + 15) // 16 * 16, c0, dtype=x.dtype)
    for i in range(r):
        for j in range(c):
            out[j // c0, i, j % c0] = x[i, j]
    return out


def test_c0_and_spec_shapes():
    assert c0_of(torch.int8) == 32 and c0_of(torch.uint8) == 32
    assert c0_of(torch.bfloat16) == 16 and c0_of(torch.float16) == 16
    # serving.md: the int8 latent of a 128-token block, and its bf16 k_pe.
    assert nz_shape(128, 512, torch.int8) == (16, 128, 32)
    assert nz_shape(128, 64, torch.bfloat16) == (4, 128, 16)
    assert nd_to_nz(_rand((128, 512), torch.int8)).shape == (16, 128, 32)
    assert nd_to_nz(_rand((128, 64), torch.bfloat16)).shape == (4, 128, 16)
    assert nz_shape(17, 33, torch.int8) == (2, 32, 32)
    assert nz_shape(17, 33, torch.float16) == (3, 32, 16)
    assert nz_shape(1, 1, torch.bfloat16) == (1, 16, 16)
    assert nz_shape(5, 576, torch.bfloat16) == (36, 16, 16)
    assert nz_shape(0, 0, torch.int8) == (0, 0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip(dtype, shape):
    x = _rand(shape, dtype, seed=shape[0] * 1000 + shape[1])
    nz = nd_to_nz(x)
    assert nz.shape == nz_shape(*shape, dtype) and nz.dtype == dtype and nz.is_contiguous()
    back = nz_to_nd(nz, *shape)
    assert back.shape == x.shape and back.dtype == dtype
    assert torch.equal(back, x)
    # Exactly the non-padding elements hold data: every one of x's (non-zero) values, and zeros elsewhere.
    assert int((nz != 0).sum()) == x.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (16, 32), (17, 33), (20, 70), (31, 16), (5, 48)])
def test_index_mapping_matches_brute_force(dtype, shape):
    x = _rand(shape, dtype, seed=7)
    assert torch.equal(nd_to_nz(x), _reference_nz(x))


def test_explicit_elements_and_padding():
    x = (torch.arange(17 * 33).view(17, 33) % 200 + 1).to(torch.bfloat16)  # exact in bf16, no zeros
    nz = nd_to_nz(x)
    assert nz.shape == (3, 32, 16)
    assert nz[0, 0, 0] == x[0, 0] and nz[0, 16, 15] == x[16, 15]
    assert nz[1, 3, 0] == x[3, 16] and nz[2, 16, 0] == x[16, 32]
    assert torch.all(nz[:, 17:, :] == 0)        # padded rows
    assert torch.all(nz[2, :, 1:] == 0)          # padded columns 33..47
    assert torch.all(nz[2, :17, 0] == x[:, 32])


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_batched_leading_dims(dtype):
    num_blocks, block_size, cols = 5, 24, 70
    cache = _rand((num_blocks, block_size, cols), dtype, seed=3)
    nz = nd_to_nz(cache)
    c1, rp, c0 = nz_shape(block_size, cols, dtype)
    assert nz.shape == (num_blocks, c1, rp, c0)
    for b in range(num_blocks):
        assert torch.equal(nz[b], nd_to_nz(cache[b]))
    assert torch.equal(nz_to_nd(nz, block_size, cols), cache)
    two = _rand((2, 3, 17, 33), dtype, seed=4)
    assert torch.equal(nz_to_nd(nd_to_nz(two), 17, 33), two)
    assert nd_to_nz(two).shape == (2, 3) + nz_shape(17, 33, dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_nz_rows_equals_nd_slice(dtype):
    rows, cols = 37, 100
    x = _rand((rows, cols), dtype, seed=5)
    nz = nd_to_nz(x)
    for t0, t1 in [(0, 0), (0, 1), (0, rows), (5, 21), (16, 32), (15, 17), (36, 37), (rows, rows)]:
        got = nz_rows(nz, t0, t1, cols)
        assert got.shape == (t1 - t0, cols)
        assert torch.equal(got, x[t0:t1])
    # batched: one block's tokens of a paged cache
    cache = _rand((4, 64, 576), dtype, seed=6)
    nzc = nd_to_nz(cache)
    assert torch.equal(nz_rows(nzc[2], 10, 50, 576), cache[2, 10:50])
    assert torch.equal(nz_rows(nzc, 10, 50, 576), cache[:, 10:50])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="float32"):
        nd_to_nz(torch.zeros(4, 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="float32"):
        c0_of(torch.float32)
    with pytest.raises(ValueError, match="int32"):
        nz_shape(4, 4, torch.int32)
    with pytest.raises(ValueError, match="bool"):
        nd_to_nz(torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dims"):
        nd_to_nz(torch.zeros(4, dtype=torch.int8))
    nz = nd_to_nz(torch.ones(17, 33, dtype=torch.int8))
    with pytest.raises(ValueError, match="does not hold a 17x70"):
        nz_to_nd(nz, 17, 70)
    with pytest.raises(ValueError, match="does not hold a 40x33"):
        nz_to_nd(nz, 40, 33)
    with pytest.raises(ValueError, match=r"\[30, 40\)"):
        nz_rows(nz, 30, 40, 33)
    with pytest.raises(ValueError, match="cols=100"):
        nz_rows(nz, 0, 4, 100)
    with pytest.raises(ValueError, match="c0=16"):
        nz_to_nd(torch.zeros(2, 32, 32, dtype=torch.bfloat16), 17, 20)
