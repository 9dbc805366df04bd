"""The request head limit behind Serve's proxy (actors/serving/app/serve_proxy.py): a head larger than
DSQUANT_MAX_HEADER_BYTES is answered 431 and closed, by the httptools protocol while it arrives (the rest
is never buffered) and by ProxyGuard once it is in; heads under the limit, bodies of any allowed size and
keep-alive requests are untouched. In-process uvicorn on a free port; no Ray."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from actors.serving.app import serve_proxy
from local_uvicorn import serving, test_app

LIMIT = 4096


@pytest.fixture(params=["httptools", "h11"])
def server(request):
    """uvicorn with the guard and the protocol's limit-keeping subclass; yields (port, protocol name)."""
    from uvicorn.importer import import_from_string

    if request.param == "httptools":
        pytest.importorskip("httptools")
    base = import_from_string(serve_proxy._PROTOCOLS[request.param][0])
    cls = serve_proxy.head_timeout_protocol(base, 30.0, LIMIT)
    with serving(serve_proxy.ProxyGuard(test_app, max_header_bytes=LIMIT), cls) as port:
        yield port, request.param


def _exchange(port: int, raw: bytes, chunk: int = 65536) -> tuple[bytes, int]:
    """Send ``raw`` in chunks until the server closes; (everything it answered, bytes it took)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            while sent < len(raw):
                s.sendall(raw[sent:sent + chunk])
                sent += min(chunk, len(raw) - sent)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while data := s.recv(65536):
                out += data
        except ConnectionResetError:
            pass
    return out, sent


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def test_a_huge_header_is_refused_while_it_arrives(server):
    port, protocol = server
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 * 1024 * 1024)
    reply, sent = _exchange(port, head)
    if protocol == "httptools":
        assert _status(reply) == 431, reply[:200]
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_header_fields_too_large" and str(LIMIT) in body["error"]["message"]
    else:                                          # h11's own bound on a head: 400
        assert _status(reply) in (400, 431), reply[:200]
    assert sent < len(head)                        # closed long before the 64 MiB were taken


@pytest.mark.parametrize("size", [LIMIT + 1, 3 * LIMIT])
def test_a_complete_head_over_the_limit_is_431(server, size):
    port, protocol = server
    start = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    head = start + b"X-Pad: " + b"a" * (size - len(start)) + b"\r\nConnection: close\r\n\r\n"
    reply, _ = _exchange(port, head)
    assert _status(reply) == 431, reply[:200]


def test_heads_under_the_limit_bodies_and_keep_alive_are_untouched(server):
    port, _ = server
    body = b"b" * (1 << 20)
    first = (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (LIMIT // 2) + b"\r\nContent-Length: "
             + str(len(body)).encode() + b"\r\n\r\n" + body)
    second = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply, _ = _exchange(port, first + second)          # one connection: a 1 MiB body, then a pipelined request
    assert reply.count(b"HTTP/1.1 200 ") == 2 and body in reply, reply[:300]


def test_the_guard_alone_answers_431_without_calling_the_app():
    called = []

    async def app(scope, receive, send):
        called.append(scope)

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    guard = serve_proxy.ProxyGuard(app, max_header_bytes=LIMIT)
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": [(b"x-big", b"a" * LIMIT)]}
    asyncio.run(guard(scope, None, send))
    assert not called and sent[0]["status"] == 431
    asyncio.run(guard({**scope, "headers": [], "query_string": b"q=" + b"a" * LIMIT}, None, send))
    assert not called and sent[-2]["status"] == 431
    asyncio.run(guard({**scope, "headers": [(b"x-small", b"a" * 64)]}, None, send))
    assert called


@pytest.mark.parametrize("value, want", [("", 16384), ("65536", 65536), ("12", 16384), ("x", 16384)])
def test_the_limit_from_the_environment(value, want):
    assert serve_proxy.header_bytes_limit({"DSQUANT_MAX_HEADER_BYTES": value}) == want
