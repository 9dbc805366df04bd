"""The single-process job's one read of the checkpoint (pipeline.quant.calibration.layerwise): every output file byte for
byte the two-pass reference's (the whole float model calibrated first, then the weights read again),
for every recipe family, on bf16 and FP8 sources; the source read once (``bytes_read``); and several
samples per forward (``calib_batch``) giving the batch-of-one statistics."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.format.description import MANIFEST_NAME
from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.release_layout.fp8_copy import write_fp8_copy
from pipeline.quant.calibration.calib_data import load_texts
from pipeline.quant.calibration.calibrate import observing, run_layer_batched
from pipeline.quant.calibration.layerwise import calibrate_layerwise
from pipeline.quant.numerics.observers import MinMax, RecallWindow
from pipeline.quant.job.options import CALIB_BATCH_REL, calibration_samples
from pipeline.quant.numerics.qparams import fa_scale, static_activation_params
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from pipeline.io.safetensors_io import itemsize
from tiny import TINY_FIXTURE


def FloatRecipe(**kw) -> Recipe:
    """The float calibration (one pass of the float model), whose one-read job this module compares with its
    two-pass reference; msModelSlim's layer-by-layer passes are tests/test_msmodelslim_recipes.py's."""
    return Recipe(calibration="float", **kw)

TIMINGS = ("calibration_s", "quantize_write_s", "bytes_read", "rchar")  # what may differ between the modes


def stored_bytes(src) -> int:
    """Every stored tensor's bytes, from the headers (the source read once)."""
    r = CheckpointReader(str(src))
    return sum(math.prod(r.header(n)[1]) * itemsize(r.header(n)[0]) for n in r.tensor_names())


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST_NAME}


def manifest(d: Path) -> dict:
    m = json.loads((d / MANIFEST_NAME).read_text())
    for k in TIMINGS + ("estimate",):
        m["job"].pop(k, None)
    return m


def both(src, tmp: Path, recipe: Recipe, opts: QuantizeOptions) -> tuple[dict, dict]:
    """(two-pass summary, layer-wise summary), asserting the outputs are the same files."""
    a, b = tmp / "two-pass", tmp / "layerwise"
    sa = quantize_checkpoint(str(src), str(a), recipe, dataclasses.replace(opts, layerwise=False), log=lambda m: None)
    sb = quantize_checkpoint(str(src), str(b), recipe, dataclasses.replace(opts, layerwise=True), log=lambda m: None)
    da, db = digests(a), digests(b)
    assert any(n.endswith(".safetensors") for n in da)
    assert da == db, [n for n in da if da[n] != db.get(n)]       # every shard's sha256, the index, description
    assert manifest(a) == manifest(b)                              # the manifest up to timings and read counts
    return sa, sb


def test_default_recipe_on_the_embedded_model_reads_once_and_writes_the_same_files(tmp_path):
    """The default recipe (W8A8 + FA3) with the default calibration data (64 texts)."""
    sa, sb = both(EMBEDDED_MODEL_DIR, tmp_path, FloatRecipe(), QuantizeOptions())
    total = stored_bytes(EMBEDDED_MODEL_DIR)
    assert sb["bytes_read"] == total and sa["bytes_read"] == 2 * total
    if sb["rchar"] is not None:  # the kernel's count of what the process read: the source once, plus small files
        assert total <= sb["rchar"] < sa["rchar"]


SMALL_CALIB = 8  # texts for the other recipes (each compared end to end)


