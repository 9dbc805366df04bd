"""SIGTERM (``kill``, ``timeout``, a service manager's stop) as an exception in a one-process job: the
job's ``finally`` blocks run (its hidden parts, a fallback probe, its lock are removed; an earlier output
stays whole) and it exits 143 with one line saying so, instead of dying silently with its files left."""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

STOPPED_RC = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException: no ``except Exception`` on the way swallows it)."""


def _raise(signum, frame) -> None:
    raise Terminated(signum)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stopped(what: str) -> int:
    """Say that the job stopped on SIGTERM; its exit status."""
    print(f"stopped: SIGTERM; {what}", file=sys.stderr, flush=True)
    return STOPPED_RC
