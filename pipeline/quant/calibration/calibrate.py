"""Calibration: run the float model on each sample (batch of one) and observe the activations.

    W8A8 linear p:      Stats[p]            = MinMax of p's input over all tokens (forward pre-hook)
    FA3 attention a:    Stats[a + ".fa_q"]  = RecallWindow(q_ratio) of q_abs = q_nope @ W_UK, one row per
                                              head: q_abs [1, S, H, C] -> [H, S * C]
                        Stats[a + ".fa_k"]  = RecallWindow(k_ratio) of the latent c = kv_a_layernorm(c) [1, S*C]
                        Stats[a + ".fa_v"]  = RecallWindow(v_ratio) of the same latent

The activations are the float model's (one pass, all layers at once): what lets pipeline stages
calibrate in parallel (docs/format.md). Run the model in the model dtype for msModelSlim parity. The MTP
layer, when ``recipe.quantize_mtp``, sees ``model.mtp(hidden[:, :-1], ids[:, 1:])`` with ``hidden`` the
main model's final normed hidden state. Statistics of separate runs (layer ranges, sample shards)
merge exactly with ``Stats.merge``.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from pipeline import layout
from pipeline.model import DeepseekV3ForCausalLM
from pipeline.quant.numerics.observers import MinMax, RecallWindow, Stat, Stats
from pipeline.quant.numerics.products import KeptWeights, calibration_products
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import FAQUANT, W8A8, Recipe


class _Collector:
    """Mutable accumulation of one run's statistics (merged in the order samples arrive). ``lengths``:
    the real lengths of the rows of a right-padded batch being run (None: no padding)."""

    def __init__(self) -> None:
        self.entries: dict[str, Stat] = {}
        self.lengths: Optional[list[int]] = None

    def real(self, b: int, s: int) -> int:
        """Row ``b``'s real tokens of ``s`` positions."""
        return s if self.lengths is None else self.lengths[b]

    def mask(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """[B, S] bool, True on real tokens, for activations x [B, S, ...] (None: all real)."""
        if self.lengths is None:
            return None
        n = torch.tensor(self.lengths, device=x.device)
        return torch.arange(x.shape[1], device=x.device)[None, :] < n[:, None]

    def add(self, name: str, stat: Stat) -> None:
        self.entries[name] = self.entries[name].merge(stat) if name in self.entries else stat  # type: ignore

    def stats(self) -> Stats:
        return Stats(dict(sorted(self.entries.items())))


def _linear_hook(col: _Collector, name: str):
    def hook(module: nn.Module, args: tuple) -> None:
        col.add(name, MinMax.observe(args[0], col.mask(args[0]), name=name))
    return hook


@contextmanager
def _observe_attention(col: _Collector, attn: nn.Module, prefix: str, recipe: Recipe) -> Iterator[None]:
    """Wrap the MLA's ``query`` and ``latent`` (instance attributes, removed on exit) to observe the
    absorbed query per head and the latent."""
    query, latent = attn.query, attn.latent

    def observed_query(x, cos, sin):
        q_nope, q_pe = query(x, cos, sin)
        w_uk, _ = attn.absorbed_weights()
        q_abs = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)                      # [B, S, H, C]
        for b in range(q_abs.shape[0]):
            rows = q_abs[b, : col.real(b, q_abs.shape[1])].transpose(0, 1).reshape(q_abs.shape[2], -1)  # [H, S * C]
            col.add(prefix + "fa_q", RecallWindow.observe(rows, recipe.q_ratio, prefix + "fa_q"))
        return q_nope, q_pe

    def observed_latent(x, cos, sin):
        c, k_pe = latent(x, cos, sin)
        for b in range(c.shape[0]):
            row = c[b, : col.real(b, c.shape[1])].reshape(1, -1)                 # [1, S * C]
            col.add(prefix + "fa_k", RecallWindow.observe(row, recipe.k_ratio, prefix + "fa_k"))
            col.add(prefix + "fa_v", RecallWindow.observe(row, recipe.v_ratio, prefix + "fa_v"))
        return c, k_pe

    attn.query, attn.latent = observed_query, observed_latent
    try:
        yield
    finally:
        del attn.query, attn.latent


