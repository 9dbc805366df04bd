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

from pipeline.config import DeepseekV3Config
from pipeline.model.causal_lm import build_model
from pipeline.quant.flex_smooth import FlexSmoothSettings, flex_smooth_layer
from pipeline.quant.iter_smooth import IterSmoothSettings, iter_smooth_layer
from pipeline.quant.options import QuantizeOptions, calibration_samples
from pipeline.quant.outlier_stats import ActivationRows, ChannelTrace, observing_subgraphs
from pipeline.quant.qparams import quantize_weight_per_channel

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SOURCE = FIXTURES / "tiny-deepseek-v3"
STEPS = {
    # the recipes' settings (tests/fixtures/recipe-itersmooth.yaml, recipe-flexsmooth.yaml)
    "iter_smooth": (FIXTURES / "msmodelslim-v1-bf16-itersmooth",
                    IterSmoothSettings(alpha=0.5, scale_min=1e-5, symmetric=False,
                                       enable_subgraph_type=("norm-linear", "ov"), include=("*",)),
                    ChannelTrace, iter_smooth_layer),
    "flex_smooth_quant": (FIXTURES / "msmodelslim-v1-bf16-flexsmooth",
                          FlexSmoothSettings(enable_subgraph_type=("norm-linear", "ov"), include=("*",)),
                          ActivationRows, flex_smooth_layer),
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
    fixture, settings, kind, smooth_layer = STEPS[step]
    cfg = DeepseekV3Config.from_file(str(SOURCE / "config.json"))
    src = load_file(str(SOURCE / "model.safetensors"))
    ref = load_file(str(next(fixture.glob("quant_model_weights-*.safetensors"))))
    model = build_model(cfg, src, dtype=torch.bfloat16)
    samples = calibration_samples(str(SOURCE), QuantizeOptions(calib_path=str(FIXTURES / "calib.json")),
                                  cfg.max_position_embeddings)
    subgraphs = [sg for i in layer_ids for sg in settings.subgraphs(cfg, i)]
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
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in STEPS:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(STEPS)} [LAYER ...]")
    print(json.dumps(run(sys.argv[1], tuple(int(a) for a in sys.argv[2:]) or (0, 1, 2))))
