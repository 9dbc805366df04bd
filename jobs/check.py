"""Check a quantized checkpoint directory against docs/format.md and print the report.

    python -m jobs.check PATH [--dialect seed|ascendV1] [--json] [--no-verify]
    python -m jobs.check PATH --runtime vllm-ascend|mindie|dsquant [--tp N] [--json]

PATH may be a local path or any fsspec URL. Every file the quantizer's manifest.json lists is checked for
its size and (unless ``--no-verify``) its sha256; msModelSlim's own folders have no manifest (the report
says so), while one this project wrote (its weight shards say so in their metadata) without its manifest
is a violation: the manifest was removed. With ``--runtime``, the directory is checked instead against
what that runtime's loader reads (pipeline.format.runtimes: each rule names the runtime source it comes
from; notes are caveats that do not fail the check). Exit status: 0 clean, 1 any violation, 2 unreadable
input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from pipeline.format.checker import check_dir
from pipeline.format.description import DIALECTS
from pipeline.format.runtimes import RUNTIMES, check_runtime
from pipeline.io.safetensors_io import CheckpointError
from pipeline.io.storage import check_reachable, describe_os_error


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.check", description=__doc__.splitlines()[0])
    p.add_argument("path", help="the quantized checkpoint directory")
    p.add_argument("--dialect", choices=DIALECTS, default=None,
                   help="hold the directory to this dialect's rules (default: %(default)s, the one detected)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: %(default)s)")
    p.add_argument("--runtime", choices=RUNTIMES, default=None,
                   help="check against this runtime's loader rules instead of the format's (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1,
                   help="with --runtime: the tensor-parallel size it would run with (default: %(default)s)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="compare only the sizes the manifest records, not the sha256 (default: off, the sha256 is verified)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_reachable(args.path)           # a mute object store: seconds, not minutes
        if args.tp < 1:
            print(f"error: --tp must be >= 1, got {args.tp}", file=sys.stderr)
            return 2
        report = check_runtime(args.path, args.runtime, args.tp, args.verify) if args.runtime else \
            check_dir(args.path, dialect=args.dialect, verify=args.verify)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
