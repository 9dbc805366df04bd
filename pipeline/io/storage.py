"""The one module that talks to storage: local and NFS paths, ``file://``, ``memory://``, ``s3://`` and any
other fsspec URL. Everything else in the project passes path strings and calls these functions.

Object-store options (endpoint, credentials) come from the usual environment (AWS_*, FSSPEC_S3_*), or
from ``storage_options`` registered with :func:`set_options` for a URL scheme.

Object stores have no directories, only key prefixes. Every call here asks the store afresh: s3fs keeps
one client per process with a cache of listings and sizes that only its own writes update, so without
:func:`filesystem` dropping the cached entries of the path (and its parents) a file written, replaced or
deleted by another process (a Ray worker) could be missed or read with a stale size. Some stores
(SeaweedFS) keep an emptied "directory" as a ``dir/`` marker: :func:`listdir` does not report it as an
entry of itself, so an empty directory lists as ``[]`` there as it does locally, and :func:`remove`
deletes the markers too, so a removed directory is gone.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import sys
import uuid
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import numpy as np

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

_OPTIONS: dict[str, dict[str, Any]] = {}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class StorageError(OSError):
    """A location that cannot be used (unreachable store, full disk); the message names the path."""


class DiskFullError(StorageError):
    """No room to write a file; the message names the path and the bytes needed."""


def set_options(protocol: str, **options: Any) -> None:
    """Register fsspec storage options for every later call on ``protocol`` (e.g. ``s3``)."""
    _OPTIONS[protocol] = dict(options)


def options() -> dict[str, dict[str, Any]]:
    """A copy of every registered protocol's options (to hand to another process: a Ray worker)."""
    return {k: dict(v) for k, v in _OPTIONS.items()}


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem serving ``path`` and the path in that filesystem's terms."""
    protocol = path.split("://", 1)[0] if "://" in path else "file"
    fs, p = url_to_fs(path, **_OPTIONS.get(protocol, {}))
    fs.invalidate_cache(p)  # no answer from an earlier call's listing (module doc); a no-op on local paths
    return fs, p


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def resolve(path: str) -> str:
    """A canonical spelling of ``path`` to compare locations: a local path made absolute with symlinks,
    ``.`` and ``..`` resolved; a URL with its path normalized (no trailing slash)."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    if "://" not in path:
        return os.path.realpath(path)
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{posixpath.normpath(rest).lstrip('/')}"


def same_location(a: str, b: str) -> bool:
    return resolve(a) == resolve(b)


PROBE_TIMEOUT_S = 5.0       # seconds an object store's endpoint has to accept a connection, then to answer
PROBE_ATTEMPTS = 3
S3_SCHEMES = ("s3", "s3a")


def endpoint_of(path: str) -> str | None:
    """The HTTP(S) endpoint URL serving an ``s3://`` path (registered options, AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL, else AWS's own); None for other paths."""
    scheme = path.split("://", 1)[0] if is_url(path) else ""
    if scheme not in S3_SCHEMES:
        return None
    opts = _OPTIONS.get(scheme, {})
    return ((opts.get("client_kwargs") or {}).get("endpoint_url") or opts.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            or "https://s3.amazonaws.com")


