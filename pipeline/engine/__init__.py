"""Serving engine building blocks: KV cache layout (NZ) and paged-cache bookkeeping."""
