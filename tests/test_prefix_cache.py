"""Prefix caching (pipeline.engine.cache.prefix_cache, the scheduler's use of it, the engine's): the chained
block keys, the allocator's reference counts and LRU eviction; the scheduler against the stand-in model
of test_scheduler with a simulated cache whose every slot holds a digest of the prefix it was computed
from (so a block shared from the cache is checked to hold exactly what the sequence would compute); and
the engine on the real quantized embedded model: the same greedy tokens with caching on and off, the
hit counts they must be, under chunked prefill, preemption, MTP, NZ, the prefill/decode handoff, and the
hit-rate metric down to /metrics."""

from __future__ import annotations

import hashlib
import random
import struct
from collections import Counter

import pytest
import torch

from pipeline.engine.cache.blocks import BlockAllocator, BlockTable, OutOfBlocks
from pipeline.engine.cache.prefix_cache import ROOT, PrefixCachingAllocator, block_key, extend_keys
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.core.scheduler import FINISHED, RUNNING, Scheduler
from engine_ref import drain, request, submit
from test_scheduler import V, alone, next_token


# ----- keys -----------------------------------------------------------------------------------------------
def test_block_keys_chain_over_the_whole_prefix():
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    keys = extend_keys([], toks, 4, 2)
    want0 = hashlib.blake2b(struct.pack("<4q", 5, 6, 7, 8), digest_size=16).digest()
    want1 = hashlib.blake2b(want0 + struct.pack("<4q", 9, 10, 11, 12), digest_size=16).digest()
    assert keys == [want0, want1] and block_key(ROOT, toks[:4]) == want0
    assert extend_keys([], toks[4:], 4, 1) != [want1]                # same tokens, other prefix: other key
    assert extend_keys([], [5, 6, 7, 0] + toks[4:], 4, 2)[1] != want1  # a change before the block changes it
    assert extend_keys([], toks[:8], 4, 2) == keys                   # only the blocks' tokens count
    ahead = extend_keys([], toks, 4, 2, lookahead=1)                 # MTP: the token after the block too
    assert ahead[0] == block_key(ROOT, toks[:5]) and ahead[0] != want0
    assert extend_keys([], toks[:8] + [99], 4, 2, lookahead=1)[1] != ahead[1]
    k = extend_keys([], toks, 4, 1)
    assert extend_keys(k, toks, 4, 2) == keys and k == keys           # extended in place
    with pytest.raises(ValueError, match="keys of 2 block.*need 9 tokens, the sequence has 8"):
        extend_keys([], toks[:8], 4, 2, lookahead=1)


# ----- allocator ------------------------------------------------------------------------------------------
def test_allocator_refcounts_lru_eviction_and_forgetting():
    a = PrefixCachingAllocator(4)
    t = BlockTable(4)
    t.append_tokens(12, a)                                 # blocks [0, 1, 2]
    keys = extend_keys([], list(range(12)), 4, 3)
    assert [a.register(b, k) for b, k in zip(t.blocks, keys)] == [True] * 3
    assert a.lookup(keys) == [0, 1, 2] and a.num_cached == 3
    assert a.lookup(extend_keys([], list(range(4, 12)), 4, 2)) == []   # blocks 1, 2's tokens, not behind block 0
    assert a.lookup(extend_keys([], list(range(8)) + [0, 0, 0, 0], 4, 3)) == [0, 1]   # the longest run only
    a.acquire([0, 1])                                      # a second sequence shares the first two
    assert [a.refcount(b) for b in range(4)] == [2, 2, 1, 0]
    t.release(a)
    assert [a.refcount(b) for b in range(4)] == [1, 1, 0, 0]
    assert a.num_free == 2 and a.num_used == 2 and a.evictable() == [2]   # block 2: cached, unreferenced
    assert a.lookup(keys) == [0, 1, 2]                     # still found after its last reference went
    assert a.allocate() == 3 and a.key_of(2) == keys[2]    # a never-cached block goes first
    assert a.allocate() == 2 and a.evictions == 1          # then the LRU cached one, evicted ...
    assert a.key_of(2) is None and a.lookup(keys) == [0, 1] and a.num_cached == 2   # ... its key forgotten
    with pytest.raises(OutOfBlocks, match="need 1 block.*0 of 4 free"):
        a.allocate()                                       # blocks 0 and 1 are referenced: never evicted
    a.free_all([2, 3])
    a.free_all([0, 1])                                     # a table's blocks: the tail is freed first
    assert a.evictable() == [1, 0] and a.num_free == 4 and a.total_refs() == 0
    a.acquire([1])                                         # taken again: out of the LRU ...
    assert a.evictable() == [0] and a.refcount(1) == 1 and a.num_free == 3
    a.free(1)                                              # ... and back as the most recently freed
    assert a.evictable() == [0, 1]
    assert a.allocate_many(3) == [2, 3, 0] and a.key_of(0) is None and a.key_of(1) == keys[1]
    assert a.lookup(keys) == [] and a.evictions == 2      # block 0 gone: nothing matches behind it


