"""Massive activations planted in the residual stream of a trained model (scripts/train_embedded.py --init
... --plant-channels K): what trained LLMs carry and what rotation recipes must cope with.

Plant: K hidden channels j (drawn from the seed) get, on the T most frequent tokens of the training text
(delimiters and spaces, as the tokens that carry massive activations in trained LLMs), an offset
s_j * M_j in the token embedding (the residual stream's start; s_j a random sign, M_j = 2^e_j times the
median RMS of the residual stream over the layers' norm inputs, e_j drawn uniformly from the factor
range), so every layer's residual input carries them at those positions, where they dominate the RMS: each
norm's output there is nearly all planted channel (up to sqrt(hidden) times a typical entry), which sets
the static activation ranges of every linear the norm feeds. Those linears' input columns j are divided by
2^e_j so their products stay of the size they had (the final norm, which feeds the float head, has its
weight divided there instead). Unlike the variants of
pipeline/quant/evaluation/outlier_variant.py (a norm weight and the linears it feeds rescaled, which a
rotation recipe folds away exactly), these outliers live in the residual stream itself: folding the norm
into the linears leaves them, and only a rotation or a smoothing of the activations spreads them.

The function changes (the linears see a large constant input); a short fine-tune with the training loop,
the planted embedding channels frozen, brings held-out perplexity back (train_embedded.py stops once it is
within --recover-pct of the source's).
"""

from __future__ import annotations

import math

import torch

RESIDUAL_NORMS = ("input_layernorm", "post_attention_layernorm")


def residual_norms(model) -> dict:
    """name -> (RMSNorm, its kind in pipeline.quant.evaluation.outlier_variant.NORMS, layer id) for every norm
    that reads the residual stream (the MTP layer's enorm and hnorm; its own residual starts at eh_proj)."""
    out = {}
    for layer in model.model.layers:
        for kind, n in (("input", "input_layernorm"), ("post_attention", "post_attention_layernorm")):
            out[f"model.layers.{layer.layer_id}.{n}"] = (getattr(layer, n), kind, layer.layer_id)
    out["model.norm"] = (model.model.norm, None, None)
    for layer in model.mtp_layers:
        for kind, n in (("mtp_enorm", "enorm"), ("mtp_hnorm", "hnorm")):
            out[f"model.layers.{layer.layer_id}.{n}"] = (getattr(layer, n), kind, layer.layer_id)
    return out


@torch.no_grad()
def norm_input_rms(model, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per residual-reading norm, the RMS of its input per token over ``batch`` (the main forward and the
    MTP layer's)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(
        n, a[0].float().pow(2).mean(-1).sqrt().flatten())) for n, (m, _, _) in residual_norms(model).items()]
    try:
        x = batch[:, :-1]
        _, h = model(x, return_hidden=True)
        if model.mtp_layers:
            model.mtp(h[:, :-1], batch[:, 1:-1])
    finally:
        for h_ in hooks:
            h_.remove()
    return seen


@torch.no_grad()
def plant(model, batch: torch.Tensor, channels: int, log2_range: tuple[int, int], seed: int,
          tokens: int) -> dict:
    """Plant (module doc) in ``model`` in place, on the ``tokens`` most frequent token ids of ``batch``;
    returns what was planted."""
    from pipeline.quant.evaluation.outlier_variant import readers

    h = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    chans = torch.randperm(h, generator=g)[:channels].sort().values
    lo, hi = log2_range
    exps = torch.randint(lo, hi + 1, (channels,), generator=g)
    signs = torch.where(torch.rand(channels, generator=g) < 0.5, -1.0, 1.0)
    ids = torch.bincount(batch.flatten(), minlength=model.config.vocab_size).argsort(descending=True)[:tokens]
    base = torch.cat(list(norm_input_rms(model, batch).values())).median().item()
    mags = signs * base * 2.0 ** exps.float()
    shrink = 2.0 ** -exps.float()
    for norm, kind, layer_id in residual_norms(model).values():
        if kind is None:              # the final norm feeds the float head: its planted channels go quiet
            norm.weight[chans] *= shrink.to(norm.weight.dtype)
            continue
        for wname, first in readers(model.config, layer_id, kind):
            w = model.get_parameter(wname)
            w[:, first + chans] *= shrink.to(w.dtype)
    emb = model.model.embed_tokens.weight
    rows = emb[ids]
    rows[:, chans] += mags.to(emb.dtype)
    emb[ids] = rows
    for layer in model.mtp_layers:                       # the MTP layer's copy (tied while training)
        if layer.embed_tokens.weight.data_ptr() != emb.data_ptr():
            layer.embed_tokens.weight[ids] = rows
    return {"channels": chans.tolist(), "log2": exps.tolist(), "offsets": [round(m, 4) for m in mags.tolist()],
            "token_ids": ids.tolist(), "median_residual_rms": round(base, 4)}


def freeze_channels(model, chans, ids) -> None:
    """Zero the gradient of the planted embedding entries, so training keeps them."""
    rows, cols = torch.tensor(ids)[:, None], torch.tensor(chans)[None, :]

    def hook(grad):
        grad = grad.clone()
        grad[rows, cols] = 0
        return grad
    model.model.embed_tokens.weight.register_hook(hook)


@torch.no_grad()
def outlier_ratio(model, batch: torch.Tensor, chans) -> float:
    """How massive the planted channels are: the median over residual-reading norm inputs of the largest
    (over tokens) max |h_planted| / median |h| of a token."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: seen.append(a[0].float().flatten(0, -2)))
             for m, _, _ in residual_norms(model).values()]
    try:
        model(batch[:, :-1])
    finally:
        for h_ in hooks:
            h_.remove()
    ratios = [(x[:, chans].abs().amax(-1) / x.abs().median(-1).values.clamp_min(1e-12)).amax().item() for x in seen]
    return float(torch.tensor(ratios).median()) if ratios else math.nan
