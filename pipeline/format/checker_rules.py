"""The per-tensor rules of the W8A8 + FA3 format (docs/format.md), as pure functions over tensor specs
(name, dtype, shape: a safetensors header's view) and description types. The checker applies them to a
directory; the writer applies them to each layer before writing it.

Per dialect, for a linear whose float weight is [n, k] ("md" = the model dtype, config.json torch_dtype;
"deq" = F32 when md is BF16, I64 (float32 bits) when md is F16):

=================  ====================================================  ===================================
type               seed                                                  ascendV1
=================  ====================================================  ===================================
W8A8               weight I8 [n,k], input_scale md [1], input_offset     weight, input_scale F32, input_offset
                   md [1], quant_bias I32 [n], deq_scale deq [n],        F32, quant_bias, deq_scale: no
                   weight_scale md [n,1], weight_offset md [n,1]         weight_scale/weight_offset
W8A8_DYNAMIC       weight I8 [n,k], weight_scale md [n,1],               weight_scale F32, weight_offset F32
                   weight_offset md [n,1]
FAQuant            fa_q.scale md [heads,1], fa_k/fa_v.scale md [1,1],    scales F32
                   offsets I8 with their scale's shape
FLOAT              any tensor, md or F32; no quantization siblings       same
=================  ====================================================  ===================================

An optional ``bias`` [n] (md or F32, described FLOAT or as its weight) is allowed on quantized linears.
Placement: kv_b_proj, the router (mlp.gate.*), embeddings, heads and every norm are FLOAT; only
``*_proj`` linears may be quantized; FAQuant is for ``self_attn.fa_{q,k,v}.{scale,offset}`` only;
q_a_proj and kv_a_proj_with_mqa of a layer have the same type.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.format.description import ASCEND_V1, FAQUANT, FLOAT, SEED, TENSOR_TYPES, W8A8, W8A8_DYNAMIC
from pipeline.io.safetensors_io import TensorSpec

MD_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # config torch_dtype -> safetensors
QUANT_SIBLINGS = ("input_scale", "input_offset", "quant_bias", "deq_scale", "weight_scale", "weight_offset")
LINEAR_LEAVES = ("weight", "bias") + QUANT_SIBLINGS
FA_NAMES = tuple(f"fa_{x}.{leaf}" for x in "qkv" for leaf in ("scale", "offset"))
_FA_MODULE = re.compile(r"(.*\.self_attn)\.fa_[qkv]")

# leaf -> (dtype policy, shape kind) per (dialect, type); policies resolved by _want_dtype.
_SIBLINGS = {
    (SEED, W8A8): {"weight": ("I8", "nk"), "input_scale": ("md", "1"), "input_offset": ("md", "1"),
                   "quant_bias": ("I32", "n"), "deq_scale": ("deq", "n"),
                   "weight_scale": ("md", "n1"), "weight_offset": ("md", "n1")},
    (ASCEND_V1, W8A8): {"weight": ("I8", "nk"), "input_scale": ("F32", "1"), "input_offset": ("F32", "1"),
                         "quant_bias": ("I32", "n"), "deq_scale": ("deq", "n")},
    (SEED, W8A8_DYNAMIC): {"weight": ("I8", "nk"), "weight_scale": ("md", "n1"), "weight_offset": ("md", "n1")},
    (ASCEND_V1, W8A8_DYNAMIC): {"weight": ("I8", "nk"), "weight_scale": ("F32", "n1"),
                                 "weight_offset": ("F32", "n1")},
}


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``where`` names the file, tensor, module or key; ``rule`` is a short tag."""

    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message} [{self.rule}]"


