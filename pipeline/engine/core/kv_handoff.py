"""Prefill/decode disaggregation at the engine: a prefill engine runs a prompt, samples its first token and
hands off the prompt's cache blocks in their stored form (:class:`KVHandoff`); a decode engine copies them
into its own cache and decodes from the next step (``LLMEngine.prefill`` / ``LLMEngine.add_prefilled``
call these functions). Both engines must share a cache layout (:func:`cache_layout`, checked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from pipeline.engine.core.sampling import restored_generator
from pipeline.engine.core.scheduler import FINISHED
from pipeline.engine.protocol import ERROR, EngineRequest, TokenLogprobs


@dataclass
class KVHandoff:
    """A prefilled prompt, as a prefill engine hands it to a decode engine: the prompt, the first token
    sampled from it, and the cache blocks holding the prompt's KV in their stored form (int8 latent with
    fa_k on FA3 layers, NZ when the cache is NZ), per layer (the MTP layer's too when drafting), plus the
    MTP draft for the next token. ``layout`` must match the receiving engine's (checked).
    ``first_logprobs``: the first token's logprobs when the request asks for them, ``first_text``: the
    text it settles when the engine detokenizes the request (stop strings), both for the request's first
    EngineOutput. ``generator_state``: a seeded request's generator after sampling the first token
    (``torch.Generator.get_state()``, of a generator on ``generator_device``): the decode engine continues
    it, so a seeded sampled request draws the same tokens as in one engine."""

    prompt: list[int]
    first_token: Optional[int]              # None: the request ended at its first token (finish_reason)
    finish_reason: Optional[str]
    num_cached: int
    blocks: dict[int, tuple[torch.Tensor, torch.Tensor]]
    draft: Optional[int]
    layout: dict
    first_logprobs: Optional[tuple[TokenLogprobs, ...]] = None
    generator_state: Optional[torch.Tensor] = None
    generator_device: Optional[str] = None
    first_text: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() + pe.numel() * pe.element_size() for c, pe in self.blocks.values())



def cache_layout(engine) -> dict:
    """What a KV handoff between two engines must agree on (fixed once the engine is built)."""
    caches = engine.runner.caches
    return {"model": engine.loaded.config.to_dict(),
            "block_size": engine.config.block_size, "nz": engine.config.nz, "mtp": engine.config.mtp,
            "layers": {i: {"latent": str(c.latent_dtype), "k_pe": str(c.dtype),
                           "fa_k": None if c.scale is None else float(c.scale)} for i, c in caches.items()}}


def prefill(engine, request: EngineRequest, step=None, read=None) -> KVHandoff:
    """Run the request's prompt through ``engine`` (an LLMEngine) (with whatever else is in flight), sample
    its first token, and hand off its cache blocks; the sequence's blocks are freed here once copied out,
    with the first token's logprobs and text (when asked) and a seeded generator's state. ``step`` /
    ``read``: how to step and read blocks (default this engine's; a DP-attention group steps all groups,
    dp_engine)."""
    step, read = step or engine.step, read or engine.runner.read_blocks
    params = request.params
    once = replace(request, params=replace(params, max_new_tokens=1, min_tokens=min(params.min_tokens, 1)))
    engine.add(once)
    seq = engine._requests[request.request_id]
    seq.hold = True
    first_out = None
    try:
        while seq.status != FINISHED:
            for out in step():
                if out.request_id == request.request_id:
                    first_out = out
        if seq.finish_reason == ERROR:
            raise RuntimeError(f"prefill failed: {first_out.error if first_out else 'the request failed'}")
        engine.scheduler.register_final(seq)   # the prompt's blocks stay reusable here once freed
        first = seq.output[0] if seq.output else None
        n = len(seq.prompt)
        blocks = seq.table.blocks[: -(-n // engine.config.block_size)]
        data = read(blocks)
        reason = "stop" if first is None else ("length" if params.max_new_tokens <= 1 else None)
        first_lp = first_out.logprobs if first is not None and params.logprobs is not None else None
        text = None if first_out is None else first_out.text
        det = engine._detok.get(seq.seq_id)
        if det is not None and reason is not None:      # it ends here: the held-back text too
            text = (text or "") + det.finish()
        gen = seq.generator
        return KVHandoff(list(seq.prompt), first, reason, n, data, seq.draft, engine.kv_layout(), first_lp,
                         None if gen is None else gen.get_state(), None if gen is None else str(gen.device), text)
    finally:  # done or failed: this prompt leaves nothing behind in the engine
        seq.hold = False
        engine.scheduler.abort(seq)
        seq.table.release(engine.allocator)
        engine._forget(seq)


def add_prefilled(engine, request: EngineRequest, kv: KVHandoff, write=None) -> None:
    """Continue in ``engine`` a request another engine prefilled: its blocks are copied into this engine's
    cache and the sequence decodes from the next step. Raises ValueError when the layouts differ and OutOfBlocks
    when the cache cannot take the blocks now (or when a seeded generator's state is for another kind of
    device than this engine samples on). ``write``: how blocks are stored (default the runner's). A
    seeded request's generator continues from the prefill's state (on this engine's device); a request
    with stop strings goes on detokenizing after the first token's text (which the prefill gave)."""
    mine = engine.kv_layout()
    if kv.layout != mine:
        diff = sorted(k for k in set(kv.layout) | set(mine) if kv.layout.get(k) != mine.get(k))
        raise ValueError(f"KV handoff: the prefill engine's cache layout differs in {diff}")
    if kv.first_token is None:
        raise ValueError(f"KV handoff: the request already finished at prefill ({kv.finish_reason})")
    params = request.params
    generator = None
    if params.seed is not None and kv.generator_state is not None:  # go on drawing where prefill stopped
        generator = restored_generator(kv.generator_state, kv.generator_device, engine.config.device)
    rid = engine._new_id(request)
    seq = engine.scheduler.add_running(kv.prompt + [kv.first_token], len(kv.prompt), kv.num_cached, params,
                                       engine.eos_id, rid)
    (write or engine.runner.write_blocks)(list(seq.table.blocks), kv.blocks)
    seq.draft = kv.draft if params.greedy and params.grammar is None else None
    if generator is not None:
        seq.generator = generator
    engine._admit(request, seq)
    det = engine._detok.get(seq.seq_id)
    if det is not None:
        det.add([kv.first_token])           # the same text the prefill engine settled (and sent) for it
