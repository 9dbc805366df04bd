"""Benchmark: accuracy of jobs.quantize's recipes on the embedded model and on outlier variants of it.

    python scripts/bench_accuracy_variants.py [--seeds 1,2,3] [--channels 4] [--factor-log2 4..6]
        [--recipes seed,seed+fallback,w8a8c8,w8a8c8+fallback,w8a8c8+ladder@int8,...] [--max-windows 32]
        [--models NAME=PATH,...] [--proxy-samples 0] [--work /tmp/dsquant-accuracy] [--keep] [--reuse]
        [--out benchmarks/accuracy_variants.json]

Each variant (jobs.make_outlier_variant's maker, every norm, --channels channels per norm, factors 2^lo..2^hi,
one per seed) computes the embedded model's logits bit for bit. Each model is quantized with each recipe
(RECIPES: the flags of ``python -m jobs.quantize``; seed = the legacy script's ``--fa_quant --mindie_format``,
w8a8c8 = the DeepSeek-V3.1 preset, msModelSlim's QuaRot + flex_smooth recipe; +fallback = ``--fa-fallback auto
--linear-fallback auto``, the ladder; +ladder@int8 = the ladder with a budget of no byte above int8, its free
rung W8A8 -> W8A8_DYNAMIC only; +fallback-nosmooth = the ladder without its MLP input smoothing;
+ladder = --linear-fallback auto alone; --models adds checkpoints such as the residual-stream outlier variants
scripts/train_embedded.py makes with --plant-channels) and evaluated
from the written files against its float model (pipeline/quant/evaluation/evaluate.py) on the first --max-windows
windows of 256 tokens of the embedded held-out texts: agreement, perplexity change, KL mean / p99 and the
minimum per-layer attention SQNR, the share of linear weights kept above int8 (from the written files), and
what fell back with the pick's figures on the fitting and held-out calibration samples. For the seed recipe
it also checks the sensitivity proxies
(pipeline/quant/evaluation/sensitivity.py) against the end-to-end costs on --proxy-samples calibration samples:
Spearman's rho of the FA3 layer ranking and of the linear rankings, "sqnr" and "residual" (routed experts
grouped per projection).
Writes the JSON and a PNG beside it (agreement and perplexity change per recipe and model):
benchmarks/accuracy_variants.json and accuracy_variants.png; with ``--seeds 4,5 --channels 8 --factor-log2 3..7
--no-embedded --out benchmarks/accuracy_unseen.json``, the unseen variants' accuracy_unseen.json and
accuracy_unseen.png; with ``--seeds "" --no-embedded --models rv-s1=DIR --out benchmarks/accuracy_residual.json``
(DIR made by docs/accuracy.md's residual-stream command), accuracy_residual.json and accuracy_residual.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_io import loadavg, write_result  # noqa: E402

SEED = ["--fa_quant", "--mindie_format"]             # the legacy script's command: m4 (iter_smooth), FA3 everywhere
FALLBACK = ["--fa-fallback", "auto", "--linear-fallback", "auto"]
C8 = ["--model-type", "DeepSeek-V3.1", "--quant-type", "w8a8c8"]
AT_INT8 = ["--fallback-target", "agreement=1,share=0"]   # the ladder's free rung only: no byte above int8
RECIPES = {"seed": SEED, "seed+fallback": SEED + FALLBACK, "w8a8c8": C8, "w8a8c8+fallback": C8 + FALLBACK,
           "w8a8c8+ladder@int8": C8 + ["--linear-fallback", "auto"] + AT_INT8,
           "w8a8c8+ladder": C8 + ["--linear-fallback", "auto"],      # its FA3 is off on a 3-layer model
           "dynamic+fallback": SEED + ["--dynamic"] + FALLBACK,
           "seed+fallback-nosmooth": SEED + FALLBACK + ["--fallback-mlp-smooth", "none"],
           "w8a8c8+fallback@0.99": C8 + FALLBACK + ["--fallback-target", "agreement=0.99,ppl=0.3"],
           "w8a8c8-dynamic": C8 + ["--dynamic"]}
FIELDS = ("agreement", "perplexity", "perplexity_delta_pct", "kl_mean", "kl_p99", "min_attn_sqnr_db",
          "min_attn_layer", "min_latent_sqnr_db", "mtp_agreement")


def make_models(work: Path, seeds, channels: int, log2: tuple[int, int], embedded: bool = True) -> dict[str, str]:
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.evaluation.outlier_variant import NORMS, VariantSpec
    from pipeline.quant.evaluation.variant_writer import write_variant

    models = {"embedded": EMBEDDED_MODEL_DIR} if embedded else {}
    for s in seeds:
        dst = work / f"variant-s{s}"
        write_variant(EMBEDDED_MODEL_DIR, str(dst), VariantSpec(seed=s, channels=dict.fromkeys(NORMS, channels),
                                                                log2_range=log2), overwrite=True, log=print)
        models[f"variant-s{s}"] = str(dst)
    return models


def quantize(src: str, dst: Path, flags: list[str]) -> float:
    """``python -m jobs.quantize`` with ``flags`` (in this process); seconds taken."""
    from jobs import quantize as job

    t = time.time()
    from pipeline.assets import EMBEDDED_MODEL_DIR

    # the embedded model goes in as the job's default: its folder name (dsv3-...) is not read as a model name,
    # as the legacy script would read "V3" in a path and keep FA3 off V3's list
    where = [] if src == EMBEDDED_MODEL_DIR else ["--model-path", src]
    if job.main([*where, "--save-path", str(dst), "--overwrite", "--no-progress", "--no-estimate", *flags]) != 0:
        raise SystemExit(f"quantize {src} {flags} failed")
    return time.time() - t


def fallback_picks(out: Path) -> dict:
    """What the output keeps above int8 and, with a fallback, what fell back (fallback.json):
    ``share_above_int8``, the share of the linear weights (main layers, kv_b_proj and router left out) the
    written output keeps FLOAT (pipeline.quant.evaluation.fallback.share); the FA3 layers kept bf16, the
    pieces made W8A8_DYNAMIC and those kept FLOAT, the bytes above int8, and the pick's figures on the
    fitting and held-out calibration samples."""
    from pipeline.quant.evaluation.fallback.share import output_share

    row = {"share_above_int8": round(output_share(str(out))["share"], 4)}
    f = out / "fallback.json"
    if not f.exists():
        return row
    r = json.loads(f.read_text())
    lin = r.get("linear") or {}
    row.update({"fa_fallback_layers": (r.get("fa") or {}).get("picked"), "linear_fallback": lin.get("picked"),
                "linear_dynamic": lin.get("dynamic"),
                "mlp_smooth_layers": (r.get("mlp_smooth") or {}).get("kept"),
                "bytes_above_int8": (lin.get("bytes") or {}).get("above_int8"),
                "calib_agreement": (r.get("with_fallback") or {}).get("agreement"),
                "heldout_calib_agreement": (r.get("with_fallback_heldout") or {}).get("agreement"),
                "calib_ppl_delta_pct": (r.get("with_fallback") or {}).get("ppl_delta_pct"),
                "heldout_calib_ppl_delta_pct": (r.get("with_fallback_heldout") or {}).get("ppl_delta_pct")})
    return row


def proxies(src: str, qdir: Path, n_samples: int) -> dict:
    import torch

    from pipeline.model.loading import load_model
    from pipeline.quant.job.options import QuantizeOptions, calibration_samples
    from pipeline.quant.evaluation.sensitivity import (FakeQuantParams, FloatReference, expert_groups, fa3_costs, linear_costs,
                                            rank_correlation)

    model = load_model(src, dtype=torch.float32, device="cpu")
    ref = FloatReference(model, calibration_samples(src, QuantizeOptions(), 2048)[:n_samples])
    params = FakeQuantParams.from_dir(str(qdir))
    groups = expert_groups(list(params.linears))
    fa_kl, fa_sq = fa3_costs(ref, params, "kl"), fa3_costs(ref, params, "sqnr")
    lin_kl, lin_sq = linear_costs(ref, params, "kl", groups), linear_costs(ref, params, "sqnr", groups)
    lin_res = linear_costs(ref, params, "residual", groups)
    full = ref.measure(params)
    return {"samples": n_samples, "tokens": ref.tokens, "full_default": full.to_dict(),
            "fa_rho": round(rank_correlation(fa_kl, fa_sq), 3),
            "linear_rho_sqnr": round(rank_correlation(lin_kl, lin_sq), 3),
            "linear_rho_residual": round(rank_correlation(lin_kl, lin_res), 3),
            "fa_by_kl": [{"layer": c.key, "kl_mean": round(c.score, 6), "agreement": round(c.figures["agreement"], 4)}
                         for c in fa_kl],
            "fa_by_proxy": [{"layer": c.key, "residual_sqnr_db": round(c.figures["residual_sqnr_db"], 2),
                             "attn_sqnr_db": round(c.figures["attn_sqnr_db"], 2),
                             "latent_sqnr_db": round(c.figures["latent_sqnr_db"], 2)} for c in fa_sq],
            "linears_top5_by_kl": [{"linear": c.key, "kl_mean": round(c.score, 6)} for c in lin_kl[:5]],
            "linears_top5_by_residual": [{"linear": c.key, "residual_sqnr_db": round(c.figures["residual_sqnr_db"], 2)}
                                         for c in lin_res[:5]]}


def summarize(rows: list[dict], recipes) -> dict:
    out = {}
    for r in recipes:
        sel = [x for x in rows if x["recipe"] == r and x["model"] != "embedded"]
        if sel:
            out[r] = {k: round(statistics.mean(x[k] for x in sel), 4) for k in
                      ("agreement", "perplexity_delta_pct", "kl_mean", "kl_p99", "min_attn_sqnr_db")}
            out[r]["share_above_int8"] = round(statistics.mean(x.get("share_above_int8") or 0.0 for x in sel), 4)
            out[r]["agreement_range"] = [min(x["agreement"] for x in sel), max(x["agreement"] for x in sel)]
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r["model"] for r in rows))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    fig = Figure(figsize=(11, 4.2), dpi=100)
    ax_a, ax_p = fig.subplots(1, 2)
    width = 0.8 / len(models)
    for k, m in enumerate(models):
        xs = [i + (k - (len(models) - 1) / 2) * width for i in range(len(recipes))]
        get = {r["recipe"]: r for r in rows if r["model"] == m}     # a recipe not run on m: no bar
        ax_a.bar(xs, [100 * get[r]["agreement"] if r in get else math.nan for r in recipes], width, label=m)
        ax_p.bar(xs, [get[r]["perplexity_delta_pct"] if r in get else math.nan for r in recipes], width, label=m)
    for ax in (ax_a, ax_p):
        ax.set_xticks(range(len(recipes)), recipes, rotation=20, ha="right", fontsize=8)
    ax_a.set_ylim(min(100 * r["agreement"] for r in rows) - 5, 100.5)
    ax_a.axhline(95, color="black", lw=0.8, ls=":")
    ax_a.axhline(98, color="black", lw=0.8, ls="--")
    ax_a.set_ylabel("top-1 agreement with float (%)")
    ax_a.set_title("Agreement")
    ax_a.legend(fontsize=7)
    ax_p.axhline(0, color="black", lw=0.8)
    ax_p.set_ylabel("perplexity change vs float (%)")
    ax_p.set_title("Perplexity")
    fig.suptitle("jobs.quantize recipes on the embedded model and its outlier variants")
    fig.tight_layout()
    fig.savefig(str(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--factor-log2", default="4..6")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--max-windows", type=int, default=32)
    ap.add_argument("--proxy-samples", type=int, default=0)
    ap.add_argument("--work", default="/tmp/dsquant-accuracy")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true",
                    help="evaluate the outputs an earlier --keep run left in --work instead of quantizing again")
    ap.add_argument("--no-embedded", action="store_true", help="the variants only")
    ap.add_argument("--models", default="",
                    help="more checkpoints, NAME=PATH,...: e.g. residual-stream outlier variants made by "
                         "scripts/train_embedded.py --init ... --plant-channels K (scripts/residual_outliers.py)")
    ap.add_argument("--merge", action="store_true",
                    help="keep --out's other rows: this run's (model, recipe) rows replace theirs, the rest stay")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "accuracy_variants.json"))
    args = ap.parse_args(argv)

    import torch

    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.model.loading import load_model
    from pipeline.model.perplexity import token_stream
    from pipeline.quant.evaluation.evaluate import compare, load_candidates, windows_of
    from pipeline.quant.evaluation.outlier_variant import parse_log2_range
    from pipeline.text import corpus
    from pipeline.text.tokenizer import Tokenizer

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    recipes = [r for r in args.recipes.split(",") if r]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    load0 = loadavg()
    models = make_models(work, seeds, args.channels, parse_log2_range(args.factor_log2), not args.no_embedded)
    models.update(dict(item.split("=", 1) for item in args.models.split(",") if item))
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    windows = windows_of(token_stream(tok, [d.text for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]]), 256,
                         args.max_windows)
    rows, proxy = [], {}
    for name, src in models.items():
        dirs = {}
        for r in recipes:
            dirs[r] = work / f"{name}-{r}"
            if args.reuse and (dirs[r] / "quant_model_description.json").exists():
                print(f"{name}: {r} already written in {dirs[r]}", flush=True)
                continue
            print(f"{name}: quantize {r} ({quantize(src, dirs[r], RECIPES[r]):.0f}s)", flush=True)
        with torch.inference_mode():
            res = compare(load_model(src, dtype=torch.float32, device="cpu"),
                          load_candidates([str(dirs[r]) for r in recipes], recipes), windows, per_linear=False)
        for s in res.summary[1:]:
            rows.append({"model": name, "recipe": s["output"], **{k: s.get(k) for k in FIELDS}})
            print(rows[-1], flush=True)
        for row in rows[-len(recipes):]:
            row.update(fallback_picks(dirs[row["recipe"]]))
        if "seed" in recipes and args.proxy_samples:
            proxy[name] = proxies(src, dirs["seed"], args.proxy_samples)
            print(name, "proxy rho: fa", proxy[name]["fa_rho"], "linear (sqnr, residual)",
                  proxy[name]["linear_rho_sqnr"], proxy[name]["linear_rho_residual"], flush=True)
    if args.merge and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        mine = {(r["model"], r["recipe"]) for r in rows}
        rows = [r for r in old["rows"] if (r["model"], r["recipe"]) not in mine] + rows
        recipes = list(dict.fromkeys([r["recipe"] for r in rows]))
        seeds = sorted(set(old["setup"]["seeds"]) | set(seeds))
        proxy = {**old.get("proxies", {}), **proxy}
    result = {
        "what": "jobs.quantize recipes on the embedded model and outlier variants of it (same float function), "
                "evaluated by fake-quant from the written files" + (
                    "; --models checkpoints (residual-stream variants: their own float function) against their own "
                    "float logits" if args.models else ""),
        "models": dict(item.split("=", 1) for item in args.models.split(",") if item),
        "setup": {"seeds": seeds, "channels_per_norm": args.channels, "factor_log2": args.factor_log2,
                  "norms": "all (input, post_attention, q_a, kv_a, MTP enorm/hnorm/head)",
                  "eval_tokens": int(windows.shape[0] * (windows.shape[1] - 1)), "window": 256,
                  "text": "embedded held-out texts", "torch_threads": torch.get_num_threads()},
        "rows": rows,
        "mean_over_variants": summarize(rows, recipes),
        "proxies": proxy,
        "seconds": round(time.time() - t0, 1), "loadavg_start": load0, "loadavg_end": loadavg(),
    }
    write_result(args.out, result, hide=("proxies",))
    plot(rows, Path(args.out).with_suffix(".png"))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