def _probe_endpoint(url: str, timeout: float) -> tuple[str, bool] | None:
    """Why ``url`` (an HTTP(S) endpoint) does not answer an HTTP request within ``timeout`` seconds to
    connect and as many to reply (any status counts as an answer), and whether that was a time-out (worth
    a retry, unlike a refusal); None when it answers."""
    import socket
    import ssl
    from urllib.parse import urlsplit

    u = urlsplit(url)
    https = u.scheme == "https"
    host, port = u.hostname or "", u.port or (443 if https else 80)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        return f"no connection within {timeout:g} s", True
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__, False
    try:
        if https:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE   # liveness only: the client verifies
            sock = ctx.wrap_socket(sock, server_hostname=host)
        sock.settimeout(timeout)
        sock.sendall(f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return None if sock.recv(1) else ("it closed the connection without an answer", False)
    except socket.timeout:
        return f"it accepted a connection but sent no answer within {timeout:g} s", True
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__, False
    finally:
        sock.close()


def check_local_path(path: str) -> None:
    """StorageError naming ``path`` when it, or a directory above it, is a loop of symbolic links, a
    symbolic link to nothing, or a file where a directory must be: a location no file can be written
    under (found now, not when the first file is written)."""
    p = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
    chain = []
    while True:
        chain.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for a in reversed(chain):       # from the root down
        if not os.path.lexists(a):
            return
        try:
            os.stat(a)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StorageError(f"{path}: {a} is a loop of symbolic links") from None
            if e.errno == errno.ENOENT:
                raise StorageError(f"{path}: {a} is a symbolic link to {os.readlink(a)}, which does not "
                                   "exist") from None
            raise StorageError(f"{path}: {a}: {e.strerror}") from None
        if a != chain[0] and not os.path.isdir(a):
            raise StorageError(f"{path}: {a} is a file, not a directory")


def check_reachable(path: str, log=None) -> None:
    """Ask the store serving ``path`` whether it exists, so that an unreachable endpoint or a refused
    connection is a StorageError naming the path (and endpoint) now, not after hours of work (a local path:
    :func:`check_local_path`). An S3
    endpoint must first answer an HTTP request within PROBE_TIMEOUT_S (a mute one would otherwise hold
    the client for minutes of its own time-outs and retries); one that does not answer in time is tried
    PROBE_ATTEMPTS times, each retry said through ``log`` (default: a line on stderr); a refusal fails at once."""
    if not is_url(path):
        check_local_path(path)
        return
    endpoint = endpoint_of(path)
    if endpoint is not None:
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            failed = _probe_endpoint(endpoint, PROBE_TIMEOUT_S)
            if failed is None:
                break
            why, timed_out = failed
            if not timed_out or attempt == PROBE_ATTEMPTS:
                tries = f"; tried {attempt} times" if attempt > 1 else ""
                raise StorageError(f"{path}: storage not reachable at {endpoint} ({why}{tries})")
            say(f"storage: {endpoint} did not answer ({why}); retrying ({attempt + 1} of {PROBE_ATTEMPTS})")
    try:
        exists(path)
    except Exception as e:  # noqa: BLE001 - any failure to get an answer means the store cannot be used
        endpoint = endpoint or (_OPTIONS.get(path.split("://", 1)[0], {}).get("client_kwargs") or {}).get(
            "endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StorageError(f"{path}: storage not reachable at {endpoint} ({reason})") from None


def free_bytes(path: str) -> int | None:
    """Bytes free on the local filesystem that holds (or would hold) ``path``; None for object stores."""
    if is_url(path):
        return None
    p = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def check_room(path: str, nbytes: int) -> None:
    """DiskFullError naming ``path`` when its local filesystem has fewer than ``nbytes`` free."""
    free = free_bytes(path)
    if free is not None and free < nbytes:
        raise DiskFullError(f"{path}: no space left: the output needs about {nbytes} bytes, {free} bytes are free")


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: the file it concerns and the reason."""
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def join(base: str, *names: str) -> str:
    """Join path components, keeping a URL's scheme intact."""
    if "://" in base:
        scheme, rest = base.split("://", 1)
        return f"{scheme}://{posixpath.join(rest, *names)}"
    return posixpath.join(base, *names)


def exists(path: str) -> bool:
    with _named(path):
        fs, p = filesystem(path)
        return fs.exists(p)


def isdir(path: str) -> bool:
    with _named(path):
        fs, p = filesystem(path)
        return fs.isdir(p)


def size(path: str) -> int:
    fs, p = filesystem(path)
    return int(fs.size(p))


VERSION_MODES = ("stat", "sha256")
_version_mode = "stat"


def set_version_mode(mode: str) -> None:
    """How :func:`version` tells a file's versions apart: ``stat`` (its size and ETag or modification time:
    nothing read; an in-place edit that keeps both, as ``cp -p`` or ``rsync -t`` can, is missed) or
    ``sha256`` (its size and content hash: every file read once per call)."""
    global _version_mode
    if mode not in VERSION_MODES:
        raise ValueError(f"version mode must be one of {', '.join(VERSION_MODES)}, got {mode!r}")
    _version_mode = mode


def version(path: str) -> dict[str, Any]:
    """What identifies a stored file's version (:func:`set_version_mode`): by default, without reading it,
    its size and, as the store has them, its ETag (object stores) or modification time (local, NFS); in
    ``sha256`` mode its size and the sha256 of its content."""
    if _version_mode == "sha256":
        n, digest = file_sha256(path)
        return {"size": n, "sha256": digest}
    fs, p = filesystem(path)
    info = fs.info(p)
    out = {"size": int(info["size"])}
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified"):
        if info.get(key) is not None:
            out[key.lower()] = str(info[key])
    return out


def listdir(path: str) -> list[str]:
    """Base names of the entries of a directory, sorted."""
    with _named(path):
        fs, p = filesystem(path)
        own = p.rstrip("/")
        return sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False) if e.rstrip("/") != own)