@pytest.fixture(scope="module")
def small_calib(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("calib") / "calib.json"
    p.write_text(json.dumps(load_texts()[:SMALL_CALIB]))
    return str(p)


@pytest.mark.parametrize("recipe", [
    FloatRecipe(dynamic=True),
    FloatRecipe(smooth=True),
    FloatRecipe(quantize_mtp=True, dialect="ascendV1"),
    FloatRecipe(smooth=True, quantize_mtp=True, fa_exclude_layers=(0,)),
], ids=["dynamic", "smooth", "mtp-ascendV1", "smooth-mtp"])
def test_every_recipe_family_on_the_embedded_model(tmp_path, small_calib, recipe):
    both(EMBEDDED_MODEL_DIR, tmp_path, recipe, QuantizeOptions(calib_path=small_calib))


@pytest.mark.parametrize("recipe", [FloatRecipe(), FloatRecipe(smooth=True, quantize_mtp=True)], ids=["default", "smooth-mtp"])
def test_fp8_source(tmp_path, recipe, calib4):
    """One read feeds both uses of an FP8 layer: its deferred weights dequantized for the forward, and
    quantized straight from their codes by the weight phase (both modes on the same four texts)."""
    fp8 = tmp_path / "fp8"
    write_fp8_copy(str(TINY_FIXTURE), str(fp8), shards=2)
    assert any(CheckpointReader(str(fp8)).header(n)[0] == "F8_E4M3" for n in CheckpointReader(str(fp8)).tensor_names())
    sa, sb = both(fp8, tmp_path, recipe, QuantizeOptions(calib_path=calib4))
    assert sb["bytes_read"] == stored_bytes(fp8) and sa["bytes_read"] == 2 * sb["bytes_read"]


def test_data_free_recipe_reads_once_in_either_mode(tmp_path):
    s = quantize_checkpoint(str(TINY_FIXTURE), str(tmp_path / "q"), FloatRecipe(dynamic=True, fa_quant=False),
                            QuantizeOptions(), log=lambda m: None)
    assert s["bytes_read"] == stored_bytes(TINY_FIXTURE)


# ----- several samples per forward -------------------------------------------------------------------------

def embedded_samples(n: int) -> list[list[int]]:
    src = str(EMBEDDED_MODEL_DIR)
    samples = calibration_samples(src, QuantizeOptions(), CheckpointReader(src).config.max_position_embeddings)
    return samples[:n]


def layer_stats(src: str, samples, batch: int, recipe: Recipe = FloatRecipe()) -> dict:
    reader = CheckpointReader(src)
    got: dict = {}
    calibrate_layerwise(reader, recipe, samples, write_globals=lambda g: None,
                        quantize=lambda i, tensors, stats: got.update(stats.entries), batch=batch)
    return got


def max_relative_change(ref: dict, got: dict) -> tuple[float, float]:
    """(the largest |got - ref| / |ref| over every recorded end: MinMax lo/hi, each recall window row;
    the same over the scales the writer derives from them), asserting the counts are equal."""
    assert set(ref) == set(got)
    md = torch.bfloat16
    ends = scales = 0.0
    for k, r in ref.items():
        g = got[k]
        assert type(g) is type(r) and g.count == r.count, k          # counts: the padding was never observed
        for a, b in zip((*_ends(r.lo), *_ends(r.hi)), (*_ends(g.lo), *_ends(g.hi))):
            ends = max(ends, abs(b - a) / max(abs(a), 1e-30))
        sr, sg = _scale(r, k, md), _scale(g, k, md)
        scales = max(scales, float(((sg - sr).abs() / sr.abs()).max()))
    return ends, scales


def _ends(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _scale(stat, name: str, md) -> torch.Tensor:
    if isinstance(stat, MinMax):
        return static_activation_params(stat.lo, stat.hi, md, name)[0].double()
    return fa_scale(torch.tensor(stat.lo, dtype=torch.float64), torch.tensor(stat.hi, dtype=torch.float64), md, name).double()


@pytest.mark.parametrize("batch", [4, 16])
def test_batched_forward_keeps_the_statistics(batch):
    """Within CALIB_BATCH_REL of batch one (measured here: equal), the padding never observed."""
    samples = embedded_samples(24)  # lengths differ: every batch is padded
    assert len({len(s) for s in samples}) > 4
    ref = layer_stats(str(EMBEDDED_MODEL_DIR), samples, 1)
    assert any(isinstance(v, RecallWindow) for v in ref.values()) and any(isinstance(v, MinMax) for v in ref.values())
    ends, scales = max_relative_change(ref, layer_stats(str(EMBEDDED_MODEL_DIR), samples, batch))
    assert ends <= CALIB_BATCH_REL and scales <= CALIB_BATCH_REL, (ends, scales)


# bf16 layer outputs of a padded batch against batch-of-one ones: max |diff| / max |ref|. Equal bits on an
# AVX2 CPU; on an AVX-512 + AMX one oneDNN's bf16 GEMMs round otherwise for another row count (measured
# there: 4.8e-4).
PADDED_OUT_REL = 2e-3


def test_padding_is_masked_out_of_every_observation():
    """Direct: one layer over right-padded batches, its observations against batch-of-one ones; the
    padded rows' activations are not those of any real token, so observing them would move the ends."""
    from pipeline.model.loading import load_model

    model = load_model(str(EMBEDDED_MODEL_DIR), dtype=torch.bfloat16, device="cpu")
    samples = embedded_samples(6)
    recipe = FloatRecipe()
    with torch.inference_mode():
        hs = [model.embed(torch.tensor([s])) for s in samples]
        with observing(model, recipe, [0]) as one:
            ref_out = run_layer_batched(model, 0, hs, 1, one)
        with observing(model, recipe, [0]) as many:
            out = run_layer_batched(model, 0, hs, 6, many)
    for a, b in zip(ref_out, out):     # a GEMM over more rows may round otherwise (oneDNN's AMX kernels do)
        assert a.shape == b.shape
        assert float((b.float() - a.float()).abs().max() / a.float().abs().max()) <= PADDED_OUT_REL
    ends, scales = max_relative_change(one.stats().entries, many.stats().entries)   # counts equal: no padding
    assert ends <= CALIB_BATCH_REL and scales <= CALIB_BATCH_REL, (ends, scales)
    # without the lengths the same batch observes the padding: the observers count its rows
    lengths = [len(s) for s in samples]
    padded = torch.zeros(len(hs), max(lengths), hs[0].shape[-1], dtype=hs[0].dtype)
    for b, x in enumerate(hs):
        padded[b, : lengths[b]] = x[0]
    with torch.inference_mode(), observing(model, recipe, [0]) as unmasked:
        model.run_layers(padded, [0])
    seen, ref = unmasked.stats().entries, one.stats().entries
    assert set(seen) == set(ref) and any(seen[k].count != ref[k].count for k in ref)


def test_batched_job(tmp_path, small_calib):
    """Through the job: the same tensors, the int8 weights equal, the activation and FA3 scales within
    CALIB_BATCH_REL of batch one's."""
    from safetensors.torch import load_file

    opts = QuantizeOptions(calib_path=small_calib)
    out = {}
    for b in (1, 4):
        d = tmp_path / f"b{b}"
        quantize_checkpoint(str(EMBEDDED_MODEL_DIR), str(d), FloatRecipe(), dataclasses.replace(opts, calib_batch=b),
                            log=lambda m: None)
        out[b] = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(out[1]) == set(out[4])
    scales = [k for k in out[1] if k.endswith("input_scale") or (".fa_" in k and k.endswith(".scale"))]
    assert len(scales) > 10
    for k, a in out[1].items():
        b = out[4][k]
        if a.dtype == torch.int8 and k.endswith(".weight"):
            assert torch.equal(a, b), k
        elif k in scales:
            assert float(((b.double() - a.double()).abs() / a.double().abs()).max()) <= CALIB_BATCH_REL, k


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="calib_batch"):
        QuantizeOptions(calib_batch=0)
    with pytest.raises(ValueError, match="calib_batch"):
        QuantizeOptions(calib_batch=4, layerwise=False)
    from jobs import quantize

    with pytest.raises(ValueError, match="--calib-batch"):
        quantize.make_job(quantize.parse_args(["--calib-batch", "0"]))
    with pytest.raises(ValueError, match="--two-pass"):
        quantize.make_job(quantize.parse_args(["--calib-batch", "2", "--two-pass"]))
    _, _, _, opts, _ = quantize.make_job(quantize.parse_args(["--two-pass"]))
    assert opts.layerwise is False and opts.calib_batch == 1
    _, _, _, opts, _ = quantize.make_job(quantize.parse_args(["--calib-batch", "8"]))
    assert opts.layerwise is True and opts.calib_batch == 8
