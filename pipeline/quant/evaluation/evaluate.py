"""Accuracy of quantized outputs against the float model, from the written files alone.

Each output is run by fake-quant (:mod:`pipeline.quant.evaluation.fakequant`: ours, msModelSlim's with norm biases or
QuaRot, quantized MTP layers) next to the float model on the same token windows (teacher forcing: both
read the true tokens), in float32. Variants of an output:

    W8A8 + FA3   as written (integer linears, int8 latent cache)
    W8A8 only    the same, the latent left in float
    FA3 only     the dequantized weights with float activations, the latent through int8

Per output and variant (``EvalResult.summary``):
    perplexity (and its change against float), top-1 agreement with the float model's next-token argmax,
    KL(float || quantized) of the next-token distributions (mean and p99 over tokens), the same three for
    the MTP layer's token-after-next when both have one, and the minima of the per-layer figures below.
Per layer (``layers``), each attention block (input norm + MLA, MTP's included):
    attn_sqnr_db      isolated: the float model's residual input through the quantized block, against the
                      float block's output (this layer's own error, what the min-attention goal reads)
    attn_sqnr_cum_db  in the quantized model's own forward (everything before it quantized too)
    latent_sqnr_db    the int8 latent against the float latent it stands for (FA3 layers only)
Per quantized linear (``linears``): output SQNR on its own input in the quantized forward, against the float
weight in the output's basis (:mod:`pipeline.quant.evaluation.linear_refs`; ``reference`` says when only the
dequantized weight could serve), accumulated by hooks during the same pass.

Residual-stream tensors of a QuaRot output are compared after undoing its global rotation.
SQNR = 10 log10(sum y^2 / sum (y - y_q)^2) over every token; None in the rows means no error (or, for
the latent, no FA3 in that layer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from pipeline.io import storage
from pipeline.model import DeepseekV3ForCausalLM
from pipeline.model.loading import load_model
from pipeline.quant.evaluation.fakequant import QuantLinear, load_fakequant_model
from pipeline.quant.evaluation.linear_refs import linear_ref

VARIANTS = {"W8A8 + FA3": {"w8a8": True, "fa3": True}, "W8A8 only": {"w8a8": True, "fa3": False},
            "FA3 only": {"w8a8": False, "fa3": True}}
FULL = "W8A8 + FA3"
KL_QUANTILE = 0.99
BATCH = 4             # windows per forward


@dataclass
class Candidate:
    """One quantized model under evaluation."""

    label: str
    variant: str
    model: DeepseekV3ForCausalLM

    @property
    def rotation(self) -> Optional[torch.Tensor]:
        return getattr(self.model, "global_rotation", None)


def load_candidates(paths: Sequence[str], labels: Optional[Sequence[str]] = None,
                    variants: Sequence[str] = (FULL,)) -> list[Candidate]:
    """Every (output, variant) as a float32 fake-quant model."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"variants: unknown {bad}; choose from {list(VARIANTS)}")
    labels = list(labels) if labels is not None else list(paths)
    return [Candidate(label, v, load_fakequant_model(p, dtype=torch.float32, **VARIANTS[v]))
            for p, label in zip(paths, labels) for v in variants]


class _Sqnr:
    """sum y^2 and sum (y - y_q)^2 over everything added."""

    def __init__(self) -> None:
        self.sig = self.err = 0.0
        self.rows = 0

    def add(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        r = ref.float()
        self.sig += torch.linalg.vector_norm(r).item() ** 2
        self.err += torch.linalg.vector_norm(r - got.float()).item() ** 2
        self.rows += ref.reshape(-1, ref.shape[-1]).shape[0]

    def db(self) -> float:
        if self.err == 0:
            return math.inf
        return 10 * math.log10(self.sig / self.err) if self.sig > 0 else -math.inf


@dataclass
class _Tally:
    """Next-token figures of one candidate (or the float model) over the windows."""

    nll: float = 0.0
    tokens: int = 0
    agree: int = 0
    kl: list = field(default_factory=list)

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref: Optional[torch.Tensor] = None) -> None:
        lp = logits.float().log_softmax(-1)
        self.nll += F.nll_loss(lp.flatten(0, 1), targets.flatten(), reduction="sum").item()
        self.tokens += targets.numel()
        if ref is not None:
            lr = ref.float().log_softmax(-1)
            self.agree += (lp.argmax(-1) == lr.argmax(-1)).sum().item()
            self.kl.append((lr.exp() * (lr - lp)).sum(-1).flatten().clamp_min(0))

    def figures(self, prefix: str = "") -> dict:
        out = {f"{prefix}perplexity": math.exp(self.nll / self.tokens)} if self.tokens else {}
        if self.kl:
            kl = torch.cat(self.kl).double()
            out.update({f"{prefix}agreement": self.agree / self.tokens, f"{prefix}kl_mean": kl.mean().item(),
                        f"{prefix}kl_p99": torch.quantile(kl, KL_QUANTILE).item()})
        return out


