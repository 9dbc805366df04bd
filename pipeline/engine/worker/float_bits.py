"""A bf16 float checkpoint loaded as the C float kernels hold it (loader.load_float, where they run the
float32 model: :func:`takes`): every bias-free linear stored in bf16 (attention projections, dense MLP,
routed and shared experts, lm_head, the MTP layer's) is read one layer at a time and packed straight from
its stored bits, never widened to float32; those bits are then the only copy of its weight (2 bytes a
value instead of float32's 4 and the packed copy's 2).

- A MoE's experts (and its shared expert, a dense MLP) go into the stacks the float FFN's C call reads
  (cpu_float_ffn.bits_mlps), each expert's linears compact cpu_float.NativeLinear modules over their slot
  of the stack, so the torch path reads the same values back (exactly: the bf16 values widened).
- Every other such linear is a compact NativeLinear of its own bits (NativeLinear.from_bf16).
- Embeddings, norms and the router are float32, as in the float model (pipeline.model.build_model).

The modules are those native_swap.use_native_float_ops makes of the float32 model, with the same bits:
the same outputs. After each layer the heap's free pages are handed back (heap.release).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pipeline.config import DeepseekV3Config
from pipeline.io import heap
from pipeline.engine.native import cpu_float, cpu_float_ffn
from pipeline.engine.native.cpu_float import NativeLinear
from pipeline.io.checkpoint import FP8_NAME, CheckpointReader
from pipeline.model import DeepseekV3ForCausalLM, build_model
from pipeline.model.ffn import MLP, MoE

HEAD = "lm_head.weight"
LEAVES = ("gate_proj", "up_proj", "down_proj")


def takes(reader: CheckpointReader, dtype: torch.dtype, device: str) -> bool:
    """Whether :func:`load` reads ``reader``'s checkpoint: a float32 model on the CPU, the C float linears
    built (cpu_float), and no FP8 weight (those are dequantized to float32 values that bf16 need not hold)."""
    return dtype == torch.float32 and torch.device(device).type == "cpu" and cpu_float.library() is not None \
        and all(reader.header(n)[0] != FP8_NAME for n in reader.tensor_names())


def load(reader: CheckpointReader, with_mtp: bool) -> DeepseekV3ForCausalLM:
    """The float32 model of ``reader``'s checkpoint, its bf16 linears as bits (module docstring); the MTP
    layer when ``with_mtp``."""
    cfg = reader.config
    tensors = reader.read_globals()                          # as stored: bf16 stays bf16 until widened here
    head = tensors.pop(HEAD) if tensors.get(HEAD, torch.empty(0)).dtype == torch.bfloat16 else None
    model = build_model(cfg, tensors, dtype=torch.float32, device="cpu", with_mtp=with_mtp, strict=False)
    del tensors
    if head is not None:
        model.lm_head = NativeLinear.from_bf16(head, f"{reader.path}: {HEAD}")
        del head
    for i in list(range(cfg.num_hidden_layers)) + (cfg.mtp_layer_ids if with_mtp else []):
        _load_layer(model.model.layers[i], f"model.layers.{i}.", reader.read_layer(i), cfg, reader.path)
        heap.release()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"{reader.path}: tensors missing for {missing[:5]}")
    return model


def _load_layer(unit: nn.Module, prefix: str, stored: dict[str, torch.Tensor], cfg: DeepseekV3Config,
                path: str) -> None:
    """Layer ``unit`` (on the meta device) given its ``stored`` tensors (full names, as stored)."""
    stored = {n[len(prefix):]: t for n, t in stored.items()}
    bits = {n[: -len(".weight")] for n, t in stored.items() if n.endswith(".weight") and t.dtype == torch.bfloat16
            and type(unit.get_submodule(n[: -len(".weight")])) is nn.Linear
            and unit.get_submodule(n[: -len(".weight")]).bias is None}
    # the rest first, widened as build_model does (no C module is in the layer yet to see the load)
    unit.load_state_dict({n: t.float() for n, t in stored.items() if n[: -len(".weight")] not in bits},
                         strict=False, assign=True)
    weight = {p: stored.pop(f"{p}.weight") for p in bits}
    del stored
    if cpu_float_ffn.library() is not None:
        _stack_ffns(unit, bits, weight, path + ": " + prefix)
    for p in sorted(bits):
        parent, _, child = p.rpartition(".")
        setattr(unit.get_submodule(parent), child, NativeLinear.from_bf16(weight.pop(p), f"{path}: {prefix}{p}.weight"))


def _stack_ffns(unit: nn.Module, bits: set[str], weight: dict[str, torch.Tensor], where: str) -> None:
    """The layer's MoE (routed and shared experts) or dense MLP whose linears are all in ``bits``, packed into
    the float FFN's stacks and swapped for its C module; their linears taken out of ``bits`` / ``weight``."""

    def stack(names: list[str], mlps: list[MLP]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        linears = [f"{n}.{leaf}" for n in names for leaf in LEAVES]
        if not names or not all(p in bits for p in linears) \
                or not cpu_float_ffn.stackable(weight[linears[0]].shape[0]):
            return None
        bits.difference_update(linears)
        return cpu_float_ffn.bits_mlps(mlps, [tuple(weight.pop(f"{n}.{leaf}") for leaf in LEAVES) for n in names],
                                       [f"{where}{n}." for n in names])

    for name, mod in list(unit.named_modules()):
        parent, _, child = name.rpartition(".")
        if type(mod) is MoE:
            experts = stack([f"{name}.experts.{e}" for e in range(len(mod.experts))], list(mod.experts))
            shared = stack([f"{name}.shared_experts"], [mod.shared_experts]) if mod.shared_experts is not None \
                else None
            if experts is not None and cpu_float_ffn.supported(mod):
                setattr(unit.get_submodule(parent), child, cpu_float_ffn.NativeFloatMoE(mod, (experts, shared)))
        elif type(mod) is MLP and name == "mlp":                # a dense layer's (experts' are the MoE's)
            dense = stack([name], [mod])
            if dense is not None:
                setattr(unit, child, cpu_float_ffn.NativeFloatMLP(mod, dense))
