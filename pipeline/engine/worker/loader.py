"""Load a model directory as the engine runs it: :func:`load_model` takes either kind and picks the loader
by what the directory holds (:func:`dir_kind`): a quantized one (quant_model_description.json) goes to
:func:`load_quantized`, a float HF-layout checkpoint (config.json + safetensors) to :func:`load_float`.

A quantized directory (ours, or any the checker accepts) is loaded with the float parts
(embeddings, norms, router, ``kv_b_proj``, the MTP layer when FLOAT) in the compute dtype, every W8A8 and
W8A8_DYNAMIC linear as an :class:`pipeline.engine.layers.qlinear.Int8Linear` that computes with the stored
integers, and each FA3 layer's ``fa_k`` scale for the int8 latent cache.

The quantized linears are never materialized in float: the model is built with those weights on the meta
device and the modules are then replaced. ``epilogue`` picks the int8 linears' epilogue (``exact``, the
reference mode, or ``fast``); with ``fuse_moe`` every MoE whose experts are all W8A8_DYNAMIC runs as
:class:`pipeline.engine.layers.moe.Int8MoE` (one activation quantization per layer, gate and up stacked: the same
output in the reference mode).

A float checkpoint (bf16, fp16, fp32, or the FP8 block-quantized release, dequantized on reading as the
quantizer reads it: pipeline.io.checkpoint) is the float model itself (pipeline.model), every linear an
``nn.Linear`` in the compute dtype, the MTP layer included when the checkpoint has it, and no fa_k scale:
its cache holds the latent in the model's dtype (bf16 for the embedded model), never int8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.model import DeepseekV3ForCausalLM, build_model
from pipeline.io import heap
from pipeline.engine.config import Kernels, resolve
from pipeline.engine.layers.moe import fuse_moe_layers
from pipeline.engine.layers.native_swap import compact_linears, use_kernels
from pipeline.engine.layers.qlinear import EXACT, build_int8_linear, by_linear
from pipeline.engine.native.cpu_float import NativeLinear
from pipeline.format.description import DESCRIPTION_NAME, FLOAT, QUANT_KINDS
from pipeline.format.reader import QuantizedSource, fa_scales
from pipeline.io import storage
from pipeline.io.checkpoint import read_model_config

QUANTIZED, FLOAT_CHECKPOINT = "quantized", "float"
QUANT_WEIGHT_PREFIX = "quant_model_weight"     # msModelSlim's weight files (quant_model_weight_w8a8*.safetensors)
#: The compute dtype of a float checkpoint on the CPU when none is asked for: float32, faster than bf16 at
#: every batch the engine was profiled at (1 to 16 sequences, decode and prefill). A bf16 GEMM alone wins
#: from some rows up, but a step is mostly small ones (an expert sees a few rows), and bf16 adds the casts
#: around the float32 attention and router. So float32 (the bf16 weights widened exactly, the
#: float model's own CPU default, pipeline.model.loading); ``dtype="bfloat16"`` computes in the model's
#: dtype. On CUDA the default is the checkpoint's torch_dtype.
FLOAT_CPU_DTYPE = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: DeepseekV3ForCausalLM
    config: DeepseekV3Config
    types: dict[str, str]
    fa_k: dict[int, float]          # layer id -> the latent's int8 scale (FA3 layers only)
    path: str
    kernels: Kernels = Kernels()    # the kernels its modules run (pipeline.engine.config.resolve)

    @property
    def quantized_linears(self) -> int:
        return sum(1 for n, t in self.types.items() if n.endswith(".weight") and t in QUANT_KINDS)


def load_quantized(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   with_mtp: bool = True, epilogue: str = EXACT, fuse_moe: bool = True,
                   kernels: Optional[Kernels] = None) -> LoadedModel:
    """Validate ``path`` with the checker (refusing what it rejects, with its report) and build the model
    to run ``kernels`` (default: resolved for ``device`` now).

    The quantized linears are read one layer at a time, straight into their modules; where the C kernels
    run them (``kernels.linears``) each layer is packed into their layout before the next is read, the
    pack the only copy of its weights (cpu_linear.compact, cpu_moe.compact). Where the C float kernels run
    the float linears (:func:`bits_at_load`), those are read the same way, each built from its stored bf16
    weight as the kernels' packed bits, never widened (cpu_float.NativeLinear.from_bf16). So the peak while
    loading is the weights once plus about two layers, and no whole-checkpoint copy is ever held."""
    src = QuantizedSource(path)
    cfg, types = src.config, src.types
    kernels = kernels or resolve(device)
    pack_now = packs_at_load(kernels, device)
    quant = {n[: -len(".weight")] for n, t in types.items() if n.endswith(".weight") and t in QUANT_KINDS}
    skip = set() if with_mtp else set(cfg.mtp_layer_ids)
    float_names = [n for n in layout.checkpoint_shapes(cfg)
                   if n in src.where and types.get(n, FLOAT) == FLOAT and n[: -len(".weight")] not in quant]
    # iter_smooth's biases on norms and on linears kept float (a quantized linear's is inside its quant_bias)
    float_names += [n for n in src.where if n.endswith(".bias") and types.get(n, FLOAT) == FLOAT
                    and n[: -len(".bias")] not in quant]
    with_mtp = with_mtp and bool(cfg.mtp_layer_ids)
    bits = bf16_linears(src, cfg, float_names, with_mtp) if bits_at_load(kernels, device, dtype) else set()
    floats = src.read({n: "full" for n in set(float_names) - {f"{p}.weight" for p in bits}
                       if layout.layer_of(n) not in skip})
    model = build_model(cfg, floats, dtype=dtype, device=device, with_mtp=with_mtp, strict=False)
    del floats
    fa_k = {i: float(s.float().reshape(())) for i, s in fa_scales(
        src.read({n: "full" for n in src.where if n.endswith("self_attn.fa_k.scale")})).items()}
    names = by_linear(dict.fromkeys(src.where))          # {linear: {leaf: None}}: each linear's tensor names
    for layer, prefixes in linears_by_layer(quant | bits, skip):
        index = read_linears(src, {f"{p}.{leaf}": "full" for p in prefixes for leaf in names.get(p, ())}, device)
        for prefix in prefixes:
            parent_name, _, child = prefix.rpartition(".")
            parent = model.get_submodule(parent_name)     # "" (lm_head): the model itself
            if not isinstance(getattr(parent, child, None), nn.Linear):
                raise ValueError(f"{path}: {prefix} is typed {types[prefix + '.weight']} but the model has no linear "
                                 f"there")
            params = index.pop(prefix, {})
            setattr(parent, child, NativeLinear.from_bf16(params["weight"], f"{path}: {prefix}.weight")
                    if prefix in bits else build_int8_linear(prefix, types[prefix + ".weight"], params,
                                                             epilogue=epilogue))
        del index
        unit = layer_unit(model, layer)
        if fuse_moe:
            fuse_moe_layers(unit)
        pack_layer(unit, pack_now)
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{path}: tensors missing for {missing[:5]}")
    use_kernels(model, kernels)
    return LoadedModel(model.eval(), cfg, dict(types), fa_k, path, kernels)


def packs_at_load(kernels: Kernels, device: str) -> bool:
    """Whether a loader packs each layer's int8 linears for the C kernels as it reads them (compact_linears):
    where those kernels run them, on the CPU."""
    return kernels.linears and torch.device(device).type == "cpu"


def pack_layer(unit: nn.Module, pack: bool) -> None:
    """The end of a layer's loading: its int8 linears packed for the C kernels, the pack their only copy
    (compact_linears), where ``pack`` (:func:`packs_at_load`); then the heap's free pages handed back (its
    read buffer's and temporaries: heap.release), so that the next layer's peak does not stack on
    them."""
    if pack:
        compact_linears(unit)
    heap.release()


def bits_at_load(kernels: Kernels, device: str, dtype: torch.dtype) -> bool:
    """Whether the float linears the C float kernels run (cpu_float.NativeLinear: a float32 model's bias-free
    linears of bf16 values, native_swap.use_native_float_ops) are built at load straight from their stored
    bf16 weights as compact modules, the bits the only copy, never widened to float32."""
    return kernels.float_ops and torch.device(device).type == "cpu" and dtype == torch.float32


def bf16_linears(src: QuantizedSource, cfg: DeepseekV3Config, float_names: Iterable[str], with_mtp: bool) -> set[str]:
    """The float linears of ``float_names`` that :func:`bits_at_load` builds from their bf16 bits: the
    model's ``nn.Linear`` modules whose weight is stored in bf16, with no bias."""
    with torch.device("meta"):
        meta = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, with_mtp=with_mtp)
    linears = {n for n, m in meta.named_modules() if type(m) is nn.Linear}
    return {n[: -len(".weight")] for n in float_names if n.endswith(".weight") and n[: -len(".weight")] in linears
            and src.where[n].info(n).dtype == "BF16" and n[: -len(".weight")] + ".bias" not in src.where}


