"""The sharding flags jobs.generate and jobs.serve share: --tp/--dp/--moe-ep/--moe-tp (MindIE's names) and
--moe-combine (pipeline.parallel, pipeline.engine.sharding.sharded)."""

from __future__ import annotations

import argparse


def add_sharding_flags(ap: argparse.ArgumentParser, default_combine: str | None = "reduce"):
    """Add the flags (in their own group, returned); ``default_combine`` None: --moe-combine unset unless given."""
    g = ap.add_argument_group("sharding (one replica over several ranks, as Ray actors)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor parallel: attention heads, dense MLP, shared expert, vocab (default: %(default)s)")
    g.add_argument("--dp", type=int, default=1,
                   help="data-parallel attention groups inside the replica, each with its own sequences and cache "
                        "(default: %(default)s)")
    g.add_argument("--moe-ep", "--moe_ep", dest="moe_ep", type=int, default=1,
                   help="expert parallel: routed experts split over this many groups (default: %(default)s)")
    g.add_argument("--moe-tp", "--moe_tp", dest="moe_tp", type=int, default=0,
                   help="each expert's width split over this many ranks (default: dp x tp / moe_ep)")
    g.add_argument("--moe-combine", choices=("reduce", "exact"), default=default_combine,
                   help="MoE combine over ranks: 'reduce' sums partial outputs (float order differs from one "
                        "rank), 'exact' the single-rank bits at top_k times the bytes (default: "
                        + ("%(default)s)" if default_combine else "the --config file's, else reduce)"))
    return g


def parallel_config(args: argparse.Namespace):
    """The ParallelConfig the flags give (ValueError naming the size that does not fit)."""
    from pipeline.parallel import ParallelConfig

    return ParallelConfig(tp=args.tp, dp=args.dp, moe_ep=args.moe_ep, moe_tp=args.moe_tp)
