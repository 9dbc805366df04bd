"""Which runtime loads a quantized output: an output (ours or msModelSlim's) checked against what one
runtime's loader reads (:func:`check_runtime`), and the runtimes a quantizer's options give an output
for (:func:`runtimes_for`). Pure: config.json, the description and the safetensors headers only.

Runtimes (:data:`RUNTIMES`):

- ``vllm-ascend``: its msModelSlim loader, as of vllm-ascend 182b75e. Every rule names the file it comes
  from (``RULES``): ``quantization/modelslim_config.py`` (where the description comes from, the per-layer
  method lookup, fused projections), ``quantization/methods/w8a8_static.py`` and ``w8a8_dynamic.py``
  (the tensors each linear method registers, their dtypes and shapes), ``quantization/methods/kv_c8.py``
  (the FA3 scales, their shapes and their split over tensor-parallel ranks) and ``attention/mla_v1.py``
  (what its FA3 decode path reads).
- ``mindie``: MindIE's FA3 documentation (MindIE <= 2.1.RC1, the MindIE guides' msModelSlim script
  output): FA3 is declared in config.json's ``quantization_config`` as ``{"fa_quant_type": "FAKQuant"}``,
  the model type is MindIE's ``deepseekv2``, the weights are float16; FA3 is documented for DeepSeek-R1 and
  needs the NZ cache (``kv_cache_options.enable_nz``): those two are said, not checked (the weights do not
  tell them).
- ``dsquant``: this project's engine, which reads both dialects (pipeline.format.checker's rules).

A rule that breaks loading or the numbers is a violation; a caveat that depends on how the runtime is
deployed (a decode-only instance, the cache layout) is a note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pipeline.format.description import DESCRIPTION_NAME, FA_QUANT_TYPE, W8A8, W8A8_DYNAMIC
from pipeline.io import storage
from pipeline.io.safetensors_io import CheckpointError, TensorSpec, read_header

VLLM_ASCEND, MINDIE, DSQUANT = "vllm-ascend", "mindie", "dsquant"
RUNTIMES = (VLLM_ASCEND, MINDIE, DSQUANT)
VLLM_ASCEND_COMMIT = "182b75e"

# rule tag -> the runtime source it comes from
RULES = {
    "description-source": "vllm-ascend quantization/modelslim_config.py (AscendModelSlimConfig.from_config and "
                          "maybe_update_config: config.json's quantization_config, when present, is the whole "
                          "description; quant_model_description.json is read only without it)",
    "model-type": "vllm-ascend quantization/modelslim_config.py (packed_modules_model_mapping is keyed by "
                  "config.json's model_type; vLLM picks the model class by it)",
    "method-lookup": "vllm-ascend quantization/modelslim_config.py (get_linear_quant_type: "
                     "quant_description[prefix + '.weight'] for every linear, the shards of a fused projection "
                     "with one type; is_layer_skipped_ascend: all shards FLOAT or none)",
    "method-type": "vllm-ascend quantization/methods (the registered linear schemes: W8A8 in w8a8_static.py, "
                   "W8A8_DYNAMIC in w8a8_dynamic.py; FLOAT is left unquantized)",
    "tensors": "vllm-ascend quantization/methods/w8a8_static.py (get_weight, get_pertensor_param, "
               "get_perchannel_param) and w8a8_dynamic.py (get_weight, get_perchannel_param)",
    "fa-quant-type": "vllm-ascend quantization/modelslim_config.py (get_quant_method: an Attention layer gets "
                     "the fa_quant_type scheme) and quantization/methods/kv_c8.py (register_scheme('FAKQuant'))",
    "fa-scales": "vllm-ascend quantization/methods/kv_c8.py (create_weights: fa_q [num_heads, 1], fa_k and fa_v "
                 "[num_kv_heads = 1, 1], offsets int8; _fa_quant_weight_loader splits dim 0 over the TP ranks)",
    "decode-weight-scale": "vllm-ascend attention/mla_v1.py (the FA3 decode path of a decode-only instance "
                           "reads q_a_proj, kv_a_proj_with_mqa and q_b_proj's weight_scale, which "
                           "w8a8_static.py registers and nothing loads when the output has none)",
    "mindie-fa-config": "MindIE FA3 documentation (config.json: quantization_config {'fa_quant_type': 'FAKQuant'})",
    "mindie-model-type": "MindIE FA3 documentation (config.json model_type deepseekv2)",
    "mindie-dtype": "MindIE FA3 documentation (float16 weights)",
    "mindie-model": "MindIE FA3 documentation (DeepSeek-R1)",
    "mindie-nz": "MindIE FA3 documentation (NZ cache: kv_cache_options.enable_nz true)",
}

VLLM_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "deepseek_v32")
# fused projections (modelslim_config.py's packed_modules_model_mapping for deepseek_v3)
FUSED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj"),
         "experts": ("gate_proj", "up_proj", "down_proj")}
LINEAR_TYPES = ("FLOAT", W8A8, W8A8_DYNAMIC)
DECODE_READS = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj")
_LINEAR = re.compile(r"(model\.layers\.(\d+)\..*_proj(?:_with_mqa)?)\.weight")


@dataclass(frozen=True)
class Finding:
    rule: str
    where: str
    message: str

    @property
    def source(self) -> str:
        return RULES.get(self.rule, "")


@dataclass
class RuntimeReport:
    path: str
    runtime: str
    tp: int = 1
    violations: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, rule: str, where: str, message: str) -> None:
        self.violations.append(Finding(rule, where, message))

    def note(self, rule: str, where: str, message: str) -> None:
        self.notes.append(Finding(rule, where, message))

    def to_dict(self) -> dict:
        row = lambda f: {"rule": f.rule, "where": f.where, "message": f.message, "source": f.source}
        return {"path": self.path, "runtime": self.runtime, "tp": self.tp, "ok": self.ok,
                "violations": [row(f) for f in self.violations], "notes": [row(f) for f in self.notes]}

    def to_text(self) -> str:
        head = f"{self.path}: {'loads in' if self.ok else 'does NOT load in'} {self.runtime}" + \
            (f" (tp {self.tp})" if self.tp > 1 else "")
        lines = [head]
        for kind, items in (("violation", self.violations), ("note", self.notes)):
            rules = list(dict.fromkeys(f.rule for f in items))
            for rule in rules:
                lines.append(f"  {kind}s [{rule}], from {RULES.get(rule, '?')}:")
                lines += [f"    {f.where}: {f.message}" for f in items if f.rule == rule]
        return "\n".join(lines)


@dataclass(frozen=True)
class Output:
    """What a runtime reads of an output: config.json, the description, the tensors' headers."""

    config: dict
    description: Optional[dict]
    specs: dict[str, TensorSpec]


