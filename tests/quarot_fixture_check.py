"""QuaRot on the tiny checkpoint against msModelSlim's quarot-c8 output (run by test_quarot.py through
pinned_isa.run_pinned; argument ``reference`` or ``blocked``: how the rotations are multiplied; or
``products``: the two ways of multiplying compared on larger random weights).

Compares every tensor of the output that depends on the rotation alone (flex_smooth_quant, which runs after
QuaRot there, changes the others): prints one JSON line {name: [equal, elements differing, max |diff|]}
plus the optional export under "optional/...".

- FLOAT tensors: embed_tokens, lm_head, model.norm, the routers, the norms QuaRot sets to one, the MTP
  layer's own modules, kv_b_proj's key (nope) rows (layers 0-2; flex_smooth rescales the value rows) and
  all of layer 3's kv_b_proj (msModelSlim never smooths the MTP layer).
- int8 weights through pipeline.quant.numerics.qparams.quantize_weight_per_channel: every W8A8_DYNAMIC MLP and
  expert weight with its weight_scale, and layer 3's W8A8 attention weights.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file

from pipeline import layout
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.numerics.qparams import quantize_weight_per_channel
from pipeline.quant.transforms.quarot import (
    QUAROT_FILE, build_rotations, description_entry, optional_tensors, rotate_globals, rotate_layer)
from tiny import FIXTURES

REF = FIXTURES / "msmodelslim-v1-bf16-quarot-c8"
SMOOTHED = ("input_layernorm", "q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj", "o_proj", "kv_b_proj")


def compare(a: torch.Tensor, b: torch.Tensor) -> list:
    if a.shape != b.shape or a.dtype != b.dtype:
        return [False, -1, f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"]
    d = (a.double() - b.double()).abs()
    return [bool(torch.equal(a, b)), int((d > 0).sum()), float(d.max())]


def main(mode: str) -> dict:
    reference = {"reference": True, "blocked": False}[mode]
    reader = CheckpointReader(str(FIXTURES / "tiny-deepseek-v3"))
    cfg = reader.config
    rot = build_rotations(cfg, 16)
    ref = load_file(str(REF / "quant_model_weights-00001-of-00001.safetensors"))
    ours = rotate_globals(reader.read_globals(), cfg, rot, reference=reference)
    for i in layout.all_layer_ids(cfg):
        ours.update(rotate_layer(reader.read_layer(i), i, cfg, rot, reference=reference))

    out: dict[str, list] = {}
    heads, per_head = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim
    for name, t in ours.items():
        lid = layout.layer_of(name)
        mtp = lid is not None and lid >= cfg.num_hidden_layers
        if name.endswith("e_score_correction_bias"):
            continue  # not touched by QuaRot (passes through; the reader hands it out as float32)
        if ref[name].dtype == torch.int8:
            if ".mlp." in name or mtp:
                q, ws, _ = quantize_weight_per_channel(t, name)
                out[name] = compare(q, ref[name])
                scale = name.replace(".weight", ".weight_scale")
                if scale in ref:
                    out[scale] = compare(ws.float(), ref[scale])
        elif name.endswith("kv_b_proj.weight") and not mtp:
            nope = lambda w: w.view(heads, per_head, -1)[:, :cfg.qk_nope_head_dim]  # noqa: E731
            out[name + "[nope rows]"] = compare(nope(t), nope(ref[name]))
        elif mtp or not any(f".{s}." in name for s in SMOOTHED):
            out[name] = compare(t, ref[name])

    optional = load_file(str(REF / QUAROT_FILE))
    for k, v in optional_tensors(rot).items():
        out[f"{QUAROT_FILE}:{k}"] = compare(v, optional[k])
    description = json.loads((REF / "quant_model_description.json").read_text())
    entry = description_entry()
    out["description:optional"] = [entry["optional"] == description["optional"], 0, 0.0]
    return out


def products() -> dict:
    """Blocked against full-matrix products, block 32, on weights spanning many binades (so that float32
    sums are inexact and their order shows), bf16 and float32, both sides, plain and composite rotations."""
    from pipeline.quant.transforms.hadamard import Rotation, block_hadamard, identity, shifted_block_hadamard

    h = block_hadamard(2048, 32, "hidden")
    kv = block_hadamard(512, 32, "kv")
    rotations = {"hidden 2048": h, "shifted 512": shifted_block_hadamard(512, 32, "q_lora"),
                 "[kv 512, I 64]": Rotation(kv.pieces + (identity(64),)),
                 "[I 128, v 128] x 4": Rotation((identity(128),) + block_hadamard(128, 32, "v").pieces, 4)}
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, r in rotations.items():
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(96, r.dim, generator=g) * torch.exp(2 * torch.randn(96, r.dim, generator=g))
            w = w.to(dtype)
            out[f"{name} {dtype} input side"] = compare(r.input_side(w).to(dtype), r.input_side(w, True).to(dtype))
            wt = w.T.contiguous()
            out[f"{name} {dtype} output side"] = compare(r.output_side(wt).to(dtype),
                                                         r.output_side(wt, True).to(dtype))
    return out


if __name__ == "__main__":
    print(json.dumps(products() if sys.argv[1] == "products" else main(sys.argv[1])))
