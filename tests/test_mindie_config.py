"""pipeline.serving.mindie_config: a MindIE ModelConfig block (the serving spec's seed document) read in every shape
MindIE users hand it over, every refusal with its message, and ServeConfig.from_mindie."""

from __future__ import annotations

import copy
import json

import pytest

from pipeline.serving.mindie_config import MindieModelConfig, parse_mindie_model_config, to_serve_options

SEED = {"modelName": "deepseekr1", "modelWeightPath": "/models/dsv3-w8a8", "worldSize": 8, "tp": 8, "dp": 2,
        "moe_ep": 4, "moe_tp": 4, "sp": 1,
        "plugin_params": "{\"plugin_type\":\"mtp\",\"num_speculative_tokens\": 1}",
        "models": {"deepseekv2": {"kv_cache_options": {"enable_nz": True}}}}


def entry(**changes):
    m = copy.deepcopy(SEED)
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    return m


def single(**changes):
    """A one-rank layout (what CPU serving accepts)."""
    return entry(**{"worldSize": 1, "tp": 1, "dp": 1, "moe_ep": 1, "moe_tp": 1, "sp": 1, **changes})


def refused(block, devices=16, gpus_per_node=None) -> str:
    with pytest.raises(ValueError) as e:
        parse_mindie_model_config(block, devices, gpus_per_node)
    return str(e.value)


def test_seed_block_parses_with_enough_devices():
    cfg = parse_mindie_model_config({"ModelConfig": [SEED]}, 16)
    assert isinstance(cfg, MindieModelConfig)
    assert (cfg.model_name, cfg.model_weight_path) == ("deepseekr1", "/models/dsv3-w8a8")
    assert (cfg.world_size, cfg.tp, cfg.dp, cfg.moe_ep, cfg.moe_tp, cfg.sp) == (8, 8, 2, 4, 4, 1)
    assert cfg.mtp is True and cfg.enable_nz is True
    assert (cfg.ranks, cfg.nodes) == (16, 2)          # dp x tp = 16 = worldSize 8 x 2 nodes
    assert cfg.warnings == ()                         # honoured as it is: nothing to warn about
    with pytest.raises(AttributeError):
        cfg.tp = 1                                    # frozen
    assert to_serve_options(cfg) == {"model_path": "/models/dsv3-w8a8", "served_model_name": "deepseekr1",
                                     "engine": {"nz": True, "mtp": True},
                                     "parallel": {"tp": 8, "dp": 2, "moe_ep": 4, "moe_tp": 4}}


@pytest.mark.parametrize("shape", ["whole", "deploy", "model_config_key", "list", "single"])
def test_all_input_shapes(shape):
    block = {"whole": {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [SEED], "maxSeqLen": 4096}}},
             "deploy": {"ModelDeployConfig": {"ModelConfig": [SEED]}},
             "model_config_key": {"ModelConfig": [SEED]},
             "list": [SEED],
             "single": SEED}[shape]
    assert parse_mindie_model_config(block, 16) == parse_mindie_model_config(SEED, 16)


def test_shape_refusals():
    assert "ModelConfig lists 2 models (deepseekr1, other); this serving job serves one model: keep a single" \
        in refused([SEED, entry(modelName="other")])
    assert "ModelConfig is an empty list" in refused({"ModelConfig": []})
    assert "BackendConfig.ModelDeployConfig is missing" in refused({"BackendConfig": {}})
    assert "got str" in refused("config.json")


def test_missing_weight_path():
    assert "ModelConfig.modelWeightPath is missing or empty: set it to the quantized weight directory" \
        in refused(entry(modelWeightPath=None))
    assert "modelWeightPath is missing" in refused(entry(modelWeightPath=""))


@pytest.mark.parametrize("key,value", [("tp", 0), ("dp", -1), ("moe_ep", 2.0), ("sp", True), ("moe_tp", "4"),
                                       ("worldSize", 0)])
def test_non_positive_integers(key, value):
    assert f"ModelConfig.{key} must be a positive integer, got {value!r}: set it to 1 or more" \
        in refused(entry(**{key: value}))
    assert "ModelConfig.worldSize is missing" in refused(entry(worldSize=None))


def test_dp_tp_must_equal_moe_ep_moe_tp():
    msg = refused(entry(moe_ep=2))
    assert "dp x tp = 2x8 = 16 but moe_ep x moe_tp = 2x4 = 8" in msg
    assert "attention runs over dp x tp ranks and MoE over moe_ep x moe_tp ranks of the same devices: 2x8 == 4x4" \
        in msg


def test_sp_at_most_tp_and_only_1():
    assert "ModelConfig.sp 2 exceeds tp 1: sequence parallelism splits within the tp group; set sp <= tp" \
        in refused(entry(tp=1, dp=2, moe_ep=2, moe_tp=1, worldSize=2, sp=2))
    assert "ModelConfig.sp 2: this engine has no sequence parallelism; set sp to 1" in refused(entry(sp=2))


