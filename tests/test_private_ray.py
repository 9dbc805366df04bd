"""A job without an address starts a private Ray even when another one runs on the machine (a user's own
``ray start --head``, whose pointer file a plain ``ray.init()`` would follow), and joins a cluster only
when an address flag or RAY_ADDRESS names it; one log line says which. Output that is not a terminal
carries no colour codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_head import start_head, stop_head
from tiny import TINY_FIXTURE

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def head():
    h = start_head(num_cpus=1)
    try:
        yield h
    finally:
        stop_head(h)


def run(args, env, timeout=300):
    env = dict(env, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_quantize_stages_2_without_address_runs_on_a_private_ray_beside_a_users_head(head, tmp_path):
    r = run(["-m", "jobs.quantize", "--no-progress", "--model-path", str(TINY_FIXTURE),
             "--save-path", str(tmp_path / "q"), "--stages", "2"], head.env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ray: started a private local Ray for this job" in r.stdout
    assert "joining" not in r.stdout
    assert (tmp_path / "q" / "quant_model_description.json").exists()
    assert head.proc.poll() is None                      # the user's head is untouched
    assert "\x1b[" not in r.stdout + r.stderr             # piped: no colour codes


def test_plan_joins_only_the_address_it_is_given(head):
    joined = run(["-m", "jobs.plan", "--check-ray", head.address], head.env())
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert f"ray: joining the cluster at {head.address} (from --check-ray)" in joined.stderr
    private = run(["-m", "jobs.plan", "--check-ray", "local"], head.env(RAY_ADDRESS=head.address))
    assert private.returncode == 0, private.stderr[-3000:]
    assert "ray: started a private local Ray for this job" in private.stderr


def test_worker_output_through_a_pipe_has_no_colour_codes(tmp_path):
    """Ray prefixes worker output with a coloured ``(pid=...)``; piped, the prefix must be plain."""
    script = ("import ray\nfrom actors.ray_start import init_ray\n"
              "init_ray(None, num_cpus=1, object_store_memory=80 * 2**20, log=lambda m: None)\n"
              "@ray.remote\ndef hello():\n    print('hello from a worker', flush=True)\n"
              "ray.get(hello.remote())\nimport time; time.sleep(1.5)\nray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_COLOR_PREFIX")}
    r = run(["-c", script], dict(env, RAY_AUTH_MODE="disabled"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "hello from a worker" in out and "(hello pid=" in out
    assert "\x1b[" not in out
