"""Calibration statistics on storage: one Parquet file per reduced calibration, so a rerun (or another
worker) can skip the forward passes.

Rows use the columns of :meth:`Stats.to_dict` (name, kind, ratio, row, lo, hi, count); smoothing
statistics (per-channel |max|, float32) are stored as rows of kind ``channel_absmax`` with the channel in
``row`` and the value in ``hi``. Every value is a float64 in the file, which holds float32/bf16 exactly,
so a load gives back bit-identical statistics. ``meta`` (e.g. the source and recipe fingerprints) goes
into the Parquet schema metadata under ``dsquant``.
"""

from __future__ import annotations

import io
import json
from typing import Any, Mapping, Optional

import torch

from pipeline.io import storage
from pipeline.quant.numerics.observers import COLUMNS, Stats
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.transforms.smooth import ChannelAbsMax

KIND_CHANNEL_ABSMAX = "channel_absmax"
META_KEY = b"dsquant"


def _smooth_rows(smooth: Mapping[str, ChannelAbsMax]) -> dict[str, list]:
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    for name, s in sorted(smooth.items()):
        if s.value is None:
            continue
        for ch, v in enumerate(s.value.double().tolist()):
            for c, x in zip(COLUMNS, (name, KIND_CHANNEL_ABSMAX, None, ch, 0.0, v, 0)):
                cols[c].append(x)
    return cols


def save_calibration(path: str, stats: Stats, smooth: Optional[Mapping[str, ChannelAbsMax]] = None,
                     meta: Optional[Mapping[str, Any]] = None) -> None:
    """Write the statistics to ``path`` (a .parquet file, any fsspec URL), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = stats.to_dict()
    for c, vals in _smooth_rows(smooth or {}).items():
        cols[c] = cols[c] + vals
    table = pa.Table.from_pydict(cols, schema=pa.schema([
        ("name", pa.string()), ("kind", pa.string()), ("ratio", pa.float64()), ("row", pa.int64()),
        ("lo", pa.float64()), ("hi", pa.float64()), ("count", pa.int64())]))
    table = table.replace_schema_metadata({META_KEY: json.dumps(dict(meta or {}), sort_keys=True).encode()})
    with storage.atomic_write(path) as f:
        pq.write_table(table, f)


def load_calibration(path: str) -> tuple[Stats, dict[str, ChannelAbsMax], dict]:
    """(statistics, smoothing statistics, meta) saved by :func:`save_calibration`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(storage.read_bytes(path)))
    except (pa.ArrowInvalid, OSError) as e:
        raise QuantError(f"{path}: not a readable calibration statistics file ({e})") from None
    cols = table.to_pydict()
    if set(cols) != set(COLUMNS):
        raise QuantError(f"{path}: columns {sorted(cols)} differ from {sorted(COLUMNS)}")
    smooth_idx = [i for i, k in enumerate(cols["kind"]) if k == KIND_CHANNEL_ABSMAX]
    keep = sorted(set(range(len(cols["kind"]))) - set(smooth_idx))
    try:
        stats = Stats.from_dict({c: [cols[c][i] for i in keep] for c in COLUMNS})
    except QuantError as e:
        raise QuantError(f"{path}: {e}") from None
    channels: dict[str, dict[int, float]] = {}
    for i in smooth_idx:
        channels.setdefault(cols["name"][i], {})[cols["row"][i]] = cols["hi"][i]
    smooth = {}
    for name, by_ch in channels.items():
        if sorted(by_ch) != list(range(len(by_ch))):
            raise QuantError(f"{path}: smoothing statistics of {name!r} miss channels")
        smooth[name] = ChannelAbsMax(torch.tensor([by_ch[c] for c in range(len(by_ch))], dtype=torch.float32))
    raw_meta = (table.schema.metadata or {}).get(META_KEY, b"{}")
    return stats, smooth, json.loads(raw_meta)
