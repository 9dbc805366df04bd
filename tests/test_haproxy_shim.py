"""actors.serving.app.serve_haproxy.write_shim: the ``haproxy`` shim Serve runs imports the project from
wherever the package lives and execs the real binary with the arguments it was given."""

from __future__ import annotations

import shutil
import subprocess

from actors.serving.app.serve_haproxy import write_shim


def test_the_shim_runs_from_any_directory_and_execs_the_real_binary(tmp_path):
    shim = write_shim(str(tmp_path), shutil.which("echo"))
    out = subprocess.run([shim, "hello", "there"], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "hello there", out.stderr[-500:]
