"""The largest non-streamed answer a server's proxy passes, and how large an answer can get.

Behind Serve's own HTTP proxy talking gRPC to the replicas (``RAY_SERVE_PROXY_USE_GRPC``, part of the
throughput settings of jobs/_serve_env.py), a whole non-streamed response body travels in one gRPC
message, which the proxy refuses above ``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH`` bytes (gRPC's 4 MiB
by default): the client would get a plain 500 after the whole generation ran. ``jobs.serve`` raises that
limit for a Ray it starts (so such answers are delivered); where the limit stands (a joined cluster's
settings), the ingress refuses up front, with a 400 that says so, a non-streamed request whose answer
could exceed it (:func:`answer_bound`, an upper bound from the request alone). Streamed answers travel a
chunk at a time and HAProxy's direct ingress has no such limit.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

GRPC_ENV = "RAY_SERVE_PROXY_USE_GRPC"
LIMIT_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
GRPC_DEFAULT_LIMIT = 4 * 1024 * 1024        # gRPC's default, which Serve keeps
PER_CHOICE = 1024       # bytes of a choice besides its tokens (index, finish reason, role, the JSON around)
PER_ENTRY = 96          # bytes of one logprobs entry besides its token's string and bytes (keys, a logprob)


def _on(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def proxy_limit(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The most bytes a non-streamed answer can have behind this server's proxy (read in a replica, whose
    environment is its cluster's); None when no such limit applies."""
    if not _on(environ.get(GRPC_ENV)) or _on(environ.get(HAPROXY_ENV)):
        return None
    try:
        return int(environ.get(LIMIT_ENV, GRPC_DEFAULT_LIMIT))
    except ValueError:
        return GRPC_DEFAULT_LIMIT


def longest_token(tokenizer) -> int:
    """Bytes of the longest token in the vocabulary (each vocabulary character is at most one byte of a
    byte-level BPE token; a special token's text counts as it is)."""
    tk = getattr(tokenizer, "_tk", None)
    vocab = tk.get_vocab(with_added_tokens=True) if tk is not None else {}
    return max((len(t.encode("utf-8")) for t in vocab), default=64)


def answer_bound(n: int, max_tokens: int, logprobs: Optional[int], token_bytes: int, echo_bytes: int = 0) -> int:
    """An upper bound, in bytes, of a non-streamed answer of ``n`` choices of ``max_tokens`` tokens each
    (``logprobs``: alternatives per token, None for none), tokens of at most ``token_bytes`` bytes (a
    string escaped in JSON takes at most 6 bytes per byte), ``echo_bytes`` of echoed prompt per choice."""
    text = 6 * token_bytes
    per_token = text
    if logprobs is not None:    # the token and each alternative: string, bytes (up to 4 per byte), keys
        per_token += (1 + logprobs) * (text + 4 * token_bytes + PER_ENTRY)
    return PER_CHOICE + n * (PER_CHOICE + 6 * echo_bytes + max_tokens * per_token)
