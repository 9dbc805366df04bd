"""The size-aware search: each piece's cost at each rung, the moves up the ladder ordered by measured error
reduction per byte kept above int8, and the fewest bytes above int8 that meet a target, validated on
held-out samples.

Costs: the ``residual`` proxy of pipeline.quant.evaluation.sensitivity per piece and rung (its block rerun on
the float input with only that piece at that rung, the error against the residual stream it joins, as a
noise-to-signal ratio); at FLOAT a piece costs nothing (it is the float weight the output holds).

Moves: per piece, W8A8 -> W8A8_DYNAMIC when that lowers its cost (no byte: the int8 weight stays), then
up to FLOAT, gaining what is left of its cost for its weight bytes above int8. The free moves come first,
largest gain first; then the paid ones by gain per byte. A prefix of that order is a pick whose bytes grow
with its length.

Search (:func:`ladder_search`): the per-layer attention bound of the target first (a layer below it takes
its own attention pieces' moves in order until it meets it, from the attention blocks alone, as
sensitivity.attention_fallback does for whole pieces), then the shortest prefix of the other moves that
meets the whole target on the fitting samples (bisection: it assumes the figures improve along the order,
true in practice, not guaranteed). With held-out samples the pick must meet the target there too: when it
does not, the search goes on along the order until both do. Both figures are reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from pipeline.format.description import FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.quant.evaluation.fallback.rungs import Piece
import torch

from pipeline.quant.evaluation.sensitivity import (FakeQuantParams, FloatReference, Metrics, Target, _db,
                                                   _float_passes, _nsr, linear_costs, quantized)

HOLDOUT_EVERY = 4      # every 4th calibration sample validates the pick instead of fitting it


def split_samples(samples: Sequence, every: int = HOLDOUT_EVERY) -> tuple[list, list]:
    """(fitting, held-out) samples: every ``every``-th one held out (none when there are fewer than
    ``every``)."""
    if every < 2 or len(samples) < every:
        return list(samples), []
    return ([s for k, s in enumerate(samples) if k % every != every - 1],
            [s for k, s in enumerate(samples) if k % every == every - 1])


def rung_costs(ref: FloatReference, pieces: Sequence[Piece], params: FakeQuantParams,
               dynamic: Mapping[str, dict]) -> dict[str, dict[str, float]]:
    """Piece key -> rung -> cost (noise-to-signal ratio against the residual stream): at the recipe's
    type from ``params``, at W8A8_DYNAMIC (static pieces) from ``dynamic`` (module -> its dynamic
    parameters), 0 at FLOAT."""
    out: dict[str, dict[str, float]] = {p.key: {FLOAT: 0.0} for p in pieces}
    for p, cost in _costs(ref, pieces, params).items():
        out[p.key][p.kind] = cost
    static = [p for p in pieces if p.kind == W8A8]
    if static:
        dyn = FakeQuantParams({m: (W8A8_DYNAMIC, dynamic[m]) for p in static for m in p.members})
        for p, cost in _costs(ref, static, dyn).items():
            out[p.key][W8A8_DYNAMIC] = cost
    return out


def _costs(ref: FloatReference, pieces: Sequence[Piece], params: FakeQuantParams) -> dict[Piece, float]:
    """The residual proxy of each piece with ``params``: routed experts from their own tokens
    (:func:`expert_costs`), the rest by rerunning their block (sensitivity.linear_costs)."""
    routed = [p for p in pieces if _routed(p) is not None]
    rest = [p for p in pieces if _routed(p) is None]
    out = expert_costs(ref, routed, params) if routed else {}
    if rest:
        by_key = {p.key: p for p in rest}
        for c in linear_costs(ref, params, "residual", {p.key: list(p.members) for p in rest}):
            out[by_key[c.key]] = c.score
    return out


def _routed(p: Piece) -> Optional[tuple[int, int]]:
    """(layer, expert) of a routed expert's piece, else None."""
    parts = p.members[0].split(".")
    if len(parts) > 5 and parts[3] == "mlp" and parts[4] == "experts" and \
            all(m.split(".")[:6] == parts[:6] for m in p.members):
        return int(parts[2]), int(parts[5])
    return None


