"""The quantization recipe and DeepSeek-V3/R1's type mix (docs/format.md, "Which layer gets which type").

By default (no ``linear_rules``), msModelSlim's DeepSeek mix:

    W8A8          self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj} (q_proj when q_lora_rank is null)
    W8A8_DYNAMIC  every Linear under mlp. (dense MLP, shared experts, routed experts); with ``dynamic``,
                  the attention linears above too
    FLOAT         self_attn.kv_b_proj, the router mlp.gate, every norm, embeddings, heads, eh_proj
    FAQuant       self_attn.fa_q / fa_k / fa_v when ``fa_quant`` and the layer is not in ``fa_exclude_layers``

``linear_rules`` (a modelslim_v1 recipe's ``linear_quant`` entries, pipeline.quant.recipe.linear_rules) replace that
mix: the first rule whose include / exclude patterns match a linear's name decides its type; a linear no rule
matches stays FLOAT. Only the linears of ``self_attn`` and ``mlp`` (not the router) can be quantized in this
format. ``fa_include`` / ``fa_exclude`` (``fa3_quant``'s patterns) match the attention module's name
(``model.layers.N.self_attn``). ``steps`` are the pre-processing steps run before calibration, in order
(pipeline.quant.recipe.steps: quarot, iter_smooth, flex_smooth_quant).

The MTP layer (id >= num_hidden_layers) follows the same rules when ``quantize_mtp``, else it is all
FLOAT (and gets no FA3). Its MTP-only modules (embed_tokens, enorm, hnorm, eh_proj, shared_head.*) are
always FLOAT. ``drop_mtp`` (msModelSlim's ``--quant_mtp none``) leaves the MTP layer out altogether: the job
reads its source without it (``CheckpointReader(..., with_mtp=False)``), so it is neither loaded,
calibrated nor written, and no description entry names it; config.json stays the source's.
``smooth`` (the exact per-channel fold of the latent, docs/deepseek.md) changes only FLOAT tensors and is
applied to the float weights before calibration, not here. ``mlp_smooth_layers`` (with
``mlp_smooth_alpha``) smooths those main layers' post_attention_layernorm into the MLP's gate/up linears and
the router by power-of-two scales (pipeline.quant.transforms.mlp_smooth), in msModelSlim's passes after the
recipe's steps: the types stay as they are, the norm and router weights change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.format.description import DIALECTS, FAQUANT, FLOAT, W8A8
from pipeline.quant.numerics.products import AUTO, MODEL, check_products
from pipeline.quant.recipe.patterns import selected
from pipeline.quant.recipe.linear_rules import LinearRule, default_rules, rule_from_dict
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.steps import Step, step_fingerprint, step_from_dict
from pipeline.strict import build

# msmodelslim: layer by layer, each layer calibrated on the previous layers' fake-quantized outputs, with
#              DeepSeek's modeling arithmetic, as msModelSlim's v1 runner (pipeline.quant.calibration.layer_passes)
# float:       the float model's activations in one pass (pipeline.quant.calibration.calibrate): no barrier between
#              layers, so pipeline stages calibrate in parallel; close to msModelSlim, not equal
MSMODELSLIM, FLOAT_PASS = "msmodelslim", "float"
CALIBRATIONS = (MSMODELSLIM, FLOAT_PASS)
STATIC_ATTN = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "q_proj")
FA_BRANCHES = ("fa_q", "fa_k", "fa_v")


@dataclass(frozen=True)
class Recipe:
    fa_quant: bool = True
    dynamic: bool = False
    fa_exclude_layers: tuple[int, ...] = ()
    quantize_mtp: bool = False
    drop_mtp: bool = False          # the MTP layer not read, calibrated or written (``--quant_mtp none``)
    dialect: str = "seed"
    smooth: bool = False
    q_ratio: float = 0.9999
    k_ratio: float = 0.9999
    v_ratio: float = 1.0
    calib_products: str = AUTO      # how the calibration forward multiplies in bf16/fp16 (pipeline.quant.numerics.products)
    linear_rules: tuple[LinearRule, ...] = ()   # () : the default mix above
    fa_include: tuple[str, ...] = ("*",)
    fa_exclude: tuple[str, ...] = ()
    steps: tuple[Step, ...] = ()
    calibration: str = MSMODELSLIM  # how activations propagate while calibrating (CALIBRATIONS)
    mlp_smooth_layers: tuple[int, ...] = ()   # main layers whose MLP input is smoothed (transforms.mlp_smooth)
    mlp_smooth_alpha: float = 0.5

    def __post_init__(self):
        check_products(self.calib_products)
        if self.calibration not in CALIBRATIONS:
            raise QuantError(f"recipe: field 'calibration' must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if not all(isinstance(r, LinearRule) for r in self.linear_rules):
            object.__setattr__(self, "linear_rules", tuple(
                r if isinstance(r, LinearRule) else rule_from_dict(r, f"recipe: linear_rules[{k}]")
                for k, r in enumerate(self.linear_rules)))
        if not all(isinstance(st, Step.__args__) for st in self.steps):
            object.__setattr__(self, "steps", tuple(
                st if isinstance(st, Step.__args__) else step_from_dict(st, f"recipe: steps[{k}]")
                for k, st in enumerate(self.steps)))
        for f in ("fa_include", "fa_exclude"):
            v = getattr(self, f)
            if isinstance(v, str) or not all(isinstance(x, str) and x for x in v):
                raise QuantError(f"recipe: field '{f}' must be a list of module-name patterns, got {v!r}")
        for f in ("fa_quant", "dynamic", "quantize_mtp", "drop_mtp", "smooth"):
            if not isinstance(getattr(self, f), bool):
                raise QuantError(f"recipe: field '{f}' must be a boolean, got {getattr(self, f)!r}")
        if self.quantize_mtp and self.drop_mtp:
            raise QuantError("recipe: fields 'quantize_mtp' and 'drop_mtp' are both true: the MTP layer is either "
                             "quantized or left out")
        if self.dialect not in DIALECTS:
            raise QuantError(f"recipe: field 'dialect' must be one of {DIALECTS}, got {self.dialect!r}")
        for f in ("q_ratio", "k_ratio", "v_ratio"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise QuantError(f"recipe: field '{f}' must be a number in (0, 1], got {v!r}")
        ex = self.fa_exclude_layers
        if not isinstance(ex, (tuple, list)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                    for i in ex):
            raise QuantError(f"recipe: field 'fa_exclude_layers' must be a list of layer ids >= 0, got {ex!r}")
        if len(set(ex)) != len(ex):
            raise QuantError(f"recipe: field 'fa_exclude_layers' repeats a layer: {list(ex)}")
        object.__setattr__(self, "fa_exclude_layers", tuple(sorted(ex)))
        ms = self.mlp_smooth_layers
        if not isinstance(ms, (tuple, list)) or len(set(ms)) != len(ms) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ms):
            raise QuantError(f"recipe: field 'mlp_smooth_layers' must be a list of distinct layer ids >= 0, got {ms!r}")
        object.__setattr__(self, "mlp_smooth_layers", tuple(sorted(ms)))
        a = self.mlp_smooth_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise QuantError(f"recipe: field 'mlp_smooth_alpha' must be a number in [0, 1], got {a!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Recipe":
        """Strict: unknown keys raise; missing keys take the defaults."""
        return build(cls, raw, "recipe", QuantError)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fa_exclude_layers"] = list(self.fa_exclude_layers)
        d["mlp_smooth_layers"] = list(self.mlp_smooth_layers)
        d["linear_rules"] = [r.to_dict() for r in self.linear_rules]
        d["fa_include"], d["fa_exclude"] = list(self.fa_include), list(self.fa_exclude)
        d["steps"] = [step_fingerprint(st) for st in self.steps]
        return d

    def fingerprint(self) -> dict:
        """What a rerun compares (pipeline.quant.job.job_state): ``to_dict`` without ``calib_products`` when it is
        ``auto``, and without the rule, pattern, step and ``drop_mtp`` fields while they hold their defaults.
        Auto resolves per machine anyway (the same recipe gives fp32 products on one CPU and bf16 on another,
        both valid), and outputs written before a field existed then stay up to date: a scheduled requantize
        after an upgrade rewrites nothing. Anything else that changes (a step, a rule, a pattern) is compared."""
        d = self.to_dict()
        if d["calib_products"] == AUTO:
            del d["calib_products"]
        for f in ("linear_rules", "fa_include", "fa_exclude", "steps", "drop_mtp", "mlp_smooth_layers",
                  "mlp_smooth_alpha"):
            if getattr(self, f) == getattr(Recipe, f):
                del d[f]
        return d

    @property
    def products(self) -> str:
        """The calibration forward's products mode in force: ``calib_products``, except that ``auto`` is
        ``model`` for msModelSlim's passes (its parameters are min / max of bf16 activations: fp32 GEMMs move
        some of them off msModelSlim's by a rounding; the float calibration keeps ``auto``'s speed choice)."""
        if self.calib_products == AUTO and self.calibration == MSMODELSLIM:
            return MODEL
        return self.calib_products

    @property
    def rules(self) -> tuple[LinearRule, ...]:
        """The linear rules in force: ``linear_rules``, or the default mix; with ``dynamic`` every W8A8
        rule's linears are W8A8_DYNAMIC."""
        rules = self.linear_rules or default_rules()
        return tuple(r.dynamic() for r in rules) if self.dynamic else rules

    def linear_kind(self, name: str) -> str:
        """The type of linear ``name`` (``model.layers.N.self_attn.o_proj``...) under the rules, ignoring
        whether its layer is quantized (see :meth:`layer_types`): W8A8, W8A8_DYNAMIC or FLOAT."""
        if not layout.is_quantizable_linear(name):
            return FLOAT
        for rule in self.rules:
            if rule.matches(name):
                return rule.kind
        return FLOAT

    def quantized_layer(self, cfg: DeepseekV3Config, layer_id: int) -> bool:
        """Is layer ``layer_id`` quantized (and so calibrated)? Every main layer; the MTP layer when
        ``quantize_mtp``."""
        return layer_id < cfg.num_hidden_layers or self.quantize_mtp

    def calibrated_layers(self, cfg: DeepseekV3Config) -> list[int]:
        """The layers whose statistics a job collects: the quantized ones (:meth:`quantized_layer`)."""
        return [i for i in (*range(cfg.num_hidden_layers), *cfg.mtp_layer_ids) if self.quantized_layer(cfg, i)]

    def fa_pattern_layer(self, layer_id: int) -> bool:
        """Whether ``fa_include`` / ``fa_exclude`` let layer ``layer_id``'s attention have FA3."""
        name = f"{layout.layer_prefix(layer_id)}self_attn"
        return selected(name, self.fa_include, self.fa_exclude)

    def check_config(self, cfg: DeepseekV3Config) -> None:
        """Every excluded layer must exist in the model."""
        ids = layout.all_layer_ids(cfg)
        bad = [i for i in self.fa_exclude_layers if i not in ids]
        if bad:
            mtp = "the MTP layer left out (drop_mtp)" if self.drop_mtp else "MTP included"
            raise QuantError(f"recipe: fa_exclude_layers {bad} not in the model (layers 0..{ids[-1]}, {mtp})")
        bad = [i for i in self.mlp_smooth_layers if i >= cfg.num_hidden_layers]
        if bad:
            raise QuantError(f"recipe: mlp_smooth_layers {bad} are not main layers of the model "
                             f"(0..{cfg.num_hidden_layers - 1}; the MTP layer is never smoothed)")

    def fa_layer(self, cfg: DeepseekV3Config, layer_id: int) -> bool:
        """Does ``layer_id`` get FA3 tensors?"""
        return bool(self.fa_quant and layer_id not in self.fa_exclude_layers and self.fa_pattern_layer(layer_id)
                    and self.quantized_layer(cfg, layer_id))

    @property
    def ascend_dialect(self) -> bool:
        """Does the output follow vllm-ascend's ascendV1 naming (float32 scales, quant_bias / deq_scale
        pairs; docs/format.md) rather than the seed's?"""
        return self.dialect == "ascendV1"

    def writes_fa3(self, cfg: Optional[DeepseekV3Config]) -> bool:
        """Does any layer of the model ``cfg`` get FA3 tensors (every layer, the MTP layer(s) included)?
        Without a config: does the recipe ask for FA3 at all."""
        if cfg is None:
            return bool(self.fa_quant)
        return any(self.fa_layer(cfg, i) for i in range(cfg.num_hidden_layers + len(cfg.mtp_layer_ids)))

    def needs_calibration(self, cfg: DeepseekV3Config) -> bool:
        """Does any output depend on activations? Static W8A8 linears (input scale and offset), FA3
        (its scales) and smoothing (its factors) do; W8A8_DYNAMIC weights and FLOAT tensors do not, so a
        recipe with only those (``dynamic`` with ``fa_quant`` off) is data-free."""
        # (QuaRot alone needs none, but its rotations are folded in by the passes)
        if self.smooth or self.steps or self.mlp_smooth_layers:
            return True
        return any(kind in (W8A8, FAQUANT) for i in layout.all_layer_ids(cfg)
                   for kind in self.layer_types(cfg, i).values())

    def layer_types(self, cfg: DeepseekV3Config, layer_id: int) -> dict[str, str]:
        """Module prefix (``model.layers.N.self_attn.q_a_proj``, ``...fa_q``) -> type, for every module
        holding a tensor of the layer, plus the FA3 branches."""
        self.check_config(cfg)
        if layer_id not in layout.all_layer_ids(cfg):
            raise QuantError(f"layer {layer_id} is not in the model (layers {layout.all_layer_ids(cfg)})")
        p = layout.layer_prefix(layer_id)
        quantized = self.quantized_layer(cfg, layer_id)
        out: dict[str, str] = {}
        for name in layout.layer_shapes(cfg, layer_id):
            prefix = name.rsplit(".", 1)[0]
            if prefix in out:
                continue
            rest = prefix[len(p):]
            out[prefix] = self.linear_kind(prefix) if quantized else FLOAT
            if rest == "self_attn.o_proj" and self.fa_layer(cfg, layer_id):
                out.update({f"{p}self_attn.{b}": FAQUANT for b in FA_BRANCHES})
        return out


