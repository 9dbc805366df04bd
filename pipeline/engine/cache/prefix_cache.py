"""Prefix caching: full cache blocks addressed by a hash of their contents and reused across requests
(what vLLM calls automatic prefix caching), on by default (``EngineConfig.prefix_caching``).

Keys. Block ``b`` of a sequence holds its tokens ``b * bs .. (b + 1) * bs - 1``; its key is
:func:`block_key` ``(key of block b - 1, those token ids)``, a 128-bit BLAKE2b digest: chained, so a key
stands for the whole prefix up to the block's end, and a block only matches behind its own prefix.
Keys name contents, not block ids: two requests that computed the same prefix get the same keys. With
``lookahead=1`` (the engine's MTP layer on: its cache entry at position ``p`` is computed from the token
at ``p + 1``, so a block's MTP entries depend on the token after the block) the key also covers the
first token after the block, so a block only matches a sequence that continues it with that token.

The allocator. :class:`PrefixCachingAllocator` is a :class:`~pipeline.engine.cache.blocks.BlockAllocator`
that can ``register`` a key on a block in use. A registered block whose last reference goes does not
lose its contents: it joins an LRU of evictable blocks and can still be found by ``lookup`` and taken
again by ``acquire``. It still counts as free (``num_free``): ``allocate`` takes never-cached free blocks
first, then evicts the least recently freed cached block, forgetting its key. A block in use is never
evicted. A table's blocks are freed last block first (``free_all``), so a sequence's tail is evicted
before the head that other prompts are likelier to share.

Which blocks are registered, when, and how a request takes them: pipeline.engine.core.scheduler.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from pipeline.engine.cache.blocks import BlockAllocator

#: The key of the block before a sequence's first block.
ROOT = b""
KEY_BYTES = 16


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a block whose previous block has key ``parent`` (``ROOT`` for the first block) and whose
    contents are ``token_ids`` (the block's tokens, plus the one after it when keys look ahead)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def extend_keys(keys: list[bytes], tokens: Sequence[int], block_size: int, n_blocks: int,
                lookahead: int = 0) -> list[bytes]:
    """Extend ``keys`` (the keys of a sequence's first blocks, in place) to its first ``n_blocks``; block
    ``b``'s key covers ``tokens[b * bs : (b + 1) * bs + lookahead]``, which must all be known. Returns
    ``keys[:n_blocks]``."""
    need = n_blocks * block_size + lookahead
    if n_blocks > len(keys) and need > len(tokens):
        raise ValueError(f"keys of {n_blocks} block(s) need {need} tokens, the sequence has {len(tokens)}")
    for b in range(len(keys), n_blocks):
        keys.append(block_key(keys[-1] if keys else ROOT,
                              tokens[b * block_size:(b + 1) * block_size + lookahead]))
    return keys[:n_blocks]


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the cache at a request's admission and how many were found there; and
    the tokens a preempted sequence found there again when it was recomputed (counted apart)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_recompute_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class PrefixCachingAllocator(BlockAllocator):
    """A block allocator whose blocks can carry a content key (module docstring). Free blocks are the
    never-cached ones (a stack, as in BlockAllocator) and the evictable cached ones (LRU order)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached, unreferenced; oldest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with a key (in use or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable(self) -> list[int]:
        """The evictable blocks, the next one to be evicted first."""
        return list(self._evictable)

    def key_of(self, block: int) -> Optional[bytes]:
        self._check_id(block)
        return self._key_of.get(block)

    def _take_free(self) -> int:
        """Never-cached free blocks first, then the least recently freed cached one, evicted (its key
        forgotten)."""
        if self._free:
            return self._free.pop()
        b, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of.pop(b)]
        self.evictions += 1
        return b

    def _put_free(self, block: int) -> None:
        """At its last reference a cached block becomes evictable (most recently freed), another free."""
        if block in self._key_of:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def free_all(self, blocks: Sequence[int]) -> None:
        """Free a sequence's blocks, the last one first: its tail is evicted before its head."""
        for b in reversed(blocks):
            self.free(b)

    def register(self, block: int, key: bytes) -> bool:
        """Give a block in use (its contents computed and final) the key ``key``. False when another block
        already holds that key (this one stays uncached) or this one has a key already."""
        self._check_allocated(block, "register")
        if block in self._key_of or key in self._block_of:
            return False
        self._key_of[block], self._block_of[key] = key, block
        return True

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks of the longest run of ``keys`` (a sequence's first blocks' keys, in order) that are
        cached; nothing is taken (``acquire`` does)."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each cached block (an evictable one leaves the LRU); all checked first."""
        for b in blocks:
            self._check_id(b)
            if b not in self._key_of:
                raise ValueError(f"acquire of block {b}, which is not cached")
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def cost(self, blocks: Sequence[int]) -> int:
        """Free blocks that acquiring ``blocks`` uses up (the evictable ones among them)."""
        return sum(1 for b in blocks if self._refs[b] == 0)
