"""The checker on msModelSlim's own outputs (accepted as ascendV1, rejected as seed), on copies broken on
purpose, and through its command line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.format.checker import Report, check_dir
from pipeline.format.description import ASCEND_V1, DESCRIPTION_NAME, SEED
from pipeline.io.safetensors_io import CheckpointError
from tests.tiny import FIXTURES

REPO = Path(__file__).resolve().parents[1]
FIXTURE_NAMES = ["msmodelslim-v1-bf16", "msmodelslim-v1-fp16"]
WEIGHTS = "quant_model_weights-00001-of-00001.safetensors"
INDEX = "quant_model_weights.safetensors.index.json"


def find(report: Report, rule: str, where: str, pattern: str) -> None:
    """Assert a violation of ``rule`` at ``where`` whose message matches ``pattern``."""
    hits = [v for v in report.violations if v.rule == rule and v.where == where and re.search(pattern, v.message)]
    assert hits, f"no [{rule}] {where}: /{pattern}/ in\n{report.to_text(per_rule=50)}"


def rules(report: Report) -> set[str]:
    return {v.rule for v in report.violations}


# ----- msModelSlim's outputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_is_clean_ascend_v1(name):
    report = check_dir(str(FIXTURES / name))
    assert report.ok, report.to_text()
    assert report.dialect == report.detected == ASCEND_V1
    assert report.type_counts == {"W8A8": 80, "W8A8_DYNAMIC": 252, "FLOAT": 35, "FAQuant": 24}
    assert report.tensors == 391 and report.fa_layers == [0, 1, 2, 3] and report.model_quant_type == "W8A8"
    assert "OK: no violations" in report.to_text() and "dialect: ascendV1 (detected)" in report.to_text()


@pytest.mark.parametrize("name,floats", [("itersmooth", 50), ("flexsmooth", 35), ("quarot-c8", 35)])
def test_recipe_fixtures_are_clean_ascend_v1(name, floats):
    """msModelSlim's recipe outputs: iter_smooth's 15 float32 norm and linear biases are FLOAT entries;
    QuaRot's optional/quarot.safetensors is found through the description's optional entry."""
    report = check_dir(str(FIXTURES / f"msmodelslim-v1-bf16-{name}"))
    assert report.ok, report.to_text()
    assert report.dialect == ASCEND_V1
    assert report.type_counts == {"W8A8": 80, "W8A8_DYNAMIC": 252, "FLOAT": floats, "FAQuant": 24}
    assert report.tensors == 356 + floats and report.fa_layers == [0, 1, 2, 3]


@pytest.mark.parametrize("name,md", [("msmodelslim-v1-bf16", "BF16"), ("msmodelslim-v1-fp16", "F16")])
def test_fixture_fails_seed_rules_naming_the_differences(name, md):
    report = check_dir(str(FIXTURES / name), dialect=SEED)
    assert report.dialect == SEED and report.detected == ASCEND_V1
    find(report, "file-names", WEIGHTS, "not a weight file name of the seed dialect .*quant_model_weight_w8a8.safetensors")
    find(report, "file-names", INDEX, r"not the seed index name \(quant_model_weight_w8a8.safetensors.index.json\)")
    find(report, "dtype", "model.layers.0.self_attn.q_a_proj.input_scale", f"dtype F32; the seed dialect wants {md}")
    find(report, "dtype", "model.layers.1.mlp.experts.0.up_proj.weight_scale", f"F32; the seed dialect wants {md}")
    find(report, "dtype", "model.layers.0.self_attn.fa_k.scale", f"F32; the seed dialect wants {md}")
    find(report, "siblings", "model.layers.0.self_attn.q_a_proj",
         "W8A8 layer lacks weight_scale, weight_offset .*static layers too")
    find(report, "top-level-keys", DESCRIPTION_NAME, "version, metadata, group_size, optional are not written by the seed")
    find(report, "model-quant-type", "model_quant_type", "is 'W8A8'; the seed dialect writes 'W8A8_DYNAMIC'")
    find(report, "layer-quant-type", "model.layers.0.self_attn.quant_type", "only the ascendV1 dialect writes them")
    assert "dialect: seed (as asked; detected ascendV1)" in report.to_text()



# ----- broken on purpose -------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A writable copy of the bf16 fixture."""
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "msmodelslim-v1-bf16", dst, copy_function=shutil.copyfile)
    os.chmod(dst, 0o755)
    return dst


