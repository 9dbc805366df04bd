"""What ``jobs.serve`` puts between Ray's HAProxy manager and the HAProxy binary: Ray's configuration binds
HAProxy's Prometheus frontend and its stats page on every interface, whatever host the server was asked
to serve on, and makes its admin socket (which can reconfigure HAProxy) mode 666. ``jobs.serve`` points
``RAY_SERVE_HAPROXY_BINARY_PATH`` at a shim (:func:`write_shim`) that runs :func:`main` before each HAProxy
start (reloads included), which

- rewrites the configuration file it is given: those two frontends bind the host jobs.serve serves on
  (``DSQUANT_HAPROXY_HOST``; a wildcard host leaves them as they are) and the admin socket is mode 600;
- makes HAProxy die with the process that starts it (the HAProxy manager, a Ray worker): no HAProxy
  outlives its Ray holding the port;
- then runs the real binary in its place (same pid, same arguments).

Standard library only: it runs before every HAProxy start.
"""

from __future__ import annotations

import os
import re
import signal
import sys

HOST_ENV = "DSQUANT_HAPROXY_HOST"
WILDCARDS = ("", "*", "0.0.0.0", "::")
PR_SET_PDEATHSIG = 1
_BIND_ANY = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::)?:(\d+)(.*)$")
_SOCKET_MODE = re.compile(r"^(\s*stats\s+socket\s+\S+\s+mode\s+)6[0-7][0-7](.*)$")


def restrict(config: str, host: str) -> str:
    """``config`` with every ``bind :PORT`` / ``bind *:PORT`` on ``host`` (unless it is a wildcard) and the
    admin socket's mode 600."""
    out = []
    for line in config.split("\n"):
        m = _BIND_ANY.match(line)
        if m and host not in WILDCARDS:
            line = f"{m.group(1)}{host}:{m.group(2)}{m.group(3)}"
        m = _SOCKET_MODE.match(line)
        if m:
            line = f"{m.group(1)}600{m.group(2)}"
        out.append(line)
    return "\n".join(out)


def _rewrite(path: str, host: str) -> None:
    with open(path) as f:
        text = f.read()
    new = restrict(text, host)
    if new != text:
        tmp = f"{path}.dsquant-tmp"
        with open(tmp, "w") as f:
            f.write(new)
        os.replace(tmp, path)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: the job's sweep still stops it
        pass


def main(real: str, argv: list[str]) -> None:
    """Rewrite the ``-f`` configuration (module doc), then exec ``real`` with ``argv``."""
    if "-f" in argv[:-1]:
        _rewrite(argv[argv.index("-f") + 1], os.environ.get(HOST_ENV, ""))
    _die_with_parent()
    os.execv(real, [real, *argv])


def write_shim(directory: str, real: str) -> str:
    """An executable ``haproxy`` in ``directory`` that runs :func:`main` for the binary ``real``."""
    import actors

    root = os.path.dirname(os.path.dirname(os.path.abspath(actors.__file__)))    # the directory holding actors/
    path = os.path.join(directory, "haproxy")
    with open(path, "w") as f:
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {root!r})\n"
                f"from actors.serving.app.serve_haproxy import main\nmain({real!r}, sys.argv[1:])\n")
    os.chmod(path, 0o700)
    return path
