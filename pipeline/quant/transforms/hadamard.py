"""Random Hadamard rotations for QuaRot (docs/quarot.md), and applying them to weights.

A random Hadamard block of order b (a power of two) is ``diag(s) @ H_b / sqrt(b)``: H_b the Sylvester
Hadamard matrix (``H[i, j] = (-1) ** popcount(i & j)``, symmetric) with its rows signed by ``s``. The signs
are msModelSlim's draw, reproduced bit for bit: torch's CPU generator seeded with 1234, then
``randint(0, 2, (b,))`` mapped to ``2 * bit - 1``; every rotation re-seeds, so all rotations built with the
same block size share one block. All matrices are float32.

A :class:`Rotation` is block-diagonal: a sequence of pieces (a square block repeated along the diagonal, or
an identity) tiled ``repeat`` times. Applied to a weight ``W`` [out, in]:

    input side   W' = W @ M          (the linear reads x @ M: for a stream that was rotated by M)
    output side  W' = M^T @ W        (the linear now writes y @ M)

Two ways to compute either, same formula: ``reference`` multiplies by the full matrix in float32 (one
``torch.matmul``, as msModelSlim does), the default multiplies block by block (b / dim of the work).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from pipeline.quant.numerics.qparams import QuantError

log = logging.getLogger(__name__)

SEED = 1234          # msModelSlim's seed for every rotation
SHIFT = 16           # the column shift of the shifted block-Hadamard (fixed, whatever the block size)
FULL = -1            # block_size meaning "one block over the whole dimension"


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def sylvester(n: int) -> Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two), float32 entries +-1."""
    if not is_power_of_two(n):
        raise QuantError(f"Hadamard order {n} is not a power of two")
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float32)


