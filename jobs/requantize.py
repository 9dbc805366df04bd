"""The scheduled form of the distributed job: requantize only when the source or the recipe changed.

    python -m jobs.requantize --model-path SRC --save-path DST [every jobs.quantize flag]

Without a recipe flag (``--config-path``, a preset, the legacy flags, ``--dynamic``, ...), the recipe is the
output's own ``<model_type>_best_practice.yaml`` (a line says so), not the default one, and
``--mindie-format``, ``--smooth-alpha`` and ``--shard-size-gb`` not given are the earlier job's (from its
``.dsquant/job.json``; a line says which): a scheduled rerun is the job that wrote the output. Fingerprints
the source (each file's size and ETag/mtime: no weight is read; ``--source-check sha256``: each file's
content hash instead, which also sees an in-place edit that keeps size and mtime), the recipe and the
calibration data, and compares them with the destination's manifest. Unchanged: nothing is done. Changed:
the job reruns through actors.quantize.quantize_job, which recalibrates and rewrites only the units (the globals,
layers) whose source files or statistics changed, keeping the others' committed shards. Prints a line
either way and exits 0; 2 for bad input, 1 when the job failed. Runs on Ray with ``--stages`` (default
1 here), on the cluster of ``--ray-address`` / RAY_ADDRESS or a local one.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from contextlib import nullcontext, redirect_stdout
from typing import Optional, Sequence

from jobs.quantize import build_parser as quantize_parser
from jobs.quantize import SHARD_UNLIMITED, failures, make_job, run_guarded
from pipeline.io import storage
from pipeline.io.storage import VERSION_MODES
from pipeline.quant.writing.output_files import RECIPE_SUFFIX


def build_parser() -> argparse.ArgumentParser:
    """jobs.quantize's options (``--stages`` 1 and no progress bars by default here) and ``--verbose``."""
    ap = quantize_parser("python -m jobs.requantize", __doc__.split("\n")[0])
    ap.set_defaults(stages=1, no_progress=True)
    ap.add_argument("--verbose", action="store_true",
                    help="the job's log lines too (default: %(default)s, one summary line)")
    ap.add_argument("--source-check", dest="source_check", choices=VERSION_MODES, default="stat",
                    help="how a changed source file is found: stat trusts its size and modification time (ETag "
                         "on object stores) and reads nothing, so an in-place edit that keeps both (cp -p, "
                         "rsync -t) is missed; sha256 reads every source file and compares contents (switching "
                         "modes rewrites the output once) (default: %(default)s)")
    return ap


# the flags that choose or change the recipe: with none of them, the output's own recipe is rerun
RECIPE_FLAGS = ("config_path", "model_type", "quant_type", "anti_method", "disable_anti", "rot", "quant_mtp", "fa_quant",
                "fa_exclude_layers", "dynamic", "smooth", "quantize_mtp", "dialect", "calib_products", "calibration")


OUTPUT_FLAGS = ("mindie_format", "smooth_alpha", "shard_size_gb")   # taken from the earlier job's state
_UNSET = object()


def given_flags(argv: Sequence[str]) -> set[str]:
    """The destinations of RECIPE_FLAGS and OUTPUT_FLAGS that ``argv`` sets (a value equal to the default
    included)."""
    dests = (*RECIPE_FLAGS, *OUTPUT_FLAGS)
    parser = build_parser()
    parser.set_defaults(**dict.fromkeys(dests, _UNSET))
    ns = parser.parse_args(argv)
    return {d for d in dests if getattr(ns, d) is not _UNSET}


def own_recipe(args: argparse.Namespace, given: set[str]) -> Optional[str]:
    """The recipe the output in ``--save-path`` was written with (its ``*_best_practice.yaml``) when no recipe
    flag is ``given``, else None; ValueError when the output holds more than one."""
    if given & set(RECIPE_FLAGS) or not storage.isdir(args.save_path):
        return None
    found = [e for e in storage.listdir(args.save_path) if e.endswith(RECIPE_SUFFIX) and not e.startswith(".")]
    if len(found) > 1:
        raise ValueError(f"{args.save_path}: holds {len(found)} recipes ({', '.join(found)}); give --config-path")
    return storage.join(args.save_path, found[0]) if found else None


def own_options(args: argparse.Namespace, given: set[str]) -> list[str]:
    """The output options the earlier job recorded in ``--save-path``'s job state (``--mindie-format``,
    ``--smooth-alpha``, ``--shard-size-gb``), set on ``args`` where not ``given``; the flags so taken, as they
    would be spelt."""
    from pipeline.quant.job.job_state import load_job

    job = load_job(args.save_path) if storage.isdir(args.save_path) else None
    if not isinstance(job, dict):
        return []
    output, weights = job.get("output_options") or {}, job.get("weight_options") or {}
    shard = weights.get("shard_bytes")
    recorded = {"mindie_format": output.get("mindie_format"), "smooth_alpha": weights.get("smooth_alpha"),
                "shard_size_gb": shard / 1024 ** 3 if isinstance(shard, int) and shard < SHARD_UNLIMITED
                else None}           # unlimited: the recipe's part_file_size 0, which the recipe carries
    taken = []
    for dest, value in recorded.items():
        if dest in given or value is None or value is False or getattr(args, dest) == value:
            continue
        setattr(args, dest, value)
        taken.append(f"--{dest.replace('_', '-')}" + ("" if value is True else f" {value:g}"))
    return taken


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.stages < 1:
        print("error: --stages must be >= 1 for requantize", file=sys.stderr)
        return 2
    log = print if args.verbose else (lambda _m: None)
    storage.set_version_mode(args.source_check)
    given = given_flags(argv)
    rc, recipe_path = run_guarded(lambda: own_recipe(args, given))
    if rc:
        return rc
    if recipe_path is not None:
        args.config_path = recipe_path
        print(f"requantize {args.save_path}: recipe {recipe_path} (the output's own; recipe flags or --config-path "
              "choose another)")
    rc, taken = run_guarded(lambda: own_options(args, given))
    if rc:
        return rc
    if taken:
        print(f"requantize {args.save_path}: {' '.join(taken)} as the earlier job ran (give the flag to change it)")
    rc, job = run_guarded(lambda: make_job(args, log))
    if rc:
        return rc
    src, dst, recipe, opts, dist = job
    dist = dataclasses.replace(dist, ray_logs=args.verbose)
    from actors.quantize.quantize_job import quantize_distributed

    with redirect_stdout(io.StringIO()) if not args.verbose else nullcontext():
        rc, s = run_guarded(lambda: quantize_distributed(src, dst, recipe, opts, dist, log=log), failures(dist))
    if rc:
        return rc
    if s["status"] == "up-to-date":
        print(f"requantize {dst}: up to date (fingerprint {s['fingerprint'][:12]}), nothing done")
    else:
        changed = s.get("changed_files")
        why = (f"source files changed: {', '.join(changed)}" if changed else
               "recipe or calibration data changed" if s.get("resumed") else "no earlier output")
        print(f"requantize {dst}: {s['units_written']} units rewritten, {s['units_kept']} kept ({why}); "
              f"{s['bytes_written'] / 2**20:.1f} MiB in {s['total_s']:.1f}s (fingerprint {s['fingerprint'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
