"""msModelSlim's layer-by-layer calibration on the stage actors (docs/recipes.md, "Calibration").

Each layer is calibrated on the previous layers' fake-quantized outputs, every sample in order, so the stages
run one after another: stage k gets stage k-1's outputs (an object reference: the hidden states go from actor
to actor through the object store, never through the driver), calibrates its layers, and writes each
layer's shards as soon as it is calibrated (the first stage the globals too), skipping shards already
committed and verified for the same unit fingerprint (a resumed job still calibrates every layer: the
outputs of a layer are the next one's inputs). The driver stores a commit record per shard written. The
replicas of a stage are not used (the passes cannot be split over samples); the files equal the single
process's (pipeline.quant.calibration.pass_run is the code of both).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import ray

from actors.cluster.ray_errors import app_error, is_retryable
from actors.quantize.ray_session import DistOptions, JobFailed
from pipeline.quant.job import job_state as js
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.writing.shard_layout import GLOBALS, Shard
from pipeline.quant.job.stage import StageSpec


class PassesFailed(JobFailed):
    pass


def run_pass_stages(actors: list[list[Any]], specs: Sequence[StageSpec], samples: Sequence[Sequence[int]],
                    key: js.JobKey, dst: str, shards: Sequence[Shard], dist: DistOptions,
                    log: Callable[[str], None] = print,
                    on_event: Optional[Callable[[str, dict], None]] = None) -> tuple[Stats, dict, list[str]]:
    """Run every stage in order (module doc); returns (statistics, unit -> fingerprint, units written)."""
    of_unit: dict[str, list[Shard]] = {}
    for s in shards:
        of_unit.setdefault(s.unit, []).append(s)
    commits = js.load_commits(dst)
    stats, unit_fp, written = Stats(), {}, []
    state = None
    for sp, row in zip(specs, actors):
        ids = [*sp.layers, *sp.mtp]
        units = ([GLOBALS] if sp.embed else []) + [str(i) for i in ids]
        mine = {u: of_unit[u] for u in units}
        known = {sh.name: commits[sh.name] for u in units for sh in mine[u] if sh.name in commits}
        t = time.monotonic()
        for attempt in range(1, dist.attempts + 1):
            refs = row[0].run_passes.options(num_returns=3).remote(state, [list(s) for s in samples], ids, sp.embed,
                                                                  dst, mine, key, known, dist.verify)
            try:
                st, out = ray.get(refs[1:])
                break
            except Exception as err:  # noqa: BLE001 - classified below
                if not is_retryable(err) or attempt == dist.attempts:
                    raise PassesFailed(f"stage {sp.index} ({sp.label}): {type(app_error(err)).__name__}: "
                                       f"{app_error(err)}") from None
                log(f"calibration: stage {sp.index} lost ({type(err).__name__}); running its layers again")
        state = refs[0]
        stats = stats.merge(st)
        for unit, fp, records, types in out:
            unit_fp[unit] = fp
            if records is None:
                continue
            for sh, rec in zip(of_unit[unit], records):
                c = js.Commit(sh.name, unit, fp, rec, {n: types[n] for n in rec.names})
                js.save_commit(dst, c)
            written.append(unit)
            if on_event is not None:
                on_event("unit", {"unit": unit, "shards": [r.path for r in records]})
        log(f"calibration: stage {sp.index} ({sp.label}) calibrated and written in {time.monotonic() - t:.1f}s "
            f"({sum(1 for u, _, r, _ in out if r is not None)} of {len(out)} units written)")
    return stats, unit_fp, written
