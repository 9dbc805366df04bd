"""``jobs.quantize``'s word on where its output will load: before the heavy work, which runtimes the chosen
options give an output for (pipeline.format.runtimes.runtimes_for), a one-line warning for each runtime an
option rules out, and with ``--target-runtime`` a refusal of such options up front."""

from __future__ import annotations

import json
from typing import Callable, Optional

from pipeline.format.runtimes import RUNTIMES, runtimes_for


def source_dtype(src: str) -> Optional[str]:
    """The source checkpoint's torch_dtype (config.json), None when it cannot be read."""
    from pipeline.io import storage

    try:
        cfg = json.loads(storage.read_bytes(storage.join(src, "config.json")))
    except (OSError, ValueError):
        return None
    return cfg.get("torch_dtype", cfg.get("dtype")) if isinstance(cfg, dict) else None


def announce(target: Optional[str], src: str, recipe, opts, log: Callable[[str], None] = print) -> Optional[str]:
    """Say which runtimes the output will load in (``log``); the error when ``target`` is one of those it
    will not (nothing is computed then), else None."""
    verdict = runtimes_for(mindie_format=bool(opts.mindie_format), fa_quant=bool(recipe.fa_quant),
                           model_dtype=source_dtype(src))
    ok = [r for r in RUNTIMES if verdict[r] is None]
    log(f"runtimes: this output will load in {', '.join(ok)} (check it with: python -m jobs.check OUT --runtime R)")
    for r in RUNTIMES:
        if verdict[r] is not None and r != target:
            log(f"warning: not for {r}: {verdict[r]}")
    if target is not None and verdict[target] is not None:
        return f"--target-runtime {target}: {verdict[target]}"
    return None
