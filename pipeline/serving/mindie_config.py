"""A MindIE ``ModelConfig`` block (the serving config users migrating from MindIE bring; serving spec,
"The MindIE configuration users bring") read into what this project's serving job can honour.

Accepted shapes of ``block``: MindIE's whole ``config.json`` (``BackendConfig -> ModelDeployConfig ->
ModelConfig``), a mapping with a ``ModelDeployConfig`` or ``ModelConfig`` key, the ``ModelConfig`` list, or
one ``ModelConfig`` entry. Exactly one model is served; a list of several is refused.

Rules (every refusal is a ``ValueError`` naming the field and what to change):

* ``modelWeightPath`` is required; ``worldSize``, ``tp``, ``dp``, ``moe_ep``, ``moe_tp``, ``sp`` are
  integers >= 1 (``worldSize`` required; ``dp``, ``sp``, ``moe_ep`` default to 1, ``tp`` to
  ``worldSize // dp``, ``moe_tp`` to ``dp * tp // moe_ep``).
* ``sp <= tp`` (sequence parallelism splits within the tp group).
* ``dp * tp == moe_ep * moe_tp``: attention and MoE run over the same devices.
* ``worldSize`` is accelerators per node, so ``dp * tp`` (the total rank count) must be a whole number
  of nodes: ``dp * tp == worldSize * nodes`` with ``nodes >= 1``. ``dp * tp > worldSize`` is therefore
  allowed (multi-node: the seed block, worldSize 8 with dp 2 x tp 8, is two nodes of 8); a ``dp * tp``
  that is not a multiple of ``worldSize`` (including one smaller than it) is refused. When
  ``gpus_per_node`` is given, ``worldSize`` may not exceed it.
* Refuse what cannot be honoured: the ``dp * tp`` ranks need that many accelerators; more than
  ``devices_available`` is refused ("worldSize 8 needs 8 accelerators but this cluster reports N; ...").
  With ``devices_available == 0`` only the single-rank layout is accepted; with ``cpu=True`` the job serves
  on CPU with one process per rank and ``devices_available`` counts the CPU slots. ``sp`` other than 1 is
  refused (no sequence parallelism here).
* The serving replica is sharded as the block says (:meth:`MindieModelConfig.replica_parallel`): dp
  DP-attention groups of tp ranks, the experts over moe_ep x moe_tp of the same ranks.
* ``plugin_params`` is a JSON *string* (a mapping is accepted too); ``plugin_type`` ``"mtp"`` turns MTP on
  and needs ``num_speculative_tokens`` exactly 1 (MindIE allows only one; absent counts as 1). Any other
  plugin type is refused (this engine has none).
* Keys: those above, plus MindIE's keys that do not apply to this engine (``IGNORED``: memory sizes,
  backend type, timeouts...), which are accepted with a warning each; any other key is refused by name.
* ``enable_nz`` (``models.deepseekv2.kv_cache_options.enable_nz``) defaults to False. MindIE requires it
  true with FA3 (the int8 latent cache); this engine can run FA3 in ND too, so FA3 without NZ is a
  warning, not a refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

SIZES = ("worldSize", "tp", "dp", "moe_ep", "moe_tp", "sp")
USED = ("modelName", "modelWeightPath", *SIZES, "plugin_params", "models")
# MindIE's other ModelConfig keys: accepted (a block is handed over as it is) with a warning that they do not
# apply here; any key outside USED and these is refused by name (a misspelt key would be lost silently)
IGNORED = ("modelInstanceType", "cpuMemSize", "npuMemSize", "backendType", "trustRemoteCode", "cp",
           "async_scheduler_wait_time", "kv_trans_timeout", "kv_link_timeout", "lora_modules")
MTP_EXAMPLE = '"{\\"plugin_type\\":\\"mtp\\",\\"num_speculative_tokens\\": 1}"'


@dataclass(frozen=True)
class MindieModelConfig:
    model_name: Optional[str]
    model_weight_path: str
    world_size: int
    tp: int
    dp: int
    moe_ep: int
    moe_tp: int
    sp: int
    mtp: bool
    enable_nz: bool
    warnings: tuple[str, ...] = ()

    @property
    def ranks(self) -> int:
        """Total ranks (accelerators) of the layout: dp * tp == moe_ep * moe_tp."""
        return self.dp * self.tp

    @property
    def nodes(self) -> int:
        return self.ranks // self.world_size

    def replica_parallel(self) -> dict:
        """The serving replica's layout: the block's sizes as they are (dp > 1: DP-attention groups inside
        the one replica, the experts over all ``dp * tp`` ranks)."""
        return {"tp": self.tp, "dp": self.dp, "moe_ep": self.moe_ep, "moe_tp": self.moe_tp}


def _model_entry(block: Any) -> Mapping[str, Any]:
    """The single ModelConfig entry out of any accepted shape."""
    if isinstance(block, Mapping) and "BackendConfig" in block:
        backend = block["BackendConfig"]
        if not isinstance(backend, Mapping) or not isinstance(backend.get("ModelDeployConfig"), Mapping):
            raise ValueError("MindIE config: BackendConfig.ModelDeployConfig is missing or not a mapping; "
                             "pass MindIE's config.json, its ModelConfig list, or one ModelConfig entry")
        block = backend["ModelDeployConfig"]
    if isinstance(block, Mapping) and "ModelDeployConfig" in block:
        block = block["ModelDeployConfig"]
    if isinstance(block, Mapping) and "ModelConfig" in block:
        block = block["ModelConfig"]
    if isinstance(block, Mapping):
        return block
    if isinstance(block, Sequence) and not isinstance(block, (str, bytes)):
        if len(block) == 0:
            raise ValueError("ModelConfig is an empty list: give it one model entry")
        if len(block) > 1:
            names = ", ".join(str(m.get("modelName", "?")) if isinstance(m, Mapping) else "?" for m in block)
            raise ValueError(f"ModelConfig lists {len(block)} models ({names}); this serving job serves one "
                             "model: keep a single ModelConfig entry")
        if not isinstance(block[0], Mapping):
            raise ValueError(f"ModelConfig[0] must be a mapping, got {type(block[0]).__name__}")
        return block[0]
    raise ValueError(f"MindIE config: expected MindIE's config.json, a ModelConfig list or one ModelConfig "
                     f"mapping, got {type(block).__name__}")


def _size(m: Mapping[str, Any], key: str, default: Optional[int]) -> int:
    v = m.get(key, default)
    if v is None:
        raise ValueError(f"ModelConfig.{key} is missing: set it to a positive integer")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"ModelConfig.{key} must be a positive integer, got {v!r}: set it to 1 or more")
    return v


def _mtp(raw: Any) -> bool:
    if raw is None or raw == "" or raw == {}:
        return False
    if isinstance(raw, str):
        try:
            params = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"ModelConfig.plugin_params is not valid JSON ({e}); it is a JSON string such "
                             f"as {MTP_EXAMPLE}") from None
    else:
        params = raw
    if not isinstance(params, Mapping):
        raise ValueError(f"ModelConfig.plugin_params must hold a JSON object such as {MTP_EXAMPLE}, "
                         f"got {params!r}")
    ptype = params.get("plugin_type")
    if ptype in (None, ""):
        return False
    types = [t.strip() for t in str(ptype).split(",") if t.strip()]
    other = [t for t in types if t != "mtp"]
    if other:
        raise ValueError(f"ModelConfig.plugin_params: plugin_type {', '.join(other)} is not supported by this "
                         "engine (only \"mtp\"): remove it from plugin_type")
    n = params.get("num_speculative_tokens", 1)
    if isinstance(n, bool) or n != 1:
        raise ValueError(f"ModelConfig.plugin_params: num_speculative_tokens is {n!r} but MindIE allows only "
                         "one MTP speculative token: set num_speculative_tokens to 1")
    return True


def _enable_nz(m: Mapping[str, Any]) -> bool:
    models = m.get("models") or {}
    opts = models.get("deepseekv2", {}) if isinstance(models, Mapping) else {}
    kv = opts.get("kv_cache_options", {}) if isinstance(opts, Mapping) else {}
    v = kv.get("enable_nz", False) if isinstance(kv, Mapping) else False
    if not isinstance(v, bool):
        raise ValueError(f"ModelConfig.models.deepseekv2.kv_cache_options.enable_nz must be true or false, "
                         f"got {v!r}")
    return v


def parse_mindie_model_config(block: Any, devices_available: int, gpus_per_node: Optional[int] = None, *,
                              fa3: bool = True, cpu: bool = False) -> MindieModelConfig:
    """Read and check one MindIE ModelConfig (see the module docstring for shapes and rules).
    ``devices_available``: accelerators in the cluster (0: CPU serving). ``gpus_per_node``: accelerators
    per node, when known. ``fa3``: whether the serving engine keeps the FA3 int8 latent cache (the default
    engine does), for the enable_nz warning. ``cpu``: serve on CPU with one process per rank, and
    ``devices_available`` counts the CPU slots for them."""
    if isinstance(devices_available, bool) or not isinstance(devices_available, int) or devices_available < 0:
        raise ValueError(f"devices_available must be an integer >= 0, got {devices_available!r}")
    m = _model_entry(block)
    unknown = sorted(str(k) for k in m if k not in USED and k not in IGNORED)
    if unknown:
        raise ValueError(f"ModelConfig has unknown key(s) {', '.join(unknown)}: MindIE's ModelConfig keys are "
                         f"{', '.join(USED + IGNORED)}; fix or remove them")
    path = m.get("modelWeightPath")
    if not isinstance(path, str) or not path.strip():
        raise ValueError("ModelConfig.modelWeightPath is missing or empty: set it to the quantized weight "
                         "directory")
    name = m.get("modelName")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"ModelConfig.modelName must be a non-empty string, got {name!r}")

    ws = _size(m, "worldSize", None)
    dp = _size(m, "dp", 1)
    tp = _size(m, "tp", max(ws // dp, 1))
    moe_ep = _size(m, "moe_ep", 1)
    moe_tp = _size(m, "moe_tp", max(dp * tp // moe_ep, 1))
    sp = _size(m, "sp", 1)

    if sp > tp:
        raise ValueError(f"ModelConfig.sp {sp} exceeds tp {tp}: sequence parallelism splits within the tp "
                         "group; set sp <= tp")
    if sp != 1:
        raise ValueError(f"ModelConfig.sp {sp}: this engine has no sequence parallelism; set sp to 1")
    if dp * tp != moe_ep * moe_tp:
        raise ValueError(f"ModelConfig: dp x tp = {dp}x{tp} = {dp * tp} but moe_ep x moe_tp = {moe_ep}x{moe_tp} "
                         f"= {moe_ep * moe_tp}; attention runs over dp x tp ranks and MoE over moe_ep x moe_tp "
                         "ranks of the same devices: 2x8 == 4x4; change dp/tp or moe_ep/moe_tp so the "
                         "products match")
    ranks = dp * tp
    if gpus_per_node is not None and ws > gpus_per_node:
        raise ValueError(f"ModelConfig.worldSize {ws} is accelerators per node but this cluster's nodes have "
                         f"{gpus_per_node}; set worldSize <= {gpus_per_node} and spread dp x tp over more nodes")
    if ranks % ws:
        raise ValueError(f"ModelConfig: tp x dp = {tp}x{dp} = {ranks} ranks is not a whole number of nodes of "
                         f"worldSize {ws} (accelerators per node); make tp x dp a multiple of worldSize")
    nodes = ranks // ws
    if devices_available == 0 or cpu:
        if cpu and ranks > devices_available:
            raise ValueError(f"ModelConfig: tp {tp} x dp {dp} = {ranks} ranks need {ranks} CPU slots (one process "
                             f"each) but this cluster reports {devices_available}; lower worldSize/tp/dp or add "
                             "CPUs")
        if not cpu and ranks > 1:
            raise ValueError(f"ModelConfig: worldSize {ws} (tp {tp} x dp {dp} = {ranks} ranks) needs {ranks} "
                             f"accelerators but this cluster reports 0; lower worldSize/tp/dp or add devices "
                             "(CPU serving runs one rank: worldSize, tp, dp, moe_ep, moe_tp, sp all 1)")
    elif ranks > devices_available:
        where = f" x {nodes} nodes (tp {tp} x dp {dp} = {ranks} ranks)" if nodes > 1 else ""
        raise ValueError(f"ModelConfig: worldSize {ws}{where} needs {ranks} accelerators but this cluster "
                         f"reports {devices_available}; lower worldSize/tp/dp or add devices")

    mtp = _mtp(m.get("plugin_params"))
    enable_nz = _enable_nz(m)
    warnings = [f"ModelConfig.{k} does not apply to this engine and is ignored" for k in IGNORED if k in m]
    if fa3 and not enable_nz:
        warnings.append("enable_nz is false with an FA3 (int8 latent) cache: MindIE requires enable_nz true "
                        "with FA3; this engine will run the FA3 cache in ND layout (set enable_nz: true to "
                        "match MindIE)")
    return MindieModelConfig(name, path, ws, tp, dp, moe_ep, moe_tp, sp, mtp, enable_nz, tuple(warnings))


def to_serve_options(cfg: MindieModelConfig) -> dict:
    """What the serving config (actors.serving.serve_config.ServeConfig.from_dict) takes from the MindIE block:
    the model, the engine's NZ / MTP switches, and the replica's layout."""
    return {"model_path": cfg.model_weight_path, "served_model_name": cfg.model_name,
            "engine": {"nz": cfg.enable_nz, "mtp": cfg.mtp}, "parallel": cfg.replica_parallel()}