@contextmanager
def _named(path: str) -> Iterator[None]:
    """An object store client's own error (botocore's NoCredentialsError, ...) as a StorageError naming
    ``path``: bad input, not a crash."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - only the store clients' own errors are translated
        if not type(e).__module__.startswith(("botocore", "aiobotocore", "s3fs")):
            raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = " (credentials: the usual AWS_* environment or ~/.aws)" if "credentials" in reason.lower() else ""
        raise StorageError(f"{path}: {reason}{hint}") from None


def read_bytes(path: str) -> bytes:
    with _named(path):
        fs, p = filesystem(path)
        with fs.open(p, "rb") as f:
            return f.read()


def read_small(path: str, limit: int, what: str = "file") -> bytes:
    """The content of a small input file (a recipe, a key): StorageError naming ``path`` when it is not a
    regular file (a FIFO or device would block or never end) or holds more than ``limit`` bytes; never
    reads more than ``limit`` + 1 bytes."""
    with _named(path):
        fs, p = filesystem(path)
        if isinstance(fs, LocalFileSystem):
            import stat

            mode = os.stat(p).st_mode          # FileNotFoundError / IsADirectoryError stay as they are
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            if not stat.S_ISREG(mode):
                raise StorageError(f"{path}: not a regular file (a FIFO, socket or device); the {what} must be a file")
        elif int(fs.size(p) or 0) > limit:
            raise StorageError(f"{path}: larger than {limit} bytes; not a {what}")
        with fs.open(p, "rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise StorageError(f"{path}: larger than {limit} bytes; not a {what}")
    return data


def read_range(path: str, start: int, end: int) -> bytes | np.ndarray:
    """Bytes [start, end) of a file (fewer past its end), with one ranged read (one HTTP range request on
    object storage). On a local path they are read straight into a new, uninitialized uint8 array
    (writable, so tensors can view it without a copy)."""
    fs, p = filesystem(path)
    if isinstance(fs, LocalFileSystem):
        import numpy as np  # here, not at the top: the corpus reader imports this module and must stay lean

        buf = np.empty(max(0, end - start), dtype=np.uint8)  # uninitialized: a bytearray would be zeroed first
        view, n = memoryview(buf), 0
        with open(p, "rb", buffering=0) as f:
            f.seek(start)
            while n < len(buf):
                k = f.readinto(view[n:])
                if not k:
                    break
                n += k
        view.release()
        return buf[:n]
    return fs.cat_file(p, start=start, end=end)


def will_need(path: str, start: int, end: int) -> bool:
    """Ask the kernel to read bytes [start, end) of a local file into the page cache in the background
    (posix_fadvise WILLNEED): a read ahead that costs no memory of this process. False where it cannot
    (object storage, a system without posix_fadvise): the caller reads ahead itself or not at all."""
    fs, p = filesystem(path)
    if not isinstance(fs, LocalFileSystem) or not hasattr(os, "posix_fadvise") or end <= start:
        return False
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
    return True


def file_sha256(path: str, chunk: int = 64 * 1024 ** 2) -> tuple[int, str]:
    """(size, sha256) of a stored file, read in chunks."""
    import hashlib

    digest, n = hashlib.sha256(), 0
    with _named(path), open_read(path) as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            digest.update(block)
            n += len(block)
    return n, digest.hexdigest()


def open_read(path: str):
    """A seekable binary file object; use for many small ranged reads of the same file."""
    fs, p = filesystem(path)
    return fs.open(p, "rb")


@contextmanager
def atomic_write(path: str, size: int | None = None) -> Iterator[Any]:
    """A binary file object that streams to a hidden temporary name beside ``path`` and is renamed to
    ``path`` only when the ``with`` block ends without an exception; on failure the temporary is removed
    and ``path`` is left as it was. Parent directories are created. A full disk (or quota) is a
    :class:`DiskFullError` naming ``path`` and ``size``, the bytes the file needs, when given.

    The rename is atomic on local and NFS paths; on object stores fsspec moves by copy-then-delete, and the
    final object still appears only once complete.
    """
    fs, p = filesystem(path)
    parent, base = posixpath.split(p)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = posixpath.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
    f = fs.open(tmp, "wb")
    try:
        yield f
        f.close()
        fs.mv(tmp, p)
    except BaseException as e:
        for cleanup in (f.close, lambda: fs.exists(tmp) and fs.rm(tmp)):  # each even if the other fails
            try:
                cleanup()
            except Exception:  # the original error is the one to report (close fails again on a full disk)
                pass
        full = disk_full(e, path, size)
        if full is not None:
            raise full from None
        raise


def disk_full(e: BaseException, path: str, size: int | None = None) -> DiskFullError | None:
    """The DiskFullError to raise instead of ``e`` when ``e`` says the disk (or quota) is full while
    writing ``path`` (``size`` bytes in all, when known); None for any other error."""
    if isinstance(e, DiskFullError) or not (isinstance(e, OSError) and e.errno in _NO_SPACE):
        return None
    need = f"{size} bytes" if size is not None else "more bytes"
    err = DiskFullError(f"{path}: no space left on the device to write {need} ({free_bytes(path)} bytes free)")
    err.errno = e.errno
    return err


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole (small) file atomically."""
    with atomic_write(path, len(data)) as f:
        f.write(data)


