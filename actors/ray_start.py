"""Ray for a job: a private local Ray of its own, or the cluster that an address names.

``ray.init()`` without an address joins whatever cluster Ray's pointer file (``ray_current_cluster`` in
Ray's temp dir) names: a user's own ``ray start --head``, another run's test cluster. A job here joins a
cluster only when told to (an address flag or ``RAY_ADDRESS``, which ``ray job submit`` sets); otherwise
it starts a private one (``address="local"``, object store capped) that ``ray.shutdown()`` stops. One log
line says which.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import ray

ADDRESS_ENV = "RAY_ADDRESS"


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


def init_ray(address: Optional[str], *, num_cpus: int, object_store_memory: int,
             flag: str = "--address", log: Callable[[str], Any] = print, **init_kw) -> bool:
    """Join the cluster at ``address`` / RAY_ADDRESS, else start a private local Ray with ``num_cpus``
    and ``object_store_memory`` bytes of object store. ``flag``: the job's address flag, for the log line.
    ``init_kw`` go to ``ray.init`` either way. Returns
    True when the Ray was started here (private: ``ray.shutdown()`` stops all of it)."""
    plain_logs()
    join = join_address(address)
    if join:
        log(f"ray: joining the cluster at {join} (from {flag if address else ADDRESS_ENV})")
        ray.init(address=join, **init_kw)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # private: no token between this job's processes
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
             include_dashboard=False, **init_kw)
    log(f"ray: started a private local Ray for this job ({num_cpus} CPUs, object store "
        f"{object_store_memory / 2**20:.0f} MiB), stopped on exit ({flag} or {ADDRESS_ENV} joins a cluster instead)")
    return True
