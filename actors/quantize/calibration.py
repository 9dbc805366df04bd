"""The calibration passes on the stage actors, pipelined: every sample's chain of stage calls is
submitted at once (each stage's output goes to the next through the object store), so stage k works on
sample j while stage k+1 works on sample j-1. At most ``in_flight`` samples per replica chain are
unfinished at a time (backpressure). Samples go round-robin to the replica chains.

Each call returns that (sample, stage)'s statistics; the driver keeps one result per (sample, stage) and
merges them in sample order at the end, so the result does not depend on timing, on replicas, or on
how often a sample was redone. A sample whose chain fails for a retryable reason (lost actor, node or
object) is resubmitted whole, up to ``attempts`` times; any other error fails the job at once. A chain
whose actor is met restarting waits for it (a backoff) without spending an attempt, for up to
``restart_wait_s``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

import ray

from actors.cluster.ray_errors import Restarts, app_error, is_restarting, is_retryable
from actors.quantize.ray_session import DistOptions, JobFailed
from pipeline.quant.job.stage import STATS


class CalibrationFailed(JobFailed):
    pass


def run_pass(actors: list[list[Any]], kind: str, samples: Sequence[Sequence[int]], dist: DistOptions,
             smoothing: Optional[Any] = None, log: Callable[[str], None] = print,
             on_event: Optional[Callable[[str, dict], None]] = None) -> list[list[Any]]:
    """results[sample][stage] of one pass (``kind``: STATS or SMOOTH). ``smoothing``: an object ref to
    (key, statistics, alpha) for the STATS pass of a smoothed recipe."""
    n_stages, n_rep = len(actors), len(actors[0])
    results: list[list[Any]] = [[None] * n_stages for _ in samples]
    remaining: dict[int, set[int]] = {}          # sample -> stages not yet returned (current attempt)
    gen = [0] * len(samples)                       # attempt number of each sample (tells stale results)
    lost = [0] * len(samples)                      # attempts lost (an actor met restarting is not one)
    pending: dict[Any, tuple[int, int, int]] = {}  # ref -> (sample, stage, attempt)
    queue = deque(range(len(samples)))
    open_per_rep = [0] * n_rep
    done_per_stage = [0] * n_stages
    t0 = last_log = time.monotonic()

    def submit(j: int) -> None:
        r = j % n_rep
        h = None
        for k in range(n_stages):
            h, st = actors[k][r].forward.options(num_returns=2).remote(
                kind, list(samples[j]), h, smoothing if kind == STATS else None)
            pending[st] = (j, k, gen[j])
        remaining[j] = set(range(n_stages))

    restarts = Restarts(dist.restart_wait_s)
    while queue or pending:
        # top up each replica chain (a redone sample goes first: it is at the queue's head)
        now = time.monotonic()
        while queue:
            j = queue[0]
            redo = j in remaining
            if not redo and open_per_rep[j % n_rep] >= dist.in_flight:
                break
            if any(restarts.resting((k, j % n_rep), now) for k in range(n_stages)):
                break  # its chain has an actor met restarting: wait for it
            queue.popleft()
            if not redo:
                open_per_rep[j % n_rep] += 1
            submit(j)
        ready = restarts.wait(pending, dist.progress_s)
        for ref in ready:
            j, k, g = pending.pop(ref)
            if g != gen[j]:
                continue  # an earlier attempt of a redone sample
            try:
                results[j][k] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - classified below
                if not is_retryable(err):
                    raise CalibrationFailed(f"{kind} pass, sample {j}, stage {k}: {app_error(err)}") from app_error(err)
                gen[j] += 1
                if is_restarting(err) and restarts.met((k, j % n_rep), time.monotonic()):
                    log(f"calibration {kind}: sample {j} met a restarting actor at stage {k}; redoing it once it is back")
                    queue.appendleft(j)
                    continue
                lost[j] += 1
                if lost[j] >= dist.attempts:
                    raise CalibrationFailed(f"{kind} pass: sample {j} failed {lost[j]} times; last at stage {k}: "
                                            f"{type(err).__name__}: {err}") from err
                log(f"calibration {kind}: sample {j} lost at stage {k} ({type(err).__name__}); redoing it")
                queue.appendleft(j)
                continue
            restarts.back((k, j % n_rep))
            remaining[j].discard(k)
            done_per_stage[k] += 1
            if on_event is not None:
                on_event("sample", {"pass": kind, "sample": j, "stage": k})
            if not remaining[j]:
                del remaining[j]
                open_per_rep[j % n_rep] -= 1
        now = time.monotonic()
        if now - last_log >= dist.progress_s or (not queue and not pending):
            rate = ", ".join(f"stage {k}: {d}/{len(samples)} ({d / max(now - t0, 1e-9):.2f}/s)"
                             for k, d in enumerate(done_per_stage))
            log(f"calibration {kind}: {rate}")
            last_log = now
    return results
