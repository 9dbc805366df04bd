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
from pipeline.engine.worker.loader import (LoadedModel, layer_unit, linears_by_layer, pack_layer, packs_at_load,
                                          read_linears)
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
    """Rank ``comm.rank``'s shard of ``path``, read as ``loader.load_quantized`` reads a whole model: the
    float parts first, then the linears one layer at a time, each layer's int8 linears packed for the C
    kernels before the next is read (the pack their only copy: compact_linears) where those run them."""
    src = QuantizedSource(path)
    cfg, types, p, rank = src.config, src.types, comm.parallel, comm.rank
    p.check_config(cfg)
    kernels = resolve(device)
    parts = held_parts(src, comm, with_mtp)
    quant = {_prefix(n) for n, t in types.items() if n.endswith(".weight") and t in QUANT_KINDS and n in parts}
    split = {_prefix(n) for n in parts if n.endswith(".weight") and _prefix(n) not in quant
             and linear_role(cfg, _prefix(n))[0] != REPLICATED}
    rest = {n: t.to(device) for n, t in src.read({n: s for n, s in parts.items()
                                                   if _prefix(n) not in quant | split}).items()}
    model = build_model(cfg, {n: t for n, t in rest.items() if types.get(n, FLOAT) == FLOAT}, dtype=dtype,
                        device=device, with_mtp=with_mtp and bool(cfg.mtp_layer_ids), strict=False)
    fa_k = {i: float(s.float().reshape(())) for i, s in fa_scales(rest).items()}
    del rest
    names = by_linear(parts)                               # {linear: {leaf: the part held}}
    for layer, prefixes in linears_by_layer(quant | split):
        index = read_linears(src, {f"{q}.{leaf}": s for q in prefixes for leaf, s in names[q].items()}, device)
        for prefix in prefixes:
            _install(model, prefix, index.pop(prefix), prefix in quant, types, cfg, comm, dtype, epilogue, path)
        del index
        unit = layer_unit(model, layer)
        if layer is not None:
            unit.self_attn.H = cfg.num_attention_heads // p.tp
            if isinstance(unit.mlp, MoE):
                unit.mlp = _sharded_moe(unit.mlp, cfg, comm, combine)
        pack_layer(unit, packs_at_load(kernels, device))
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ValueError(f"{path}: rank {rank}: tensors missing for {missing[:5]}")
    # the kernels of this device (the int8 linears take them when built; the float modules stay torch's,
    # as every rank must compute the router identically: sharded.py)
    return LoadedModel(model.eval(), cfg, dict(types), fa_k, path, kernels)


def _install(model: nn.Module, prefix: str, params: dict[str, torch.Tensor], quantized: bool, types, cfg,
             comm: Comm, dtype: torch.dtype, epilogue: str, path: str) -> None:
    """The rank's module for linear ``prefix`` (its held tensors ``params`` by leaf) in place of the meta one."""
    parent_name, _, child = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)     # "" (lm_head): the model itself
    role, group, width = linear_role(cfg, prefix)
    if quantized:
        module: nn.Module = build_int8_linear(prefix, types[prefix + ".weight"], params, epilogue=epilogue)
    else:
        w = params["weight"].to(dtype)
        if role == VOCAB:
            module = (VocabEmbedding(w, part(width, comm.parallel, comm.rank, "tp")[0], comm)
                      if child == "embed_tokens" else VocabHead(w, comm))
        else:
            module = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            module.weight = nn.Parameter(w, requires_grad=False)
    if role == ROW:
        module = RowParallel(module, comm, group)
    elif role == VOCAB and quantized:
        raise ValueError(f"{path}: {prefix} is quantized; a vocab-parallel int8 head is not supported")
    setattr(parent, child, module)


def _expert(mlp: nn.Module) -> nn.Module:
    return Int8Expert(mlp) if is_int8_mlp(mlp) else mlp


def _sharded_moe(moe: MoE, cfg, comm: Comm, combine: str) -> ShardedMoE:
    held = {e: _expert(moe.experts[e]) for e in expert_range(cfg, comm.parallel, comm.rank)}
    shared = _expert(moe.shared_experts) if moe.shared_experts is not None else None
    return ShardedMoE(moe.gate, held, shared, cfg.n_routed_experts, comm, combine)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the rank's model holds, a compact int8 linear's weight (held as
    the C kernels' pack: pipeline.engine.native.cpu_linear.compact) counted as its int8 bytes, a compact
    float linear's (cpu_float.NativeLinear.compact) as its bf16 bits."""
    from pipeline.engine.native import cpu_float, cpu_linear

    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    for m in model.modules():
        if cpu_linear.is_compact(m):
            n += m.out_features * m.in_features                  # int8
        elif isinstance(m, cpu_float.NativeLinear) and m.is_compact():
            n += 2 * m.out_features * m.in_features              # bf16
    return n
