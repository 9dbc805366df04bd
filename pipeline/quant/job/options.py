"""How a quantize job runs (not what it computes: that is the Recipe), and its calibration samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.quant.calibration.calib_data import load_texts, tokenize
from pipeline.text.tokenizer import Tokenizer

SHARD_BYTES = 4 * 1024 ** 3
CALIB_BATCH_REL = 0.05  # the bound on the relative change of a recorded statistic with calib_batch > 1 (below)


@dataclass(frozen=True)
class QuantizeOptions:
    """How to run (not what to compute: that is the Recipe)."""

    calib_path: Optional[str] = None        # default: the embedded model's calibration texts
    max_calib_tokens: int = 2048            # per sample; longer samples are an error unless truncate
    truncate: bool = False
    smooth_alpha: float = 0.5
    mindie_format: bool = False
    overwrite: bool = False
    shard_bytes: int = SHARD_BYTES
    device: Optional[str] = None
    progress: bool = False
    prefetch: bool = True                   # read layer i+1 while layer i is quantized: one more layer in memory
    estimate: bool = False                  # log the up-front estimate first (pipeline.quant.job.estimate); the CLI's default
    layerwise: bool = True                  # one read of the checkpoint (pipeline.quant.calibration.layerwise); False: the
                                            # two-pass reference (whole float model, then the weight phase)
    calib_batch: int = 1                    # samples per calibration forward (layer-wise only); see below
    recipe_file: Optional[tuple[str, str]] = None  # (name, YAML text) written next to the weights: the recipe run
    extra_files: tuple[tuple[str, bytes], ...] = ()  # (name, bytes) more files written with the output
    # calib_batch > 1: consecutive samples right-padded into one forward of the statistics stream
    # (pipeline.quant.calibration.calibrate.run_layer_batched), the padding masked out of every observation, so the
    # statistics are the same function of the same tokens; but a GEMM over more rows may round
    # differently. Measured (CPU, torch 2.13, bf16, batches 4/8/16): on the embedded model every statistic
    # equal, the output files byte-identical; on a DeepSeek-V3-shaped checkpoint (hidden 7168, 16 default
    # samples) 1 of 14 statistics moved (one end of layer 1's fa_q recall window, by up to 4.4% relative)
    # and no recorded scale moved (max relative change 0). CALIB_BATCH_REL bounds the change of any
    # recorded end or scale (tested). Speed on a shared 2-core CPU: the embedded model, its 64 default
    # texts, 8.8 samples/s at batch 1, 10.0 / 10.3 / 9.8 at 4 / 8 / 16; the V3-shaped checkpoint 0.51 at
    # batch 1, 0.32 / 0.25 at 4 / 16 (padding costs more than bigger GEMMs gain). Batch 1, the exact
    # reference, stays the default; larger batches are for accelerators (not measured here).

    def __post_init__(self):
        if isinstance(self.calib_batch, bool) or not isinstance(self.calib_batch, int) or self.calib_batch < 1:
            raise ValueError(f"QuantizeOptions.calib_batch must be an int >= 1, got {self.calib_batch!r}")
        if self.calib_batch > 1 and not self.layerwise:
            raise ValueError("QuantizeOptions.calib_batch > 1 needs layerwise=True (the two-pass reference runs "
                             "one sample at a time)")


def calibration_samples(src: str, opts: QuantizeOptions, max_positions: int) -> list[list[int]]:
    """The calibration texts tokenized one by one as HF's ``tokenizer(text)`` does (bos only when the
    tokenizer's post-processor adds it), which is how msModelSlim feeds them."""
    tok = Tokenizer.from_dir(src)
    texts = load_texts(opts.calib_path)
    return tokenize(texts, tok, max_tokens=min(opts.max_calib_tokens, max_positions), truncate=opts.truncate,
                    add_bos=tok.adds_bos_by_default, source=opts.calib_path or "default calibration texts")
