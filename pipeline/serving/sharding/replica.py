"""A header-only replica of a checkpoint layout: the real DeepSeek-V3 release's 163 shards in seconds.

``make_header_replica(path, cfg_dict)`` writes config.json (with the release's FP8
``quantization_config``), ``model.safetensors.index.json`` and ``model-00001-of-000163.safetensors`` ...
where every shard has a valid safetensors header and the exact size of the real file, but no data: with
``sparse=True`` (the default) the data region is a hole made by truncating the file to its size, so the
688.6 GB layout takes about 10 MB of headers on disk. Anything that reads a weight gets zeros; the
planner, which must not read weights, sees exactly the release's headers.

Tensor dtypes as the release (docs/deepseek.md): every ``*_proj.weight`` under self_attn and mlp
(kv_a_proj_with_mqa included) is F8_E4M3 with an F32 ``_scale_inv`` [ceil(out/128), ceil(in/128)] right
after it; the router bias ``e_score_correction_bias`` is F32; everything else (norms, router weight,
embeddings, heads, eh_proj) BF16. Tensors are laid out in model order (embed, layers 0..60, norm,
lm_head, MTP layer 61) and cut into ``n_shards`` contiguous runs of about equal bytes.

Sparse files are a property of a local filesystem, so this writes local paths with plain file I/O
(test and benchmark support; the pipeline itself only reads through :mod:`pipeline.io.storage`).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

from pipeline import layout
from pipeline.io.checkpoint import CONFIG_NAME, INDEX_NAME, SCALE_SUFFIX
from pipeline.config import DeepseekV3Config
from pipeline.io.fp8 import DEFAULT_BLOCK, scale_shape
from pipeline.io.release_layout.fp8_copy import assign_shards, quantization_config, shard_name
from pipeline.io.safetensors_io import TensorSpec, encode_header

RELEASE_SHARDS = 163
_ZERO_CHUNK = 64 * 1024 * 1024

# config.json of the DeepSeek-V3 release (R1 is the same architecture), without auto_map.
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0,
    "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    "quantization_config": quantization_config(DEFAULT_BLOCK),
}


def release_specs(cfg: DeepseekV3Config) -> list[TensorSpec]:
    """Every tensor of the FP8 release in model order, each FP8 weight followed by its scale."""
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for lid in range(cfg.num_hidden_layers):
        shapes.update(layout.layer_shapes(cfg, lid))
    shapes.update({n: s for n, s in layout.global_shapes(cfg).items() if n != "model.embed_tokens.weight"})
    for lid in cfg.mtp_layer_ids:
        shapes.update(layout.layer_shapes(cfg, lid))
    specs = []
    for name, shape in shapes.items():
        if layout.is_fp8_quantizable(name):
            specs.append(TensorSpec(name, "F8_E4M3", tuple(shape)))
            specs.append(TensorSpec(name + SCALE_SUFFIX, "F32", scale_shape(shape, DEFAULT_BLOCK)))
        else:
            specs.append(TensorSpec(name, "F32" if name.endswith("e_score_correction_bias") else "BF16",
                                    tuple(shape)))
    return specs


def make_header_replica(path: str, cfg_dict: Mapping[str, Any] = DEEPSEEK_V3_CONFIG,
                        n_shards: int = RELEASE_SHARDS, sparse: bool = True) -> dict:
    """Write the replica into local directory ``path`` (created); returns the index written.
    ``sparse=False`` writes the zeros for real (only for small configs)."""
    raw = copy.deepcopy(dict(cfg_dict))
    raw.setdefault("quantization_config", quantization_config(DEFAULT_BLOCK))
    cfg = DeepseekV3Config.from_dict(raw, source=f"{path}/{CONFIG_NAME}")
    specs = release_specs(cfg)
    shard_of = assign_shards([s.nbytes for s in specs], n_shards)
    per_shard: list[list[TensorSpec]] = [[] for _ in range(n_shards)]
    for s, k in zip(specs, shard_of):
        per_shard[k].append(s)
    os.makedirs(path, exist_ok=True)
    names = [shard_name(k + 1, n_shards) for k in range(n_shards)]
    for name, shard in zip(names, per_shard):
        header = encode_header(shard, metadata={"format": "pt"})
        data = sum(s.nbytes for s in shard)
        with open(os.path.join(path, name), "wb") as f:
            f.write(header)
            if sparse:
                f.truncate(len(header) + data)
            else:
                for start in range(0, data, _ZERO_CHUNK):
                    f.write(bytes(min(_ZERO_CHUNK, data - start)))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(raw, f, indent=2)
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
             "weight_map": {s.name: names[k] for s, k in zip(specs, shard_of)}}
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    return index
