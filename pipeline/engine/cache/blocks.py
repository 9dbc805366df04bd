"""Paged KV cache bookkeeping (docs/serving.md, "The KV cache"): block ids and reference counts only.

The cache itself is ``[num_blocks, block_size, ...]`` per layer; a sequence's token ``p`` lives in slot
``(table.blocks[p // block_size], p % block_size)``. Blocks are reference counted so that several
sequences can share a prefix (``fork``). A shared block is never written: appending to a sequence whose
last, partially filled block is shared first moves that sequence onto a fresh block (copy-on-write), and
``append_tokens`` returns the ``(src, dst)`` pairs whose first ``offset`` slots the caller must copy.
Full blocks shared across requests by their contents (prefix caching): pipeline.engine.cache.prefix_cache.

What a token costs under a quantization recipe: ``kv_bytes_per_token``, beside the recipe.
"""

from __future__ import annotations

from typing import Iterable, Optional


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than a request needs; nothing was allocated."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_count(name: str, v: int, minimum: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")


class BlockAllocator:
    """``num_blocks`` block ids ``0..num_blocks-1`` with reference counts. ``allocate`` hands out a free
    block with count 1; ``incref``/``fork`` add a sharer; ``free`` removes one, and the block is free again
    when its count reaches 0."""

    def __init__(self, num_blocks: int):
        _check_count("num_blocks", num_blocks, 1)
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # a stack: block 0 is handed out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def total_refs(self) -> int:
        """Sum of all reference counts (= total number of block references held by the tables)."""
        return sum(self._refs)

    def _check_id(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block!r} is not a block of this allocator (ids 0..{self.num_blocks - 1})")

    def _check_allocated(self, block: int, what: str) -> None:
        self._check_id(block)
        if self._refs[block] == 0:
            raise ValueError(f"{what} of block {block}, which is not allocated (already free)")

    def allocate(self) -> int:
        """One free block, reference count 1. OutOfBlocks when none is free."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """``n`` free blocks, all or none (OutOfBlocks, state unchanged, when fewer than ``n`` are free)."""
        _check_count("allocate_many: n", n)
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} block(s), {self.num_free} of {self.num_blocks} free")
        out = [self._take_free() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def _take_free(self) -> int:
        """One free block out of the free set (a subclass may evict: pipeline.engine.cache.prefix_cache)."""
        return self._free.pop()

    def _put_free(self, block: int) -> None:
        """A block whose last reference went: back into the free set."""
        self._free.append(block)

    def incref(self, block: int) -> None:
        """One more sharer of an allocated block."""
        self._check_allocated(block, "incref")
        self._refs[block] += 1

    def fork(self, blocks: Iterable[int]) -> list[int]:
        """``incref`` every block (all checked first, so an error changes nothing); returns them as a list."""
        blocks = list(blocks)
        for b in blocks:
            self._check_allocated(b, "fork")
        for b in blocks:
            self._refs[b] += 1
        return blocks

    def free(self, block: int) -> None:
        """Drop one reference; the block is free again at 0. ValueError on an unknown or free block."""
        self._check_id(block)
        if self._refs[block] == 0:
            raise ValueError(f"double free of block {block} (its reference count is already 0)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._put_free(block)

    def free_all(self, blocks: Iterable[int]) -> None:
        """``free`` each of a sequence's blocks (in order here; the prefix-caching allocator frees the
        last first, pipeline.engine.cache.prefix_cache)."""
        for b in blocks:
            self.free(b)


class BlockTable:
    """One sequence's blocks: token ``p`` (0 <= p < num_tokens) is at ``(blocks[p // block_size],
    p % block_size)``. Invariant: ``len(blocks) == ceil(num_tokens / block_size)``."""

    def __init__(self, block_size: int, blocks: Optional[list[int]] = None, num_tokens: int = 0):
        _check_count("block_size", block_size, 1)
        _check_count("num_tokens", num_tokens)
        blocks = list(blocks or [])
        if len(blocks) != _ceil_div(num_tokens, block_size):
            raise ValueError(f"BlockTable: {num_tokens} tokens at block_size {block_size} need "
                             f"{_ceil_div(num_tokens, block_size)} block(s), got {len(blocks)}")
        self.block_size = block_size
        self.blocks = blocks
        self.num_tokens = num_tokens

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, num_tokens={self.num_tokens}, blocks={self.blocks})"

    def _needs_cow(self, n_new_tokens: int, allocator: Optional[BlockAllocator]) -> bool:
        """Would appending write into a partially filled last block that another sequence shares?"""
        return (allocator is not None and n_new_tokens > 0 and self.num_tokens % self.block_size != 0
                and allocator.refcount(self.blocks[-1]) > 1)

    def slots_needed(self, n_new_tokens: int, allocator: Optional[BlockAllocator] = None) -> int:
        """New blocks that appending ``n_new_tokens`` takes: ``ceil((T + n) / bs) - ceil(T / bs)``, plus 1
        for the copy-on-write of a shared partial last block when ``allocator`` is given."""
        _check_count("slots_needed: n_new_tokens", n_new_tokens)
        grow = _ceil_div(self.num_tokens + n_new_tokens, self.block_size) - len(self.blocks)
        return grow + int(self._needs_cow(n_new_tokens, allocator))

    def append_tokens(self, n: int, allocator: BlockAllocator) -> list[tuple[int, int]]:
        """Make room for ``n`` more tokens, all or nothing (OutOfBlocks leaves table and allocator
        unchanged). Returns copy-on-write pairs ``(src, dst)``: copy slots ``[0, num_tokens_before %
        block_size)`` of block ``src`` into ``dst`` before writing the new tokens (empty list usually)."""
        _check_count("append_tokens: n", n)
        cow = self._needs_cow(n, allocator)
        new = allocator.allocate_many(self.slots_needed(n, allocator))
        copies: list[tuple[int, int]] = []
        if cow:
            src, dst = self.blocks[-1], new.pop(0)
            self.blocks[-1] = dst
            allocator.free(src)            # still held by its other sharers
            copies.append((src, dst))
        self.blocks.extend(new)
        self.num_tokens += n
        return copies

    def slot(self, position: int) -> tuple[int, int]:
        """``(block id, offset)`` of token ``position``."""
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < self.num_tokens:
            raise IndexError(f"slot: position {position!r} is outside the sequence's {self.num_tokens} token(s)")
        return self.blocks[position // self.block_size], position % self.block_size

    def fork(self, allocator: BlockAllocator) -> "BlockTable":
        """A new table for a sequence sharing every block of this one (each gets one more reference)."""
        return BlockTable(self.block_size, allocator.fork(self.blocks), self.num_tokens)

    def truncate(self, num_tokens: int, allocator: BlockAllocator) -> None:
        """Keep only the first ``num_tokens`` slots (a rejected speculative token's slot is given back),
        freeing the blocks no longer needed."""
        _check_count("truncate: num_tokens", num_tokens)
        if num_tokens > self.num_tokens:
            raise ValueError(f"truncate: {num_tokens} tokens is more than the table's {self.num_tokens}")
        keep = _ceil_div(num_tokens, self.block_size)
        for b in self.blocks[keep:]:
            allocator.free(b)
        del self.blocks[keep:]
        self.num_tokens = num_tokens

    def release(self, allocator: BlockAllocator) -> None:
        """Drop this table's reference to each of its blocks; the table is left empty."""
        allocator.free_all(self.blocks)
        self.blocks = []
        self.num_tokens = 0
