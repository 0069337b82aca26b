"""The native kernels' build cache (distgrad.stats.cbuild): compiled once per machine and source,
shared by ranks that start together, reused by later processes, with clean fallbacks when there
is no compiler or the cache is not writable.

Compiler invocations are counted with a wrapper script set as ``$CC`` that appends its parent
process id and arguments to a log before running the real compiler."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, launch
from distgrad.stats import cbuild, native

REAL_CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
needs_cc = pytest.mark.skipif(REAL_CC is None, reason="no C compiler on this machine")


def _wrapper(tmp: Path) -> tuple[Path, Path]:
    """A ``$CC`` that logs ``<parent pid> <args>`` per invocation to the returned log path."""
    log, cc = tmp / "cc.log", tmp / "cc-wrapper"
    cc.write_text(f'#!/bin/sh\necho "$PPID $*" >> "{log}"\nexec "{REAL_CC}" "$@"\n')
    cc.chmod(0o755)
    return cc, log


def _compiles(log: Path) -> dict[str, set[str]]:
    """Key directory -> set of parent pids that invoked the compiler for it."""
    out: dict[str, set[str]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, *args = line.split()
        so = args[args.index("-o") + 1]
        out.setdefault(os.path.basename(os.path.dirname(so)), set()).add(pid)
    return out


@needs_cc
def test_two_ranks_compile_once_and_a_second_start_compiles_nothing(tmp_path):
    cc, log = _wrapper(tmp_path)
    cache = tmp_path / "cache"
    env = {"CC": str(cc), cbuild.CACHE_ENV: str(cache)}
    reports = launch("kernel_cache_job.py", tmp_path / "ranks.json", env=env)
    assert len(reports) == 2
    names = ["dg_stats", "dg_hist", "dg_adam"]
    for name in names:
        per_rank = [r[name] for r in reports]
        assert all(p is not None for p in per_rank), per_rank  # available on both ranks
        assert sum(p["built"] for p in per_rank) == 1, per_rank  # one rank compiled, one loaded
        assert per_rank[0]["path"] == per_rank[1]["path"]
        assert Path(per_rank[0]["path"]).parent.parent == cache
    compiles = _compiles(log)
    # three kernels -> three keys, each compiled by exactly one process (a retry without
    # -march=native, if the compiler refused it, would come from the same process)
    assert len(compiles) == 3 and all(len(pids) == 1 for pids in compiles.values()), compiles
    assert {Path(r[n]["path"]).parent.name for r in reports for n in names} == set(compiles)
    before = log.read_text()

    # a second process start (the install-time prebuild command) loads all three, compiles nothing
    p = subprocess.run([sys.executable, "-m", "distgrad.stats", "--prebuild"], cwd=ROOT,
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("(cached), self-check passed") == 3, p.stdout
    assert log.read_text() == before


def test_no_compiler_falls_back_to_torch_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path / "cache"))
    kernel = cbuild.LazyKernel(native._compile_native, native._self_check, "native statistics kernel (test)")
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        assert kernel() is None and kernel() is None
    msgs = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(msgs) == 1 and "no-such-cc" in msgs[0], msgs
    assert not list((tmp_path / "cache").rglob("kernel.so"))


@needs_cc
def test_unwritable_cache_compiles_in_a_temporary_directory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a regular file where the cache's parent should be: makedirs fails
    monkeypatch.setenv(cbuild.CACHE_ENV, str(blocker / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cbuild, "_warned_unwritable", False)
    kernel = cbuild.LazyKernel(native._compile_native, native._self_check, "native statistics kernel (test)")
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        fn = kernel()
        fn2 = cbuild.compile_c(native.c_source(), "dg_stats", [], flags=["-fno-math-errno", "-pthread"])
    assert fn is not None and fn._path is None and fn._built and fn2._path is None
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("is not usable" in m for m in msgs) == 1, msgs
    # the temporary build computes what float64 torch computes
    x = torch.randn(70001, generator=torch.Generator().manual_seed(3))
    row = native._call_native(fn, [x])[0]
    d = x.double()
    assert row[0].item() == d.numel()
    assert abs(row[2].item() - (d * d).sum().item()) <= 1e-6 * (d * d).sum().item()
