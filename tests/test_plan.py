"""The planner: the real 671B layout as a sparse header-only replica (no weight read), stage balance, output
shards, per-unit output bytes against msModelSlim's own output and our quantizer's, the refusal messages,
the dict round trip, the wall-time arithmetic and the CLI."""

from __future__ import annotations

import itertools
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.io import storage
from pipeline.io.checkpoint import CheckpointReader
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.quant.plan.partition import atoms_of, partition, unit_cost_shares
from pipeline.quant.plan.planner import plan
from pipeline.quant.plan.report import plan_from_dict, plan_to_dict, plan_to_text
from pipeline.quant.plan.resources import check_resources
from pipeline.quant.plan.types import GiB, PlanError
from pipeline.quant.job.costs import unit_costs
from pipeline.serving.sharding.replica import RELEASE_SHARDS, make_header_replica
from pipeline.quant.plan.timing import Cluster, estimate_wall_time
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from pipeline.io.safetensors_io import read_header
from tiny import FIXTURES, TINY_FIXTURE

REPO = Path(__file__).resolve().parents[1]
V3_STORED_GB = 688.6  # docs/deepseek.md
# Balance bound on the real layout, for 4, 8 and 16 stages: the largest stage costs at most 1.5x the
# smallest (measured 1.02-1.35), and at most total/stages + the largest unit (what the optimum guarantees).
BALANCE_RATIO = 1.5


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dsv3") / "DeepSeek-V3"
    make_header_replica(str(path))
    return str(path)


