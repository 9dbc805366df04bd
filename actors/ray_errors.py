"""What a Ray task error means for the caller: the application exception inside it, and whether redoing
the work elsewhere can succeed."""

from __future__ import annotations

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
