"""The API key: what a usable key is, and the one way a request's ``Authorization`` header is compared with
it (Serve's proxy guard and the ingress both call :func:`authorized`).

A key is 1 to 4096 visible ASCII characters (``!`` to ``~``): no space, tab or non-ASCII character. HTTP
carries header values as bytes and clients encode non-ASCII text differently (UTF-8, Latin-1, refused), so
a server started with such a key would answer 401 to everyone; it is refused when the server starts, naming
where the key came from. ``DSQUANT_API_KEY`` set but empty is refused like ``--api-key ""``: unset it to
serve without a key. Standard library only: Serve's proxy imports it.
"""

from __future__ import annotations

import hmac
import os
import re
from typing import Optional, Union

KEY_ENV = "DSQUANT_API_KEY"
MAX_KEY_CHARS = 4096
_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")


def check_key(key: object, where: str) -> str:
    """``key`` when it is usable, else ValueError naming ``where`` (the flag, file or variable)."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{where} is empty" if isinstance(key, str) else f"{where} must be a string, got {key!r}")
    if not _KEY.fullmatch(key):
        raise ValueError(f"{where}: an API key must be 1-{MAX_KEY_CHARS} visible ASCII characters (no space, tab or "
                         "non-ASCII character: HTTP clients would send it in other bytes)")
    return key


def env_key(environ=os.environ) -> Optional[str]:
    """``DSQUANT_API_KEY``: None when unset; ValueError when set but empty or unusable."""
    raw = environ.get(KEY_ENV)
    if raw is None:
        return None
    return check_key(raw, f"{KEY_ENV} (set; unset it to serve without a key)" if not raw.strip() else KEY_ENV)


def authorized(header: Union[bytes, str, None], key: str) -> bool:
    """Whether an ``Authorization`` header value (bytes as received, or Starlette's Latin-1 str of them)
    is ``Bearer <key>``: scheme case-insensitive, spaces and tabs around the token ignored, the token
    compared in constant time."""
    if header is None:
        return False
    try:
        raw = header.encode("latin-1") if isinstance(header, str) else bytes(header)
    except UnicodeEncodeError:
        return False
    scheme, _, token = raw.strip(b" \t").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" \t"), key.encode("ascii", "replace"))
