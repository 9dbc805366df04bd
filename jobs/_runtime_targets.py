"""``jobs.quantize``'s word on where its output will load: before the heavy work, which runtimes the chosen
options give an output for (pipeline.format.runtimes.runtimes_for), a one-line warning for each runtime an
option rules out, and with ``--target-runtime`` a refusal of such options up front; after it, the
runtimes the written output loads in, checked on the output itself (pipeline.format.runtimes.check_runtime)."""

from __future__ import annotations

import json
from typing import Callable, Optional

from pipeline.format.runtimes import RUNTIMES, check_runtime, runtimes_for


def source_config(src: str) -> dict:
    """The source checkpoint's config.json ({} when it cannot be read)."""
    from pipeline.io import storage

    try:
        cfg = json.loads(storage.read_bytes(storage.join(src, "config.json")))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def writes_fa3(recipe, raw: dict) -> bool:
    """Whether the recipe gives any layer of the source FA3 tensors (``Recipe.writes_fa3``; whether it asks
    for FA3 when the config cannot be read)."""
    from pipeline.config import ConfigError, DeepseekV3Config

    try:
        cfg = DeepseekV3Config.from_dict(raw, source="config.json")
    except (ConfigError, ValueError, TypeError):
        cfg = None
    return recipe.writes_fa3(cfg)


def announce(target: Optional[str], src: str, recipe, opts, log: Callable[[str], None] = print) -> Optional[str]:
    """Say which runtimes the output will load in (``log``); the error when ``target`` is one of those it
    will not (nothing is computed then), else None."""
    raw = source_config(src)
    verdict = runtimes_for(mindie_format=bool(opts.mindie_format), fa_quant=writes_fa3(recipe, raw),
                           model_dtype=raw.get("torch_dtype", raw.get("dtype")))
    ok = [r for r in RUNTIMES if verdict[r] is None]
    log(f"runtimes: this output will load in {', '.join(ok)} (check it with: python -m jobs.check OUT --runtime R)")
    for r in RUNTIMES:
        if verdict[r] is not None and r != target:
            log(f"warning: not for {r}: {verdict[r]}")
    if target is not None and verdict[target] is not None:
        return f"--target-runtime {target}: {verdict[target]}"
    return None


def loads_in(dst: str) -> str:
    """The line that labels a written output: the runtimes whose loader rules it meets."""
    try:
        ok = [r for r in RUNTIMES if check_runtime(dst, r, verify=False).ok]   # sizes, not sha256s
    except (OSError, ValueError) as e:
        return f"runtimes: not checked ({e})"
    return f"runtimes: {dst} loads in {', '.join(ok) or 'none of ' + ', '.join(RUNTIMES)}"
