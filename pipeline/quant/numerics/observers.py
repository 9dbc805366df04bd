"""Calibration statistics that merge exactly: per-tensor min/max and the FA3 recall window.

Every statistic is a (lo, hi) pair per row plus a count, merged by lo = min, hi = max, count = sum, so
``merge`` is associative and commutative and the result is bit-identical for any split of the samples
over shards or workers (min and max of floats are exact). Values are kept as Python floats (float64),
which hold every bf16/fp16/fp32 value exactly.

    MinMax:        lo = min over observed values, hi = max (a linear's input, all tokens, padding excluded)
    RecallWindow:  per sample and row, sort the row's N values v; m = max(int(ratio * N), 1);
                   i* = the first i minimising v[i + m - 1] - v[i] (differences in float64);
                   window = (v[i*], v[i* + m - 1]); across samples lo = min, hi = max.

Rows: Q is the absorbed query [B, H, S, C] (one row per head), K and V the latent (one row). A sample
is one sequence (batch of one), so heads never mix across sequences. ``Stats`` maps HF module names
(``model.layers.0.self_attn.q_a_proj``, ``model.layers.0.self_attn.fa_q``) to statistics and
serialises to a columnar dict of lists (one row per name and row), ready for Parquet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch
from torch import Tensor

from pipeline.quant.numerics.qparams import QuantError, check_float

KIND_MINMAX, KIND_WINDOW = "minmax", "recall_window"
COLUMNS = ("name", "kind", "ratio", "row", "lo", "hi", "count")


def _tokens(x: Tensor, mask: Optional[Tensor], name: str) -> Tensor:
    """x [..., k] with mask [...] (True = real token) -> the real tokens' values, flattened."""
    check_float(x, name)
    if mask is None:
        return x.reshape(-1)
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:-1]):
        raise QuantError(f"{name}: mask must be bool of shape {list(x.shape[:-1])}, got "
                         f"{mask.dtype} {list(mask.shape)}")
    return x[mask].reshape(-1)


@dataclass(frozen=True)
class MinMax:
    """Per-tensor min/max of a linear's input; ``count`` = values observed (0: nothing seen)."""

    lo: float = math.inf
    hi: float = -math.inf
    count: int = 0

    @classmethod
    def observe(cls, x: Tensor, mask: Optional[Tensor] = None, name: str = "activation") -> "MinMax":
        """x [..., k] (md), mask [...] bool marking real tokens (padding False)."""
        v = _tokens(x, mask, name)
        if v.numel() == 0:
            return cls()
        return cls(float(v.min()), float(v.max()), int(v.numel()))

    def merge(self, other: "MinMax") -> "MinMax":
        if not isinstance(other, MinMax):
            raise QuantError(f"cannot merge MinMax with {type(other).__name__}")
        return MinMax(min(self.lo, other.lo), max(self.hi, other.hi), self.count + other.count)

    @property
    def rows(self) -> int:
        return 1


