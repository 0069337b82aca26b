"""Every code block of README.md and docs/*.md that a user copies is run or checked
(tests/docs_blocks.py extracts them with their doctest markers):

* python blocks run in one world-size-1 launch (tests/dist/docs_cases.py), each in its context,
  and what each claims is checked against a reference computed another way there (float64
  losses and norms, the saved state, the loop's own counts); blocks marked ``skip`` are listed
  here, must compile, and must cite a test file that makes the same distgrad calls;
* yaml blocks parse, and those that are distgrad config sections validate;
* shell blocks name scripts that exist, flags those scripts (or the ``distgrad`` CLI) define,
  extras that pyproject.toml declares and console scripts the environment installs."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import yaml

from tests.docs_blocks import ROOT, blocks
from tests.helpers import launch

#: python blocks not run here (each cites the test that runs the same calls); update when adding one
EXPECTED_SKIPS = 2
ALL = blocks()


def test_python_blocks_run_and_match_their_references(tmp_path):
    results = launch("docs_cases.py", tmp_path / "docs.json", nproc=1)
    runnable = [b.where for b in ALL if b.lang == "python" and "skip" not in b.marker]
    assert [r["where"] for r in results] == runnable  # none silently left out
    failed = {r["where"]: r["error"] for r in results if not r["ok"]}
    assert not failed, "\n\n".join(f"{w}:\n{e}" for w, e in failed.items())
    for r in results:
        print(f"{r['where']} [{r['context']}] {r['seconds']} s: {r['facts']}")


def test_python_blocks_not_run_are_listed_compile_and_cite_a_test():
    skipped = [b for b in ALL if b.lang == "python" and "skip" in b.marker]
    for b in skipped:
        print(f"not run: {b.where}: {b.marker['skip']}")
    assert len(skipped) == EXPECTED_SKIPS, [b.where for b in skipped]
    for b in (b for b in ALL if b.lang == "python"):
        compile(b.code, b.where, "exec")  # valid Python, no `f(..., key=...)` placeholders
    for b in skipped:
        cited = re.findall(r"tests/\S+\.py", b.marker["skip"])
        assert cited and all((ROOT / c).is_file() for c in cited), (b.where, cited)
        text = "".join((ROOT / c).read_text() for c in cited)
        imports = [(n.module, a.name) for n in ast.walk(ast.parse(b.code)) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("distgrad") for a in n.names]
        assert imports and all(name in text for _, name in imports), (b.where, imports, cited)
        for module, name in imports:  # the import still resolves (without importing the framework)
            assert name in _defined(module), f"{b.where}: {name} is not defined in {module}"


def _defined(module: str) -> set[str]:
    """Top-level names a distgrad module defines (functions, classes, assignments, imports),
    read from its source without importing it."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    assert path.is_file(), f"no module {module}"
    out = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            out |= {t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {a.asname or a.name.split(".")[0] for a in n.names}
    return out


def test_yaml_blocks_parse_and_config_sections_validate():
    from distgrad.config import DistgradConfig

    sections = set(DistgradConfig.model_fields)
    ymls = [b for b in ALL if b.lang in ("yaml", "yml")]
    assert ymls
    for b in ymls:
        data = yaml.safe_load(b.code)
        assert isinstance(data, dict), b.where
        if set(data) <= sections:
            DistgradConfig.load(data)  # raises ConfigError naming a bad key or value


def _options(script: Path) -> set[str]:
    """The option strings of every ``add_argument`` / ``add_parser`` call in a Python script."""
    out = set()
    for n in ast.walk(ast.parse(script.read_text())):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("add_argument", "add_parser"):
            out |= {a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def _commands(code: str) -> list[list[str]]:
    lines = code.replace("\\\n", " ").splitlines()
    cmds = []
    for line in lines:
        for part in re.split(r"&&|;", line):
            toks = shlex.split(part, comments=True)
            while toks and re.fullmatch(r"[A-Z_]+=\S*", toks[0]):
                toks.pop(0)  # VAR=value prefixes
            if toks:
                cmds.append(toks)
    return cmds


def _flags(toks: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in toks if t.startswith("-") and not re.fullmatch(r"-\d.*", t)]


def test_shell_blocks_name_existing_scripts_flags_and_extras():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    venv_bin = Path(sys.executable).parent
    cli = _options(ROOT / "distgrad" / "cli.py")
    checked = 0
    for b in (b for b in ALL if b.lang in ("bash", "sh", "console")):
        for toks in _commands(b.code):
            where = f"{b.where}: {' '.join(toks)}"
            prog = toks[0]
            if prog.startswith(".venv/bin/"):
                assert (venv_bin / Path(prog).name).exists(), where
            name = Path(prog).name
            if name == "pip":
                for spec in toks[2:]:
                    m = re.fullmatch(r"distgrad(?:\[(.*)\])?", spec)
                    assert m, where
                    assert set(filter(None, (m.group(1) or "").split(","))) <= extras, where
            elif name == "distgrad":
                assert toks[1] in cli, where  # the subcommand
                assert set(_flags(toks[2:])) <= cli, where
            elif name == "bash":
                script = ROOT / toks[1]
                assert script.is_file(), where
                text = "\n".join(ln for ln in script.read_text().splitlines() if not ln.lstrip().startswith("#"))
                known = set(re.findall(r"--[\w-]+", text))
                for py in set(re.findall(r"launch/\w+\.py", text)):  # extra arguments passed on
                    known |= _options(ROOT / py)
                assert set(_flags(toks[2:])) <= known, where
            elif name in ("ruff", "mypy"):  # the checks of docs/contributing.md: pinned in the test extra
                assert (venv_bin / name).exists(), where
                test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
                assert any(d.startswith(f"{name}==") for d in test_extra), where
            elif name.startswith("python") and toks[1:2] == ["-m"]:  # python -m MODULE ...
                assert importlib.util.find_spec(toks[2]) is not None, where
            else:  # a launcher or python running a script: the script's flags after it
                scripts = [i for i, t in enumerate(toks) if t.endswith(".py")]
                assert scripts, where
                script = ROOT / toks[scripts[0]]
                assert script.is_file(), where
                assert set(_flags(toks[scripts[0] + 1:])) <= _options(script), where
            checked += 1
    assert checked >= 15, checked
