"""Checkpoint reading (bf16 and FP8, sharded or not, local/file:// /memory://), FP8 block math against
brute-force references, the FP8 copy's layout, and every malformed-checkpoint error with its message."""

from __future__ import annotations

import json
import re
import shutil
import struct
import uuid

import pytest
import torch
from safetensors import safe_open

from jobs import make_fp8
from pipeline import layout
from pipeline.io import storage
from pipeline.io.checkpoint import CheckpointError, CheckpointReader
from pipeline.config import DeepseekV3Config
from pipeline.io.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks, scale_shape
from pipeline.io.release_layout.fp8_copy import assign_shards, shard_name, write_fp8_copy
from pipeline.io.safetensors_io import SafetensorsWriter, TensorSpec, read_header, save_safetensors
from tiny import TINY_FIXTURE, random_tensors, tiny_config

FIXTURE = str(TINY_FIXTURE)
FIXTURE_CONFIG = json.loads((TINY_FIXTURE / "config.json").read_text())
FP8_DTYPE = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: rounding a normal value x moves it by at most 2^-4 |x|; below the smallest
# normal (2^-6) the spacing is 2^-9, so by at most 2^-10. In weight units (x = w / s):
# |w_hat - w| <= 2^-4 |w| + 2^-10 s.
E4M3_REL, E4M3_SUBNORMAL_ABS = 2.0**-4, 2.0**-10
# Kv_lora 512 + rope 64: kv_a_proj_with_mqa is [576, 200], FP8 scale [5, 2], both edges ragged.
RAGGED_CONFIG = tiny_config(hidden_size=200, kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2,
                            vocab_size=64)
LAYER_IDS = layout.all_layer_ids(DeepseekV3Config.from_dict(FIXTURE_CONFIG))


