"""A user's own ``ray start --head`` for tests (its own temp dir and ports, stopped by killing exactly the
processes it started: never ``ray stop``, which stops every Ray on the machine), and the processes that
still run under a Ray temp dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RAY_BIN = str(Path(sys.executable).parent / "ray")


FREE_PORTS = range(20000, 32768)   # above Ray's worker ports (10002-19999), below the kernel's ephemeral ones


def free_port() -> int:
    """A port nothing listens on, for a server a test starts later (seconds later: after a Ray has started).
    Taken outside the kernel's ephemeral range (Linux's default 32768-60999), where every process that binds
    port 0 gets its port (a Ray's GCS, raylet, agents and workers, a Serve of another test), and outside
    Ray's worker ports: none of them can take it in between. (Port 0 itself would give an ephemeral port,
    which any of them may take before the test's server binds it.)"""
    import random

    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.choice(FREE_PORTS)
        if port_free(port):
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS}")


def ray_tmpdir() -> str:
    """A fresh, short directory for RAY_TMPDIR (Unix socket paths under it must stay short)."""
    return tempfile.mkdtemp(prefix="rt", dir="/tmp")


def processes_under(path: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment or command line names ``path``: every
    process of a Ray started with ``RAY_TMPDIR=path`` inherits it (agents and workers rename themselves,
    ``ray::IDLE``, so their command lines do not tell)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes().decode(errors="replace")
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if (path in cmd or path in env) and "zombie" not in state:
            out.append((int(d.name), cmd[:200]))
    return out


def kill_under(path: str) -> None:
    """SIGKILL what still runs under ``path`` (test cleanup only)."""
    for pid, _ in processes_under(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_gone(path: str, timeout: float) -> list[tuple[int, str]]:
    """Wait up to ``timeout`` s for every process under ``path`` to exit; what is left."""
    deadline = time.time() + timeout
    while (left := processes_under(path)) and time.time() < deadline:
        time.sleep(0.2)
    return left


@dataclass
class Head:
    proc: subprocess.Popen
    address: str
    tmpdir: str                  # its RAY_TMPDIR: the pointer file lies in <tmpdir>/ray

    def env(self, **extra) -> dict:
        """An environment in which a plain ``ray.init()`` would find this head (its pointer file)."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        return dict(env, RAY_TMPDIR=self.tmpdir, RAY_AUTH_MODE="disabled", **extra)


def start_head(num_cpus: int = 1, timeout: float = 90) -> Head:
    """``ray start --head --block`` in its own process group; returns once its pointer file is written."""
    tmp = ray_tmpdir()
    port = free_port()
    env = dict({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled")
    log = open(Path(tmp) / "head.log", "w")
    proc = subprocess.Popen(
        [RAY_BIN, "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}", "--num-gpus=0",
         "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
         f"--dashboard-agent-listen-port={free_port()}", "--object-store-memory=100000000", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    pointer = Path(tmp) / "ray" / "ray_current_cluster"
    deadline = time.time() + timeout
    while not pointer.exists():
        if proc.poll() is not None or time.time() > deadline:
            stop_head(Head(proc, "", tmp))
            raise RuntimeError(f"ray start --head did not come up: {(Path(tmp) / 'head.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return Head(proc, pointer.read_text().strip(), tmp)


def stop_head(head: Head) -> None:
    """Stop exactly this head: its process group, then anything left under its temp dir. (A head told
    SIGTERM takes over 10 s to go, its GCS, raylet and agents too, measured: a test's head gets 2 s, then
    SIGKILL.)"""
    try:
        os.killpg(head.proc.pid, signal.SIGTERM)
        head.proc.wait(timeout=2)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    kill_under(head.tmpdir)
    wait_gone(head.tmpdir, 5)
    try:
        os.killpg(head.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on (IPv4 and IPv6, read from /proc)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:      # 0A: LISTEN
                continue
            hexip, hexport = f[1].split(":")
            raw = bytes.fromhex(hexip)
            if width == 8:
                ip = ".".join(str(b) for b in raw[::-1])
            else:
                words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(words))
            out.append((ip, int(hexport, 16)))
    return out


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def ray_titled_under(path: str) -> list[int]:
    """Processes titled by Ray (``ray::...``) that hold a file open under ``path``: Ray's agents overwrite
    their environment with their title, so :func:`processes_under` may not see them."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if not (d / "cmdline").read_bytes().startswith(b"ray::"):
                continue
            if any(os.readlink(fd).startswith(path) for fd in (d / "fd").iterdir()):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
