"""The engine event streams of one generation request, as the ingress (actors/serving/app/serve_ingress.py) reads
them: each of its ``n`` choices is an engine request whose ``EngineOutput`` s come through a Serve
streaming handle. :func:`first_event` reads a choice's first event (before any header goes out, so a
refusal is still an HTTP error: :func:`first_error` says which), :func:`merge_events` then interleaves
the choices' events as they come, each choice's in order up to its finish reason, and raises
:class:`ShuttingDown` as soon as the ingress drains."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from actors.cluster.ray_errors import app_error
from pipeline.engine.protocol import EngineDead, EngineOutput, PrefillFailed
from pipeline.serving.endpoints import openai_api as api
from pipeline.serving.endpoints.openai_api import ApiError


class ShuttingDown(Exception):
    """The ingress is draining for shutdown: open streams end, new requests are refused."""


class NoEvents(RuntimeError):
    """A choice's event stream ended before its first event."""


def engine_failed(cause: BaseException) -> ApiError:
    """A request the engine failed: 503 when the engine replica itself is down (its loop stopped, e.g. a
    rank of a sharded replica died: Serve replaces it, a retry can succeed), else 500."""
    status = 503 if isinstance(cause, EngineDead) else 500
    return ApiError(status, f"the engine failed: {type(cause).__name__}: {cause}", "server_error")


def shutdown_error() -> ApiError:
    return ApiError(503, "the server is shutting down; retry the request", "server_error", None,
                    "server_shutting_down")


def first_error(e: BaseException) -> ApiError:
    """The HTTP error of a choice whose first event failed: the engine's refusal (a ValueError) is a 400,
    a failed prefill (disaggregated) a 503, anything else the engine's failure."""
    if isinstance(e, NoEvents):
        return ApiError(500, "the engine's event stream ended without a token or a finish reason", "server_error")
    cause = app_error(e)
    if isinstance(cause, ValueError):
        return api.invalid(str(cause))
    if isinstance(cause, PrefillFailed):
        return ApiError(503, str(cause), "server_error", None, "prefill_unavailable")
    return engine_failed(cause)


async def first_event(gen) -> EngineOutput:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise NoEvents() from None


async def merge_events(gens: Sequence, firsts: Sequence[EngineOutput],
                       draining: asyncio.Event) -> AsyncIterator[tuple[int, EngineOutput]]:
    """(choice index, event): the first events, then every choice's next events as they arrive (several
    ready at once: in index order), each choice up to the event with its finish reason. EngineDead when a
    stream ends without one; ShuttingDown once ``draining`` is set (the events already arrived first)."""
    futs: dict[int, asyncio.Future] = {}
    drain = asyncio.ensure_future(draining.wait())
    try:
        for i, ev in enumerate(firsts):
            yield i, ev
            if ev.finish_reason is None:
                futs[i] = asyncio.ensure_future(gens[i].__anext__())
        while futs:
            done, _ = await asyncio.wait({*futs.values(), drain}, return_when=asyncio.FIRST_COMPLETED)
            for i in sorted(i for i, f in futs.items() if f in done):
                try:
                    ev = futs.pop(i).result()
                except StopAsyncIteration:
                    raise EngineDead("the engine's event stream ended without a finish reason") from None
                yield i, ev
                if ev.finish_reason is None:
                    futs[i] = asyncio.ensure_future(gens[i].__anext__())
            if drain in done and futs:
                raise ShuttingDown()
    finally:
        drain.cancel()
        for f in futs.values():
            f.cancel()
