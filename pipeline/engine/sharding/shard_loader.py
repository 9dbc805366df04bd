"""Load one rank's shard of a quantized directory (pipeline.parallel's layout; slices: shard_spec).

The rank reads only what it holds: the replicated tensors whole, its experts only, a column-parallel
weight's rows with one ranged read, a row-parallel weight's columns (read whole one tensor at a time,
the copy of its columns kept). The model is built on the meta device as in ``loader.load_quantized``;
the split modules are then installed (pipeline.engine.sharding.sharded): no rank ever holds the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline import layout
from pipeline.engine.config import resolve
from pipeline.engine.sharding.comm import Comm
from pipeline.engine.worker.loader import LoadedModel
from pipeline.engine.layers.moe import Int8Expert, is_int8_mlp
from pipeline.engine.layers.qlinear import EXACT, build_int8_linear, by_linear
from pipeline.engine.sharding.shard_spec import REPLICATED, ROW, VOCAB, expert_range, linear_role, part, tensor_slice
from pipeline.engine.sharding.sharded import REDUCE, RowParallel, ShardedMoE, VocabEmbedding, VocabHead
from pipeline.format.description import FLOAT, QUANT_KINDS
from pipeline.format.reader import QuantizedSource, fa_scales
from pipeline.model import build_model
from pipeline.model.ffn import MoE


def _prefix(name: str) -> str:
    return name.rpartition(".")[0]


def held_parts(src: QuantizedSource, comm: Comm, with_mtp: bool) -> dict[str, object]:
    """name -> the part of it this rank reads."""
    cfg, out = src.config, {}
    for n in src.where:
        if not with_mtp and layout.layer_of(n) in cfg.mtp_layer_ids:
            continue
        s = tensor_slice(cfg, comm.parallel, comm.rank, n)
        if s is not None:
            out[n] = s
    return out


def load_sharded(path: str, comm: Comm, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 with_mtp: bool = True, epilogue: str = EXACT, combine: str = REDUCE) -> LoadedModel:
    src = QuantizedSource(path)
    cfg, types, p, rank = src.config, src.types, comm.parallel, comm.rank
    p.check_config(cfg)
    tensors = {n: t.to(device) for n, t in src.read(held_parts(src, comm, with_mtp)).items()}
    quant = {_prefix(n) for n, t in types.items() if n.endswith(".weight") and t in QUANT_KINDS and n in tensors}
    split = {_prefix(n) for n in tensors if n.endswith(".weight") and _prefix(n) not in quant
             and linear_role(cfg, _prefix(n))[0] != REPLICATED}
    floats = {n: t for n, t in tensors.items() if types.get(n, FLOAT) == FLOAT and _prefix(n) not in quant
              and _prefix(n) not in split}
    model = build_model(cfg, floats, dtype=dtype, device=device, with_mtp=with_mtp and bool(cfg.mtp_layer_ids),
                        strict=False)
    index = by_linear(tensors)
    for prefix in sorted(quant | split):
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)     # "" (lm_head): the model itself
        role, group, width = linear_role(cfg, prefix)
        if prefix in quant:
            module: nn.Module = build_int8_linear(prefix, types[prefix + ".weight"], index.get(prefix, {}),
                                                  epilogue=epilogue)
        else:
            w = tensors[prefix + ".weight"].to(dtype)
            if role == VOCAB:
                module = (VocabEmbedding(w, part(width, p, rank, "tp")[0], comm) if child == "embed_tokens"
                          else VocabHead(w, comm))
            else:
                module = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                module.weight = nn.Parameter(w, requires_grad=False)
        if role == ROW:
            module = RowParallel(module, comm, group)
        elif role == VOCAB and prefix in quant:
            raise ValueError(f"{path}: {prefix} is quantized; a vocab-parallel int8 head is not supported")
        setattr(parent, child, module)
    for layer in model.model.layers:
        layer.self_attn.H = cfg.num_attention_heads // p.tp
        if isinstance(layer.mlp, MoE):
            layer.mlp = _sharded_moe(layer.mlp, cfg, comm, combine)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ValueError(f"{path}: rank {rank}: tensors missing for {missing[:5]}")
    fa_k = {i: float(s.float().reshape(())) for i, s in fa_scales(tensors).items()}
    # the kernels of this device (the int8 linears take them when built; the float modules stay torch's,
    # as every rank must compute the router identically: sharded.py)
    return LoadedModel(model.eval(), cfg, dict(types), fa_k, path, resolve(device))


def _expert(mlp: nn.Module) -> nn.Module:
    return Int8Expert(mlp) if is_int8_mlp(mlp) else mlp


def _sharded_moe(moe: MoE, cfg, comm: Comm, combine: str) -> ShardedMoE:
    held = {e: _expert(moe.experts[e]) for e in expert_range(cfg, comm.parallel, comm.rank)}
    shared = _expert(moe.shared_experts) if moe.shared_experts is not None else None
    return ShardedMoE(moe.gate, held, shared, cfg.n_routed_experts, comm, combine)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the rank's model holds, a compact int8 linear's weight (held as
    the C kernels' pack: pipeline.engine.native.cpu_linear.compact) counted as its int8 bytes."""
    from pipeline.engine.native import cpu_linear

    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    return n + sum(m.out_features * m.in_features for m in model.modules() if cpu_linear.is_compact(m))
