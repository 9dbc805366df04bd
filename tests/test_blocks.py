"""pipeline.engine.cache.blocks: the paged KV cache's block allocator, block tables and bytes per token."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pipeline.config import DeepseekV3Config
from pipeline.engine.cache.blocks import BlockAllocator, BlockTable, OutOfBlocks
from pipeline.quant.recipe.recipe import kv_bytes_per_token
from pipeline.serving.sharding.replica import DEEPSEEK_V3_CONFIG
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from tiny import tiny_config


def _state(alloc: BlockAllocator, *tables: BlockTable):
    return ([alloc.refcount(b) for b in range(alloc.num_blocks)], alloc.num_free,
            [(list(t.blocks), t.num_tokens) for t in tables])


# ----- allocator ------------------------------------------------------------------------------------------
def test_allocator_basics():
    a = BlockAllocator(3)
    assert issubclass(OutOfBlocks, RuntimeError)
    assert a.num_free == 3 and a.num_used == 0
    assert [a.allocate(), a.allocate()] == [0, 1]
    assert a.num_free == 1 and a.refcount(0) == 1 and a.refcount(2) == 0
    a.incref(0)
    assert a.refcount(0) == 2 and a.total_refs() == 3
    a.free(0)
    assert a.refcount(0) == 1 and a.num_free == 1          # still held once
    a.free(0)
    assert a.refcount(0) == 0 and a.num_free == 2
    assert a.allocate() == 0                               # freed blocks are reused
    assert a.allocate() == 2
    with pytest.raises(OutOfBlocks, match="need 1 block"):
        a.allocate()
    with pytest.raises(OutOfBlocks):
        a.allocate_many(1)
    assert a.allocate_many(0) == [] and a.num_free == 0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_double_free_and_unknown_blocks():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match=f"double free of block {b}"):
        a.free(b)
    with pytest.raises(ValueError, match="block 3"):        # never allocated
        a.free(3)
    for bad in (-1, 4, 100, "1", 1.0, True):
        with pytest.raises(ValueError, match=f"block {bad!r} is not a block"):
            a.free(bad)
    with pytest.raises(ValueError, match="incref of block 2"):
        a.incref(2)
    a.allocate()
    with pytest.raises(ValueError, match="fork of block 1"):
        a.fork([0, 1])
    assert a.refcount(0) == 1                              # the failed fork changed nothing
    assert a.num_free == 3 and a.total_refs() == 1


def test_allocate_many_is_all_or_nothing():
    a = BlockAllocator(5)
    assert a.allocate_many(3) == [0, 1, 2]
    before = _state(a)
    with pytest.raises(OutOfBlocks, match="need 3 block.*2 of 5 free"):
        a.allocate_many(3)
    assert _state(a) == before


# ----- block table ----------------------------------------------------------------------------------------
def test_table_slots_and_append():
    a = BlockAllocator(8)
    t = BlockTable(16)
    assert [t.slots_needed(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert t.append_tokens(10, a) == []
    assert t.blocks == [0] and t.num_tokens == 10
    assert [t.slots_needed(n) for n in (0, 6, 7, 22, 23)] == [0, 0, 1, 1, 2]
    assert t.append_tokens(30, a) == []
    assert t.blocks == [0, 1, 2] and t.num_tokens == 40 and a.num_free == 5
    assert t.slot(0) == (0, 0) and t.slot(15) == (0, 15) and t.slot(16) == (1, 0) and t.slot(39) == (2, 7)
    for bad in (40, -1):
        with pytest.raises(IndexError, match=f"position {bad} is outside the sequence's 40 token"):
            t.slot(bad)
    assert t.append_tokens(0, a) == [] and t.blocks == [0, 1, 2]
    t.release(a)
    assert t.blocks == [] and t.num_tokens == 0 and a.num_free == 8 and a.total_refs() == 0
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(0)
    with pytest.raises(ValueError, match="need 2 block"):
        BlockTable(16, [0], 17)


def test_fork_shares_blocks_and_copies_on_write():
    a = BlockAllocator(8)
    parent = BlockTable(16)
    parent.append_tokens(20, a)                            # blocks [0, 1], block 1 holds 4 tokens
    child = parent.fork(a)
    assert child.blocks == [0, 1] and child.num_tokens == 20 and child.blocks is not parent.blocks
    assert a.refcount(0) == 2 and a.refcount(1) == 2 and a.num_free == 6
    assert child.slots_needed(1) == 0 and child.slots_needed(1, a) == 1     # copy-on-write block
    assert child.append_tokens(1, a) == [(1, 2)]           # copy slots [0, 4) of block 1 into block 2
    assert child.blocks == [0, 2] and child.num_tokens == 21
    assert a.refcount(1) == 1 and a.refcount(2) == 1 and a.refcount(0) == 2
    assert parent.append_tokens(1, a) == []                # block 1 is parent's alone now
    assert parent.blocks == [0, 1] and parent.slot(20) == (1, 4)
    # A full shared block is never written: appending opens a new block, no copy.
    full = BlockTable(16)
    full.append_tokens(32, a)                              # blocks [3, 4]
    twin = full.fork(a)
    assert twin.slots_needed(1, a) == 1 and twin.append_tokens(1, a) == [] and twin.blocks == [3, 4, 5]
    for t in (parent, child, full, twin):
        t.release(a)
    assert a.num_free == 8 and a.total_refs() == 0


def test_out_of_blocks_leaves_state_unchanged():
    a = BlockAllocator(4)
    t1, t2 = BlockTable(16), BlockTable(16)
    t1.append_tokens(40, a)                                # 3 blocks
    before = _state(a, t1, t2)
    with pytest.raises(OutOfBlocks, match="need 3 block.*1 of 4 free"):
        t2.append_tokens(33, a)
    assert _state(a, t1, t2) == before
    with pytest.raises(OutOfBlocks, match="need 2 block"):
        t1.append_tokens(25, a)                            # 40 + 25 = 65 tokens: 5 blocks, 2 new, 1 free
    assert _state(a, t1, t2) == before
    # copy-on-write needs a block too: all or nothing, the shared block stays shared
    child = t1.fork(a)
    a.allocate()                                           # the last free block
    before = _state(a, t1, child)
    with pytest.raises(OutOfBlocks, match="need 1 block.*0 of 4 free"):
        child.append_tokens(1, a)
    assert _state(a, t1, child) == before and a.refcount(t1.blocks[-1]) == 2


def test_randomized_operations_keep_refcounts_consistent():
    """20k random operations over many sequences, against a simulated cache holding token values: every
    step, the references held by the tables (and loose blocks) equal the allocator's counts exactly; every
    new token is written to a block no other sequence holds; each sequence reads back its own tokens."""
    rng = random.Random(1234)
    num_blocks, bs = 64, 4
    a = BlockAllocator(num_blocks)
    seqs: dict[int, tuple[BlockTable, list[int]]] = {}
    loose: list[int] = []                                  # blocks allocated directly, not in a table
    cache = {b: [None] * bs for b in range(num_blocks)}
    next_id, token = 0, 0
    events = Counter()

    def read(t: BlockTable) -> list:
        return [cache[b][o] for b, o in (t.slot(p) for p in range(t.num_tokens))]

    def append(sid: int, n: int) -> None:
        nonlocal token
        t, toks = seqs[sid]
        before = _state(a, t)
        try:
            copies = t.append_tokens(n, a)
        except OutOfBlocks:
            events["oom"] += 1
            assert _state(a, t) == before
            return
        old = len(toks)
        for src, dst in copies:
            events["cow"] += 1
            cache[dst][:old % bs] = cache[src][:old % bs]
        for p in range(old, old + n):
            b, o = t.slot(p)
            assert a.refcount(b) == 1, f"token {p} of seq {sid} would be written into shared block {b}"
            cache[b][o] = token
            toks.append(token)
            token += 1
        assert t.num_tokens == len(toks) and read(t) == toks

    for step in range(20_000):
        op = rng.random()
        if a.num_free < num_blocks // 4 and op < 0.5:      # under pressure: mostly release, keep OOMs rare-ish
            op = 0.80 if seqs else 0.95
        if op < 0.10 or not seqs:
            seqs[next_id] = (BlockTable(bs), [])
            append(next_id, rng.randint(1, 12))
            events["new"] += 1
            next_id += 1
        elif op < 0.55:
            big = rng.random() < 0.05                      # a long prefill now and then: OOMs happen
            append(rng.choice(list(seqs)), rng.randint(20, 160) if big else rng.randint(0, 6))
        elif op < 0.70:
            t, toks = seqs[rng.choice(list(seqs))]
            seqs[next_id] = (t.fork(a), list(toks))
            events["fork"] += 1
            next_id += 1
        elif op < 0.85:
            sid = rng.choice(list(seqs))
            t, toks = seqs.pop(sid)
            t.release(a)
            assert t.blocks == [] and t.num_tokens == 0
            events["release"] += 1
        elif op < 0.90 and len(loose) < 8:
            try:
                loose.append(a.allocate())
                events["allocate"] += 1
            except OutOfBlocks:
                events["oom"] += 1
        elif loose:
            a.free(loose.pop(rng.randrange(len(loose))))
        # invariant: held references == allocator counts, block by block
        held = Counter(b for t, _ in seqs.values() for b in t.blocks) + Counter(loose)
        refs = [a.refcount(b) for b in range(num_blocks)]
        assert all(r >= 0 for r in refs)
        assert refs == [held.get(b, 0) for b in range(num_blocks)], f"step {step}"
        assert a.num_free == refs.count(0) and a.total_refs() == sum(held.values())
        if step % 1000 == 0:
            for t, toks in seqs.values():
                assert read(t) == toks
    for t, toks in seqs.values():
        assert read(t) == toks
        t.release(a)
    for b in loose:
        a.free(b)
    assert a.num_free == num_blocks and a.total_refs() == 0
    assert [a.allocate() for _ in range(num_blocks)] and a.num_free == 0   # every block is usable again
    for name, at_least in (("new", 1000), ("fork", 1000), ("release", 1000), ("cow", 100), ("oom", 50),
                           ("allocate", 500)):
        assert events[name] >= at_least, (name, events)


# ----- bytes per token ------------------------------------------------------------------------------------
V3 = DeepseekV3Config.from_dict(DEEPSEEK_V3_CONFIG)


def test_kv_bytes_per_token_v3():
    per, total = kv_bytes_per_token(V3, Recipe())
    assert sorted(per) == list(range(62))                  # 61 layers + the MTP layer 61
    assert all(per[i] == 640 for i in range(61))           # int8 latent 512 + bf16 k_pe 128
    assert per[61] == 1152                                 # MTP not quantized by default: (512 + 64) * 2
    assert total == 61 * 640 + 1152 == 40192
    per, total = kv_bytes_per_token(V3, Recipe(quantize_mtp=True))
    assert set(per.values()) == {640} and total == 62 * 640
    per, total = kv_bytes_per_token(V3, Recipe(fa_exclude_layers=(0, 60)))
    assert per[0] == per[60] == per[61] == 1152 and per[1] == per[59] == 640
    assert total == 59 * 640 + 3 * 1152 == 41216
    for r in (Recipe(fa_quant=False), None):
        per, total = kv_bytes_per_token(V3, r)
        assert set(per.values()) == {1152} and total == 62 * 1152
    per, total = kv_bytes_per_token(V3, Recipe(), dtype_bytes=4)      # an fp32 model
    assert per[0] == 512 + 256 and per[61] == 576 * 4 and total == 61 * 768 + 2304


def test_kv_bytes_per_token_other_configs():
    tiny = DeepseekV3Config.from_dict(tiny_config())       # kv_lora_rank 32, qk_rope_head_dim 16, 3 layers + MTP
    per, total = kv_bytes_per_token(tiny, Recipe(fa_exclude_layers=(1,)))
    assert per == {0: 64, 1: 96, 2: 64, 3: 96} and total == 320
    no_mtp = DeepseekV3Config.from_dict(tiny_config(num_nextn_predict_layers=0))
    assert kv_bytes_per_token(no_mtp, Recipe()) == ({0: 64, 1: 64, 2: 64}, 192)
    with pytest.raises(QuantError, match=r"fa_exclude_layers \[99\]"):
        kv_bytes_per_token(V3, Recipe(fa_exclude_layers=(99,)))
