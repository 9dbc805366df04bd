"""Issue 15, item 8, the header timeout: a slowloris client (many connections, each sending its request
head a byte at a time and never finishing) no longer holds the proxy's connections; see
actors/serving/app/serve_proxy.py. First uvicorn with the timeout-keeping protocols in-process (httptools and h11: a
slow head gets a 408 and is closed, an idle connection is closed; requests, keep-alive, streamed responses
and slowly sent bodies are untouched), then ``python -m jobs.serve`` itself (``--http-proxy serve``: the
front door with the header timeout, the default when an API key is set) with a 2 s timeout under 20 slow
connections."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import select
import socket
import threading
import time

import pytest

from actors.serving.app import serve_proxy
from local_uvicorn import serving, test_app

MARGIN_S = 2.0                     # in-process: slack past the timeout for a closing to be seen (a loaded CPU)
SERVE_TIMEOUT_S = 2.0              # jobs.serve's header timeout in the end-to-end test
SERVE_MARGIN_S = 3.0               # its slack (a loaded 2-core machine, a proxy in another process)
SLOW_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUser-Agent: slowloris\r\nX-Padding: " + b"a" * 4096


class SlowClients:
    """``n`` raw connections to ``port``, each sending ``head`` one byte every ``every`` seconds (never
    all of it) from one thread, noting when the server closed each and what it answered."""

    def __init__(self, port: int, n: int, head: bytes = SLOW_HEAD, every: float = 0.25, prefix: bytes = b""):
        self.head, self.every = head, every
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
        self.t0 = time.time()
        self.sent = [0] * n
        for i, s in enumerate(self.socks):
            # the head's first byte goes at once: the server's clock runs from the connection, and a slow
            # head whose first byte came only after the timeout (this thread starved on a loaded CPU) would
            # be an idle connection, closed without a 408
            s.sendall(prefix + self.head[:1])
            self.sent[i] = len(self.head[:1])
            s.setblocking(False)
        self.replies = [b""] * n
        self.closed_at: list[float | None] = [None] * n
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _close(self, i: int) -> None:
        if self.closed_at[i] is None:
            self.closed_at[i] = time.time() - self.t0

    def _run(self) -> None:
        while not self._stop.is_set() and not all(self.closed):
            open_ = [s for i, s in enumerate(self.socks) if self.closed_at[i] is None]
            readable, _, _ = select.select(open_, [], [], self.every)
            for s in readable:
                i = self.socks.index(s)
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, BlockingIOError):
                    chunk = b""
                self.replies[i] += chunk
                if not chunk:
                    self._close(i)
            for i, s in enumerate(self.socks):
                if self.closed_at[i] is None and self.head:
                    try:
                        s.send(self.head[self.sent[i] % len(self.head):][:1])
                        self.sent[i] += 1
                    except (BrokenPipeError, ConnectionResetError):
                        self._close(i)
                    except BlockingIOError:
                        pass

    @property
    def closed(self) -> list[bool]:
        return [t is not None for t in self.closed_at]

    def wait_closed(self, timeout: float) -> None:
        deadline = self.t0 + timeout
        while not all(self.closed) and time.time() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.socks:
            s.close()


# ----- in-process: the protocols ----------------------------------------------------------------------------

@pytest.fixture(params=["httptools", "h11"])
def local_server(request):
    """uvicorn on a free port with the protocol's timeout-keeping subclass (0.8 s); yields (port, timeout)."""
    from uvicorn.importer import import_from_string

    from uvicorn.config import HTTP_PROTOCOLS

    if request.param == "httptools":
        pytest.importorskip("httptools")
    timeout = 0.8
    base = import_from_string(serve_proxy._PROTOCOLS[request.param][0])
    assert HTTP_PROTOCOLS[request.param] == serve_proxy._PROTOCOLS[request.param][0]  # nothing installed here
    cls = serve_proxy.head_timeout_protocol(base, timeout)
    assert issubclass(cls, base) and cls.head_timeout_s == timeout
    with serving(test_app, cls) as port:
        yield port, timeout


