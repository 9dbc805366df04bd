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


def start(args, env) -> subprocess.Popen:
    env = dict(env, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def finished(proc: subprocess.Popen, timeout=300) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(args, env, timeout=300):
    return finished(start(args, env), timeout)


def test_quantize_stages_2_without_address_runs_on_a_private_ray_beside_a_users_head(head, tmp_path, calib4):
    r = run(["-m", "jobs.quantize", "--no-progress", "--model-path", str(TINY_FIXTURE), "--calib-data", calib4,
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
    script = ("import ray\nfrom actors.cluster.ray_start import init_ray\n"
              "init_ray(None, num_cpus=1, object_store_memory=80 * 2**20, log=lambda m: None)\n"
              "@ray.remote\ndef hello():\n    print('hello from a worker', flush=True)\n"
              "ray.get(hello.remote())\nimport time; time.sleep(1.5)\nray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_COLOR_PREFIX")}
    r = run(["-c", script], dict(env, RAY_AUTH_MODE="disabled"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "hello from a worker" in out and "(hello pid=" in out
    assert "\x1b[" not in out


def test_an_address_naming_no_cluster_fails_at_once_and_writes_nothing(tmp_path):
    """--ray-address / RAY_ADDRESS / --address naming nothing (a closed port, one that accepts and never
    answers, one that answers but is no Ray): one line ``no Ray cluster at ...``, exit 2, no ``.dsquant/``
    (nothing at all) in the destination. (A hang would hit the subprocess time-out.)"""
    import socket

    from ray_head import free_port

    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)                     # accepts connections (the kernel does), never answers
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    closed = f"127.0.0.1:{free_port()}"
    try:
        cases = [(["--ray-address", f"127.0.0.1:{mute.getsockname()[1]}"], env, "--ray-address", "no answer within"),
                 ([], dict(env, RAY_ADDRESS=closed), "RAY_ADDRESS", "cannot connect")]
        # the three jobs side by side (each starts no Ray: it stops at the address check)
        procs = [start(["-m", "jobs.quantize", "--no-progress", "--model-path", str(TINY_FIXTURE), "--save-path",
                        str(tmp_path / f"q{i}"), "--stages", "2", *flags], e) for i, (flags, e, _, _) in enumerate(cases)]
        procs.append(start(["-m", "jobs.serve", "--model-path", str(TINY_FIXTURE), "--address", closed], env))
        try:
            results = [finished(p, timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for i, (r, (_, _, source, why)) in enumerate(zip(results, cases)):
            assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
            line = r.stderr.strip().splitlines()[-1]
            assert line.startswith("error: no Ray cluster at ") and f"({source})" in line and why in line, r.stderr
            assert "Traceback" not in r.stderr and not (tmp_path / f"q{i}").exists()
        r = results[-1]
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
            f"error: no Ray cluster at {closed} (--address): cannot connect"), r.stderr[-2000:]
    finally:
        mute.close()


def test_check_address_accepts_a_running_cluster(head):
    from actors.cluster.ray_start import NoCluster, check_address

    check_address(head.address)
    with pytest.raises(NoCluster, match=r"^no Ray cluster at ray://.*: something answers there, but not Ray's client"):
        check_address(f"ray://{head.address}")          # the GCS port speaks gRPC, but is no client server


def test_kill_9_of_a_stages_driver_leaves_no_ray_process(tmp_path):
    """The job's private Ray outlives a SIGKILLed driver only until its watcher (actors.cluster.ray_reaper) sees the
    driver gone: no GCS, raylet, worker, nor the agents (which hide their environment) remain."""
    import signal
    import time

    from ray_head import kill_under, processes_under, ray_titled_under, ray_tmpdir, running

    tmp = ray_tmpdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jobs.quantize", "--no-progress", "--save-path", str(tmp_path / "q"),
                             "--stages", "2"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not any(b"StageWorker" in Path(f"/proc/{p}/cmdline").read_bytes() for p in ray_titled_under(tmp)
                      if Path(f"/proc/{p}").exists()):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.1)
        agents = [p for p in ray_titled_under(tmp) if b"Agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
        proc.kill()                                    # the driver only: no stop of its own
        proc.wait()
        deadline = time.time() + 20                    # left alone, the agents outlive it by a minute or more
        while (processes_under(tmp) or any(map(running, agents))) and time.time() < deadline:
            time.sleep(0.2)
        assert agents and processes_under(tmp) == [] and not [p for p in agents if running(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_under(tmp)
        for p in ray_titled_under(tmp):
            os.kill(p, signal.SIGKILL)
        log.close()
