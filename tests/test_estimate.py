"""The up-front estimate (pipeline.quant.job.estimate) and the per-phase progress bars (pipeline.quant.calibration.progress):
the CLI prints the estimate before the job starts, its byte counts are the job's own (read: every stored
byte once per phase; written: the output's tensor bytes exactly), its arithmetic is the documented
formula (one read for the layer-wise single-process job), and the bars count tokens and bytes with a rate, a redone
sample once."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.format.description import MANIFEST_NAME
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.job.costs import unit_costs
from pipeline.quant.job.estimate import FORWARD_EFFICIENCY, GB, Probe, estimate_job, probe
from pipeline.quant.calibration.progress import JobProgress, over_samples
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import output_specs
from tiny import TINY_FIXTURE

REL = 1e-9  # the estimate's arithmetic against the formula: equal up to float rounding
PROBE = Probe(read_gbps=0.5, write_gbps=0.25, quantize_gbps=2.0, matmul_tflops=0.1, seconds=0.0)


def test_estimate_is_the_documented_formula():
    reader = CheckpointReader(str(TINY_FIXTURE))
    recipe = Recipe()
    samples = [[1] * 30, [2] * 50]
    est = estimate_job(reader, recipe, samples, PROBE)
    units, _ = unit_costs(reader, recipe, 40)  # the samples' mean length
    stored = sum(u.stored_bytes for u in units)
    assert est.read_bytes == 2 * stored                       # the float model, then the weight phase
    assert est.write_bytes == sum(s.nbytes for s in output_specs(reader, recipe))
    assert est.calib_tokens == 80 and est.calib_samples == 2
    assert est.calib_flops == pytest.approx(sum(u.flops_per_token for u in units) * 80, rel=REL)
    assert est.calibration_compute_s == pytest.approx(
        est.calib_flops / (0.1e12 * FORWARD_EFFICIENCY), rel=1e-2, abs=0.01)
    assert est.weights_s == pytest.approx(max(stored / (0.5 * GB) + est.write_bytes / (0.25 * GB),
                                              est.float_bytes / (2.0 * GB)), rel=1e-2, abs=0.01)
    smooth = estimate_job(reader, Recipe(smooth=True), samples, PROBE)
    assert smooth.calib_flops == pytest.approx(2 * est.calib_flops, rel=REL)  # two passes

    # the single-process job's one read (layer-wise calibration): read once, overlapping the compute
    one = estimate_job(reader, recipe, samples, PROBE, single_read=True)
    assert one.read_bytes == stored and one.calibration_read_s == 0
    assert one.calibration_compute_s == est.calibration_compute_s
    # one layer at a time on the job's thread (the tiny fixture is bf16: nothing to dequantize), written meanwhile
    assert one.total_s == pytest.approx(max(est.write_bytes / (0.25 * GB), one.calibration_compute_s + stored / (0.5 * GB)
                                            + est.float_bytes / (2.0 * GB)), rel=1e-2, abs=0.02)
    assert "from the one read" in "\n".join(one.to_text())

    free = estimate_job(reader, Recipe(dynamic=True, fa_quant=False), [], PROBE)
    assert free.read_bytes == stored and free.calibration_read_s == 0 and free.calibration_compute_s == 0
    assert "calibration: none (data-free recipe)" in "\n".join(free.to_text())

    dist = estimate_job(reader, recipe, samples, PROBE, actors=2)  # compute shared by the actors, I/O not
    assert dist.calibration_compute_s == pytest.approx(est.calibration_compute_s / 2, rel=1e-2, abs=0.01)
    assert dist.calibration_read_s == est.calibration_read_s and dist.ray_s > 0


def test_probe_measures_this_machine_quickly(tmp_path):
    dst = tmp_path / "not-yet" / "q"  # probed in the nearest existing directory, nothing left there
    p = probe(CheckpointReader(EMBEDDED_MODEL_DIR), "cpu", 64, str(dst))
    assert p.read_gbps > 0 and p.write_gbps > 0 and p.quantize_gbps > 0 and p.matmul_tflops > 0
    assert p.seconds < 10, p  # "about a second" on an idle machine; a loaded 2-CPU one is slower
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_the_estimate_first_and_records_it(tmp_path, capsys):
    from jobs import quantize

    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"]))
    dst = tmp_path / "q"
    assert quantize.main(["--save-path", str(dst), "--calib-data", str(calib), "--dynamic", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    first = next(k for k, m in enumerate(out) if m.startswith("estimate (one process; probe "))
    assert first < next(k for k, m in enumerate(out) if m.startswith("calibrating "))
    block = "\n".join(out[first:first + 4])
    assert "calibration: layer by layer from the one read" in block and "2 samples" in block
    assert "weights: read" in block and "(once, for the calibration too)" in block and "total: ~" in block

    est = json.loads((dst / MANIFEST_NAME).read_text())["job"]["estimate"]
    reader = CheckpointReader(EMBEDDED_MODEL_DIR)
    stored = sum(math.prod(reader.header(n)[1]) * {"BF16": 2, "F32": 4}[reader.header(n)[0]]
                 for n in reader.tensor_names())
    assert est["read_bytes"] == stored and est["single_read"]  # the layer-wise job reads the source once
    assert json.loads((dst / MANIFEST_NAME).read_text())["job"]["bytes_read"] == stored
    ran = Recipe.from_dict(json.loads((dst / MANIFEST_NAME).read_text())["job"]["recipe"])  # (with the legacy m4)
    written = sum(s.nbytes for s in output_specs(reader, ran))
    assert est["write_bytes"] == written

    assert quantize.main(["--save-path", str(tmp_path / "free"), "--dynamic", "--no-fa-quant", "--disable-anti", "--no-progress",
                          "--no-estimate"]) == 0
    assert not any(m.startswith("estimate") for m in capsys.readouterr().out.splitlines())


def test_bars_have_rates_and_count_a_redone_sample_once(capsys):
    samples = [[0] * 5, [0] * 7, [0] * 11]
    assert list(over_samples(samples, True)) == samples
    err = capsys.readouterr().err
    assert "tok/s" in err and "3/3 samples" in err

    jp = JobProgress(True, samples, n_stages=2)
    for j, k in [(0, 0), (1, 0), (0, 1), (2, 0), (1, 0), (1, 1), (2, 1)]:  # sample 1 redone after stage 0
        jp.event("sample", {"pass": "stats", "sample": j, "stage": k})
    assert jp.calib["stats"].n == 23 and jp.done["stats"] == 3
    jp.start_weights({"globals": 1000, "0": 3000})
    jp.event("unit", {"unit": "0", "shards": []})
    jp.event("unit", {"unit": "globals", "shards": []})
    assert jp.weights.n == 4000 and jp.units_done == 2
    jp.close()
    err = capsys.readouterr().err
    assert "B/s" in err and "2/2 units" in err and "3/3 samples" in err


def test_progress_is_whole_lines_when_stderr_is_not_a_terminal(capsys):
    """No carriage-return redraws in a log: a bar off a terminal prints a line per interval and one at the end."""
    from pipeline.quant.calibration.progress import LineBar, bar

    b = bar(True, "weights", 1000, "B")
    assert isinstance(b, LineBar)
    for _ in range(100):
        b.update(10)
    b.set_postfix_str("5/5 units")
    b.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") <= 2
    assert err.splitlines()[-1].startswith("weights: 100% (1k/1k B") and err.rstrip().endswith("5/5 units)")


def test_memory_estimate_of_the_layerwise_job_is_its_documented_formula():
    """layerwise_peak: the largest of (a layer's float weights + the weights its steps rewrite + its quantized
    weights fake-quantized in md + one sample's working set), + every sample's hidden states in and out, +
    the fixed part; quarot rewrites every weight, so it counts each layer's weights twice."""
    from pipeline.quant.job.estimate import FIXED_PEAK_BYTES, layerwise_peak
    from pipeline.quant.recipe.steps import QuaRot

    reader = CheckpointReader(str(TINY_FIXTURE))
    cfg = reader.config
    samples = [[1] * 30, [2] * 50]
    plain = Recipe()
    units, outputs = unit_costs(reader, plain, 40)
    layers = [u for u in units if u.layer_id is not None]

    def fake(u):   # bf16: two bytes for each int8 weight value written
        outs = dict(outputs[u.unit])
        return sum(2 * b for n, b in outs.items() if n.endswith(".weight") and n + "_scale" in outs)

    assert all(fake(u) > 0 for u in layers if u.layer_id < cfg.num_hidden_layers)
    hidden = 2 * 80 * cfg.hidden_size * 2
    want = max(u.float_bytes + fake(u) + u.act_bytes for u in layers)
    assert layerwise_peak(reader, plain, units, outputs, 80)[0] == want + hidden + FIXED_PEAK_BYTES
    est = estimate_job(reader, plain, samples, PROBE, single_read=True)
    assert est.peak_bytes == want + hidden + FIXED_PEAK_BYTES and "memory: peak ~" in "\n".join(est.to_text())
    assert estimate_job(reader, plain, samples, PROBE).peak_bytes == 0     # two-pass: the planner's model

    rotated = Recipe(steps=(QuaRot(),))
    r_units, r_outputs = unit_costs(reader, rotated, 40)
    got = layerwise_peak(reader, rotated, r_units, r_outputs, 80)[0] - hidden - FIXED_PEAK_BYTES
    assert got == max(2 * u.float_bytes + fake(u) + u.act_bytes for u in r_units if u.layer_id is not None)


def test_the_memory_estimate_counts_the_mlp_smoothing_rewrites():
    """mlp_smooth replaces its norm, the gate/up weights it feeds and the router by new tensors: the layers
    it names count those bytes once more."""
    from pipeline.quant.job.estimate import layerwise_peak
    from pipeline.quant.transforms.recipe_plan import resolve

    reader = CheckpointReader(str(TINY_FIXTURE))
    cfg = reader.config
    plain, smoothed = Recipe(), Recipe(mlp_smooth_layers=tuple(range(cfg.num_hidden_layers)))
    rewritten = resolve(smoothed, cfg).rewritten(1)
    assert {"model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.gate.weight"} <= rewritten
    units, outputs = unit_costs(reader, plain, 40)
    s_units, s_outputs = unit_costs(reader, smoothed, 40)
    base = layerwise_peak(reader, plain, units, outputs, 80)[0]
    more = layerwise_peak(reader, smoothed, s_units, s_outputs, 80)[0]
    assert more > base
