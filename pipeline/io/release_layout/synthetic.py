"""Random-weight DeepSeek-V3 checkpoints at any width: the real model's dimensions (hidden 7168, 128 heads,
MLA 1536/512/128/64, experts of 2048, a dense MLP of 18432) with fewer layers and experts.

Their function is noise, but a layer costs what a real layer costs: the same tensors, shapes and bytes, and
with ``top_k`` 8 (a 16-expert layer routes 8 of 4 groups, + 1 shared) a decode step reads per layer what
the real model's reads. They carry the embedded model's tokenizer, so every job, the engine, the server and
llama.cpp's converter take them as they take the release.

Written one unit at a time (the globals, then each layer: memory of one layer), bf16 or in the release's
FP8 layout (e4m3 128x128 blocks with ``weight_scale_inv``), into ``<dst>.partial`` renamed at the end, so
an interrupted run leaves no directory that looks complete.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.io import storage

#: DeepSeek-V3/R1's dimensions (its config.json), less the counts this module makes smaller.
REAL_WIDTH = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_shared_experts=1, routed_scaling_factor=2.5, scoring_func="sigmoid",
    topk_method="noaux_tc", norm_topk_prob=True, moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-6,
    rope_theta=10000, max_position_embeddings=163840, attention_bias=False, attention_dropout=0.0,
    tie_word_embeddings=False, initializer_range=0.02, bos_token_id=0, eos_token_id=1,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Shape:
    """What to make: ``layers`` decoder layers (the first ``dense`` with a dense MLP, the rest MoE with
    ``experts`` routed experts, ``top_k`` of them per token), ``mtp`` MTP layers, ``vocab`` rows of
    embeddings and head; ``hidden``/``heads``/``expert_width`` override the real width (tests)."""
    layers: int = 3
    experts: int = 16
    top_k: int = 8
    dense: int = 1
    mtp: int = 1
    vocab: int = 4096           # the embedded tokenizer's: every id the model emits detokenizes
    hidden: Optional[int] = None
    heads: Optional[int] = None
    expert_width: Optional[int] = None

    def check(self) -> None:
        for name in ("layers", "experts", "top_k", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.dense <= self.layers:
            raise ValueError(f"--dense must be between 0 and --layers ({self.layers}), got {self.dense}")
        if self.mtp not in (0, 1):
            raise ValueError(f"--mtp must be 0 or 1, got {self.mtp}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        for name in ("hidden", "heads", "expert_width"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {v}")


def groups(experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) as the release routes: 8 groups (fewer for few experts, each of at least 4),
    and enough groups kept (half of them at least, as the release's 4 of 8) to hold ``top_k`` experts."""
    n_group = 1
    for g in (8, 4, 2):
        if experts % g == 0 and experts // g >= 4:
            n_group = g
            break
    size = experts // n_group
    return n_group, min(n_group, max(math.ceil(top_k / size), n_group // 2))


def config(shape: Shape, fp8: bool = False) -> dict:
    """The config.json of a checkpoint of ``shape`` (the release's, with its counts)."""
    shape.check()
    cfg = dict(REAL_WIDTH)
    n_group, topk_group = groups(shape.experts, shape.top_k)
    cfg.update(vocab_size=shape.vocab, num_hidden_layers=shape.layers, first_k_dense_replace=shape.dense,
               n_routed_experts=shape.experts, num_experts_per_tok=shape.top_k, n_group=n_group,
               topk_group=topk_group, num_nextn_predict_layers=shape.mtp,
               torch_dtype="bfloat16")
    if shape.hidden is not None:
        cfg["hidden_size"] = shape.hidden
    if shape.heads is not None:
        cfg["num_attention_heads"] = cfg["num_key_value_heads"] = shape.heads
    if shape.expert_width is not None:
        cfg["moe_intermediate_size"] = shape.expert_width
    if fp8:
        cfg["quantization_config"] = dict(FP8_CONFIG)
    return cfg


def _tensor(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return torch.rand(shape, generator=g) * 0.01                      # float32, as the release stores it
    if name.endswith("norm.weight"):
        return (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    std = 0.02 if len(shape) < 2 or "embed_tokens" in name or name.endswith("head.weight") else shape[-1] ** -0.5
    return torch.randn(shape, generator=g).mul_(std).to(torch.bfloat16)


def layer_bytes(cfg_dict: dict, fp8: bool = False) -> dict:
    """Bytes per unit ('globals', then each layer id) of a checkpoint with this config: what
    :func:`make_checkpoint` writes (FP8 scale tensors included)."""
    from pipeline import layout
    from pipeline.config import DeepseekV3Config

    cfg = DeepseekV3Config.from_dict(cfg_dict)
    out = {}
    for lid in [None] + layout.all_layer_ids(cfg):
        shapes = layout.global_shapes(cfg) if lid is None else layout.layer_shapes(cfg, lid)
        total = 0
        for name, shp in shapes.items():
            n = math.prod(shp)
            if fp8 and layout.is_fp8_quantizable(name):
                total += n + 4 * math.ceil(shp[0] / 128) * math.ceil(shp[1] / 128)
            else:
                total += n * (4 if name.endswith("e_score_correction_bias") else 2)
        out["globals" if lid is None else lid] = total
    return out


def make_checkpoint(dst: str | Path, shape: Shape, fp8: bool = False, seed: int = 0,
                    progress: Optional[Callable[[str], None]] = None) -> int:
    """Write a random checkpoint of ``shape`` to the new directory ``dst``; returns its tensor bytes."""
    from pipeline import layout
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.config import DeepseekV3Config
    from pipeline.io.fp8 import quantize_fp8_blocks
    from pipeline.io.release_layout.fp8_copy import shard_name
    from pipeline.io.safetensors_io import save_safetensors

    cfg_dict = config(shape, fp8)
    cfg = DeepseekV3Config.from_dict(cfg_dict)
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        g = torch.Generator().manual_seed(seed)
        units = [None] + layout.all_layer_ids(cfg)
        weight_map, total = {}, 0
        for n, lid in enumerate(units, start=1):
            shapes = layout.global_shapes(cfg) if lid is None else layout.layer_shapes(cfg, lid)
            tensors = {}
            for name, shp in shapes.items():
                t = _tensor(name, shp, g)
                if fp8 and layout.is_fp8_quantizable(name):
                    tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(t, name=name)
                else:
                    tensors[name] = t
            fname = shard_name(n, len(units))
            total += save_safetensors(tensors, str(tmp / fname))
            weight_map.update({k: fname for k in tensors})
            del tensors
            if progress:
                progress(f"{fname} ({'globals' if lid is None else f'layer {lid}'})")
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        for f in TOKENIZER_FILES:
            shutil.copy(Path(EMBEDDED_MODEL_DIR) / f, tmp / f)
        if dst.exists():
            storage.replace_dir(str(tmp), str(dst))   # the earlier checkpoint kept until this one is in place
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return total
