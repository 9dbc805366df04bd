"""The accuracy report of ``jobs.evaluate``: markdown tables, a PNG with the four views people look at
(agreement and perplexity per output; KL per output; attention and latent SQNR per layer; per-linear SQNR)
and one self-contained HTML page with both.

Inputs are an :class:`pipeline.quant.evaluation.evaluate.EvalResult`. Models and outputs are named by what a reader
can use elsewhere (:func:`model_label`): a URL as given, a path inside the current directory relative to
it, any other local path by its folder name, never by this machine's absolute path.
"""

from __future__ import annotations

import base64
import html
import io
import os

from pipeline.io import storage
from pipeline.quant.evaluation.evaluate import EvalResult, layer_table, linear_summary, summary_table

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


def markdown(label: str, data_label: str, res: EvalResult) -> str:
    return (f"# Accuracy against the float model {label}\n\n"
            f"Text: {data_label}, {res.tokens} tokens (windows of {res.seq}, teacher-forced)\n\n"
            f"## Next-token agreement, perplexity and KL(float || quantized)\n\n{summary_table(res.summary)}\n\n"
            f"## Per layer: attention block alone on the float input, in the quantized forward, and the int8 "
            f"latent against its float value\n\n{layer_table(res.layers)}\n\n"
            f"## Per quantized linear: output SQNR on its own input\n\n{linear_summary(res.linears)}\n")


def _key(r: dict) -> str:
    return r["output"] if r["variant"] in ("W8A8 + FA3", "float") else f"{r['output']} ({r['variant']})"


def figure_png(label: str, res: EvalResult) -> bytes:
    """Top left: agreement per output, the perplexity change written on each bar. Top right: KL mean and
    p99. Bottom left: attention SQNR per layer (solid) and latent SQNR (dashed). Bottom right: every
    quantized linear's SQNR against its layer."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), dpi=100)
    (ax_a, ax_k), (ax_l, ax_s) = fig.subplots(2, 2)
    rows = [r for r in res.summary if r["output"] != "float"]
    names = [_key(r) for r in rows]
    xs = range(len(rows))
    bars = ax_a.bar(xs, [100 * r["agreement"] for r in rows], color="tab:blue")
    for b, r in zip(bars, rows):
        ax_a.annotate(f"{r['perplexity_delta_pct']:+.2f}% ppl", (b.get_x() + b.get_width() / 2, b.get_height()),
                      ha="center", va="bottom", fontsize=7)
    lo = min([100 * r["agreement"] for r in rows], default=90)
    ax_a.set_ylim(max(0, lo - 5), 100.5)
    ax_a.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=7)
    ax_a.set_ylabel("top-1 agreement with float (%)")
    ax_a.set_title("Agreement (perplexity change on the bars)")
    width = 0.4
    ax_k.bar([x - width / 2 for x in xs], [max(r["kl_mean"], 1e-9) for r in rows], width, label="mean")
    ax_k.bar([x + width / 2 for x in xs], [max(r["kl_p99"], 1e-9) for r in rows], width, label="p99")
    ax_k.set_yscale("log")
    ax_k.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=7)
    ax_k.set_ylabel("KL(float || quantized), nats")
    ax_k.set_title("Next-token KL divergence")
    ax_k.legend(fontsize=7)
    for name in dict.fromkeys(_key(r) for r in res.layers):
        sel = sorted((r for r in res.layers if _key(r) == name), key=lambda r: r["layer"])
        line, = ax_l.plot([r["layer"] for r in sel], [_finite(r["attn_sqnr_db"]) for r in sel], marker="o",
                          label=f"{name} attention")
        lat = [r for r in sel if r["latent_sqnr_db"] is not None]
        if lat:
            ax_l.plot([r["layer"] for r in lat], [r["latent_sqnr_db"] for r in lat], ls="--", marker="x",
                      color=line.get_color(), label=f"{name} latent")
    ax_l.axhline(30, color="black", lw=0.8, ls=":")
    ax_l.xaxis.get_major_locator().set_params(integer=True)
    ax_l.set_xlabel("layer")
    ax_l.set_ylabel("SQNR (dB, higher is better)")
    ax_l.set_title("Attention block alone (solid), int8 latent (dashed); 30 dB dotted")
    ax_l.legend(fontsize=6, ncol=2)
    names_l = list(dict.fromkeys(_key(r) for r in res.linears))
    for k, name in enumerate(names_l):
        sel = [r for r in res.linears if _key(r) == name]
        off = (k - (len(names_l) - 1) / 2) * 0.8 / max(len(names_l), 1)
        ax_s.scatter([r["layer"] + off for r in sel], [_finite(r["sqnr_db"]) for r in sel], s=8, label=name)
    ax_s.xaxis.get_major_locator().set_params(integer=True)
    ax_s.set_xlabel("layer")
    ax_s.set_ylabel("SQNR (dB)")
    ax_s.set_title("Per quantized linear, on its own input")
    if names_l:
        ax_s.legend(fontsize=6)
    fig.suptitle(f"Quantized outputs against float {label}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _finite(v):
    return float("nan") if v is None else v


def html_page(md: str, png: bytes) -> str:
    """One file, no external references: the figure inline, the tables as preformatted markdown."""
    title = md.splitlines()[0].lstrip("# ")
    img = base64.b64encode(png).decode()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif;max-width:1200px'><h1>{html.escape(title)}</h1>"
            f"<img alt='agreement, KL and SQNR' style='max-width:100%' src='data:image/png;base64,{img}'>"
            f"<pre>{html.escape(md)}</pre></body></html>\n")


def write_report(out_dir: str, src: str, res: EvalResult, data_label: str) -> str:
    """Write report.md, report.png and report.html into ``out_dir``; returns the markdown."""
    label = model_label(src)
    md = markdown(label, data_label, res)
    png = figure_png(label, res)
    storage.write_bytes(storage.join(out_dir, MD_NAME), md.encode())
    storage.write_bytes(storage.join(out_dir, PNG_NAME), png)
    storage.write_bytes(storage.join(out_dir, HTML_NAME), html_page(md, png).encode())
    return md
