"""Ray for a job: a private local Ray of its own, or the cluster that an address names.

``ray.init()`` without an address joins whatever cluster Ray's pointer file (``ray_current_cluster`` in
Ray's temp dir) names: a user's own ``ray start --head``, another run's test cluster. A job here joins a
cluster only when told to (an address flag or ``RAY_ADDRESS``, which ``ray job submit`` sets); otherwise
it starts a private one (``address="local"``, object store capped) that ``ray.shutdown()`` stops. One log
line says which.

An address is checked before anything else (:func:`check_address`: one gRPC call of the GCS, or of the
client server for ``ray://``, answered within ``PROBE_TIMEOUT_S``), so that one naming nothing
fails within seconds with ``no Ray cluster at ...`` instead of ``ray.init`` retrying for minutes. A private
Ray's processes carry a mark in their environment and a watcher process (:mod:`actors.cluster.ray_reaper`) stops
whatever of them outlives the job (``kill -9`` of the job included).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, NamedTuple, Optional

import ray

from actors.cluster import ray_reaper

ADDRESS_ENV = "RAY_ADDRESS"
PROBE_TIMEOUT_S = 3.0     # seconds for a cluster's address to answer one call
DEFAULT_GCS_PORT = 6379
_private_mark = None   # the PrivateRay started last


class NoCluster(ValueError):
    """The address given names no Ray cluster (the message says which and why)."""


def plain_logs() -> None:
    """No colour codes in the prefixes Ray puts on worker output (``(raylet)``, ``(pid=...)``) when this
    process's output is not a terminal (a file, a pipe, a log collector). An explicit setting wins."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def join_address(address: Optional[str]) -> Optional[str]:
    """The cluster to join: ``address`` (a flag), else ``RAY_ADDRESS``; None: start a private Ray (also
    for ``address="local"``, which asks for one)."""
    if address == "local":
        return None
    return address or os.environ.get(ADDRESS_ENV) or None


def _probe(target: str, client: bool, timeout: float) -> Optional[str]:
    """Why ``target`` (host:port) is not a Ray GCS (``client``: a Ray client server), or None: a gRPC
    call of that service (GCS: GetClusterId; client server: ClusterInfo) answers within ``timeout``."""
    import grpc

    method = "/ray.rpc.RayletDriver/ClusterInfo" if client else "/ray.rpc.NodeInfoGcsService/GetClusterId"
    channel = grpc.insecure_channel(target)
    try:
        channel.unary_unary(method)(b"", timeout=timeout)
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {timeout:g} s"
        if code == grpc.StatusCode.UNAVAILABLE:
            details = (e.details() or "").rpartition(": ")[2]
            return f"cannot connect ({details or 'unavailable'})"
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            return "something answers there, but not Ray's " + ("client server" if client else "GCS")
        # anything else (a refused token, a request the server did not like): a Ray server answered
    finally:
        channel.close()
    return None


def check_address(address: Optional[str], flag: str = "--address", timeout: float = PROBE_TIMEOUT_S) -> None:
    """When ``address`` / RAY_ADDRESS names a cluster to join, check that one answers there (module doc):
    NoCluster naming the address, where it came from and why, within about ``timeout`` seconds."""
    join = join_address(address)
    if not join:
        return
    source = flag if address else ADDRESS_ENV
    target = join
    if join == "auto":
        from ray._private import services

        try:
            target = services.canonicalize_bootstrap_address(join)
        except Exception:  # noqa: BLE001 - Ray says none runs here
            target = None
        if not target:
            raise NoCluster(f"no Ray cluster at {join} ({source}): none runs on this machine; start one "
                            f"(ray start --head) or leave {source} unset for a private one")
    client, hostport = target.startswith("ray://"), target.split("://", 1)[-1].rstrip("/")
    if not hostport.rpartition(":")[2].isdigit():
        hostport = f"{hostport}:{DEFAULT_GCS_PORT}"
    why = _probe(hostport, client, timeout)
    if why is not None:
        raise NoCluster(f"no Ray cluster at {join} ({source}): {why}")


class PrivateRay(NamedTuple):
    """How actors.cluster.ray_reaper finds the processes of a private Ray: its mark, its session directory."""

    mark: str
    session_dir: str


def _session_dir() -> str:
    try:
        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - Ray's internals moved: the mark alone then
        return ""


def private_ray() -> Optional[PrivateRay]:
    """The private Ray this process started last (actors.cluster.ray_reaper finds its processes), or None."""
    return _private_mark


def init_ray(address: Optional[str], *, num_cpus: int, object_store_memory: int,
             flag: str = "--address", log: Callable[[str], Any] = print, **init_kw) -> bool:
    """Join the cluster at ``address`` / RAY_ADDRESS, else start a private local Ray with ``num_cpus``
    and ``object_store_memory`` bytes of object store. ``flag``: the job's address flag, for the log line.
    ``init_kw`` go to ``ray.init`` either way. Returns
    True when the Ray was started here (private: ``ray.shutdown()`` stops all of it). NoCluster when the
    address names no cluster (:func:`check_address`)."""
    global _private_mark
    plain_logs()
    join = join_address(address)
    if join:
        check_address(address, flag)
        log(f"ray: joining the cluster at {join} (from {flag if address else ADDRESS_ENV})")
        ray.init(address=join, **init_kw)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # private: no token between this job's processes
    mark = ray_reaper.new_token()
    os.environ[ray_reaper.MARK_ENV] = mark      # inherited by the GCS and the raylet, and so by all the rest
    try:
        ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
                 include_dashboard=False, **init_kw)
    finally:
        os.environ.pop(ray_reaper.MARK_ENV, None)   # not by what this process starts later
    _private_mark = PrivateRay(mark, _session_dir())
    ray_reaper.watch(*_private_mark)
    log(f"ray: started a private local Ray for this job ({num_cpus} CPUs, object store "
        f"{object_store_memory / 2**20:.0f} MiB), stopped on exit ({flag} or {ADDRESS_ENV} joins a cluster instead)")
    return True