@torch.no_grad()
def expert_costs(ref: FloatReference, pieces: Sequence[Piece], params: FakeQuantParams) -> dict[Piece, float]:
    """The residual proxy of routed experts' pieces, from the tokens routed to each expert: with one expert's
    piece quantized, its MoE output changes by the expert's routing weight times its output change on
    those tokens alone, against the residual stream the MoE output joins (the layer's output). The same
    figure as rerunning the MoE block (sensitivity's ``residual``), one expert's tokens at a time."""
    model = ref.model
    layers = sorted({_routed(p)[0] for p in pieces})
    inputs: dict[int, list] = {i: [] for i in layers}
    signal = dict.fromkeys(layers, 0.0)
    hooks = []
    for i in layers:
        layer = model.model.layers[i] if i < len(model.model.layers) else \
            model.mtp_layers[i - model.config.num_hidden_layers]
        hooks.append(layer.mlp.register_forward_pre_hook(
            lambda mod, a, i=i: inputs[i].append(a[0].reshape(-1, a[0].shape[-1]))))
        hooks.append(layer.register_forward_hook(
            lambda mod, a, out, i=i: signal.__setitem__(i, signal[i] + torch.linalg.vector_norm(out.float()).item() ** 2)))
    try:
        _float_passes(model, ref.ids, layers)
    finally:
        for h in hooks:
            h.remove()
    out: dict[Piece, float] = {}
    for p in pieces:
        i, e = _routed(p)
        mlp = model.model.layers[i].mlp if i < len(model.model.layers) else \
            model.mtp_layers[i - model.config.num_hidden_layers].mlp
        noise = 0.0
        for flat in inputs[i]:
            w, idx = mlp.gate(flat)
            t, k = (idx == e).nonzero(as_tuple=True)
            if not len(t):
                continue
            x, g = flat[t], w[t, k].float()[:, None]
            y = mlp.experts[e](x).float() * g
            with quantized(model, params.only(linears=list(p.members))):
                yq = mlp.experts[e](x).float() * g
            noise += torch.linalg.vector_norm(yq - y).item() ** 2
        out[p] = _nsr(_db([signal[i], noise]))
    return out


@dataclass(frozen=True)
class Move:
    """``piece`` up to ``rung``: its cost falls by ``gain`` for ``bytes`` more above int8."""

    piece: Piece
    rung: str
    gain: float
    bytes: int

    def to_dict(self) -> dict:
        return {"key": self.piece.key, "rung": self.rung, "gain": self.gain, "bytes": self.bytes}


def ladder_moves(pieces: Sequence[Piece], costs: Mapping[str, Mapping[str, float]],
                 float_bytes: int = 2) -> list[Move]:
    """Every piece's moves up (module doc), in the order the search takes them."""
    free, paid = [], []
    for p in pieces:
        cur = costs[p.key][p.kind]
        if p.kind == W8A8 and costs[p.key][W8A8_DYNAMIC] < cur:
            free.append(Move(p, W8A8_DYNAMIC, cur - costs[p.key][W8A8_DYNAMIC], 0))
            cur = costs[p.key][W8A8_DYNAMIC]
        paid.append(Move(p, FLOAT, cur, p.extra_bytes(FLOAT, float_bytes)))
    free.sort(key=lambda m: (-m.gain, m.piece.key))
    paid.sort(key=lambda m: (-m.gain / max(m.bytes, 1), m.piece.key))
    return free + paid


def within_budget(moves: Sequence[Move], budget: float) -> list[Move]:
    """The moves in order, those to FLOAT only while their bytes together stay within ``budget`` (a move
    that would pass it is skipped, a smaller later one may still fit)."""
    out, spent = [], 0
    for m in moves:
        if spent + m.bytes <= budget:
            out.append(m)
            spent += m.bytes
    return out


def state_of(moves: Sequence[Move]) -> dict[str, str]:
    """Piece key -> the rung the moves leave it on (pieces no move names keep their type)."""
    out: dict[str, str] = {}
    for m in moves:
        out[m.piece.key] = m.rung
    return out


