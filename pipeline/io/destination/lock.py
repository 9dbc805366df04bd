"""One writer per output location: a lock object beside the destination, on local disk, NFS and S3 alike.

A job that writes ``dst`` first creates ``.<name>.dsquant-lock`` in the directory holding ``dst``, with an
exclusive create: ``O_CREAT | O_EXCL`` on local and NFS paths (atomic on NFSv3 and later), a conditional
``PutObject`` (``If-None-Match: *``) on S3 and other object stores, read back to catch a store that ignores
the condition. The object says who holds it (host, pid and the process's start time, the command line, a
random token) and when it was last refreshed: a thread rewrites it every ``HEARTBEAT_S``. A second job
finds it and stops with one line naming the running job; it deletes nothing.

A lock is stale, and taken over, when its holder is gone: on the same host, its process no longer exists
(or the pid now belongs to a process started later); on another host, it has not been refreshed for
``stale_after`` seconds (``DSQUANT_LOCK_STALE_S``, default 600: a host that died, a job killed with -9
elsewhere). The holder checks its token before anything destructive (:meth:`DestinationLock.ensure`), so a
job whose lock was taken over stops instead of removing files another job wrote.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import sys
import threading
import time
import uuid
from typing import Any, Optional

from pipeline.io import storage

LOCK_SUFFIX = ".dsquant-lock"
HEARTBEAT_S = 30.0
STALE_ENV = "DSQUANT_LOCK_STALE_S"
DEFAULT_STALE_S = 600.0


class DestinationBusy(storage.StorageError):
    """Another job holds the destination's lock; the message names it."""


class LockLost(storage.StorageError):
    """This job's lock was taken over (it looked stale to another job); nothing more may be written."""


def lock_path(dst: str) -> str:
    """Where the lock of output location ``dst`` lives: a hidden sibling object."""
    return storage.sibling(dst, f".{posixpath.basename(dst.rstrip('/'))}{LOCK_SUFFIX}")


def _process_start(pid: int) -> Optional[int]:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int, start: Optional[int]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    now = _process_start(pid)
    return start is None or now is None or now == start


def _precondition_failed(e: BaseException) -> bool:
    """Whether an object store refused a conditional create because the object exists (HTTP 412)."""
    for err in (e, e.__cause__, e.__context__):
        code = (getattr(err, "response", None) or {}).get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            return True
    text = str(e).lower()
    return "precondition" in text or "pre-condition" in text


