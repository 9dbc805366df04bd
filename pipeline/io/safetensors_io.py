"""safetensors over any fsspec URL, by ranged reads and streaming writes (no ``safe_open``, which needs a
local path, and never a whole file in memory).

File format (little-endian)::

    [0, 8)              u64 N: length of the JSON header
    [8, 8 + N)          JSON {"__metadata__": {str: str} (optional),
                              name: {"dtype": "BF16", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
                        padded with spaces so that 8 + N is a multiple of 8
    [8 + N, size)       the data; a tensor's bytes are [8 + N + begin, 8 + N + end),
                        end - begin == prod(shape) * itemsize(dtype), row-major

All storage access goes through :mod:`pipeline.io.storage`.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from pipeline.io import storage
from pipeline.io.json_input import parse_json


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it claims to be; the message names the file and the tensor."""


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # what the reference implementation accepts
# Adjacent tensors are fetched with one ranged read up to this many bytes: fewer requests on object
# storage, while a tensor kept alive pins at most this much of a shared read buffer.
MAX_RUN_BYTES = 64 * 1024 * 1024

if sys.byteorder != "little":  # the bytes are little-endian and are viewed in place
    raise ImportError("pipeline.io.safetensors_io needs a little-endian host")


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, with offsets made absolute: the bytes are [start, end) of the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    size: int  # file size in bytes
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the file")
        return self.tensors[name]


# ----- reading --------------------------------------------------------------------------------------
def read_header(path: str) -> SafetensorsHeader:
    """Parse and validate the header with two ranged reads (the length, then the JSON).

    Raises :class:`CheckpointError` for a file too short for its header or its data (truncated), a
    header that is not a JSON object of well-formed entries, an unknown dtype, a byte length that is not
    numel * itemsize, and data ranges that overlap or lie outside the file.
    """
    size = storage.size(path)
    if size < 8:
        raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", storage.read_range(path, 0, 8))
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointError(
            f"{path}: corrupt header: header length {n} is impossible for a file of {size} bytes")
    raw = parse_json(bytes(storage.read_range(path, 8, 8 + n)), f"{path}: corrupt header", CheckpointError)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object, got {type(raw).__name__}")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt header: __metadata__ must map strings to strings")
    data_start = 8 + n
    tensors = {name: _parse_entry(path, name, entry, data_start) for name, entry in raw.items()}
    _check_layout(path, size, tensors)
    return SafetensorsHeader(path=path, size=size, tensors=tensors, metadata=dict(metadata))


def _parse_entry(path: str, name: str, entry: Any, data_start: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{where}: corrupt header: entry needs dtype, shape and data_offsets, got {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: corrupt header: shape must be a list of ints >= 0, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: corrupt header: data_offsets must be [begin, end], got {offsets!r}")
    nbytes = math.prod(shape) * itemsize(dtype)
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"{where}: corrupt header: {offsets[1] - offsets[0]} bytes for {dtype} {shape} (expected {nbytes})")
    return TensorInfo(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_layout(path: str, size: int, tensors: Mapping[str, TensorInfo]) -> None:
    prev_name, prev_end = None, 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r}: truncated file: data ends at byte {t.end}, the file has {size}")
        if t.start < prev_end:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} overlaps tensor {prev_name!r}")
        if t.end > t.start:
            prev_name, prev_end = name, t.end


def read_tensors(header: SafetensorsHeader, names: Iterable[str],
                 max_run_bytes: int = MAX_RUN_BYTES) -> dict[str, torch.Tensor]:
    """The named tensors of one file, as stored (dtype and shape of the header).

    Only their bytes are read: tensors that lie back to back are fetched together with one ranged read
    of at most ``max_run_bytes`` (a larger tensor gets its own read); nothing between them is read.
    The returned tensors may share their read buffer.
    """
    infos = sorted(((n, header.info(n)) for n in set(names)), key=lambda kv: kv[1].start)
    runs: list[list[tuple[str, TensorInfo]]] = []
    for name, info in infos:
        last = runs[-1] if runs else None
        if last and last[-1][1].end == info.start and info.end - last[0][1].start <= max_run_bytes:
            last.append((name, info))
        else:
            runs.append([(name, info)])
    out: dict[str, torch.Tensor] = {}
    for run in runs:
        start, end = run[0][1].start, run[-1][1].end
        data = storage.read_range(header.path, start, end) if end > start else bytearray()
        buf = bytearray(data) if isinstance(data, bytes) else data  # writable, for torch.frombuffer
        if len(buf) != end - start:
            raise CheckpointError(f"{header.path}: tensor {run[-1][0]!r}: truncated file: "
                                  f"read {len(buf)} of {end - start} bytes at offset {start}")
        for name, info in run:
            out[name] = _from_bytes(buf, info.start - start, info)
    return out