@dataclass
class EvalResult:
    """Rows of the three tables (module doc) and what they were measured on."""

    summary: list[dict]
    layers: list[dict]
    linears: list[dict]
    tokens: int
    seq: int

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seq": self.seq, "summary": self.summary, "layers": self.layers,
                "linears": self.linears}


def windows_of(stream: torch.Tensor, seq: int, max_windows: int = 0) -> torch.Tensor:
    """Non-overlapping windows of seq + 1 tokens [N, seq + 1] (as pipeline.model.perplexity cuts them)."""
    n = (len(stream) - 1) // seq
    if n == 0:
        raise ValueError(f"the evaluation text ({len(stream)} tokens) is shorter than one window ({seq + 1})")
    if max_windows:
        n = min(n, max_windows)
    return torch.stack([stream[i * seq: i * seq + seq + 1] for i in range(n)])


@torch.no_grad()
def compare(float_model: DeepseekV3ForCausalLM, candidates: Sequence[Candidate], windows: torch.Tensor,
            per_linear: bool = True, progress: bool = False, batch: int = BATCH) -> EvalResult:
    """Measure every candidate against ``float_model`` on ``windows`` [N, seq + 1] (module doc)."""
    from pipeline.quant.calibration.progress import bar

    float_model.eval()
    n_batches = math.ceil(len(windows) / batch)
    pbar = bar(progress, "evaluate", n_batches * (1 + len(candidates)), "pass")
    states = [_CandidateState(c, float_model, per_linear) for c in candidates]
    f_main, f_mtp = _Tally(), _Tally()
    try:
        for k in range(0, len(windows), batch):
            w = windows[k:k + batch]
            ids, targets = w[:, :-1], w[:, 1:]
            cap = FloatCapture(float_model)
            with cap:
                logits, hidden = float_model(ids, return_hidden=True)
                mtp_logits = float_model.mtp(hidden[:, :-1], ids[:, 1:])[0] if _mtp(float_model) else None
            f_main.add(logits, targets)
            if mtp_logits is not None:
                f_mtp.add(mtp_logits, w[:, 2:])
            pbar.update(1)
            for st in states:
                st.run(ids, w, logits, mtp_logits, cap)
                pbar.update(1)
    finally:
        pbar.close()
        for st in states:
            st.close()
    base = {**f_main.figures(), **f_mtp.figures("mtp_")}
    summary = [_clean({"output": "float", "variant": "float", "tokens": f_main.tokens, **base,
                       "perplexity_delta_pct": 0.0, "agreement": 1.0, "kl_mean": 0.0, "kl_p99": 0.0})]
    layers, linears = [], []
    for st in states:
        s, lrows, linrows = st.rows(base, f_main.tokens)
        summary.append(s)
        layers += lrows
        linears += linrows
    return EvalResult(summary, layers, linears, f_main.tokens, windows.shape[1] - 1)


def _mtp(model) -> bool:
    return bool(model.mtp_layers)


def unrotate(h: torch.Tensor, rot: Optional[torch.Tensor]) -> torch.Tensor:
    """A residual-stream tensor of a QuaRot model (``h @ rot``) back in the float model's basis."""
    return h if rot is None else (h.float() @ rot.T).to(h.dtype)


