"""The ingress's view of its engine (actors/serving/app/serve_ingress.py): ``await info()``, ``await stats()`` and
``stream(request)``, an event stream read with ``await s.__anext__()`` and stopped with ``s.cancel()``
(the sequence is aborted). Two kinds: :class:`RemoteEngine`, the ``LLMServer`` deployment behind a
DeploymentHandle (each event one Ray streaming item), and :class:`LocalEngine`, an ``LLMServer`` built in
the ingress's own process (``engine_in_ingress``: the engine core's events reach the HTTP streams with no
Ray hop)."""

from __future__ import annotations

from typing import Optional


class RemoteEngine:
    """The engine deployment, called through its DeploymentHandle."""

    local = False

    def __init__(self, handle):
        self.handle = handle

    async def info(self) -> dict:
        return await self.handle.info.remote()

    async def stats(self) -> dict:
        return await self.handle.stats.remote()

    def stream(self, request):
        return self.handle.options(stream=True).generate.remote(request)

    def check_health(self) -> None:
        """Serve checks the engine replicas itself."""

    def close(self) -> None:
        """The engine deployment's replicas are Serve's to stop."""


class LocalEngine:
    """An ``LLMServer`` (actors/serving/engine/llm_server.py) in this process: its engine steps in a child process (or on a
    thread, sharded) and its streams are read on this process's event loop."""

    local = True

    def __init__(self, server):
        self.server = server

    @classmethod
    def build(cls, config, prefill: Optional[object] = None) -> "LocalEngine":
        from actors.serving.engine.llm_server import LLMServer

        return cls(LLMServer.func_or_class(config, prefill))

    async def info(self) -> dict:
        return await self.server.info()

    async def stats(self) -> dict:
        return await self.server.stats()

    def stream(self, request):
        return self.server.stream(request)

    def check_health(self) -> None:
        self.server.check_health()

    def close(self) -> None:
        self.server.close()
