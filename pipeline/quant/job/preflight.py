"""Everything a quantize job can check before its heavy work (loading the model, calibrating, writing):
the locations (the destination is not the source, however spelt; it holds nothing but an earlier output,
which needs ``overwrite``; object stores answer; the local disk has room), the source (config, headers,
every stored float tensor in the config's dtype: the output could not be written otherwise), the recipe
against the config, and the calibration data, read and tokenized. A failure here costs seconds and
leaves the destination as it was."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import model_dtype
from pipeline.io import storage
from pipeline.io.checkpoint import CONFIG_NAME, ROUTER_BIAS_SUFFIX, SCALE_SUFFIX, CheckpointError, CheckpointReader
from pipeline.io.json_input import parse_json
from pipeline.io.safetensors_io import DTYPE_NAMES, DTYPES
from pipeline.quant.writing.output_files import existing_output
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.recipe_plan import RecipePlan, resolve
from pipeline.quant.job.options import QuantizeOptions, calibration_samples
from pipeline.quant.writing.shard_layout import output_units
from pipeline.quant.writing.writer import check_finish_args


@dataclass(frozen=True)
class CheckedJob:
    """What the checks read, for the job to use rather than read again."""

    reader: CheckpointReader
    raw_config: dict          # the source's config.json object
    model_dtype: torch.dtype
    samples: list             # the calibration samples' token ids
    output_bytes: int         # the output's tensor data
    needs_calibration: bool   # the recipe reads activation statistics (else: data-free, ``samples`` empty)
    plan: RecipePlan          # the recipe resolved for the source's model


def check_source_dtypes(reader: CheckpointReader) -> None:
    """Every stored float tensor in the config's torch_dtype, but FP8 weights, their scales and the router
    bias (float32 by design); else CheckpointError naming the first tensor that is not."""
    want = DTYPE_NAMES[model_dtype(reader.config)]
    for name in reader.tensor_names():
        dt, _ = reader.header(name)
        if (name.endswith((SCALE_SUFFIX, ROUTER_BIAS_SUFFIX)) or dt.startswith("F8_")
                or not DTYPES[dt].is_floating_point or dt == want):
            continue
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} is stored as {dt}, but config.json says "
                              f"torch_dtype {reader.config.torch_dtype!r} ({want}); every weight must be in "
                              "the model dtype")


def check_job(src: str, dst: str, recipe: Recipe, opts: QuantizeOptions, *, resumable: bool = False) -> CheckedJob:
    """Run every check of the module doc; raises the first failure (bad input: the job's exit status 2).
    ``resumable`` (the distributed job): an earlier output in ``dst`` is the job's to resume or replace,
    so only the source and foreign files are refused here."""
    for path in (src, dst):
        storage.check_reachable(path)
    existing_output(dst, opts.overwrite or resumable, src)
    reader = CheckpointReader(src, with_mtp=not recipe.drop_mtp)
    reader.check_headers()      # every tensor's name, dtype, shape and FP8 scale, from the headers alone
    cfg = reader.config
    recipe.check_config(cfg)
    md = model_dtype(cfg)
    check_source_dtypes(reader)
    config_path = storage.join(src, CONFIG_NAME)
    raw_config = parse_json(storage.read_bytes(config_path), config_path, CheckpointError)
    check_finish_args(dst, raw_config, src, md)
    nbytes = sum(s.nbytes for _, specs in output_units(reader, recipe) for s in specs)
    storage.check_room(dst, nbytes)
    # data-free recipes (no static linear, no FA3, no smoothing) read no calibration data, nor a tokenizer,
    # in either job (the distributed one then starts its actors for the weight phase only)
    needs = recipe.needs_calibration(cfg)
    plan = resolve(recipe, cfg)
    plan.check_calibration(needs, layerwise=opts.layerwise)
    samples = calibration_samples(src, opts, cfg.max_position_embeddings) if needs else []
    return CheckedJob(reader, raw_config, md, samples, nbytes, needs, plan)


def data_free_notes(src: str) -> list[str]:
    """The log lines of a job whose recipe reads no statistic: that it runs no calibration, and a warning
    when the source has no tokenizer (the output then has none either)."""
    lines = ["data-free: the recipe reads no activation statistic (no static linear, no FA3, no smoothing): "
             f"no calibration, {src} is read once, for its weights"]
    if not storage.exists(storage.join(src, "tokenizer.json")):
        lines.append(f"warning: {src} has no tokenizer.json; the output will have none either")
    return lines
