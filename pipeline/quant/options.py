"""How a quantize job runs (not what it computes: that is the Recipe), and its calibration samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.quant.calib_data import load_texts, tokenize
from pipeline.text.tokenizer import Tokenizer

SHARD_BYTES = 4 * 1024 ** 3


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
    estimate: bool = False                  # log the up-front estimate first (pipeline.quant.estimate); the CLI's default


def calibration_samples(src: str, opts: QuantizeOptions, max_positions: int) -> list[list[int]]:
    """The calibration texts tokenized one by one as HF's ``tokenizer(text)`` does (bos only when the
    tokenizer's post-processor adds it), which is how msModelSlim feeds them."""
    tok = Tokenizer.from_dir(src)
    texts = load_texts(opts.calib_path)
    return tokenize(texts, tok, max_tokens=min(opts.max_calib_tokens, max_positions), truncate=opts.truncate,
                    add_bos=tok.adds_bos_by_default, source=opts.calib_path or "default calibration texts")
