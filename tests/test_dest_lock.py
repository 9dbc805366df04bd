"""One job per destination (pipeline.io.destination.lock): a second quantize job on the same --save-path stops with
one line naming the running job and deletes nothing; stale locks (a dead process here, a silent host
elsewhere) are taken over; a job whose lock was taken over removes nothing; the same on S3 through a
conditional create."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.format.checker import check_dir
from pipeline.io.destination import lock as dest_lock
from pipeline.io.destination.lock import DestinationBusy, DestinationLock, LockLost, lock_path
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions
from pipeline.quant.writing.writer import QuantizedWriter
from tiny import TINY_FIXTURE

from test_job_safety import calib, finished, output, snapshot  # noqa: F401 (fixtures shared with those tests)

ROOT = Path(__file__).resolve().parents[1]


def quantize_cmd(dst: Path, calib: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jobs.quantize", "--model-path", str(TINY_FIXTURE), "--save-path", str(dst),
            "--calib-data", calib, "--no-progress", "--no-estimate", *extra]


def run_job(dst: Path, calib: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(quantize_cmd(dst, calib, *extra), cwd=ROOT, capture_output=True, text=True, timeout=600)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_lock(dst: Path, **info) -> Path:
    path = Path(lock_path(str(dst)))
    base = {"token": "other", "host": socket.gethostname(), "pid": os.getpid(), "pid_start": None,
            "started": time.time(), "heartbeat": time.time(), "command": "python -m jobs.quantize --save-path x"}
    path.write_text(json.dumps({**base, **info}))
    return path


def test_a_second_job_on_a_held_destination_fails_naming_the_holder_and_keeps_the_output(output, calib):
    before = snapshot(output)
    with DestinationLock(str(output), command="python -m jobs.quantize --save-path q (the first job)"):
        r = run_job(output, calib, "--overwrite")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "another dsquant job is writing it" in lines[0] and f"pid {os.getpid()}" in lines[0]
    assert "(the first job)" in lines[0]
    assert snapshot(output) == before  # nothing deleted, nothing added
    assert not Path(lock_path(str(output))).exists()  # the holder released it; the loser never took it


def test_two_overwrite_jobs_started_together_leave_one_complete_output(output, calib):
    """The defect: both jobs deleting each other's files left the destination empty. Now the second finds
    the first's lock (or, if the first already ended, overwrites after it); the output is whole either way."""
    first = subprocess.Popen(quantize_cmd(output, calib, "--overwrite"), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lock = Path(lock_path(str(output)))
    while first.poll() is None and not lock.exists():
        time.sleep(0.05)
    second = run_job(output, calib, "--overwrite")
    out1, err1 = first.communicate(timeout=600)
    codes = sorted([first.returncode, second.returncode])
    assert codes in ([0, 0], [0, 2]), (err1, second.stderr)
    if second.returncode == 2:
        assert "another dsquant job is writing it" in second.stderr and "Traceback" not in second.stderr
    assert first.returncode == 0, err1
    assert check_dir(str(output)).ok
    assert not [p.name for p in output.iterdir() if ".part-" in p.name or ".tmp-" in p.name]
    assert not lock.exists()


def test_a_dead_local_holder_is_taken_over(output, calib):
    stale = write_lock(output, pid=dead_pid())
    r = run_job(output, calib, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert check_dir(str(output)).ok and not stale.exists()


def test_a_live_local_holder_blocks_even_when_its_heartbeat_is_old(output, calib):
    write_lock(output, pid=os.getpid(), heartbeat=0.0, started=0.0)
    with pytest.raises(DestinationBusy, match="another dsquant job"):
        DestinationLock(str(output)).acquire()


@pytest.mark.parametrize("age,busy", [(5.0, True), (dest_lock.DEFAULT_STALE_S + 60, False)])
def test_another_hosts_lock_is_stale_only_when_it_stopped_refreshing(tmp_path, age, busy):
    dst = tmp_path / "q"
    write_lock(dst, host="some-other-host", pid=1, heartbeat=time.time() - age)
    lock = DestinationLock(str(dst))
    if busy:
        with pytest.raises(DestinationBusy, match="on host some-other-host"):
            lock.acquire()
    else:
        with lock:
            assert json.loads(Path(lock.path).read_text())["token"] == lock.token


def test_stale_after_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(dest_lock.STALE_ENV, "2")
    dst = tmp_path / "q"
    write_lock(dst, host="some-other-host", pid=1, heartbeat=time.time() - 3)
    with DestinationLock(str(dst)):
        pass
    monkeypatch.setenv(dest_lock.STALE_ENV, "soon")
    with pytest.raises(ValueError, match=dest_lock.STALE_ENV):
        dest_lock.stale_after()


def test_the_heartbeat_refreshes_the_lock(tmp_path):
    lock = DestinationLock(str(tmp_path / "q"), heartbeat_s=0.05)
    with lock:
        first = json.loads(Path(lock.path).read_text())["heartbeat"]
        deadline = time.time() + 60
        while json.loads(Path(lock.path).read_text())["heartbeat"] == first and time.time() < deadline:
            time.sleep(0.05)
        assert json.loads(Path(lock.path).read_text())["heartbeat"] > first
    assert not Path(lock.path).exists()


def test_a_job_whose_lock_was_taken_over_removes_nothing(output, tmp_path):
    """The writer calls the lock's ensure before it removes the earlier output: a lost lock keeps it."""
    before = snapshot(output)
    lock = DestinationLock(str(output)).acquire()
    try:
        write_lock(output, token="thief")
        with pytest.raises(LockLost, match="taken over"):
            lock.ensure()
        with pytest.raises(LockLost):
            with QuantizedWriter(str(output), "seed", model_dtype="bfloat16", overwrite=True,
                                 guard=lock.ensure, background=False) as w:
                import torch

                w.add({"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}, {"model.norm.weight": "FLOAT"})
                w.finish({"torch_dtype": "bfloat16"})
    finally:
        lock.release()
    assert snapshot(output) == before
    assert json.loads(Path(lock_path(str(output))).read_text())["token"] == "thief"  # not ours: left alone


def test_the_lock_is_released_when_the_job_fails(tmp_path, calib):
    dst = tmp_path / "q"
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    r = run_job(dst, calib.replace(calib, str(bad)))
    assert r.returncode == 2 and not Path(lock_path(str(dst))).exists()


def test_s3_destination_takes_one_lock_at_a_time(s3):
    dst = s3.bucket("lock") + "/q"
    first = DestinationLock(dst, command="first job")
    with first:
        with pytest.raises(DestinationBusy, match=r"another dsquant job is writing it: .*\(first job\)"):
            DestinationLock(dst).acquire()
        first.ensure()
    with DestinationLock(dst):  # released: the next one takes it
        pass


def test_the_distributed_job_stops_at_a_held_lock_before_ray_starts(output, calib):
    from actors.quantize.quantize_job import quantize_distributed
    from actors.quantize.ray_session import DistOptions

    before = snapshot(output)
    with DestinationLock(str(output), command="the first job"):
        with pytest.raises(DestinationBusy, match=r"\(the first job\)"):
            quantize_distributed(str(TINY_FIXTURE), str(output), Recipe(),
                                 QuantizeOptions(calib_path=calib, overwrite=True),
                                 DistOptions(stages=1, address="127.0.0.1:1"), log=lambda m: None)
    assert snapshot(output) == before
    assert not any(p.name.endswith(".overwrite") for p in output.parent.iterdir())
