"""Session fixtures shared by test modules: the results of the multi-rank drivers that several
modules check, each launched once per session. Plain helpers (paths, ports, the launcher):
:mod:`tests.helpers`."""

from __future__ import annotations

import pytest

from tests.helpers import launch


@pytest.fixture(scope="session")
def ds_results(tmp_path_factory):
    """All DeepSpeed reference cases, run once in one 2-rank launch."""
    out = tmp_path_factory.mktemp("ds") / "ds_cases.json"
    return launch("ds_cases.py", out)


@pytest.fixture(scope="session")
def torch_results(tmp_path_factory):
    """All DDP / FSDP1 / FSDP2 reference cases, run once in one 2-rank launch."""
    out = tmp_path_factory.mktemp("torch") / "torch_cases.json"
    return launch("torch_cases.py", out)


@pytest.fixture(scope="session")
def diag_results(tmp_path_factory):
    """The diagnostics cases (faults, fp16 overflow, bf16), one 2-rank launch."""
    out = tmp_path_factory.mktemp("diag") / "diag.json"
    return launch("diag_cases.py", out)