def stale_after() -> float:
    raw = os.environ.get(STALE_ENV)
    if raw is None:
        return DEFAULT_STALE_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{STALE_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{STALE_ENV} must be > 0, got {raw!r}")
    return value


def describe_holder(info: dict[str, Any]) -> str:
    """``pid 123 on host h since 2026-12-05 14:02:11 UTC (python -m jobs.quantize ...)``."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info.get("started", 0))))
    cmd = info.get("command") or "?"
    if len(cmd) > 160:
        cmd = cmd[:157] + "..."
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {since} ({cmd})"


def is_stale(info: dict[str, Any], now: Optional[float] = None, stale_s: Optional[float] = None) -> bool:
    """Whether the job that wrote lock ``info`` is gone (module doc)."""
    now = time.time() if now is None else now
    stale_s = stale_after() if stale_s is None else stale_s
    try:
        pid = int(info["pid"])
        beat = float(info["heartbeat"])
    except (KeyError, TypeError, ValueError):
        return now - float(info.get("_mtime", now)) > stale_s  # unreadable content: judged by age only
    if info.get("host") == socket.gethostname():
        start = info.get("pid_start")
        return not _pid_alive(pid, int(start) if isinstance(start, int) else None)
    return now - beat > stale_s


class DestinationLock:
    """The lock of ``dst`` (module doc). ``with DestinationLock(dst):`` takes it (or raises
    :class:`DestinationBusy`), refreshes it while the block runs and removes it after."""

    def __init__(self, dst: str, command: Optional[str] = None, heartbeat_s: float = HEARTBEAT_S):
        self.dst = dst
        self.path = lock_path(dst)
        self.token = uuid.uuid4().hex
        self.heartbeat_s = heartbeat_s
        self._command = command if command is not None else " ".join([os.path.basename(sys.executable), *sys.argv])
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lost: Optional[str] = None
        self.held = False

    # ----- the lock object ----------------------------------------------------------------------------
    def _content(self) -> bytes:
        info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "pid_start": _process_start(os.getpid()), "started": self._started, "heartbeat": time.time(),
                "command": self._command, "destination": self.dst}
        return json.dumps(info, indent=1).encode()

    def _read(self) -> Optional[dict[str, Any]]:
        """The lock's content, or None when there is no lock; {} with its mtime when unreadable."""
        try:
            raw = storage.read_bytes(self.path)
        except FileNotFoundError:
            return None
        try:
            info = json.loads(raw)
            if isinstance(info, dict):
                return info
        except ValueError:
            pass
        try:
            fs, p = storage.filesystem(self.path)
            mtime = fs.modified(p).timestamp()
        except Exception:  # noqa: BLE001 - age unknown: treat as fresh
            mtime = time.time()
        return {"_mtime": mtime}

    def _create(self) -> bool:
        """Create the lock object if there is none; whether this call created it."""
        data = self._content()
        fs, p = storage.filesystem(self.path)
        parent = posixpath.dirname(p)
        if not storage.is_url(self.path):
            if parent:
                os.makedirs(parent, exist_ok=True)
            try:
                fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        try:
            fs.pipe_file(p, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise
        info = self._read()  # a store that ignores If-None-Match: the last writer wins, and it may not be us
        return bool(info) and info.get("token") == self.token

    def _rewrite(self) -> None:
        """Refresh the heartbeat (the object is replaced whole: atomic rename locally, a PUT on S3)."""
        storage.write_bytes(self.path, self._content())

    # ----- taking and giving back -----------------------------------------------------------------------
    def acquire(self) -> "DestinationLock":
        for _ in range(5):
            if self._create():
                self.held = True
                self._start_heartbeat()
                return self
            info = self._read()
            if info is None:
                continue  # released in between: try again
            if not is_stale(info):
                raise DestinationBusy(
                    f"{self.dst}: another dsquant job is writing it: {describe_holder(info)}; wait for it to end "
                    f"or choose another --save-path (its lock: {self.path})")
            self._break(info)
        raise DestinationBusy(f"{self.dst}: could not take its lock {self.path} (other jobs keep taking it)")

    def _break(self, stale: dict[str, Any]) -> None:
        """Remove a stale lock, unless it changed since it was read (then the next loop judges it again)."""
        now = self._read()
        if now is not None and now.get("token") == stale.get("token") and now.get("heartbeat") == stale.get("heartbeat"):
            storage.remove(self.path)

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    info = self._read()
                    if info is None or info.get("token") != self.token:
                        self._lost = describe_holder(info) if info else "the lock was removed"
                        return
                    self._rewrite()
                except Exception:  # noqa: BLE001 - a failed refresh is retried at the next beat
                    pass

        self._thread = threading.Thread(target=beat, name="dest-lock", daemon=True)
        self._thread.start()

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless this job still holds the lock (call before deleting anything)."""
        if not self.held:
            raise LockLost(f"{self.dst}: this job does not hold its lock {self.path}")
        info = self._read()
        if self._lost is not None or info is None or info.get("token") != self.token:
            holder = describe_holder(info) if info else "the lock was removed"
            raise LockLost(f"{self.dst}: this job's lock was taken over ({holder}); stopping without "
                           "changing the destination further")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            info = self._read()
            if info is not None and info.get("token") == self.token:
                storage.remove(self.path)
        except Exception:  # noqa: BLE001 - a lock left behind is judged stale by the next job
            pass

    def __enter__(self) -> "DestinationLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
