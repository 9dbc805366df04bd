"""Small random DeepSeek-V3 checkpoints for tests (written with safetensors in the HF layout)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline import layout
from pipeline.config import DeepseekV3Config

FIXTURES = Path(__file__).resolve().parent / "fixtures"   # provenance: fixtures/README.md
TINY_FIXTURE = FIXTURES / "tiny-deepseek-v3"

# The tiny config of docs/deepseek.md ("A tiny config that works"), plus an MTP layer.
TINY = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}


def first_texts(n: int) -> list[str]:
    """The first ``n`` calibration texts of fixtures/calib.json."""
    return json.loads((FIXTURES / "calib.json").read_text())[:n]


def tiny_config(**overrides) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg.update(overrides)
    return cfg


def random_tensors(cfg: DeepseekV3Config, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights of every checkpoint tensor; norms near 1, the router bias float32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in layout.checkpoint_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            out[name] = (torch.rand(shape, generator=g) * 0.1).float()
        elif name.endswith("norm.weight"):
            out[name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            std = 1.0 if "embed_tokens" in name else fan_in ** -0.5
            out[name] = (torch.randn(shape, generator=g) * std).to(dtype)
    return out


def write_checkpoint(path: Path, cfg_dict: dict, seed: int = 0, dtype=torch.bfloat16) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = DeepseekV3Config.from_dict(cfg_dict)
    save_file(random_tensors(cfg, seed, dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    return path


def fail_quantize_layer(monkeypatch, layer: int) -> None:
    """Make the quantizer raise RuntimeError("injected failure in layer N") in the middle of ``layer``
    (after its first piece went to the writer: a crash mid-run, mid-layer, after earlier layers were
    written)."""
    from pipeline.quant.job import run as run_mod

    real = run_mod.quantize_layer_pieces

    def failing(cfg, layer_id, *a, **k):
        for n, piece in enumerate(real(cfg, layer_id, *a, **k)):
            if layer_id == layer and n == 1:
                raise RuntimeError(f"injected failure in layer {layer}")
            yield piece

    monkeypatch.setattr(run_mod, "quantize_layer_pieces", failing)


def split_by_layer(src: Path, dst: Path) -> Path:
    """``src`` (one model.safetensors) rewritten as one file per layer plus one for the globals, with an
    index, so that changing one file changes one layer; config and tokenizer files copied."""
    import shutil

    from safetensors.torch import load_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    groups: dict[str, dict] = {}
    for name, t in tensors.items():
        lid = layout.layer_of(name)
        groups.setdefault("globals" if lid is None else f"layer{lid}", {})[name] = t
    weight_map = {}
    for key, group in sorted(groups.items()):
        fname = f"model-{key}.safetensors"
        save_file(group, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst
