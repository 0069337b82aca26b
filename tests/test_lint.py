"""Static checks of the package: ``ruff check distgrad`` (the rule set and line length of
pyproject.toml's ``[tool.ruff]``) passes, and the configuration is live (a known defect in a copy
is reported). docs/contributing.md ("Checks") gives the same commands to run by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
