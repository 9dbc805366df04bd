"""Compare iter_smooth / flex_smooth_quant with msModelSlim's outputs for the tiny fixture checkpoint.

Run as a script (the tests run it in a subprocess, with ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` set before torch is imported, the kernels msModelSlim's references were made
with)::

    python tests/anti_outlier_parity.py iter_smooth|flex_smooth_quant [LAYER ...]   (default: 0 1 2)

It prints one JSON object: per smoothed tensor of layers 0-2, how our tensors compare with the fixture's
(``equal``: the fraction of equal elements, ``rel``: max |ours - theirs| / max |theirs|), plus the alpha /
beta flex_smooth_quant chose. The statistics come from plain float forwards of our model (bf16, torch's
bf16 matmuls): for layer 0's input_layernorm subgraph they are exactly msModelSlim's (its input is the
embedding); deeper subgraphs see activations that msModelSlim computed with its own attention code and,
from layer 1 on, through the already smoothed and fake-quantized earlier layers.

Weights are compared as msModelSlim stores them: int8 by dsquant's per-channel quantizer, their weight
scale through deq_scale = f32(md(input_scale * weight_scale)) with the fixture's own input_scale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.io.checkpoint import read_model_config
from pipeline.model.causal_lm import build_model
from pipeline.quant.recipe import modelslim_yaml
from pipeline.quant.transforms.flex_smooth import flex_smooth_layer
from pipeline.quant.transforms.iter_smooth import iter_smooth_layer
from pipeline.quant.job.options import QuantizeOptions, calibration_samples
from pipeline.quant.transforms.outlier_stats import ActivationRows, ChannelTrace, observing_subgraphs
from pipeline.quant.numerics.qparams import quantize_weight_per_channel, static_activation_params
from pipeline.quant.recipe.steps import FlexSmooth
from pipeline.quant.transforms.subgraphs import step_subgraphs

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SOURCE = FIXTURES / "tiny-deepseek-v3"
STEPS = {  # fixture, its recipe (whose first process step is the one compared), observer, layer function
    "iter_smooth": ("msmodelslim-v1-bf16-itersmooth", "recipe-itersmooth.yaml", ChannelTrace, iter_smooth_layer),
    "flex_smooth_quant": ("msmodelslim-v1-bf16-flexsmooth", "recipe-flexsmooth.yaml", ActivationRows,
                          flex_smooth_layer),
}
QUANTIZED = ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj")


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    a, b = ours.double(), theirs.double()
    if a.shape != b.shape:
        return {"shape": [list(a.shape), list(b.shape)]}
    scale = float(b.abs().max()) or 1.0
    return {"equal": float((a == b).double().mean()), "rel": float((a - b).abs().max()) / scale,
            "dtype": str(ours.dtype) == str(theirs.dtype)}


def run(step: str, layer_ids=(0, 1, 2)) -> dict:
    folder, recipe, kind, smooth_layer = STEPS[step]
    fixture = FIXTURES / folder
    settings = modelslim_yaml.load(str(FIXTURES / recipe)).recipe.steps[0]
    assert settings.type == step, settings
    cfg = read_model_config(str(SOURCE / "config.json"))
    src = load_file(str(SOURCE / "model.safetensors"))
    ref = load_file(str(next(fixture.glob("quant_model_weights-*.safetensors"))))
    model = build_model(cfg, src, dtype=torch.bfloat16)
    samples = calibration_samples(str(SOURCE), QuantizeOptions(calib_path=str(FIXTURES / "calib.json")),
                                  cfg.max_position_embeddings)
    subgraphs = [sg for i in layer_ids for sg in step_subgraphs(settings, cfg, i)]
    with torch.no_grad(), observing_subgraphs(model, subgraphs, kind) as stats:
        for s in samples:
            model.run_layers(model.embed(torch.tensor([s])), range(max(layer_ids) + 1))
    out: dict = {"layers": {}, "choices": {}}
    for i in layer_ids:
        p = f"model.layers.{i}."
        mine = {k: v for k, v in src.items() if k.startswith(p)}
        extra = {"choices": out["choices"]} if step == "flex_smooth_quant" else {}
        new = smooth_layer(mine, i, cfg, stats, settings, **extra)
        res: dict = {}
        for name, t in new.items():
            if t is mine.get(name):
                continue
            module = name.rsplit(".", 2)[-2]
            if module in QUANTIZED and name.endswith(".weight"):
                q, ws, _ = quantize_weight_per_channel(t)
                base = name[: -len(".weight")]
                res[name] = compare(q, ref[name])
                deq = (ref[base + ".input_scale"].to(ws.dtype) * ws[:, 0]).float()
                res[base + ".weight_scale"] = compare(deq, ref[base + ".deq_scale"])
            else:
                res[name] = compare(t, ref[name])
        out["layers"][i] = res
    out["choices"] = {k: [c.alpha, c.beta] for k, c in out["choices"].items()}
    if step == "flex_smooth_quant" and 0 in layer_ids:
        # msModelSlim's choice for layer 0's ov, recovered from its kv_b_proj rows by a least-squares fit of
        # log(1 / s) against log(a), log(w): alpha 0.249, beta 0.750
        fixed = FlexSmooth(alpha=0.25, beta=0.75, enable_subgraph_type=("ov",))
        new = flex_smooth_layer({k: v for k, v in src.items() if k.startswith("model.layers.0.")}, 0, cfg,
                                stats, fixed)
        kv_b, o = "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.o_proj.weight"
        out["layer0_ov_their_choice"] = {kv_b: compare(new[kv_b], ref[kv_b]),
                                         o: compare(quantize_weight_per_channel(new[o])[0], ref[o])}
    if step == "iter_smooth" and 0 in layer_ids:
        out["layer0_activation"] = layer0_activation(model, cfg, samples, smooth_layer(
            {k: v for k, v in src.items() if k.startswith("model.layers.0.")}, 0, cfg, stats, settings), ref)
    return out


@torch.no_grad()
def layer0_activation(model, cfg, samples, new: dict, ref: dict) -> dict:
    """Layer 0's q_a_proj / kv_a_proj_with_mqa activation parameters after iter_smooth, from the smoothed
    norm's output as msModelSlim's run computed it, md(md(g * x^) + b), and quant_bias with the bias
    divided by deq_scale in md (msModelSlim's order): each compared with the fixture."""
    p = "model.layers.0."
    g, b = new[p + "input_layernorm.weight"], new[p + "input_layernorm.bias"]
    lo, hi = float("inf"), float("-inf")
    for s in samples:
        h = model.embed(torch.tensor([s])).float()
        x_hat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(g.dtype)
        y = (g * x_hat + b).to(g.dtype)
        lo, hi = min(lo, float(y.min())), max(hi, float(y.max()))
    scale, offset = static_activation_params(lo, hi, g.dtype)
    res = {}
    for m in ("q_a_proj", "kv_a_proj_with_mqa"):
        a = p + "self_attn." + m
        q, ws, _ = quantize_weight_per_channel(new[a + ".weight"])
        deq = (scale * ws[:, 0]).float()
        qb = torch.round((new[a + ".bias"].to(g.dtype) / deq.to(g.dtype)).float()
                         - q.sum(1).float() * offset.float()).to(torch.int32)
        res[a] = {"input_scale": compare(scale.float(), ref[a + ".input_scale"]),
                  "input_offset": compare(offset.float(), ref[a + ".input_offset"]),
                  "deq_scale": compare(deq, ref[a + ".deq_scale"]),
                  "quant_bias": compare(qb, ref[a + ".quant_bias"])}
    return res


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in STEPS:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(STEPS)} [LAYER ...]")
    print(json.dumps(run(sys.argv[1], tuple(int(a) for a in sys.argv[2:]) or (0, 1, 2))))
