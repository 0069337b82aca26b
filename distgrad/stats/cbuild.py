"""Build helper of distgrad's native CPU kernels (``distgrad/stats/dg_stats.c``,
``distgrad/signals/dg_hist.c``, ``distgrad/signals/dg_adam.c``): the package's C file is compiled
once per process with the system C compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``) at
``-O3`` (with ``-march=native`` when the compiler accepts it; never ``-ffast-math``, which would
break NaN/Inf handling), loaded with ctypes and self-checked by its module; any failure is logged
once and the caller falls back to its torch path."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from typing import Any, Callable, Sequence

log = logging.getLogger("distgrad")


def c_source(package: str, filename: str) -> str:
    """The text of a C file shipped as package data (e.g. ``("distgrad.stats", "dg_stats.c")``).

    Raises:
        FileNotFoundError: the file is missing from the installation.
    """
    return resources.files(package).joinpath(filename).read_text(encoding="utf-8")


def compile_c(source: str, symbol: str, argtypes: Sequence[Any], *, flags: Sequence[str] = (),
              restype: Any = ctypes.c_int) -> Any:
    """Compile C ``source`` into a shared library in a temporary directory (removed afterwards)
    and return its function ``symbol`` as a ctypes function with ``argtypes`` / ``restype``
    (the library stays loaded as long as the function lives).

    ``flags``: extra compiler flags (e.g. ``-pthread``, ``-fno-math-errno``).

    Raises:
        RuntimeError: no C compiler, or it failed with and without ``-march=native`` (its
            messages are included).
        OSError / AttributeError: the library could not be loaded or lacks ``symbol``.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found (set CC)")
    d = tempfile.mkdtemp(prefix="distgrad-kernel-")
    try:
        src, so = os.path.join(d, "kernel.c"), os.path.join(d, "kernel.so")
        with open(src, "w") as f:
            f.write(source)
        errors = []
        # -ffast-math must not be used: it would break NaN/Inf counting and NaN-skipping extrema
        for arch in (["-march=native"], []):
            cmd = [cc, "-O3", *arch, *flags, "-std=gnu99", "-shared", "-fPIC", "-o", so, src]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                break
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
        else:
            raise RuntimeError("; ".join(errors))
        lib = ctypes.CDLL(so)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    fn = getattr(lib, symbol)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    fn._keep = lib  # keep the library loaded as long as the function lives
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

    def __init__(self, build: Callable[[], Any], self_check: Callable[[Any], None], what: str) -> None:
        self.build, self.self_check, self.what = build, self_check, what
        self.fn: Any = None
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        if self.fn is None:
            with self._lock:
                if self.fn is None:
                    self.fn = self._load()
        return self.fn or None

    def _load(self) -> Any:
        try:
            if os.name != "posix":
                raise RuntimeError("only built on POSIX systems")
            fn = self.build()
            self.self_check(fn)
            return fn
        except Exception as e:  # noqa: BLE001 - the caller's torch path is used instead
            log.warning("distgrad: %s unavailable (%s: %s)", self.what, type(e).__name__, e)
            return False
