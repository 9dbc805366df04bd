"""Quantize a DeepSeek-V3/R1 checkpoint to W8A8 + FA3 (FAKQuant) in the msModelSlim format.

    python -m jobs.quantize --model-path SRC --save-path DST [--fa-quant] [--mindie-format] [--dynamic]
                            [--calib-data FILE] [--fa-exclude-layers 0,1,2] [--smooth] ...

msModelSlim's flags are kept (underscore spellings too). ``--fa-fallback`` / ``--linear-fallback`` auto|N|none
keep the FA3 layers and linears whose quantization costs most, measured on a probe, in bf16, and record
them in the written recipe (pipeline/quant/evaluation/fallback/, docs/accuracy.md). With no arguments it quantizes the embedded
model into ./out/dsv3-tiny-pydoc-w8a8-fa3. SRC and DST may be local paths or fsspec URLs (s3://...).

With ``--stages N`` the job runs distributed on Ray (actors.quantize.quantize_job): N pipeline stages (times
``--replicas``), on the cluster of ``--ray-address`` / RAY_ADDRESS (``ray job submit`` sets it), or on a
local Ray started for the job. That form is resumable: a rerun skips what is committed and verified, and
a rerun of a finished job with the same source, recipe and data does nothing. Same files either way.

The single-process job reads the checkpoint once: layer-wise calibration (pipeline.quant.calibration.layerwise), each
layer read, calibrated and quantized from the same tensors; ``--two-pass`` runs the reference (the whole
float model, then the weights read again), with the same files.

One job writes a destination at a time: the job holds a lock object beside it (``.<name>.dsquant-lock``;
an exclusive create on local disk and NFS, a conditional create on S3), and a second job on the same
``--save-path`` stops with a line naming the first; a lock whose job is gone is taken over
(pipeline/io/destination/lock.py).

With ``--dynamic --no-fa-quant --disable-anti`` (and no ``--smooth``) no output depends on an activation: either form
runs no calibration (data-free: no calibration data or tokenizer read, the source read once). Before
it starts, the job prints what it will read, compute and write and roughly how long here
(``--no-estimate``: not), then a progress bar per phase with its rate (``--no-progress``: none).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_SAVE = os.path.join("out", "dsv3-tiny-pydoc-w8a8-fa3")
SHARD_UNLIMITED = 1 << 62  # part_file_size 0: no split (msModelSlim's single file)


def _flag(ap, *names, **kw):
    """Each --a-b option also as --a_b (msModelSlim's spelling); its help ends with its default."""
    spelled = []
    for n in names:
        spelled += [n] + ([f"--{n[2:].replace('-', '_')}"] if "-" in n[2:] else [])
    if "default" not in kw.get("help", ""):
        kw["help"] = f"{kw.get('help', '')} (default: %(default)s)".lstrip()
    return ap.add_argument(*spelled, **kw)


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids like 0,1,2, got {text!r}") from None


def build_parser(prog: str = "python -m jobs.quantize", description: str = "") -> argparse.ArgumentParser:
    from pipeline.quant.recipe.presets import MODEL_TYPES, QUANT_TYPES, presets_help

    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n")[0])
    _flag(ap, "--model-path", default=None, help="source checkpoint; None: the embedded model")
    _flag(ap, "--save-path", default=DEFAULT_SAVE, help="output directory")
    _flag(ap, "--calib-data", "--calib_file", dest="calib_data", default=None,
          help="calibration texts: .json list of strings, .jsonl with 'text', or .parquet with a 'text' "
               "column; None: the embedded model's texts")
    r = ap.add_argument_group("recipe (docs/msmodelslim.md): a modelslim_v1 file, a preset, or the legacy script's flags")
    _flag(r, "--config-path", default=None, metavar="R.yaml",
          help="run this msModelSlim modelslim_v1 recipe (quarot, iter_smooth, flex_smooth_quant, linear_quant, "
               "fa3_quant; its dataset unless --calib-data)")
    _flag(r, "--model-type", default=None, choices=MODEL_TYPES,
          help="the model: picks the preset with --quant-type, and the FA3 exclusion list of the legacy flags; "
               "None: read from the model path as msModelSlim's script does (R1, V3.1, V3)")
    _flag(r, "--quant-type", default=None, choices=QUANT_TYPES, help="preset: " + presets_help())
    _flag(r, "--anti-method", default=None, metavar="{m4,m6,none}",
          help="legacy anti-outlier step: m4 = iter_smooth (alpha 0.5, a shift on norm-linear), m6 = "
               "flex_smooth_quant, none; None: m4, as quant_deepseek_w8a8.py")
    _flag(r, "--disable-anti", action="store_true", help="legacy: no anti-outlier step (as --anti-method none)")
    _flag(r, "--rot", action="store_true", help="legacy: QuaRot (block 32) before the anti-outlier step")
    _flag(r, "--quant-mtp", default=None, metavar="{float,mix,none}",
          help="the MTP layer: float (kept in the model dtype), mix (quantized like the other layers) or none "
               "(not read, calibrated or written, config.json the source's: msModelSlim's script default); "
               "None: float, or what the recipe says")
    fa = r.add_mutually_exclusive_group()
    _flag(fa, "--fa-quant", dest="fa_quant", action="store_true", default=None,
          help="FA3: int8 MLA latent cache scales (default: on)")
    _flag(fa, "--no-fa-quant", dest="fa_quant", action="store_false", help="W8A8 only, no FA3 (default: FA3 on)")
    _flag(ap, "--fa-exclude-layers", type=_layers, default=(), help="layers kept out of FA3, e.g. 0,1,2,46")
    _flag(ap, "--mlp-smooth-layers", type=_layers, default=(),
          help="main layers whose MLP input (post_attention_layernorm) is smoothed into gate/up and the router "
               "by power-of-two scales, e.g. 1,2 (pipeline/quant/transforms/mlp_smooth.py); recorded in the recipe")
    _flag(ap, "--fa-fallback", default="none", metavar="auto|N|none",
          help="FA3 layers kept bf16 by measured cost (pipeline/quant/evaluation/fallback/): auto, the fewest meeting its "
               "target; N, the N costliest; none. Recorded in the written recipe, reported in fallback.json")
    _flag(ap, "--linear-fallback", default="none", metavar="auto|N|none",
          help="quantized linears by measured cost: auto, the ladder W8A8 -> W8A8_DYNAMIC -> float per piece (one "
               "routed expert at a time) with the fewest bytes above int8 meeting the target; N, the N costliest "
               "kept float (routed experts per layer and projection); none")
    _flag(ap, "--fallback-target", default=None, metavar="agreement=A,ppl=P[,kl=K][,sqnr=S][,share=F]",
          help="what auto fallback meets on the calibration samples (fitting and held-out): top-1 agreement with "
               "float >= A, perplexity change <= P %%, mean KL <= K, every layer's attention SQNR >= S dB; share: "
               "at most F of the linear weights above int8 (default agreement=0.98,ppl=1,sqnr=32)")
    _flag(ap, "--fallback-mlp-smooth", choices=("auto", "none"), default="auto",
          help="with --linear-fallback auto: smooth each layer's MLP input where that lowers its measured error, "
               "before any piece goes bf16 (auto), or not (none)")
    _flag(ap, "--dynamic", action="store_true", help="every quantized linear W8A8_DYNAMIC")
    _flag(ap, "--mindie-format", action="store_true", help="add MindIE's config.json keys (and model_type deepseekv2)")
    _flag(ap, "--target-runtime", choices=("vllm-ascend", "mindie", "dsquant"), default=None,
          help="refuse, before any work, options whose output this runtime cannot load (jobs.check --runtime)")
    _flag(ap, "--smooth", action="store_true", help="anti-outlier smoothing (SmoothQuant + latent), format unchanged")
    _flag(ap, "--smooth-alpha", type=float, default=0.5, help="smoothing migration strength alpha in [0, 1]")
    _flag(ap, "--quantize-mtp", action="store_true", help="quantize the MTP layer too (else it stays FLOAT)")
    _flag(ap, "--dialect", choices=("seed", "ascendV1"), default=None,
          help="seed: the legacy msModelSlim/MindIE layout; ascendV1: msModelSlim's newer saver; None: the "
               "recipe's saver (ascendv1_saver: ascendV1), else seed")
    _flag(ap, "--batch-size", type=int, default=1,
          help="accepted for msModelSlim compatibility and ignored (samples per forward: --calib-batch)")
    _flag(ap, "--calib-batch", type=int, default=1,
          help="calibration samples per forward, right-padded, the padding masked out of every statistic "
               "(layer-wise job only)")
    _flag(ap, "--calib-products", choices=("auto", "fp32", "model"), default="auto",
          help="how the calibration forward multiplies bf16/fp16 operands: fp32 (the fp32 GEMM of the upcast "
               "operands, rounded once: a bf16 GEMM's arithmetic, summed in another order), model (torch's "
               "matmuls in the model dtype, the reference mode), auto: fp32 where torch has no native kernel "
               "for the dtype (CPUs without AVX-512 BF16 or AMX), else model; see pipeline/quant/numerics/products.py")
    _flag(ap, "--calibration", choices=("msmodelslim", "float"), default="msmodelslim",
          help="msmodelslim: layer by layer, each layer on the previous layers' fake-quantized outputs, with "
               "DeepSeek's modeling arithmetic (msModelSlim's v1 runner: its activation parameters); float: the "
               "float model's activations in one pass (pipeline stages calibrate in parallel; close, not equal)")
    _flag(ap, "--two-pass", action="store_true",
          help="the reference calibration: the whole float model first, then the weights read again "
               "(default: one read, layer by layer; the same files)")
    _flag(ap, "--max-calib-tokens", type=int, default=2048, help="longest calibration sample allowed")
    _flag(ap, "--truncate", action="store_true", help="cut longer calibration samples instead of failing")
    _flag(ap, "--shard-size-gb", type=float, default=None,
          help="weight shard size limit in GiB; None: the recipe saver's part_file_size, else 4")
    _flag(ap, "--overwrite", action="store_true",
          help="replace an existing output in --save-path (kept until the new one is complete)")
    _flag(ap, "--device", default=None, help="cpu or cuda; None: cuda when present")
    _flag(ap, "--no-progress", action="store_true", help="no progress bars (one per phase, with its rate)")
    _flag(ap, "--no-estimate", action="store_true",
          help="no up-front estimate (what the job reads, computes and writes, and roughly how long here)")
    _flag(ap, "--s3-endpoint", default=None, help="S3 endpoint URL for s3:// paths (credentials: the usual AWS_* "
          "environment); None: AWS_ENDPOINT_URL or AWS's")
    d = ap.add_argument_group("distributed (Ray)")
    _flag(d, "--stages", type=int, default=None,
          help="pipeline stages on Ray, 1..num_hidden_layers (as jobs.plan); None: one process, no Ray")
    _flag(d, "--replicas", type=int, default=1, help="data-parallel copies of every stage")
    _flag(d, "--ray-address", default=None, help="Ray cluster to use; None: RAY_ADDRESS, else a local Ray")
    _flag(d, "--cpus-per-actor", type=float, default=1.0, help="CPUs reserved per stage actor")
    _flag(d, "--gpus-per-actor", type=float, default=0.0, help="GPUs reserved per stage actor")
    _flag(d, "--memory-per-actor-gb", type=float, default=0.0, help="memory reserved per actor with Ray (0: none)")
    _flag(d, "--actor-resource", action="append", default=[], metavar="NAME=N",
          help="a custom Ray resource every stage actor asks for, e.g. stage_slot=1 (repeatable)")
    _flag(d, "--in-flight", type=int, default=4, help="calibration samples in flight per pipeline (backpressure)")
    _flag(d, "--verify", choices=("sha256", "size"), default="sha256",
          help="how shards of an earlier run are checked before being kept (sha256 re-reads them)")
    return ap


def _resources(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"--actor-resource wants NAME=N such as stage_slot=1, got {item!r}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def make_job(args: argparse.Namespace, log: Callable[[str], None] = print):
    """(src, dst, Recipe, QuantizeOptions, DistOptions or None) from the parsed flags; ``log`` says where the
    recipe came from (and the FA3 list the legacy flags chose). ``args.fallback`` is set to
    (fa choice, linear choice, recipe -> YAML text) when a fallback is asked, else None."""
    from pipeline.io import storage
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.engine.device import check_device
    from pipeline.model.loading import default_device
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.quant.recipe.recipe_source import RecipeRequest, resolve
    from pipeline.quant.job.run import QuantizeOptions


    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.calib_batch < 1:
        raise ValueError(f"--calib-batch must be >= 1, got {args.calib_batch}")
    if args.calib_batch > 1 and args.two_pass:
        raise ValueError("--calib-batch > 1 needs the layer-wise job (drop --two-pass)")
    if args.stages is not None and args.stages < 1:
        raise ValueError(f"--stages must be >= 1, got {args.stages} (leave it out for the single-process job)")
    if args.shard_size_gb is not None and not 0 < args.shard_size_gb < math.inf:
        raise ValueError(f"--shard-size-gb must be a finite number > 0, got {args.shard_size_gb}")
    if args.quantize_mtp and args.quant_mtp not in (None, "mix"):
        raise ValueError(f"--quantize-mtp quantizes the MTP layer, --quant-mtp {args.quant_mtp} does not: give one")
    if args.max_calib_tokens < 1:
        raise ValueError(f"--max-calib-tokens must be >= 1, got {args.max_calib_tokens}")
    if not 0 <= args.smooth_alpha <= 1:
        raise ValueError(f"--smooth-alpha must be in [0, 1], got {args.smooth_alpha}")
    check_device(args.device)           # an unknown device, or CUDA without it: before anything loads
    from pipeline.quant.evaluation.fallback import TARGET, parse_choice, parse_target

    fallback = tuple(None if c == 0 else c for c in (parse_choice(args.fa_fallback, "--fa-fallback"),
                                                     parse_choice(args.linear_fallback, "--linear-fallback")))
    target = parse_target(args.fallback_target) if args.fallback_target is not None else TARGET
    if args.fallback_target is not None and fallback == (None, None):
        raise ValueError("--fallback-target: no --fa-fallback or --linear-fallback given (the target is what "
                         "their auto pick meets)")
    if fallback != (None, None) and args.stages:
        raise ValueError("--fa-fallback / --linear-fallback run in the one-process job (drop --stages)")
    if args.s3_endpoint:
        storage.set_options("s3", client_kwargs={"endpoint_url": args.s3_endpoint})
    src = args.model_path or EMBEDDED_MODEL_DIR
    storage.check_reachable(src)
    cfg = CheckpointReader(src).config
    if args.stages is not None and args.stages > cfg.num_hidden_layers:     # as jobs.plan: stages split the main layers
        raise ValueError(f"--stages must be 1..{cfg.num_hidden_layers} (the model's main layers), got {args.stages}")
    req = RecipeRequest(config_path=args.config_path, model_type=args.model_type, quant_type=args.quant_type,
                        anti_method=args.anti_method, disable_anti=args.disable_anti, rot=args.rot,
                        quant_mtp="mix" if args.quantize_mtp else args.quant_mtp, fa_quant=args.fa_quant,
                        dynamic=args.dynamic, smooth=args.smooth, fa_exclude_layers=args.fa_exclude_layers,
                        mlp_smooth_layers=args.mlp_smooth_layers,
                        dialect=args.dialect, calib_products=args.calib_products, calib_data=args.calib_data,
                        calibration=args.calibration)
    resolved = resolve(req, args.model_path, cfg, log)
    recipe = resolved.recipe
    log(f"recipe: {resolved.source}")
    if fallback != (None, None):
        from pipeline.quant.evaluation.fallback import check_choices

        fallback = check_choices(recipe, cfg, *fallback)     # from the recipe and config: before any work
    args.fallback = None if fallback == (None, None) else (
        *fallback, lambda r: dataclasses.replace(resolved, recipe=r).yaml_text(), target, print,
        args.fallback_mlp_smooth == "auto")
    shard_gb = args.shard_size_gb if args.shard_size_gb is not None else (resolved.part_file_size or 4.0)
    opts = QuantizeOptions(calib_path=resolved.calib_path, max_calib_tokens=args.max_calib_tokens,
                           truncate=args.truncate, smooth_alpha=args.smooth_alpha,
                           mindie_format=args.mindie_format, overwrite=args.overwrite,
                           shard_bytes=int(shard_gb * 1024 ** 3) if shard_gb > 0 else SHARD_UNLIMITED,
                           recipe_file=(resolved.file_name, resolved.yaml_text()),
                           device=args.device or default_device(), progress=not args.no_progress,
                           estimate=not args.no_estimate, layerwise=not args.two_pass, calib_batch=args.calib_batch)
    dist = None
    if args.stages:
        from actors.quantize.ray_session import DistOptions
        from actors.cluster.ray_start import check_address

        check_address(args.ray_address, "--ray-address")   # before anything is written: no cluster, no .dsquant/

        dist = DistOptions(stages=args.stages, replicas=args.replicas, address=args.ray_address,
                           cpus_per_actor=args.cpus_per_actor, gpus_per_actor=args.gpus_per_actor,
                           memory_per_actor=int(args.memory_per_actor_gb * 1024 ** 3), in_flight=args.in_flight,
                           verify=args.verify, resources=_resources(args.actor_resource))
    return src, args.save_path, recipe, opts, dist


JOB_ERRORS: tuple = (OSError, ValueError)


def job_errors() -> tuple:
    """The exceptions that mean bad input or an unusable location (exit 2 with the message), not a bug:
    a file that cannot be read (a directory, a symlink loop), a full disk, an unreachable store."""
    from pipeline.io.checkpoint import CheckpointError
    from pipeline.config import ConfigError
    from pipeline.quant.plan.types import PlanError
    from pipeline.quant.calibration.calib_data import CalibDataError
    from pipeline.quant.numerics.qparams import QuantError

    return (CheckpointError, ConfigError, CalibDataError, QuantError, PlanError, *JOB_ERRORS)


def run_guarded(job: Callable[[], Any], failed: tuple = ()) -> tuple[int, Any]:
    """(0, job()) or, printing the message: (2, None) for bad input, (1, None) for a ``failed`` error."""
    try:
        return 0, job()
    except failed as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1, None
    except job_errors() as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2, None


def error_line(e: BaseException) -> str:
    """The one line a job prints for bad input: an OSError as its file and reason."""
    from pipeline.io.storage import describe_os_error

    text = describe_os_error(e) if isinstance(e, OSError) else str(e)
    return text.splitlines()[0] if text.strip() else type(e).__name__


def failures(dist) -> tuple:
    """The distributed job's failure type when ``dist`` is set (imports Ray only then)."""
    if dist is None:
        return ()
    from actors.quantize.ray_session import JobFailed

    return (JobFailed,)


def _run_here(args, src, dst, recipe, opts) -> int:
    """The one-process job (with its fallback probe when asked); SIGTERM stops it cleanly (exit 143)."""
    from jobs._stop_signal import Terminated, sigterm_raises, stopped
    from pipeline.quant.evaluation.fallback import quantize_with_fallback
    from pipeline.quant.job.run import quantize_checkpoint

    try:
        with sigterm_raises():
            if args.fallback:
                return run_guarded(lambda: quantize_with_fallback(src, dst, recipe, opts, *args.fallback))[0]
            return run_guarded(lambda: quantize_checkpoint(src, dst, recipe, opts))[0]
    except Terminated:
        return stopped(f"{dst} is as it was before the job (its partial files and probe removed)")


def main(argv=None) -> int:
    args = parse_args(argv)
    rc, job = run_guarded(lambda: make_job(args))
    if rc:
        return rc
    src, dst, recipe, opts, dist = job
    from jobs._runtime_targets import announce, loads_in

    refused = announce(args.target_runtime, src, recipe, opts)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    if dist is None:
        rc = _run_here(args, src, dst, recipe, opts)
    else:
        from actors.quantize.quantize_job import quantize_distributed

        rc, _ = run_guarded(lambda: quantize_distributed(src, dst, recipe, opts, dist), failures(dist))
    if rc == 0:
        print(f"done: {dst} (check it with: python -m jobs.check {dst})")
        print(loads_in(dst))
    return rc


if __name__ == "__main__":
    sys.exit(main())
