"""Quantize the tiny fixture checkpoint with one of msModelSlim's recipes and compare every tensor with what
msModelSlim wrote for it (run by tests/test_msmodelslim_recipes.py in a child process pinned to AVX2).

    python msmodelslim_recipe_parity.py FIXTURE RECIPE PRODUCTS [fp16]

Prints one JSON object: {"missing": [...], "extra": [...], "tensors": {name: {"kind", "exact", "diff"}}}
with kind "int" (diff: largest absolute difference, in steps), "offset" (input_offset: steps) or "float"
(diff: max |ours - theirs| / max |theirs|).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.quant.recipe import modelslim_yaml
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from tiny import FIXTURES, TINY_FIXTURE


def fp16_copy(dst: Path) -> Path:
    """The tiny checkpoint in fp16, as msModelSlim's fp16 fixture was made from it."""
    shutil.copytree(TINY_FIXTURE, dst)
    t = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in t.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load_dir(path: Path) -> dict:
    out = {}
    for f in path.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def compare(ours: dict, ref: dict) -> dict:
    res = {}
    for name in sorted(set(ours) & set(ref)):
        a, b = ours[name], ref[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            res[name] = {"kind": "layout", "exact": False, "diff": f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"}
        elif not a.is_floating_point():
            d = (a.long() - b.long()).abs()
            res[name] = {"kind": "int", "exact": bool(torch.equal(a, b)), "diff": int(d.max()) if a.numel() else 0,
                         "frac": float((d > 0).float().mean()) if a.numel() else 0.0}
        elif name.endswith(".input_offset"):
            res[name] = {"kind": "offset", "exact": bool(torch.equal(a, b)), "diff": float((a - b).abs().max())}
        else:
            top = float(b.float().abs().max())
            d = float((a.float() - b.float()).abs().max())
            res[name] = {"kind": "float", "exact": bool(torch.equal(a, b)), "diff": d / top if top else d}
    return res


def main(fixture: str, recipe: str, products: str, fp16: bool = False) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = fp16_copy(Path(tmp) / "src") if fp16 else TINY_FIXTURE
        rf = modelslim_yaml.load(str(FIXTURES / recipe))
        dst = Path(tmp) / "out"
        quantize_checkpoint(str(src), str(dst), dataclasses.replace(rf.recipe, calib_products=products),
                            QuantizeOptions(calib_path=str(FIXTURES / "calib.json")), log=lambda m: None)
        ours, ref = load_dir(dst), load_dir(FIXTURES / fixture)
        return {"missing": sorted(set(ref) - set(ours)), "extra": sorted(set(ours) - set(ref)),
                "tensors": compare(ours, ref),
                "optional": compare(load_dir(dst / "optional"), load_dir(FIXTURES / fixture / "optional"))
                if (FIXTURES / fixture / "optional").exists() else {},
                "description": json.loads((dst / "quant_model_description.json").read_text())}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "fp16")))
