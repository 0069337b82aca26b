"""Build helper of distgrad's native CPU kernels (``distgrad/stats/dg_stats.c``,
``distgrad/signals/dg_hist.c``, ``distgrad/signals/dg_adam.c``).

A kernel is compiled once per machine and source, not once per process: the shared library is
kept in a per-user cache directory (:func:`cache_dir`: ``$DISTGRAD_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/distgrad/kernels``, else ``~/.cache/distgrad/kernels``), in a sub-directory
named by a hash of the C source, the compiler named by ``$CC`` (default ``cc``), the flags and
the CPU (model and feature flags, since the library is built with ``-march=native``). Ranks that
start together take a file lock (``fcntl.flock``) on that key: the first compiles into a
temporary file and renames it into place atomically, the others wait and load the same file; a
later process start loads it without compiling (or locking). The compiler is the system C
compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``) at ``-O3`` (with ``-march=native`` when
the compiler accepts it; never ``-ffast-math``, which would break NaN/Inf handling); the
library is loaded with ctypes and self-checked by its module every time.

Fallbacks: where the cache directory cannot be created or written, the kernel is compiled in a
temporary directory of this process as before (one log line per process); where there is no
compiler and nothing cached, or the self-check fails, one warning is logged and the caller uses
its torch path. ``python -m distgrad.stats --prebuild`` fills the cache (e.g. at install time,
or once per node image), so that nodes without a compiler load the prebuilt libraries.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, Literal, Protocol

log = logging.getLogger("distgrad")

#: environment variable that relocates the kernel cache (a directory; created when missing)
CACHE_ENV = "DISTGRAD_KERNEL_CACHE"
#: bumped when the cache layout or the build command changes (part of every key)
_CACHE_VERSION = 1
#: compiler flags of every kernel (``-march=native`` is tried first, then dropped)
_BASE_FLAGS = ("-O3", "-std=gnu99", "-shared", "-fPIC")
_warned_unwritable = False
_warn_lock = threading.Lock()


def c_source(package: str, filename: str) -> str:
    """The text of a C file shipped as package data (e.g. ``("distgrad.stats", "dg_stats.c")``).

    Raises:
        FileNotFoundError: the file is missing from the installation.
    """
    return resources.files(package).joinpath(filename).read_text(encoding="utf-8")


def cache_dir() -> str:
    """The kernel cache directory (may not exist yet): ``$DISTGRAD_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/distgrad/kernels``, else ``~/.cache/distgrad/kernels``."""
    d = os.environ.get(CACHE_ENV)
    if d:
        return os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "distgrad", "kernels")


def compiler_command() -> list[str]:
    """The compiler as named by the user: ``shlex.split($CC)``, else ``["cc"]`` (the name that
    enters the cache key; :func:`_resolve_compiler` finds the binary)."""
    cc = os.environ.get("CC", "").strip()
    return shlex.split(cc) if cc else ["cc"]


def _resolve_compiler() -> list[str]:
    """The compiler command to run: ``$CC`` (split like a shell would), else the first of ``cc``,
    ``gcc``, ``clang`` on ``PATH``.

    Raises:
        RuntimeError: the compiler named by ``$CC`` is not found, or none of the defaults is.
    """
    cc = os.environ.get("CC", "").strip()
    if cc:
        cmd = shlex.split(cc)
        exe = shutil.which(cmd[0])
        if not exe:
            raise RuntimeError(f"C compiler {cmd[0]!r} (from $CC) not found")
        return [exe, *cmd[1:]]
    for name in ("cc", "gcc", "clang"):
        exe = shutil.which(name)
        if exe:
            return [exe]
    raise RuntimeError("no C compiler found (set CC)")


def _cpu_fingerprint() -> str:
    """Machine architecture, CPU model and feature flags (Linux ``/proc/cpuinfo``; elsewhere
    ``platform.processor()``): a library built with ``-march=native`` is only reused on a CPU
    with the same fingerprint (a cache shared over NFS by different node types stays safe)."""
    parts = [sys.platform, platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            seen: set[str] = set()
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("model name", "flags", "features", "cpu part", "cpu implementer",
                           "isa", "cpu model") and key not in seen:
                    seen.add(key)
                    parts.append(line.strip())
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def cache_key(source: str, flags: Sequence[str] = ()) -> str:
    """The cache sub-directory name of a kernel: the first 24 hex digits of the SHA-256 of the
    source, the compiler as named (:func:`compiler_command`), ``flags`` and the CPU fingerprint."""
    blob = json.dumps([_CACHE_VERSION, source, compiler_command(), list(_BASE_FLAGS), list(flags),
                       _cpu_fingerprint()])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _compile_into(source: str, so: str, work: str, flags: Sequence[str]) -> list[str]:
    """Compile ``source`` into the shared library ``so`` (written in place), using ``work`` for the
    source file; returns the command that succeeded.

    Raises:
        RuntimeError: no compiler, or it failed with and without ``-march=native``.
    """
    cc = _resolve_compiler()
    src = os.path.join(work, f"kernel-{os.getpid()}.c")
    with open(src, "w") as f:
        f.write(source)
    errors = []
    try:
        # -ffast-math must not be used: it would break NaN/Inf counting and NaN-skipping extrema
        for arch in (["-march=native"], []):
            cmd = [*cc, _BASE_FLAGS[0], *arch, *flags, *_BASE_FLAGS[1:], "-o", so, src]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                return cmd
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
    finally:
        try:
            os.unlink(src)
        except OSError:
            pass
    raise RuntimeError("; ".join(errors))


def _build_cached(source: str, flags: Sequence[str]) -> tuple[str, bool]:
    """The cached library of ``source``, compiled under the key's file lock when missing.
    Returns ``(path, built)``: ``built`` is True when this process compiled it.

    Raises:
        OSError: the cache directory cannot be created, locked or written.
        RuntimeError: as :func:`_compile_into`.
    """
    import fcntl

    key_dir = os.path.join(cache_dir(), cache_key(source, flags))
    so = os.path.join(key_dir, "kernel.so")
    if os.path.exists(so):  # complete: only ever renamed into place
        return so, False
    os.makedirs(key_dir, exist_ok=True)
    with open(os.path.join(key_dir, "lock"), "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if os.path.exists(so):  # another rank built it while this one waited
            return so, False
        tmp = os.path.join(key_dir, f"kernel.so.tmp-{os.getpid()}")
        try:
            cmd = _compile_into(source, tmp, key_dir, flags)
            with open(os.path.join(key_dir, "build.json"), "w") as f:
                json.dump({"command": cmd, "source_sha256": hashlib.sha256(source.encode()).hexdigest()}, f)
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return so, True


class NativeFn(Protocol):
    """A ctypes function of :func:`compile_c`: called with Python ints (pointers, sizes) for its
    ``argtypes``, it returns its ``restype``'s value (an int for the default ``c_int``)."""

    _path: str | None  #: the library's path in the kernel cache (None: a temporary build)
    _built: bool  #: whether this process compiled it

    def __call__(self, *args: Any) -> Any: ...


