"""Fair scheduling between requests (pipeline/engine/scheduler.py): a request's ``n`` choices share a
group, and a small request beside a big one is scheduled within a step or two, however many slots,
blocks or prompt tokens the big one asks for. Counted in engine steps, never in seconds; and every
sequence still gets exactly the tokens it gets alone (preemption redoes work, it never changes it)."""

from __future__ import annotations

import random

from pipeline.engine.cache.blocks import BlockAllocator
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.core.scheduler import FINISHED, RUNNING, Scheduler

from test_scheduler import alone, next_token, run


def step(sched: Scheduler):
    b = sched.schedule()
    sched.update(b, {p.seq.seq_id: next_token(p.seq.tokens) for p in b.pieces if p.samples})
    return b


def steps_until_scheduled(sched: Scheduler, seq, limit: int = 50) -> int:
    for i in range(1, limit + 1):
        if any(p.seq is seq for p in step(sched).pieces):
            return i
    raise AssertionError(f"{seq.seq_id} not scheduled within {limit} steps")


def big_request(sched: Scheduler, n: int, max_new: int, prompt_len: int = 5, group: str = "big"):
    return [sched.add([(7 * i + j) % 97 for j in range(prompt_len)],
                      SamplingParams(max_new_tokens=max_new, group=group), eos_id=None) for i in range(n)]


def test_a_request_of_every_slot_leaves_one_to_a_small_request_at_once():
    for slots in (4, 8, 16):
        alloc = BlockAllocator(1024)     # room for every sequence: only slots are short
        sched = Scheduler(alloc, block_size=4, max_model_len=512, max_num_seqs=slots, max_batched_tokens=64)
        big = big_request(sched, slots, max_new=200)
        for _ in range(3):
            step(sched)
        assert sum(s.status == RUNNING for s in big) == slots          # it holds every slot
        small = sched.add([1, 2, 3], SamplingParams(max_new_tokens=4, group="small"))
        assert steps_until_scheduled(sched, small) == 1
        assert sum(s.status == RUNNING for s in big) == slots - 1      # one of its sequences gave way
        while small.status != FINISHED:
            step(sched)
        step(sched)
        assert sum(s.status == RUNNING for s in big) == slots          # and took its slot back at once
        run(sched)
        assert all(s.output == alone(s.prompt, s.params.max_new_tokens, None) for s in [*big, small])
        assert sum(s.preemptions for s in big) == sched.num_preemptions == 1
        assert alloc.num_free == alloc.num_blocks


def test_requests_of_one_sequence_are_never_preempted_for_one_another():
    alloc = BlockAllocator(256)
    sched = Scheduler(alloc, block_size=4, max_model_len=512, max_num_seqs=4, max_batched_tokens=64)
    singles = [sched.add([i + 1] * 5, SamplingParams(max_new_tokens=30)) for i in range(4)]
    step(sched)
    late = sched.add([9, 9], SamplingParams(max_new_tokens=3))
    while late.status != FINISHED:
        b = step(sched)
        assert not b.preempted   # the fifth waits for a slot: it has no fewer than any other request
    assert all(s.status == FINISHED for s in singles)   # ... until the first four were done
    assert sched.num_preemptions == 0


def test_two_big_requests_share_the_slots_and_a_third_small_one_still_starts_at_once():
    alloc = BlockAllocator(512)
    sched = Scheduler(alloc, block_size=4, max_model_len=512, max_num_seqs=8, max_batched_tokens=64)
    a = big_request(sched, 8, max_new=100, group="a")
    for _ in range(2):
        step(sched)
    b = big_request(sched, 8, max_new=100, group="b")
    for _ in range(4):
        step(sched)
    running = lambda seqs: sum(s.status == RUNNING for s in seqs)  # noqa: E731
    assert (running(a), running(b)) == (4, 4)                      # halves
    small = sched.add([4, 5, 6], SamplingParams(max_new_tokens=3, group="c"))
    assert steps_until_scheduled(sched, small) == 1
    run(sched)
    assert all(s.output == alone(s.prompt, s.params.max_new_tokens, None) for s in [*a, *b, small])
    assert alloc.num_free == alloc.num_blocks


def test_a_short_prompt_is_not_stuck_behind_long_ones():
    """Long prompts that fill the cache and the step's budget: a short prompt behind them is admitted
    (it overtakes the long ones that do not fit) and prefilled ahead of the long chunks."""
    for long_len, blocks in ((60, 40), (120, 64), (200, 128)):
        alloc = BlockAllocator(blocks)
        sched = Scheduler(alloc, block_size=4, max_model_len=256, max_num_seqs=16, max_batched_tokens=32)
        longs = [sched.add([(i + j) % 97 for j in range(long_len)], SamplingParams(max_new_tokens=40))
                 for i in range(16)]
        for _ in range(3):
            step(sched)
        assert any(s.status != RUNNING for s in longs)    # the cache cannot hold them all
        short = sched.add([3, 1, 4], SamplingParams(max_new_tokens=2))
        assert steps_until_scheduled(sched, short) <= 2
        while short.status != FINISHED:
            step(sched)
        assert all(s.status != FINISHED for s in longs)    # it was done long before them
        run(sched)
        assert all(s.output == alone(s.prompt, 40, None) for s in longs) and short.output == alone([3, 1, 4], 2, None)
        assert alloc.num_free == alloc.num_blocks


def test_a_prompt_that_does_not_fit_is_overtaken_a_bounded_number_of_times():
    """Small prompts keep coming while a big one waits for blocks: at most max_num_seqs of them go first."""
    for slots in (3, 5):
        alloc = BlockAllocator(16)
        sched = Scheduler(alloc, block_size=4, max_model_len=64, max_num_seqs=slots, max_batched_tokens=64)
        hog = sched.add(list(range(30)), SamplingParams(max_new_tokens=30))   # 8 of the 16 blocks, then more
        step(sched)
        big = sched.add(list(range(40)), SamplingParams(max_new_tokens=2))   # 11 blocks: waits for them
        went_first = 0
        while big.status != RUNNING and big.status != FINISHED:
            smalls = [sched.add([i, i], SamplingParams(max_new_tokens=1)) for i in range(2)]  # a steady stream
            b = step(sched)
            went_first += sum(any(p.seq is s for p in b.pieces) for s in smalls) if big.status == "waiting" else 0
            assert went_first <= slots
        assert big.overtaken >= 1
        run(sched)
        assert big.output == alone(list(range(40)), 2, None) and hog.output == alone(list(range(30)), 30, None)


def test_random_grouped_load_matches_each_sequence_alone_and_frees_every_block():
    rng = random.Random(1)
    alloc = BlockAllocator(40)
    sched = Scheduler(alloc, block_size=4, max_model_len=128, max_num_seqs=6, max_batched_tokens=24)
    seqs = []
    for r in range(15):
        n = rng.choice((1, 1, 2, 6))
        prompt = [rng.randrange(97) for _ in range(rng.randint(1, 30))]
        for i in range(n):
            params = SamplingParams(max_new_tokens=rng.randint(1, 30), group=f"r{r}")
            seqs.append(sched.add(prompt + [i], params, eos_id=5))
        if rng.random() < 0.5:
            for _ in range(rng.randint(0, 3)):
                step(sched)
    run(sched)
    for s in seqs:
        assert s.status == FINISHED and s.output == alone(s.prompt, s.params.max_new_tokens, 5), s.seq_id
    assert alloc.num_free == alloc.num_blocks and alloc.total_refs() == 0