def random_signs(n: int, seed: int = SEED) -> Tensor:
    """n float32 signs +-1: torch's CPU generator seeded with ``seed``, one ``randint(0, 2)`` per sign."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float32) * 2 - 1


def random_hadamard(n: int, seed: int = SEED) -> Tensor:
    """The orthogonal float32 [n, n] ``diag(random_signs(n)) @ sylvester(n) / sqrt(n)``."""
    signed = random_signs(n, seed)[:, None] * sylvester(n)
    return signed / torch.tensor(float(n), dtype=torch.float32).sqrt()


# ----- rotations ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """``size`` consecutive channels: rotated by ``block`` ([b, b] float32, repeated size / b times along
    the diagonal), or left alone (``block`` None)."""

    size: int
    block: Optional[Tensor] = None

    def matrix(self) -> Tensor:
        if self.block is None:
            return torch.eye(self.size, dtype=torch.float32)
        return torch.block_diag(*[self.block] * (self.size // self.block.shape[0]))


@dataclass(frozen=True)
class Rotation:
    """An orthogonal block-diagonal float32 matrix: ``pieces`` in order, the sequence tiled ``repeat``
    times (e.g. per attention head)."""

    pieces: tuple[Piece, ...]
    repeat: int = 1

    @property
    def dim(self) -> int:
        return self.repeat * sum(p.size for p in self.pieces)

    def matrix(self) -> Tensor:
        """The full float32 [dim, dim] matrix."""
        period = torch.block_diag(*[p.matrix() for p in self.pieces])
        return torch.block_diag(*[period] * self.repeat) if self.repeat > 1 else period

    def tiled(self, n: int) -> "Rotation":
        """This rotation repeated ``n`` times along the diagonal."""
        return Rotation(self.pieces, self.repeat * n)

    def input_side(self, w: Tensor, reference: bool = False) -> Tensor:
        """float32 ``w @ M`` for ``w`` [out, dim] (any float dtype; computed in float32)."""
        w = w.to(torch.float32)
        if w.shape[-1] != self.dim:
            raise QuantError(f"rotation of size {self.dim} cannot multiply {list(w.shape)} on its input side")
        if reference:
            return torch.matmul(w, self.matrix())
        n = w.shape[0]
        view = w.reshape(n, self.repeat, -1)
        out = torch.empty_like(view)
        at = 0
        for p in self.pieces:
            seg = view[:, :, at:at + p.size]
            if p.block is None:
                out[:, :, at:at + p.size] = seg
            else:
                b = p.block.shape[0]
                out[:, :, at:at + p.size] = torch.matmul(seg.reshape(n, self.repeat, p.size // b, b),
                                                         p.block).reshape(seg.shape)
            at += p.size
        return out.reshape(w.shape)

    def output_side(self, w: Tensor, reference: bool = False) -> Tensor:
        """float32 ``M^T @ w`` for ``w`` [dim, in] (any float dtype; computed in float32)."""
        w = w.to(torch.float32)
        if w.shape[0] != self.dim:
            raise QuantError(f"rotation of size {self.dim} cannot multiply {list(w.shape)} on its output side")
        if reference:
            return torch.matmul(self.matrix().T, w)
        k = w.shape[1]
        view = w.reshape(self.repeat, -1, k)
        out = torch.empty_like(view)
        at = 0
        for p in self.pieces:
            seg = view[:, at:at + p.size]
            if p.block is None:
                out[:, at:at + p.size] = seg
            else:
                b = p.block.shape[0]
                out[:, at:at + p.size] = torch.matmul(p.block.T, seg.reshape(self.repeat, p.size // b, b, k)
                                                      ).reshape(seg.shape)
            at += p.size
        return out.reshape(w.shape)


def identity(size: int) -> Piece:
    return Piece(size)


def check_block_size(block_size: int) -> None:
    """QuantError unless ``block_size`` is -1 or a positive power of two (msModelSlim's rule)."""
    if block_size != FULL and not is_power_of_two(block_size):
        raise QuantError(f"quarot block_size must be -1 or a positive power of two, got {block_size}")


def block_size_for(dim: int, block_size: int, what: str, shrink: bool = False) -> int:
    """The block size used on a rotated dimension ``dim`` (named ``what`` in errors).

    ``block_size`` is -1 (one block over the whole dimension, which must then be a power of two) or a power
    of two dividing ``dim``. When it does not divide ``dim``: a QuantError, or with ``shrink`` the largest
    power of two below it that does (logged). msModelSlim itself fails there with an AttributeError."""
    check_block_size(block_size)
    if block_size == FULL:
        if not is_power_of_two(dim):
            raise QuantError(f"quarot block_size -1 needs a Hadamard matrix of order {what} {dim}, which is "
                             f"not a power of two; give a power-of-two block_size dividing {dim}")
        return dim
    if dim % block_size == 0:
        return block_size
    if not shrink:
        raise QuantError(f"quarot block_size {block_size} does not divide {what} {dim}")
    b = math.gcd(dim, block_size)  # a power of two: the largest one dividing both
    log.warning("quarot: block_size %d does not divide %s %d; using block size %d there", block_size, what, dim, b)
    return b


def block_hadamard(dim: int, block_size: int, what: str, shrink: bool = False, seed: int = SEED) -> Rotation:
    """The block-diagonal random Hadamard on ``dim`` channels (see :func:`block_size_for`)."""
    b = block_size_for(dim, block_size, what, shrink)
    return Rotation((Piece(dim, random_hadamard(b, seed)),))


def shifted_block_hadamard(dim: int, block_size: int, what: str, shrink: bool = False,
                           seed: int = SEED, shift: int = SHIFT) -> Rotation:
    """msModelSlim's "shifted" block-Hadamard on ``dim`` channels: ``R @ P @ R``, R the block-diagonal random
    Hadamard (block_size -1 means 32 here, as in msModelSlim) and P the identity with its columns rolled
    right by ``shift`` (16). Dense: the shift mixes neighbouring blocks. Computed in float32 as written."""
    b = block_size_for(dim, 32 if block_size == FULL else block_size, what, shrink)
    r = block_hadamard(dim, b, what, seed=seed).matrix()
    eye = torch.eye(dim, dtype=torch.float32)
    p = torch.cat((eye[:, -shift:], eye[:, :-shift]), dim=1)
    return Rotation((Piece(dim, r @ p @ r),))
