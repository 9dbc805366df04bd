"""The processes of a private Ray, found by a mark in their environment, and a watcher that stops them
when the job that started them ends without stopping them all (``kill -9``, the OOM killer, a stop cut
short).

:func:`actors.ray_start.init_ray` marks a private Ray: ``DSQUANT_RAY_MARK=<token>`` is in the job's
environment while ``ray.init`` starts the GCS and the raylet, so every process of that Ray inherits it:
the GCS, the raylet, its dashboard and runtime-env agents, the workers and what they start (HAProxy, an
engine core process). :func:`sweep` kills every process so marked; :func:`watch` starts a small process
of its own session (unmarked, stdlib only: this file run as a script) that waits for the job to exit,
gives the Ray's processes ``GRACE_S`` to exit on their own, then sweeps what is left. A job that stops
its Ray cleanly leaves the watcher nothing to do: it exits at once.
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


def marked(token: str, exclude: Iterable[int] = ()) -> list[int]:
    """The live processes (no zombies) whose environment holds ``DSQUANT_RAY_MARK=token``."""
    needle = f"{MARK_ENV}={token}".encode()
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
        if state != [b"Z"] and needle in env.split(b"\0"):
            out.append(int(name))
    return out


def sweep(token: str, exclude: Iterable[int] = ()) -> list[int]:
    """SIGKILL every process marked with ``token`` (but this one and ``exclude``); the pids signalled."""
    pids = marked(token, exclude)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def watch(token: str) -> subprocess.Popen:
    """Start the watcher of this process's private Ray (module doc)."""
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
    return subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), str(os.getpid()), token], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


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
    pid, token = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a terminal's Ctrl-C is the job's to handle
    _wait_exit(pid)
    deadline = time.monotonic() + GRACE_S
    while marked(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    sweep(token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
