"""The embedded default model: a tiny DeepSeek-V3 (real MLA widths: kv_lora_rank 512, qk_rope_head_dim 64)
trained in this repo on CPython's own documentation text (scripts/train_embedded.py)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_DIR = str(Path(__file__).resolve().parent / "dsv3-tiny-pydoc")
EMBEDDED_MODEL_NAME = "dsv3-tiny-pydoc"

# The architecture, as written to its config.json. Everything but the MLA widths is shrunk.
EMBEDDED_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 4, "original_max_position_embeddings": 512,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 1,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
