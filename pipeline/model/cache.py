"""A contiguous MLA cache for the float model: per layer, the normed latent and the rotated k_pe.

Per token and layer the absorbed form needs only ``c = kv_a_layernorm(c_kv)`` [kv_lora_rank] and
``k_pe = rope(k_pe)`` [qk_rope_head_dim] (no head dimension). This is the float reference cache used for
generation on the float model; the engine's paged int8 cache builds on the same contents.
"""

from __future__ import annotations

import torch


class LatentCache:
    """One layer's cache for a batch of B sequences that share a length (filled left to right)."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, dtype, device=None):
        self.c = torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.pe = torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.c.shape[1]

    def append(self, c: torch.Tensor, pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store c [B, S, kv_lora_rank] and pe [B, S, rope]; return the whole cache so far and the
        position of the first new token."""
        start, S = self.length, c.shape[1]
        if start + S > self.max_len:
            raise ValueError(f"KV cache full: {start} + {S} tokens exceed its capacity of {self.max_len}")
        self.c[:, start:start + S] = c
        self.pe[:, start:start + S] = pe
        self.length = start + S
        return self.c[:, :self.length], self.pe[:, :self.length], start


class ModelCache:
    """A LatentCache per decoder layer, MTP layers included (keyed by layer id)."""

    def __init__(self, cfg, batch: int, max_len: int, dtype, device=None, layer_ids=None):
        ids = layer_ids if layer_ids is not None else list(range(cfg.num_hidden_layers)) + cfg.mtp_layer_ids
        self.layers = {
            i: LatentCache(batch, max_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, device) for i in ids
        }

    def __getitem__(self, layer_id: int) -> LatentCache:
        return self.layers[layer_id]

    def bytes_per_token(self) -> int:
        return sum((lc.c[0, 0].numel() * lc.c.element_size() + lc.pe[0, 0].numel() * lc.pe.element_size())
                   for lc in self.layers.values())
