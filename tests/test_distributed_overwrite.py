"""The distributed job's --overwrite keeps an earlier output whole until the new one is complete (issue 15,
item 12): the new output is written in a hidden sibling directory, then swapped in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from actors.quantize.quantize_job import quantize_distributed
from actors.quantize.ray_session import DistOptions
from distributed import OPTS, PLAIN, assert_same_output, quiet
from pipeline.format.checker import check_dir
from pipeline.quant.recipe.recipe import Recipe
from tiny import TINY_FIXTURE


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    return ray_cluster


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_overwrite_keeps_the_old_output_until_the_new_one_is_complete(tmp_path, tiny_references):
    dst = tmp_path / "q"
    shutil.copytree(tiny_references["plain"], dst)
    before = snapshot(dst)
    seen = []

    def crash_after_the_first_unit(kind: str, info: dict) -> None:
        if kind == "unit":
            seen.append(snapshot(dst) == before and check_dir(str(dst)).ok)
            raise RuntimeError("injected crash in the weight phase")

    opts = OPTS.__class__(**{**OPTS.__dict__, "overwrite": True})
    with pytest.raises(RuntimeError, match="injected crash"):
        quantize_distributed(str(TINY_FIXTURE), str(dst), Recipe(dynamic=True), opts, DistOptions(stages=1),
                             log=quiet, on_event=crash_after_the_first_unit)
    assert seen == [True]
    assert snapshot(dst) == before and check_dir(str(dst)).ok

    quantize_distributed(str(TINY_FIXTURE), str(dst), PLAIN, opts, DistOptions(stages=1), log=quiet)
    assert_same_output(str(dst), str(tiny_references["plain"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no staging or old directory left
