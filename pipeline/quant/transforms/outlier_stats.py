"""What msModelSlim's anti-outlier steps observe: the input of each subgraph's first target linear.

msModelSlim runs each calibration sample as its own forward (a batch of one, no padding) and observes in
the activation's dtype (bf16 for a bf16 model: every value below is a value of that dtype):

    iter_smooth (per channel j; sample k's tokens x_k):
        lo_k, hi_k  = running min / max of x over samples 1..k
        shift_k     = (hi_k + lo_k) / 2                       (two roundings to the dtype)
        symmetric:  a_j = max over k, tokens of |x|
        shifted:    a_j = max over k, tokens of |x_k - shift_k|  (each sample against the shift so far)
                    shift = shift_K (after the last sample)
    flex_smooth_quant: every token's row (the alpha/beta search multiplies them) and a_j = max |x|.

The shifted maximum depends on the order of the samples, so :class:`ChannelTrace` keeps each sample's
per-channel min and max and replays msModelSlim's order: max_t |x_t - c| = max(|hi - c|, |lo - c|)
for the sample's extremes (rounding to the dtype is monotonic, so the extremes give the same bits as
every token). Both observers merge by concatenation: ``a.merge(b)`` means a's samples come before b's
(shards of the samples merge in sample order, and the result is what one process would have seen).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from pipeline.quant.numerics.qparams import QuantError, check_float
from pipeline.quant.transforms.subgraphs import Subgraph

# The real lengths of the rows of a right-padded batch being run, or None when nothing is padded.
Lengths = Callable[[], Optional[Sequence[int]]]


def _samples(x: Tensor, lengths: Optional[Sequence[int]], name: str) -> list[Tensor]:
    """One input [..., k] -> each sample's real token rows [n, k]. A 3-D input [B, S, k] holds B samples
    (padded to S when ``lengths``); any other shape is one sample's rows (a routed expert's tokens)."""
    check_float(x, name, finite=False)
    if x.dim() == 3:
        if lengths is not None and len(lengths) != x.shape[0]:
            raise QuantError(f"{name}: {len(lengths)} lengths for a batch of {x.shape[0]}")
        return [x[b, : (lengths[b] if lengths is not None else x.shape[1])] for b in range(x.shape[0])]
    if lengths is not None:
        raise QuantError(f"{name}: rows of padded samples cannot be told apart (shape {list(x.shape)}); "
                         "observe these statistics one sample per forward")
    return [x.reshape(-1, x.shape[-1])]


@dataclass
class ChannelTrace:
    """Per sample (in sample order), the per-channel min and max of its tokens, in the activation's dtype."""

    lo: list[Tensor] = field(default_factory=list)
    hi: list[Tensor] = field(default_factory=list)

    def observe(self, x: Tensor, lengths: Optional[Sequence[int]] = None, name: str = "activation") -> None:
        for rows in _samples(x, lengths, name):
            if rows.shape[0]:
                self.lo.append(rows.detach().amin(0))
                self.hi.append(rows.detach().amax(0))

    def merge(self, other: "ChannelTrace") -> "ChannelTrace":
        return ChannelTrace(self.lo + other.lo, self.hi + other.hi)

    @property
    def samples(self) -> int:
        return len(self.lo)

    def absmax(self) -> Tensor:
        """max |x| per channel over every token (the dtype's values)."""
        self._check()
        return torch.maximum(torch.stack(self.hi).amax(0).abs(), torch.stack(self.lo).amin(0).abs())

    def shifted_absmax(self) -> tuple[Tensor, Tensor]:
        """(a, shift) of the shifted form, replaying msModelSlim's running shift (module docstring)."""
        self._check()
        lo = hi = a = shift = None
        for lo_k, hi_k in zip(self.lo, self.hi):
            lo = lo_k if lo is None else torch.min(lo, lo_k)
            hi = hi_k if hi is None else torch.max(hi, hi_k)
            shift = (hi + lo) / 2
            m = torch.maximum((hi_k - shift).abs(), (lo_k - shift).abs())
            a = m if a is None else torch.max(a, m)
        return a, shift

    def _check(self) -> None:
        if not self.lo:
            raise QuantError("no activation observed (the subgraph's linear saw no token)")


@dataclass
class ActivationRows:
    """Every token's row (in sample order), in the activation's dtype (flex_smooth_quant's search input)."""

    rows: list[Tensor] = field(default_factory=list)

    def observe(self, x: Tensor, lengths: Optional[Sequence[int]] = None, name: str = "activation") -> None:
        self.rows += [r.detach().clone() for r in _samples(x, lengths, name) if r.shape[0]]

    def merge(self, other: "ActivationRows") -> "ActivationRows":
        return ActivationRows(self.rows + other.rows)

    @property
    def samples(self) -> int:
        return len(self.rows)

    def tensor(self) -> Tensor:
        """All rows [N, k], in sample order."""
        if not self.rows:
            raise QuantError("no activation observed (the subgraph's linear saw no token)")
        return torch.cat(self.rows, 0)


Observer = Union[ChannelTrace, ActivationRows]


@contextmanager
def observing_subgraphs(model: nn.Module, subgraphs: Sequence[Subgraph], kind: type,
                        lengths: Optional[Lengths] = None) -> Iterator[dict[str, Observer]]:
    """While active, forwards of ``model`` (modules found by their HF names, e.g. the float model of
    pipeline.model or the layer-wise host) feed the yielded ``{observed module name: kind()}``, one per
    subgraph (``kind``: ChannelTrace for iter_smooth, ActivationRows for flex_smooth_quant). ``lengths``
    tells the real lengths of a padded batch (e.g. ``lambda: collector.lengths``); padding is skipped."""
    if kind not in (ChannelTrace, ActivationRows):
        raise QuantError(f"observing_subgraphs: kind must be ChannelTrace or ActivationRows, got {kind!r}")
    stats: dict[str, Observer] = {}
    handles = []

    def hook(name: str):
        def pre_hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], Tensor) and args[0].numel():
                stats[name].observe(args[0], lengths() if lengths is not None else None, name)
        return pre_hook

    try:
        for sg in subgraphs:
            if sg.observed not in stats:
                stats[sg.observed] = kind()
                handles.append(model.get_submodule(sg.observed).register_forward_pre_hook(hook(sg.observed)))
        yield stats
    finally:
        for h in handles:
            h.remove()