def _edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw, indent=2))


def rewrite(d: Path, tensors_fn: Optional[Callable[[dict], None]] = None, types: Optional[dict] = None,
            drop: tuple[str, ...] = (), consistent: bool = True) -> None:
    """Change the weights with ``tensors_fn``; with ``consistent``, also put ``types`` (name -> type) in the
    description, drop ``drop`` from it, and rebuild the index, so that only the change itself is wrong."""
    tensors = load_file(str(d / WEIGHTS))
    if tensors_fn:
        tensors_fn(tensors)
    save_file(tensors, str(d / WEIGHTS))
    if not consistent:
        return

    def fix_desc(desc: dict) -> None:
        for n in drop:
            desc.pop(n)
        desc.update(types or {})

    _edit_json(d / DESCRIPTION_NAME, fix_desc)
    _edit_json(d / INDEX, lambda ix: ix.update(
        metadata={"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        weight_map=dict.fromkeys(tensors, WEIGHTS)))


def test_deleted_tensor(ckpt):
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    rewrite(ckpt, lambda t: t.pop(name), consistent=False)
    report = check_dir(str(ckpt))
    find(report, "key-without-tensor", name, "described in quant_model_description.json but in no weight file")
    find(report, "siblings", "model.layers.1.mlp.experts.3.up_proj", "W8A8_DYNAMIC layer lacks weight_scale")
    find(report, "index", name, f"{INDEX} maps it to {WEIGHTS}, but it is in no weight file")


def test_tensor_without_description_key(ckpt):
    name = "model.layers.0.self_attn.o_proj.smooth_scale"
    rewrite(ckpt, lambda t: t.update({name: torch.ones(64)}), consistent=False)
    report = check_dir(str(ckpt))
    find(report, "tensor-without-key", name, "has no entry in quant_model_description.json")
    find(report, "index", name, f"{INDEX} does not name this tensor")


def test_wrong_deq_scale_dtype(ckpt):
    name = "model.layers.0.self_attn.o_proj.deq_scale"
    rewrite(ckpt, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    report = check_dir(str(ckpt))
    find(report, "dtype", name, "dtype BF16; the ascendV1 dialect wants F32 for deq_scale of a W8A8 layer")
    assert rules(report) == {"dtype"}


def test_fa_k_scale_per_head(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.2.self_attn.fa_k.scale": torch.ones(4, 1),
                                      "model.layers.2.self_attn.fa_k.offset": torch.zeros(4, 1, dtype=torch.int8)}))
    report = check_dir(str(ckpt))
    find(report, "shape", "model.layers.2.self_attn.fa_k.scale", r"shape \[4, 1\]; expected \[1, 1\]")
    find(report, "shape", "model.layers.2.self_attn.fa_k.offset", r"shape \[4, 1\]; expected \[1, 1\]")
    assert rules(report) == {"shape"}


def _static_linear(p: str, n: int, k: int) -> dict:
    return {f"{p}.weight": torch.zeros(n, k, dtype=torch.int8), f"{p}.quant_bias": torch.zeros(n, dtype=torch.int32),
            f"{p}.input_scale": torch.ones(1), f"{p}.input_offset": torch.zeros(1), f"{p}.deq_scale": torch.ones(n)}


def test_kv_b_proj_quantized(ckpt):
    new = _static_linear("model.layers.1.self_attn.kv_b_proj", 128, 48)
    rewrite(ckpt, lambda t: t.update(new), types=dict.fromkeys(new, "W8A8"))
    report = check_dir(str(ckpt))
    find(report, "float-required", "model.layers.1.self_attn.kv_b_proj.weight",
         "is W8A8 but must be FLOAT .*vllm-ascend asserts kv_b_proj is unquantized")
    assert rules(report) == {"float-required"}


def test_q_a_and_kv_a_types_disagree(ckpt):
    p = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    gone = [f"{p}.{x}" for x in ("quant_bias", "input_scale", "input_offset", "deq_scale")]
    new = {f"{p}.weight_scale": torch.ones(64, 1), f"{p}.weight_offset": torch.zeros(64, 1)}

    def change(t: dict) -> None:
        for n in gone:
            t.pop(n)
        t.update(new)

    rewrite(ckpt, change, types=dict.fromkeys([f"{p}.weight", *new], "W8A8_DYNAMIC"), drop=tuple(gone))
    report = check_dir(str(ckpt))
    find(report, "qa-kva-type", "model.layers.0.self_attn",
         "q_a_proj is W8A8 but kv_a_proj_with_mqa is W8A8_DYNAMIC; runtimes fuse them")
    assert rules(report) == {"qa-kva-type"}


def test_mtp_layer_not_carried(ckpt):
    """No tensor (nor description entry) of the MTP layer, config.json unchanged: msModelSlim's
    ``--quant_mtp none`` output, valid."""
    mtp = [n for n in load_file(str(ckpt / WEIGHTS)) if n.startswith("model.layers.3.")]
    assert len(mtp) > 20
    rewrite(ckpt, lambda t: [t.pop(n) for n in mtp], drop=tuple(mtp) + ("model.layers.3.self_attn.quant_type",))
    report = check_dir(str(ckpt))
    assert report.ok, report.to_text()
    assert report.mtp.startswith("not carried") and report.fa_layers == [0, 1, 2]
    assert "MTP layer: not carried" in report.to_text() and report.to_dict()["mtp"] == report.mtp
    assert check_dir(str(FIXTURES / "msmodelslim-v1-bf16")).mtp == "carried"


@pytest.mark.parametrize("kept", ["model.layers.3.eh_proj.weight", "model.layers.3.input_layernorm.weight"])
def test_mtp_layer_partly_dropped(ckpt, kept):
    """One tensor of the MTP layer left: the layer counts as carried, so the rest are missing."""
    mtp = [n for n in load_file(str(ckpt / WEIGHTS)) if n.startswith("model.layers.3.") and n != kept]
    rewrite(ckpt, lambda t: [t.pop(n) for n in mtp], drop=tuple(mtp) + ("model.layers.3.self_attn.quant_type",))
    report = check_dir(str(ckpt))
    assert report.mtp == "carried"
    missing = next(n for n in ("model.layers.3.enorm.weight", "model.layers.3.eh_proj.weight") if n != kept)
    find(report, "layout-missing", missing, "MTP layer is carried whole or not at all")
    assert rules(report) == {"layout-missing"}


def test_index_points_to_missing_file(ckpt):
    missing = "quant_model_weights-00002-of-00002.safetensors"
    _edit_json(ckpt / INDEX, lambda ix: ix["weight_map"].update({"model.norm.weight": missing}))
    report = check_dir(str(ckpt))
    find(report, "index", INDEX, f"points 1 tensor\\(s\\) at {missing}, which does not exist")
    find(report, "index", "model.norm.weight", f"{INDEX} maps it to {missing}, but it is in {WEIGHTS}")


def test_corrupt_description(ckpt):
    (ckpt / DESCRIPTION_NAME).write_text('{"model.norm.weight": "FLOAT",')
    report = check_dir(str(ckpt))
    find(report, "description", DESCRIPTION_NAME, "not valid JSON")
    (ckpt / DESCRIPTION_NAME).write_text('{"model.norm.weight": "FLOAT", "model.norm.weight": "W8A8"}')
    find(check_dir(str(ckpt)), "description", DESCRIPTION_NAME, "key 'model.norm.weight' appears more than once")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    report = check_dir(str(ckpt))
    find(report, "config", "config.json", "missing")
    assert rules(report) == {"config"}  # the dtype rules fall back to the tensors' float dtype


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        check_dir(str(tmp_path / "nothing"))


# ----- the command line --------------------------------------------------------------------------------
def test_cli_exit_codes(tmp_path):
    fixture = str(FIXTURES / "msmodelslim-v1-bf16")
    argvs = {0: [fixture, "--json"], 1: [fixture, "--dialect", "seed"], 2: [str(tmp_path / "nothing")]}
    procs = {code: subprocess.Popen([sys.executable, "-m", "jobs.check", *argv], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for code, argv in argvs.items()}  # started together: each pays the torch import
    out = {code: p.communicate(timeout=60) for code, p in procs.items()}
    assert {code: p.returncode for code, p in procs.items()} == {0: 0, 1: 1, 2: 2}, out
    assert json.loads(out[0][0])["ok"] is True
    assert "[file-names]" in out[1][0] and "not a directory" in out[2][1]
