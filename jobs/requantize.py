"""The scheduled form of the distributed job: requantize only when the source or the recipe changed.

    python -m jobs.requantize --model-path SRC --save-path DST [every jobs.quantize flag]

Without a recipe flag (``--config-path``, a preset, the legacy flags, ``--dynamic``, ...), the recipe is the
output's own ``<model_type>_best_practice.yaml`` (a line says so), not the default one: a scheduled rerun
is the job that wrote the output. Fingerprints the source (each file's size and ETag/mtime: no weight is
read; ``--source-check sha256``: each file's content hash instead, which also sees an in-place edit that
keeps size and mtime), the recipe and the calibration data, and compares them with the destination's
manifest. Unchanged: nothing is done. Changed:
the job reruns through actors.quantize_job, which recalibrates and rewrites only the units (the globals,
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
from typing import Optional

from jobs.quantize import build_parser as quantize_parser
from jobs.quantize import failures, make_job, run_guarded
from pipeline.io import storage
from pipeline.io.storage import VERSION_MODES
from pipeline.quant.output_files import RECIPE_SUFFIX


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


def own_recipe(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Optional[str]:
    """The recipe the output in ``--save-path`` was written with (its ``*_best_practice.yaml``) when no recipe
    flag is given, else None; ValueError when the output holds more than one."""
    unset = parser.parse_args(["--save-path", args.save_path])     # every default, as parsing leaves them
    if any(getattr(args, f) != getattr(unset, f) for f in RECIPE_FLAGS):
        return None
    if not storage.isdir(args.save_path):
        return None
    found = [e for e in storage.listdir(args.save_path) if e.endswith(RECIPE_SUFFIX) and not e.startswith(".")]
    if len(found) > 1:
        raise ValueError(f"{args.save_path}: holds {len(found)} recipes ({', '.join(found)}); give --config-path")
    return storage.join(args.save_path, found[0]) if found else None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stages < 1:
        print("error: --stages must be >= 1 for requantize", file=sys.stderr)
        return 2
    log = print if args.verbose else (lambda _m: None)
    storage.set_version_mode(args.source_check)
    rc, recipe_path = run_guarded(lambda: own_recipe(args, parser))
    if rc:
        return rc
    if recipe_path is not None:
        args.config_path = recipe_path
        print(f"requantize {args.save_path}: recipe {recipe_path} (the output's own; recipe flags or --config-path "
              "choose another)")
    rc, job = run_guarded(lambda: make_job(args, log))
    if rc:
        return rc
    src, dst, recipe, opts, dist = job
    dist = dataclasses.replace(dist, ray_logs=args.verbose)
    from actors.quantize_job import quantize_distributed

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