def read_rows(header: SafetensorsHeader, name: str, start: int, end: int) -> torch.Tensor:
    """Rows ``start .. end`` (dim 0) of one tensor, with one ranged read of just their bytes."""
    info = header.info(name)
    if not info.shape or not 0 <= start <= end <= info.shape[0]:
        raise CheckpointError(f"{header.path}: tensor {name!r}: rows {start}..{end} outside its shape "
                              f"{list(info.shape)}")
    row = math.prod(info.shape[1:]) * itemsize(info.dtype)
    part = TensorInfo(info.dtype, (end - start, *info.shape[1:]), info.start + start * row, info.start + end * row)
    data = storage.read_range(header.path, part.start, part.end) if part.end > part.start else bytearray()
    buf = bytearray(data) if isinstance(data, bytes) else data
    if len(buf) != part.end - part.start:
        raise CheckpointError(f"{header.path}: tensor {name!r}: truncated file: read {len(buf)} of "
                              f"{part.end - part.start} bytes at offset {part.start}")
    return _from_bytes(buf, 0, part)


def _from_bytes(buf: bytearray | np.ndarray, offset: int, info: TensorInfo) -> torch.Tensor:
    dtype = DTYPES[info.dtype]
    numel = math.prod(info.shape)
    if numel == 0:
        return torch.empty(info.shape, dtype=dtype)
    if offset % dtype.itemsize:  # misaligned inside the shared buffer: copy to a fresh (aligned) one
        buf, offset = bytearray(buf[offset:offset + numel * dtype.itemsize]), 0
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).reshape(info.shape)


# ----- writing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """What a tensor will be, known before its values: lets a file's header be written first."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        return cls(name, DTYPE_NAMES[t.dtype], tuple(t.shape))


def encode_header(specs: Sequence[TensorSpec], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The 8-byte length and the JSON header for tensors laid out back to back in ``specs`` order."""
    raw: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        raw["__metadata__"] = dict(metadata)
    offset = 0
    for s in specs:
        if s.dtype not in DTYPES:
            raise ValueError(f"tensor {s.name!r}: unknown dtype {s.dtype!r}")
        if s.name in raw or not s.name:
            raise ValueError(f"tensor name {s.name!r} is empty, reserved or repeated")
        raw[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(raw, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """Streams one safetensors file whose tensors are declared up front, so that only one tensor need be
    in memory at a time. Tensors must be written in ``specs`` order; the file appears at ``path`` (via
    :func:`pipeline.io.storage.atomic_write`) only when every declared tensor has been written::

        with SafetensorsWriter(path, specs) as w:
            for s in specs:
                w.write(s.name, make(s))
    """

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: Optional[Mapping[str, str]] = None):
        self.path = path
        self.specs = list(specs)
        self._header = encode_header(self.specs, metadata)
        self._next = 0
        self._size = len(self._header) + sum(s.nbytes for s in self.specs)
        self._ctx = storage.atomic_write(path, self._size)
        self._file: Any = None

    def __enter__(self) -> "SafetensorsWriter":
        self._file = self._ctx.__enter__()
        self._write(self._header)
        return self

    def _write(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as e:  # a full disk: say where and how much
            full = storage.disk_full(e, self.path, self._size)
            if full is None:
                raise
            raise full from None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path}: tensor {name!r} was not declared (all {len(self.specs)} written)")
        want, got = self.specs[self._next], TensorSpec.of(name, tensor)
        if got != want:
            raise ValueError(f"{self.path}: expected tensor {want} next, got {got}")
        if tensor.numel():
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._write(memoryview(data))
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and self._next != len(self.specs):
            missing = [s.name for s in self.specs[self._next:]]
            exc = ValueError(f"{self.path}: {len(missing)} declared tensors never written: {missing[:5]}")
            self._ctx.__exit__(ValueError, exc, None)
            raise exc
        return bool(self._ctx.__exit__(exc_type, exc, tb))


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str,
                     metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``tensors`` (in their mapping order) to ``path`` atomically; returns the data byte count."""
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    with SafetensorsWriter(path, specs, metadata) as w:
        for s in specs:
            w.write(s.name, tensors[s.name])
    return sum(s.nbytes for s in specs)
