"""What every benchmark script does with its figures: print them and write them as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def write_result(path: str | Path, result: dict[str, Any], hide: Iterable[str] = (), show: bool = True) -> None:
    """Print ``result`` (unless ``show`` is False; less the bulky keys in ``hide``) and write all of it
    to ``path`` as JSON."""
    hidden = set(hide)
    if show:
        print(json.dumps({k: v for k, v in result.items() if k not in hidden}, indent=1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def loadavg() -> str:
    """/proc/loadavg as it reads (the 1, 5 and 15 minute loads first), or "n/a"."""
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def median_us(fn, reps: int, digits: int = 1) -> float:
    """The median wall time of ``reps`` calls of ``fn`` in microseconds, after a few warm-up calls."""
    import statistics
    import time

    for _ in range(max(3, reps // 20)):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(ts), digits)


def embedded_quantized(folder: str | Path) -> Path:
    """The embedded model quantized with the default recipe (W8A8 + FA3) in ``folder``/q, made once and
    reused by the engine benchmarks."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint

    qdir = Path(folder) / "q"
    if not (qdir / "quant_model_description.json").exists():
        quantize_checkpoint(str(EMBEDDED_MODEL_DIR), str(qdir), Recipe(), QuantizeOptions(overwrite=True),
                            log=lambda m: None)
    return qdir
