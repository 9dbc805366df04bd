"""The distributed quantization job (the driver): plan, calibrate on pipelined stage actors, reduce,
quantize and write the shards on the actors, then the index and description last.

::

    quantize_distributed(src, dst, Recipe(), QuantizeOptions(), DistOptions(stages=2, replicas=1))

1. Plan: stage ranges from :func:`pipeline.quant.plan.planner.plan` (balanced by bytes and FLOPs), checked against the
   resources Ray reports; the output's shards from :mod:`pipeline.quant.writing.shard_layout` (the single-process
   writer's rule, so the files are the same).
2. Destination (:mod:`pipeline.quant.job.job_state`), after every input is checked
   (:func:`pipeline.quant.job.preflight.check_job`): a finished output of the same job fingerprint: nothing
   to do, said in one line. Otherwise it stops looking complete, and an earlier run's state is kept; with
   ``overwrite`` an earlier output stays whole while the new one is written in a hidden sibling
   directory (:func:`pipeline.quant.job.job_state.staging_dir`), swapped in at the end.
3. Calibration (:mod:`actors.quantize.calibration`), skipped when ``.dsquant/calibration.parquet`` holds the same
   calibration fingerprint: with smoothing, a smoothing pass, its statistics reduced and folded into
   every stage; then the W8A8/FA3 pass; statistics reduced exactly (min/max) across samples and replicas
   and saved. Not run at all for a data-free recipe (``Recipe.needs_calibration``: no static linear, no
   FA3, no smoothing): no calibration data or tokenizer is read, no stage loads its layers, and the
   weight phase reads every unit from the source, once.
4. Weights (:mod:`actors.quantize.weights`): every unit whose shards are not committed and verified for the
   current unit fingerprint is quantized and written by a free actor; a commit record per shard.
5. Finish: every shard checked against its record, stale files removed, then config, copies, manifest
   (with the job fingerprint), index, description (:func:`pipeline.quant.writing.output_files.finalize`), and a
   job summary (time per phase, bytes, throughput, peak memory per actor) in ``job_summary.json``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import ray

from actors.quantize.calibration import run_pass
from actors.quantize.pass_stages import run_pass_stages
from actors.quantize.ray_session import DistOptions, cluster_resources, connect, make_actors
from actors.quantize.weights import run_weights
from pipeline.io import storage
from pipeline.io.destination.lock import DestinationLock
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.plan.planner import plan as make_plan
from pipeline.quant.plan.resources import check_resources
from pipeline.quant.job import job_state as js
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.writing.output_files import finalize, json_bytes
from pipeline.quant.job.run import QuantizeOptions, recipe_files
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.writing.shard_layout import checkpoint_shards
from pipeline.quant.transforms.recipe_plan import RecipePlan
from pipeline.quant.transforms.smooth import ChannelAbsMax
from pipeline.quant.job.stage import SMOOTH, STATS, StageSpec, even_ranges, split_stages
from pipeline.quant.job.stats_io import load_calibration, save_calibration
from pipeline.quant.job.estimate import announce
from pipeline.quant.job.preflight import check_job, data_free_notes
from pipeline.quant.calibration.progress import JobProgress

Log = Callable[[str], None]


def stage_specs(reader: CheckpointReader, recipe: Recipe, dist: DistOptions, seq_len: int, n_samples: int,
                shard_bytes: int):
    """(StageSpecs from the planner's balanced ranges, the plan)."""
    cfg = reader.config
    L = cfg.num_hidden_layers
    if not 1 <= dist.stages <= L:
        raise ValueError(f"stages must be 1..{L} (the model's main layers), got {dist.stages}")
    pl = make_plan(reader, dist.stages, dist.replicas, recipe, calib_tokens=max(1, seq_len * n_samples),
                   seq_len=seq_len, shard_bytes=shard_bytes, cpus_per_actor=dist.cpus_per_actor,
                   gpus_per_actor=dist.gpus_per_actor)
    ranges = []
    for st in pl.stages:
        main = [int(u) for u in st.units if u.isdigit() and int(u) < L]
        ranges.append((main[0], main[-1] + 1) if main else None)
    if None in ranges or len(ranges) != dist.stages:
        ranges = even_ranges(L, dist.stages)
    return split_stages(L, cfg.mtp_layer_ids, ranges), pl


def merge_stats(results) -> Stats:
    out = Stats({})
    for per_sample in results:
        for part in per_sample:
            out = out.merge(part)
    return out


def merge_smoothing(results) -> dict[str, ChannelAbsMax]:
    acc: dict[str, ChannelAbsMax] = {}
    for per_sample in results:
        for part in per_sample:
            for k, v in part.items():
                acc[k] = acc[k].merge(v) if k in acc else v
    return dict(sorted(acc.items()))


def _calibrate(actors, samples, plan: RecipePlan, opts: QuantizeOptions, dist: DistOptions, key: js.JobKey,
               dst: str, log: Log, on_event, phases: dict):
    path = js.state_path(dst, js.CALIBRATION_NAME)
    if storage.exists(path):
        try:
            stats, smooth, meta = load_calibration(path)
            if meta.get("calibration") == key.calibration:
                log(f"calibration: reusing {path} (same source, recipe and samples)")
                return stats, (smooth or None)
        except Exception as e:  # noqa: BLE001 - an unreadable file is redone, not fatal
            log(f"calibration: ignoring {path} ({e})")
    t = time.time()
    for ref in [a.load.remote() for row in actors for a in row]:  # every stage loads its layers at once
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a lost actor reloads on its first sample; anything else fails there
            log(f"calibration: a stage failed to load ({type(e).__name__}); its first sample retries")
    phases["load_s"] = round(time.time() - t, 3)

    def smoothing_pass() -> dict[str, ChannelAbsMax]:
        t = time.time()
        out = merge_smoothing(run_pass(actors, SMOOTH, samples, dist, log=log, on_event=on_event))
        phases["calibration_smooth_s"] = round(time.time() - t, 3)
        return out

    smooth = plan.smoothing.collect(smoothing_pass)  # dsquant's smoothing: a pass of its own first
    t = time.time()
    smoothing = ray.put((key.calibration, smooth, opts.smooth_alpha)) if smooth else None
    stats = merge_stats(run_pass(actors, STATS, samples, dist, smoothing, log=log, on_event=on_event))
    phases["calibration_stats_s"] = round(time.time() - t, 3)
    save_calibration(path, stats, smooth, meta={"calibration": key.calibration})
    return stats, smooth


def _weight_phase(actors, specs, reader, recipe: Recipe, opts: QuantizeOptions, dist: DistOptions, key, work: str,
                  shards, units, stats, smooth, bars, log: Log, event, phases: dict):
    """The units still to write, quantized and written on the actors (actors.quantize.weights); returns (throughput
    figures, units written, commits, unit fingerprints)."""
    t = time.time()
    unit_fp = {u: key.unit(reader, u, stats, smooth) for u in units}
    commits = js.load_commits(work)
    done = {s.name: js.verify_shard(work, s, commits.get(s.name), unit_fp[s.unit], dist.verify) for s in shards}
    todo = js.units_to_redo(shards, done)
    log(f"weights: {len(todo)} of {len(units)} units to write ({len(units) - len(todo)} committed and verified)")

    def on_unit(u: str, records, types) -> None:
        for sh, rec in zip([s for s in shards if s.unit == u], records):
            c = js.Commit(sh.name, u, unit_fp[u], rec, {n: types[n] for n in rec.names})
            js.save_commit(work, c)
            commits[sh.name] = c

    bars.start_weights({u: sum(s.nbytes for s in shards if s.unit == u) for u in todo})
    # the layers each stage holds, as Stage loads them
    held = [(sp, (*sp.layers, *(i for i in sp.mtp if recipe.quantized_layer(reader.config, i)))) for sp in specs]
    owner = {str(i): sp.index for sp, ids in held for i in ids}
    weights = run_weights([(sp.index, a) for sp, row in zip(specs, actors) for a in row], owner, todo, shards,
                          work, ray.put(stats), ray.put(smooth), opts.smooth_alpha,
                          key.calibration if smooth else None, dist, on_unit, log, event)
    phases["weights_s"] = round(time.time() - t, 3)
    return weights, todo, commits, unit_fp


def _actor_info(actors, specs: list[StageSpec]) -> list[dict]:
    out = []
    for sp, row in zip(specs, actors):
        for r, a in enumerate(row):
            try:
                info = ray.get(a.info.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - a summary line, not a failure
                info = {"error": f"{type(e).__name__}"}
            out.append({"stage": sp.index, "replica": r, "layers": sp.label, **info})
    return out


def quantize_distributed(src: str, dst: str, recipe: Recipe, opts: QuantizeOptions = QuantizeOptions(),
                         dist: DistOptions = DistOptions(), log: Log = print,
                         on_event: Optional[Callable[[str, dict], None]] = None) -> dict:
    """Run the job (module doc); returns its summary. ``on_event(kind, info)`` is called for each
    calibration (sample, stage) and each unit written, in the driver (progress hooks, tests)."""
    t0 = time.time()
    checked = check_job(src, dst, recipe, opts, resumable=True)  # every input, before Ray starts
    reader, samples = checked.reader, checked.samples
    key = js.JobKey.of(reader, recipe, samples, smooth_alpha=opts.smooth_alpha, shard_bytes=opts.shard_bytes,
                       mindie_format=opts.mindie_format)
    if not opts.overwrite and js.is_up_to_date(dst, key):
        log(f"{dst}: up to date (source, recipe and calibration data unchanged); nothing to do")
        return {"status": "up-to-date", "fingerprint": key.job, "total_s": round(time.time() - t0, 3)}
    with DestinationLock(dst) as lock:  # one job per destination: a second one stops here, naming this one
        return _run_locked(src, dst, recipe, opts, dist, log, on_event, checked, key, lock, t0)


def _run_locked(src: str, dst: str, recipe: Recipe, opts: QuantizeOptions, dist: DistOptions, log: Log,
                on_event: Optional[Callable[[str, dict], None]], checked, key: "js.JobKey",
                lock: DestinationLock, t0: float) -> dict:
    """The job once ``dst``'s lock is held (``lock.ensure`` before anything in the destination goes)."""
    reader, raw_config, samples = checked.reader, checked.raw_config, checked.samples
    phases: dict[str, float] = {}
    shards = checkpoint_shards(reader, recipe, opts.shard_bytes)
    units = list(dict.fromkeys(s.unit for s in shards))
    data_free = not checked.needs_calibration
    # a data-free job plans as if for one one-token sample: its actors only ever hold one unit at a time
    specs, pl = stage_specs(reader, recipe, dist, max((len(s) for s in samples), default=1), len(samples),
                            opts.shard_bytes)
    final = dst
    # --overwrite of an earlier output: the new one is written beside it and swapped in once complete.
    work = js.staging_dir(final) if opts.overwrite and js.owned_entries(final) else final
    lock.ensure()
    state = js.open_destination(work, opts.overwrite)
    previous = js.load_job(work) if state == "resume" else None
    js.save_job(work, key, status="running")
    phases["plan_s"] = round(time.time() - t0, 3)
    changed = js.changed_files(previous["source"], key.source) if previous else None
    notes = ([f"written in {work} until complete"] if work != final else []) + \
        ([f"changed source files: {', '.join(changed)}"] if changed else [])
    log(f"{src} -> {final} ({'; '.join([state, *notes])}): "
        f"{len(specs)} stages x {dist.replicas} replicas [{', '.join(s.label for s in specs)}], "
        f"{'no calibration' if data_free else f'{len(samples)} samples'}, {len(shards)} shards")
    if data_free:
        for line in data_free_notes(src):
            log(line)
    est = announce(reader, recipe, samples, "cuda" if dist.gpus_per_actor > 0 else "cpu", log,
                   actors=len(specs) * dist.replicas, dst=work) if opts.estimate else None
    bars = JobProgress(opts.progress, samples, len(specs))

    def event(kind: str, info: dict) -> None:
        bars.event(kind, info)
        if on_event is not None:
            on_event(kind, info)

    t = time.time()
    started = connect(dist, len(specs) * dist.replicas)
    actors: list = []
    try:
        check_resources(pl, cluster_resources())
        actors = make_actors(src, specs, recipe, dist)
        phases["ray_start_s"] = round(time.time() - t, 3)
        passes = not data_free and checked.plan.layer_passes
        if passes:  # msModelSlim's passes: the stages in order, each writing its layers as it calibrates them
            t = time.time()
            bars.start_weights({u: sum(s.nbytes for s in shards if s.unit == u) for u in units})
            stats, unit_fp, todo = run_pass_stages(actors, specs, samples, key, work, shards, dist, log, event)
            smooth = None
            commits = js.load_commits(work)
            phases["calibration_weights_s"] = round(time.time() - t, 3)
            weights = {"units": len(todo), "bytes_written": sum(commits[s.name].record.size for s in shards
                                                                if s.unit in todo)}
        elif data_free:  # no stage loads its layers: the weight phase reads every unit from the source, once
            stats, smooth = Stats({}), None
        else:
            stats, smooth = _calibrate(actors, samples, checked.plan, opts, dist, key, work, log, event, phases)
        if not passes:
            weights, todo, commits, unit_fp = _weight_phase(actors, specs, reader, recipe, opts, dist, key, work,
                                                            shards, units, stats, smooth, bars, log, event, phases)

        actor_info = _actor_info(actors, specs)
    finally:
        bars.close()
        for a in (a for row in actors for a in row):  # their CPUs and memory back to the cluster now
            ray.kill(a, no_restart=True)
        if started:
            ray.shutdown()

    t = time.time()
    bad = [s.name for s in shards if not js.verify_shard(work, s, commits.get(s.name), unit_fp[s.unit], "size")]
    if bad:
        raise RuntimeError(f"{work}: shards not committed after the weight phase: {', '.join(bad)}")
    stale = js.remove_stale(work, [s.name for s in shards])
    if stale:
        log(f"removed {len(stale)} files of an earlier layout: {', '.join(stale[:5])}")
    written = sum(commits[s.name].record.size for s in shards if s.unit in todo)
    summary: dict[str, Any] = {
        "status": "done", "fingerprint": key.job, "source": src, "recipe": recipe.to_dict(), "resumed": state == "resume",
        "changed_files": changed or [],
        "stages": [s.label for s in specs], "replicas": dist.replicas, "samples": len(samples),
        "calibration": "none (data-free recipe)" if data_free else "calibrated",
        "units_written": len(todo), "units_kept": len(units) - len(todo), "bytes_written": written,
        "write_mib_s": round(written / 2**20 / max(phases.get("weights_s", phases.get("calibration_weights_s", 0)),
                                                   1e-9), 2),
        "phases": phases, "actors": actor_info, "weights": weights, **({"estimate": est.to_dict()} if est else {})}
    types = {n: y for s in shards for n, y in commits[s.name].types.items()}
    files, optional = checked.plan.files()
    finalize(work, recipe.dialect, [commits[s.name].record for s in shards], types, raw_config, src,
             mindie_format=opts.mindie_format, job={"fingerprint": key.job, "source": src, "recipe": recipe.to_dict()},
             extra={**recipe_files(opts), **files}, optional=optional)
    phases["finish_s"] = round(time.time() - t, 3)
    summary["total_s"] = round(time.time() - t0, 3)
    storage.write_bytes(storage.join(work, js.SUMMARY_NAME), json_bytes(summary))
    js.save_job(work, key, status="finished")
    if work != final:
        lock.ensure()
        storage.replace_dir(work, final)
    log(f"wrote {final} in {summary['total_s']:.1f}s ({len(todo)} units written, {len(units) - len(todo)} kept; "
        f"phases {phases})")
    return summary
