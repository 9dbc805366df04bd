"""Accuracy of the quantized model against the float one: perplexity of each variant on held-out text
and per-layer error (SQNR) of every quantized linear and attention.

Variants, for each smoothing setting (off, on):
  W8A8 + FA3   the quantized directory as written (integer linears, int8 latent cache)
  W8A8 only    the same directory with the latent left in float
  FA3 only     the float model (smoothed the same way) with only the latent through int8 (its fa_k)
plus the float model itself. Smoothing is function-preserving, so "float" is one row.

SQNR = 10 log10(sum(y^2) / sum((y - y_q)^2)) over the held-out windows, where y_q is computed by the
quantized module on the float model's own input to that module (each module's error in isolation).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
from torch import nn

from pipeline.io import storage
from pipeline.model.loading import load_model
from pipeline.model.perplexity import perplexity
from pipeline.format.reader import fa_scales, read_quantized
from pipeline.quant.fakequant import QuantLinear, install_fa3, load_fakequant_model
from pipeline.quant.recipe import Recipe
from pipeline.quant.run import QuantizeOptions, calibration_samples, prepare_float_model, quantize_checkpoint

SQNR_WINDOWS = 4


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    err = (ref.double() - got.double()).pow(2).sum().item()
    sig = ref.double().pow(2).sum().item()
    return math.inf if err == 0 else 10 * math.log10(sig / err)


@torch.no_grad()
def module_sqnr(float_model, quant_model, windows: torch.Tensor) -> list[dict]:
    """SQNR of each quantized linear and each attention block of ``quant_model`` on the inputs the float
    model gives it. ``windows``: [B, S] token ids."""
    pairs: list[tuple[str, str, nn.Module, nn.Module]] = []
    for name, qmod in quant_model.named_modules():
        if isinstance(qmod, QuantLinear):
            pairs.append((name, qmod.kind, float_model.get_submodule(name), qmod))
    for layer in quant_model.model.layers:
        name = f"model.layers.{layer.layer_id}.self_attn"
        pairs.append((name, "attention", float_model.get_submodule(name), layer.self_attn))
    seen: dict[str, list] = {name: [] for name, *_ in pairs}
    handles = [fmod.register_forward_hook(lambda m, args, out, name=name: seen[name].append((args, out)))
               for name, _, fmod, _ in pairs]
    try:
        for row in windows:
            float_model(row[None])
            if float_model.mtp_layers:
                _, h = float_model(row[None], return_hidden=True)
                float_model.mtp(h[:, :-1], row[None, 1:])
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, kind, _, qmod in pairs:
        if not seen[name]:
            continue
        ref = torch.cat([out.flatten(0, -2) for _, out in seen[name]])
        got = torch.cat([qmod(*args).flatten(0, -2) for args, _ in seen[name]])
        layer = int(name.split(".")[2])
        rows.append({"layer": layer, "module": name, "type": kind, "sqnr_db": round(sqnr_db(ref, got), 3)})
    return rows


def evaluate(src: str, work_dir: str, heldout: torch.Tensor, recipe: Recipe = Recipe(),
             opts: QuantizeOptions = QuantizeOptions(), seq: int = 256, log: Callable[[str], None] = print,
             full_only: bool = False) -> tuple[list[dict], list[dict]]:
    """Quantize ``src`` with and without smoothing into ``work_dir`` and measure every variant on the
    ``heldout`` token stream. Returns (perplexity rows, SQNR rows). ``full_only``: only the float and the
    W8A8 + FA3 rows, no SQNR rows (what the accuracy target reads)."""
    float_model = load_model(src, dtype=torch.float32, device="cpu")
    base = perplexity(float_model, heldout, seq)
    ppl_rows = [{"variant": "float", "smooth": False, **_ppl(base, base)}]
    sqnr_rows: list[dict] = []
    cfg = float_model.config
    samples = None
    for smooth in (False, True):
        r = dataclasses.replace(recipe, smooth=smooth, fa_quant=True)
        dst = storage.join(work_dir, "smooth" if smooth else "plain")
        quantize_checkpoint(src, dst, r, dataclasses.replace(opts, overwrite=True), log=log)
        full = load_fakequant_model(dst, dtype=torch.float32)
        ppl_rows.append({"variant": "W8A8 + FA3", "smooth": smooth, **_ppl(perplexity(full, heldout, seq), base)})
        if full_only:
            continue
        w_only = load_fakequant_model(dst, dtype=torch.float32, fa3=False)
        ppl_rows.append({"variant": "W8A8 only", "smooth": smooth, **_ppl(perplexity(w_only, heldout, seq), base)})
        samples = samples or calibration_samples(src, opts, cfg.max_position_embeddings)
        smoothed, _ = prepare_float_model(src, r, samples, opts)
        smoothed = smoothed.to(torch.float32)
        for row in module_sqnr(smoothed, full, _windows(heldout, seq)):
            sqnr_rows.append({"smooth": smooth, **row})
        install_fa3(smoothed, fa_scales(read_quantized(dst)[2]))
        ppl_rows.append({"variant": "FA3 only", "smooth": smooth, **_ppl(perplexity(smoothed, heldout, seq), base)})
        log(f"smooth={smooth}: " + ", ".join(f"{x['variant']} {x['perplexity']:.3f}" for x in ppl_rows if x["smooth"] == smooth))
    return ppl_rows, sqnr_rows


def _ppl(res: dict, base: dict) -> dict:
    return {"perplexity": round(res["perplexity"], 4), "delta_pct": round(100 * (res["perplexity"] / base["perplexity"] - 1), 3),
            "tokens": res["tokens"]}


def _windows(stream: torch.Tensor, seq: int, n: int = SQNR_WINDOWS) -> torch.Tensor:
    k = min(n, max(1, (len(stream) - 1) // seq))
    return torch.stack([stream[i * seq: i * seq + seq] for i in range(k)])


def ppl_table(rows: Sequence[dict]) -> str:
    """A readable table: variant, smoothing, perplexity, change against float."""
    lines = ["| variant | smoothing | perplexity | vs float |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {'on' if r['smooth'] else 'off'} | {r['perplexity']:.3f} | "
                     f"{r['delta_pct']:+.2f}% |")
    return "\n".join(lines)


def sqnr_summary(rows: Sequence[dict]) -> str:
    """Per type and smoothing: min / median SQNR."""
    out = ["| type | smoothing | modules | min SQNR dB | median SQNR dB |", "|---|---|---|---|---|"]
    keys = sorted({(r["type"], r["smooth"]) for r in rows})
    for kind, smooth in keys:
        v = sorted(r["sqnr_db"] for r in rows if r["type"] == kind and r["smooth"] == smooth)
        out.append(f"| {kind} | {'on' if smooth else 'off'} | {len(v)} | {v[0]:.1f} | {v[len(v) // 2]:.1f} |")
    return "\n".join(out)


def write_parquet(rows: Sequence[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with storage.atomic_write(path) as f:
        pq.write_table(pa.Table.from_pylist(list(rows)), f)
