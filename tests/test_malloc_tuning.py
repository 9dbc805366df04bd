"""pipeline.io.heap: on glibc the settings take (mallopt accepts each), once per process;
DSQUANT_MALLOC_TUNING=0 leaves malloc alone. Each case in a fresh interpreter (the settings are per
process), loading the module by its path (no torch import)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[1] / "pipeline" / "io" / "heap.py"
PROBE = ("import importlib.util as u; s = u.spec_from_file_location('m', {path!r}); m = u.module_from_spec(s); "
         "s.loader.exec_module(m); print(m.tune(), m.tune())")


def probe(env_value: str | None) -> str:
    env = {} if env_value is None else {"DSQUANT_MALLOC_TUNING": env_value}
    out = subprocess.run([sys.executable, "-c", PROBE.format(path=str(MODULE))], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_the_settings_take_on_glibc_and_the_switch_turns_them_off():
    assert probe(None) == "True True"
    assert probe("0") == "False False"
