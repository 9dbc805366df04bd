"""Keep the fast tier fast: add the tests that take long to tests/slow_for_time.txt.

    python -m pytest -m "not slow" --junitxml=/tmp/fast.xml
    python scripts/slow_tests.py /tmp/fast.xml [--over 1.5]

Reads pytest's JUnit XML of a fast-tier run, sums each test function's time over its parameters (setup,
call and teardown: a module fixture's setup counts where it ran) and adds every function over --over
seconds to tests/slow_for_time.txt, keeping the entries already there. tests/conftest.py marks the tests
listed there ``slow``. Marking a fixture's first user moves the fixture's cost to the next one: run it
again after a second fast-tier run until nothing is added.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LIST = Path(__file__).resolve().parents[1] / "tests" / "slow_for_time.txt"
HEADER = ("# Tests marked slow for their time (module::function, every parameter), out of the fast tier\n"
          "# (pytest -m \"not slow\"); a bare module name marks the whole module (its shared fixture is the\n"
          "# cost). Made by scripts/slow_tests.py from a fast-tier run's JUnit XML.\n")


def function_times(junit: Path) -> dict[str, float]:
    times: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        times[f"{module}.py::{case.get('name', '').split('[')[0]}"] += float(case.get("time") or 0)
    return times


def read_list(path: Path = LIST) -> set[str]:
    if not path.exists():
        return set()
    return {s for line in path.read_text().splitlines() if (s := line.split("#")[0].strip())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("junit", type=Path, help="pytest --junitxml output of a fast-tier run")
    ap.add_argument("--over", type=float, default=1.5, help="seconds a test function may take in the fast tier")
    args = ap.parse_args(argv)
    if not args.junit.is_file():
        print(f"error: {args.junit}: no such file", file=sys.stderr)
        return 2
    times = function_times(args.junit)
    old = read_list()
    new = {k for k, t in times.items() if t > args.over} - old
    LIST.write_text(HEADER + "".join(f"{k}\n" for k in sorted(old | new)))
    kept = sum(t for k, t in times.items() if k not in old | new)
    print(f"{len(new)} added, {len(old | new)} listed; the rest of this run took {kept:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
