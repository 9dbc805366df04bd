"""QuantizedWriter: dialect names, sharding, index, manifest, crash safety, memory://, and the description
builder reproducing msModelSlim's file byte for byte."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest
import torch

from pipeline import layout
from pipeline.io import storage
from pipeline.config import DeepseekV3Config
from pipeline.io import safetensors_io as writer_mod  # SafetensorsWriter, patched below
from pipeline.format.checker import check_dir
from pipeline.format.description import (
    ASCEND_V1, DESCRIPTION_NAME, MANIFEST_NAME, NAMING, SEED, build_description, detect_dialect, encode_description,
    parse_description,
)
from pipeline.quant.writing.writer import QuantizedWriter, build_config, to_dialect
from pipeline.io.safetensors_io import read_header
from tests.test_checker import find
from tests.tiny import FIXTURES, TINY_FIXTURE

FIXTURE_V1 = FIXTURES / "msmodelslim-v1-bf16"
SMALL_SHARD = 200_000  # bytes of tensor data: the tiny model (~1.4 MB) spans several shards
STATIC = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


def _cfg_dict() -> dict:
    return json.loads((TINY_FIXTURE / "config.json").read_text())


def _linear(name: str, n: int, k: int, kind: str, md: torch.dtype, g: torch.Generator) -> tuple[dict, dict]:
    """One quantized linear in the canonical (seed) form, random values of the right dtypes and shapes."""
    p = name[: -len(".weight")]
    t = {name: torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
         f"{p}.weight_scale": (torch.rand(n, 1, generator=g) / 127).to(md),
         f"{p}.weight_offset": torch.zeros(n, 1, dtype=md)}
    if kind == "W8A8":
        deq = torch.rand(n, generator=g) * 1e-4
        t.update({f"{p}.input_scale": torch.tensor([0.02], dtype=md),
                  f"{p}.input_offset": torch.tensor([-3.0], dtype=md),
                  f"{p}.quant_bias": torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32),
                  f"{p}.deq_scale": deq.view(torch.int32).to(torch.int64) if md == torch.float16 else deq})
    return t, dict.fromkeys(t, kind)


def synthetic_model(md: torch.dtype = torch.bfloat16, seed: int = 0) -> list[tuple[dict, dict]]:
    """(tensors, types) per unit (each layer, MTP included, then the globals) for the tiny fixture config:
    static W8A8 attention but kv_b_proj, W8A8_DYNAMIC MLP but the router, FA3 on every layer."""
    cfg = DeepseekV3Config.from_dict(_cfg_dict())
    g = torch.Generator().manual_seed(seed)
    units = []
    for lid in layout.all_layer_ids(cfg):
        tensors, types = {}, {}
        for name, shape in layout.layer_shapes(cfg, lid).items():
            module = name.rpartition(".")[0].rpartition(".")[2]
            kind = "W8A8" if module in STATIC else \
                "W8A8_DYNAMIC" if ".mlp." in name and module.endswith("_proj") else None
            if kind:
                t, y = _linear(name, *shape, kind, md, g)
            else:
                dt = torch.float32 if name.endswith("e_score_correction_bias") else md
                t, y = {name: torch.randn(shape, generator=g).to(dt)}, {name: "FLOAT"}
            tensors.update(t)
            types.update(y)
        attn = f"model.layers.{lid}.self_attn."
        for x, rows in (("q", cfg.num_attention_heads), ("k", 1), ("v", 1)):
            tensors[f"{attn}fa_{x}.scale"] = (torch.rand(rows, 1, generator=g) + 0.01).to(md)
            tensors[f"{attn}fa_{x}.offset"] = torch.zeros(rows, 1, dtype=torch.int8)
            types[f"{attn}fa_{x}.scale"] = types[f"{attn}fa_{x}.offset"] = "FAQuant"
        units.append((tensors, types))
    glob = {n: torch.randn(s, generator=g).to(md) for n, s in layout.global_shapes(cfg).items()}
    units.append((glob, dict.fromkeys(glob, "FLOAT")))
    return units


def write_model(dst: str, dialect: str, shard_bytes: int = SMALL_SHARD, md=torch.bfloat16, one_unit: bool = False,
                **finish) -> dict:
    """The synthetic model through a QuantizedWriter, one add() per layer (``one_unit``: all in one)."""
    config = {**_cfg_dict(), "torch_dtype": str(md).removeprefix("torch.")}
    units = synthetic_model(md)
    if one_unit:
        units = [({n: t for ts, _ in units for n, t in ts.items()}, {n: y for _, ys in units for n, y in ys.items()})]
    with QuantizedWriter(dst, dialect, model_dtype=md, shard_bytes=shard_bytes) as w:
        for tensors, types in units:
            w.add(tensors, types)
        return w.finish(config, str(TINY_FIXTURE), **finish)


def _names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


# ----- writing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", [SEED, ASCEND_V1])
def test_sharded_output_is_complete_and_passes_the_checker(tmp_path, dialect):
    manifest = write_model(str(tmp_path), dialect, job={"run": "test"})
    naming = NAMING[dialect]
    shards = sorted(f for f in _names(tmp_path) if f.endswith(".safetensors"))
    n = len(shards)
    assert n >= 4 and shards == [naming.shard_name(i, n) for i in range(1, n + 1)]
    assert not [f for f in _names(tmp_path) if f.startswith(".")]  # no part or temporary left

    index = json.loads((tmp_path / naming.index_name).read_text())
    held = {}
    for f in shards:
        header = read_header(str(tmp_path / f))
        data = sum(i.end - i.start for i in header.tensors.values())
        assert data <= SMALL_SHARD or len(header.tensors) == 1  # only a tensor alone passes the limit
        for name in header.tensors:
            assert name not in held
            held[name] = f
    assert index["weight_map"] == held  # every tensor exactly once, at its file
    assert index["metadata"]["total_size"] == manifest["total_size"]

    desc = json.loads((tmp_path / DESCRIPTION_NAME).read_text())
    assert set(parse_description(desc).tensors) == set(held)
    report = check_dir(str(tmp_path))
    assert report.dialect == dialect and report.ok, report.to_text()
    assert report.fa_layers == [0, 1, 2, 3]

    assert manifest["job"] == {"run": "test"} and manifest["dialect"] == dialect
    on_disk = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert on_disk == manifest
    assert set(manifest["files"]) == _names(tmp_path) - {MANIFEST_NAME}
    for name, entry in manifest["files"].items():
        data = (tmp_path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert (tmp_path / "tokenizer.json").read_bytes() == (TINY_FIXTURE / "tokenizer.json").read_bytes()


def test_a_shard_never_spans_two_units(tmp_path):
    """Shards close at every add(): 5 units (4 layers, globals) under a limit that would hold them all."""
    write_model(str(tmp_path), SEED, shard_bytes=2**30)
    index = json.loads((tmp_path / NAMING[SEED].index_name).read_text())["weight_map"]
    unit_of = {n: n.split(".")[2] if n.startswith("model.layers.") else "globals" for n in index}
    files = {f: {unit_of[n] for n, g in index.items() if g == f} for f in set(index.values())}
    assert len(files) == 5 and all(len(units) == 1 for units in files.values())


def test_one_shard_names(tmp_path):
    write_model(str(tmp_path / "s"), SEED, shard_bytes=2**30, one_unit=True)
    assert {f for f in _names(tmp_path / "s") if "quant_model" in f} == {
        "quant_model_weight_w8a8.safetensors", DESCRIPTION_NAME}  # seed: one file, no index
    write_model(str(tmp_path / "v"), ASCEND_V1, shard_bytes=2**30, one_unit=True)
    assert {f for f in _names(tmp_path / "v") if "quant_model" in f} == {  # ascendV1: as the fixture
        "quant_model_weights-00001-of-00001.safetensors", "quant_model_weights.safetensors.index.json",
        DESCRIPTION_NAME}
    for d in ("s", "v"):
        assert check_dir(str(tmp_path / d)).ok


def test_dialect_dtypes_and_siblings(tmp_path):
    write_model(str(tmp_path), ASCEND_V1)
    desc = json.loads((tmp_path / DESCRIPTION_NAME).read_text())
    assert "model.layers.0.self_attn.q_a_proj.weight_scale" not in desc
    assert desc["model.layers.0.self_attn.quant_type"] == "INT8" and desc["model_quant_type"] == "W8A8"
    assert list(desc)[-6:] == ["fa_quant_type", "version", "model_quant_type", "metadata", "group_size", "optional"]
    fixture = json.loads((FIXTURE_V1 / DESCRIPTION_NAME).read_text())
    assert set(desc) == set(fixture)  # the same key set as msModelSlim's for the same model


def test_ascend_v1_form_input_gives_the_same_output(tmp_path):
    """Layers already in ascendV1's form (as quantize_layer makes them for that dialect, with the
    per-layer quant_type entry in types) are written exactly as the canonical form is."""
    write_model(str(tmp_path / "a"), ASCEND_V1)
    with QuantizedWriter(str(tmp_path / "b"), ASCEND_V1, model_dtype=torch.bfloat16, shard_bytes=SMALL_SHARD) as w:
        for lid, (tensors, types) in enumerate(synthetic_model()):
            conv, conv_types = to_dialect(tensors, types, ASCEND_V1, torch.bfloat16)
            if lid < 4:
                conv_types[f"model.layers.{lid}.self_attn.quant_type"] = "INT8"
            w.add(conv, conv_types)
        w.finish(_cfg_dict(), str(TINY_FIXTURE))
    for f in _names(tmp_path / "a") - {MANIFEST_NAME}:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_fp16_deq_scale_is_int64(tmp_path):
    write_model(str(tmp_path), SEED, shard_bytes=2**30, md=torch.float16, one_unit=True)
    header = read_header(str(tmp_path / "quant_model_weight_w8a8.safetensors"))
    assert header.tensors["model.layers.0.self_attn.o_proj.deq_scale"].dtype == "I64"
    assert header.tensors["model.layers.0.self_attn.o_proj.input_scale"].dtype == "F16"
    assert check_dir(str(tmp_path)).ok
    with pytest.raises(ValueError, match="torch_dtype 'bfloat16' but the tensors were written for torch.float16"):
        with QuantizedWriter(str(tmp_path / "again"), SEED, model_dtype=torch.float16) as w:
            w.add(*synthetic_model(torch.float16)[0])
            w.finish(_cfg_dict())


def test_memory_url():
    dst = f"memory://quant-{uuid.uuid4().hex[:8]}/out"
    write_model(dst, SEED)
    assert storage.exists(storage.join(dst, DESCRIPTION_NAME))
    report = check_dir(dst)
    assert report.ok, report.to_text()


def test_our_seed_output_fails_ascend_v1_rules(tmp_path):
    """The checker holds our output to the other dialect's rules too, naming the differences."""
    write_model(str(tmp_path), SEED, shard_bytes=2**30, one_unit=True)
    report = check_dir(str(tmp_path), dialect=ASCEND_V1)
    find(report, "siblings", "model.layers.0.self_attn.o_proj", "unexpected weight_scale, weight_offset .*ascendV1 "
                                                                  "writes no weight_scale")
    find(report, "file-names", "quant_model_weight_w8a8.safetensors", "not a weight file name of the ascendV1 dialect")
    find(report, "top-level-keys", DESCRIPTION_NAME, "missing: version, metadata, group_size, optional")
    find(report, "layer-quant-type", "model.layers.0.self_attn.quant_type", "is None")


