"""``jobs.check --runtime``: msModelSlim's own outputs (the shared fixtures) against each runtime's loader
rules, an altered copy of a fixture per rule (each breaks that rule only, and the check names it), the
quantizer's up-front runtime label against the check of what it wrote, and ``--target-runtime``'s
refusal before any work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.format.runtimes import DSQUANT, MINDIE, VLLM_ASCEND, check_runtime, runtimes_for

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path("/work/shared/fixtures")
OUTPUTS = sorted(p.name for p in FIXTURES.glob("msmodelslim-v1-*")) if FIXTURES.is_dir() else []
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not OUTPUTS, reason="the shared msModelSlim fixtures are not here")


def test_fixtures_load_in_vllm_ascend_and_are_labelled_for_mindie():
    assert len(OUTPUTS) >= 5
    for name in OUTPUTS:
        r = check_runtime(str(FIXTURES / name), VLLM_ASCEND)
        assert r.ok, (name, r.to_text())
        # their W8A8 q_a/kv_a/q_b carry no weight_scale: a note (decode-only instances), 3 per layer
        assert {f.rule for f in r.notes} == {"decode-weight-scale"} and len(r.notes) == 3 * 3
        m = check_runtime(str(FIXTURES / name), MINDIE)
        rules = {f.rule for f in m.violations}
        assert {"mindie-fa-config", "mindie-model-type"} <= rules
        assert ("mindie-dtype" in rules) == ("fp16" not in name)
    assert check_runtime(str(FIXTURES / "msmodelslim-v1-bf16"), VLLM_ASCEND, tp=2).ok   # 4 heads over 2 ranks


def _copy(tmp_path: Path, name: str = "msmodelslim-v1-bf16") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _edit_tensors(d: Path, edit) -> None:
    [f] = list(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    idx = d / "quant_model_weights.safetensors.index.json"
    if idx.exists():
        _edit_json(idx, lambda j: j.__setitem__("weight_map", {k: f.name for k in tensors}))


L0 = "model.layers.0.self_attn"


def _set(d, k, v):
    d[k] = v


def _pop(d, k):
    d.pop(k)


ALTERATIONS = {
    # config.json's quantization_config shadows the description (what --mindie-format writes)
    "description-source": lambda d: _edit_json(d / "config.json", lambda c: _set(
        c, "quantization_config", {"fa_quant_type": "FAKQuant"})),
    "model-type": lambda d: _edit_json(d / "config.json", lambda c: _set(c, "model_type", "deepseekv2")),
    "method-lookup": lambda d: _edit_json(d / "quant_model_description.json", lambda j: _set(
        j, f"{L0}.kv_a_proj_with_mqa.weight", "FLOAT")),         # fused with q_a_proj (W8A8)
    "method-type": lambda d: _edit_json(d / "quant_model_description.json", lambda j: _set(
        j, "model.layers.1.mlp.shared_experts.down_proj.weight", "W2A2")),
    "tensors": lambda d: _edit_tensors(d, lambda t: _set(t, f"{L0}.o_proj.deq_scale",
                                                         t[f"{L0}.o_proj.deq_scale"].to(torch.int64))),
    "fa-quant-type": lambda d: _edit_json(d / "quant_model_description.json", lambda j: _set(
        j, "fa_quant_type", "FAQuant")),
    "fa-scales": lambda d: _edit_tensors(d, lambda t: _pop(t, "model.layers.2.self_attn.fa_k.scale")),
}


@pytest.mark.parametrize("rule", sorted(ALTERATIONS))
def test_each_rule_is_caught_on_an_altered_copy(tmp_path, rule):
    d = _copy(tmp_path)
    ALTERATIONS[rule](d)
    r = check_runtime(str(d), VLLM_ASCEND)
    assert not r.ok and {f.rule for f in r.violations} == {rule}, r.to_text()
    assert "vllm-ascend" in r.violations[0].source


def test_fa_scales_split_over_tensor_parallel_ranks():
    r = check_runtime(str(FIXTURES / "msmodelslim-v1-bf16"), VLLM_ASCEND, tp=3)   # 4 heads
    assert {f.rule for f in r.violations} == {"fa-scales"} and "tp 3" in r.violations[0].message


def test_mindie_accepts_its_own_layout(tmp_path):
    """The fp16 fixture with what --mindie-format writes into config.json: MindIE's rules pass (its
    notes remain), and vllm-ascend refuses it."""
    d = _copy(tmp_path, "msmodelslim-v1-fp16")
    _edit_json(d / "config.json", lambda c: c.update(model_type="deepseekv2",
                                                       quantization_config={"fa_quant_type": "FAKQuant"}))
    m = check_runtime(str(d), MINDIE)
    assert m.ok and {f.rule for f in m.notes} == {"mindie-model", "mindie-nz"}
    assert {f.rule for f in check_runtime(str(d), VLLM_ASCEND).violations} == {"description-source", "model-type"}


def test_cli_runtime_exit_status_and_json(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "jobs.check", *a], cwd=REPO, capture_output=True,
                                    text=True, timeout=120)
    ok = run(str(FIXTURES / "msmodelslim-v1-bf16"), "--runtime", "vllm-ascend", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    bad = run(str(FIXTURES / "msmodelslim-v1-bf16"), "--runtime", "mindie")
    assert bad.returncode == 1 and "does NOT load in mindie" in bad.stdout and "MindIE FA3 documentation" in bad.stdout


def test_quantizer_label_matches_the_check_of_its_output(qdir):
    """The default recipe's output (FA3, bfloat16 source, no --mindie-format): labelled for dsquant and
    vllm-ascend, not MindIE; the checks agree."""
    label = runtimes_for(mindie_format=False, fa_quant=True, model_dtype="bfloat16")
    assert label[DSQUANT] is None and label[VLLM_ASCEND] is None and label[MINDIE] is not None
    for runtime in (DSQUANT, VLLM_ASCEND, MINDIE):
        assert check_runtime(qdir, runtime).ok == (label[runtime] is None), runtime
    label = runtimes_for(mindie_format=True, fa_quant=True, model_dtype="float16")
    assert label[VLLM_ASCEND] is not None and label[MINDIE] is None


def test_target_runtime_refuses_before_any_work(tmp_path):
    out = tmp_path / "never"
    p = subprocess.run([sys.executable, "-m", "jobs.quantize", "--mindie-format", "--target-runtime", "vllm-ascend",
                        "--save-path", str(out), "--no-estimate", "--no-progress"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "--target-runtime vllm-ascend" in p.stderr and "mindie" in p.stderr.lower()
    assert "runtimes: this output will load in dsquant" in p.stdout
    assert not out.exists()


def test_quantize_says_up_front_what_its_output_then_loads_in(tmp_path):
    """The tiny checkpoint with the legacy flags: DeepSeek-V3's FA3 exclusion list covers all its layers,
    so no FA3 tensor is written; the label said before the work equals the one checked on the output."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "jobs.quantize", "--model-path", str(FIXTURES / "tiny-deepseek-v3"),
                        "--calib-data", str(FIXTURES / "calib.json"), "--save-path", str(out), "--no-estimate",
                        "--no-progress", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("runtimes: ")]
    assert len(lines) == 2, p.stdout
    before = lines[0].split("will load in ")[1].split(" (")[0].split(", ")
    after = lines[1].split(" loads in ")[1].split(", ")
    assert sorted(before) == sorted(after) == sorted([DSQUANT, VLLM_ASCEND, MINDIE])
    assert all(check_runtime(str(out), r).ok for r in after)