def module_types(cfg: DeepseekV3Config, recipe: Recipe, layer_ids) -> dict[str, str]:
    """``layer_types`` over several layers."""
    out: dict[str, str] = {}
    for i in layer_ids:
        out.update(recipe.layer_types(cfg, i))
    return out


def kv_bytes_per_token(cfg: DeepseekV3Config, recipe: Optional[Recipe],
                       dtype_bytes: int = 2) -> tuple[dict[int, int], int]:
    """``({layer_id: bytes}, total)`` of KV cache per token under ``recipe``, every layer including the MTP
    layer(s), each of which has a cache of its own.
    FA3 layer (``recipe.fa_layer``): ``kv_lora_rank * 1 + qk_rope_head_dim * dtype_bytes``; other layers
    (and every layer when ``recipe`` is None): ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``."""
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be an integer >= 1, got {dtype_bytes!r}")
    if recipe is not None:
        recipe.check_config(cfg)
    ids = list(range(cfg.num_hidden_layers)) + list(cfg.mtp_layer_ids)
    per: dict[int, int] = {}
    for i in ids:
        if recipe is not None and recipe.fa_layer(cfg, i):
            per[i] = cfg.kv_lora_rank + cfg.qk_rope_head_dim * dtype_bytes
        else:
            per[i] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return per, sum(per.values())