@pytest.fixture(scope="module")
def v3_reader(v3) -> CheckpointReader:
    return CheckpointReader(v3)


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_replica_is_the_release_layout_as_sparse_files(v3):
    files = sorted(f for f in os.listdir(v3) if f.endswith(".safetensors"))
    assert files[0] == "model-00001-of-000163.safetensors" and len(files) == RELEASE_SHARDS
    index = json.loads(Path(v3, "model.safetensors.index.json").read_text())
    data = sum(os.path.getsize(os.path.join(v3, f)) - _header_len(os.path.join(v3, f)) for f in files)
    assert index["metadata"]["total_size"] == data and round(data / 1e9, 1) == V3_STORED_GB
    on_disk = sum(os.stat(os.path.join(v3, f)).st_blocks * 512 for f in files)
    assert on_disk < 64 * 1024 ** 2, f"the replica is not sparse: {on_disk} bytes on disk"
    wm = index["weight_map"]
    hdr = read_header(os.path.join(v3, wm["model.layers.61.self_attn.kv_a_proj_with_mqa.weight"]))
    got = {n: (t.dtype, t.shape) for n, t in hdr.tensors.items()}
    p = "model.layers.61."
    assert got[p + "self_attn.kv_a_proj_with_mqa.weight"] == ("F8_E4M3", (576, 7168))
    assert got[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ("F32", (5, 56))
    assert got[p + "self_attn.kv_a_layernorm.weight"] == ("BF16", (512,))
    dtypes = {n: read_header(os.path.join(v3, wm[n])).tensors[n].dtype for n in (
        "model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.experts.255.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", p + "eh_proj.weight", p + "shared_head.head.weight")}
    assert dtypes == {"model.embed_tokens.weight": "BF16", "lm_head.weight": "BF16",
                      "model.layers.3.mlp.gate.weight": "BF16", "model.layers.3.mlp.gate.e_score_correction_bias": "F32",
                      "model.layers.3.mlp.experts.255.down_proj.weight": "F8_E4M3",
                      "model.layers.0.mlp.gate_proj.weight": "F8_E4M3", p + "eh_proj.weight": "BF16",
                      p + "shared_head.head.weight": "BF16"}


def test_the_671b_plan_reads_headers_only(v3, monkeypatch):
    reads: list[tuple[str, int, int]] = []
    whole: list[str] = []
    real_range, real_bytes = storage.read_range, storage.read_bytes
    monkeypatch.setattr(storage, "read_range", lambda p, s, e: reads.append((p, s, e)) or real_range(p, s, e))
    monkeypatch.setattr(storage, "read_bytes", lambda p: whole.append(p) or real_bytes(p))
    pl = plan(v3, 8)
    assert not [p for p in whole if p.endswith(".safetensors")]
    beyond = [(p, s, e) for p, s, e in reads if e > _header_len(p)]
    assert not beyond, f"weight bytes were read: {beyond[:3]}"
    assert len({p for p, _, _ in reads}) == RELEASE_SHARDS
    index = json.loads(Path(v3, "model.safetensors.index.json").read_text())
    assert pl.total("stored_bytes") == index["metadata"]["total_size"]
    assert sum(s.stored_bytes for s in pl.stages) == pl.total("stored_bytes")
    assert [u.unit for u in pl.units] == ["embed", *map(str, range(61)), "head", "61"]


@pytest.mark.parametrize("stages", [4, 8, 16])
def test_stages_are_contiguous_balanced_and_own_their_shards(v3_reader, stages):
    pl = plan(v3_reader, stages)
    order = [u.unit for u in pl.units]
    assert [u for s in pl.stages for u in s.units] == order  # contiguous, each unit exactly once, MTP included
    assert pl.stages[0].units[:2] == ("embed", "0") and "head" in pl.stages[-1].units + pl.stages[-2].units
    head_stage = next(s for s in pl.stages if "head" in s.units)
    assert head_stage.units[head_stage.units.index("head") - 1] == "60"
    costs = [s.cost for s in pl.stages]
    shares = unit_cost_shares(pl.units, pl.params.bytes_weight)
    largest_atom = max(sum(shares[i] for i in a) for a in atoms_of(pl.units))
    assert abs(sum(costs) - 1) < 1e-9
    assert max(costs) <= 1 / stages + largest_atom + 1e-12
    assert max(costs) / min(costs) <= BALANCE_RATIO, costs
    assert [s.index for s in pl.shards] == list(range(len(pl.shards)))
    for s in pl.stages:
        mine = [sh for sh in pl.shards if sh.stage == s.index]
        assert [sh.index for sh in mine] == list(s.shards) and s.shards == tuple(range(s.shards[0], s.shards[-1] + 1))
        assert all(set(sh.units) <= set(s.units) or (s.index == 0 and sh.units == ("embed", "head")) for sh in mine)
    assert sum(sh.nbytes for sh in pl.shards) == sum(s.output_bytes for s in pl.stages)
    assert all(sh.units == ("embed", "head") for sh in pl.shards[:1])  # the globals first, on stage 0
    assert all(len(sh.units) == 1 for sh in pl.shards[1:])  # then one unit per shard
    assert all(sh.nbytes <= pl.params.shard_bytes for sh in pl.shards)
    assert pl.shards[0].name == f"quant_model_weight_w8a8-00001-of-{len(pl.shards):05d}.safetensors"
    assert pl.stages[0].peak_memory > pl.stages[0].float_bytes  # resident: the stage's weights dequantized
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(pl)))) == pl


def test_partition_is_the_exact_minmax():
    rng = random.Random(0)
    for _ in range(30):
        costs = [rng.random() for _ in range(rng.randint(3, 9))]
        k = rng.randint(1, len(costs))
        got = partition(costs, k)
        assert got[0][0] == 0 and got[-1][1] == len(costs) and all(a[1] == b[0] for a, b in zip(got, got[1:]))
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
                   for cuts in itertools.combinations(range(1, len(costs)), k - 1))
        assert max(sum(costs[a:b]) for a, b in got) == pytest.approx(best, rel=1e-12)
    with pytest.raises(PlanError, match="cannot cut 3 units into 4 stages"):
        partition([1.0, 1.0, 1.0], 4)