def test_allocator_refusals():
    a = PrefixCachingAllocator(3)
    b = a.allocate()
    k = block_key(ROOT, [1, 2])
    assert a.register(b, k)
    c = a.allocate()
    assert not a.register(c, k)                            # the key is held: this block stays uncached
    assert not a.register(b, block_key(ROOT, [3]))         # one key per block
    with pytest.raises(ValueError, match="register of block 2, which is not allocated"):
        a.register(2, block_key(ROOT, [4]))
    with pytest.raises(ValueError, match="acquire of block 1, which is not cached"):
        a.acquire([b, c])
    assert a.refcount(b) == 1                              # the failed acquire changed nothing
    a.free(c)
    a.free(b)
    with pytest.raises(ValueError, match="double free of block 0"):
        a.free(b)
    with pytest.raises(ValueError, match="fork of block 0"):  # an evictable block is free: take it by acquire
        a.fork([b])
    assert a.cost([b]) == 1 and a.num_free == 3


# ----- scheduler, against the stand-in model and a simulated cache -------------------------------------
def _digest(tokens) -> int:
    return hash(tuple(tokens))


def _run_checked(sched: Scheduler, mtp: bool, rng: random.Random, add_later=()) -> dict:
    """Step ``sched`` to the end like the engine: each piece writes, per slot, a digest of the tokens up to
    its position (the main cache) and, after the update, of the tokens up to the next one (the MTP
    cache, for the sequences still running: _draft_work; a slot's main write makes its MTP entry stale);
    before writing, every slot a piece attends to must hold its own prefix's digest. With ``mtp``,
    greedy drafts, right or wrong at random."""
    main, side = {}, {}
    counts = {"steps": 0, "drafts": 0, "hit_pieces": 0}
    later = list(add_later)
    while sched.has_work or later:
        if later and (not sched.has_work or rng.random() < 0.3):
            later.pop(0)()
        admitted = {s.seq_id for s in sched.waiting}
        batch = sched.schedule()
        assert batch.num_tokens <= sched.max_batched_tokens
        for p in batch.pieces:
            seq, t = p.seq, p.seq.table
            assert p.start == seq.num_computed and p.n >= 1 and t.num_tokens == p.start + p.n
            for q in range(p.start):                      # what attention reads: the sequence's own prefix
                assert main[t.slot(q)] == _digest(seq.tokens[:q + 1]), (seq.seq_id, q)
                if mtp:
                    assert side[t.slot(q)] == _digest(seq.tokens[:q + 2]), (seq.seq_id, q)
            counts["hit_pieces"] += seq.seq_id in admitted and p.start > 0   # it starts on cached blocks
            ids = seq.tokens[:p.start] + p.token_ids
            for q in range(p.start, p.start + p.n):
                assert sched.allocator.refcount(t.slot(q)[0]) == 1, "a shared block is written"
                main[t.slot(q)] = _digest(ids[:q + 1])
                side.pop(t.slot(q), None)                 # the slot's old MTP entry is stale now
        sampled = {}
        for p in batch.pieces:
            if not p.samples:
                continue
            t1 = next_token(p.seq.tokens)
            if p.draft is None:
                sampled[p.seq.seq_id] = t1
            else:
                counts["drafts"] += 1
                sampled[p.seq.seq_id] = [t1] if t1 != p.draft else [t1, next_token(p.seq.tokens + [t1])]
        sched.update(batch, sampled)
        for p in batch.pieces:
            seq = p.seq
            if mtp and seq.status == RUNNING:
                for q in range(p.start, seq.num_computed):
                    side[seq.table.slot(q)] = _digest(seq.tokens[:q + 2])
                if seq.remaining == 1:
                    good = next_token(seq.tokens)
                    seq.draft = good if rng.random() < 0.6 else (good + 1) % V
        counts["steps"] += 1
        assert counts["steps"] < 20_000
        # references: exactly the running tables'; the free ones are the unreferenced; evictable = cached
        a = sched.allocator
        held = Counter(b for s in sched.running for b in s.table.blocks)
        refs = [a.refcount(b) for b in range(a.num_blocks)]
        assert refs == [held.get(b, 0) for b in range(a.num_blocks)] and a.num_free == refs.count(0)
        if sched.caching:
            assert all(refs[b] == 0 and a.key_of(b) is not None for b in a.evictable())
    return counts


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_scheduler_random_load_shares_exact_prefixes(mtp):
    """Requests over a few shared prefixes, many arriving while others run, a cache far smaller than
    the load (preemption, eviction): every sequence gets its tokens alone, every block it attends to
    holds its own prefix, the cache is hit, nothing leaks."""
    rng = random.Random(7 + mtp)
    alloc = PrefixCachingAllocator(24)
    sched = Scheduler(alloc, block_size=4, max_model_len=128, max_num_seqs=6, max_batched_tokens=20, mtp=mtp)
    heads = [[rng.randrange(V) for _ in range(rng.randint(4, 30))] for _ in range(4)]
    seqs = []

    def add():
        prompt = rng.choice(heads) + [rng.randrange(V) for _ in range(rng.randint(0, 9))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 20))
        seqs.append((sched.add(prompt, params, eos_id=5), prompt, params))

    for _ in range(10):
        add()
    counts = _run_checked(sched, mtp, rng, [add] * 40)
    assert len(seqs) == 50 and all(s.status == FINISHED for s, _, _ in seqs)
    for seq, prompt, params in seqs:
        assert seq.output == alone(prompt, params.max_new_tokens, 5), seq.seq_id
    st = sched.stats
    assert sched.num_preemptions > 0 and alloc.evictions > 0 and counts["hit_pieces"] > 10
    assert st.prefix_cache_queries == sum(len(p) for _, p, _ in seqs)
    assert 0.2 < st.prefix_cache_hit_rate < 1 and st.prefix_cache_recompute_hits > 0, st
    assert st.prefix_cache_hits % 4 == 0 and st.prefix_cache_recompute_hits % 4 == 0
    assert (counts["drafts"] > 50) == mtp
    assert alloc.num_free == 24 and alloc.total_refs() == 0


