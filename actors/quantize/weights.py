"""The weight phase on the actors: each unit still to do (the globals or a layer) goes to the next free
actor, one unit per actor at a time (a unit's weights are what bounds an actor's memory), largest first,
an actor taking its own stage's layers first (it holds their weights from calibration and need not read
them again) and then any unit left (read from the source), so that no actor idles while work remains.
An actor writes the unit's shards straight to the destination and returns their records; the driver
stores a commit record per shard as each unit returns (what a rerun trusts). A unit lost for a retryable
reason is redone, up to ``attempts`` times, on whichever actor is free; other errors are not retried. An
actor met restarting rests (a backoff) and the unit goes to another, without spending an attempt, for up
to ``restart_wait_s``.
The job fails at the end with every failed unit's shards named."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Mapping, Optional, Sequence

import ray

from actors.cluster.ray_errors import Restarts, app_error, is_restarting, is_retryable
from actors.quantize.ray_session import DistOptions, JobFailed
from pipeline.quant.writing.shard_layout import Shard


class WeightsFailed(JobFailed):
    def __init__(self, failed: Mapping[str, str], shards: Sequence[Shard]):
        self.failed = dict(failed)
        self.shards = [s.name for s in shards if s.unit in failed]
        lines = [f"  unit {u}: {why}" for u, why in failed.items()]
        super().__init__(f"{len(self.shards)} shards failed: {', '.join(self.shards)}\n" + "\n".join(lines))


def run_weights(actors: Sequence[tuple[int, Any]], owner: Mapping[str, Optional[int]], units: Sequence[str],
                shards: Sequence[Shard], dst: str, stats_ref: Any, smooth_ref: Any, alpha: float,
                smoothing_key: Optional[str], dist: DistOptions, on_unit: Callable[[str, list, dict], None],
                log: Callable[[str], None] = print,
                on_event: Optional[Callable[[str, dict], None]] = None) -> dict:
    """Quantize and write ``units`` on ``actors`` ((stage, handle) pairs; ``owner``: the stage holding
    each unit, None for none); ``on_unit(unit, records, types)`` as each completes. Returns throughput
    figures; raises WeightsFailed naming every failed shard."""
    of_unit: dict[str, list[Shard]] = {}
    for s in shards:
        of_unit.setdefault(s.unit, []).append(s)
    size = {u: sum(s.nbytes for s in of_unit[u]) for u in units}
    queue = sorted(units, key=lambda u: -size[u])
    free = deque(actors)
    pending: dict[Any, tuple[str, tuple[int, Any]]] = {}
    attempts: dict[str, int] = {}
    failed: dict[str, str] = {}
    written = 0
    t0 = last_log = time.monotonic()
    done = 0
    restarts = Restarts(dist.restart_wait_s)
    while queue or pending:
        now = time.monotonic()
        ready_free = [a for a in free if not restarts.resting(a[1], now)]
        for a in ready_free:
            free_stages = {f[0] for f in ready_free if f in free}
            u = next((u for u in queue if owner.get(u) == a[0]), None)  # its own layer first
            if u is None:  # else one whose owner is busy (or none): never one its free owner will take
                u = next((u for u in queue if owner.get(u) is None or owner[u] not in free_stages), None)
            if u is None:
                continue
            free.remove(a)
            queue.remove(u)
            pending[a[1].write_unit.remote(dst, of_unit[u], stats_ref, smooth_ref, alpha, smoothing_key)] = (u, a)
        ready = restarts.wait(pending, dist.progress_s)
        for ref in ready:
            u, a = pending.pop(ref)
            free.append(a)
            try:
                records, types = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - classified below
                if is_restarting(err) and restarts.met(a[1], time.monotonic()):
                    log(f"weights: unit {u} met a restarting actor (stage {a[0]}); redoing it once it is back")
                    queue.insert(0, u)
                    continue
                attempts[u] = attempts.get(u, 0) + 1
                if is_retryable(err) and attempts[u] < dist.attempts:
                    log(f"weights: unit {u} lost ({type(err).__name__}); redoing it")
                    queue.insert(0, u)
                else:
                    failed[u] = f"{type(app_error(err)).__name__}: {app_error(err)}"
                    log(f"weights: unit {u} failed: {failed[u]}")
                continue
            restarts.back(a[1])
            on_unit(u, records, types)
            done += 1
            written += sum(r.size for r in records)
            if on_event is not None:
                on_event("unit", {"unit": u, "shards": [r.path for r in records]})
        now = time.monotonic()
        if now - last_log >= dist.progress_s or (not queue and not pending):
            el = max(now - t0, 1e-9)
            log(f"weights: {done}/{len(units)} units, {written / 2**20:.1f} MiB written ({written / 2**20 / el:.1f} MiB/s)")
            last_log = now
    if failed:
        raise WeightsFailed(failed, shards)
    return {"units": done, "bytes_written": written, "seconds": round(time.monotonic() - t0, 3)}