def recall_window(rows: Tensor, ratio: float, name: str = "rows") -> tuple[list[float], list[float]]:
    """rows [R, N] -> per row the shortest interval (lo, hi) covering m = max(int(ratio * N), 1)
    consecutive sorted values; the first (lowest) such interval on ties.

    Only the k = N - m + 1 lowest and k highest values can be window ends (v[i] for i < k, v[i + m - 1]
    for i + m - 1 >= N - k), so when 2k <= N (FA3's ratios 0.9999 and 1: k = 1 + N / 10^4 or 1) those are
    taken with ``topk``, O(N), instead of sorting the row: the same order statistics, the same float64
    differences, the same first argmin (:func:`recall_window_sorted` is the reference, and the tests
    compare them). Rows go in chunks of at most ``WINDOW_CHUNK`` values."""
    check_float(rows, name, ndim=2)
    _check_ratio(ratio, name)
    n = rows.shape[1]
    k = n - max(int(ratio * n), 1) + 1
    if 2 * k > n:
        return recall_window_sorted(rows, ratio, name)
    lo, hi = [], []
    step = max(1, WINDOW_CHUNK // n)
    for r in range(0, rows.shape[0], step):
        chunk = rows[r: r + step]
        low = torch.topk(chunk, k, dim=1, largest=False, sorted=True).values.double()        # v[0 .. k-1]
        high = torch.topk(chunk, k, dim=1, largest=True, sorted=True).values.flip(1).double()  # v[N-k .. N-1]
        i = torch.argmin(high - low, dim=1, keepdim=True)      # first minimum, as on the sorted row
        lo.extend(low.gather(1, i).flatten().tolist())
        hi.extend(high.gather(1, i).flatten().tolist())
    return lo, hi


WINDOW_CHUNK = 1 << 22   # values per topk call (V3's Q rows hold S * 512: 2048 tokens -> 4 rows at a time)


def recall_window_sorted(rows: Tensor, ratio: float, name: str = "rows") -> tuple[list[float], list[float]]:
    """The reference for :func:`recall_window`: each row sorted whole, every window's width in float64.
    One row at a time, so memory stays at one row."""
    check_float(rows, name, ndim=2)
    _check_ratio(ratio, name)
    n = rows.shape[1]
    m = max(int(ratio * n), 1)
    lo, hi = [], []
    for r in range(rows.shape[0]):
        v = torch.sort(rows[r]).values.double()
        i = int(torch.argmin(v[m - 1:] - v[: n - m + 1]))
        lo.append(float(v[i]))
        hi.append(float(v[i + m - 1]))
    return lo, hi


def _check_ratio(ratio: float, name: str) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise QuantError(f"{name}: ratio must be a number in (0, 1], got {ratio!r}")


@dataclass(frozen=True)
class RecallWindow:
    """Per-row recall-window ends, min/max-merged across samples; ``count`` = samples merged."""

    ratio: float
    lo: tuple[float, ...] = ()
    hi: tuple[float, ...] = ()
    count: int = 0

    def __post_init__(self):
        _check_ratio(self.ratio, "RecallWindow")
        if len(self.lo) != len(self.hi):
            raise QuantError(f"RecallWindow: {len(self.lo)} lo values but {len(self.hi)} hi values")

    @classmethod
    def observe(cls, rows: Tensor, ratio: float, name: str = "rows") -> "RecallWindow":
        """One sample's rows [R, N] (padding already removed)."""
        lo, hi = recall_window(rows, ratio, name)
        return cls(ratio, tuple(lo), tuple(hi), 1)

    def merge(self, other: "RecallWindow") -> "RecallWindow":
        if not isinstance(other, RecallWindow):
            raise QuantError(f"cannot merge RecallWindow with {type(other).__name__}")
        if self.ratio != other.ratio:
            raise QuantError(f"cannot merge recall windows of ratios {self.ratio} and {other.ratio}")
        if not self.count or not other.count:
            return other if not self.count else self
        if len(self.lo) != len(other.lo):
            raise QuantError(f"cannot merge recall windows of {len(self.lo)} and {len(other.lo)} rows")
        return RecallWindow(self.ratio, tuple(map(min, self.lo, other.lo)), tuple(map(max, self.hi, other.hi)),
                            self.count + other.count)

    @property
    def rows(self) -> int:
        return len(self.lo)


Stat = Union[MinMax, RecallWindow]


@dataclass(frozen=True)
class Stats:
    """HF module name -> statistic. Merge is exact; ``to_dict``/``from_dict`` round-trip bit for bit."""

    entries: Mapping[str, Stat] = field(default_factory=dict)

    def merge(self, other: "Stats") -> "Stats":
        out = dict(self.entries)
        for k, v in other.entries.items():
            out[k] = out[k].merge(v) if k in out else v  # type: ignore[arg-type]
        return Stats(dict(sorted(out.items())))

    def add(self, name: str, stat: Stat) -> "Stats":
        return self.merge(Stats({name: stat}))

    def minmax(self, name: str) -> MinMax:
        return self._get(name, MinMax)  # type: ignore[return-value]

    def window(self, name: str) -> RecallWindow:
        return self._get(name, RecallWindow)  # type: ignore[return-value]

    def _get(self, name: str, kind: type) -> Stat:
        s = self.entries.get(name)
        if s is None:
            raise QuantError(f"{name}: no calibration statistics (was it calibrated? "
                             f"{len(self.entries)} entries present)")
        if not isinstance(s, kind) or not s.count:
            raise QuantError(f"{name}: expected a non-empty {kind.__name__} statistic, got {s!r}")
        return s

    def select(self, prefix: str) -> "Stats":
        """The entries whose name starts with ``prefix`` (e.g. one layer's ``model.layers.3.``)."""
        return Stats({k: v for k, v in self.entries.items() if k.startswith(prefix)})

    # ----- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, list]:
        """Columnar: one row per (name, row) with columns name, kind, ratio (None for minmax), row,
        lo, hi, count."""
        cols: dict[str, list] = {c: [] for c in COLUMNS}
        for name, s in sorted(self.entries.items()):
            if isinstance(s, MinMax):
                rows = [(KIND_MINMAX, None, 0, s.lo, s.hi)]
            else:
                rows = [(KIND_WINDOW, s.ratio, r, lo, hi) for r, (lo, hi) in enumerate(zip(s.lo, s.hi))]
            for kind, ratio, r, lo, hi in rows:
                for c, v in zip(COLUMNS, (name, kind, ratio, r, lo, hi, s.count)):
                    cols[c].append(v)
        return cols

    @classmethod
    def from_dict(cls, cols: Mapping[str, list]) -> "Stats":
        if set(cols) != set(COLUMNS):
            raise QuantError(f"stats: columns {sorted(cols)} differ from {sorted(COLUMNS)}")
        lengths = {c: len(cols[c]) for c in COLUMNS}
        if len(set(lengths.values())) > 1:
            raise QuantError(f"stats: columns differ in length {lengths}")
        grouped: dict[str, list[tuple]] = {}
        for row in zip(*(cols[c] for c in COLUMNS)):
            grouped.setdefault(row[0], []).append(row[1:])
        out: dict[str, Stat] = {}
        for name, rows in grouped.items():
            kinds = {r[0] for r in rows}
            count = rows[0][5]
            if len(kinds) != 1 or any(r[5] != count for r in rows):
                raise QuantError(f"stats: rows of {name!r} disagree on kind or count")
            if kinds == {KIND_MINMAX}:
                if len(rows) != 1:
                    raise QuantError(f"stats: minmax {name!r} has {len(rows)} rows")
                out[name] = MinMax(float(rows[0][3]), float(rows[0][4]), int(count))
            elif kinds == {KIND_WINDOW}:
                rows = sorted(rows, key=lambda r: r[2])
                if [r[2] for r in rows] != list(range(len(rows))) or len({r[1] for r in rows}) != 1:
                    raise QuantError(f"stats: recall window {name!r} has bad row indices or mixed ratios")
                out[name] = RecallWindow(float(rows[0][1]), tuple(float(r[3]) for r in rows),
                                         tuple(float(r[4]) for r in rows), int(count))
            else:
                raise QuantError(f"stats: unknown kind {sorted(kinds)} for {name!r}")
        return cls(dict(sorted(out.items())))
