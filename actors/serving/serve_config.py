"""The serving application's configuration: a dataclass built in code or read from a JSON/YAML file."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from actors.serving.api_keys import check_key
from pipeline.engine import cpu_pinning
from pipeline.engine.config import EngineConfig
from pipeline.engine.worker.loader import DTYPES
from pipeline.parallel import SIZES as PARALLEL_SIZES, ParallelConfig
from pipeline.io.json_input import parse_json
from pipeline.strict import check_keys

@dataclass(frozen=True)
class DeploymentOptions:
    """Replica count and Ray actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``, ...)."""

    num_replicas: int = 1
    ray_actor_options: Mapping[str, Any] = field(default_factory=lambda: {"num_cpus": 1})

    def __post_init__(self):
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if not isinstance(self.ray_actor_options, Mapping):
            raise ValueError(f"ray_actor_options must be a mapping, got {self.ray_actor_options!r}")


MODES = ("colocated", "disaggregated")
#: A served engine prefills up to 2048 tokens a step (16 prompts of 128 in one), as vLLM's CPU build does
#: for MLA (chunked prefill off: a whole prompt up to max_model_len 2048 per step). With vLLM's client at
#: concurrency 16 (random 128 / 64, quantized) it serves more tokens/s than 256 a step, with a lower median
#: TTFT; longer prompts are still chunked.
DEFAULT_ENGINE = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=16, max_batched_tokens=2048, nz=True)


@dataclass(frozen=True)
class ServeConfig:
    """Everything the application needs. ``model_path``: a quantized directory or a float checkpoint
    (pipeline.engine.worker.loader.load_model tells them apart; every replica reads it: use an absolute or shared
    path). ``served_model_name``: the OpenAI model id (default: the directory's name). ``dtype``: a float
    checkpoint's compute dtype, or a quantized directory's float parts' (float32, bfloat16, float16; None
    or "auto": the loader's default). ``engine``: the engine's options. ``api_key``: required bearer
    token on ``/v1`` (None: open).
    ``max_in_flight``: generation requests per ingress replica before 429. ``torch_threads``: per engine
    replica. ``engine_cpus``: the CPUs an engine core process pins itself to (``pipeline.engine.cpu_pinning``:
    "auto", "none", or a list). ``mode``: "colocated" (one engine deployment does prefill and decode) or "disaggregated" (a
    prefill deployment, ``prefill`` replicas, computes each prompt's cache and hands the blocks to the
    decode deployment, ``llm``, through the object store; a prefill slower than ``prefill_timeout_s``
    fails that request only). ``max_body_bytes``: the largest request body (413 beyond);
    ``body_timeout_s``: how long a request body may take to arrive (408 beyond). Both sides run the same engine
    options, so they agree on the checkpoint, the KV dtype, the block size and the layout; the decode side checks
    every handoff against its own. ``host``/``port``/``app_name``/``route_prefix``: where ``jobs.serve`` serves it."""

    model_path: str
    served_model_name: Optional[str] = None
    engine: EngineConfig = DEFAULT_ENGINE
    api_key: Optional[str] = None
    max_in_flight: int = 64
    torch_threads: int = 1
    llm: DeploymentOptions = field(default_factory=lambda: DeploymentOptions(1, {"num_cpus": 1}))
    # 0 CPUs reserved for the ingress (async I/O; Ray does not cap what it uses): the defaults then need 1
    # CPU colocated and 2 disaggregated, so `jobs.serve --mode disaggregated` fits a 2-CPU machine
    ingress: DeploymentOptions = field(default_factory=lambda: DeploymentOptions(1, {"num_cpus": 0}))
    mode: str = "colocated"         # or "disaggregated": prefill on its own deployment, KV handed to decode
    prefill: DeploymentOptions = field(default_factory=lambda: DeploymentOptions(1, {"num_cpus": 1}))
    prefill_timeout_s: float = 60.0
    max_body_bytes: int = 2 * 1024 * 1024   # a larger request body is refused with 413 before it is read
    body_timeout_s: float = 30.0            # a body not received in full by then: 408 (slow clients)
    parallel: Mapping[str, int] = field(default_factory=dict)  # tp/dp/moe_ep/moe_tp of each engine replica
    prefill_parallel: Optional[Mapping[str, int]] = None       # the prefill replicas' (default: parallel's)
    moe_combine: str = "reduce"     # MoE combine over ranks: "reduce" or "exact" (pipeline.engine.sharding.sharded)
    # the engine of a single-process replica steps in a child process of its own (pipeline.engine.core.core_process:
    # no interpreter lock shared with HTTP and streaming); False: on a thread of the replica (a sharded
    # replica always does: its ranks are Ray actors of the replica)
    engine_process: bool = True
    # the CPUs the engine core process is pinned to (pipeline.engine.cpu_pinning: "auto", "none" or a list
    # such as "3" or "2-3"); only an engine in a process of its own is pinned
    engine_cpus: str = "auto"
    # each ingress replica builds its own engine (an LLMServer in its process: no Ray hop per token between
    # the engine and the HTTP stream); None: when the llm replica is one process and there are as many
    # ingress replicas as llm replicas. False: a separate LLMServer deployment behind the ingress.
    engine_in_ingress: Optional[bool] = None
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "dsquant"
    route_prefix: str = "/"
    dtype: Optional[str] = None     # float compute dtype (pipeline.engine.worker.loader.DTYPES); None: the loader's
    # for tests only: every engine step first sleeps this long, so that a request meant to be long lasts long
    # however fast the machine is (a client's time-out, an abort, a fair share observed mid-request)
    step_delay_s: float = 0.0
    # the chat responses' reasoning parser (pipeline.serving.reasoning): "deepseek_r1", "none", or None: on for a
    # chat template that opens <think> (R1-family checkpoints)
    reasoning_parser: Optional[str] = None
    # with a reasoning parser: constrain the reasoning too (vLLM's enable_in_reasoning); False: a request's
    # grammar starts after </think>
    constrain_reasoning: bool = False

    def __post_init__(self):
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a non-empty string, got {self.model_path!r}")
        for f in ("max_in_flight", "torch_threads", "max_body_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an integer >= 1, got {v!r}")
        cpu_pinning.parse(self.engine_cpus)        # ValueError naming engine_cpus
        if self.api_key is not None:
            check_key(self.api_key, "api_key")     # visible ASCII: compared the same way everywhere
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("parallel", "prefill_parallel"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, Mapping) or set(value) - set(PARALLEL_SIZES):
                    raise ValueError(f"{name} must be a mapping of {', '.join(PARALLEL_SIZES)}, got {value!r}")
                ParallelConfig(**value)
        if self.dtype not in (None, "auto", *DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, 'auto' or null, got {self.dtype!r}")
        if self.reasoning_parser not in (None, "deepseek_r1", "none"):
            raise ValueError(f"reasoning_parser must be deepseek_r1, none or null, got {self.reasoning_parser!r}")
        if not isinstance(self.constrain_reasoning, bool):
            raise ValueError(f"constrain_reasoning must be true or false, got {self.constrain_reasoning!r}")
        if self.moe_combine not in ("reduce", "exact"):
            raise ValueError(f"moe_combine must be 'reduce' or 'exact', got {self.moe_combine!r}")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be true or false, got {self.engine_process!r}")
        if self.engine_in_ingress not in (None, True, False):
            raise ValueError(f"engine_in_ingress must be true, false or null, got {self.engine_in_ingress!r}")
        if self.engine_in_ingress and not self.parallel_of("llm").single:
            raise ValueError("engine_in_ingress: a sharded llm replica (parallel "
                             f"{self.parallel_of('llm').describe()}) runs as a deployment of its own")
        if self.engine_in_ingress and self.ingress.num_replicas != self.llm.num_replicas:
            raise ValueError(f"engine_in_ingress: each ingress replica owns one engine, so ingress.num_replicas "
                             f"({self.ingress.num_replicas}) must equal llm.num_replicas ({self.llm.num_replicas})")
        if isinstance(self.step_delay_s, bool) or not isinstance(self.step_delay_s, (int, float)) \
                or not 0 <= self.step_delay_s <= 60:
            raise ValueError(f"step_delay_s must be a number of seconds in [0, 60], got {self.step_delay_s!r}")
        for f in ("prefill_timeout_s", "body_timeout_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")

    def parallel_of(self, deployment: str) -> ParallelConfig:
        """The layout of one replica of ``deployment`` ("llm" or "prefill")."""
        if deployment == "prefill" and self.prefill_parallel is not None:
            return ParallelConfig(**self.prefill_parallel)
        return ParallelConfig(**self.parallel)

    @property
    def fused(self) -> bool:
        """Whether each ingress replica owns its engine (``engine_in_ingress``, None resolved)."""
        if self.engine_in_ingress is not None:
            return self.engine_in_ingress
        return self.parallel_of("llm").single and self.ingress.num_replicas == self.llm.num_replicas

    def fused_ingress(self) -> DeploymentOptions:
        """The ingress deployment's options when it owns the engine: llm's replicas, the CPUs (and other
        resources) of both."""
        opts = dict(self.llm.ray_actor_options)
        for k, v in self.ingress.ray_actor_options.items():
            if k in ("num_cpus", "num_gpus", "memory") and isinstance(v, (int, float)):
                opts[k] = opts.get(k, 0) + v
            else:
                opts.setdefault(k, v)
        return DeploymentOptions(self.llm.num_replicas, opts)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path.rstrip("/")).name

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ServeConfig":
        """From plain data (a parsed JSON/YAML file); unknown keys are refused by name."""
        d = check_keys(d, cls, "serve config")
        if isinstance(d.get("engine"), Mapping):
            d["engine"] = EngineConfig(**check_keys(d["engine"], EngineConfig, "engine"))
        for key in ("llm", "ingress", "prefill"):
            if isinstance(d.get(key), Mapping):
                d[key] = DeploymentOptions(**check_keys(d[key], DeploymentOptions, key))
        if "model_path" not in d:
            raise ValueError("serve config: model_path is required")
        return cls(**d)

    @classmethod
    def from_mindie(cls, block: Any, devices_available: int, cpu: bool = False, warn=None,
                    **overrides: Any) -> "ServeConfig":
        """From a MindIE ModelConfig block (pipeline.serving.mindie_config: refuses what the devices cannot honour);
        ``overrides`` (from_dict's keys, e.g. ``port``) win; an ``engine``/``llm`` mapping is merged in;
        ``warn(line)`` gets each warning (what the block says that this engine does not follow)."""
        from pipeline.serving.mindie_config import parse_mindie_model_config, to_serve_options

        parsed = parse_mindie_model_config(block, devices_available, cpu=cpu)
        for line in parsed.warnings if warn is not None else ():
            warn(line)
        d = to_serve_options(parsed)
        d["engine"] = {**dataclasses.asdict(DEFAULT_ENGINE), **d["engine"]}
        for key, value in overrides.items():
            d[key] = {**d.get(key, {}), **value} if key in ("engine", "llm") and isinstance(value, Mapping) else value
        return cls.from_dict(d)

    @classmethod
    def from_file(cls, path: str) -> "ServeConfig":
        """Read a ``.json``, ``.yaml`` or ``.yml`` file holding :meth:`from_dict`'s mapping."""
        raw = Path(path).read_bytes()
        if path.endswith((".yaml", ".yml")):
            import yaml

            try:
                data = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
            except RecursionError:
                raise ValueError(f"{path}: not valid YAML (nested too deeply to parse)") from None
        else:
            data = parse_json(raw, path)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping of serve options, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def deployments(self) -> dict[str, DeploymentOptions]:
        """The deployments this config starts, by option name (``llm``, ``ingress``, ``prefill``)."""
        out = {"llm": self.fused_ingress()} if self.fused else {"llm": self.llm, "ingress": self.ingress}
        if self.mode == "disaggregated":
            out["prefill"] = self.prefill
        return out


def check_model_dir(config: ServeConfig) -> str:
    """The kind of ``config.model_path`` (pipeline.engine.worker.loader.dir_kind: "quantized" or "float"),
    refusing (ValueError naming the directory) one that is neither, and a float checkpoint with a sharded
    llm or prefill layout (its engine runs in one process: the shard loader reads quantized directories),
    and MTP speculative decoding (``engine.mtp``) on a model without the MTP layer (an output of
    ``--quant_mtp none``)."""
    from pipeline.engine.worker.loader import FLOAT_CHECKPOINT, carries_mtp, dir_kind

    kind = dir_kind(config.model_path)
    if config.engine.mtp and not carries_mtp(config.model_path):
        raise ValueError(f"--mtp: {config.model_path} carries no MTP layer (quantized with --quant_mtp none, or "
                         "config.json has num_nextn_predict_layers 0); serve it without --mtp")
    if kind == FLOAT_CHECKPOINT:
        for name in config.deployments():
            if name != "ingress" and not config.parallel_of(name).single:
                raise ValueError(f"{config.model_path}: a float checkpoint is served by one process per replica; "
                                 f"drop the {name} sharding ({config.parallel_of(name).describe()})")
    return kind


def check_fits(config: ServeConfig, total_cpus: float, node_cpus: list[float]) -> None:
    """Refuse (ValueError naming what to change) a config whose replicas' CPU requests cannot all be
    scheduled on a cluster with ``total_cpus`` CPUs on nodes of ``node_cpus``: Serve would otherwise wait
    for them forever (a Ray warning every 30 s, requests hanging)."""
    need, parts = 0.0, []
    biggest = max(node_cpus, default=0.0)
    for name, opts in config.deployments().items():
        cpus = float(opts.ray_actor_options.get("num_cpus", 1) or 0)
        ranks = config.parallel_of(name).world if name in ("llm", "prefill") else 1
        if cpus > biggest:
            raise ValueError(f"{name}.ray_actor_options.num_cpus is {cpus:g} but the largest Ray node has "
                             f"{biggest:g} CPUs: lower it (jobs.serve: --llm-num-cpus, or a --config file)")
        need += cpus * opts.num_replicas * ranks
        parts.append(f"{name} {opts.num_replicas} x {cpus:g}" + (f" x {ranks} ranks" if ranks > 1 else ""))
    if need > total_cpus + 1e-9:
        raise ValueError(f"the {config.mode} app needs {need:g} CPUs ({', '.join(parts)}) but the Ray cluster "
                         f"has {total_cpus:g}: lower num_cpus or num_replicas in the llm/prefill/ingress options "
                         "(jobs.serve: --llm-num-cpus, --llm-replicas, or a --config file) or add CPUs")