def params_at(params: FakeQuantParams, pieces: Sequence[Piece], state: Mapping[str, str],
              dynamic: Mapping[str, dict]) -> FakeQuantParams:
    """``params`` with each piece on its rung in ``state``: W8A8_DYNAMIC from ``dynamic``, FLOAT left out."""
    linears = dict(params.linears)
    for p in pieces:
        rung = state.get(p.key, p.kind)
        for m in p.members:
            if rung == FLOAT:
                linears.pop(m, None)
            elif rung != p.kind:
                linears[m] = (rung, dynamic[m])
    return FakeQuantParams(linears, dict(params.fa_k))


@dataclass
class LadderPick:
    """The moves taken (``moves[:n]``, the first ``forced`` of them for the attention bound), whether the
    target is ``met`` (on both sample sets when there are held-out ones), the figures on the fitting and
    held-out samples, and every prefix evaluated on the way."""

    moves: list
    n: int
    forced: int
    met: bool
    metrics: Metrics
    heldout: Optional[Metrics]
    tried: list = field(default_factory=list)

    @property
    def taken(self) -> list[Move]:
        return self.moves[: self.n]

    @property
    def state(self) -> dict[str, str]:
        return state_of(self.taken)

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.taken)

    def keys(self, rung: str) -> list[str]:
        return sorted(k for k, r in self.state.items() if r == rung)

    def to_dict(self) -> dict:
        return {"met": self.met, "moves_taken": self.n, "forced": self.forced, "bytes_above_int8": self.bytes,
                "metrics": self.metrics.to_dict(), "heldout": self.heldout.to_dict() if self.heldout else None,
                "tried": self.tried, "order": [m.to_dict() for m in self.moves]}


def attention_moves(ref: FloatReference, moves: Sequence[Move], bound: Optional[float],
                    at: Callable[[Sequence[Move]], FakeQuantParams]) -> list[Move]:
    """The moves the per-layer attention bound asks for: per layer below it, its attention pieces' moves in
    order until its attention SQNR (float residual in) meets it. [] without a bound."""
    if bound is None:
        return []
    per_layer: dict[int, list[Move]] = {}
    for m in moves:
        if m.piece.attention:
            per_layer.setdefault(m.piece.layer, []).append(m)
    out: list[Move] = []
    for i, mine in sorted(per_layer.items()):
        n = 0
        while n < len(mine) and ref.attention_sqnr(at(mine[:n]), [i]).get(i, math.inf) < bound:
            n += 1
        out.extend(mine[:n])
    return out


def ladder_search(ref: FloatReference, held: Optional[FloatReference], moves: Sequence[Move], target: Target,
                  at: Callable[[Sequence[Move]], FakeQuantParams]) -> LadderPick:
    """The fewest moves (module doc) meeting ``target`` on ``ref``'s samples and on ``held``'s (when
    given); ``at(moves)``: the parameters with those moves made."""
    forced = attention_moves(ref, moves, target.min_attn_sqnr_db, at)
    seq = forced + [m for m in moves if m not in forced]
    fit: dict[int, Metrics] = {}
    out: dict[int, Metrics] = {}

    def on(refs: dict, r: FloatReference, n: int) -> Metrics:
        if n not in refs:
            refs[n] = r.measure(at(seq[:n]))
        return refs[n]

    def meets(n: int, with_held: bool) -> bool:
        return target.met(on(fit, ref, n)) and (not with_held or held is None or target.met(on(out, held, n)))

    def smallest(lo: int, hi: int, with_held: bool) -> tuple[int, bool]:
        """The first n in [lo, hi] that meets (lo - 1 known to miss, or lo the floor), else (hi, False)."""
        if meets(lo, with_held):
            return lo, True
        if not meets(hi, with_held):
            return hi, False
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid, with_held):
                hi = mid
            else:
                lo = mid
        return hi, True

    n, met = smallest(len(forced), len(seq), False)
    if met and held is not None:
        n, met = smallest(n, len(seq), True)
    if held is not None:
        on(out, held, n)
    cum = [0]
    for m in seq:
        cum.append(cum[-1] + m.bytes)
    tried = [{"n": k, "bytes_above_int8": cum[k], "fit": fit[k].to_dict(),
              "heldout": out[k].to_dict() if k in out else None} for k in sorted(fit)]
    return LadderPick(seq, n, len(forced), met, on(fit, ref, n), out.get(n), tried)
