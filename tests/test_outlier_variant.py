"""The outlier variant maker: the variant computes the source's logits bit for bit (embedded model, tiny
fixture, fp32, FP8 sources), its picked channels really carry outliers, and bad options or inexact
factors are one-line errors that leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.io.release_layout.fp8_copy import write_fp8_copy
from pipeline.model.loading import load_model
from pipeline.quant.evaluation.outlier_variant import NORMS, VariantError, VariantSpec, parse_log2_range, parse_norms
from pipeline.quant.evaluation.variant_writer import RECORD_NAME, write_variant
from tiny import TINY_FIXTURE, tiny_config, write_checkpoint

REPO = Path(__file__).resolve().parents[1]
# A picked channel's max |activation| over the median channel's, in the variant: at least the smallest
# factor (2^4) times the smallest ratio such a channel had in the source, which is never below 1/2 here.
MIN_OUTLIER_RATIO = 8.0
# ... and in the source the same channels are ordinary (no outlier yet).
MAX_SOURCE_RATIO = 4.0


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def embedded_variant(tmp_path_factory):
    dst = tmp_path_factory.mktemp("variant") / "v"
    record = write_variant(EMBEDDED_MODEL_DIR, str(dst), VariantSpec(seed=11), log=quiet)
    return dst, record


def held_ids(n: int = 3, length: int = 96) -> list[torch.Tensor]:
    from pipeline.text import corpus
    from pipeline.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    docs = corpus.load_heldout(EMBEDDED_MODEL_DIR)[1][:n]
    return [torch.tensor([tok.encode(d.text)[:length]]) for d in docs]


@torch.no_grad()
def assert_same_function(src: str, variant: str, ids, dtype=torch.float32) -> None:
    a = load_model(src, dtype=torch.bfloat16, device="cpu")    # an FP8 source as the reader gives it
    a = a if dtype == torch.bfloat16 else a.to(dtype)
    b = load_model(variant, dtype=dtype, device="cpu")
    for x in ids:
        la, ha = a(x, return_hidden=True)
        lb, hb = b(x, return_hidden=True)
        assert torch.equal(la, lb)
        if a.mtp_layers:
            assert torch.equal(a.mtp(ha[:, :-1], x[:, 1:])[0], b.mtp(hb[:, :-1], x[:, 1:])[0])


def test_embedded_variant_logits_bit_identical(embedded_variant):
    dst, record = embedded_variant
    assert record["check"]["identical"] and record["check"]["dtypes"] == ["float32", "bfloat16"]
    assert_same_function(EMBEDDED_MODEL_DIR, str(dst), held_ids())                      # texts the check never saw
    assert_same_function(EMBEDDED_MODEL_DIR, str(dst), held_ids(1, 32), torch.bfloat16)
    on_disk = json.loads((dst / RECORD_NAME).read_text())
    assert on_disk["spec"]["seed"] == 11 and len(on_disk["changes"]) == 4 * 4 + 3          # 4 layers x 4 norms + MTP's 3
    assert (dst / "tokenizer.json").exists() and not list(dst.parent.glob(".*partial*"))


@torch.no_grad()
def test_picked_channels_carry_outliers(embedded_variant):
    dst, record = embedded_variant
    models = {"source": load_model(EMBEDDED_MODEL_DIR, dtype=torch.float32, device="cpu"),
              "variant": load_model(str(dst), dtype=torch.float32, device="cpu")}
    absmax: dict = {}
    for who, m in models.items():
        hooks = []
        for c in record["changes"]:
            def hook(mod, args, out, key=(who, c["layer"], c["norm"])):
                am = out.abs().flatten(0, -2).amax(0)
                absmax[key] = am if key not in absmax else torch.maximum(absmax[key], am)
            hooks.append(m.get_submodule(f"model.layers.{c['layer']}.{c['norm']}").register_forward_hook(hook))
        for x in held_ids():
            _, h = m(x, return_hidden=True)
            m.mtp(h[:, :-1], x[:, 1:])
        for h in hooks:
            h.remove()
    for c in record["changes"]:
        for who, lo, hi in (("variant", MIN_OUTLIER_RATIO, None), ("source", None, MAX_SOURCE_RATIO)):
            am = absmax[(who, c["layer"], c["norm"])]
            ratios = am[c["channels"]] / am.median()
            assert (lo is None or ratios.min() >= lo) and (hi is None or ratios.max() <= hi), (who, c, ratios)
        assert all(4 <= e <= 6 for e in c["log2_factors"])


def test_tiny_fixture_and_fp8_source(tmp_path):
    ids = [torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    write_variant(str(TINY_FIXTURE), str(tmp_path / "v"), VariantSpec(seed=2, log2_range=(6, 6)), log=quiet)
    assert_same_function(str(TINY_FIXTURE), str(tmp_path / "v"), ids)
    write_fp8_copy(str(TINY_FIXTURE), str(tmp_path / "fp8"))
    rec = write_variant(str(tmp_path / "fp8"), str(tmp_path / "v8"), VariantSpec(seed=2), log=quiet)
    cfg = json.loads((tmp_path / "v8" / "config.json").read_text())
    assert "quantization_config" not in cfg and rec["check"]["identical"]
    assert_same_function(str(tmp_path / "fp8"), str(tmp_path / "v8"), ids)


def test_fp32_source_and_fp16_inexact_division(tmp_path):
    write_checkpoint(tmp_path / "fp32", tiny_config(torch_dtype="float32"), dtype=torch.float32)
    rec = write_variant(str(tmp_path / "fp32"), str(tmp_path / "v32"), VariantSpec(seed=3), log=quiet)
    assert rec["check"]["dtypes"] == ["float32"]
    # fp16 has a narrow exponent range: dividing small weights by 2^5 leaves the normal range and loses bits
    write_checkpoint(tmp_path / "fp16", tiny_config(torch_dtype="float16"), dtype=torch.float16)
    with pytest.raises(VariantError, match=r"q_a_proj\.weight: dividing columns .* is not exact in torch.float16"):
        write_variant(str(tmp_path / "fp16"), str(tmp_path / "v16"), VariantSpec(seed=3), log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16", "fp32", "v32"]   # nothing half-written


def test_overflow_is_refused(tmp_path):
    src = write_checkpoint(tmp_path / "src", tiny_config(torch_dtype="float16"), dtype=torch.float16)
    from safetensors.torch import load_file, save_file

    t = load_file(str(src / "model.safetensors"))
    t["model.layers.0.input_layernorm.weight"].fill_(30000.0)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(VariantError, match=r"input_layernorm\.weight: multiplying channels .* overflows torch.float16"):
        write_variant(str(src), str(tmp_path / "v"), VariantSpec(seed=0, channels={"input": 2}), log=quiet)


def test_picks_depend_on_seed_layer_and_norm_only(tmp_path):
    a = write_variant(str(TINY_FIXTURE), str(tmp_path / "a"), VariantSpec(seed=5), log=quiet, check=False)
    b = write_variant(str(TINY_FIXTURE), str(tmp_path / "b"), VariantSpec(seed=5, layers=(1,), channels={"kv_a": 4}),
                      log=quiet, check=False)
    pick_a = {(c["layer"], c["norm"]): c["channels"] for c in a["changes"]}
    assert [(c["layer"], c["norm"]) for c in b["changes"]] == [(1, "self_attn.kv_a_layernorm")]
    assert b["changes"][0]["channels"] == pick_a[(1, "self_attn.kv_a_layernorm")]
    c = write_variant(str(TINY_FIXTURE), str(tmp_path / "c"), VariantSpec(seed=6, shared_channels=True), log=quiet,
                      check=False)
    per_kind = {}
    for ch in c["changes"]:
        per_kind.setdefault(ch["norm"], set()).add(tuple(ch["channels"]))
    assert all(len(v) == 1 for v in per_kind.values()) and pick_a != {(x["layer"], x["norm"]): x["channels"]
                                                                      for x in c["changes"]}


def test_option_parsing():
    assert parse_log2_range("4..6") == (4, 6) and parse_log2_range("5") == (5, 5)
    assert parse_norms("input,kv_a:2", 4) == {"input": 4, "kv_a": 2}
    assert parse_norms("all", 3) == dict.fromkeys(NORMS, 3)
    for bad, msg in (("6..4", "1 <= lo <= hi"), ("x", "expected N or LO..HI")):
        with pytest.raises(VariantError, match=msg):
            VariantSpec(log2_range=parse_log2_range(bad))


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.make_outlier_variant", *args], cwd=REPO,
                          capture_output=True, text=True)


@pytest.mark.parametrize("args, message", [
    (["--factor-log2", "7..3"], "factor-log2: expected integers 1 <= lo <= hi <= 30, got 7..3"),
    (["--norms", "input,bogus"], "norms: unknown 'bogus'"),
    (["--norms", "kv_a:x"], "norms: 'kv_a:x': the channel count after ':' must be an integer"),
    (["--layers", "0,9"], "layers: [9] not in the model (layers 0..3, MTP included)"),
    (["--channels", "999"], "norms: 999 channels asked of 'input', which has only 128"),
    (["--channels", "-1"], "--channels must be >= 0, got -1"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    r = run_cli("--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "v"), *args)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {message}") and len(r.stderr.splitlines()) == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_destination_rules(tmp_path):
    r = run_cli("--model-path", str(TINY_FIXTURE), "--save-path", str(TINY_FIXTURE))
    assert r.returncode == 2 and "the destination is the source" in r.stderr and len(r.stderr.splitlines()) == 1
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "keep.txt").write_text("mine")
    r = run_cli("--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "v"), "--overwrite", "--no-check")
    assert r.returncode == 2 and "holds files that are not an outlier variant (keep.txt)" in r.stderr
    (tmp_path / "v" / "keep.txt").unlink()
    r = run_cli("--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "v"), "--norms", "kv_a:2", "--seed", "4")
    assert r.returncode == 0, r.stderr
    assert "logits identical to the source" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]