def test_output_bytes_equal_what_msmodelslim_and_our_quantizer_write(tmp_path):
    """Per tensor: the planner's output (names and bytes, from headers) against msModelSlim's ascendV1 fixture
    and against our own seed-dialect output of the same checkpoint."""
    reader = CheckpointReader(str(TINY_FIXTURE))
    _, outs = unit_costs(reader, Recipe(dialect="ascendV1", quantize_mtp=True), 64)
    ref = read_header(str(FIXTURES / "msmodelslim-v1-bf16" / "quant_model_weights-00001-of-00001.safetensors"))
    assert {n: b for u in outs.values() for n, b in u} == {n: t.end - t.start for n, t in ref.tensors.items()}

    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(["def f(x):\n    return x", "The quick brown fox."]))
    dst = tmp_path / "q"
    quantize_checkpoint(str(TINY_FIXTURE), str(dst), Recipe(), QuantizeOptions(calib_path=str(calib)),
                        log=lambda m: None)
    written = {}
    for f in dst.glob("*.safetensors"):
        written.update({n: t.end - t.start for n, t in read_header(str(f)).tensors.items()})
    _, outs = unit_costs(reader, Recipe(), 64)
    assert {n: b for u in outs.values() for n, b in u} == written


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_planned_shards_are_the_files_the_writer_lays_out(stages):
    """The planner's shards (names, first/last tensor, bytes, count) are the single-process writer's layout
    (shard_layout.checkpoint_shards), whatever the number of stages."""
    from pipeline.quant.writing.shard_layout import checkpoint_shards

    reader = CheckpointReader(str(TINY_FIXTURE))
    pl = plan(reader, stages, shard_bytes=150_000, seq_len=64)
    real = checkpoint_shards(reader, Recipe(), 150_000)
    assert len(real) > 5
    assert [(s.name, s.first, s.last, s.nbytes, s.tensors) for s in pl.shards] == \
        [(s.name, s.specs[0].name, s.specs[-1].name, s.nbytes, len(s.specs)) for s in real]


def test_refusal_names_the_stage_and_what_to_change(v3_reader):
    pl = plan(v3_reader, 4)
    eight = [{"name": f"n{i}", "memory": 256 * GiB} for i in range(8)]
    with pytest.raises(PlanError, match=r"stage 0 \(units embed\+0-16\) needs an estimated 313\.\d GiB .* the "
                                        r"largest node \(n0\) has 256\.0 GiB: use at least 6 stages \(raise --stages "
                                        r"to 6\).* or use a node with >= 313\.\d GiB"):
        check_resources(pl, {"nodes": eight})
    check_resources(plan(v3_reader, 6), {"nodes": eight})  # the suggestion fits
    # one figure for the whole cluster: resident weights (1.3 TiB in all) cannot fit 256 GiB at any stage count
    with pytest.raises(PlanError, match=r"has 256\.0 GiB: use --memory-model streaming \(est\. \d+\.\d GiB per actor\)"):
        check_resources(pl, {"memory": 256 * GiB})
    check_resources(plan(v3_reader, 4, memory_model="streaming"), {"memory": 256 * GiB})

    four = [{"name": f"n{i}", "memory": 1024 * GiB, "CPU": 64, "GPU": 8} for i in range(4)]
    wide = plan(v3_reader, 8, replicas=4)
    with pytest.raises(PlanError, match=r"32 actors need an estimated .* fewer replicas \(--replicas 3 fits\)"):
        check_resources(wide, {"nodes": four, "memory": 4096 * GiB})
    check_resources(plan(v3_reader, 8, replicas=3), {"nodes": four, "memory": 4096 * GiB})
    with pytest.raises(PlanError, match=r"ask for 32 CPU in all .* Ray reports 16: fewer replicas \(--replicas 2 fits\)"):
        check_resources(wide, {"CPU": 16})
    gpu = plan(v3_reader, 16, gpus_per_actor=1.0)
    with pytest.raises(PlanError, match=r"stage \d+ .* GPU memory .* hold 80\.0 GiB: use at least \d+ stages"):
        check_resources(gpu, {"GPU": 32, "gpu_memory": 80 * GiB})


def test_weight_workers_take_every_shard_once(v3_reader):
    pl = plan(v3_reader, 8, weight_workers=6)
    assert sorted(i for w in pl.workers for i in w.shards) == list(range(len(pl.shards)))
    assert sum(w.write_bytes for w in pl.workers) == pl.total("output_bytes")
    assert all(s.weight_memory == 0 and s.write_bytes == 0 for s in pl.stages)
    assert plan_from_dict(plan_to_dict(pl)) == pl
    assert "worker" in plan_to_text(pl)


