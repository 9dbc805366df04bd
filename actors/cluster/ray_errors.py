"""What a Ray task error means for the caller: the application exception inside it, and whether redoing
the work elsewhere can succeed."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import ray
import ray.exceptions as rex

RETRYABLE = (rex.RayActorError, rex.ObjectLostError, rex.WorkerCrashedError, rex.NodeDiedError,
             rex.OutOfMemoryError)


def is_retryable(err: BaseException) -> bool:
    """A lost actor, worker, node or object: redoing the work elsewhere can succeed. A RayTaskError is
    retryable only when what it wraps is."""
    if isinstance(err, rex.RayTaskError):
        cause = getattr(err, "cause", None)
        return isinstance(cause, RETRYABLE)
    return isinstance(err, RETRYABLE)


def app_error(err: BaseException) -> BaseException:
    """The application exception inside a RayTaskError (what the user should read)."""
    cause = getattr(err, "cause", None) if isinstance(err, rex.RayTaskError) else None
    return cause if isinstance(cause, BaseException) else err


def is_restarting(err: BaseException) -> bool:
    """The actor is restarting (Ray's ActorUnavailableError): the same actor takes work again once it is
    back, so meeting it is a wait, not a lost attempt (resubmitted at once, every attempt would meet the
    restart in milliseconds)."""
    return isinstance(app_error(err), rex.ActorUnavailableError)


class Restarts:
    """The actors met restarting, by key: each rests before it takes work again (0.25 s, doubling to 4 s
    while it stays unavailable); one unavailable for longer than ``limit_s`` counts as lost (``met``
    returns False and the caller spends an attempt)."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self._since: dict[Any, float] = {}
        self._times: dict[Any, int] = {}
        self._until: dict[Any, float] = {}

    def met(self, key: Any, now: float) -> bool:
        """``key``'s actor is restarting: rest it. False once it has been so for longer than limit_s."""
        since = self._since.setdefault(key, now)
        n = self._times.get(key, 0)
        self._times[key] = n + 1
        self._until[key] = now + min(0.25 * 2 ** n, 4.0)
        return now - since <= self.limit_s

    def back(self, key: Any) -> None:
        """``key``'s actor did work: it is up."""
        for d in (self._since, self._times, self._until):
            d.pop(key, None)

    def resting(self, key: Any, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def wait(self, pending: Sequence[Any], timeout_s: float) -> list:
        """``ray.wait`` for the first of ``pending`` to finish, for at most timeout_s or until a resting
        actor may take work again; with nothing pending, sleep until then. Returns the finished refs."""
        wake = self.wake_in(time.monotonic())
        if not pending:
            time.sleep(wake if wake is not None else 0.05)
            return []
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(timeout_s, wake or timeout_s))
        return ready

    def wake_in(self, now: float) -> Optional[float]:
        """Seconds until the first resting actor may take work; None when none rests."""
        ahead = [t - now for t in self._until.values() if t > now]
        return min(ahead) if ahead else None
