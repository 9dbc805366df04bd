"""Generation on the float model with the absorbed-form latent cache (one sequence at a time)."""

from __future__ import annotations

import torch

from pipeline.model import DeepseekV3ForCausalLM, ModelCache
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.core.sampling import adjust_logits, sample
from pipeline.engine.core.detokenizer import cut_at_stop


@torch.inference_mode()
def generate_ids(model: DeepseekV3ForCausalLM, prompt_ids: list[int], params: SamplingParams,
                 eos_id: int | None = None, absorb: bool = True) -> list[int]:
    """Prefill the prompt, then decode one token per step from the cache; returns the new token ids
    (the eos token, when produced, ends them and is not included, unless ``params.ignore_eos``)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    cfg = model.config
    total = len(prompt_ids) + params.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    device = model.lm_head.weight.device
    cache = ModelCache(cfg, 1, total, model.lm_head.weight.dtype, device, layer_ids=range(cfg.num_hidden_layers))
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    ids = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(params.max_new_tokens):
        logits = adjust_logits(model(ids, cache, absorb=absorb)[:, -1], params, prompt_ids, out, eos_id)
        nxt = int(sample(logits, params, gen)[0])
        if nxt == eos_id and not params.ignore_eos:
            break
        out.append(nxt)
        ids = torch.tensor([[nxt]], device=device)
    return out


def generate_text(model: DeepseekV3ForCausalLM, tokenizer, prompt: str, params: SamplingParams,
                  chat: bool = True) -> str:
    """Encode (with the chat template when ``chat``), generate, decode, and cut at the first stop string."""
    if chat:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        ids = tokenizer.encode(prompt)
    return cut_at_stop(tokenizer.decode(generate_ids(model, ids, params, eos_id=tokenizer.eos_id)), params.stop)[0]
