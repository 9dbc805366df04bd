"""A guard in front of Ray Serve's HTTP proxy, for what happens there before any request reaches the
ingress: Serve echoes ``X-Request-ID`` verbatim (any size) and answers a non-UTF-8 one with a 500, and it
answers ``/-/routes`` to anyone.

:class:`ProxyGuard` (an ASGI middleware, outermost in the proxy) replaces an ``X-Request-ID`` that is not
1-128 characters of ``[A-Za-z0-9._:-]`` with a fresh id, drops any other header whose value is not
UTF-8 (Serve decodes some of them), and with an API key answers ``/-/routes`` only with
``Authorization: Bearer <key>`` (``/-/healthz`` stays open, like ``/health``).

Serve 2.60 takes proxy middlewares only from a callback named by an environment variable that must be set
in the proxies' environment, i.e. before Ray starts (``jobs.serve`` does this for a Ray it starts; for an
existing cluster set it where the cluster is started)::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=actors.serve_proxy:proxy_middlewares
    DSQUANT_API_KEY=sk-...        # the key /-/routes then needs (optional)
"""

from __future__ import annotations

import hmac
import json
import os
import re
import uuid
from typing import Optional

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "actors.serve_proxy:proxy_middlewares"
KEY_ENV = "DSQUANT_API_KEY"
REQUEST_ID = b"x-request-id"
_VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
KEYED_PATHS = ("/-/routes",)


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


class ProxyGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app, api_key: Optional[str] = None):
        self.app, self.api_key = app, api_key

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = dict((k.lower(), v) for k, v in headers).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = {**scope, "headers": clean_headers(list(scope.get("headers", [])))}
        if self.api_key and scope["type"] == "http" and scope.get("path", "").endswith(KEYED_PATHS) \
                and not self._authorized(scope["headers"]):
            body = json.dumps({"error": {"message": "no valid API key was provided: send 'Authorization: Bearer "
                                                    "<key>'", "type": "invalid_request_error", "param": None,
                                         "code": "invalid_api_key"}}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def proxy_middlewares() -> list:
    """The callback Serve's proxy calls (named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyGuard, api_key=os.environ.get(KEY_ENV) or None)]