# ----- crash safety ------------------------------------------------------------------------------------
def _assert_nothing_final(path: Path) -> None:
    names = _names(path) if path.exists() else set()
    assert not names & {DESCRIPTION_NAME, MANIFEST_NAME, "config.json"}
    assert not [f for f in names if f.endswith((".safetensors", ".index.json")) and not f.startswith(".")], names


def test_exception_in_add_leaves_nothing_final(tmp_path):
    units = synthetic_model()
    with pytest.raises(KeyboardInterrupt):
        with QuantizedWriter(str(tmp_path), SEED, model_dtype=torch.bfloat16, shard_bytes=SMALL_SHARD) as w:
            for k, (tensors, types) in enumerate(units):
                w.add(tensors, types)
                if k == 2:
                    raise KeyboardInterrupt  # the job dies mid-write
    _assert_nothing_final(tmp_path)
    assert not [f for f in _names(tmp_path) if f.startswith(".")]  # parts removed on the way out


@pytest.mark.parametrize("background", [False, True])
def test_failure_while_writing_a_shard(tmp_path, monkeypatch, background):
    """Without the writer thread the failing add() raises; with it, a later add() or finish() does."""
    calls = []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 300:
            raise OSError("disk full")
        return original(self, name, tensor)

    original = writer_mod.SafetensorsWriter.write
    monkeypatch.setattr(writer_mod.SafetensorsWriter, "write", failing_write)
    w = QuantizedWriter(str(tmp_path), SEED, model_dtype=torch.bfloat16, shard_bytes=SMALL_SHARD,
                        background=background)
    with pytest.raises(OSError, match="disk full"):
        for tensors, types in synthetic_model():
            w.add(tensors, types)
        w.finish(_cfg_dict())
    _assert_nothing_final(tmp_path)  # earlier shards exist only under hidden part names
    assert [f for f in _names(tmp_path) if f.startswith(".")]
    with pytest.raises(RuntimeError, match="failed"):
        w.finish(_cfg_dict())
    w.abort()
    assert _names(tmp_path) == set()


