"""The processes of a private Ray, found by a mark in their environment, and a watcher that stops them
when the job that started them ends without stopping them all (``kill -9``, the OOM killer, a stop cut
short).

:func:`actors.cluster.ray_start.init_ray` marks a private Ray: ``DSQUANT_RAY_MARK=<token>`` is in the job's
environment while ``ray.init`` starts the GCS and the raylet, so every process of that Ray inherits it:
the GCS, the raylet, its dashboard and runtime-env agents, the workers and what they start (HAProxy, an
engine core process). Some of them overwrite their environment with their process title (the agents);
those are titled ``ray::...`` and hold files open in the Ray's session directory (their logs), which
names them too.
:func:`sweep` kills every process so found; :func:`watch` starts a small process of its own session
(unmarked, stdlib only: this file run as a script) that waits for the job to exit, gives the Ray's
processes ``GRACE_S`` to exit on their own, then sweeps what is left. A job that stops its Ray cleanly
leaves the watcher nothing to do: it exits at once.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import Iterable

MARK_ENV = "DSQUANT_RAY_MARK"
GRACE_S = 1.0           # after the job's exit, for its Ray's processes to exit on their own


def new_token() -> str:
    return uuid.uuid4().hex


def _holds_file_under(pid: str, directory: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(directory):
                return True
        except OSError:
            continue
    return False


def _ray_titled(pid: str) -> bool:
    """Whether the process has a title of Ray's (``ray::...``: its agents and workers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(5) == b"ray::"
    except OSError:
        return False


def marked(token: str, session_dir: str = "", exclude: Iterable[int] = ()) -> list[int]:
    """The live processes (no zombies) whose environment holds ``DSQUANT_RAY_MARK=token``, or titled by Ray
    (``ray::``) and holding a file open under ``session_dir`` (the Ray's session directory; "": not looked
    at): never a user's own process that merely reads a log there."""
    needle = f"{MARK_ENV}={token}".encode()
    prefix = session_dir.rstrip("/") + "/" if session_dir else ""
    skip = {os.getpid(), *exclude}
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[:1]
        except OSError:
            continue
        if state == [b"Z"]:
            continue
        if needle in env.split(b"\0") or (prefix and _ray_titled(name) and _holds_file_under(name, prefix)):
            out.append(int(name))
    return out


def sweep(token: str, session_dir: str = "", exclude: Iterable[int] = ()) -> list[int]:
    """SIGKILL every process of the Ray (:func:`marked`) but this one and ``exclude``; the pids signalled."""
    pids = marked(token, session_dir, exclude)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def watch(token: str, session_dir: str = "") -> subprocess.Popen:
    """Start the watcher of this process's private Ray (module doc)."""
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
    return subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), str(os.getpid()), token, session_dir],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _wait_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
        os.close(fd)
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    pid, token, session_dir = int(argv[0]), argv[1], (argv[2] if len(argv) > 2 else "")
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a terminal's Ctrl-C is the job's to handle
    _wait_exit(pid)
    deadline = time.monotonic() + GRACE_S
    while marked(token, session_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    sweep(token, session_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
