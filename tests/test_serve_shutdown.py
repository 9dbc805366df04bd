"""``python -m jobs.serve`` stops fast and clean: SIGTERM while serving exits within the 5 s it documents,
with every Ray process of its private cluster gone and no alarming line in its log (no controller
time-out, no killed task, no "existing Serve app", no traceback, no colour codes in a file); SIGINT (the
same handler) does the same behind Serve's own proxy (the default front door is HAProxy); SIGTERM during
start-up leaves nothing behind either."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import json
import urllib.request

import pytest

from ray_head import (free_port, kill_under, listening, port_free, processes_under, ray_titled_under, ray_tmpdir,
                      running, wait_gone)

REPO = Path(__file__).resolve().parents[1]
STOP_S = 5.0                       # the bound, signal to exit
START_STOP_S = 20.0                # during start-up: Ray's start is let finish first (seconds on a loaded CPU)
ALARMS = ("Controller failed to shut down", "killed by ray.kill", "Connecting to existing Serve app",
          "Traceback", "\x1b[", "did not shut down in time")   # the last: the private Ray killed, not stopped


class Served:
    def __init__(self, qdir: str, tmp: Path, extra: tuple[str, ...] = (), port: int | None = None):
        self.ray_tmp, self.port = ray_tmpdir(), port or free_port()
        self.log_path = tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_COLOR_PREFIX")}
        env.update(RAY_TMPDIR=self.ray_tmp, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS="1")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobs.serve", "--model-path", qdir, "--port", str(self.port),
             "--num-blocks", "32", "--max-num-seqs", "4", "--llm-num-cpus", "0.5", *extra],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, needle: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while needle not in self.text():
            assert self.proc.poll() is None, f"jobs.serve exited {self.proc.returncode}:\n{self.text()[-3000:]}"
            assert time.time() < deadline, f"no {needle!r} in {timeout}s:\n{self.text()[-3000:]}"
            time.sleep(0.2)

    def stop(self, sig: int) -> float:
        """Send ``sig``; seconds until the process exited (fails past a minute)."""
        t0 = time.time()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return time.time() - t0

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        kill_under(self.ray_tmp)
        self.log.close()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)   # its private Ray's session files


@pytest.fixture
def served(embedded_quantized, tmp_path):
    s = Served(embedded_quantized, tmp_path)
    try:
        yield s
    finally:
        s.cleanup()


def _stopped_clean(served: Served, sig: int, bound_s: float) -> None:
    """Send ``sig``: exit 0 within ``bound_s``, no Ray process left, no alarm in the log."""
    took = served.stop(sig)
    left = wait_gone(served.ray_tmp, 2.0)
    log = served.text()
    assert served.proc.returncode == 0, log[-3000:]
    assert took < bound_s, f"stopping took {took:.1f}s:\n{log[-3000:]}"
    assert left == [], left
    assert [a for a in ALARMS if a in log] == [], log[-3000:]
    assert "ray: started a private local Ray for this job" in log


def test_sigterm_stops_serving_fast_and_leaves_nothing(served):
    """The default front door (Ray's HAProxy, which comes with ray[serve]) answers as soon as the job
    says it serves; SIGTERM stops everything, HAProxy included."""
    served.wait_for("serving ")
    assert "front door: HAProxy" in served.text()
    assert any("haproxy" in cmd for _, cmd in processes_under(served.ray_tmp))
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/v1/models", timeout=30) as r:
        assert r.status == 200 and json.load(r)["data"]
    _stopped_clean(served, signal.SIGTERM, STOP_S)


def test_sigterm_during_start_up_leaves_nothing(served):
    """SIGTERM while the private Ray is still starting (its session directory exists, ray.init has not
    returned): held until Ray is up, then the same stop; no Ray process outlives the job."""
    session = Path(served.ray_tmp) / "ray" / "session_latest"
    deadline = time.time() + 120
    while not session.exists():
        assert served.proc.poll() is None and time.time() < deadline, served.text()[-3000:]
        time.sleep(0.05)
    took = served.stop(signal.SIGTERM)
    left = wait_gone(served.ray_tmp, 2.0)
    log = served.text()
    assert left == [], left
    assert served.proc.returncode == 0, log[-3000:]
    assert took < START_STOP_S, f"stopping took {took:.1f}s:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]


def test_the_serve_proxy_front_door_answers_and_stops_clean(embedded_quantized, tmp_path):
    """``--http-proxy serve`` (the default is Ray's HAProxy where Ray has it): Serve's own proxy listens on
    the port, no HAProxy runs; a completion answers through it, and SIGINT stops everything the same way."""
    s = Served(embedded_quantized, tmp_path, ("--http-proxy", "serve"))
    try:
        s.wait_for("serving ")
        assert "front door: Serve's proxy" in s.text()
        assert not any("haproxy" in cmd for _, cmd in processes_under(s.ray_tmp))
        base = f"http://127.0.0.1:{s.port}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "The os module", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
        assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
        _stopped_clean(s, signal.SIGINT, STOP_S)
    finally:
        s.cleanup()


def _haproxy_admin_socket(pid: int) -> Path:
    """HAProxy's admin socket: beside the configuration file it runs (its full command line)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return Path(args[args.index("-f") + 1]).parent / "admin.sock"


def test_a_process_group_stop_leaves_no_process_or_port_and_the_port_serves_again(embedded_quantized, tmp_path):
    """``timeout``, ``kill -TERM -PGID`` and systemd signal every process of the job, the private Ray's GCS
    and raylet included: the job still exits within STOP_S, and nothing (no HAProxy) keeps the port. With
    ``--host 127.0.0.1`` HAProxy listens on 127.0.0.1 only (its admin frontends too) and its admin socket is
    the user's alone. Then a new jobs.serve on the same port, behind Serve's proxy with a key from a file,
    delivers a non-streamed answer over gRPC's 4 MiB; killed with SIGKILL (no stop of its own at all), the
    watcher of its private Ray still leaves no process or port."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = Served(embedded_quantized, tmp_path / "a", ("--host", "127.0.0.1"))
    try:
        a.wait_for("serving ")
        assert "front door: HAProxy" in a.text()
        hap = [(pid, cmd) for pid, cmd in processes_under(a.ray_tmp) if "haproxy" in cmd]
        addrs = {addr for pid, _ in hap for addr in listening(pid)}
        assert len(addrs) >= 3 and {ip for ip, _ in addrs} == {"127.0.0.1"}, addrs   # serving, stats, Prometheus
        assert (_haproxy_admin_socket(hap[-1][0]).stat().st_mode & 0o777) == 0o600
        t0 = time.time()
        os.killpg(a.proc.pid, signal.SIGTERM)
        a.proc.wait(timeout=60)
        took = time.time() - t0
        left = wait_gone(a.ray_tmp, 2.0)
        assert a.proc.returncode == 0 and took < STOP_S, (took, a.text()[-3000:])
        assert left == [] and port_free(a.port), left
        assert "Traceback" not in a.text()
    finally:
        a.cleanup()

    key = tmp_path / "key"
    key.write_text("sk-from-a-file\n")
    # the 16 choices of 300 tokens decode side by side (16 sequences, 20 blocks each): 300 steps, not 1200
    b = Served(embedded_quantized, tmp_path / "b", ("--http-proxy", "serve", "--api-key-file", str(key),
                                                    "--num-blocks", "336", "--max-num-seqs", "16"), port=a.port)
    try:
        b.wait_for("serving ")
        assert "API key required" in b.text() and "sk-from-a-file" not in " ".join(
            cmd for _, cmd in processes_under(b.ray_tmp))
        body = json.dumps({"model": Path(embedded_quantized).name, "messages": [{"role": "user", "content": "Hi"}],
                           "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 300, "temperature": 1.0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{b.port}/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": "Bearer sk-from-a-file"})
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read()
        assert len(raw) > 4 * 2**20 and json.loads(raw)["usage"]["completion_tokens"] == 16 * 300
        agents = [p for p in ray_titled_under(b.ray_tmp) if b"Agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
        b.proc.kill()
        b.proc.wait()
        left = wait_gone(b.ray_tmp, 20.0)
        alive = lambda: [p for p in agents if running(p)]  # noqa: E731 (they hide their environment)
        deadline = time.time() + 20      # left alone, Ray's agents outlive their raylet by a minute or more
        while (alive() or not port_free(b.port)) and time.time() < deadline:
            time.sleep(0.2)
        assert left == [] and agents and alive() == [] and port_free(b.port), (left, alive())
    finally:
        b.cleanup()
