"""Perplexity on a token stream: how the embedded model is trained and evaluated, and how quantized
variants are compared with the float model."""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch
import torch.nn.functional as F

Sample = Union[str, Sequence[dict]]


def token_stream(tok, samples: Sequence[Sample]) -> torch.Tensor:
    """Every sample concatenated: a text as bos + tokens + eos; a chat (list of messages) as its chat
    template renders it (bos ... <|Assistant|>answer eos), encoded exactly as at inference."""
    ids: list[int] = []
    for s in samples:
        if isinstance(s, str):
            ids.extend(tok.encode(s, add_bos=True))
            ids.append(tok.eos_id)
        else:
            ids.extend(tok.encode_chat(list(s), add_generation_prompt=False))
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq: int = 256, batch: int = 8) -> dict:
    """exp(mean next-token NLL) of the main model over non-overlapping windows of ``seq`` + 1 tokens;
    with an MTP layer also its perplexity and top-1 accuracy for the token after next.

    Returns {"tokens", "perplexity"[, "mtp_perplexity", "mtp_top1"]}."""
    was_training = model.training
    model.eval()
    n = (len(stream) - 1) // seq
    if n == 0:
        raise ValueError(f"the evaluation stream ({len(stream)} tokens) is shorter than one window ({seq + 1})")
    nll = mtp_nll = 0.0
    tokens = mtp_tokens = mtp_hits = 0
    for i in range(0, n, batch):
        b = torch.stack([stream[j * seq: j * seq + seq + 1] for j in range(i, min(n, i + batch))])
        b = b.to(model.lm_head.weight.device)
        logits, h = model(b[:, :-1], return_hidden=True)
        nll += F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
        tokens += b[:, 1:].numel()
        if model.mtp_layers:
            ml, _ = model.mtp(h[:, :-1], b[:, 1:-1])
            mtp_nll += F.cross_entropy(ml.flatten(0, 1), b[:, 2:].flatten(), reduction="sum").item()
            mtp_tokens += b[:, 2:].numel()
            mtp_hits += (ml.argmax(-1) == b[:, 2:]).sum().item()
    model.train(was_training)
    out = {"tokens": tokens, "perplexity": math.exp(nll / tokens)}
    if mtp_tokens:
        out.update(mtp_perplexity=math.exp(mtp_nll / mtp_tokens), mtp_top1=mtp_hits / mtp_tokens)
    return out
