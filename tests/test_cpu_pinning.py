"""pipeline.engine.cpu_pinning: the engine_cpus specs, the "auto" claims (distinct CPUs for concurrent
engines, one CPU always left unclaimed, a dead engine's claim taken over), and pinning itself in a fresh
process (its affinity afterwards)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.serving.serve_config import ServeConfig
from pipeline.engine import cpu_pinning


def test_specs():
    assert cpu_pinning.parse("auto") is None and cpu_pinning.parse(" None ") is None
    assert cpu_pinning.parse("3") == [3] and cpu_pinning.parse("2-4,1") == [1, 2, 3, 4]
    for bad in ("", "x", "3-1", "-2", "1,,2"):
        with pytest.raises(ValueError, match="engine_cpus"):
            cpu_pinning.parse(bad)
    with pytest.raises(ValueError, match="engine_cpus"):
        ServeConfig(model_path="m", engine_cpus="two")


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_auto_claims(tmp_path):
    me, parent = os.getpid(), os.getppid()
    assert cpu_pinning.claim(1, {0, 1, 2, 3}, me, tmp_path) == [3]
    assert cpu_pinning.claim(1, {0, 1, 2, 3}, me, tmp_path) == [3]          # its own claim again
    assert cpu_pinning.claim(2, {0, 1, 2, 3}, parent, tmp_path) == [2, 1]   # the next free ones
    assert cpu_pinning.claim(1, {0, 1, 2, 3}, dead_pid(), tmp_path) == []   # CPU 0 stays unclaimed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]
    (tmp_path / "2").write_text(str(dead_pid()))                            # that engine died
    assert cpu_pinning.claim(1, {0, 1, 2, 3}, dead_pid(), tmp_path) == [2]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs and Linux affinity")
def test_pinning_a_process(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, tempfile, sys; tempfile.tempdir = sys.argv[1]; from pipeline.engine import cpu_pinning as c; "
            "print(c.pin(sys.argv[2], 1), sorted(os.sched_getaffinity(0)))")

    def run(spec):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path), spec], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return out.stdout.strip() or out.stderr.strip().splitlines()[-1]

    assert run("auto") == f"[{allowed[-1]}] [{allowed[-1]}]"
    assert run("none") == f"[] {allowed}"
    assert run(str(allowed[0])) == f"[{allowed[0]}] [{allowed[0]}]"
    assert "not available to this process" in run("9999")