# ----- helpers ----------------------------------------------------------------------------------------
def load_all(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def fp8_files(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a local sharded checkpoint, via safetensors' own reader."""
    index = json.loads(storage.read_bytes(storage.join(path, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_all(storage.join(path, f)))
    return out


def write_checkpoint(root: str, tensors: dict, cfg: dict = FIXTURE_CONFIG, shards: int = 1,
                     index: bool = True, key=None) -> str:
    """A checkpoint at any URL: one model.safetensors, or ``shards`` files (+ an index unless not
    ``index``); tensors laid out in ``sorted(names, key=key)`` order."""
    storage.write_bytes(storage.join(root, "config.json"), json.dumps(cfg).encode())
    names = sorted(tensors, key=key)
    if shards == 1:
        save_safetensors({n: tensors[n] for n in names}, storage.join(root, "model.safetensors"))
        return root
    weight_map = {}
    for k, chunk in enumerate([names[i::shards] for i in range(shards)]):
        fname = shard_name(k + 1, shards)
        save_safetensors({n: tensors[n] for n in chunk}, storage.join(root, fname))
        weight_map.update({n: fname for n in chunk})
    if index:
        storage.write_bytes(storage.join(root, "model.safetensors.index.json"),
                            json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    return root


def mutated(tmp_path, change, shards: int = 1) -> str:
    """A copy of the fixture with ``change(tensors)`` applied."""
    tensors = load_all(f"{FIXTURE}/model.safetensors")
    change(tensors)
    return write_checkpoint(str(tmp_path / "ckpt"), tensors, shards=shards)


def dequant_reference(q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """W[i, j] = float(Wq[i, j]) * s[i // b0, j // b1], element by element (exact in float64, one
    rounding to float32: the same as torch's fp32 product)."""
    qf, sf = q.float().tolist(), s.float().tolist()
    rows = [[qf[i][j] * sf[i // block[0]][j // block[1]] for j in range(q.shape[1])] for i in range(q.shape[0])]
    return torch.tensor(rows, dtype=torch.float64).float()


def names_both(file: str, tensor: str) -> str:
    return f"{re.escape(file)}.*{re.escape(tensor)}"


@pytest.fixture
def mem_root():
    root = f"memory://ckpt-{uuid.uuid4().hex}"
    yield root
    fs, p = storage.filesystem(root)
    if fs.exists(p):
        fs.rm(p, recursive=True)


@pytest.fixture(scope="module")
def fp8_copy(tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("fp8") / "fixture-fp8")
    write_fp8_copy(FIXTURE, dst, shards=3)
    return dst


# ----- bf16 reads -------------------------------------------------------------------------------------
def test_read_layer_and_globals_equal_safe_open():
    r = CheckpointReader(FIXTURE)
    ref = load_all(f"{FIXTURE}/model.safetensors")
    assert r.files == [f"{FIXTURE}/model.safetensors"] and r.tensor_names() == sorted(ref)
    assert r.header("model.layers.0.self_attn.q_a_proj.weight") == ("BF16", (64, 128))
    got = r.read_globals()
    for i in LAYER_IDS:
        got.update(r.read_layer(i))
    assert sorted(got) == sorted(ref)
    for name, t in got.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name


def test_dtype_cast_keeps_router_bias_fp32():
    r = CheckpointReader(FIXTURE)
    layer = r.read_layer(1, dtype=torch.float16)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert layer[bias].dtype == torch.float32 and layer["model.layers.1.mlp.gate.weight"].dtype == torch.float16
    assert r.read_tensor(bias, dtype=torch.bfloat16).dtype == torch.float32
    assert r.read_tensor(bias, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="floating-point"):
        r.read_layer(1, dtype=torch.int8)


def test_reading_a_layer_reads_only_its_bytes(monkeypatch, tmp_path):
    # Layers interleaved in each file (ordered by the tensor's own name first): reads must skip the gaps.
    root = write_checkpoint(str(tmp_path / "sharded"), load_all(f"{FIXTURE}/model.safetensors"), shards=4,
                            key=lambda n: (n.split(".")[3:], n))
    r = CheckpointReader(root)
    reads: list[tuple[str, int, int]] = []
    real = storage.read_range
    monkeypatch.setattr(storage, "read_range", lambda p, s, e: reads.append((p, s, e)) or real(p, s, e))
    r.read_layer(2)
    mine = {n: read_header(r.file_of(n)).tensors[n] for n in r.tensor_names() if layout.layer_of(n) == 2}
    for path, start, end in reads:
        if start in (0, 8):  # the length and the JSON header
            continue
        inside = sorted((i.start, i.end) for n, i in mine.items() if r.file_of(n) == path)
        pos = start  # [start, end) must be back-to-back tensors of layer 2
        for a, b in inside:
            pos = b if a == pos and b <= end else pos
        assert pos == end, (path, start, end)
    assert {p for p, s, _ in reads if s not in (0, 8)} == {r.file_of(n) for n in mine}


def test_sharded_index_and_plain_shards_equal_single_file(tmp_path, mem_root):
    tensors = load_all(f"{FIXTURE}/model.safetensors")
    single = CheckpointReader(write_checkpoint(str(tmp_path / "single"), tensors))
    sharded = CheckpointReader(write_checkpoint(mem_root, tensors, shards=4))
    globbed = CheckpointReader(write_checkpoint(str(tmp_path / "noindex"), tensors, shards=3, index=False))
    assert len(sharded.files) == 4 and len(globbed.files) == 3
    for i in LAYER_IDS:
        a, b, c = single.read_layer(i), sharded.read_layer(i), globbed.read_layer(i)
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[n], b[n]) and torch.equal(a[n], c[n]) for n in a)
    assert all(torch.equal(single.read_globals()[n], sharded.read_globals()[n]) for n in single.read_globals())


def test_file_url(fp8_copy):
    by_path, by_url = CheckpointReader(fp8_copy), CheckpointReader("file://" + fp8_copy)
    assert by_url.config == by_path.config
    a, b = by_path.read_layer(2), by_url.read_layer(2)
    assert all(torch.equal(a[n], b[n]) for n in a)


# ----- FP8 math ---------------------------------------------------------------------------------------
def test_ragged_dequant_equals_elementwise_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 300, generator=g)
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and tuple(s.shape) == (5, 3)
    assert torch.equal(dequantize_fp8_blocks(q, s, dtype=torch.float32), dequant_reference(q, s))
    assert torch.equal(dequantize_fp8_blocks(q, s), dequant_reference(q, s).bfloat16())


def test_quantize_convention_and_error_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 260, generator=g) * 0.02
    w[128:256, 128:256] = 0  # an all-zero block
    q, s = quantize_fp8_blocks(w)
    for bi in range(3):
        for bj in range(3):
            blk = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            qb = q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].float()
            amax = blk.abs().max()
            assert s[bi, bj] == (amax / 448 if amax > 0 else 1.0)
            assert qb.abs().max() == (448 if amax > 0 else 0)
    err = (dequantize_fp8_blocks(q, s, dtype=torch.float32) - w).abs()
    bound = E4M3_REL * w.abs() + E4M3_SUBNORMAL_ABS * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert bool((err <= bound).all())


def test_dequant_rejects_bad_scale_shape():
    q = torch.zeros(576, 300, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match=r"'kv_a'.*scale_inv shape \[4, 3\].*expected \[5, 3\]"):
        dequantize_fp8_blocks(q, torch.ones(4, 3), name="kv_a")
    assert scale_shape((576, 7168)) == (5, 56)


def test_assign_shards_uses_every_shard_in_order():
    for sizes, n in [([10, 1, 1, 1], 3), ([1] * 7, 7), ([5, 5, 100, 5], 2), ([0, 0, 3], 2)]:
        got = assign_shards(sizes, n)
        assert got[0] == 0 and got[-1] == n - 1 and all(0 <= b - a <= 1 for a, b in zip(got, got[1:]))
    with pytest.raises(ValueError, match="cannot split"):
        assign_shards([1, 2], 3)


# ----- the FP8 copy -----------------------------------------------------------------------------------
def test_fp8_copy_layout(fp8_copy):
    src = load_all(f"{FIXTURE}/model.safetensors")
    out = fp8_files(fp8_copy)
    index = json.loads(storage.read_bytes(f"{fp8_copy}/model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == [shard_name(k, 3) for k in (1, 2, 3)]
    assert shard_name(1, 163) == "model-00001-of-000163.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.itemsize for t in out.values())
    assert set(index["weight_map"]) == set(out)
    for name, t in src.items():
        if layout.is_fp8_quantizable(name):
            assert out[name].dtype == FP8_DTYPE and out[name].shape == t.shape
            scale = out[name + "_scale_inv"]
            assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(t.shape)
        else:
            assert torch.equal(out[name], t) and out[name].dtype == t.dtype, name
    assert sum(layout.is_fp8_quantizable(n) for n in src) * 2 + sum(not layout.is_fp8_quantizable(n) for n in src) \
        == len(out)
    cfg = json.loads(storage.read_bytes(f"{fp8_copy}/config.json"))
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == FIXTURE_CONFIG
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert storage.read_bytes(f"{fp8_copy}/{f}") == storage.read_bytes(f"{FIXTURE}/{f}")


def test_fp8_reads_equal_dequantized_bytes_and_stay_close_to_bf16(fp8_copy):
    r, raw, src = CheckpointReader(fp8_copy), fp8_files(fp8_copy), load_all(f"{FIXTURE}/model.safetensors")
    assert r.config.fp8_block_size == (128, 128)
    for i in LAYER_IDS:
        exact, default = r.read_layer(i, dtype=torch.float32), r.read_layer(i)
        assert not any(n.endswith("_scale_inv") for n in exact)
        for name, t in exact.items():
            if not layout.is_fp8_quantizable(name):
                assert torch.equal(default[name], src[name])
                continue
            q, s = raw[name], raw[name + "_scale_inv"]
            ref = dequant_reference(q, s)
            assert torch.equal(t, ref), name
            assert default[name].dtype == torch.bfloat16 and torch.equal(default[name], ref.bfloat16()), name
            w = src[name].float()
            s_full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            assert bool(((t - w).abs() <= E4M3_REL * w.abs() + E4M3_SUBNORMAL_ABS * s_full).all()), name


def test_fp8_copy_of_fp8_is_bit_identical_and_cli(fp8_copy, tmp_path, mem_root, capsys):
    assert make_fp8.main(["--src", fp8_copy, "--dst", mem_root, "--shards", "2"]) == 0
    assert "in 2 shards" in capsys.readouterr().out
    again = str(tmp_path / "again")
    write_fp8_copy(mem_root, again, shards=1)
    a, b = fp8_files(fp8_copy), fp8_files(again)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_ragged_checkpoint_fp8_round_trip(tmp_path):
    cfg = DeepseekV3Config.from_dict(RAGGED_CONFIG)
    src = write_checkpoint(str(tmp_path / "src"), random_tensors(cfg), cfg=RAGGED_CONFIG)
    dst = str(tmp_path / "fp8")
    write_fp8_copy(src, dst)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    r = CheckpointReader(dst)
    assert r.header(name) == ("F8_E4M3", (576, 200)) and r.header(name + "_scale_inv") == ("F32", (5, 2))
    raw = fp8_files(dst)
    assert torch.equal(r.read_layer(0, dtype=torch.float32)[name], dequant_reference(raw[name], raw[name + "_scale_inv"]))


# ----- the writer -------------------------------------------------------------------------------------
def test_save_safetensors_round_trips_through_safe_open(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5), "f16": torch.randn(7).half(), "bf16": torch.randn(2, 3).bfloat16(),
        "f8": torch.randn(4, 4).to(FP8_DTYPE), "f64": torch.randn(3).double(), "i8": torch.arange(-3, 3, dtype=torch.int8),
        "i16": torch.arange(5, dtype=torch.int16), "i32": torch.arange(6, dtype=torch.int32).view(2, 3),
        "i64": torch.tensor(7), "u8": torch.arange(9, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }
    path = str(tmp_path / "all.safetensors")
    save_safetensors(tensors, path, metadata={"format": "pt"})
    assert (8 + struct.unpack("<Q", open(path, "rb").read(8))[0]) % 8 == 0
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape, k
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


def test_failed_write_leaves_nothing(tmp_path):
    path = str(tmp_path / "out" / "x.safetensors")
    specs = [TensorSpec("a", "F32", (2,)), TensorSpec("b", "F32", (3,))]
    with pytest.raises(ValueError, match="expected tensor"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", torch.zeros(2))
            w.write("b", torch.zeros(4))
    with pytest.raises(ValueError, match="never written"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", torch.zeros(2))
    assert list((tmp_path / "out").iterdir()) == []


# ----- errors -----------------------------------------------------------------------------------------
def _fp8_variant(tmp_path, fp8_copy, change) -> tuple[str, str]:
    """A copy of the FP8 checkpoint whose shard holding layer 0's q_a_proj is rewritten by ``change``."""
    dst = str(tmp_path / "fp8")
    shutil.copytree(fp8_copy, dst)
    r = CheckpointReader(dst)
    shard = r.file_of("model.layers.0.self_attn.q_a_proj.weight")
    tensors = load_all(shard)
    change(tensors)
    save_safetensors(tensors, shard)
    return dst, shard


def test_missing_and_misshapen_scale_inv(tmp_path, fp8_copy):
    name = "model.layers.0.self_attn.q_a_proj.weight"
    dst, shard = _fp8_variant(tmp_path / "a", fp8_copy, lambda t: t.pop(name + "_scale_inv"))
    (tmp_path / "a" / "fp8" / "model.safetensors.index.json").unlink()  # found by globbing instead
    with pytest.raises(CheckpointError, match=names_both(shard, name) + ".*scale tensor.*missing"):
        CheckpointReader(dst).read_layer(0)
    dst, shard = _fp8_variant(tmp_path / "b", fp8_copy, lambda t: t.update({name + "_scale_inv": torch.ones(2, 1)}))
    with pytest.raises(CheckpointError, match=names_both(shard, name + "_scale_inv") + r".*expected float \[1, 1\]"):
        CheckpointReader(dst).read_tensor(name)


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    root = mutated(tmp_path / "a", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=names_both(root, name) + ".*missing"):
        CheckpointReader(root).read_layer(2)
    CheckpointReader(root).read_layer(1)  # other layers still read
    root = mutated(tmp_path / "b", lambda t: t.update({name: torch.zeros(128, 40, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=names_both(f"{root}/model.safetensors", name)
                       + re.escape("': shape [128, 40] does not match the config (expected [128, 48])")):
        CheckpointReader(root).read_layer(2)
    extra = "model.layers.2.self_attn.k_proj.weight"
    root = mutated(tmp_path / "c", lambda t: t.update({extra: torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=names_both(f"{root}/model.safetensors", extra) + ".*not part of layer 2"):
        CheckpointReader(root).read_layer(2)
    root = mutated(tmp_path / "d", lambda t: t.update({"model.layers.9.x.weight": torch.zeros(2),
                                                       "model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"model\.extra\.weight.*not part of the globals.*model\.layers\.9"):
        CheckpointReader(root).read_globals()
    with pytest.raises(CheckpointError, match="layer 9 is not in the config"):
        CheckpointReader(root).read_layer(9)


def test_nan_and_inf_weights(tmp_path, fp8_copy):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def poison(value):
        def change(t):
            t[name] = t[name].clone()
            t[name][5, 7] = value
        return change
    for k, (value, counts) in enumerate([(float("nan"), "1 NaN and 0 Inf"), (float("inf"), "0 NaN and 1 Inf")]):
        root = mutated(tmp_path / str(k), poison(value))
        with pytest.raises(CheckpointError, match=names_both(f"{root}/model.safetensors", name) + "': " + counts):
            CheckpointReader(root).read_layer(1)
    fp8_name = "model.layers.0.self_attn.q_a_proj.weight"
    dst, shard = _fp8_variant(tmp_path / "f8", fp8_copy, lambda t: t[fp8_name].view(torch.uint8).__setitem__((0, 0), 0x7F))
    with pytest.raises(CheckpointError, match=names_both(shard, fp8_name) + "': 1 NaN"):
        CheckpointReader(dst).read_layer(0)
    dst, shard = _fp8_variant(tmp_path / "sc", fp8_copy,
                              lambda t: t[fp8_name + "_scale_inv"].__setitem__((0, 0), float("inf")))
    with pytest.raises(CheckpointError, match=names_both(shard, fp8_name + "_scale_inv") + "': 0 NaN and 1 Inf"):
        CheckpointReader(dst).read_tensor(fp8_name)


def test_truncated_files(tmp_path):
    root = mutated(tmp_path, lambda t: None)
    path = f"{root}/model.safetensors"
    data = open(path, "rb").read()
    r = CheckpointReader(root)  # header parsed while the file is whole
    open(path, "wb").write(data[:-100])
    with pytest.raises(CheckpointError, match=re.escape(path) + r": tensor '.*': truncated file: read"):
        r.read_globals()
    with pytest.raises(CheckpointError, match=re.escape(path) + r": tensor 'model\.norm\.weight': truncated file: data ends"):
        CheckpointReader(root)
    open(path, "wb").write(data[:5])
    with pytest.raises(CheckpointError, match=re.escape(path) + ": truncated: 5 bytes"):
        CheckpointReader(root)


def _raw_file(path, header: bytes, n: int | None = None, data: bytes = b"\0" * 64):
    open(path, "wb").write(struct.pack("<Q", len(header) if n is None else n) + header + data)


@pytest.mark.parametrize("header, n, message", [
    (b"{not json", None, "corrupt header: not valid JSON"),
    (b"{}", 10_000, "corrupt header: header length 10000 is impossible for a file of 74 bytes"),
    (b"[1, 2]", None, "corrupt header: expected a JSON object"),
    (json.dumps({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}).encode(), None,
     "tensor 'w': unknown dtype 'Q4'"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode(), None, "tensor 'w': corrupt header: entry needs"),
    (json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode(), None,
     r"tensor 'w': corrupt header: 8 bytes for F32 \[3\] \(expected 12\)"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode(), None,
     "tensor 'v' overlaps tensor 'w'"),
])
def test_corrupt_headers(tmp_path, header, n, message):
    (tmp_path / "config.json").write_text(json.dumps(FIXTURE_CONFIG))
    path = tmp_path / "model.safetensors"
    _raw_file(path, header, n)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*" + message):
        CheckpointReader(str(tmp_path))


def test_pickles_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FIXTURE_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*refused.*arbitrary code"):
        CheckpointReader(str(tmp_path))
    with pytest.raises(CheckpointError, match="refused"):
        CheckpointReader(str(tmp_path / "pytorch_model.bin"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.bin"}}))
    with pytest.raises(CheckpointError, match=r"index\.json.*model-1\.bin.*refused"):
        CheckpointReader(str(tmp_path))


def test_index_errors(tmp_path):
    root = write_checkpoint(str(tmp_path / "ckpt"), load_all(f"{FIXTURE}/model.safetensors"), shards=2)
    index_path = f"{root}/model.safetensors.index.json"
    index = json.loads(open(index_path).read())
    r = CheckpointReader(root)
    index["weight_map"]["model.norm.weight"] = "model-00009-of-000009.safetensors"
    open(index_path, "w").write(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(index_path) + r".*'model\.norm\.weight'.*"
                       + re.escape(f"{root}/model-00009-of-000009.safetensors") + ", which does not exist"):
        CheckpointReader(root)
    index["weight_map"]["model.norm.weight"] = next(f for f in (shard_name(1, 2), shard_name(2, 2))
                                                    if f != r.file_of("model.norm.weight").rsplit("/", 1)[1])
    open(index_path, "w").write(json.dumps(index))
    wrong = f"{root}/{index['weight_map']['model.norm.weight']}"
    with pytest.raises(CheckpointError, match=re.escape(wrong) + r": tensor 'model\.norm\.weight' is not in the file"):
        CheckpointReader(root).read_globals()
    open(index_path, "w").write("{oops")
    with pytest.raises(CheckpointError, match=re.escape(index_path) + ": not valid JSON"):
        CheckpointReader(root)
    (tmp_path / "ckpt" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        CheckpointReader(root)
