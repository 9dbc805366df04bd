"""A guard in front of Ray Serve's HTTP proxy, for what happens there before any request reaches the
ingress: Serve echoes ``X-Request-ID`` verbatim (any size) and answers a non-UTF-8 one with a 500, it
answers ``/-/routes`` to anyone, and its uvicorn server has no time limit for a request's head, so a
slowloris client (many connections, each sending its headers a byte every few seconds and never finishing)
holds connections open for as long as it likes.

:class:`ProxyGuard` (an ASGI middleware, outermost in the proxy) replaces an ``X-Request-ID`` that is not
1-128 characters of ``[A-Za-z0-9._:-]`` with a fresh id, drops any other header whose value is not
UTF-8 (Serve decodes some of them), and with an API key answers ``/-/routes`` only with
``Authorization: Bearer <key>`` (``/-/healthz`` stays open, like ``/health``). A request head (request line
and headers) larger than ``DSQUANT_MAX_HEADER_BYTES`` (default 16 KiB, as HAProxy's front door) is answered
``431`` with an OpenAI-style ``request_header_fields_too_large`` error: by the guard once it is in, and by the
httptools protocol below while it arrives (so a 100 MB header is not buffered first; h11 refuses heads over
its own 16 KiB with a 400).

The header timeout (:func:`install_header_timeout`, run once by the callback in the proxy's process):
uvicorn's HTTP/1.1 protocols (httptools, which Serve's ``http="auto"`` picks when it is installed, and h11)
are subclassed so that a request head must arrive whole within ``DSQUANT_HEADER_TIMEOUT_S`` seconds
(default 10; 0 turns it off), counted from the connection's opening for its first request and from the
first byte of each later request on a keep-alive connection (idle time between requests stays uvicorn's
keep-alive timeout, Serve's ``RAY_SERVE_HTTP_KEEP_ALIVE_TIMEOUT_S``). Past it the connection is answered
``408`` with an OpenAI-style ``request_timeout`` error and closed (a connection that sent nothing is just
closed). Once the head is in, nothing is timed here: streamed responses last as long as they last, and a
slowly sent body is the ingress's ``body_timeout_s`` (408). The subclasses are put in place of uvicorn's
own only in ``uvicorn.config.HTTP_PROTOCOLS`` (names to classes) of the proxy's process, only when the
uvicorn internals they rely on look as expected (checked against uvicorn 0.54, Ray Serve 2.60); otherwise a
warning is logged and the proxy runs as before.

Serve 2.60 takes proxy middlewares only from a callback named by an environment variable that must be set
in the proxies' environment, i.e. before Ray starts (``jobs.serve`` does this for a Ray it starts; for an
existing cluster set it where the cluster is started); the other variables are read in the proxies too::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=actors.serving.app.serve_proxy:proxy_middlewares
    DSQUANT_API_KEY=sk-...        # the key /-/routes then needs (optional)
    DSQUANT_HEADER_TIMEOUT_S=10   # seconds a request head may take to arrive (optional; 0: no limit)
    DSQUANT_MAX_HEADER_BYTES=16384  # the largest request head (optional)
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import uuid
from typing import Optional

from actors.serving.api_keys import KEY_ENV, authorized

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "actors.serving.app.serve_proxy:proxy_middlewares"
HEADER_TIMEOUT_ENV = "DSQUANT_HEADER_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0
HEADER_BYTES_ENV = "DSQUANT_MAX_HEADER_BYTES"
DEFAULT_MAX_HEADER_BYTES = 16 * 1024   # a request head's bytes (request line and headers), as HAProxy's buffer
REQUEST_ID = b"x-request-id"
_VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
KEYED_PATHS = ("/-/routes",)

log = logging.getLogger("ray.serve")  # in the proxy, Serve's logger writes to its proxy log


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def clean_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers with a bad X-Request-ID replaced by a fresh id and non-UTF-8 values dropped."""
    out = []
    for key, value in headers:
        if key.lower() == REQUEST_ID:
            if not _VALID_ID.fullmatch(value):
                value = uuid.uuid4().hex.encode()
        elif not _utf8(value):
            continue
        out.append((key, value))
    return out


