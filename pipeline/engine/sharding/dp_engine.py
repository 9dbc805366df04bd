"""A DP-attention replica's engine (pipeline.parallel: dp > 1): one scheduler and KV cache per dp group,
all groups stepped in lockstep through one :class:`~pipeline.engine.sharding.dist_runner.DPRunner`.

Each group is an :class:`~pipeline.engine.core.engine.LLMEngine` of its own (its sequences, block tables
and sampling), run phase by phase (``begin_step``, the model, ``sampled``, MTP, ``end_step``): every step,
the model runs every group's spans in one call (a group without work runs a one-token step in its scratch
block, so the experts' collectives always have every rank), and each group samples from its own logits.
A request goes to the group with the fewest sequences. The interface is the engine's (add, abort, step,
stats, has_work), with the KV handoff of disaggregated serving (``prefill``, ``add_prefilled``: the
blocks are read from, or written to, the ranks of the group that computes or will own the request),
``warm_up`` and ``generate``.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Optional, Sequence

from pipeline.engine.core.engine import LLMEngine, generate
from pipeline.engine.protocol import (EngineOutput, EngineRequest, EngineStats, ReplicaBroken,
                                      SamplingParams, StepFailed)
from pipeline.engine.sharding.dist_runner import DPRunner


class DPEngine:
    def __init__(self, groups: list[LLMEngine], runner: DPRunner):
        self.groups, self.runner = groups, runner
        self.loaded, self.tokenizer = groups[0].loaded, groups[0].tokenizer
        self.config = replace(groups[0].config, num_blocks=groups[0].config.num_blocks * len(groups))
        self._group_of: dict[str, int] = {}     # request_id -> the group holding it
        self.steps = 0

    # ----- the interface --------------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        if request.request_id in self._group_of:
            raise ValueError(f"request id {request.request_id!r} is already in this engine")
        g = self._least_loaded()
        self.groups[g].add(request)
        self._group_of[request.request_id] = g

    def abort(self, request_id: str) -> None:
        g = self._group_of.pop(request_id, None)
        if g is not None:
            self.groups[g].abort(request_id)

    def step(self) -> list[EngineOutput]:
        work = [g.begin_step() for g in self.groups]
        if any(w.spans for w in work):
            try:
                logits = self.runner.forward_dp([(w.spans, w.rows) if w.spans else None for w in work])
                drafts = [g.sampled(w, lg) if w.spans else None for g, w, lg in zip(self.groups, work, logits)]
                if any(d is not None for d in drafts):
                    mtp = self.runner.mtp_dp([(d.spans, d.hidden_rows, d.rows) if d else None for d in drafts])
                    for d, lg in zip(drafts, mtp):
                        if d is not None:
                            LLMEngine.drafted(d, lg)
            except ReplicaBroken:
                raise
            except Exception as e:
                failed = [g.step_failed(e) for g in self.groups]
                self._done(o for f in failed for o in f.outputs)
                raise StepFailed(str(failed[0]), [o for f in failed for o in f.outputs]) from e
        outputs = [o for g, w in zip(self.groups, work) for o in g.end_step(w)]
        self.steps += 1
        self._done(outputs)
        return outputs

    def stats(self) -> EngineStats:
        per = [g.stats() for g in self.groups]
        total = {f.name: sum(getattr(s, f.name) for s in per) for f in fields(EngineStats)}
        return EngineStats(**{**total, "steps": self.steps})

    @property
    def has_work(self) -> bool:
        return any(g.has_work for g in self.groups)

    @property
    def max_model_len(self) -> int:
        return self.groups[0].max_model_len

    # ----- the rest -------------------------------------------------------------------------------------
    def _done(self, outputs) -> None:
        for o in outputs:
            if o.finished:
                self._group_of.pop(o.request_id, None)

    def _least_loaded(self) -> int:
        return min(range(len(self.groups)), key=lambda g: len(self.groups[g].scheduler.running)
                   + len(self.groups[g].scheduler.waiting))

    def kv_layout(self) -> dict:
        return self.groups[0].kv_layout()

    def prefill(self, request: EngineRequest):
        """LLMEngine.prefill in the least loaded group, every group stepping; the blocks read from that
        group's ranks (DPRunner.read_blocks_dp)."""
        g = self._least_loaded()
        return self.groups[g].prefill(request, step=self.step,
                                      read=lambda blocks: self.runner.read_blocks_dp(g, blocks))

    def add_prefilled(self, request: EngineRequest, kv) -> None:
        """LLMEngine.add_prefilled into the least loaded group: the blocks go to that group's ranks."""
        if request.request_id in self._group_of:
            raise ValueError(f"request id {request.request_id!r} is already in this engine")
        g = self._least_loaded()
        self.groups[g].add_prefilled(request, kv,
                                     write=lambda blocks, data: self.runner.write_blocks_dp(g, blocks, data))
        self._group_of[request.request_id] = g

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
        return generate(self, prompts, params)