def test_with_block_without_finish_removes_output(tmp_path):
    with pytest.raises(RuntimeError, match="without finish"):
        with QuantizedWriter(str(tmp_path), SEED, model_dtype=torch.bfloat16) as w:
            w.add(*synthetic_model()[0])
    _assert_nothing_final(tmp_path)


def test_abort_after_finish_keeps_the_output(tmp_path):
    w = QuantizedWriter(str(tmp_path), SEED, model_dtype=torch.bfloat16)
    for tensors, types in synthetic_model():
        w.add(tensors, types)
    w.finish(_cfg_dict())
    w.abort()
    assert check_dir(str(tmp_path)).ok


def test_existing_output_needs_overwrite(tmp_path):
    write_model(str(tmp_path), ASCEND_V1)
    before = _names(tmp_path)
    with pytest.raises(FileExistsError, match="already holds quantized output .* use --overwrite"):
        QuantizedWriter(str(tmp_path), SEED, model_dtype=torch.bfloat16)
    w = QuantizedWriter(str(tmp_path), SEED, model_dtype=torch.bfloat16, overwrite=True)
    for tensors, types in synthetic_model():
        w.add(tensors, types)
    w._wait()
    assert before <= _names(tmp_path)  # the old output stays while the new one is written
    w.abort()
    assert _names(tmp_path) == before and check_dir(str(tmp_path)).ok  # and after a failed one


