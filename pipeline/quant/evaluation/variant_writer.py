"""Write an outlier variant (:mod:`pipeline.quant.evaluation.outlier_variant`) of a checkpoint and prove it computes
what the source computes.

The source is read one layer at a time (FP8 weights dequantized to the config's dtype, every other tensor
in its stored dtype); the variant is written in the same layout as a plain float checkpoint
(``model-0000k-of-0000N.safetensors`` + index, no ``quantization_config``), with every other top-level
file of the source copied. Everything goes into a hidden sibling of the destination first; the logits
check runs on it there, and only a variant that passes is moved into place (``overwrite``: an existing
destination is replaced, and kept whole until then). Any error leaves the destination as it was.

The check runs the source and the variant on a few texts (the source's tokenizer; seeded random ids
without one), in float32 and in the model dtype, main logits and MTP logits, and demands bit-identical
results. An FP8 source's function is its dequantization to the model dtype (what the variant stores), so
the source is read in the model dtype and widened for the float32 run. It also measures how much each
changed norm's output channels now stand out: the smallest ratio, over the picked channels, of the
channel's max |activation| to the median channel's.
``outlier_variant.json`` in the variant records the spec, every change and these figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import posixpath
import uuid
from typing import Callable, Optional, Sequence

import torch

from pipeline import layout
from pipeline.config import model_dtype
from pipeline.io import storage
from pipeline.io.destination.lock import DestinationLock
from pipeline.io.destination.rule import check_destination as check_variant_destination
from pipeline.io.checkpoint import CONFIG_NAME, INDEX_NAME, CheckpointReader
from pipeline.io.release_layout.fp8_copy import SHARD_BYTES, assign_shards, copy_other_files, shard_name
from pipeline.io.safetensors_io import DTYPE_NAMES, SafetensorsWriter, TensorSpec
from pipeline.quant.evaluation.outlier_variant import NORMS, Change, VariantError, VariantSpec, apply_to_layer, summarize

RECORD_NAME = "outlier_variant.json"
CHECK_TEXTS = (
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "The quick brown fox jumps over the lazy dog, twice, and then rests by the river bank.",
    "import torch\nx = torch.randn(4, 8)\nprint(x.abs().max(dim=-1))\n",
    "Quantization maps each value to the nearest point of a grid; outliers stretch the grid.",
)
CHECK_RANDOM_TOKENS = 64   # tokens per sample when the source has no tokenizer


def check_destination(src: str, dst: str, overwrite: bool) -> None:
    """The destination rule (:mod:`pipeline.io.destination.rule`): only an earlier variant (it holds
    ``outlier_variant.json``) is replaced, and only with ``overwrite``."""
    check_variant_destination(dst, kind="an outlier variant", is_own=lambda entries: RECORD_NAME in entries,
                              overwrite=overwrite, sources=(src,))


def write_variant(src: str, dst: str, spec: VariantSpec, *, overwrite: bool = False, check: bool = True,
                  shard_bytes: int = SHARD_BYTES, log: Callable[[str], None] = print) -> dict:
    """Write the variant of ``src`` into ``dst``, holding its lock (:mod:`pipeline.io.destination.lock`); returns the
    record written as ``outlier_variant.json``."""
    check_destination(src, dst, overwrite)
    with DestinationLock(dst) as lock:
        check_destination(src, dst, overwrite)     # as it is now that no other job writes it
        return _write_variant(src, dst, spec, check, shard_bytes, log, lock)


def _write_variant(src: str, dst: str, spec: VariantSpec, check: bool, shard_bytes: int,
                   log: Callable[[str], None], lock: DestinationLock) -> dict:
    reader = CheckpointReader(src)
    cfg = reader.config
    spec.check_config(cfg)
    units: list[Optional[int]] = [None, *layout.all_layer_ids(cfg)]
    unit_specs = {lid: [TensorSpec(n, DTYPE_NAMES[dt], tuple(shape)) for n, (dt, shape)
                        in sorted(reader.read_specs(lid).items())] for lid in units}
    specs = [s for lid in units for s in unit_specs[lid]]
    n = max(1, math.ceil(sum(s.nbytes for s in specs) / shard_bytes))
    shard_of = assign_shards([s.nbytes for s in specs], n)
    files = [shard_name(k + 1, n) for k in range(n)]
    per_shard: list[list[TensorSpec]] = [[] for _ in range(n)]
    for s, k in zip(specs, shard_of):
        per_shard[k].append(s)
    tmp = storage.sibling(dst, f".{posixpath.basename(dst.rstrip('/'))}.partial-{uuid.uuid4().hex[:12]}")
    try:
        changes = _write_weights(reader, tmp, spec, units, unit_specs, shard_of, files, per_shard)
        raw = json.loads(storage.read_bytes(storage.join(src, CONFIG_NAME)))
        raw.pop("quantization_config", None)       # FP8 sources are written dequantized
        storage.write_bytes(storage.join(tmp, CONFIG_NAME), (json.dumps(raw, indent=2) + "\n").encode())
        copy_other_files(src, tmp)
        storage.remove(storage.join(tmp, RECORD_NAME))   # a variant of a variant records only its own changes
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: files[k] for s, k in sorted(zip(specs, shard_of), key=lambda x: x[0].name)}}
        storage.write_bytes(storage.join(tmp, INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode())
        record = {"source": src, "spec": spec.to_dict(), "summary": summarize(changes),
                  "changes": [c.to_dict() for c in changes]}
        if check:
            log(f"checking the variant's logits against {src}")
            record["check"] = check_logits(src, tmp, changes)
            _attach_ratios(record)
        storage.write_bytes(storage.join(tmp, RECORD_NAME), (json.dumps(record, indent=1) + "\n").encode())
        lock.ensure()
        if storage.exists(dst):
            storage.replace_dir(tmp, dst)
        else:
            storage.move_dir(tmp, dst)
    except BaseException:
        storage.remove(tmp)
        raise
    return record


def _write_weights(reader: CheckpointReader, tmp: str, spec: VariantSpec, units, unit_specs, shard_of, files,
                   per_shard) -> list[Change]:
    cfg = reader.config
    changes: list[Change] = []
    with contextlib.ExitStack() as stack:   # one open shard at a time; an error aborts it (no file)
        writer, current, i = None, -1, 0
        for lid in units:
            tensors = dict(reader.read_globals() if lid is None else reader.read_layer(lid))
            if lid is not None:
                changes += apply_to_layer(cfg, lid, tensors, spec)
            for s in unit_specs[lid]:
                if shard_of[i] != current:
                    stack.close()
                    current = shard_of[i]
                    writer = stack.enter_context(SafetensorsWriter(storage.join(tmp, files[current]),
                                                                   per_shard[current], metadata={"format": "pt"}))
                writer.write(s.name, tensors.pop(s.name))
                i += 1
    return changes


# ----- the check ------------------------------------------------------------------------------------
def check_ids(src: str, vocab: int) -> list[torch.Tensor]:
    """[1, S] token ids of the check: CHECK_TEXTS through the source's tokenizer, else random ids."""
    from pipeline.text.tokenizer import Tokenizer

    if storage.exists(storage.join(src, "tokenizer.json")):
        tok = Tokenizer.from_dir(src)
        return [torch.tensor([tok.encode(t)]) for t in CHECK_TEXTS]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, CHECK_RANDOM_TOKENS), generator=g) for _ in CHECK_TEXTS]