def split_name(name: str) -> tuple[str, str]:
    """(module, leaf): ``model.layers.0.mlp.gate.e_score_correction_bias`` -> (``...mlp.gate``, ``e_score...``)."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def is_fa_module(module: str) -> bool:
    return _FA_MODULE.fullmatch(module) is not None


def must_be_float(module: str) -> bool:
    """kv_b_proj (vllm-ascend asserts it), the router, embeddings, heads and norms."""
    last = module.rpartition(".")[2]
    return last in ("kv_b_proj", "gate", "embed_tokens", "lm_head", "head") or "norm" in last


def is_quantizable(module: str) -> bool:
    last = module.rpartition(".")[2]
    return last.endswith(("_proj", "_proj_with_mqa")) and not must_be_float(module)


def deq_dtype(md: str) -> str:
    """deq_scale is float32, or int64 holding the float32 bits when the model is fp16."""
    return "I64" if md == "F16" else "F32"


def _want_dtype(policy: str, md: str) -> str:
    return {"md": md, "deq": deq_dtype(md)}.get(policy, policy)


def _want_shape(kind: str, n: int, k: int) -> tuple[int, ...]:
    return {"nk": (n, k), "n": (n,), "n1": (n, 1), "1": (1,)}[kind]


# ----- the rules ---------------------------------------------------------------------------------------
def check_tensors(specs: Mapping[str, TensorSpec], types: Mapping[str, str], dialect: str, md: str,
                  heads: Optional[int] = None) -> list[Violation]:
    """Every per-tensor rule for the tensors that have both a spec and a type. ``md``: the model dtype
    as a safetensors name ("BF16"); ``heads``: num_attention_heads, for fa_q's shape, when known.
    Tensors typed outside TENSOR_TYPES are skipped: reporting them is the caller's part."""
    types = {n: t for n, t in types.items() if t in TENSOR_TYPES}
    out: list[Violation] = []
    modules: dict[str, dict[str, str]] = defaultdict(dict)
    for name in specs:
        if name in types:
            module, leaf = split_name(name)
            modules[module][leaf] = name
    fa_groups: dict[str, list[str]] = defaultdict(list)
    for module, leaves in modules.items():
        m = _FA_MODULE.fullmatch(module)
        if m:
            fa_groups[m.group(1)].extend(leaves.values())
        else:
            out += _check_module(module, leaves, specs, types, dialect, md)
    for attn, names in fa_groups.items():
        out += _check_fa(attn, names, specs, types, dialect, md, heads)
    out += _check_qa_kva(types)
    return out


def _check_module(module: str, leaves: Mapping[str, str], specs: Mapping[str, TensorSpec],
                  types: Mapping[str, str], dialect: str, md: str) -> list[Violation]:
    weight = leaves.get("weight")
    t = types[weight] if weight else FLOAT
    if t == FAQUANT:
        return [Violation("type-placement", weight, "FAQuant is only for self_attn.fa_{q,k,v} tensors")]
    if t == FLOAT:
        out = [Violation("type-placement", n, f"{types[n]} tensor in a FLOAT module (its weight is FLOAT or absent)")
               for n in leaves.values() if types[n] != FLOAT]
        stray = sorted(set(leaves) & set(QUANT_SIBLINGS))
        if stray:
            out.append(Violation("siblings", module, f"a FLOAT layer has quantization tensors {', '.join(stray)}"))
        for n in leaves.values():
            if specs[n].dtype not in (md, "F32"):
                out.append(Violation("dtype", n, f"FLOAT tensor has dtype {specs[n].dtype}; expected {md} "
                                                 f"(the model dtype) or F32"))
        return out

    # a quantized linear
    out = []
    if not is_quantizable(module):
        why = "vllm-ascend asserts kv_b_proj is unquantized" if module.endswith("kv_b_proj") else \
            "the router, embeddings, heads and norms stay FLOAT" if must_be_float(module) else "not a *_proj linear"
        out.append(Violation("float-required", weight, f"is {t} but must be FLOAT ({why})"))
    expected = _SIBLINGS[(dialect, t)]
    missing = [leaf for leaf in expected if leaf not in leaves]
    if missing:
        hint = " (the seed dialect writes weight_scale/weight_offset on static layers too)" \
            if dialect == SEED and t == W8A8 and {"weight_scale", "weight_offset"} & set(missing) else ""
        out.append(Violation("siblings", module, f"{t} layer lacks {', '.join(missing)}{hint}"))
    extra = [leaf for leaf in leaves if leaf not in expected and leaf != "bias"]
    if extra:
        hint = " (ascendV1 writes no weight_scale/weight_offset on static layers)" \
            if dialect != SEED and t == W8A8 and {"weight_scale", "weight_offset"} & set(extra) else ""
        out.append(Violation("siblings", module, f"unexpected {', '.join(extra)} for a {t} layer in the "
                                                 f"{dialect} dialect{hint}"))
    wshape = specs[weight].shape
    if len(wshape) != 2:
        return out + [Violation("shape", weight, f"shape {list(wshape)}, a linear weight is 2-D [n, k]")]
    n, k = wshape
    for leaf, name in leaves.items():
        if leaf == "bias":
            if types[name] not in (FLOAT, t):
                out.append(Violation("type-placement", name, f"bias typed {types[name]}; expected FLOAT or {t}"))
            want_dt, want_shape = (md, "F32"), (n,)
        elif leaf in expected:
            if types[name] != t:
                out.append(Violation("type-placement", name, f"typed {types[name]} but its weight is {t}"))
            policy, kind = expected[leaf]
            want_dt, want_shape = (_want_dtype(policy, md),), _want_shape(kind, n, k)
        else:
            continue
        if specs[name].dtype not in want_dt:
            out.append(Violation("dtype", name, f"dtype {specs[name].dtype}; the {dialect} dialect wants "
                                                f"{' or '.join(want_dt)} for {leaf} of a {t} layer"))
        if tuple(specs[name].shape) != want_shape:
            out.append(Violation("shape", name, f"shape {list(specs[name].shape)}; expected {list(want_shape)}"))
    return out


