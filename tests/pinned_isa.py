"""Run a comparison with msModelSlim's fixtures in a child process whose CPU kernels are pinned to AVX2.

The fixtures were made with AVX2 kernels; the variables must be set before torch is imported, so the
comparison runs in a fresh interpreter (tests of AMX / AVX-512 paths keep the real ISA in this one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# MKL_CBWR: MKL's conditional numerical reproducibility, AVX2 code path in strict mode; MKL_ENABLE_INSTRUCTIONS
# alone leaves some float32 GEMMs on an AMX (Sapphire Rapids) machine with other bits than AVX2 machines give
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
              "MKL_CBWR": "AVX2,STRICT"}
TESTS = Path(__file__).resolve().parent


def run_pinned(script: Path, *args: str) -> dict:
    """Run ``python script args`` with :data:`PINNED_ISA`; the script prints one JSON object as its last
    stdout line, returned here. A non-zero exit fails with the child's stderr."""
    env = dict(os.environ, **PINNED_ISA)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{script.name} {' '.join(args)} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
