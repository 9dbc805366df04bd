"""How the output tensors are cut into shard files: one rule for the single-process writer, the planner
and the distributed job, so that they all write the same files.

The output is a sequence of *units*: the globals (``model.embed_tokens``, ``model.norm``, ``lm_head``),
then each layer (main layers, then MTP), each unit's tensors in the order the quantizer emits them.

    A shard never spans two units. Within a unit, tensors go into shards in order, a shard closing as
    soon as the next tensor would take it past ``shard_bytes`` of tensor data (so a shard passes the limit
    only when one tensor alone does).

Because a layer's shards depend on that layer alone, any worker that owns a set of layers can write their
shards, under their final names (``-0000i-of-0000N``: N is known from the headers before anything runs),
without talking to the others, and the files are the same whichever worker wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pipeline import layout
from pipeline.io.checkpoint import CheckpointReader
from pipeline.format.description import NAMING
from pipeline.quant.writing.quantize_layer import layer_output_specs
from pipeline.quant.recipe.recipe import Recipe
from pipeline.io.safetensors_io import TensorSpec

GLOBALS = "globals"


def unit_key(layer_id: Optional[int]) -> str:
    """The unit of a layer id (None: the globals)."""
    return GLOBALS if layer_id is None else str(layer_id)


def unit_layer(unit: str) -> Optional[int]:
    return None if unit == GLOBALS else int(unit)


@dataclass(frozen=True)
class Shard:
    index: int                      # 0-based
    name: str                       # the final file name
    unit: str                       # GLOBALS or a layer id
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def split_sizes(sizes: Sequence[int], shard_bytes: int) -> list[int]:
    """How many of one unit's tensors (their byte sizes, in order) go into each of its shards, by the
    module doc's rule."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
    counts: list[int] = []
    size = 0
    for n in sizes:
        if not counts or (counts[-1] and size + n > shard_bytes):
            counts.append(0)
            size = 0
        counts[-1] += 1
        size += n
    return counts


def split_unit(specs: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """One unit's tensors cut into shards by the module doc's rule."""
    out, k = [], 0
    for c in split_sizes([s.nbytes for s in specs], shard_bytes):
        out.append(list(specs[k:k + c]))
        k += c
    return out


def layout_shards(units: Sequence[tuple[str, Sequence[TensorSpec]]], shard_bytes: int,
                  dialect: str) -> list[Shard]:
    """Every shard of the output, in file order, from each unit's (name, specs) in output order."""
    pieces = [(u, p) for u, specs in units for p in split_unit(specs, shard_bytes)]
    names = NAMING[dialect].file_names(len(pieces))
    return [Shard(i, names[i], u, tuple(p)) for i, (u, p) in enumerate(pieces)]


def output_units(reader: CheckpointReader, recipe: Recipe) -> list[tuple[str, list[TensorSpec]]]:
    """(unit, the specs of every tensor the quantizer writes for it) in output order, from the source's
    headers alone."""
    cfg = reader.config
    units = [(GLOBALS, layer_output_specs(cfg, None, reader.read_specs(None), recipe))]
    for i in layout.all_layer_ids(cfg):
        units.append((unit_key(i), layer_output_specs(cfg, i, reader.read_specs(i), recipe)))
    return units


def checkpoint_shards(reader: CheckpointReader, recipe: Recipe, shard_bytes: int) -> list[Shard]:
    """The output's shards for quantizing ``reader``'s checkpoint with ``recipe``."""
    return layout_shards(output_units(reader, recipe), shard_bytes, recipe.dialect)
