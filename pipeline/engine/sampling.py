"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1.0 disable those filters. ``stop``: strings that end
    generation (the text is cut before them)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    if p.greedy:
        return logits.argmax(-1)
    x = logits.float() / p.temperature
    if p.top_k:
        kth = x.topk(min(p.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.multinomial(x.softmax(-1), 1, generator=generator).squeeze(-1)


def cut_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any (non-empty) stop string, and whether one occurs."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
