"""benchmarks/ holds current results only: every file there is written by a script of scripts/ that names
it (its default --out, or the --out of a documented run), so each figure can be made again; history lives in
git."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_file_is_named_by_the_script_that_writes_it():
    scripts = "\n".join(p.read_text() for p in sorted((REPO / "scripts").glob("*.py")))
    files = sorted(p.name for p in (REPO / "benchmarks").iterdir() if p.is_file())
    assert files
    assert [f for f in files if f"benchmarks/{f}" not in scripts and f not in scripts] == []