def check_samples(samples: Sequence[Sequence[int]], vocab: int) -> None:
    if not samples:
        raise QuantError("samples: no calibration samples")
    for i, s in enumerate(samples):
        if len(s) == 0:
            raise QuantError(f"samples[{i}]: empty sample")
        bad = [t for t in s if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise QuantError(f"samples[{i}]: token ids {bad[:5]} are not ints in [0, {vocab})")


def stats_layers(cfg, recipe: Recipe, layers: Optional[Iterable[int]] = None, have_mtp: bool = True) -> list[int]:
    """The layers whose statistics are collected: ``layers`` (default: ``recipe.calibrated_layers``, all main
    layers, plus the MTP layer(s) when the recipe quantizes them), checked against the model."""
    layer_ids = sorted(set(recipe.calibrated_layers(cfg) if layers is None else layers))
    for i in layer_ids:
        if i not in layout.all_layer_ids(cfg):
            raise QuantError(f"layers: {i} is not a layer of the model ({layout.all_layer_ids(cfg)})")
        if i >= cfg.num_hidden_layers and not have_mtp:
            raise QuantError(f"layers: MTP layer {i} requested but the model was built without it")
    return layer_ids


@contextmanager
def observing(model: DeepseekV3ForCausalLM, recipe: Recipe, layer_ids: Sequence[int],
              kept: Optional[KeptWeights] = None) -> Iterator[_Collector]:
    """While active, every forward through ``layer_ids`` adds its observations to the yielded collector
    (``.stats()`` gives them), and this thread's reduced-precision products follow
    ``recipe.calib_products`` (pipeline.quant.numerics.products; upcast weights kept in ``kept``, default: for this
    activation). The model may hold only some layers (a pipeline stage): only ``layer_ids`` are touched."""
    modules = dict(model.named_modules())
    col = _Collector()
    with ExitStack() as stack:
        stack.enter_context(calibration_products(recipe.calib_products, kept))
        for i in layer_ids:
            for prefix, kind in recipe.layer_types(model.config, i).items():
                if kind == W8A8:
                    stack.callback(modules[prefix].register_forward_pre_hook(_linear_hook(col, prefix)).remove)
                elif kind == FAQUANT and prefix.endswith(".fa_q"):
                    attn = prefix[: -len(".fa_q")]
                    stack.enter_context(_observe_attention(col, modules[attn], attn + ".", recipe))
        yield col


def run_mtp(model: DeepseekV3ForCausalLM, hidden: torch.Tensor, ids: torch.Tensor, depths: int) -> None:
    """The MTP layers as calibration runs them: depth d predicts token t+d+2 from the previous depth's
    hidden at t and token t+d+1 (``hidden``: the main model's final normed hidden state)."""
    for depth in range(depths):
        if ids.shape[1] <= depth + 1:
            break
        _, hidden = model.mtp(hidden[:, :-1], ids[:, depth + 1:], depth=depth)


def run_layer_batched(model: DeepseekV3ForCausalLM, layer_id: int, hs: Sequence[torch.Tensor], batch: int = 1,
                      col: Optional[_Collector] = None) -> list[torch.Tensor]:
    """Every sample's hidden state [1, S_j, h] through main layer ``layer_id``, ``batch`` samples per
    forward: consecutive samples right-padded with zeros into [B, S_max, h] (causal attention: a real
    token attends only to earlier positions, all real, so padding never reaches it), the collector
    ``col`` told the real lengths so that every observation skips the padding (MinMax over real tokens;
    each FA3 window on its sample's real rows, in sample order). Returns each sample's output [1, S_j, h].

    ``batch`` 1 is the reference (what collect_stats runs). Larger batches compute the same function, but
    a GEMM over more rows may round differently on some backends: see QuantizeOptions.calib_batch for how
    far the statistics were measured to move."""
    if batch < 1:
        raise QuantError(f"calib_batch: must be >= 1, got {batch}")
    if batch == 1:
        return [model.run_layers(x, [layer_id]) for x in hs]
    out: list[torch.Tensor] = []
    for k in range(0, len(hs), batch):
        group = hs[k:k + batch]
        lengths = [x.shape[1] for x in group]
        padded = torch.zeros(len(group), max(lengths), group[0].shape[-1], dtype=group[0].dtype, device=group[0].device)
        for b, x in enumerate(group):
            padded[b, : lengths[b]] = x[0]
        if col is not None:
            col.lengths = lengths
        try:
            y = model.run_layers(padded, [layer_id])
        finally:
            if col is not None:
                col.lengths = None
        out += [y[b: b + 1, : n] for b, n in enumerate(lengths)]
    return out


@torch.no_grad()
def collect_stats(model: DeepseekV3ForCausalLM, samples: Sequence[Sequence[int]], recipe: Recipe,
                  layers: Optional[Iterable[int]] = None, progress: bool = False) -> Stats:
    """Statistics of every W8A8-static linear input and FA3 attention of ``layers`` (default: all main
    layers, plus the MTP layer(s) when ``recipe.quantize_mtp``), each sample run alone. ``progress``
    shows a progress bar over the samples' tokens (tokens/s)."""
    cfg = model.config
    recipe.check_config(cfg)
    layer_ids = stats_layers(cfg, recipe, layers, have_mtp=len(model.mtp_layers) > 0)
    check_samples(samples, cfg.vocab_size)
    run_mtp_layers = any(i >= cfg.num_hidden_layers for i in layer_ids)
    device = model.lm_head.weight.device
    with observing(model, recipe, layer_ids) as col:
        for s in _maybe_progress(samples, progress):
            ids = torch.tensor([list(s)], dtype=torch.long, device=device)
            hidden = model.final_hidden(ids)   # no logits: calibration never reads them
            run_mtp(model, hidden, ids, len(model.mtp_layers) if run_mtp_layers else 0)
    return col.stats()


def _maybe_progress(samples: Sequence[Sequence[int]], enabled: bool):
    from pipeline.quant.calibration.progress import over_samples

    return over_samples(samples, enabled) if enabled else samples
