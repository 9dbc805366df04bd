"""The destination rule of every job that writes a directory (jobs.quantize, jobs.requantize,
jobs.evaluate ``--out``, jobs.make_outlier_variant, jobs.make_fp8, jobs.make_checkpoint).

A destination is refused when

- it is the source, contains the source, or lies inside it, however spelt (symbolic links, ``..``, a
  trailing slash, ``file://``): writing there would delete or alter what is read;
- it exists and is not a directory;
- it holds anything but the job's own kind of output (``is_own`` judges the entries): another
  checkpoint, another job's output, a home directory;
- it holds the job's own kind of output and ``overwrite`` was not given.

A crashed writer's hidden leftovers (``.name.part-*``, ``.name.tmp-*``) are neither the job's output nor
foreign: they never block. Each job keeps what it writes in a hidden sibling until it is complete, under the
destination's lock (:mod:`pipeline.io.destination.lock`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from pipeline.io import storage


def is_leftover(name: str) -> bool:
    """A hidden part or temporary file of a writer that crashed: garbage, never an output."""
    return name.startswith(".") and (".part-" in name or ".tmp-" in name)


def _inside(child: str, parent: str) -> bool:
    """Whether resolved location ``child`` lies under resolved location ``parent`` (not equal)."""
    parent = parent.rstrip("/")
    return child != parent and child.startswith(parent + "/")


def check_not_source(src: Optional[str], dst: str, flag: str = "--save-path", may_hold: bool = False) -> None:
    """ValueError naming ``flag`` when ``dst`` is ``src``, contains it (unless ``may_hold``: a job that
    replaces nothing in ``dst`` but its own named files), or lies inside it."""
    if src is None:
        return
    s, d = storage.resolve(src), storage.resolve(dst)
    if s == d:
        raise ValueError(f"{dst}: the destination is the source {src}; choose another {flag}")
    if _inside(s, d) and not may_hold:
        raise ValueError(f"{dst}: the destination contains the source {src} (writing it would replace the "
                         f"source); choose another {flag}")
    if _inside(d, s):
        raise ValueError(f"{dst}: the destination is inside the source {src} (writing it would alter the "
                         f"source); choose another {flag}")


def check_destination(dst: str, *, kind: str, is_own: Callable[[list[str]], bool], overwrite: bool,
                      sources: Iterable[Optional[str]] = (), flag: str = "--save-path",
                      overwrite_flag: Optional[str] = "--overwrite", may_hold: bool = False) -> list[str]:
    """The entries of an earlier output of ``kind`` (e.g. "an outlier variant") in ``dst`` that a new one
    will replace, after checking the module doc's rule; ``is_own(entries)`` says whether the non-empty
    entry list is such an output. Raises ValueError (the source) or FileExistsError (anything else),
    naming ``dst`` and what to do. ``overwrite_flag`` None: the job always replaces its own kind.
    ``may_hold``: see :func:`check_not_source`."""
    for src in sources:
        check_not_source(src, dst, flag, may_hold)
    if not storage.exists(dst):
        return []
    if not storage.isdir(dst):
        raise FileExistsError(f"{dst}: exists and is not a directory; choose another {flag}")
    entries = [e for e in storage.listdir(dst) if not is_leftover(e)]
    if not entries:
        return []
    if not is_own(entries):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise FileExistsError(f"{dst}: holds files that are not {kind} ({shown}); choose a new or empty "
                              f"directory for {flag}")
    if not overwrite and overwrite_flag is not None:
        raise FileExistsError(f"{dst}: already holds {kind}; use {overwrite_flag} to replace it")
    return entries
