"""A DP-attention replica's engine (pipeline.parallel: dp > 1): one scheduler and KV cache per dp group,
all groups stepped in lockstep through one :class:`~pipeline.engine.sharding.dist_runner.DPRunner`.

Each group is an :class:`~pipeline.engine.core.engine.LLMEngine` of its own (its sequences, block tables and
sampling), run phase by phase (``begin_step``, the model, ``sampled``, MTP, ``end_step``): every step,
the model runs every group's spans in one call (a group without work runs a one-token step in its scratch
block, so the experts' collectives always have every rank), and each group samples from its own logits.
A request goes to the group with the fewest sequences; sequence ids are disjoint over the groups (group
``g`` numbers ``g, g + dp, ...``), so an id names its group. The interface is what generation and the
serving loop (engine_loop) use of LLMEngine's: ``add_request``, ``step``, ``has_work``, ``abort``,
``pop_error``, ``generate``, ``text``, ``kv_layout``, and aggregate views ``scheduler`` (running,
waiting), ``allocator`` (num_free), ``stats`` and ``config`` (``num_blocks``: the replica's, all
groups), and the KV handoff of disaggregated serving (``prefill``, ``add_prefilled``): the blocks are read
from, or written to, the ranks of the group that computes or will own the sequence.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from pipeline.engine.sharding.dist_runner import DPRunner
from pipeline.engine.core.engine import EngineStats, LLMEngine
from pipeline.engine.core.sampling import SamplingParams


class _Schedulers:
    def __init__(self, groups):
        self.groups, self.max_model_len = groups, groups[0].scheduler.max_model_len

    @property
    def running(self) -> list:
        return [s for g in self.groups for s in g.scheduler.running]

    @property
    def waiting(self) -> list:
        return [s for g in self.groups for s in g.scheduler.waiting]


class _Allocators:
    def __init__(self, groups):
        self.groups = groups

    @property
    def num_free(self) -> int:
        return sum(g.allocator.num_free for g in self.groups)


class DPEngine:
    def __init__(self, groups: list[LLMEngine], runner: DPRunner):
        self.groups, self.runner = groups, runner
        self.loaded, self.tokenizer = groups[0].loaded, groups[0].tokenizer
        self.config = replace(groups[0].config, num_blocks=groups[0].config.num_blocks * len(groups))
        for g, group in enumerate(groups):
            group.scheduler.number_ids(g, len(groups))
        self.scheduler, self.allocator = _Schedulers(groups), _Allocators(groups)
        self.steps = 0

    def _group(self, seq) -> LLMEngine:
        return self.groups[seq.seq_id % len(self.groups)]

    @property
    def has_work(self) -> bool:
        return any(g.has_work for g in self.groups)

    @property
    def stats(self) -> EngineStats:
        out = EngineStats(steps=self.steps)
        for g in self.groups:
            for f in ("prompt_tokens", "generated_tokens", "preemptions", "drafts", "accepted",
                      "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_recompute_hits"):
                setattr(out, f, getattr(out, f) + getattr(g.stats, f))
        return out

    def kv_layout(self) -> dict:
        return self.groups[0].kv_layout()

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams):
        return self.groups[self._least_loaded()].add_request(prompt_ids, params)

    def _least_loaded(self) -> int:
        return min(range(len(self.groups)), key=lambda g: len(self.groups[g].scheduler.running)
                   + len(self.groups[g].scheduler.waiting))

    def prefill(self, prompt_ids: Sequence[int], params: SamplingParams):
        """LLMEngine.prefill in the least loaded group, every group stepping; the blocks read from that
        group's ranks (DPRunner.read_blocks_dp)."""
        g = self._least_loaded()
        return self.groups[g].prefill(prompt_ids, params, step=self.step,
                                      read=lambda blocks: self.runner.read_blocks_dp(g, blocks))

    def add_prefilled(self, kv, params):
        """LLMEngine.add_prefilled into the least loaded group: the blocks go to that group's ranks."""
        g = self._least_loaded()
        return self.groups[g].add_prefilled(kv, params,
                                            write=lambda blocks, data: self.runner.write_blocks_dp(g, blocks, data))

    def abort(self, seq) -> None:
        self._group(seq).abort(seq)

    def pop_error(self, seq):
        return self._group(seq).pop_error(seq)

    def step(self) -> list:
        work = [g.begin_step() for g in self.groups]
        events = []
        if any(w.spans for w in work):
            logits = self.runner.forward_dp([(w.spans, w.rows) if w.spans else None for w in work])
            drafts = [g.sampled(w, lg) if w.spans else None for g, w, lg in zip(self.groups, work, logits)]
            if any(d is not None for d in drafts):
                mtp = self.runner.mtp_dp([(d.spans, d.hidden_rows, d.rows) if d else None for d in drafts])
                for d, lg in zip(drafts, mtp):
                    if d is not None:
                        LLMEngine.drafted(d, lg)
        for g, w in zip(self.groups, work):
            events += g.end_step(w) if w.spans else w.events
        self.steps += 1
        return events

    def warm_up(self, tokens: Optional[int] = None) -> int:
        """LLMEngine.warm_up for every dp group at once (their steps run together, as a served step's do):
        each group's tokens on blocks of its own, given back after. Returns the tokens run, all groups."""
        if self.has_work:
            return 0
        work = [g.warm_up_work(tokens) for g in self.groups]
        counts = [sum(sp.n for sp in w[0]) if w else 0 for w in work]
        try:
            if not any(counts):
                return 0
            self.runner.forward_dp([(w[0], w[1]) if w else None for w in work])
            if self.runner.mtp_id is not None:
                self.runner.mtp_dp([(w[0], list(range(n)), w[1]) if w else None for w, n in zip(work, counts)])
        finally:
            for g, w in zip(self.groups, work):
                if w is not None:
                    g.allocator.free_all(w[2])
        return sum(counts)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_work:
            self.step()
        for i, s in enumerate(seqs):
            if s.finish_reason == "error":
                raise RuntimeError(f"prompt {i} failed: {self.pop_error(s)}")
        return [s.output for s in seqs]

    def text(self, seq) -> str:
        return self._group(seq).text(seq)

    @property
    def acceptance_rate(self) -> float:
        drafts = sum(g.stats.drafts for g in self.groups)
        return sum(g.stats.accepted for g in self.groups) / drafts if drafts else 0.0
