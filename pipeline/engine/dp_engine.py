"""A DP-attention replica's engine (pipeline.parallel: dp > 1): one scheduler and KV cache per dp group,
all groups stepped in lockstep through one :class:`~pipeline.engine.dist_runner.DPRunner`.

Each group is an :class:`~pipeline.engine.engine.LLMEngine` of its own (its sequences, block tables and
sampling), run phase by phase (``begin_step``, the model, ``sampled``, MTP, ``end_step``): every step,
the model runs every group's spans in one call (a group without work runs a one-token step in its scratch
block, so the experts' collectives always have every rank), and each group samples from its own logits.
A request goes to the group with the fewest sequences. The interface is the subset of LLMEngine's that
generation uses (``add_request``, ``step``, ``has_work``, ``generate``, ``text``, ``abort``); the serving
layer does not take DP-attention replicas yet (they are refused there).
"""

from __future__ import annotations

from typing import Sequence

from pipeline.engine.dist_runner import DPRunner
from pipeline.engine.engine import LLMEngine
from pipeline.engine.sampling import SamplingParams


class DPEngine:
    def __init__(self, groups: list[LLMEngine], runner: DPRunner):
        self.groups, self.runner = groups, runner
        self.config, self.loaded, self.tokenizer = groups[0].config, groups[0].loaded, groups[0].tokenizer
        self._group_of: dict[int, LLMEngine] = {}

    @property
    def has_work(self) -> bool:
        return any(g.has_work for g in self.groups)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams):
        group = min(self.groups, key=lambda g: len(g.scheduler.running) + len(g.scheduler.waiting))
        seq = group.add_request(prompt_ids, params)
        self._group_of[id(seq)] = group
        return seq

    def abort(self, seq) -> None:
        self._group_of.pop(id(seq)).abort(seq)

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
        return events

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_work:
            self.step()
        for i, s in enumerate(seqs):
            if s.finish_reason == "error":
                raise RuntimeError(f"prompt {i} failed: {self._group_of[id(s)].pop_error(s)}")
        return [s.output for s in seqs]

    def text(self, seq) -> str:
        return self._group_of[id(seq)].text(seq)

    @property
    def acceptance_rate(self) -> float:
        drafts = sum(g.stats.drafts for g in self.groups)
        return sum(g.stats.accepted for g in self.groups) / drafts if drafts else 0.0