def test_wall_time_arithmetic(v3_reader):
    pl = plan(v3_reader, 32, gpus_per_actor=1.0)
    c = Cluster(nodes=4, gpus_per_node=8, disk_read_gbps=5, network_gbps=25, gpu_tflops=400)
    t = estimate_wall_time(pl, c)
    calib_read = max(sum(u.stored_bytes for u in pl.units if u.unit in s.units and u.forward) for s in pl.stages)
    assert t.read_s == pytest.approx(8 * calib_read / 5e9)
    step = max(s.flops_per_token for s in pl.stages) * 2048 / 400e12 + 2048 * 7168 * 2 / 25e9
    assert t.calibrate_s == pytest.approx((128 + 31) * step)
    assert t.total_s == pytest.approx(t.read_s + t.calibrate_s + t.reread_s + t.quantize_s + t.write_s)
    assert estimate_wall_time(pl, Cluster(4, 8, disk_read_gbps=10)).read_s == pytest.approx(t.read_s / 2)


def test_bad_plans_are_refused(v3_reader):
    with pytest.raises(PlanError, match=r"stages must be in 1\.\.62"):
        plan(v3_reader, 63)
    with pytest.raises(PlanError, match="replicas must be an integer >= 1"):
        plan(v3_reader, 2, replicas=0)
    with pytest.raises(PlanError, match="memory_model must be one of"):
        plan(v3_reader, 2, memory_model="mmap")
    with pytest.raises(PlanError, match="unknown key"):
        plan_from_dict({**plan_to_dict(plan(str(TINY_FIXTURE), 1)), "extra": 1})


def test_the_embedded_model_plans_for_1_2_3_stages():
    if not os.path.exists(os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors")):
        pytest.skip(f"{EMBEDDED_MODEL_DIR}/model.safetensors is missing: the embedded model is not trained yet")
    reader = CheckpointReader(EMBEDDED_MODEL_DIR)
    n = reader.config.num_hidden_layers
    for k in (1, 2, 3):
        pl = plan(reader, k, seq_len=512, calib_tokens=16 * 512)
        assert [u for s in pl.stages for u in s.units] == ["embed", *map(str, range(n)), "head", str(n)]
        assert len(pl.stages) == k and plan_from_dict(plan_to_dict(pl)) == pl
        assert sum(sh.nbytes for sh in pl.shards) == pl.total("output_bytes")
        check_resources(pl, {"memory": 16 * GiB, "CPU": 8})


def test_cli_prints_the_plan_and_exits_2_when_refused(v3, capsys):
    from jobs.plan import main

    assert main(["--model-path", str(TINY_FIXTURE), "--stages", "2", "--json", "--estimate", "1x0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(plan_from_dict(out["plan"]).stages) == 2 and out["wall_time"]["total_s"] > 0
    assert main(["--model-path", str(TINY_FIXTURE), "--stages", "9"]) == 2
    assert "stages must be 1..3 (the model's main layers), got 9" in capsys.readouterr().err   # as jobs.quantize
    # the real entry point, on the 671B replica
    refused = subprocess.run([sys.executable, "-m", "jobs.plan", "--model-path", v3, "--stages", "4",
                              "--cluster-memory-gib", "2048", "--nodes", "8"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "refused: stage 0" in refused.stderr and "use at least 6 stages" in refused.stderr
    assert "embed+0-16" in refused.stdout  # the plan is printed before the refusal


def test_a_data_free_recipe_plans_no_calibration(v3_reader):
    """--dynamic --no-fa-quant runs no forward: the plan holds no calibration memory or compute for it, so
    its resource check sizes only the weight phase (it refused small clusters for a pass that never ran)."""
    from pipeline.quant.recipe.recipe import Recipe

    free = plan(v3_reader, 4, recipe=Recipe(dynamic=True, fa_quant=False))
    calibrated = plan(v3_reader, 4, recipe=Recipe(dynamic=True))
    assert all(s.calib_memory == 0 for s in free.stages) and not any(u.forward for u in free.units)
    assert all(s.calib_memory > 0 for s in calibrated.stages)
    assert all(f.peak_memory < c.peak_memory for f, c in zip(free.stages, calibrated.stages))
