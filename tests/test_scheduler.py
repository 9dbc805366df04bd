"""The continuous-batching scheduler against a stand-in model whose next token is a pure function of the
sequence so far: whatever the batching, chunking or preemption, every sequence must get exactly the
tokens it gets alone, the budget is never exceeded, and no cache block leaks. (The stand-in is the only
test double here: the real engine steps are tested in the engine's own tests.)"""

from __future__ import annotations

import random

import pytest

from pipeline.engine.cache.blocks import BlockAllocator
from pipeline.engine.core.scheduler import FINISHED, Scheduler
from pipeline.engine.protocol import SamplingParams

V = 97


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % V


def alone(prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    toks = list(prompt)
    out = []
    for _ in range(max_new):
        t = next_token(toks)
        if t == eos:
            break
        toks.append(t)
        out.append(t)
    return out


def run(sched: Scheduler, check_step=None) -> int:
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        assert batch.num_tokens <= sched.max_batched_tokens
        assert len({p.seq.seq_id for p in batch.pieces}) == len(batch.pieces)
        for p in batch.pieces:
            assert p.start == p.seq.num_computed and p.n >= 1
            assert p.seq.table.num_tokens == p.start + p.n  # slots reserved for exactly these tokens
        if check_step:
            check_step(batch)
        sampled = {p.seq.seq_id: next_token(p.seq.tokens) for p in batch.pieces if p.samples}
        sched.update(batch, sampled)
        steps += 1
        assert steps < 10_000
    return steps


def test_random_load_matches_each_sequence_alone_with_preemption_and_no_leak():
    rng = random.Random(0)
    alloc = BlockAllocator(24)
    sched = Scheduler(alloc, block_size=4, max_model_len=128, max_num_seqs=6, max_batched_tokens=24)
    seqs = []
    for _ in range(40):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 30))
        seqs.append((sched.add(prompt, params, eos_id=5), prompt, params))
    run(sched)
    assert sched.num_preemptions > 0  # the cache (96 slots) is far smaller than the load
    for seq, prompt, params in seqs:
        assert seq.status == FINISHED
        assert seq.output == alone(prompt, params.max_new_tokens, 5), seq.seq_id
    assert alloc.num_free == alloc.num_blocks and alloc.total_refs() == 0


def test_long_prompt_is_chunked_and_does_not_stall_decodes():
    alloc = BlockAllocator(64)
    sched = Scheduler(alloc, block_size=4, max_model_len=256, max_batched_tokens=8)
    short = sched.add([1, 2, 3], SamplingParams(max_new_tokens=20))
    run_steps = []

    def one_step():
        b = sched.schedule()
        sched.update(b, {p.seq.seq_id: next_token(p.seq.tokens) for p in b.pieces if p.samples})
        run_steps.append(b)

    one_step()  # the short prompt's prefill
    long = sched.add(list(range(60)), SamplingParams(max_new_tokens=2))
    for _ in range(8):
        one_step()
        pieces = {p.seq.seq_id: p for p in run_steps[-1].pieces}
        assert pieces[short.seq_id].n == 1  # a decode every step
        assert pieces[long.seq_id].n == 7  # the rest of the budget goes to the prompt, chunk by chunk
    assert long.num_computed == 56


def test_refusals_name_the_limit():
    sched = Scheduler(BlockAllocator(4), block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="the prompt has 64 tokens; this model takes at most 63"):
        sched.add(list(range(64)), SamplingParams())
    with pytest.raises(ValueError, match="needs 5 cache blocks of 4 tokens but the cache has 4"):
        sched.add(list(range(16)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        sched.add([], SamplingParams())


def test_abort_frees_blocks():
    alloc = BlockAllocator(8)
    sched = Scheduler(alloc, block_size=4, max_model_len=64)
    seq = sched.add(list(range(10)), SamplingParams(max_new_tokens=50))
    b = sched.schedule()
    sched.update(b, {p.seq.seq_id: 0 for p in b.pieces if p.samples})
    assert alloc.num_free < 8
    sched.abort(seq)
    assert alloc.num_free == 8 and seq.finish_reason == "abort" and not sched.has_work


def test_a_sequence_longer_than_the_cache_ends_with_length():
    alloc = BlockAllocator(3)
    sched = Scheduler(alloc, block_size=4, max_model_len=64)
    seq = sched.add([1, 2, 3], SamplingParams(max_new_tokens=40))
    run(sched)
    assert seq.finish_reason == "length" and seq.num_computed == 12  # 3 blocks x 4 slots, + 1 sampled token
    assert seq.output == alone([1, 2, 3], 10, None) and alloc.num_free == 3
