"""Progress bars of a quantize job's phases (tqdm, on stderr), each with its rate: calibration in tokens/s
(samples done in the postfix), the weight phase in bytes written per second (units done in the postfix).
Disabled, every bar is a no-op object with the same methods, so callers never branch."""

from __future__ import annotations

import sys
import time
from typing import Any, Iterator, Sequence


class NoBar:
    n = 0

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


class LineBar(NoBar):
    """Progress as whole lines on stderr, at most one per ``every`` seconds and one at the end: what a
    bar becomes when stderr is not a terminal (a log file, ``ray job submit``, a collector), where tqdm's
    carriage-return redraws would pile up as thousands of fragments."""

    def __init__(self, desc: str, total: float, unit: str, every: float = 10.0):
        self.desc, self.total, self.unit, self.every = desc, total, unit, every
        self.t0 = self.last = time.monotonic()
        self.postfix = ""

    def _line(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        pct = 100.0 * self.n / self.total if self.total else 100.0
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {pct:.0f}% ({_si(self.n)}/{_si(self.total)} {self.unit}, "
              f"{_si(self.n / dt)} {self.unit}/s{extra})", file=sys.stderr, flush=True)

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._line()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        self._line()


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def bar(enabled: bool, desc: str, total: float, unit: str, unit_scale: bool = False) -> Any:
    """A tqdm bar on a terminal, whole lines (LineBar) elsewhere, a NoBar when not ``enabled``."""
    if not enabled:
        return NoBar()
    if not sys.stderr.isatty():
        return LineBar(desc, total, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, dynamic_ncols=True, leave=True)


def calibration_bar(enabled: bool, samples: Sequence[Sequence[int]], desc: str = "calibrate") -> Any:
    """A bar over the samples' tokens (rate: tokens/s)."""
    return bar(enabled, desc, sum(len(s) for s in samples), "tok", unit_scale=True)


def weights_bar(enabled: bool, total_bytes: int, units: int, desc: str = "weights") -> Any:
    """A bar over the bytes the weight phase writes (rate: B/s); postfix: units done of ``units``."""
    b = bar(enabled, desc, total_bytes, "B", unit_scale=True)
    b.set_postfix_str(f"0/{units} units")
    return b


def over_samples(samples: Sequence[Sequence[int]], enabled: bool, desc: str = "calibrate") -> Iterator:
    """Each sample in turn, the calibration bar advanced by its tokens once the caller is done with it."""
    b = calibration_bar(enabled, samples, desc)
    try:
        for k, s in enumerate(samples):
            yield s
            b.update(len(s))
            b.set_postfix_str(f"{k + 1}/{len(samples)} samples")
    finally:
        b.close()


class JobProgress:
    """The distributed job's bars, fed by its driver events (``on_event``): a calibration bar per pass
    (a sample counts once every stage has returned it) and one weights bar."""

    def __init__(self, enabled: bool, samples: Sequence[Sequence[int]], n_stages: int):
        self.enabled, self.samples, self.n_stages = enabled, samples, n_stages
        self.calib: dict[str, Any] = {}
        self.stages_back: dict[tuple[str, int], set[int]] = {}  # (pass, sample) -> stages returned
        self.done: dict[str, int] = {}
        self.weights: Any = NoBar()
        self.unit_bytes: dict[str, int] = {}
        self.units_done = 0

    def start_weights(self, unit_bytes: dict[str, int]) -> None:
        self.close_calibration()
        self.unit_bytes = dict(unit_bytes)
        self.weights = weights_bar(self.enabled, sum(unit_bytes.values()), len(unit_bytes))

    def event(self, kind: str, info: dict) -> None:
        if kind == "sample":
            p, j = info["pass"], info["sample"]
            if p not in self.calib:
                self.close_calibration()
                self.calib[p] = calibration_bar(self.enabled, self.samples, f"calibrate ({p})")
                self.done[p] = 0
            back = self.stages_back.setdefault((p, j), set())
            before = len(back)
            back.add(info["stage"])  # a redone sample's stages come back again: counted once
            if before < self.n_stages == len(back):
                self.done[p] += 1
                self.calib[p].update(len(self.samples[j]))
                self.calib[p].set_postfix_str(f"{self.done[p]}/{len(self.samples)} samples")
        elif kind == "unit":
            self.units_done += 1
            self.weights.update(self.unit_bytes.get(info["unit"], 0))
            self.weights.set_postfix_str(f"{self.units_done}/{len(self.unit_bytes)} units")

    def close_calibration(self) -> None:
        for b in self.calib.values():
            b.close()

    def close(self) -> None:
        self.close_calibration()
        self.weights.close()
