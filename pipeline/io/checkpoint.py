"""Read a DeepSeek-V3/R1 checkpoint directory (bf16 or the FP8 release) one layer at a time, from a
local path or any fsspec URL, checking every tensor against the config.

Tensors are found through ``model.safetensors.index.json`` (``weight_map``: name -> file), else a single
``model.safetensors``, else every ``*.safetensors`` in the directory. Pickle-based weights (``.bin``,
``.pt``, ...) are refused, never unpickled. Only headers are read up front (lazily, once per file); reading
a layer reads that layer's bytes and nothing else.

FP8 tensors (F8_E4M3 with a ``<name>_scale_inv`` sibling) are dequantized as in :mod:`pipeline.io.fp8`,
``W[i, j] = float(Wq[i, j]) * s[i // b0, j // b1]`` with (b0, b1) = the config's ``weight_block_size``
(default 128 x 128).

dtype rules for the ``read_*`` methods: ``dtype=None`` keeps a stored float tensor's dtype and gives
dequantized FP8 tensors the config's ``torch_dtype`` (bf16 for the release); pass ``torch.float32`` for
the exact products. ``mlp.gate.e_score_correction_bias`` is never narrowed below float32: the router adds it
to sigmoid scores in fp32 (spec Pitfall 5), and rounding it to bf16 would move near-tied expert choices.
"""

from __future__ import annotations

import posixpath
import re
from typing import Container, Iterable, Mapping, Optional

import torch

from pipeline import layout
from pipeline.io import storage
from pipeline.config import ConfigError, DeepseekV3Config
from pipeline.io.finite import all_finite, nonfinite_counts
from pipeline.io.json_input import parse_json
from pipeline.io.fp8 import (
    DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, BlockRows, dequantize_fp8_blocks, fp8_nan_count, scale_shape,
)
from pipeline.io.safetensors_io import (
    DTYPE_NAMES, DTYPES, MAX_RUN_BYTES, CheckpointError, SafetensorsHeader, read_header, read_tensors,
)

__all__ = ["CheckpointError", "CheckpointReader", "SCALE_SUFFIX", "INDEX_NAME", "CONFIG_NAME"]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
FP8_NAME = "F8_E4M3"
ROUTER_BIAS_SUFFIX = "mlp.gate.e_score_correction_bias"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")



def read_model_config(path: str) -> DeepseekV3Config:
    """The model's config.json at ``path`` (a local path or an fsspec URL); ConfigError naming the file for
    anything unreadable or invalid."""
    raw = parse_json(storage.read_bytes(path), path, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return DeepseekV3Config.from_dict(raw, source=path)


def _refuse_pickles(where: str, names: Iterable[str]) -> None:
    found = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES) or n.endswith(".bin.index.json"))
    if found:
        raise CheckpointError(
            f"{where}: pickle-based weights {found[:5]} are refused: unpickling can run arbitrary code. "
            "Only safetensors checkpoints are read; convert the weights to safetensors first.")