def test_scheduler_hit_counts_and_what_is_never_shared():
    """Hit = the full blocks of the common prefix (at most all but the block of the last token); with MTP
    one token less (a block matches only with the token after it); off: nothing changes."""
    prefix = list(range(10, 30))                           # 20 tokens: 5 blocks of 4
    for mtp, caching, hit_blocks in ((False, True, 5), (True, True, 4), (False, False, 0)):
        alloc = PrefixCachingAllocator(32) if caching else BlockAllocator(32)
        sched = Scheduler(alloc, block_size=4, max_model_len=128, mtp=mtp)
        first = sched.add(prefix + [1, 2, 3], SamplingParams(max_new_tokens=3))
        _run_checked(sched, mtp, random.Random(0))
        second = sched.add(prefix + [7], SamplingParams(max_new_tokens=2))
        batch = sched.schedule()
        (p,) = batch.pieces
        assert (p.start, p.n) == (hit_blocks * 4, 21 - hit_blocks * 4)
        assert all(alloc.key_of(b) is not None for b in second.table.blocks[:hit_blocks])
        assert first.status == FINISHED and second.num_registered == hit_blocks
        assert sched.stats.prefix_cache_queries == (44 if caching else 0)
        assert sched.stats.prefix_cache_hits == hit_blocks * 4
        sched.update(batch, {second.seq_id: 0})
        # the whole prompt cached: its last block is left to compute (the logits of its last token)
        again = sched.add(prefix, SamplingParams(max_new_tokens=1))
        (p,) = [p for p in sched.schedule().pieces if p.seq is again]
        assert (p.start, p.n) == ((16, 4) if caching else (0, 20)), mtp
        sched.abort(again)
        sched.abort(second)
        assert alloc.num_free == 32 and alloc.total_refs() == 0


