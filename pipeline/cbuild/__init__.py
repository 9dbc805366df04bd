"""C kernels compiled on first use with the machine's C compiler and loaded with ctypes (the weight
phase's :mod:`pipeline.quant.numerics.native`, the engine's CPU kernels): one :class:`NativeLibrary` per source.

The shared object is built with ``cc <flags>`` (the flags without ``-march=...`` when the compiler refuses
them) into a cache directory (``DSQUANT_CACHE_DIR``, else ``~/.cache/dsquant``, else the temp directory)
under a name keyed by the source (and the ``*.h`` headers beside it, which it may include), the flags,
the compiler and the CPU's feature flags, so that nodes
sharing a home directory never load a library built for another CPU; it is written under a temporary
name and renamed, so concurrent workers are safe. ctypes releases the GIL during each call.

When there is no compiler, the build fails, or the library's switch variable is ``0``
(``DSQUANT_NATIVE=0`` for every library), :meth:`NativeLibrary.library` returns None and says why in
:meth:`NativeLibrary.status`; callers then use their torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

#: -O3 with the host's vector units; no errno/trap bookkeeping (no effect on results).
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
#: For kernels that must reproduce torch's float arithmetic bit for bit: no a*b+c fused into one FMA.
EXACT_FLAGS = BASE_FLAGS + ("-ffp-contract=off",)


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


#: The vector extensions the kernels choose between (what a benchmark's figures depend on).
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_description() -> dict:
    """This machine for a benchmark's record: the CPU's model name, its CPU count, and which of
    VECTOR_FLAGS it has."""
    name = platform.processor() or "unknown"
    try:
        name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), name)
    except OSError:
        pass
    have = set(cpu_flags().split())
    return {"cpu": name, "cpus": os.cpu_count(), "vector": [f for f in VECTOR_FLAGS if f in have]}


def cache_dir() -> Path:
    for d in (os.environ.get("DSQUANT_CACHE_DIR"), Path.home() / ".cache" / "dsquant",
              Path(tempfile.gettempdir()) / f"dsquant-{getattr(os, 'getuid', lambda: 0)()}"):
        if d is None:
            continue
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return Path(d)
        except OSError:
            continue
    raise OSError("no writable cache directory for the native kernels")


def compiler() -> Optional[str]:
    from shutil import which

    return os.environ.get("CC") or which("cc") or which("gcc") or which("clang")


class NativeLibrary:
    """``source`` (a C file) built with ``flags`` and declared by ``declare(dll)`` (argtypes/restype);
    ``switch``: an extra environment variable that disables this library when ``0`` (besides
    ``DSQUANT_NATIVE``); ``what``: how warnings and :meth:`status` name it."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], flags: Sequence[str] = BASE_FLAGS,
                 switch: Optional[str] = None, what: str = "native kernel"):
        self.source, self.declare, self.flags = Path(source), declare, tuple(flags)
        self.switch, self.what = switch, what
        self._switches = ("DSQUANT_NATIVE",) + ((switch,) if switch else ())
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}

    def _text(self) -> str:
        """The source and every header beside it (in name order): what the build depends on."""
        headers = sorted(self.source.parent.glob("*.h"))
        return "\0".join([self.source.read_text(), *(f"{h.name}\0{h.read_text()}" for h in headers)])

    def _build(self) -> ctypes.CDLL:
        cc = compiler()
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
        errors = []
        for flags in (self.flags, tuple(f for f in self.flags if not f.startswith("-march="))):
            key = hashlib.sha256("\0".join([self._text(), *flags, version, platform.machine(),
                                            cpu_flags()]).encode()).hexdigest()[:16]
            lib = cache_dir() / f"{self.source.stem}-{key}.so"
            if lib.exists():
                break
            tmp = lib.with_name(f".{lib.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            out = subprocess.run([cc, *flags, "-o", str(tmp), str(self.source), "-lm"], capture_output=True,
                                 text=True)
            if out.returncode == 0:
                os.replace(tmp, lib)
                break
            tmp.unlink(missing_ok=True)
            errors.append(f"{cc} {' '.join(flags)} failed on {self.source.name}: {out.stderr.strip()[-300:]}")
        else:
            raise OSError("; ".join(errors))
        dll = ctypes.CDLL(str(lib))
        self.declare(dll)
        self._state["path"] = str(lib)
        return dll

    def _off(self) -> Optional[str]:
        """The switch variable that turns this library off now, or None."""
        for v in self._switches:
            if os.environ.get(v) == "0":
                return v
        return None

    def library(self) -> Optional[ctypes.CDLL]:
        """The compiled library, or None (the reason in :meth:`status`); built once per process. The switch
        variables are read at each call: this is where a caller decides whether to use the library (the
        engine once, when it is built; the weight phase per tensor); a kernel call of a caller that decided
        uses :meth:`loaded`."""
        return None if self._off() else self.loaded()

    def loaded(self) -> Optional[ctypes.CDLL]:
        """The library for a caller that chose to use it when it was built (an engine's module, after its
        kernels were resolved with :meth:`library`): built once, its switches not read again (no
        environment lookup per call); None when it cannot be built."""
        built = self._state.get("lib", self)
        if built is not self:
            return built  # type: ignore[return-value]
        with self._lock:
            if "lib" not in self._state:
                try:
                    self._state["lib"] = self._build()
                except OSError as e:
                    self._state["lib"], self._state["why"] = None, str(e)
                    warnings.warn(f"{self.what} unavailable, using torch ops: {e}")
            return self._state["lib"]  # type: ignore[return-value]

    def set_threads(self, n: int) -> int:
        """Threads of the library's kernel pool (its ``pool_set_threads``: pipeline/engine/native/csrc/pool.h),
        the caller included, 1 .. 256; returns the count set (1 when the library is not built)."""
        dll = self.loaded()
        if dll is None:
            return 1
        if self._state.get("threads") != n:
            dll.pool_set_threads.argtypes, dll.pool_set_threads.restype = [ctypes.c_int], ctypes.c_int
            self._state["threads"] = dll.pool_set_threads(int(n))
        return self._state["threads"]  # type: ignore[return-value]

    def threads(self) -> int:
        """The pool's thread count as last set here (1 before any)."""
        return self._state.get("threads", 1)  # type: ignore[return-value]

    def status(self) -> str:
        """``native (<path>)`` or ``torch ops (<why>)``, for logs, metrics and benchmark records."""
        off = self._off()
        if off:
            return f"torch ops (disabled by {off}=0)"
        return f"native ({self._state['path']})" if self.library() is not None else f"torch ops ({self._state['why']})"

    def reset(self) -> None:
        """Forget the loaded library (tests that flip the switch variables)."""
        with self._lock:
            self._state.clear()
