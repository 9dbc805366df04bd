"""JSON from untrusted files: every way a file can fail to parse (not UTF-8, not JSON, nested deeper than
the parser can follow) is one error of the caller's type naming the file, never a traceback."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional


def parse_json(data: bytes | str, source: str, error: type[Exception] = ValueError,
               object_pairs_hook: Optional[Callable] = None) -> Any:
    """``json.loads(data)``; raises ``error("<source>: ...")`` for bytes that are not UTF-8, text that is
    not JSON, and nesting too deep to parse."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as e:
        raise error(f"{source}: not valid JSON (not UTF-8 text: byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as e:
        raise error(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{source}: not valid JSON (nested too deeply to parse)") from None