def test_ranks_a_whole_number_of_nodes():
    # tp x dp may exceed worldSize (multi-node) but must be a multiple of it
    assert "tp x dp = 4x3 = 12 ranks is not a whole number of nodes of worldSize 8 (accelerators per node); " \
           "make tp x dp a multiple of worldSize" in refused(entry(tp=4, dp=3, moe_ep=3, moe_tp=4))
    assert "tp x dp = 4x1 = 4 ranks is not a whole number of nodes" in refused(entry(tp=4, dp=1, moe_ep=1, moe_tp=4))
    cfg = parse_mindie_model_config(entry(tp=8, dp=4, moe_ep=8, moe_tp=4), 32)
    assert cfg.nodes == 4


def test_world_size_per_node():
    assert "worldSize 8 is accelerators per node but this cluster's nodes have 4; set worldSize <= 4" \
        in refused(SEED, 16, gpus_per_node=4)
    assert parse_mindie_model_config(SEED, 16, gpus_per_node=8).nodes == 2


def test_refuse_what_the_devices_cannot_honour():
    one_node = entry(dp=1, moe_ep=2, moe_tp=4)
    assert "worldSize 8 needs 8 accelerators but this cluster reports 4; lower worldSize/tp/dp or add devices" \
        in refused(one_node, 4)
    assert parse_mindie_model_config(one_node, 8).tp == 8
    assert "worldSize 8 x 2 nodes (tp 8 x dp 2 = 16 ranks) needs 16 accelerators but this cluster reports 8; " \
           "lower worldSize/tp/dp or add devices" in refused(SEED, 8)
    # CPU serving (0 devices): one rank only; tp or moe parallelism is refused, never ignored
    msg = refused(SEED, 0)
    assert "needs 16 accelerators but this cluster reports 0; lower worldSize/tp/dp or add devices" in msg
    assert "CPU serving runs one rank" in msg
    assert "needs 2 accelerators but this cluster reports 0" in \
        refused(single(worldSize=2, tp=2, moe_ep=2), 0)
    # ... unless it serves on CPU with a process per rank (cpu=True: devices are the CPU slots)
    two = parse_mindie_model_config(single(worldSize=2, tp=2, moe_ep=2), 2, cpu=True)
    assert (two.replica_parallel(), two.warnings) == ({"tp": 2, "dp": 1, "moe_ep": 2, "moe_tp": 1}, ())
    assert "4 ranks need 4 CPU slots (one process each) but this cluster reports 2" in \
        str(pytest.raises(ValueError, parse_mindie_model_config, single(worldSize=4, tp=4, moe_tp=4), 2, cpu=True).value)
    cpu = parse_mindie_model_config(single(), 0)
    assert (cpu.tp, cpu.dp, cpu.ranks) == (1, 1, 1)
    assert cpu.warnings == ()                          # nz on, nothing sharded
    assert "devices_available must be an integer >= 0" in refused(SEED, -1)


def test_plugin_params():
    assert parse_mindie_model_config(single(plugin_params=None), 0).mtp is False
    assert parse_mindie_model_config(single(plugin_params=""), 0).mtp is False
    assert parse_mindie_model_config(single(plugin_params={"plugin_type": "mtp"}), 0).mtp is True
    two = json.dumps({"plugin_type": "mtp", "num_speculative_tokens": 2})
    assert "num_speculative_tokens is 2 but MindIE allows only one MTP speculative token: set " \
           "num_speculative_tokens to 1" in refused(single(plugin_params=two), 0)
    assert "plugin_params is not valid JSON" in refused(single(plugin_params="{plugin_type: mtp"), 0)
    assert "plugin_type la is not supported by this engine" in \
        refused(single(plugin_params='{"plugin_type": "la"}'), 0)


def test_enable_nz_default_false_and_fa3_warning():
    cfg = parse_mindie_model_config(single(models=None), 0)
    assert cfg.enable_nz is False
    assert len(cfg.warnings) == 1
    assert "MindIE requires enable_nz true with FA3" in cfg.warnings[0]
    assert parse_mindie_model_config(single(models=None), 0, fa3=False).warnings == ()
    assert parse_mindie_model_config(single(models={"deepseekv2": {}}), 0).enable_nz is False
    assert "enable_nz must be true or false" in \
        refused(single(models={"deepseekv2": {"kv_cache_options": {"enable_nz": "yes"}}}), 0)


def test_serve_config_from_mindie():
    from actors.serving.serve_config import DEFAULT_ENGINE, ServeConfig

    sc = ServeConfig.from_mindie({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [SEED]}}}, 16,
                                 port=9001, engine={"num_blocks": 64})
    assert sc.model_path == "/models/dsv3-w8a8" and sc.model_name == "deepseekr1"
    assert sc.llm.num_replicas == 1 and sc.parallel_of("llm").world == 16 and sc.port == 9001
    assert sc.engine.nz is True and sc.engine.mtp is True and sc.engine.num_blocks == 64
    assert sc.engine.block_size == DEFAULT_ENGINE.block_size
    off = ServeConfig.from_mindie(single(models=None, plugin_params=None), 0)
    assert (off.engine.nz, off.engine.mtp, off.llm.num_replicas) == (False, False, 1)
    with pytest.raises(ValueError, match="cluster reports 0"):
        ServeConfig.from_mindie(SEED, 0)
