"""config.json parsing: what DeepSeek-V3 needs is required and checked; the rest round-trips."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, DeepseekV3Config
from tiny import FIXTURES, TINY_FIXTURE, tiny_config
from pipeline.io.checkpoint import read_model_config


def test_fixture_and_round_trip():
    raw = json.loads((TINY_FIXTURE / "config.json").read_text())
    cfg = DeepseekV3Config.from_dict(raw)
    assert cfg.kv_lora_rank == 48 and cfg.mtp_layer_ids == [3]
    assert cfg.rope_scaling.factor == 40 and cfg.rope_scaling.original_max_position_embeddings == 4096
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    again = DeepseekV3Config.from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.to_dict()["architectures"] == ["DeepseekV3ForCausalLM"]   # unknown keys kept


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "deepseekv2"])
def test_mindie_model_type_variants(model_type):
    assert DeepseekV3Config.from_dict(tiny_config(model_type=model_type)).model_type == model_type


def test_msmodelslim_output_config_parses():
    cfg = read_model_config(str(FIXTURES / "msmodelslim-v1-bf16" / "config.json"))
    assert cfg.num_hidden_layers == 3


def test_fp8_quantization_config():
    raw = tiny_config(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    assert DeepseekV3Config.from_dict(raw).fp8_block_size == (128, 128)
    assert DeepseekV3Config.from_dict(tiny_config()).fp8_block_size is None


def test_transformers5_rope_parameters_spelling():
    raw = tiny_config()
    rs = raw.pop("rope_scaling")
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000, **{k: v for k, v in rs.items() if k != "type"}}
    cfg = DeepseekV3Config.from_dict(raw)
    assert cfg.rope_scaling.factor == 40 and cfg.rope_theta == 10000


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not a DeepSeek-V3 model"),
    ({"kv_lora_rank": "512"}, "field 'kv_lora_rank' must be an integer, got '512'"),
    ({"hidden_size": 0}, "field 'hidden_size' must be > 0"),
    ({"n_group": 3}, r"n_routed_experts \(8\) must be a multiple of n_group \(3\)"),
    ({"topk_group": 5}, r"topk_group \(5\) must be in 1..n_group \(4\)"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be in 1..topk_group\*experts_per_group \(4\)"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' unsupported"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' unsupported"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling type 'linear' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 40}}, "rope_scaling: required field 'original_max_position_embeddings'"),
    ({"torch_dtype": "int8"}, "torch_dtype 'int8' is not one of"),
    ({"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' must be a finite number"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt 'e5m2' unsupported"),
])
def test_bad_fields_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV3Config.from_dict(tiny_config(**change), source="x/config.json")


def test_missing_field_names_file_and_field(tmp_path):
    raw = tiny_config()
    del raw["kv_lora_rank"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"{p}: required field 'kv_lora_rank' is missing"):
        read_model_config(str(p))


def test_invalid_json_names_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match=f"{p}: not valid JSON"):
        read_model_config(str(p))
