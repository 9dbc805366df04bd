"""Write an FP8 block-quantized copy of a checkpoint in the DeepSeek-V3 release's layout.

    python -m jobs.make_fp8 --src DIR --dst DIR [--shards N]

DIR may be a local path or any fsspec URL (file://, s3://, memory://). DST must be new or empty, and not
the source however spelt. Exit status: 0 written, 2 bad input (one line naming the file).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from pipeline.io.release_layout.fp8_copy import write_fp8_copy


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.make_fp8", description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True, help="source checkpoint directory, bf16 or FP8 (required; no default)")
    p.add_argument("--dst", required=True, help="new or empty destination directory for the FP8 copy "
                                                "(required; no default)")
    p.add_argument("--shards", type=int, default=None,
                   help="number of shard files (default: %(default)s, about 4 GiB each)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from jobs.quantize import error_line, job_errors

    try:
        index = write_fp8_copy(args.src, args.dst, shards=args.shards)
    except job_errors() as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    n_files = len(set(index["weight_map"].values()))
    print(f"{args.dst}: {len(index['weight_map'])} tensors, {index['metadata']['total_size']} bytes "
          f"in {n_files} shards")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