def test_mtp_blocks_are_cached_only_once_their_mtp_entries_are_written():
    """A prompt prefilled in one step that ends there (its first token: max_new_tokens=1) never gets its
    MTP entries (the MTP pass skips finished sequences): with MTP its blocks are not cached, without MTP
    they are; a prompt that runs one more step is cached either way."""
    prefix = list(range(40, 56))                           # 4 blocks of 4
    for mtp, one_step_hits, two_step_hits in ((False, 16, 16), (True, 0, 12)):
        for max_new, want in ((1, one_step_hits), (2, two_step_hits)):
            alloc = PrefixCachingAllocator(16)
            sched = Scheduler(alloc, block_size=4, max_model_len=64, mtp=mtp)
            sched.add(prefix + [1], SamplingParams(max_new_tokens=max_new))
            _run_checked(sched, mtp, random.Random(1))
            nxt = sched.add(prefix + [2, 3], SamplingParams(max_new_tokens=1))
            (p,) = sched.schedule().pieces
            assert (p.seq, p.start) == (nxt, want), (mtp, max_new)


# ----- the engine, on the real quantized embedded model -------------------------------------------------
SYSTEM = ("You are a careful Python tutor for beginners. Answer in short plain sentences and give one small "
          "example when it helps. Prefer the standard library, name the module you use, and never invent "
          "modules or functions. When a question is vague, say what you assume. Keep every answer under a "
          "hundred words.")
# one system prompt, four questions, and the first again (a whole prompt cached: its last block is recomputed)
QUESTIONS = ["What's deep learning?", "What does the os module do?", "Explain list comprehensions.",
             "How do I open a file?", "What's deep learning?"]
GREEDY = SamplingParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(qdir, tok, prompts):
    """Each prompt's greedy tokens alone, prefix caching off."""
    eng = engine(qdir, tok, prefix_caching=False)
    return [eng.generate([p], GREEDY)[0] for p in prompts]


