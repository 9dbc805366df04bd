"""An in-process uvicorn for the front-door tests (the head timeout, the head size limit): a free port,
a small ASGI app, and the server run on a thread for the length of a ``with`` block."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_app(scope, receive, send):
    """``/stream``: 8 chunks 0.25 s apart; ``/echo``: the body; else ``ok``."""
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(8):
            await asyncio.sleep(0.25)
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    out = body if scope["path"] == "/echo" else b"ok"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


test_app.__test__ = False   # an app, not a test


@contextmanager
def serving(app, http) -> Iterator[int]:
    """uvicorn serving ``app`` with protocol class ``http`` on a free port of 127.0.0.1; yields the port."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="error",
                                           lifespan="off", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
