"""Token sampling (what :class:`~pipeline.engine.protocol.SamplingParams` asks): greedy, temperature, top-k,
top-p, with a seeded generator; penalties and ``min_tokens`` (:func:`adjust_logits`); the raw
log-probabilities of the sampled tokens and their most likely alternatives (:func:`token_logprobs`); a
sequence's seeded generator on the logits' device (:func:`generator_on`) and restored from a KV handoff's
state (:func:`restored_generator`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pipeline.engine.protocol import SamplingParams, TokenLogprobs

def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64). Numerically safe for every valid ``p``: non-finite logits
    are clamped, the most likely token always survives the filters, and a row whose probabilities are
    still unusable falls back to greedy."""
    if p.greedy:
        return logits.argmax(-1)
    x = torch.nan_to_num(logits.float(), nan=float("-inf"))
    x = (x / p.temperature).clamp(min=torch.finfo(torch.float32).min)  # -inf stays finite-but-tiny
    if p.top_k:
        kth = x.topk(min(p.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p; the first token always stays (a
        # top_p below float32's range compares as 0, which would otherwise drop every token)
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[:, 0] = False
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    usable = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    if not bool(usable.all()):
        probs = torch.where(usable[:, None], probs, torch.nn.functional.one_hot(
            logits.argmax(-1), probs.shape[-1]).to(probs.dtype))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Row i of ``logits`` [R, V] (the raw logits of the position that produced ``token_ids[i]``): its
    token's logprob and its ``ks[i]`` most likely tokens, ``log_softmax`` in float32. One batched
    log_softmax and topk for all the rows, one copy to the host."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    k = min(max(ks, default=0), lp.shape[-1])
    if k:
        values, indices = lp.topk(k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
    out = []
    for i, (t, x, ki) in enumerate(zip(token_ids, chosen, ks)):
        top = tuple(zip(indices[i][:ki], values[i][:ki])) if k and ki else ()
        out.append(TokenLogprobs(int(t), x, top))
    return out


def piece_logprobs(logits: torch.Tensor, asking: list[tuple[Any, int]],
                   sampled: dict[int, list[int]]) -> dict[int, tuple[Any, list[TokenLogprobs]]]:
    """The engine's step (LLMEngine.sampled): the logprobs of the tokens sampled for the sequences that
    ask, ``asking`` (sequence, its first row of ``logits``), ``sampled`` (seq_id -> its tokens; an MTP
    piece's second token is read at the next row), in one batch; seq_id -> (sequence, its TokenLogprobs)."""
    rows, tokens, ks, owners = [], [], [], []
    for seq, r in asking:
        for j, t in enumerate(sampled[seq.seq_id]):
            rows.append(r + j)
            tokens.append(t)
            ks.append(seq.params.logprobs)
            owners.append(seq)
    out: dict[int, tuple[Any, list[TokenLogprobs]]] = {}
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    for seq, lp in zip(owners, token_logprobs(logits.index_select(0, idx), tokens, ks)):
        out.setdefault(seq.seq_id, (seq, []))[1].append(lp)
    return out


def generator_on(seq, device: torch.device) -> Optional[torch.Generator]:
    """The sequence's generator on ``device`` (the logits'): the scheduler seeds one on the CPU, which is
    never drawn from when the logits are elsewhere, so it is replaced by one seeded alike on ``device``
    (a generator moved between devices of one kind keeps its state)."""
    gen = seq.generator
    if gen is None or (gen.device.type == device.type and (gen.device.index or 0) == (device.index or 0)):
        return gen
    moved = torch.Generator(device=device)
    if gen.device.type == device.type:
        moved.set_state(gen.get_state())
    else:
        moved.manual_seed(seq.params.seed)
    seq.generator = moved
    return moved


def restored_generator(state: torch.Tensor, state_device: Optional[str], device: str) -> torch.Generator:
    """A generator on ``device`` continuing ``state`` (a KVHandoff's, of a generator on ``state_device``)."""
    kind = torch.device(state_device or "cpu").type
    if kind != torch.device(device).type:
        raise ValueError(f"KV handoff: the seeded generator's state is for a {kind} generator but this engine "
                         f"samples on {device}")
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


def plain_greedy(seq) -> bool:
    """Whether ``seq``'s next tokens are the raw logits' argmax: greedy, no penalty, and no eos to block
    (``min_tokens`` reached; it stays reached as the output grows)."""
    p = seq.params
    return p.greedy and not p.penalized and not p.biased and (seq.eos_id is None or len(seq.output) >= p.min_tokens)


def adjust_logits(logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                  eos_id: int | None) -> torch.Tensor:
    """The logits [1, V] of a sequence's next token after its penalties, its ``logit_bias`` and
    ``min_tokens`` (see SamplingParams); the same tensor when none applies."""
    block_eos = eos_id is not None and len(output) < p.min_tokens
    if not (p.penalized or block_eos or p.logit_bias):
        return logits
    x = logits.float().clone()
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=x.device)
        v = x[0, seen]
        x[0, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(list(output), dtype=torch.long, device=x.device).unique(return_counts=True)
        x[0, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    if p.logit_bias:
        ids = [t for t, _ in p.logit_bias if t < x.shape[-1]]
        if ids:
            x[0, ids] += torch.tensor([b for t, b in p.logit_bias if t < x.shape[-1]], device=x.device)
    if block_eos:
        x[0, eos_id] = float("-inf")
    return x
