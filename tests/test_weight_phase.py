"""The weight phase's fast paths against their plain formulas: FP8 block dequantization bit for bit, the
one-pass finiteness checks, the reader's and the quantizer's output specs, and quantize_weights (planned
streaming writer, background prefetch) against the plain loop into a queuing writer, byte for byte. The
per-channel quantizer and its native kernels: test_weight_quantizer.py."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import layout
from pipeline.io.checkpoint import CheckpointError, CheckpointReader
from pipeline.io.finite import all_finite
from pipeline.io.fp8 import FP8_DTYPE, BlockRows, dequantize_fp8_blocks, expand_scale, fp8_nan_count, quantize_fp8_blocks
from pipeline.io.release_layout.fp8_copy import write_fp8_copy
from pipeline.quant.writing.quantize_layer import (
    deferred_weights, model_dtype, quantize_globals, quantize_layer, quantize_layer_pieces,
)
from pipeline.quant.writing.unit_writer import read_layer
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, calibrate, quantize_weights
from pipeline.quant.writing.writer import QuantizedWriter
from pipeline.io.safetensors_io import TensorSpec
from fp8_codes import bits, every_code
from tiny import FIXTURES, TINY_FIXTURE

OPTS = QuantizeOptions(calib_path=str(FIXTURES / "calib.json"))

# ----- FP8 dequantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(128, 128), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_the_formula_bit_for_bit(dtype, block):
    """Every code, ragged edges on both axes, scales from float32 subnormals to 1e37 (whose s * 2^8
    overflows float32: that block row takes the formula itself), negative and zero scales; products that
    overflow a 16-bit dtype come out as the formula's Inf."""
    w = every_code((300, 260))
    r, c = math.ceil(300 / block[0]), math.ceil(260 / block[1])
    g = torch.Generator().manual_seed(0)
    s = torch.rand(r, c, generator=g) * 10.0 ** torch.randint(-44, 30, (r, c), generator=g).float()
    s[0, 0], s[0, -1], s[-1, 0], s[1, 1] = 1.4e-45, -0.0, -3.5, 1e37
    ref = (w.float() * expand_scale(s, (300, 260), block)).to(dtype)
    got = dequantize_fp8_blocks(w, s, block, dtype)
    assert got.dtype == dtype and torch.equal(bits(got), bits(ref))
    assert torch.equal(bits(dequantize_fp8_blocks(w, s.double(), block, dtype)), bits(ref))  # a float64 scale


