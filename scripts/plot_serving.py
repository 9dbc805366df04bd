"""Plot serving benchmarks: output tokens/s and median TPOT against concurrency, one line per server or
mode, side by side.

    python scripts/plot_serving.py OUT.png INPUT [INPUT ...]

Each INPUT is one of
- what ``scripts/bench_serve.py`` writes (``{"modes": {mode: [level, ...]}}``): one line per mode;
- a folder of ``vllm bench serve --save-result`` files (``max_concurrency``, ``output_throughput``,
  ``median_tpot_ms``): one line, named after the folder, the median over rounds at each concurrency;
- a series file ``{"series": [{"label": ..., "points": [{"concurrency", "output_tok_s",
  "median_tpot_ms"}, ...]}]}``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

Point = dict  # {"concurrency": int, "output_tok_s": float, "median_tpot_ms": float}


def series_of(path: Path) -> list[dict]:
    """The ``[{"label", "points"}]`` lines one input holds."""
    if path.is_dir():
        return [_vllm_dir(path)]
    data = json.loads(path.read_text())
    if "series" in data:
        return data["series"]
    if "modes" in data:
        return [{"label": mode, "points": [{"concurrency": lv["concurrency"],
                                            "output_tok_s": lv["output_token_throughput"],
                                            "median_tpot_ms": lv["tpot_ms"]["median"]} for lv in levels]}
                for mode, levels in data["modes"].items()]
    raise ValueError(f"{path}: neither a series file nor bench_serve output (no 'series' or 'modes' key)")


def _vllm_dir(folder: Path) -> dict:
    by_c: dict[int, list[dict]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        missing = [k for k in ("max_concurrency", "output_throughput", "median_tpot_ms") if k not in r]
        if missing:
            raise ValueError(f"{f}: not a vllm bench serve result (no {', '.join(missing)})")
        by_c.setdefault(int(r["max_concurrency"]), []).append(r)
    if not by_c:
        raise ValueError(f"{folder}: no vllm bench serve result (*.json) in it")
    points = [{"concurrency": c, "output_tok_s": statistics.median(r["output_throughput"] for r in rs),
               "median_tpot_ms": statistics.median(r["median_tpot_ms"] for r in rs)} for c, rs in sorted(by_c.items())]
    return {"label": folder.name, "points": points}


def plot(series: list[dict], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=110)
    ax_t, ax_l = fig.subplots(1, 2)
    ticks = sorted({p["concurrency"] for s in series for p in s["points"]})
    for s in series:
        pts = sorted(s["points"], key=lambda p: p["concurrency"])
        xs = [p["concurrency"] for p in pts]
        ax_t.plot(xs, [p["output_tok_s"] for p in pts], marker="o", label=s["label"])
        ax_l.plot(xs, [p["median_tpot_ms"] for p in pts], marker="o", label=s["label"])
    for ax, what in ((ax_t, "output tokens/s (higher is better)"), (ax_l, "median TPOT, ms (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, inputs = Path(argv[0]), [Path(a) for a in argv[1:]]
    try:
        series = [s for p in inputs for s in series_of(p)]
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot(series, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
