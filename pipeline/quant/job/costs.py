"""What each unit of a checkpoint costs, from the index and the safetensors headers alone (no weight read).

A *unit* is what the planner places: ``embed`` (model.embed_tokens), each decoder layer by id (the MTP
layer ``num_hidden_layers`` included) and ``head`` (model.norm + lm_head). For each unit:

    stored_bytes    tensor bytes as stored (FP8 weights + their ``_scale_inv``, bf16 norms, ...): what is read
    float_bytes     bytes once FP8 is dequantized to the model dtype (md, bf16 for DeepSeek); scales consumed,
                    other tensors as stored (the fp32 router bias stays fp32): what the float forward holds
    output_bytes    bytes written in the chosen dialect per docs/format.md: int8 weights, per-channel scales,
                    static activation params, FA3 scales, FLOAT tensors in md (see ``unit_outputs``)
    flops_per_token forward FLOPs of one calibration token (2 per multiply-add), as the float model runs it:
                    attention projections, naive MLA over ``seq_len`` keys (the eager kernel computes the
                    masked full S x S matrix), the absorbed query of the FA3 Q observer, the dense MLP or
                    the router + (num_experts_per_tok + n_shared_experts) experts, lm_head / MTP eh_proj
                    and shared_head; 0 for a unit the calibration forward does not run (the MTP layer
                    unless the recipe quantizes it, the embedding lookup)
    act_bytes       working set of one micro-batch (batch of one, ``seq_len`` tokens) through the unit:
                    fp32 scores + probs and md probs of the eager attention (H*S*S*10 bytes), q/k/v in md,
                    the FA3 observer's absorbed query and its sorted copy in fp32, the MLP intermediates,
                    the logits (fp32 + md) of a head, and the unit's input/output hidden states
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pipeline import layout
from pipeline.io.checkpoint import SCALE_SUFFIX, CheckpointReader, read_dtype
from pipeline.config import DeepseekV3Config
from pipeline.quant.writing.quantize_layer import layer_output_specs
from pipeline.quant.recipe.recipe import Recipe
from pipeline.io.safetensors_io import CheckpointError, itemsize

EMBED, HEAD = "embed", "head"
MD_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Bytes per element of the eager attention's S x S intermediates: fp32 scores, fp32 softmax, md probs.
ATTN_MATRIX_BYTES = 4 + 4 + 2


@dataclass(frozen=True)
class LayerCost:
    unit: str                   # "embed", "0", ..., "head", "61"
    layer_id: Optional[int]     # None for embed / head
    stored_bytes: int
    float_bytes: int
    output_bytes: int
    output_tensors: int
    flops_per_token: float
    act_bytes: int
    forward: bool               # does the calibration forward run it (and so hold its weights)?
    files: tuple[str, ...]      # source files holding its tensors (base names)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["files"] = list(self.files)
        return d

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "LayerCost":
        kw = dict(raw)
        kw["files"] = tuple(kw["files"])
        return cls(**kw)


def unit_names(cfg: DeepseekV3Config) -> list[str]:
    """Units in model order: embed, main layers, head, MTP layers."""
    main = [str(i) for i in range(cfg.num_hidden_layers)]
    return [EMBED, *main, HEAD, *(str(i) for i in cfg.mtp_layer_ids)]


def unit_of(name: str) -> str:
    """The unit a tensor name belongs to."""
    lid = layout.layer_of(name)
    if lid is not None:
        return str(lid)
    return EMBED if name.startswith("model.embed_tokens.") else HEAD


def _expected(cfg: DeepseekV3Config, unit: str) -> dict[str, tuple]:
    if unit == EMBED:
        return {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    if unit == HEAD:
        return {n: s for n, s in layout.global_shapes(cfg).items() if n != "model.embed_tokens.weight"}
    return layout.layer_shapes(cfg, int(unit))


# ----- output tensors ---------------------------------------------------------------------------------
def unit_outputs(cfg: DeepseekV3Config, unit: str, stored: Mapping[str, str], recipe: Recipe) -> list[tuple[str, int]]:
    """(name, nbytes) of every tensor the unit writes, in the order quantize_layer / to_dialect emit them.

    ``stored``: tensor name -> stored safetensors dtype ("F8_E4M3", "BF16", "F32", ...). The tensors are
    :func:`~pipeline.quant.writing.quantize_layer.layer_output_specs` of what the reader gives (a FLOAT tensor in
    md when stored FP8, else as stored; ascendV1 writes the router bias in md and the MTP-only tensors in
    float32; deq_scale is float32 when md is bf16, else an int64 bit pattern)."""
    shapes = _expected(cfg, unit)
    inputs = {n: (read_dtype(n, stored[n], cfg.torch_dtype), s) for n, s in shapes.items()}
    lid = None if unit in (EMBED, HEAD) else int(unit)
    return [(s.name, s.nbytes) for s in layer_output_specs(cfg, lid, inputs, recipe)]


# ----- compute and activations ------------------------------------------------------------------------
def _attention(cfg: DeepseekV3Config, fa: bool, S: int) -> tuple[float, int]:
    """(FLOPs per token, working-set bytes of S tokens) of one MLA block, naive form."""
    h, H, C = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    macs = (h * cfg.q_lora_rank + cfg.q_lora_rank * H * (dn + dr)) if cfg.q_lora_rank else h * H * (dn + dr)
    macs += h * (C + dr) + C * H * (dn + dv) + H * dv * h      # kv_a, kv_b, o_proj
    macs += S * H * ((dn + dr) + dv)                           # scores and P @ V over S keys
    if fa:
        macs += H * dn * C                                     # FA3 Q observer: absorbed query
    mdb = itemsize(MD_NAMES[cfg.torch_dtype])
    act = H * S * S * ATTN_MATRIX_BYTES + S * H * (2 * (dn + dr) + dn + 2 * dv) * mdb
    if fa:
        act += 2 * S * H * C * 4
    return 2.0 * macs, act


def _mlp(cfg: DeepseekV3Config, lid: int, S: int) -> tuple[float, int]:
    h, mdb = cfg.hidden_size, itemsize(MD_NAMES[cfg.torch_dtype])
    if cfg.is_moe_layer(lid):
        active = cfg.num_experts_per_tok + cfg.n_shared_experts
        macs = h * cfg.n_routed_experts + 3 * h * cfg.moe_intermediate_size * active
        act = S * (active * 3 * cfg.moe_intermediate_size * mdb + cfg.n_routed_experts * 4 * 2)
    else:
        macs = 3 * h * cfg.intermediate_size
        act = S * 3 * cfg.intermediate_size * mdb
    return 2.0 * macs, act


def _compute(cfg: DeepseekV3Config, unit: str, recipe: Recipe, S: int, calibrates: bool = True
             ) -> tuple[float, int, bool]:
    """(FLOPs per token, activation bytes of a micro-batch, run by the calibration forward). A data-free
    recipe (``calibrates`` False: Recipe.needs_calibration) runs no forward: nothing to compute or hold."""
    if not calibrates:
        return 0.0, 0, False
    h, V = cfg.hidden_size, cfg.vocab_size
    mdb = itemsize(MD_NAMES[cfg.torch_dtype])
    hidden = 2 * S * h * mdb  # the unit's input and output
    if unit == EMBED:
        return 0.0, hidden, True
    if unit == HEAD:
        return 2.0 * h * V, hidden + S * V * (4 + mdb), True
    lid = int(unit)
    if not recipe.quantized_layer(cfg, lid):
        return 0.0, 0, False
    af, aa = _attention(cfg, recipe.fa_layer(cfg, lid), S)
    mf, ma = _mlp(cfg, lid, S)
    flops, act = af + mf, max(aa, ma) + hidden
    if lid >= cfg.num_hidden_layers:  # MTP: enorm/hnorm, eh_proj over [e, h], shared_head
        flops += 2.0 * (2 * h) * h + 2.0 * h * V
        act = max(act, hidden + S * V * (4 + mdb)) + S * 2 * h * mdb
    return flops, act, True


# ----- from headers -----------------------------------------------------------------------------------
def unit_costs(reader: CheckpointReader, recipe: Recipe, seq_len: int
               ) -> tuple[list[LayerCost], dict[str, list[tuple[str, int]]]]:
    """(costs in unit order, unit -> its output tensors (name, nbytes)) from headers only.

    Raises :class:`CheckpointError` naming the tensor when a tensor the config needs is missing or has
    another shape, or a stored tensor belongs to no unit of the config."""
    cfg = reader.config
    recipe.check_config(cfg)
    md = MD_NAMES[cfg.torch_dtype]
    units = unit_names(cfg)
    stored: dict[str, dict[str, tuple[str, tuple, int]]] = {u: {} for u in units}  # name -> dtype, shape, bytes
    files: dict[str, set[str]] = {u: set() for u in units}
    for name in reader.tensor_names():
        u = unit_of(name)
        if u not in stored:
            raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} belongs to no layer of the config "
                                  f"(units: embed, 0..{cfg.num_hidden_layers - 1}, head, MTP {cfg.mtp_layer_ids})")
        dt, shape = reader.header(name)
        stored[u][name] = (dt, tuple(shape), math.prod(shape) * itemsize(dt))
        files[u].add(reader.file_of(name))
    costs, outputs = [], {}
    calibrates = recipe.needs_calibration(cfg)
    expected_of = {u: _expected(cfg, u) for u in units}
    for u in units:
        expected = expected_of[u]
        for name, shape in expected.items():
            if name not in stored[u]:
                raise CheckpointError(f"{reader.path}: tensor {name!r} is missing (unit {u} needs it)")
            if stored[u][name][1] != tuple(shape):
                raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r}: shape {list(stored[u][name][1])} "
                                      f"does not match the config (expected {list(shape)})")
        float_bytes = sum(math.prod(s) * itemsize(md if stored[u][n][0] == "F8_E4M3" else stored[u][n][0])
                          for n, s in expected.items())
        outs = unit_outputs(cfg, u, {n: v[0] for n, v in stored[u].items()}, recipe)
        flops, act, fwd = _compute(cfg, u, recipe, seq_len, calibrates)
        outputs[u] = outs
        costs.append(LayerCost(
            unit=u, layer_id=None if u in (EMBED, HEAD) else int(u),
            stored_bytes=sum(v[2] for v in stored[u].values()), float_bytes=float_bytes,
            output_bytes=sum(b for _, b in outs), output_tensors=len(outs), flops_per_token=flops,
            act_bytes=act, forward=fwd, files=tuple(sorted(f.rsplit("/", 1)[-1] for f in files[u]))))
    unused = [n for u in units for n in stored[u] if n not in expected_of[u]
              and not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in stored[u])]
    if unused:
        raise CheckpointError(f"{reader.file_of(unused[0])}: tensor {unused[0]!r} is not part of the config "
                              f"({len(unused)} unexpected: {unused[:5]})")
    return costs, outputs