def copy_file(src: str, dst: str) -> None:
    """Copy a small file, possibly across filesystems (e.g. local -> s3), atomically at ``dst``."""
    write_bytes(dst, read_bytes(src))


def move(src: str, dst: str) -> None:
    """Rename within one filesystem (atomic on local/NFS; copy-then-delete on object stores)."""
    fs, s = filesystem(src)
    fs.mv(s, filesystem(dst)[1])


def sibling(path: str, name: str) -> str:
    """``name`` in the directory that holds ``path``."""
    return join(posixpath.dirname(path.rstrip("/")), name)


def move_dir(src: str, dst: str) -> None:
    """Move a directory and everything under it (a rename on local/NFS; copy-then-delete on object
    stores, whose emptied folder markers are removed too)."""
    fs, s = filesystem(src)
    d = filesystem(dst)[1]
    if isinstance(fs, LocalFileSystem):
        fs.mv(s, d, recursive=True)
        return
    base = s.rstrip("/")
    for f in fs.find(base):  # object by object: fsspec's recursive copy trips over a prefix with no marker
        fs.mv(f, d.rstrip("/") + f[len(base):])
    remove(src)


def replace_dir(new: str, dst: str) -> None:
    """Put directory ``new`` at ``dst``: what was at ``dst`` is moved aside first and removed only once
    ``new`` is in place (moved back if that fails), so that ``dst`` is never lost."""
    old = None
    if exists(dst):
        old = sibling(dst, f".{posixpath.basename(dst.rstrip('/'))}.old-{uuid.uuid4().hex[:12]}")
        move_dir(dst, old)
    try:
        move_dir(new, dst)
    except BaseException:
        if old is not None:
            move_dir(old, dst)
        raise
    if old is not None:
        remove(old)


def remove(path: str) -> None:
    """Delete a file, or a directory with everything under it; a missing path is not an error."""
    fs, p = filesystem(path)
    if not fs.exists(p):
        return
    if not fs.isdir(p):
        fs.rm(p)
        return
    fs.rm(p, recursive=True)
    fs.invalidate_cache(p)
    if fs.exists(p):  # emptied folders kept as "dir/" markers (SeaweedFS; console-made markers on S3)
        folders = [d for d, _, _ in fs.walk(p)]
        for d in sorted(folders, key=lambda d: d.rstrip("/").count("/"), reverse=True):  # deepest first
            fs.rm_file(d.rstrip("/") + "/")