def read_output(path: str) -> Output:
    from pipeline.format.description import loads_json_object
    from pipeline.io.checkpoint import CONFIG_NAME

    path = path.rstrip("/") or path
    if not storage.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    entries = storage.listdir(path)
    if CONFIG_NAME not in entries:
        raise CheckpointError(f"{path}: no {CONFIG_NAME}")
    config = loads_json_object(storage.read_bytes(storage.join(path, CONFIG_NAME)), CONFIG_NAME)
    desc = loads_json_object(storage.read_bytes(storage.join(path, DESCRIPTION_NAME)), DESCRIPTION_NAME) \
        if DESCRIPTION_NAME in entries else None
    specs: dict[str, TensorSpec] = {}
    for f in sorted(e for e in entries if e.endswith(".safetensors")):
        for name, info in read_header(storage.join(path, f)).tensors.items():
            specs[name] = TensorSpec(name, info.dtype, info.shape)
    return Output(config, desc, specs)


def check_runtime(path: str, runtime: str, tp: int = 1, verify: bool = True) -> RuntimeReport:
    """The report of ``path`` against ``runtime``'s loader (``tp``: the tensor-parallel size it would
    run with; ``verify``: dsquant's manifest sha256s re-read, as pipeline.format.checker.check_dir).
    CheckpointError when the directory or its config.json cannot be read."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    report = RuntimeReport(path, runtime, tp)
    if runtime == DSQUANT:
        from pipeline.format.checker import check_dir

        for v in check_dir(path, verify=verify).violations:
            report.add(v.rule, v.where, v.message)
        return report
    out = read_output(path)
    (_vllm_ascend if runtime == VLLM_ASCEND else _mindie)(out, report)
    return report


# ----- vllm-ascend ----------------------------------------------------------------------------------------

def _layers(config: Mapping[str, Any]) -> int:
    return int(config.get("num_hidden_layers", 0))


def _vllm_ascend(out: Output, report: RuntimeReport) -> None:
    cfg, specs = out.config, out.specs
    qc = cfg.get("quantization_config")
    desc = out.description
    mt = cfg.get("model_type")
    if mt not in VLLM_MODEL_TYPES:
        report.add("model-type", "config.json model_type",
                   f"{mt!r} is not a DeepSeek model type vLLM knows ({', '.join(VLLM_MODEL_TYPES)})")
    if isinstance(qc, dict) and not qc.get("quant_method"):
        missing = [n for n in specs if n not in qc]
        if missing:
            report.add("description-source", "config.json quantization_config",
                       f"vLLM takes it as the whole description ({len(qc)} key(s): {sorted(qc)[:4]}) and never "
                       f"reads {DESCRIPTION_NAME}; it has no entry for {len(missing)} tensor(s), e.g. {missing[0]} "
                       "(the per-layer lookups then fail)")
            return
        desc = qc
    if desc is None:
        report.add("description-source", DESCRIPTION_NAME, "missing: vllm-ascend's loader reads it")
        return
    n_layers = _layers(cfg)
    md = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))
    linears = {}
    for name in specs:
        m = _LINEAR.fullmatch(name)
        if m and int(m.group(2)) < n_layers:        # the MTP layer is another model (deepseek_mtp)
            linears[m.group(1)] = name
    for prefix in sorted(linears):
        key = prefix + ".weight"
        kind = desc.get(key)
        if kind is None:
            report.add("method-lookup", key, "no description entry: the loader's lookup of this linear fails")
            continue
        if kind not in LINEAR_TYPES:
            report.add("method-type", key, f"{kind!r} is not one of the linear methods {', '.join(LINEAR_TYPES)}")
            continue
        _linear_tensors(prefix, kind, specs, md, report)
    _fused(desc, linears, report)
    _fa(desc, specs, cfg, n_layers, report)


def _fused(desc: Mapping[str, Any], linears: Mapping[str, str], report: RuntimeReport) -> None:
    groups: dict[str, dict[str, Any]] = {}
    for prefix in linears:
        head, _, proj = prefix.rpartition(".")
        if proj in FUSED["fused_qkv_a_proj"]:
            groups.setdefault(head + ".fused_qkv_a_proj", {})[proj] = desc.get(prefix + ".weight")
        elif ".experts." in prefix:
            if re.search(r"\.experts\.0\.[a-z_]+$", prefix):
                groups.setdefault(head.rsplit(".", 1)[0] + ".experts", {})[proj] = desc.get(prefix + ".weight")
        elif proj in FUSED["gate_up_proj"]:
            groups.setdefault(head + ".gate_up_proj", {})[proj] = desc.get(prefix + ".weight")
    for fused, kinds in sorted(groups.items()):
        if len(set(kinds.values())) > 1:
            report.add("method-lookup", fused, f"the shards of one fused projection have different methods "
                                               f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})")
    per_layer: dict[str, dict[str, set]] = {}
    for prefix in linears:
        if ".experts." in prefix:
            layer, _, rest = prefix.partition(".experts.")
            per_layer.setdefault(layer + ".experts", {}).setdefault(desc.get(prefix + ".weight"), set()).add(
                rest.split(".")[0])
    for fused, kinds in sorted(per_layer.items()):
        if len(kinds) > 1:
            report.add("method-lookup", fused, "the routed experts of one layer have different methods (the fused "
                                               "MoE takes one for all: " + ", ".join(
                                                   f"{k}: {len(v)} expert(s)" for k, v in sorted(kinds.items())) + ")")


def _spec(specs, name: str) -> Optional[TensorSpec]:
    return specs.get(name)


def _want(report: RuntimeReport, specs, name: str, dtypes: tuple, shape: Optional[tuple], why: str = "") -> None:
    s = _spec(specs, name)
    if s is None:
        report.add("tensors", name, f"missing: the method registers it{why}")
        return
    if s.dtype not in dtypes:
        report.add("tensors", name, f"dtype {s.dtype}, the method's parameter is {' or '.join(dtypes)}")
    if shape is not None and tuple(s.shape) != shape and not (shape == (1,) and _numel(s.shape) == 1):
        report.add("tensors", name, f"shape {list(s.shape)}, the method's parameter is {list(shape)}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _linear_tensors(prefix: str, kind: str, specs, model_dtype: str, report: RuntimeReport) -> None:
    if kind == "FLOAT":
        return
    w = specs[prefix + ".weight"]
    if w.dtype != "I8" or len(w.shape) != 2:
        report.add("tensors", prefix + ".weight", f"{w.dtype} {list(w.shape)}: {kind} registers an int8 [out, in]")
        return
    out_features = w.shape[0]
    floats = ("F32", "BF16", "F16")
    if kind == W8A8:
        _want(report, specs, prefix + ".input_scale", floats, (1,))
        _want(report, specs, prefix + ".input_offset", floats + ("I8",), (1,))
        _want(report, specs, prefix + ".quant_bias", ("I32",), (out_features,))
        deq = ("I64",) if model_dtype == "float16" else ("F32",)
        _want(report, specs, prefix + ".deq_scale", deq, (out_features,),
              f" ({'int64 bit patterns for a float16 model' if deq == ('I64',) else 'float32 for a bfloat16 model'})")
        if prefix + ".weight_scale" not in specs and prefix.rsplit(".", 1)[-1] in DECODE_READS:
            report.note("decode-weight-scale", prefix + ".weight_scale",
                        "absent: vllm-ascend leaves it uninitialised, and its FA3 decode path on a decode-only "
                        "(disaggregated) instance reads it; mixed prefill+decode instances are unaffected")
    else:
        _want(report, specs, prefix + ".weight_scale", floats, (out_features, 1))
        _want(report, specs, prefix + ".weight_offset", floats, (out_features, 1))


def _fa(desc: Mapping[str, Any], specs, cfg: Mapping[str, Any], n_layers: int, report: RuntimeReport) -> None:
    fa_type = desc.get("fa_quant_type")
    fa_layers = sorted({int(m.group(1)) for n in specs if (m := re.match(r"model\.layers\.(\d+)\.self_attn\.fa_", n))})
    if fa_type is None:
        if fa_layers:
            report.add("fa-quant-type", "fa_quant_type", f"absent, but layers {fa_layers[:4]} carry fa_* scales: "
                                                         "the model has no parameter to load them into")
        return
    if fa_type != FA_QUANT_TYPE:
        report.add("fa-quant-type", "fa_quant_type", f"{fa_type!r}: the attention scheme registered for MLA is "
                                                     f"{FA_QUANT_TYPE!r}")
        return
    heads = int(cfg.get("num_attention_heads", 0))
    if heads % report.tp:
        report.add("fa-scales", "num_attention_heads", f"{heads} heads do not split over tp {report.tp}: "
                                                       "fa_q's rows are split evenly over the ranks")
    for layer in range(n_layers):
        for part, rows in (("fa_q", heads), ("fa_k", 1), ("fa_v", 1)):
            for what, dtypes in (("scale", ("F32", "BF16", "F16")), ("offset", ("I8",))):
                name = f"model.layers.{layer}.self_attn.{part}.{what}"
                s = specs.get(name)
                if s is None:
                    report.add("fa-scales", name, "missing: every attention layer gets the FA3 parameters, "
                                                  "this one would stay uninitialised")
                    continue
                if s.dtype not in dtypes:
                    report.add("fa-scales", name, f"dtype {s.dtype}, the parameter is {' or '.join(dtypes)}")
                if tuple(s.shape) != (rows, 1) and not (rows == 1 and _numel(s.shape) == 1):
                    report.add("fa-scales", name, f"shape {list(s.shape)}, the parameter is [{rows}, 1]")
                elif rows > 1 and report.tp > 1 and s.shape[0] % report.tp:
                    report.add("fa-scales", name, f"{s.shape[0]} rows do not split over tp {report.tp}")


# ----- MindIE ----------------------------------------------------------------------------------------------

def _mindie(out: Output, report: RuntimeReport) -> None:
    cfg, specs = out.config, out.specs
    fa = any(".self_attn.fa_" in n for n in specs)
    if not fa:
        return          # MindIE's FA3 rules only; W8A8 without FA3 is the plain msModelSlim layout
    qc = cfg.get("quantization_config")
    if not (isinstance(qc, dict) and qc.get("fa_quant_type") == FA_QUANT_TYPE):
        report.add("mindie-fa-config", "config.json quantization_config",
                   f"MindIE turns FA3 on from config.json's quantization_config {{'fa_quant_type': "
                   f"'{FA_QUANT_TYPE}'}}; got {qc!r} (quantize with --mindie-format)")
    if cfg.get("model_type") != "deepseekv2":
        report.add("mindie-model-type", "config.json model_type",
                   f"{cfg.get('model_type')!r}: MindIE's FA3 model is deepseekv2 (quantize with --mindie-format)")
    md = cfg.get("torch_dtype", cfg.get("dtype"))
    if md != "float16":
        report.add("mindie-dtype", "config.json torch_dtype",
                   f"{md!r}: MindIE's FA3 runs float16 weights (quantize a float16 checkpoint)")
    report.note("mindie-model", "model", "MindIE documents FA3 for DeepSeek-R1 (the weights cannot tell)")
    report.note("mindie-nz", "serving", "MindIE's FA3 needs the NZ cache: ModelConfig.models.deepseekv2."
                                        "kv_cache_options.enable_nz true (jobs.serve --mindie-config checks it)")


# ----- the quantizer's options ------------------------------------------------------------------------------

def runtimes_for(*, mindie_format: bool, fa_quant: bool, model_dtype: Optional[str]) -> dict[str, Optional[str]]:
    """{runtime: None when the options give an output it loads, else the one-line reason it will not}."""
    out: dict[str, Optional[str]] = {DSQUANT: None, VLLM_ASCEND: None, MINDIE: None}
    if mindie_format:
        out[VLLM_ASCEND] = ("--mindie-format writes config.json quantization_config {'fa_quant_type': ...}, which "
                            "vLLM takes as the whole description, and model_type deepseekv2 "
                            "(vllm-ascend quantization/modelslim_config.py)")
    if fa_quant and not mindie_format:
        out[MINDIE] = "MindIE turns FA3 on from config.json keys only --mindie-format writes (MindIE FA3 documentation)"
    elif fa_quant and model_dtype not in (None, "float16"):
        out[MINDIE] = f"MindIE's FA3 runs float16 weights; the source is {model_dtype} (MindIE FA3 documentation)"
    return out