@torch.no_grad()
def check_logits(src: str, variant: str, changes: Sequence[Change] = ()) -> dict:
    """Run both checkpoints on the check ids in float32 and the model dtype; raises VariantError unless
    every main and MTP logit is bit-identical. Returns what was compared, and per change the outlier
    ratio of its norm's output in the variant (float32) and in the source."""
    from pipeline.model.loading import load_model

    cfg = CheckpointReader(src).config
    ids = check_ids(src, cfg.vocab_size)
    md = model_dtype(cfg)
    dtypes = list(dict.fromkeys([torch.float32, md]))
    ratios: dict[tuple[int, str], dict] = {}
    for dt in dtypes:
        a = load_model(src, dtype=md, device="cpu")       # an FP8 source's function: its md dequantization
        if dt != md:
            a = a.to(dt)
        b = load_model(variant, dtype=dt, device="cpu")
        seen = {}
        handles = []
        if dt == torch.float32:
            for name, model in (("source", a), ("variant", b)):
                handles += _absmax_hooks(model, changes, seen, name)
        try:
            for x in ids:
                for what, (la, lb) in _outputs(a, b, x).items():
                    if not torch.equal(la, lb):
                        diff = (la.float() - lb.float()).abs().max().item()
                        raise VariantError(f"{variant}: the variant's {what} differ from the source's in {dt} "
                                           f"(max |diff| {diff:.3g}); it is not function-preserving")
        finally:
            for h in handles:
                h.remove()
        if dt == torch.float32:
            for c in changes:
                key = (c.layer, c.norm)
                ratios[key] = {who: _ratio(seen[(who, key)], c.channels) for who in ("variant", "source")
                               if (who, key) in seen}
        del a, b
    return {"identical": True, "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "samples": len(ids), "tokens": sum(x.shape[1] for x in ids),
            "outlier_ratio": {f"{lid}/{NORMS[k]}": r for (lid, k), r in ratios.items()}}


def _outputs(a, b, x: torch.Tensor) -> dict:
    la, ha = a(x, return_hidden=True)
    lb, hb = b(x, return_hidden=True)
    out = {"logits": (la, lb)}
    if a.mtp_layers and x.shape[1] > 1:
        out["MTP logits"] = (a.mtp(ha[:, :-1], x[:, 1:])[0], b.mtp(hb[:, :-1], x[:, 1:])[0])
    return out


def _absmax_hooks(model, changes: Sequence[Change], seen: dict, who: str) -> list:
    handles = []
    for c in changes:
        mod = model.get_submodule(f"model.layers.{c.layer}.{NORMS[c.norm]}")
        key = (who, (c.layer, c.norm))

        def hook(m, args, out, key=key):
            am = out.detach().abs().flatten(0, -2).amax(0).float()
            seen[key] = am if key not in seen else torch.maximum(seen[key], am)
        handles.append(mod.register_forward_hook(hook))
    return handles


def _ratio(absmax: torch.Tensor, channels: Sequence[int]) -> float:
    """min over ``channels`` of absmax[c] / median(absmax)."""
    med = absmax.median().item()
    return round(min(absmax[c].item() for c in channels) / med, 3) if med > 0 else math.inf


def _attach_ratios(record: dict) -> None:
    ratios = record["check"].pop("outlier_ratio")
    for c in record["changes"]:
        r = ratios.get(f"{c['layer']}/{c['norm']}", {})
        c["outlier_ratio"] = r.get("variant")
        c["source_ratio"] = r.get("source")