def _env_number(environ, name: str, default: float, ok, what: str) -> float:
    """``name``'s value as a float, ``default`` when unset; one that is not a number or fails ``ok`` is
    warned about (saying it must be ``what``) and the default used."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or not ok(value):
        log.warning("dsquant: %s=%r is not %s; using %g", name, raw, what, default)
        return default
    return value


def header_bytes_limit(environ=os.environ) -> int:
    """``DSQUANT_MAX_HEADER_BYTES`` (default 16 KiB); a value that is not a whole number >= 1024 is warned
    about and the default used."""
    return int(_env_number(environ, HEADER_BYTES_ENV, DEFAULT_MAX_HEADER_BYTES,
                           lambda v: 1024 <= v < math.inf and v == int(v), "a number of bytes >= 1024"))


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
                      separators=(",", ":")).encode()


def _too_large_body(limit: int) -> bytes:
    return _error_body(f"the request head (request line and headers) is larger than this server's limit of "
                       f"{limit} bytes", "request_header_fields_too_large")


class ProxyGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app, api_key: Optional[str] = None, max_header_bytes: Optional[int] = None):
        self.app, self.api_key = app, api_key
        self.max_header_bytes = max_header_bytes if max_header_bytes is not None else header_bytes_limit()

    @staticmethod
    async def _answer(send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        return authorized(dict((k.lower(), v) for k, v in headers).get(b"authorization"), self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers", []))
        head = (len(scope.get("raw_path") or scope.get("path", "").encode()) + len(scope.get("query_string") or b"")
                + sum(len(k) + len(v) + 4 for k, v in headers))
        if scope["type"] == "http" and head > self.max_header_bytes:
            return await self._answer(send, 431, _too_large_body(self.max_header_bytes))
        scope = {**scope, "headers": clean_headers(headers)}
        if self.api_key and scope["type"] == "http" and scope.get("path", "").endswith(KEYED_PATHS) \
                and not self._authorized(scope["headers"]):
            return await self._answer(send, 401, _error_body("no valid API key was provided: send 'Authorization: "
                                                             "Bearer <key>'", "invalid_api_key"))
        await self.app(scope, receive, send)


# ----- the header timeout ---------------------------------------------------------------------------------

def header_timeout_s(environ=os.environ) -> Optional[float]:
    """``DSQUANT_HEADER_TIMEOUT_S`` in seconds (default 10); None for no limit (0 or less). A value that is
    not a finite number is warned about and the default used."""
    value = _env_number(environ, HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S, lambda v: not math.isinf(v),
                        "a number of seconds")
    return value if value > 0 else None


def _raw_response(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def _timeout_response(timeout_s: float) -> bytes:
    return _raw_response(b"408 Request Timeout", _error_body(f"the request head did not arrive within {timeout_s:g} s",
                                                              "request_timeout"))


class _HeadDeadline:
    """What both protocol subclasses share: one timer per connection, armed while a request head is
    awaited; when it fires the connection gets a 408 (if part of a request came) and is closed."""

    head_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    head_max_bytes: int = DEFAULT_MAX_HEADER_BYTES
    _head_timer: Optional[asyncio.TimerHandle] = None
    _head_started = False          # some bytes of the awaited head have come
    _head_bytes = 0                # bytes of the awaited head received (whole reads while it was awaited)
    _head_transport = None

    def _count_head(self, n: int) -> None:
        """``n`` more bytes of a head still incomplete: past ``head_max_bytes`` the connection gets a 431 and
        is closed, before the parser buffers more (ProxyGuard answers a complete head over the limit)."""
        self._head_bytes += n
        transport = self._head_transport
        if self._head_bytes > self.head_max_bytes and transport is not None and not transport.is_closing():
            self._cancel_head_timer()
            transport.write(_raw_response(b"431 Request Header Fields Too Large", _too_large_body(self.head_max_bytes)))
            transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None and self._head_transport is not None:
            self._head_timer = asyncio.get_running_loop().call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_started = False
        self._head_bytes = 0

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self._head_transport
        if transport is None or transport.is_closing():
            return
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not getattr(cycle, "response_complete", True):
            # a pipelined head behind a response still being sent: the server is the slow one; its time
            # counts again once that response is done
            self._arm_head_timer()
            return
        if self._head_started:
            transport.write(_timeout_response(self.head_timeout_s))
        transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_transport = transport
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        self._head_transport = None
        super().connection_lost(exc)


def _httptools_subclass(base: type, timeout_s: float, max_bytes: int) -> type:
    class HeadTimeoutHttpToolsProtocol(_HeadDeadline, base):
        head_timeout_s = timeout_s
        head_max_bytes = max_bytes

        def data_received(self, data: bytes) -> None:
            awaited = self._head_timer is not None   # a read that ends one request and starts the next: not counted
            super().data_received(data)
            if self._head_timer is not None and data:
                self._head_started = True
                if awaited:
                    self._count_head(len(data))

        def on_message_begin(self) -> None:  # the parser: the first byte of a request
            super().on_message_begin()
            self._arm_head_timer()

        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            super().on_headers_complete()

    return HeadTimeoutHttpToolsProtocol


def _h11_subclass(base: type, timeout_s: float, max_bytes: int) -> type:
    import h11

    class HeadTimeoutH11Protocol(_HeadDeadline, base):   # h11 bounds a head itself (16 KiB: 400 beyond)
        head_timeout_s = timeout_s
        head_max_bytes = max_bytes

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if getattr(getattr(self, "conn", None), "their_state", None) is h11.IDLE:
                if data:  # (the rest of) a head is awaited
                    self._arm_head_timer()
                    self._head_started = self._head_timer is not None
            else:         # the head is in (or the connection is done with HTTP/1.1)
                self._cancel_head_timer()

    return HeadTimeoutH11Protocol


# uvicorn's protocol names, what they name in uvicorn 0.54, the methods the subclasses extend
_PROTOCOLS = {
    "httptools": ("uvicorn.protocols.http.httptools_impl:HttpToolsProtocol", _httptools_subclass,
                  ("connection_made", "connection_lost", "data_received", "on_message_begin",
                   "on_headers_complete")),
    "h11": ("uvicorn.protocols.http.h11_impl:H11Protocol", _h11_subclass,
            ("connection_made", "connection_lost", "data_received")),
}
_AUTO = ("auto", "uvicorn.protocols.http.auto:AutoHTTPProtocol")
_installed: dict[str, type] = {}  # protocol name -> the subclass now in HTTP_PROTOCOLS


def head_timeout_protocol(base: type, timeout_s: float, max_bytes: Optional[int] = None) -> type:
    """A subclass of uvicorn's ``HttpToolsProtocol`` or ``H11Protocol`` (``base``) that closes a connection
    whose request head takes longer than ``timeout_s`` (408 if part of it came), or grows past ``max_bytes``
    (431; default ``DSQUANT_MAX_HEADER_BYTES``); see the module docstring. Usable as
    ``uvicorn.Config(http=...)``."""
    for path, make, methods in _PROTOCOLS.values():
        if base.__name__ == path.rpartition(":")[2]:
            missing = [m for m in methods if not callable(getattr(base, m, None))]
            if missing:
                raise TypeError(f"{base.__module__}.{base.__name__} has no {', '.join(missing)}")
            return make(base, timeout_s, max_bytes if max_bytes is not None else header_bytes_limit())
    raise TypeError(f"not a uvicorn HTTP/1.1 protocol class: {base!r}")


def install_header_timeout(timeout_s: Optional[float] = None) -> bool:
    """Make uvicorn servers started later in this process (Serve's proxy) use :func:`head_timeout_protocol`
    for ``http="auto"``, ``"httptools"`` and ``"h11"``, by replacing those entries of
    ``uvicorn.config.HTTP_PROTOCOLS``. ``timeout_s`` defaults to ``DSQUANT_HEADER_TIMEOUT_S``. Idempotent:
    only the first call in a process installs. True when the timeout is in place; False (with a warning,
    nothing changed) when it is turned off or uvicorn is not as expected."""
    if _installed:
        return True
    timeout_s = header_timeout_s() if timeout_s is None else (timeout_s if timeout_s > 0 else None)
    if timeout_s is None:
        log.warning("dsquant: %s turns the request header timeout off: slowly sent headers hold connections",
                    HEADER_TIMEOUT_ENV)
        return False
    version = "?"
    try:
        import uvicorn
        from uvicorn.config import HTTP_PROTOCOLS
        from uvicorn.importer import import_from_string

        version = getattr(uvicorn, "__version__", "?")
        subclasses: dict[str, type] = {}
        for name, (path, _, _) in _PROTOCOLS.items():
            if HTTP_PROTOCOLS.get(name) != path:
                raise TypeError(f"uvicorn.config.HTTP_PROTOCOLS[{name!r}] is {HTTP_PROTOCOLS.get(name)!r}, "
                                f"not {path!r}")
            try:
                base = import_from_string(path)
            except ImportError:  # httptools (an optional dependency of uvicorn) is not installed
                continue
            subclasses[name] = head_timeout_protocol(base, timeout_s)
        if HTTP_PROTOCOLS.get(_AUTO[0]) != _AUTO[1]:
            raise TypeError(f"uvicorn.config.HTTP_PROTOCOLS['auto'] is {HTTP_PROTOCOLS.get('auto')!r}, not "
                            f"{_AUTO[1]!r}")
        auto = import_from_string(_AUTO[1])
        chosen = next((n for n, (p, _, _) in _PROTOCOLS.items() if n in subclasses and import_from_string(p) is auto),
                      None)
        if chosen is None:
            raise TypeError(f"uvicorn's auto HTTP protocol is {auto!r}, neither h11's nor httptools'")
        subclasses[_AUTO[0]] = subclasses[chosen]
    except Exception as e:  # noqa: BLE001 - never break the proxy over this
        log.warning("dsquant: no request header timeout (uvicorn %s is not as this code expects: %s): slowly "
                    "sent headers hold connections; put a reverse proxy with one in front",
                    version, e)
        return False
    for name, cls in subclasses.items():
        HTTP_PROTOCOLS[name] = cls  # uvicorn's import_from_string returns a class as it is
    _installed.update(subclasses)
    log.info("dsquant: request heads must arrive within %g s (%s) on uvicorn %s (%s)", timeout_s,
             HEADER_TIMEOUT_ENV, version, ", ".join(sorted(subclasses)))
    return True


def proxy_middlewares() -> list:
    """The callback Serve's proxy calls (named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), before it
    starts its uvicorn server: installs the header timeout and returns the guard middleware."""
    from starlette.middleware import Middleware

    install_header_timeout()
    return [Middleware(ProxyGuard, api_key=os.environ.get(KEY_ENV) or None)]