def engine(qdir, tok, **kw):
    from pipeline.engine.core.engine import LLMEngine

    return LLMEngine.from_dir(qdir, tokenizer=tok, **{"num_blocks": 64, "block_size": 16, **kw})


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hits(prompt, earlier, bs: int, mtp: bool) -> int:
    """Hand-computed hit tokens of ``prompt`` after the sequences ``earlier`` (their tokens) ran with all
    their full blocks cached: the full blocks of the longest common prefix (with MTP, those followed by a
    common token too), never the block of the prompt's last token."""
    common = max((_lcp(prompt, t) for t in earlier), default=0)
    return max(0, min((common - mtp) // bs, (len(prompt) - 1) // bs)) * bs


def recorder(eng) -> list:
    """The batches ``eng`` schedules (its own scheduler's, observed)."""
    log, schedule = [], eng.scheduler.schedule

    def observed():
        log.append(schedule())
        return log[-1]

    eng.scheduler.schedule = observed
    return log


def computed_prompt_tokens(log, rid: str, n_prompt: int) -> int:
    """Prompt tokens of request ``rid`` (``n_prompt`` of them) the logged batches computed."""
    return sum(min(p.start + p.n, n_prompt) - p.start for b in log for p in b.pieces
               if p.seq.request_id == rid and p.start < n_prompt)


def run_one_by_one(eng, prompts, params=GREEDY, bs=16, mtp=False):
    """Run the prompts one after another; check each one's hits and prompt tokens computed against the
    hand-computed counts. Returns the outputs and the expected hit tokens."""
    log = recorder(eng)
    outs, hits, earlier = [], [], []
    for p in prompts:
        rid = submit(eng, p, params)
        out = drain(eng)[rid].tokens
        want = expected_hits(p, earlier, bs, mtp)
        assert computed_prompt_tokens(log, rid, len(p)) == len(p) - want, (len(outs), want)
        outs.append(out)
        hits.append(want)
        earlier.append(p + out)
    st = eng.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (sum(map(len, prompts)), sum(hits))
    assert st.prefix_cache_hit_rate == sum(hits) / sum(map(len, prompts))
    return outs, hits


@pytest.mark.parametrize("nz", [False, True], ids=["nd", "nz"])
def test_engine_shared_prefix_same_tokens_fewer_computed(qdir, tok, prompts, reference, nz):
    """Prompts sharing a 87-88 token system prefix, one after another: each later one starts after the
    cached full blocks of its common prefix (5 of 16 tokens; the repeated prompt too: its 6th block holds
    its last token) and gets the tokens it gets with caching off; also with chunked prefill."""
    eng = engine(qdir, tok, nz=nz)
    outs, hits = run_one_by_one(eng, prompts)
    assert outs == reference and hits == [0, 80, 80, 80, 80]
    assert eng.allocator.num_free == 64 and eng.allocator.total_refs() == 0 and eng.allocator.num_cached > 0
    chunked = engine(qdir, tok, nz=nz, max_batched_tokens=7)   # every prompt takes several steps
    outs, hits = run_one_by_one(chunked, prompts)
    assert outs == reference and hits == [0, 80, 80, 80, 80]
    off = engine(qdir, tok, nz=nz, prefix_caching=False)
    log = recorder(off)
    rids = [submit(off, p, GREEDY) for p in prompts]
    drain(off)
    assert [computed_prompt_tokens(log, r, len(p)) for r, p in zip(rids, prompts)] == list(map(len, prompts))
    assert (off.stats().prefix_cache_queries, off.stats().prefix_cache_hit_rate) == (0, 0.0)


def test_engine_together_chunked_and_preempted(qdir, tok, prompts, reference):
    """All prompts at once. Chunked prefill (7 tokens a step): each prompt is admitted only once the one
    before is prefilled (the budget goes to its chunks) and its blocks cached, so the hits are those of
    one by one. A cache of 10 blocks (~8 per sequence): sequences are preempted and recomputed from what
    the cache still holds, in fewer steps than without caching (measured: 76 against 138; how many
    preemptions each takes depends on the scheduler's order, not on caching). Tokens unchanged, nothing
    leaks."""
    chunked = engine(qdir, tok, max_batched_tokens=7)
    assert chunked.generate(prompts, GREEDY) == reference
    assert chunked.stats().prefix_cache_hits == 4 * 80
    small = engine(qdir, tok, num_blocks=10, max_batched_tokens=64)
    assert small.generate(prompts, GREEDY) == reference
    st = small.stats()
    assert st.preemptions > 0 and st.prefix_cache_recompute_hits > 0 and st.prefix_cache_hits > 0, st
    assert small.allocator.num_free == 10 and small.allocator.total_refs() == 0 and small.allocator.evictions > 0
    small_off = engine(qdir, tok, num_blocks=10, max_batched_tokens=64, prefix_caching=False)
    assert small_off.generate(prompts, GREEDY) == reference
    assert st.steps < small_off.stats().steps and small_off.stats().preemptions > 0


@pytest.mark.parametrize("nz", [False, True], ids=["nd", "nz"])
def test_engine_mtp_prefix_cache_exact(qdir, tok, prompts, reference, nz):
    """MTP on, blocks of 8: a block matches only with the token after it (the second prompt shares 88
    tokens with the first: 10 blocks, not 11). Same tokens as without MTP and the same drafts accepted as
    with caching off; every layer's cache entries of a prompt that starts on the first one's blocks, the
    MTP layer's included, are bit for bit those it computes alone. The 11th block is why: its main
    entries are the same for both prompts, its MTP entries are not (the last one reads token 88)."""
    params = SamplingParams(max_new_tokens=32)
    kw = {"nz": nz, "mtp": True, "block_size": 8, "num_blocks": 128}
    off = engine(qdir, tok, prefix_caching=False, **kw)
    want = [off.generate([p], params)[0] for p in prompts]
    assert want == reference
    on = engine(qdir, tok, **kw)
    outs, hits = run_one_by_one(on, prompts, params, bs=8, mtp=True)
    assert outs == want and hits == [0, 80, 80, 80, 88]
    assert expected_hits(prompts[1], [prompts[0]], 8, False) == 88     # without MTP it would be 11 blocks
    on_st, off_st = on.stats(), off.stats()
    assert (on_st.mtp_drafts, on_st.mtp_accepted) == (off_st.mtp_drafts, off_st.mtp_accepted) and on_st.mtp_drafts > 0
    fresh = engine(qdir, tok, **kw)
    fresh.generate([prompts[0]], params)
    got = fresh.prefill(request(prompts[1], params))       # starts on the first prompt's 10 blocks
    assert fresh.stats().prefix_cache_hits == 80
    alone_ = off.prefill(request(prompts[1], params))
    first = off.prefill(request(prompts[0], params))
    assert (got.first_token, got.draft) == (alone_.first_token, alone_.draft)
    mtp_id, r = off.runner.mtp_id, len(prompts[1]) % 8     # the last block holds r of the prompt's tokens

    def prompt_slots(x):  # the stored blocks (ND [k, bs, ...] or NZ [k, C1, R', c0]) cut to the prompt's slots
        return x[:-1], (x[-1, :, :r] if nz else x[-1, :r])

    for layer, (c, pe) in alone_.blocks.items():
        for mine, theirs in zip(got.blocks[layer], (c, pe)):
            assert all(torch.equal(a, b) for a, b in zip(prompt_slots(mine), prompt_slots(theirs))), layer
        same_11th = torch.equal(first.blocks[layer][0][10], c[10]) and torch.equal(first.blocks[layer][1][10], pe[10])
        assert same_11th == (layer != mtp_id), layer


@pytest.mark.parametrize("kw", [{}, {"nz": True, "mtp": True}], ids=["nd", "nz-mtp"])
def test_prefill_decode_handoff_with_prefix_cache(qdir, tok, prompts, reference, kw):
    """The prefill engine reuses its cache across prompts, with MTP too (a held prompt's blocks are
    registered once its step's MTP pass has written them: Scheduler.register_final). The decode engine
    caches the blocks it is handed, and a request sent straight to it then starts after them. Same tokens
    throughout."""
    pre, dec = engine(qdir, tok, **kw), engine(qdir, tok, **kw)
    log = recorder(pre)
    handoffs = []
    reqs = [request(p, GREEDY) for p in prompts[:4]]
    for r in reqs:
        handoffs.append(pre.prefill(r))
    want = [0, 80, 80, 80]                         # 5 shared blocks (with MTP keyed by token 81: shared too)
    assert pre.stats().prefix_cache_hits == sum(want) and pre.allocator.num_free == 64
    assert sum(b.num_tokens for b in log) == sum(map(len, prompts[:4])) - sum(want)
    for r, h in zip(reqs, handoffs):
        dec.add_prefilled(r, h)
    got = drain(dec)
    assert [[h.first_token] + got[r.request_id].tokens for r, h in zip(reqs, handoffs)] == reference[:4]
    assert dec.stats().prefix_cache_queries == 0    # handed-over prompts are not looked up, only cached
    again = submit(dec, prompts[4], GREEDY)         # the first prompt again, straight to the decode engine
    assert drain(dec)[again].tokens == reference[4] and dec.stats().prefix_cache_hits == 80
    assert dec.allocator.num_free == 64 and dec.allocator.total_refs() == 0


def test_hit_rate_in_the_loop_snapshot_and_metrics(qdir, tok, prompts):
    """The engine loop's snapshot and /metrics' text carry the counts and the hit rate computed by hand."""
    import queue
    import time

    from actors.serving.app.serve_metrics import ServeMetrics
    from pipeline.engine.core.engine_loop import EngineLoop

    loop = EngineLoop(engine(qdir, tok))
    try:
        for p in prompts[:2]:
            got = queue.Queue()
            loop.submit(request(p, GREEDY), got.put)
            while got.get(timeout=60).finish_reason is None:
                pass
        deadline = time.time() + 10
        while loop.snapshot["running"] and time.time() < deadline:
            time.sleep(0.05)
        snap = loop.snapshot
    finally:
        loop.stop()
    queries = len(prompts[0]) + len(prompts[1])       # 95 + 95 prompt tokens looked up
    assert expected_hits(prompts[1], [prompts[0]], 16, False) == 80   # 88 shared: 5 full blocks of 16
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"]) == (queries, 80)
    assert snap["prefix_cache_hit_rate"] == 80 / queries and snap["prefix_cache_blocks"] >= 5
    text = ServeMetrics().render(snap)[0].decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["dsquant_prefix_cache_hit_rate"]) == pytest.approx(80 / queries, rel=1e-12)
    assert float(values["dsquant_prefix_cache_queries_total"]) == queries
    assert float(values["dsquant_prefix_cache_hits_total"]) == 80
    assert float(values["dsquant_prefix_cache_recompute_hits_total"]) == 0