def linears_by_layer(prefixes: Iterable[str], skip: Iterable[int] = ()) -> list[tuple[Optional[int], list[str]]]:
    """The linears ``prefixes`` grouped by layer in loading order, those outside a layer (lm_head,
    embed_tokens) first, the layers in ``skip`` left out."""
    out: dict[Optional[int], list[str]] = {}
    skip = set(skip)
    for prefix in sorted(prefixes):
        layer = layout.layer_of(prefix + ".weight")
        if layer not in skip:
            out.setdefault(layer, []).append(prefix)
    return sorted(out.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


def layer_unit(model: DeepseekV3ForCausalLM, layer: Optional[int]) -> nn.Module:
    """The module holding a layer's linears (``None``: the model itself, for lm_head / embed_tokens)."""
    return model if layer is None else model.model.layers[layer]


def read_linears(src: QuantizedSource, parts: Mapping[str, object], device: str) -> dict[str, dict[str, torch.Tensor]]:
    """One layer's linears' tensors (``parts``: name -> what to read, QuantizedSource.read's) by linear and
    leaf, on ``device``: the weights as read, every other tensor copied out of the read buffer it shares
    with the layer's weights (a view would keep the whole buffer alive after the weights are packed)."""
    return {prefix: {leaf: v.to(device) if leaf == "weight" else v.to(device, copy=True) for leaf, v in leaves.items()}
            for prefix, leaves in by_linear(src.read(parts)).items()}


def dir_kind(path: str) -> str:
    """``QUANTIZED`` (quant_model_description.json or msModelSlim weight files present) or
    ``FLOAT_CHECKPOINT`` (config.json and safetensors weights: the index, model.safetensors or any
    *.safetensors); anything else is a ValueError naming the directory and what it holds
    (FileNotFoundError when it is not a directory)."""
    if not storage.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory (a quantized directory or a float checkpoint)")
    entries = set(storage.listdir(path))
    if DESCRIPTION_NAME in entries or any(e.startswith(QUANT_WEIGHT_PREFIX) for e in entries):
        return QUANTIZED    # msModelSlim weights without their description: the checker says what is wrong
    if "config.json" in entries and any(e.endswith(".safetensors") or e == "model.safetensors.index.json"
                                        for e in entries):
        return FLOAT_CHECKPOINT
    shown = sorted(entries)[:8]
    raise ValueError(f"{path}: neither a quantized directory (no {DESCRIPTION_NAME}) nor a float checkpoint "
                     f"(config.json and *.safetensors weights{'' if 'config.json' in entries else ': no config.json'}"
                     f"); it holds {shown or 'nothing'}")


def carries_mtp(path: str) -> bool:
    """Whether the model directory at ``path`` has an MTP layer to draft with, from config.json and the
    description alone (a quantized output of ``--quant_mtp none`` has none). A directory whose files cannot
    be read counts as having one: loading it then says what is wrong."""
    from pipeline.format.reader import carried_model, read_types

    try:
        if dir_kind(path) == QUANTIZED:
            return bool(carried_model(path, read_types(path)).mtp_layer_ids)
        return bool(read_model_config(storage.join(path, "config.json")).mtp_layer_ids)
    except (OSError, ValueError):
        return True


def resolve_float_dtype(dtype, cfg: DeepseekV3Config, device: str) -> torch.dtype:
    """A float checkpoint's compute dtype: a torch dtype or its name; None / "auto": FLOAT_CPU_DTYPE on
    the CPU, the checkpoint's torch_dtype elsewhere (an FP8 release's is bfloat16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return FLOAT_CPU_DTYPE if str(device).startswith("cpu") else getattr(torch, cfg.torch_dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def load_float(path: str, dtype=None, device: str = "cpu", with_mtp: bool = True,
               kernels: Optional[Kernels] = None) -> LoadedModel:
    """A float HF-layout DeepSeek-V3 checkpoint as the engine runs it: the float model (pipeline.model)
    with every tensor checked against the config (pipeline.io.checkpoint.CheckpointReader: a missing,
    unexpected or misshapen tensor, a pickle, NaN/Inf all raise naming the file), FP8 weights dequantized
    on reading, everything in ``dtype`` (:func:`resolve_float_dtype`) but the router bias (float32), the
    MTP layer when the checkpoint has one and ``with_mtp``. No fa_k scales: the engine's cache holds the
    latent in the model's dtype (EngineConfig.cache_dtype; default the config's torch_dtype).
    The default dtype on the CPU is float32 (measured faster there: FLOAT_CPU_DTYPE). Where the C float
    kernels run that model, a bf16 checkpoint's linears are read layer by layer straight into their bf16
    bits, never widened, those bits the only copy (float_bits: the same modules and outputs)."""
    from pipeline.engine.worker import float_bits
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.model.loading import load_model as load_float_model

    cfg = read_model_config(storage.join(path, "config.json"))
    dt = resolve_float_dtype(dtype, cfg, device)
    with_mtp = with_mtp and bool(cfg.mtp_layer_ids)
    kernels = kernels or resolve(device)
    reader = CheckpointReader(path) if kernels.float_ops else None
    if reader is not None and float_bits.takes(reader, dt, device):
        model = float_bits.load(reader, with_mtp)
    else:
        model = load_float_model(path, dtype=dt, device=device, with_mtp=with_mtp)
    types = {n: FLOAT for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    types.update({f"{n}.weight": FLOAT for n, m in model.named_modules() if isinstance(m, NativeLinear) and m.is_compact()})
    use_kernels(model, kernels)
    return LoadedModel(model.eval(), model.config, types, {}, path, kernels)


def load_model(path: str, dtype=None, device: str = "cpu", with_mtp: bool = True,
               kernels: Optional[Kernels] = None, **quantized) -> LoadedModel:
    """Either kind of directory (:func:`dir_kind`): a quantized one with :func:`load_quantized` (``dtype``
    of its float parts, default float32; ``quantized``: its ``epilogue`` / ``fuse_moe``), a float
    checkpoint with :func:`load_float` (``dtype`` default: :func:`resolve_float_dtype`); built to run
    ``kernels`` (default: resolved for ``device`` now)."""
    if dir_kind(path) == QUANTIZED:
        kw = {} if dtype in (None, "auto") else {"dtype": resolve_float_dtype(dtype, None, device)}
        return load_quantized(path, device=device, with_mtp=with_mtp, kernels=kernels, **kw, **quantized)
    if quantized:
        raise ValueError(f"{path}: a float checkpoint takes no quantized-model options ({sorted(quantized)})")
    return load_float(path, dtype=dtype, device=device, with_mtp=with_mtp, kernels=kernels)