def compile_c(source: str, symbol: str, argtypes: Sequence[Any], *, flags: Sequence[str] = (),
              restype: Any = ctypes.c_int) -> NativeFn:
    """The function ``symbol`` of C ``source`` as a ctypes function with ``argtypes`` /
    ``restype``, compiled once per machine into the kernel cache (see the module docstring) or,
    where the cache is not writable, into a temporary directory of this process (logged once).
    The library stays loaded as long as the function lives; the function's attribute ``_path``
    is the library's path (None for a temporary build) and ``_built`` says whether this process
    compiled it.

    ``flags``: extra compiler flags (e.g. ``-pthread``, ``-fno-math-errno``); part of the key.

    Raises:
        RuntimeError: nothing cached and no C compiler, or it failed with and without
            ``-march=native`` (its messages are included).
        OSError / AttributeError: the library could not be loaded or lacks ``symbol``.
    """
    global _warned_unwritable
    try:
        path, built = _build_cached(source, flags)
        lib = ctypes.CDLL(path)
    except OSError as e:
        with _warn_lock:
            if not _warned_unwritable:
                _warned_unwritable = True
                log.warning("distgrad: kernel cache %s is not usable (%s: %s); native kernels are "
                            "compiled in a temporary directory by this process (set %s to a "
                            "writable directory)", cache_dir(), type(e).__name__, e, CACHE_ENV)
        d = tempfile.mkdtemp(prefix="distgrad-kernel-")
        try:
            so = os.path.join(d, "kernel.so")
            _compile_into(source, so, d, flags)
            lib = ctypes.CDLL(so)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        path, built = None, True
    fn = getattr(lib, symbol)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    fn._keep = lib  # keep the library loaded as long as the function lives
    fn._path, fn._built = path, built
    return fn


class LazyKernel:
    """A native kernel built and self-checked on first use, once per process.

    ``kernel()`` returns the ctypes function, or None when it is unavailable (non-POSIX system,
    no compiler, a failed self-check: one warning ``distgrad: <what> unavailable, ...`` is
    logged and the caller's torch path is used from then on). Thread-safe; the attribute
    :attr:`fn` holds None before trying, the function, or False once it proved unavailable
    (tests set it to False to force the torch path).

    Args:
        build: compiles and loads the kernel (e.g. with :func:`compile_c`); may raise.
        self_check: raises if the loaded function disagrees with a reference.
        what: the kernel's name in the warning, e.g. ``"native histogram kernel (...)"``.
    """

    def __init__(self, build: Callable[[], NativeFn], self_check: Callable[[NativeFn], None], what: str) -> None:
        self.build, self.self_check, self.what = build, self_check, what
        self.fn: NativeFn | Literal[False] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> NativeFn | None:
        if self.fn is None:
            with self._lock:
                if self.fn is None:
                    self.fn = self._load()
        return self.fn or None

    def _load(self) -> NativeFn | Literal[False]:
        try:
            if os.name != "posix":
                raise RuntimeError("only built on POSIX systems")
            fn = self.build()
            self.self_check(fn)
            return fn
        except Exception as e:  # noqa: BLE001 - the caller's torch path is used instead
            log.warning("distgrad: %s unavailable (%s: %s)", self.what, type(e).__name__, e)
            return False
