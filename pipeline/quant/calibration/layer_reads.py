"""Reading a checkpoint's units for the layer-by-layer jobs: each unit's stored size, the next layer on its
way while the caller works on this one, and a layer's tensors as the float model holds them."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import torch

from pipeline import layout
from pipeline.io import heap
from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.fp8 import BlockRows
from pipeline.io.safetensors_io import itemsize


def unit_bytes(reader: CheckpointReader) -> dict[Optional[int], int]:
    """Stored bytes of each unit (None: the globals; else a layer id), from the headers: what one
    ``read_globals`` / ``read_layer`` reads (every tensor of the unit, FP8 scales included)."""
    out: dict[Optional[int], int] = {}
    for name in reader.tensor_names():
        dt, shape = reader.header(name)
        lid = layout.layer_of(name)
        out[lid] = out.get(lid, 0) + math.prod(shape) * itemsize(dt)
    return out


def prefetched(ids: list[int], load: Callable[[int], dict], enabled: bool,
               ahead: Optional[Callable[[int], bool]] = None) -> Iterator[tuple[int, dict]]:
    """(i, load(i)) for each id, the next one on its way while the caller works on this one. With
    ``ahead`` (``CheckpointReader.read_ahead``) that takes the hint, the page cache reads it in the
    background and this process holds one layer; else a thread loads it (one deep: a second layer held).
    Once the caller is done with a layer, the heap's freed blocks go back to the system
    (:func:`pipeline.io.heap.release`), so that the next layer's peak does not stack on them. Closing the
    generator waits for that thread; its errors surface here."""
    if not ids:
        return
    hint = enabled and ahead is not None and ahead(ids[0])
    if hint or not enabled:
        for k, i in enumerate(ids):
            tensors = load(i)
            if hint and k + 1 < len(ids):
                ahead(ids[k + 1])
            yield i, tensors
            del tensors
            heap.release()
        return
    with ThreadPoolExecutor(1, thread_name_prefix="prefetch-layer") as pool:
        nxt = pool.submit(load, ids[0])
        try:
            for k, i in enumerate(ids):
                tensors = nxt.result()
                nxt = pool.submit(load, ids[k + 1]) if k + 1 < len(ids) else None
                yield i, tensors
                del tensors
                heap.release()
        finally:
            if nxt is not None:
                nxt.cancel()


def forward_tensors(tensors: dict) -> dict[str, torch.Tensor]:
    """The layer as the float model holds it: deferred FP8 weights dequantized (the same BlockRows the
    weight phase quantizes from: ``materialize`` is what ``read_layer(dtype=md)`` gives)."""
    return {n: (t.materialize() if isinstance(t, BlockRows) else t) for n, t in tensors.items()}