# ----- refusals ----------------------------------------------------------------------------------------
def test_add_refuses_broken_layers():
    w = QuantizedWriter(f"memory://refuse-{uuid.uuid4().hex[:8]}", SEED, model_dtype=torch.bfloat16)
    tensors, types = synthetic_model()[0]
    with pytest.raises(ValueError, match="tensors without a type"):
        w.add(tensors, {k: v for k, v in types.items() if not k.endswith("deq_scale")})
    bad = dict(tensors)
    bad.update(_linear("model.layers.0.self_attn.kv_b_proj.weight", 128, 48, "W8A8", torch.bfloat16,
                       torch.Generator().manual_seed(1))[0])
    bad_types = {**types, **dict.fromkeys([k for k in bad if "kv_b_proj" in k], "W8A8")}
    with pytest.raises(ValueError, match="kv_b_proj.weight: is W8A8 but must be FLOAT"):
        w.add(bad, bad_types)
    no_ws = {k: v for k, v in tensors.items() if not k.endswith("o_proj.weight_scale")}
    with pytest.raises(ValueError, match="o_proj: W8A8 layer lacks weight_scale"):
        w.add(no_ws, {k: types[k] for k in no_ws})
    w.add(tensors, types)
    with pytest.raises(ValueError, match="already added"):
        w.add(tensors, types)
    w.abort()


def test_to_dialect_is_idempotent():
    tensors, types = synthetic_model()[-2]  # the MTP layer
    once = to_dialect(tensors, types, ASCEND_V1, "bfloat16")
    twice = to_dialect(*once, ASCEND_V1, "bfloat16")
    assert once[1] == twice[1] and all(torch.equal(once[0][k], twice[0][k]) for k in once[0])
    assert once[0]["model.layers.3.eh_proj.weight"].dtype == torch.float32  # MTP-only FLOAT: float32
    assert once[0]["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16  # router: md


def test_build_config():
    src = {**_cfg_dict(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    types = {n: t for _, y in synthetic_model() for n, t in y.items()}
    plain = build_config(src, types)
    assert "quantization_config" not in plain and plain["model_type"] == "deepseek_v3"
    mindie = build_config(src, types, mindie_format=True)
    assert (mindie["quantize"], mindie["mla_quantize"], mindie["model_type"]) == ("w8a8_dynamic", "w8a8", "deepseekv2")
    assert mindie["quantization_config"] == {"fa_quant_type": "FAKQuant"}
    assert src["quantization_config"]["quant_method"] == "fp8"  # the caller's dict is untouched


# ----- the description -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["msmodelslim-v1-bf16", "msmodelslim-v1-fp16"])
def test_description_reproduces_msmodelslim_byte_for_byte(fixture):
    data = (FIXTURES / fixture / DESCRIPTION_NAME).read_bytes()
    types = dict(parse_description(json.loads(data)).tensors)
    assert encode_description(build_description(types, True, ASCEND_V1)) == data


def test_description_seed_and_refusals():
    types = {"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC", "model.norm.weight": "FLOAT"}
    assert build_description(types, False, SEED) == {"model_quant_type": "W8A8_DYNAMIC", **types}
    with pytest.raises(ValueError, match="fa_quant=True but FAQuant tensors are absent"):
        build_description(types, True, SEED)
    with pytest.raises(ValueError, match="unknown tensor types"):
        build_description({"x.weight": "W4A8"}, False, SEED)
    with pytest.raises(ValueError, match="unknown dialect"):
        build_description(types, False, "mindie")
    assert detect_dialect(None, ["quant_model_weights-00001-of-00001.safetensors"]) == ASCEND_V1
    assert detect_dialect({"model_quant_type": "W8A8", "group_size": 0}, []) == ASCEND_V1
    assert detect_dialect({"model_quant_type": "W8A8"}, ["quant_model_weight_w8a8.safetensors"]) == SEED
