"""Static checks of the package: ``ruff check distgrad`` (the rule set and line length of
pyproject.toml's ``[tool.ruff]``) and ``mypy`` (``[tool.mypy]``: every module of distgrad/,
annotated) pass, and each configuration is live (a known defect in a copy is reported).
docs/contributing.md ("Checks") gives the same commands to run by hand.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


def _ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # `python -m ruff` runs the pinned ruff of this environment (the `test` extra)
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(PYPROJECT), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_passes_on_distgrad():
    r = _ruff("distgrad")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_reports_defects(tmp_path):
    # the same configuration on a copy of one module with an unused import, an undefined name and
    # an over-long line: each is reported under its own code
    src = (REPO / "distgrad" / "_version.py").read_text()
    bad = tmp_path / "distgrad" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(src + "import os\n\n\ndef f():\n    return undefined_name  # " + "x" * 120 + "\n")
    r = _ruff("--output-format", "concise", "distgrad", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    found = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("distgrad/bad.py:")}
    assert found == {"F401", "F821", "E501"}, r.stdout


def _mypy(cache: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(cache),
                           "--config-file", str(PYPROJECT)],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy-cache")


def test_mypy_passes_on_distgrad(mypy_cache):
    r = _mypy(mypy_cache)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_reports_type_errors(tmp_path, mypy_cache):
    # a copy of the package where a checked module assigns a str to an int and an untyped function
    # calls a method that does not exist: the assignment, the missing annotations
    # (disallow_untyped_defs) and the call inside the untyped body (check_untyped_defs) are reported
    shutil.copytree(REPO / "distgrad", tmp_path / "distgrad", ignore=shutil.ignore_patterns("__pycache__"))
    mod = tmp_path / "distgrad" / "_version.py"
    mod.write_text(mod.read_text() + "\n_n: int = 'one'\n\n\ndef _f():\n    return 'x'.no_such_method()\n")
    r = _mypy(mypy_cache, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 3 and all(e.startswith("distgrad/_version.py:") for e in errors), r.stdout
    assert "[assignment]" in errors[0] and "[no-untyped-def]" in errors[1] and "[attr-defined]" in errors[2], r.stdout
