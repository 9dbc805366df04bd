"""The accuracy report of ``jobs.evaluate``: markdown tables, a PNG with the two views people look at
(perplexity per variant; SQNR per layer by module type) and one self-contained HTML page with both.

Inputs are the rows ``pipeline.quant.evaluate.evaluate`` returns. The model is named by what a reader can
use elsewhere (:func:`model_label`): a URL as given, a path inside the current directory relative to it,
any other local path by its folder name, never by this machine's absolute path.
"""

from __future__ import annotations

import base64
import html
import io
import os
from typing import Sequence

from pipeline.io import storage
from pipeline.quant.evaluate import ppl_table, sqnr_summary

PNG_NAME, HTML_NAME, MD_NAME = "report.png", "report.html", "report.md"


def model_label(src: str, cwd: str | None = None) -> str:
    """How a report names the model ``src``."""
    if "://" in src:
        return src
    path = os.path.abspath(src)
    base = os.path.abspath(cwd or os.getcwd())
    if path == base or path.startswith(base + os.sep):
        return os.path.relpath(path, base)
    return os.path.basename(path.rstrip(os.sep)) or path


def markdown(label: str, ppl: Sequence[dict], sqnr: Sequence[dict], seq: int) -> str:
    return (f"# Accuracy of W8A8 + FA3 on {label}\n\nHeld-out tokens: {ppl[0]['tokens']} (windows of {seq})\n\n"
            f"## Perplexity\n\n{ppl_table(ppl)}\n\n"
            f"## Per-module SQNR (each module on the float model's input)\n\n{sqnr_summary(sqnr)}\n")


def figure_png(label: str, ppl: Sequence[dict], sqnr: Sequence[dict]) -> bytes:
    """Left: perplexity of each variant, smoothing off and on, the float model's as a line. Right: SQNR of
    every module against its layer, one series per module type and smoothing."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    ax_p, ax_s = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    base = next(r["perplexity"] for r in ppl if r["variant"] == "float")
    variants = [v for v in dict.fromkeys(r["variant"] for r in ppl) if v != "float"]
    width = 0.38
    for k, smooth in enumerate((False, True)):
        vals = [next((r["perplexity"] for r in ppl if r["variant"] == v and r["smooth"] == smooth), float("nan"))
                for v in variants]
        xs = [i + (k - 0.5) * width for i in range(len(variants))]
        ax_p.bar(xs, vals, width, label=f"smoothing {'on' if smooth else 'off'}")
    ax_p.axhline(base, color="black", lw=1, ls="--", label=f"float {base:.3f}")
    ax_p.set_xticks(range(len(variants)), variants)
    lo = min(r["perplexity"] for r in ppl)
    hi = max(r["perplexity"] for r in ppl)
    pad = max(hi - lo, 1e-3 * base)
    ax_p.set_ylim(lo - pad, hi + pad)
    ax_p.set_ylabel("held-out perplexity")
    ax_p.set_title("Perplexity per variant")
    ax_p.legend(fontsize=8)
    for kind in sorted({r["type"] for r in sqnr}):
        for smooth, marker in ((False, "o"), (True, "x")):
            pts = sorted((r["layer"], r["sqnr_db"]) for r in sqnr if r["type"] == kind and r["smooth"] == smooth)
            if pts:
                ax_s.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=18,
                             label=f"{kind}, smoothing {'on' if smooth else 'off'}")
    ax_s.xaxis.get_major_locator().set_params(integer=True)
    ax_s.set_xlabel("layer")
    ax_s.set_ylabel("SQNR (dB, higher is better)")
    ax_s.set_title("Per-module SQNR by layer and type")
    ax_s.legend(fontsize=7, ncol=2)
    fig.suptitle(f"W8A8 + FA3 on {label}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def html_page(md: str, png: bytes) -> str:
    """One file, no external references: the figure inline, the tables as preformatted markdown."""
    title = md.splitlines()[0].lstrip("# ")
    img = base64.b64encode(png).decode()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif;max-width:1200px'><h1>{html.escape(title)}</h1>"
            f"<img alt='perplexity and SQNR' style='max-width:100%' src='data:image/png;base64,{img}'>"
            f"<pre>{html.escape(md)}</pre></body></html>\n")


def write_report(out_dir: str, src: str, ppl: Sequence[dict], sqnr: Sequence[dict], seq: int) -> str:
    """Write report.md, report.png and report.html into ``out_dir``; returns the markdown."""
    label = model_label(src)
    md = markdown(label, ppl, sqnr, seq)
    png = figure_png(label, ppl, sqnr)
    storage.write_bytes(storage.join(out_dir, MD_NAME), md.encode())
    storage.write_bytes(storage.join(out_dir, PNG_NAME), png)
    storage.write_bytes(storage.join(out_dir, HTML_NAME), html_page(md, png).encode())
    return md