def test_dequantize_round_trip_of_quantize_fp8_blocks():
    w = torch.randn(576, 200, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = quantize_fp8_blocks(w)
    assert torch.equal(bits(dequantize_fp8_blocks(q, s)), bits((q.float() * expand_scale(s, (576, 200), (128, 128)))
                                                              .bfloat16()))


def test_fp8_nan_count():
    w = every_code((16, 64))
    assert fp8_nan_count(w) == 0 and fp8_nan_count(w[:0]) == 0
    u = w.clone().view(torch.uint8)
    u[3, 5], u[7, 1], u[15, 63] = 0x7F, 0xFF, 0xFF
    assert fp8_nan_count(u.view(FP8_DTYPE)) == 3
    assert fp8_nan_count(u.view(FP8_DTYPE)[8:]) == 1


# ----- finiteness -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e5m2])
def test_all_finite_finds_one_bad_value_anywhere(dtype):
    for n in (1, 7, 16, 33, 1000, 4099):
        x = torch.linspace(-2, 2, n).to(dtype)
        assert all_finite(x) and all_finite(x.view(1, n)[:, ::2])
        for pos in {0, n // 2, n - 1}:
            for v in (float("nan"), float("inf"), -float("inf")):
                y = x.clone()
                y[pos] = v
                assert not all_finite(y), (n, pos, v)
    assert all_finite(torch.empty(0, 3, dtype=dtype))


# ----- reading ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """The tiny fixture (bf16), its FP8 copy, an fp16 copy and the fp16 copy's FP8 copy."""
    root = tmp_path_factory.mktemp("sources")
    f16 = root / "f16"
    f16.mkdir()
    tensors = load_file(str(TINY_FIXTURE / "model.safetensors"))
    half = {k: v.half() if v.dtype == torch.bfloat16 else v for k, v in tensors.items()}
    save_file(half, str(f16 / "model.safetensors"))
    cfg = json.loads((TINY_FIXTURE / "config.json").read_text())
    (f16 / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_FIXTURE / f, f16 / f)
    write_fp8_copy(str(TINY_FIXTURE), str(root / "fp8"), shards=2)
    write_fp8_copy(str(f16), str(root / "fp8-f16"), shards=3)
    return {"bf16": str(TINY_FIXTURE), "fp8": str(root / "fp8"), "f16": str(f16), "fp8-f16": str(root / "fp8-f16")}


@pytest.mark.parametrize("src", ["bf16", "fp8", "fp8-f16"])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_read_specs_are_what_the_reads_give(sources, src, dtype):
    r = CheckpointReader(sources[src])
    for lid in [None, *layout.all_layer_ids(r.config)]:
        got = r.read_globals(dtype) if lid is None else r.read_layer(lid, dtype)
        assert r.read_specs(lid, dtype) == {n: (t.dtype, tuple(t.shape)) for n, t in got.items()}


@pytest.mark.parametrize("src", ["fp8", "fp8-f16"])
def test_deferred_fp8_weights_are_what_the_read_gives(sources, src):
    """read_layer(deferred=...) gives the named FP8 weights as BlockRows whose materialization is the
    plain read's tensor; other tensors come as always."""
    r = CheckpointReader(sources[src])
    deferred = 0
    for lid in layout.all_layer_ids(r.config):  # the MTP layer (FLOAT) has none
        plain = r.read_layer(lid)
        names = deferred_weights(r.config, lid, Recipe())
        got = r.read_layer(lid, deferred=names)
        assert list(got) == list(plain)
        for n, t in got.items():
            if n in names:
                deferred += 1
                assert isinstance(t, BlockRows) and t.shape == tuple(plain[n].shape)
                assert torch.equal(bits(t.materialize()), bits(plain[n]))
            else:
                assert torch.equal(bits(t), bits(plain[n]))
    assert deferred >= 2 * 5


def test_dequantization_overflow_names_the_stage(tmp_path, sources):
    """A scale too large for the model dtype: finite float32 products that overflow float16 are reported
    after the conversion, products that overflow float32 after dequantization, and a huge scale over
    all-zero codes is no error."""
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    for k, (scale, codes, when) in enumerate([(1e3, None, "after conversion to torch.float16"),
                                              (1e37, None, "after dequantization"), (1e37, 0, None)]):
        dst = tmp_path / str(k)
        shutil.copytree(sources["fp8-f16"], dst)
        r = CheckpointReader(str(dst))
        shard = r.file_of(name)
        tensors = load_file(shard)
        tensors[name + "_scale_inv"][0, 0] = scale
        if codes is not None:
            tensors[name].view(torch.uint8)[:] = codes
        save_file(tensors, shard)
        for deferred in ((), {name}):  # a scale that could overflow is dequantized (and checked) even if deferred
            if when is None:
                assert bool((CheckpointReader(str(dst)).read_layer(1, deferred=deferred)[name] == 0).all())
            else:
                what = rf"{re.escape(shard)}: tensor '{name}': \d+ NaN and [1-9]\d* Inf values {when}"
                with pytest.raises(CheckpointError, match=what):
                    CheckpointReader(str(dst)).read_layer(1, deferred=deferred)


# ----- quantize_weights -------------------------------------------------------------------------------
def queued_loop(reader: CheckpointReader, writer: QuantizedWriter, stats, recipe: Recipe, smooth_stats) -> None:
    """The plain weight loop, no plan (the writer queues) and no prefetch."""
    from pipeline.quant.transforms.smooth import smooth_layer

    cfg = reader.config
    writer.add(*quantize_globals(cfg, reader.read_globals(), recipe))
    for i in layout.all_layer_ids(cfg):
        tensors = reader.read_layer(i)
        if smooth_stats is not None:
            tensors = smooth_layer(tensors, i, smooth_stats, OPTS.smooth_alpha)
        writer.add(*quantize_layer(cfg, i, tensors, stats, recipe))


def files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("src, recipe", [
    ("bf16", Recipe(smooth=True)),
    ("fp8", Recipe(dialect="ascendV1", quantize_mtp=True)),
    ("f16", Recipe(dialect="ascendV1", dynamic=True)),
    ("fp8-f16", Recipe(fa_quant=False)),
    ("fp8", Recipe(smooth=True)),
])
def test_quantize_weights_equals_the_plain_loop(tmp_path, sources, src, recipe):
    """Planned streaming shards, with and without the prefetch, are the queuing writer's files byte for
    byte (several shards): the specs planned from the headers are exactly what the quantizer makes."""
    stats, smooth_stats = calibrate(sources[src], recipe, OPTS)
    reader = CheckpointReader(sources[src])
    config = json.loads(Path(sources[src], "config.json").read_text())
    out = {}
    for how in ("queued", "prefetch", "serial"):
        with QuantizedWriter(str(tmp_path / how), recipe.dialect, model_dtype=model_dtype(reader.config),
                             shard_bytes=150_000) as w:
            if how == "queued":
                queued_loop(reader, w, stats, recipe, smooth_stats)
            else:
                quantize_weights(reader, w, stats, recipe, smooth_stats, OPTS.smooth_alpha, prefetch=how == "prefetch")
            w.finish(config, sources[src])
        out[how] = files(tmp_path / how)
    assert len([f for f in out["queued"] if f.endswith(".safetensors")]) >= 3
    assert out["prefetch"] == out["queued"] and out["serial"] == out["queued"]


def test_a_failing_background_read_surfaces_and_leaves_no_thread(tmp_path, sources, monkeypatch):
    reader = CheckpointReader(sources["fp8"])
    real = reader.read_layer

    def failing(i, *a, **k):
        if i == 2:
            raise CheckpointError("injected read failure in layer 2")
        return real(i, *a, **k)

    monkeypatch.setattr(reader, "read_layer", failing)
    stats, _ = calibrate(sources["fp8"], Recipe(), OPTS)
    with pytest.raises(CheckpointError, match="injected read failure"):
        with QuantizedWriter(str(tmp_path / "q"), "seed", model_dtype=torch.bfloat16, shard_bytes=150_000) as w:
            quantize_weights(reader, w, stats, Recipe())
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetch-layer")]
    assert not [p.name for p in (tmp_path / "q").iterdir()]


@pytest.mark.parametrize("dialect", ["seed", "ascendV1"])
def test_layer_pieces_are_whole_modules_in_order(sources, dialect):
    """quantize_layer_pieces: concatenated, quantize_layer's tensors and types in its order; each piece
    whole modules, the attention's in one piece (its format rules pair them), the rest one module each."""
    recipe = Recipe(dialect=dialect, quantize_mtp=True)
    reader = CheckpointReader(sources["fp8"])
    stats, _ = calibrate(sources["fp8"], recipe, OPTS)
    for i in layout.all_layer_ids(reader.config):
        tensors = read_layer(reader, i, recipe)
        whole, whole_types = quantize_layer(reader.config, i, tensors, stats, recipe)
        pieces = list(quantize_layer_pieces(reader.config, i, tensors, stats, recipe))
        names = [n for piece, _ in pieces for n in piece]
        assert names == list(whole) and all(torch.equal(bits(whole[n]), bits(t)) for piece, _ in pieces
                                            for n, t in piece.items())
        assert [n for _, ty in pieces for n in ty] == list(whole_types)
        modules = [{n.rsplit(".", 1)[0] for n in ty} for _, ty in pieces]
        attention = [m for m in modules if any(".self_attn" in x for x in m)]  # ascendV1: self_attn.quant_type
        assert len(attention) == 1 and all(".self_attn" in x for x in attention[0])
        assert all(len(m) == 1 for m in modules if m is not attention[0])


def test_a_forked_child_hashes_with_a_thread_of_its_own(tmp_path):
    """The hashing thread is per process: a child forked after the parent hashed (a thread it does not
    inherit) still commits its shards with the right sha256."""
    import hashlib

    from pipeline.quant.writing.output_files import ShardFile

    def hashed_right(path) -> bool:
        t = torch.arange(1000, dtype=torch.int32)
        f = ShardFile(str(path), [TensorSpec.of("x", t)])
        f.write("x", t)
        return f.close().sha256 == hashlib.sha256(path.read_bytes()).hexdigest()

    assert hashed_right(tmp_path / "parent.safetensors")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it hashed correctly (a hang ends by SIGALRM after 20 s)
        import signal

        signal.alarm(20)
        ok = False
        try:
            ok = hashed_right(tmp_path / "child.safetensors")
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# ----- the planned writer -----------------------------------------------------------------------------
@pytest.mark.parametrize("background", [False, True])
def test_planned_writer_holds_nothing_and_refuses_the_unplanned(tmp_path, background):
    """Without the writer thread a unit is written when add() returns; with it, once the next call waits
    for it (here finish): neither holds the tensors afterwards."""
    a = {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    b = {"model.embed_tokens.weight": torch.zeros(8, 64, dtype=torch.bfloat16)}
    specs = [[TensorSpec.of(n, t) for n, t in d.items()] for d in (a, b)]  # two units
    w = QuantizedWriter(str(tmp_path / "q"), "seed", model_dtype=torch.bfloat16, shard_bytes=150,
                        background=background)
    w.plan(specs)
    with pytest.raises(RuntimeError, match="plan\\(\\) must come once"):
        w.plan(specs)
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' BF16 \\[8, 64\\] is not the next planned one: "
                                         "'model.norm.weight' BF16 \\[64\\]"):
        w.add(b, {"model.embed_tokens.weight": "FLOAT"})
    ref = weakref.ref(a["model.norm.weight"])
    w.add(a, {"model.norm.weight": "FLOAT"})
    del a
    if not background:
        assert ref() is None  # written, not queued
    with pytest.raises(ValueError, match="1 planned tensors were never added: \\['model.embed_tokens.weight'\\]"):
        w.finish({})
    assert ref() is None
    w.abort()
    assert not list((tmp_path / "q").iterdir())


def test_abort_removes_the_part_being_written(tmp_path):
    t = {f"model.layers.0.mlp.experts.{k}.up_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16) for k in range(3)}
    w = QuantizedWriter(str(tmp_path / "q"), "seed", model_dtype=torch.bfloat16, background=False)
    w.plan([[TensorSpec.of(n, v) for n, v in t.items()]])
    w.add({n: t[n] for n in list(t)[:1]}, dict.fromkeys(list(t)[:1], "FLOAT"))
    assert [p.name for p in (tmp_path / "q").iterdir() if ".tmp-" in p.name]  # the shard is open
    w.abort()
    assert not list((tmp_path / "q").iterdir())


def test_a_failing_background_write_fails_the_writer_and_removes_everything(tmp_path, monkeypatch):
    """The writer thread's error (a full disk, injected here: it cannot be made on this machine's disk)
    is raised by a later add() or finish(); the units queued behind it are not written (no new part
    starts), the writer is failed, the with block removes every file and the thread is gone."""
    import pipeline.io.safetensors_io as sio

    units = [{f"model.layers.{i}.mlp.experts.{k}.up_proj.weight": torch.full((64, 64), float(i), dtype=torch.bfloat16)
              for k in range(2)} for i in range(3)]
    real = sio.SafetensorsWriter.write

    def write(self, name, tensor):
        if name.startswith("model.layers.1."):
            raise OSError(28, "No space left on device")
        real(self, name, tensor)

    monkeypatch.setattr(sio.SafetensorsWriter, "write", write)
    with pytest.raises(OSError, match="No space left"):
        with QuantizedWriter(str(tmp_path / "q"), "seed", model_dtype=torch.bfloat16, shard_bytes=10_000,
                             in_flight_bytes=1 << 30) as w:  # every unit queued behind the failing one
            w.plan([[TensorSpec.of(n, v) for n, v in u.items()] for u in units])
            for u in units:
                w.add(u, dict.fromkeys(u, "FLOAT"))
            w.finish({})
    assert w._state == "aborted" and not list((tmp_path / "q").iterdir())
    with pytest.raises(RuntimeError, match="writer is aborted"):
        w.add(units[2], dict.fromkeys(units[2], "FLOAT"))
    assert not [t for t in threading.enumerate() if t.name.startswith("shard-writer")]