def _request(port: int, raw: bytes, pieces: int = 1, step: float = 0.0) -> bytes:
    """Send ``raw`` (in ``pieces``, ``step`` s apart) and read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        size = -(-len(raw) // pieces)
        for i in range(0, len(raw), size):
            s.sendall(raw[i:i + size])
            time.sleep(step)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _read_to_eof(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _slow_and_idle_heads(port: int, timeout: float) -> None:
    slow = SlowClients(port, 3, every=0.1)
    idle = SlowClients(port, 2, head=b"")
    try:
        slow.wait_closed(timeout + MARGIN_S)
        idle.wait_closed(timeout + MARGIN_S)
        assert all(slow.closed) and all(idle.closed), (slow.closed_at, idle.closed_at)
        for t in slow.closed_at + idle.closed_at:
            assert timeout * 0.9 <= t <= timeout + MARGIN_S, (slow.closed_at, idle.closed_at)
        for reply in slow.replies:
            assert reply.startswith(b"HTTP/1.1 408 ") and reply.endswith(json.dumps({"error": {
                "message": f"the request head did not arrive within {timeout:g} s", "type": "invalid_request_error",
                "param": None, "code": "request_timeout"}}, separators=(",", ":")).encode()), reply
        assert idle.replies == [b"", b""]  # a connection that sent nothing is just closed
    finally:
        slow.stop()
        idle.stop()


def _a_head_sent_bytewise_in_time(port: int, timeout: float) -> None:
    raw = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert _request(port, raw, pieces=len(raw) // 4, step=0.01).endswith(b"\r\nok")


def _a_long_stream(port: int, timeout: float) -> None:
    t0 = time.time()
    assert _request(port, b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").count(b"data: ") == 8
    assert time.time() - t0 > 2 * timeout


def _a_slow_body(port: int, timeout: float) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 6\r\n\r\n")
        for b in b"abcdef":
            time.sleep(0.25)
            s.sendall(bytes([b]))
        reply = _read_to_eof(s)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"\r\nabcdef"), reply


def _keep_alive_idle(port: int, timeout: float) -> None:
    """Idle longer than the timeout between requests is fine (uvicorn's keep-alive decides)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/")
    assert conn.getresponse().read() == b"ok"
    sock = conn.sock
    time.sleep(timeout * 3)
    conn.request("GET", "/")
    assert conn.getresponse().read() == b"ok" and conn.sock is sock
    conn.close()


def _keep_alive_then_a_slow_head(port: int, timeout: float) -> None:
    """The next request's head, begun later on a kept-alive connection, has the timeout from its first byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while not reply.endswith(b"\r\nok"):
            reply += s.recv(65536)
        time.sleep(timeout * 2)
        t1, reply = time.time(), b""
        s.setblocking(False)
        for b in SLOW_HEAD:
            if time.time() - t1 > timeout + MARGIN_S:
                break
            try:
                s.send(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([s], [], [], 0.1)[0]:
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                reply += chunk
                if not chunk:
                    break
        took = time.time() - t1
    assert reply.startswith(b"HTTP/1.1 408 ") and timeout * 0.9 <= took <= timeout + MARGIN_S, (reply, took)


def test_a_slow_head_is_answered_408_and_closed_and_nothing_else_changes(local_server):
    """Each check on its own connections, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    port, timeout = local_server
    checks = (_slow_and_idle_heads, _a_head_sent_bytewise_in_time, _a_long_stream, _a_slow_body,
              _keep_alive_idle, _keep_alive_then_a_slow_head)
    with ThreadPoolExecutor(len(checks)) as pool:
        for future in [pool.submit(check, port, timeout) for check in checks]:
            future.result()


# ----- installing ---------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_install(monkeypatch):
    """uvicorn's protocol table and the module's install state, restored afterwards; yields the table and
    the warnings logged."""
    from uvicorn.config import HTTP_PROTOCOLS

    for name, path in list(HTTP_PROTOCOLS.items()):
        monkeypatch.setitem(HTTP_PROTOCOLS, name, path)
    monkeypatch.setattr(serve_proxy, "_installed", {})
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    serve_proxy.log.addHandler(handler)
    try:
        yield HTTP_PROTOCOLS, warnings
    finally:
        serve_proxy.log.removeHandler(handler)


def test_install_replaces_uvicorns_protocols_once(fresh_install, monkeypatch):
    import uvicorn

    table, warnings = fresh_install
    monkeypatch.setenv(serve_proxy.HEADER_TIMEOUT_ENV, "3.5")
    assert serve_proxy.install_header_timeout() is True
    classes = dict(table)
    assert {n: c.head_timeout_s for n, c in classes.items() if n != "zttp"} == {"auto": 3.5, "h11": 3.5,
                                                                                "httptools": 3.5}
    assert serve_proxy.install_header_timeout(1.0) is True and dict(table) == classes  # once per process
    config = uvicorn.Config(test_app, http="auto")
    config.load()
    assert config.http_protocol_class is classes["auto"] is classes["httptools"]
    assert warnings == []


@pytest.mark.parametrize("value, want", [("", 10.0), ("2.5", 2.5), ("0", None), ("-1", None), ("soon", 10.0),
                                         ("nan", 10.0), ("inf", 10.0)])
def test_the_timeout_from_the_environment(value, want):
    assert serve_proxy.header_timeout_s({serve_proxy.HEADER_TIMEOUT_ENV: value}) == want


def test_install_does_nothing_but_warn_when_off_or_uvicorn_is_not_as_expected(fresh_install, monkeypatch):
    table, warnings = fresh_install
    before = dict(table)
    monkeypatch.setenv(serve_proxy.HEADER_TIMEOUT_ENV, "0")
    assert serve_proxy.install_header_timeout() is False and dict(table) == before
    assert warnings[-1].startswith("dsquant: DSQUANT_HEADER_TIMEOUT_S turns the request header timeout off")
    monkeypatch.setitem(table, "h11", "somewhere.else:Protocol")
    before = dict(table)
    assert serve_proxy.install_header_timeout(2.0) is False and dict(table) == before and not serve_proxy._installed
    assert warnings[-1].startswith("dsquant: no request header timeout (uvicorn ") and "somewhere.else" in warnings[-1]
    with pytest.raises(TypeError, match="not a uvicorn HTTP/1.1 protocol class"):
        serve_proxy.head_timeout_protocol(asyncio.Protocol, 1.0)


# ----- end to end: jobs.serve -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_jobs_serve_closes_slowloris_connections_and_keeps_answering(embedded_quantized, tmp_path, monkeypatch):
    """20 slow heads against ``python -m jobs.serve`` (header timeout 2 s via the environment, so in the
    proxy of the private Ray it starts): each gets its 408 and is closed within the timeout + SERVE_MARGIN_S,
    while /health, /v1/models and a streamed chat completion are answered; a keep-alive connection idle
    for longer than the timeout is served again; afterwards it still answers."""
    openai = pytest.importorskip("openai")
    from test_serve_shutdown import Served

    monkeypatch.setenv(serve_proxy.HEADER_TIMEOUT_ENV, f"{SERVE_TIMEOUT_S:g}")
    served = Served(embedded_quantized, tmp_path, ("--http-proxy", "serve"))  # its environment: this one
    try:
        served.wait_for("serving ")
        base = f"http://127.0.0.1:{served.port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        slow = SlowClients(served.port, 20)
        try:
            t0 = time.time()
            kept = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)  # used again below
            kept.request("GET", "/v1/models")
            assert kept.getresponse().read()
            with urllib_open(f"{base}/health") as r:
                assert r.status == 200
            with urllib_open(f"{base}/v1/models") as r:
                model = json.load(r)["data"][0]["id"]
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=16, temperature=0, stream=True)
            chunks = [c for c in stream]
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
            took = time.time() - t0
            assert took < SERVE_TIMEOUT_S + SERVE_MARGIN_S, f"normal requests took {took:.1f} s beside slow heads"
            slow.wait_closed(SERVE_TIMEOUT_S + SERVE_MARGIN_S)
            assert all(slow.closed), f"{slow.closed.count(False)} of 20 slow connections still open after " \
                                     f"{time.time() - slow.t0:.1f} s: {slow.closed_at}"
            assert all(r.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in r for r in slow.replies), \
                slow.replies
            assert min(slow.closed_at) >= SERVE_TIMEOUT_S * 0.9, slow.closed_at
            # a keep-alive connection idle for longer than the header timeout is still served
            sock = kept.sock
            kept.request("GET", "/health")
            assert kept.getresponse().status == 200 and kept.sock is sock
            kept.close()
        finally:
            slow.stop()
        with urllib_open(f"{base}/v1/models") as r:
            assert r.status == 200 and json.load(r)["data"]
        assert "request heads must arrive within 2 s" in proxy_logs(served.ray_tmp)
    finally:
        served.cleanup()


def urllib_open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=30)


def proxy_logs(ray_tmp: str) -> str:
    """The text of Serve's proxy logs under a Ray temp dir."""
    from pathlib import Path

    return "".join(p.read_text(errors="replace")
                   for p in Path(ray_tmp).glob("ray/session_latest/logs/serve/proxy_*.log"))