def isolated_attention(layer, h_in: torch.Tensor, rope: tuple, rot: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``layer``'s attention block (input norm + MLA) of a quantized model on the float model's residual input
    ``h_in`` and (cos, sin) ``rope`` (what :class:`FloatCapture` holds), its output in the float model's basis
    (``rot``: the quantized model's global rotation, None when it has none)."""
    x = h_in if rot is None else (h_in.float() @ rot).to(h_in.dtype)
    return unrotate(layer.self_attn(layer.input_layernorm(x), *rope), rot)


class FloatCapture:
    """While active: per layer (MTP's included), the residual entering its input norm, the attention's
    (cos, sin) and its output, for the current batch."""

    def __init__(self, model: DeepseekV3ForCausalLM):
        self.model = model
        self.h_in: dict[int, torch.Tensor] = {}
        self.rope: dict[int, tuple] = {}
        self.attn: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self):
        for layer in self.model.model.layers:
            i = layer.layer_id
            self.handles.append(layer.input_layernorm.register_forward_pre_hook(
                lambda m, args, i=i: self.h_in.__setitem__(i, args[0])))
            self.handles.append(layer.self_attn.register_forward_hook(self._attn_hook(i)))
        return self

    def _attn_hook(self, i: int):
        def hook(mod, args, out):
            self.rope[i] = (args[1], args[2])
            self.attn[i] = out
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


class _CandidateState:
    """One candidate's hooks and accumulators."""

    def __init__(self, cand: Candidate, float_model: DeepseekV3ForCausalLM, per_linear: bool):
        self.c = cand
        m = cand.model
        m.eval()
        self.rot = cand.rotation
        self.main, self.mtp = _Tally(), _Tally()
        ids = [layer.layer_id for layer in m.model.layers if layer.layer_id in
               {fl.layer_id for fl in float_model.model.layers}]
        self.layer_ids = ids
        self.iso = {i: _Sqnr() for i in ids}
        self.cum = {i: _Sqnr() for i in ids}
        self.latent = {i: _Sqnr() for i in ids if i in getattr(m, "fa3_layers", ())}
        self.lin: dict[str, _Sqnr] = {}
        self.refs = {}
        self.recording = False
        self.float_attn: dict[int, torch.Tensor] = {}
        self.handles: list = []
        layers = {layer.layer_id: layer for layer in m.model.layers}
        for i in ids:
            self.handles.append(layers[i].self_attn.register_forward_hook(self._cum_hook(i)))
        if per_linear:
            for name, mod in m.named_modules():
                if isinstance(mod, QuantLinear):
                    self.refs[name] = linear_ref(name, float_model, m, self.rot)
                    self.lin[name] = _Sqnr()
                    self.handles.append(mod.register_forward_hook(self._lin_hook(name)))
        self.layers = layers

    def _cum_hook(self, i: int):
        def hook(mod, args, out):
            if self.recording and i in self.float_attn:
                self.cum[i].add(self.float_attn[i], self._unrotate(out))
        return hook

    def _lin_hook(self, name: str):
        def hook(mod, args, out):
            if self.recording:
                self.lin[name].add(self.refs[name](args[0]), out)
        return hook

    def _unrotate(self, h: torch.Tensor) -> torch.Tensor:
        return unrotate(h, self.rot)

    def run(self, ids, w, f_logits, f_mtp, cap: FloatCapture) -> None:
        m = self.c.model
        self.float_attn = cap.attn
        self.recording = True
        try:
            logits, hidden = m(ids, return_hidden=True)
            self.main.add(logits, w[:, 1:], f_logits)
            if f_mtp is not None and _mtp(m):
                self.mtp.add(m.mtp(hidden[:, :-1], ids[:, 1:])[0], w[:, 2:], f_mtp)
        finally:
            self.recording = False
        for i in self.layer_ids:        # each attention block alone, on the float model's input
            if i not in cap.h_in:
                continue
            layer = self.layers[i]
            seen = {}
            hs = []
            if i in self.latent:
                kv = layer.self_attn.kv_a_layernorm
                hs.append(kv.register_forward_hook(lambda mod, a, out: seen.__setitem__("c", out), prepend=True))
                hs.append(kv.register_forward_hook(lambda mod, a, out: seen.__setitem__("q", out)))
            try:
                out = isolated_attention(layer, cap.h_in[i], cap.rope[i], self.rot)
            finally:
                for h in hs:
                    h.remove()
            self.iso[i].add(cap.attn[i], out)
            if i in self.latent:
                self.latent[i].add(seen["c"], seen["q"])

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def rows(self, base: dict, tokens: int) -> tuple[dict, list, list]:
        key = {"output": self.c.label, "variant": self.c.variant}
        fig = {**self.main.figures(), **self.mtp.figures("mtp_")}
        fig["perplexity_delta_pct"] = 100 * (fig["perplexity"] / base["perplexity"] - 1)
        if "mtp_perplexity" in fig and "mtp_perplexity" in base:
            fig["mtp_perplexity_delta_pct"] = 100 * (fig["mtp_perplexity"] / base["mtp_perplexity"] - 1)
        layers = [{**key, "layer": i, "attn_sqnr_db": self.iso[i].db(), "attn_sqnr_cum_db": self.cum[i].db(),
                   "latent_sqnr_db": self.latent[i].db() if i in self.latent else None}
                  for i in self.layer_ids]
        linears = []
        for name, acc in self.lin.items():
            if not acc.rows:
                continue
            ref = self.refs[name]
            linears.append({**key, "layer": int(name.split(".")[2]), "module": name,
                            "type": self.c.model.get_submodule(name).kind, "sqnr_db": acc.db(),
                            "reference": ref.reference, "weight_sqnr_db": ref.weight_sqnr_db, "tokens": acc.rows})
        worst = min(layers, key=lambda r: r["attn_sqnr_db"]) if layers else None
        lat = [r["latent_sqnr_db"] for r in layers if r["latent_sqnr_db"] is not None]
        summary = {**key, "tokens": tokens, **fig,
                   "min_attn_sqnr_db": worst["attn_sqnr_db"] if worst else None,
                   "min_attn_layer": worst["layer"] if worst else None,
                   "min_latent_sqnr_db": min(lat) if lat else None,
                   "min_linear_sqnr_db": min((r["sqnr_db"] for r in linears), default=None),
                   "fa3_layers": list(getattr(self.c.model, "fa3_layers", [])),
                   "quantized_linears": len(linears), "rotated": self.rot is not None}
        return _clean(summary), [_clean(r) for r in layers], [_clean(r) for r in linears]


def _clean(row: dict) -> dict:
    """Floats to 7 significant digits; inf / NaN as None (JSON and Parquet safe)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, float):
            v = float(f"{v:.7g}") if math.isfinite(v) else None
        out[k] = v
    return out


# ----- quantize, then compare --------------------------------------------------------------------------
def evaluate(src: str, work_dir: str, heldout: torch.Tensor, recipe=None, opts=None, seq: int = 256,
             log: Callable[[str], None] = print, smooth: Sequence[bool] = (False, True),
             variants: Sequence[str] = tuple(VARIANTS), per_linear: bool = True, progress: bool = False,
             max_windows: int = 0) -> EvalResult:
    """Quantize ``src`` with ``recipe`` for each smoothing setting into ``work_dir``/plain and /smooth,
    then :func:`compare` every variant of both on the ``heldout`` token stream."""
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint

    recipe = recipe or Recipe()
    opts = opts or QuantizeOptions()
    paths, labels = [], []
    for sm in smooth:
        dst = storage.join(work_dir, "smooth" if sm else "plain")
        quantize_checkpoint(src, dst, dataclasses.replace(recipe, smooth=sm),
                            dataclasses.replace(opts, overwrite=True, progress=progress), log=log)
        paths.append(dst)
        labels.append("smooth" if sm else "plain")
    float_model = load_model(src, dtype=torch.float32, device="cpu")
    return compare(float_model, load_candidates(paths, labels, variants), windows_of(heldout, seq, max_windows),
                   per_linear=per_linear, progress=progress)


# ----- tables -------------------------------------------------------------------------------------------
def _f(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def summary_table(rows: Sequence[dict]) -> str:
    """Output, variant, perplexity and its change, agreement, KL mean / p99, min attention SQNR."""
    lines = ["| output | variant | perplexity | vs float | agreement | KL mean | KL p99 | min attn SQNR dB (layer) |"
             " min latent SQNR dB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        attn = "n/a" if r.get("min_attn_sqnr_db") is None and r["output"] == "float" else \
            f"{_f(r.get('min_attn_sqnr_db'), '.1f')} ({r.get('min_attn_layer')})"
        lines.append(f"| {r['output']} | {r['variant']} | {r['perplexity']:.3f} | {r['perplexity_delta_pct']:+.2f}% | "
                     f"{100 * r['agreement']:.2f}% | {r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {attn} | "
                     f"{_f(r.get('min_latent_sqnr_db'), '.1f')} |")
    return "\n".join(lines)


def linear_summary(rows: Sequence[dict]) -> str:
    """Per output, variant and type: linears, min / median SQNR, how many measured on the float weight."""
    out = ["| output | variant | type | linears | min SQNR dB | median SQNR dB | float reference |",
           "|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["output"], r["variant"], r["type"]) for r in rows))
    for o, v, t in keys:
        sel = [r for r in rows if (r["output"], r["variant"], r["type"]) == (o, v, t)]
        vals = sorted(r["sqnr_db"] if r["sqnr_db"] is not None else math.inf for r in sel)
        n_float = sum(r["reference"] == "float" for r in sel)
        out.append(f"| {o} | {v} | {t} | {len(sel)} | {vals[0]:.1f} | {vals[len(vals) // 2]:.1f} | {n_float}/{len(sel)} |")
    return "\n".join(out)


def layer_table(rows: Sequence[dict]) -> str:
    out = ["| output | variant | layer | attention SQNR dB | in the quantized forward | latent SQNR dB |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['output']} | {r['variant']} | {r['layer']} | {_f(r['attn_sqnr_db'], '.1f')} | "
                   f"{_f(r['attn_sqnr_cum_db'], '.1f')} | {_f(r['latent_sqnr_db'], '.1f')} |")
    return "\n".join(out)


def write_parquet(rows: Sequence[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with storage.atomic_write(path) as f:
        pq.write_table(pa.Table.from_pylist(list(rows)), f)