def _check_fa(attn: str, names: Iterable[str], specs: Mapping[str, TensorSpec], types: Mapping[str, str],
              dialect: str, md: str, heads: Optional[int]) -> list[Violation]:
    out = []
    have = {n[len(attn) + 1:]: n for n in names}
    missing = [x for x in FA_NAMES if x not in have]
    if missing:
        out.append(Violation("fa-tensors", attn, f"FA3 layer lacks {', '.join(missing)}"))
    out += [Violation("fa-tensors", n, "not an FA3 tensor (fa_{q,k,v}.{scale,offset})")
            for x, n in have.items() if x not in FA_NAMES]
    scale_dt = md if dialect == SEED else "F32"
    for x, name in have.items():
        if x not in FA_NAMES:
            continue
        if types[name] != FAQUANT:
            out.append(Violation("type-placement", name, f"typed {types[name]}; FA3 tensors are FAQuant"))
        want_dt = "I8" if x.endswith("offset") else scale_dt
        if specs[name].dtype != want_dt:
            out.append(Violation("dtype", name, f"dtype {specs[name].dtype}; the {dialect} dialect wants {want_dt}"))
        shape = tuple(specs[name].shape)
        if x.startswith("fa_q"):
            ok = len(shape) == 2 and shape[1] == 1 and (heads is None or shape[0] == heads)
            want = f"[{heads if heads is not None else 'num_attention_heads'}, 1] (one scale per head)"
        else:
            ok, want = shape == (1, 1), "[1, 1] (vllm-ascend asserts fa_k/fa_v are per layer)"
        if not ok:
            out.append(Violation("shape", name, f"shape {list(shape)}; expected {want}"))
    return out


def _check_qa_kva(types: Mapping[str, str]) -> list[Violation]:
    out = []
    for name, t in types.items():
        if name.endswith(".self_attn.q_a_proj.weight"):
            other = name.replace(".q_a_proj.", ".kv_a_proj_with_mqa.")
            if other in types and types[other] != t:
                out.append(Violation("qa-kva-type", name.rpartition(".q_a_proj")[0],
                                     f"q_a_proj is {t} but kv_a_proj_with_mqa is {types[other]}; runtimes fuse "
                                     "them, so they must have the same type"))
    return out


def check_layout(specs: Mapping[str, TensorSpec], cfg: DeepseekV3Config) -> list[Violation]:
    """Tensors against ``cfg`` (config.json's, or without the MTP layer when the output carries none of it:
    pipeline.layout.carried_config): every float tensor of the model is there with its shape (a quantized
    weight keeps [n, k]), and nothing is there that the model does not have."""
    out = []
    expected = layout.checkpoint_shapes(cfg)
    for name, shape in expected.items():
        if name not in specs:
            lid = layout.layer_of(name)
            in_mtp = lid is not None and lid >= cfg.num_hidden_layers
            mtp = " (an MTP layer is carried whole or not at all)" if in_mtp else ""
            out.append(Violation("layout-missing", name, f"missing: config.json's model has it{mtp}"))
        elif tuple(specs[name].shape) != tuple(shape):
            out.append(Violation("shape", name, f"shape {list(specs[name].shape)}; config.json gives {list(shape)}"))
    attn = {split_name(n)[0].rpartition(".")[0] for n in expected if ".self_attn." in n}
    for name in specs:
        if name in expected:
            continue
        module, leaf = split_name(name)
        fa = _FA_MODULE.fullmatch(module)
        if (module + ".weight" in expected and leaf in LINEAR_LEAVES) or (fa and fa.group(1) in attn):
            continue
        out.append(Violation("layout-unknown", name, "not a tensor of the model config.json describes"))
    return out