class CheckpointReader:
    """A checkpoint directory: ``config`` (DeepseekV3Config), ``files`` (sorted full paths) and typed,
    validated tensor reads. Errors are :class:`CheckpointError` naming the file and the tensor.
    ``with_mtp=False``: the checkpoint without its MTP layer(s) (a job run with msModelSlim's ``--quant_mtp
    none``): ``config`` says no MTP layer (:func:`pipeline.layout.without_mtp`) and the MTP layers' tensors
    are neither listed, checked nor read, as if they were not stored."""

    def __init__(self, path: str, *, with_mtp: bool = True):
        self.path = path.rstrip("/") or path
        _refuse_pickles(self.path, [self.path])
        if not storage.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        entries = storage.listdir(self.path)
        if CONFIG_NAME not in entries:
            raise CheckpointError(f"{self.path}: no {CONFIG_NAME} in the checkpoint directory")
        self.config: DeepseekV3Config = read_model_config(storage.join(self.path, CONFIG_NAME))
        self.block: tuple[int, int] = tuple(self.config.fp8_block_size or DEFAULT_BLOCK)  # type: ignore[assignment]
        self._headers: dict[str, SafetensorsHeader] = {}
        self._file_of = self._discover(entries)
        check_counts(self.config, self._file_of, storage.join(self.path, CONFIG_NAME))
        if not with_mtp:
            dropped = set(self.config.mtp_layer_ids)
            self.config = layout.without_mtp(self.config)
            self._file_of = {n: f for n, f in self._file_of.items() if layout.layer_of(n) not in dropped}
        self.files: list[str] = sorted(set(self._file_of.values()))
        self._by_layer: dict[Optional[int], list[str]] = {}
        for name in sorted(self._file_of):
            self._by_layer.setdefault(layout.layer_of(name), []).append(name)

    # ----- discovery --------------------------------------------------------------------------------
    def _discover(self, entries: list[str]) -> dict[str, str]:
        """name -> full path of the file holding it."""
        if INDEX_NAME in entries:
            return self._from_index(storage.join(self.path, INDEX_NAME))
        files = [SINGLE_NAME] if SINGLE_NAME in entries else [e for e in entries if e.endswith(".safetensors")]
        if not files:
            _refuse_pickles(self.path, entries)
            raise CheckpointError(
                f"{self.path}: no safetensors weights (looked for {INDEX_NAME}, {SINGLE_NAME}, *.safetensors)")
        file_of: dict[str, str] = {}
        for f in files:
            full = storage.join(self.path, f)
            for name in self._header(full).tensors:
                if name in file_of:
                    raise CheckpointError(f"{full}: tensor {name!r} is also in {file_of[name]}")
                file_of[name] = full
        return file_of

    def _from_index(self, index_path: str) -> dict[str, str]:
        raw = parse_json(storage.read_bytes(index_path), index_path, CheckpointError)
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        _refuse_pickles(index_path, wm.values())
        for name, fname in wm.items():
            if posixpath.isabs(fname) or ".." in fname.split("/") or not fname.endswith(".safetensors"):
                raise CheckpointError(f"{index_path}: tensor {name!r} maps to {fname!r}, not a .safetensors "
                                      "file inside the checkpoint directory")
        file_of = {name: storage.join(self.path, fname) for name, fname in wm.items()}
        first_name = {f: n for n, f in sorted(file_of.items(), reverse=True)}
        for f in sorted(first_name):
            if not storage.exists(f):
                raise CheckpointError(
                    f"{index_path}: tensor {first_name[f]!r} maps to {f}, which does not exist")
        return file_of

    def _header(self, file: str) -> SafetensorsHeader:
        if file not in self._headers:
            self._headers[file] = read_header(file)
        return self._headers[file]

    # ----- names and headers ------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Every stored tensor name, ``_scale_inv`` siblings included, sorted."""
        return sorted(self._file_of)

    def file_of(self, name: str) -> str:
        """The full path of the file that holds ``name``."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        return self._file_of[name]

    def files_of(self, layer_id: Optional[int]) -> list[str]:
        """The files holding a layer's stored tensors (None: the tensors outside any layer)."""
        return sorted({self._file_of[n] for n in self._by_layer.get(layer_id, [])})

    def read_ahead(self, layer_id: Optional[int]) -> bool:
        """Have the page cache read a unit's stored bytes in the background (:func:`storage.will_need`, one
        span per file), so that its ``read_layer`` finds them there while this process holds nothing more.
        False where the source cannot take the hint (object storage)."""
        spans: dict[str, tuple[int, int]] = {}
        for n in self._by_layer.get(layer_id, []):
            file = self._file_of[n]
            info = self._header(file).info(n)
            lo, hi = spans.get(file, (info.start, info.end))
            spans[file] = (min(lo, info.start), max(hi, info.end))
        return all([storage.will_need(f, *span) for f, span in spans.items()])

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, e.g. "BF16" or "F8_E4M3"; shape) as stored, from the header only."""
        info = self._header(self.file_of(name)).info(name)
        return info.dtype, info.shape

    # ----- reads -------------------------------------------------------------------------------------
    def read_tensor(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One tensor, dequantized if stored FP8 and cast to ``dtype`` (see the module's dtype rules).
        Its shape is checked against the config when the config's layout names it."""
        _check_dtype(dtype)
        lid = layout.layer_of(name)
        known = layout.global_shapes(self.config) if lid is None else self._layer_shapes(lid)
        names = self._plan({name: known[name]} if name in known else {name: None})
        return self._materialize(name, self._read_stored(names), dtype)

    def read_layer(self, layer_id: int, dtype: Optional[torch.dtype] = None, dequantize: bool = True,
                   deferred: Container[str] = ()) -> dict[str, torch.Tensor | BlockRows]:
        """Every tensor of ``model.layers.{layer_id}.`` (the MTP layer included), checked against
        ``layout.layer_shapes``: a missing tensor, an unexpected name, a wrong shape, an FP8 tensor
        without a well-shaped ``_scale_inv`` all raise. Scale tensors are consumed, not returned.
        ``dequantize=False`` returns the tensors as stored, ``_scale_inv`` siblings included.
        The FP8 weights named in ``deferred`` come as :class:`pipeline.io.fp8.BlockRows` (checked, not yet
        dequantized: ``materialize()`` gives what would have come), for a consumer that takes them a
        block row at a time; a weight whose scales could overflow the dtype is dequantized as usual."""
        if layer_id not in layout.all_layer_ids(self.config):
            raise CheckpointError(f"{self.path}: layer {layer_id} is not in the config "
                                  f"(layers {layout.all_layer_ids(self.config)})")
        return self._read_unit(self._layer_shapes(layer_id), self._by_layer.get(layer_id, []),
                               f"layer {layer_id}", dtype, dequantize, deferred)

    def read_globals(self, dtype: Optional[torch.dtype] = None, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """``model.embed_tokens.weight``, ``model.norm.weight`` and ``lm_head.weight`` (unless tied).
        Any other stored tensor outside the config's layers is reported as unexpected."""
        layer_ids = set(layout.all_layer_ids(self.config))
        stray = [n for lid, names in self._by_layer.items() if lid is None or lid not in layer_ids for n in names]
        return self._read_unit(layout.global_shapes(self.config), stray, "the globals", dtype, dequantize)

    def read_specs(self, layer_id: Optional[int], dtype: Optional[torch.dtype] = None
                   ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape) of what ``read_layer(layer_id, dtype)`` (``read_globals(dtype)`` for
        None) returns, in its order, from the headers alone."""
        _check_dtype(dtype)
        names = layout.global_shapes(self.config) if layer_id is None else self._layer_shapes(layer_id)
        out = {}
        for name in names:
            stored, shape = self.header(name)
            out[name] = (read_dtype(name, stored, self.config.torch_dtype, dtype), shape)
        return out

    # ----- internals ---------------------------------------------------------------------------------
    def _layer_shapes(self, layer_id: int) -> dict[str, tuple]:
        return layout.layer_shapes(self.config, layer_id)

    def check_headers(self) -> None:
        """From the headers alone, everything reading each unit (the globals, every layer) would refuse:
        a missing or unexpected tensor, a shape that does not match the config (a vocabulary that does not
        match the embedding, a q_b_proj for another head count), an FP8 weight without a well-shaped
        ``_scale_inv``, a tensor stored in a type that is not a float (an I32 weight): a CheckpointError
        naming the file and tensor, before any weight is read."""
        layer_ids = set(layout.all_layer_ids(self.config))
        stray = [n for lid, names in self._by_layer.items() if lid is None or lid not in layer_ids for n in names]
        self._check_unit(layout.global_shapes(self.config), stray, "the globals")
        for lid in sorted(layer_ids):
            self._check_unit(self._layer_shapes(lid), self._by_layer.get(lid, []), f"layer {lid}")

    def _check_unit(self, expected: Mapping[str, tuple], stored: list[str], what: str) -> list[str]:
        """The header checks of one unit (:meth:`check_headers`); the stored names to read (_plan)."""
        unexpected = [n for n in stored if n not in expected
                      and not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in expected)]
        if unexpected:
            raise CheckpointError(
                f"{self.file_of(unexpected[0])}: tensor {unexpected[0]!r} is not part of {what} in the config "
                f"({len(unexpected)} unexpected: {unexpected[:5]})")
        missing = [n for n in expected if n not in self._file_of]
        if missing:
            raise CheckpointError(f"{self.path}: tensor {missing[0]!r} is missing ({what} needs it; "
                                  f"{len(missing)} missing: {missing[:5]})")
        for n in expected:
            dt, _ = self.header(n)
            if not DTYPES[dt].is_floating_point:
                raise CheckpointError(f"{self.file_of(n)}: tensor {n!r} is stored as {dt}; a weight of the model is "
                                      "a float (BF16, F16, F32, or F8_E4M3 with its scale)")
        return self._plan(expected)

    def _read_unit(self, expected: Mapping[str, tuple], stored: list[str], what: str,
                   dtype: Optional[torch.dtype], dequantize: bool, deferred: Container[str] = ()) -> dict:
        _check_dtype(dtype)
        if not dequantize and dtype is not None:
            raise ValueError("dtype applies only with dequantize=True")
        names = self._check_unit(expected, stored, what)
        if not dequantize:
            return self._read_stored(names)
        # In batches of about one ranged read, each FP8 weight dequantized as soon as it and its scale are
        # in: the stored bytes of the whole unit are never held next to its dequantized weights.
        scale_of = {n: n + SCALE_SUFFIX for n in expected if n + SCALE_SUFFIX in names}
        got: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for batch in self._batches(names):
            got.update(self._read_stored(batch))
            for n in [n for n in got if n in expected and (n not in scale_of or scale_of[n] in got)]:
                out[n] = self._materialize(n, got, dtype, n in deferred)
        return {n: out[n] for n in expected}

    def _batches(self, names: list[str]) -> list[list[str]]:
        """``names`` in file order, cut into runs of at most MAX_RUN_BYTES stored bytes (a larger tensor
        alone), so that read_tensors still fetches back-to-back tensors with one ranged read."""
        infos = {n: self._header(self.file_of(n)).info(n) for n in names}
        batches: list[list[str]] = []
        size = 0
        for n in sorted(names, key=lambda n: (self.file_of(n), infos[n].start)):
            nbytes = infos[n].end - infos[n].start
            if not batches or (size and size + nbytes > MAX_RUN_BYTES):
                batches.append([])
                size = 0
            batches[-1].append(n)
            size += nbytes
        return batches

    def _plan(self, expected: Mapping[str, Optional[tuple]]) -> list[str]:
        """From headers only: check shapes and FP8 scale siblings; the stored names to read, each FP8
        weight followed by its scale."""
        names: list[str] = []
        for name, shape in expected.items():
            dt, got = self.header(name)
            file = self.file_of(name)
            if shape is not None and got != tuple(shape):
                raise CheckpointError(f"{file}: tensor {name!r}: shape {list(got)} does not match the config "
                                      f"(expected {list(shape)})")
            names.append(name)
            scale = name + SCALE_SUFFIX
            if dt == FP8_NAME and not name.endswith(SCALE_SUFFIX):
                if scale not in self._file_of:
                    raise CheckpointError(f"{file}: tensor {name!r} is stored as {FP8_NAME} but its scale "
                                          f"tensor {scale!r} is missing")
                if len(got) != 2:
                    raise CheckpointError(f"{file}: tensor {name!r}: {FP8_NAME} block weights are 2-D, "
                                          f"got shape {list(got)}")
                sdt, sshape = self.header(scale)
                want = scale_shape(got, self.block)
                if sshape != want or sdt not in ("F32", "BF16", "F16", "F64"):
                    raise CheckpointError(
                        f"{self.file_of(scale)}: tensor {scale!r}: {sdt} {list(sshape)} is not a scale for "
                        f"{list(got)} in blocks {list(self.block)} (expected float {list(want)})")
                names.append(scale)
            elif scale in self._file_of:
                raise CheckpointError(f"{self.file_of(scale)}: tensor {scale!r} scales {name!r}, which is "
                                      f"stored as {dt}, not {FP8_NAME}")
        return names

    def _read_stored(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors as stored (one pass per file, ``names`` order kept), each checked for NaN/Inf."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of(n), []).append(n)
        got: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            got.update(read_tensors(self._header(file), file_names))
        for n in names:
            _check_finite(got[n], f"{self.file_of(n)}: tensor {n!r}")
        return {n: got[n] for n in names}

    def _materialize(self, name: str, stored: dict[str, torch.Tensor], dtype: Optional[torch.dtype],
                     defer: bool = False) -> torch.Tensor | BlockRows:
        """Dequantize (FP8; with ``defer``, only when its scales could overflow the dtype: else its
        BlockRows) and cast one stored tensor; pops it (and its scale) from ``stored``. The stored tensors
        were checked for NaN/Inf; what dequantization or a narrowing cast could add is checked too."""
        t = stored.pop(name)
        where = f"{self.file_of(name)}: tensor {name!r}"
        target = read_dtype(name, DTYPE_NAMES[t.dtype], self.config.torch_dtype, dtype)
        if t.dtype == FP8_DTYPE:
            scale = stored.pop(name + SCALE_SUFFIX)
            try:
                rows = BlockRows(t, scale, self.block, name, target)
            except ValueError as e:
                raise CheckpointError(f"{self.file_of(name)}: {e}") from None
            # Finite codes (|Wq| <= 448) times finite scales whose products stay within the target's range
            # are finite: only a scale too large for that needs the products checked, as the formula goes.
            fits = FP8_MAX * float(scale.to(torch.float32).abs().max()) <= torch.finfo(target).max
            if defer and fits:
                return rows
            out = rows.materialize()
            if not fits:
                exact = dequantize_fp8_blocks(t, scale, self.block, torch.float32, name)
                _check_finite(exact, where, " after dequantization")
                _check_finite(out, where, f" after conversion to {target}")
            return out
        if t.dtype != target and t.is_floating_point() and target.is_floating_point:
            narrowing = torch.finfo(target).max < torch.finfo(t.dtype).max
            t = t.to(target)
            if narrowing:  # a widening cast keeps finite values finite
                _check_finite(t, where, f" after conversion to {target}")
        return t


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def check_counts(cfg: DeepseekV3Config, names: Iterable[str], source: str) -> None:
    """Bound the config's counts by the tensors present, before anything sized by them is built: no more
    layers than have tensors, and no more ``n_routed_experts`` than the experts stored (a missing layer's
    tensors are reported by name when it is read).
    A config claiming 10^9 layers is an error naming the field here, not a MemoryError later."""
    layer_ids, experts = set(), -1
    for n in names:
        lid = layout.layer_of(n)
        if lid is not None:
            layer_ids.add(lid)
        m = _EXPERT.match(n)
        if m:
            experts = max(experts, int(m.group(2)))
    n_layers = max(layer_ids, default=-1) + 1
    for field in ("num_hidden_layers", "num_nextn_predict_layers"):
        if getattr(cfg, field) > n_layers:
            raise ConfigError(f"{source}: field '{field}' is {getattr(cfg, field)}, but the checkpoint's tensors "
                              f"hold {n_layers} layers")
    moe = any(cfg.is_moe_layer(i) for i in range(n_layers))
    if moe and cfg.n_routed_experts > experts + 1:
        raise ConfigError(f"{source}: field 'n_routed_experts' is {cfg.n_routed_experts}, but the checkpoint's "
                          f"tensors hold {experts + 1} routed experts")


def read_dtype(name: str, stored: str, torch_dtype: str, dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype the ``read_*`` methods give tensor ``name`` stored as ``stored`` (a safetensors dtype
    name, e.g. "F8_E4M3") in a checkpoint whose config says ``torch_dtype`` (the module's dtype rules)."""
    st = DTYPES[stored]
    if not st.is_floating_point:
        return st
    target = dtype or (getattr(torch, torch_dtype) if st == FP8_DTYPE else st)
    if name.endswith(ROUTER_BIAS_SUFFIX) and target.itemsize < 4:
        target = torch.float32
    return target


def _check_dtype(dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")


def _check_finite(t: torch.Tensor, where: str, when: str = "") -> None:
    """Raise naming ``where`` when a float tensor holds NaN or Inf (e4m3fn NaN is the bit pattern
    S.1111.111; the format has no Inf). Counted only once found."""
    if t.dtype == FP8_DTYPE:
        nan, inf = fp8_nan_count(t), 0
    elif t.is_floating_point() and not all_finite(t):
        nan, inf = nonfinite_counts(t)
    else:
        return
    if nan or inf:
        raise CheckpointError(f"{where}: {nan} NaN and {inf} Inf values{when}")
