"""Render ``configs/distgrad.yaml`` and ``docs/configuration.md`` from the model, so that the
documented defaults cannot drift from the code (a test compares the committed files).

    python -m distgrad.config --yaml       # print the YAML
    python -m distgrad.config --markdown   # print the documentation page
    python -m distgrad.config --write      # rewrite both files in the repository
"""

from __future__ import annotations

import textwrap
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from distgrad.config import DistgradConfig

ROOT = Path(__file__).resolve().parents[2]
YAML_PATH = ROOT / "configs" / "distgrad.yaml"
DOC_PATH = ROOT / "docs" / "configuration.md"
_GENERATED = "generated from distgrad/config/sections.py by `python -m distgrad.config --write`; do not edit"


def _is_section(info: FieldInfo) -> bool:
    return isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)


def _default(info: FieldInfo) -> Any:
    return info.get_default(call_default_factory=True)


def _scalar(v: Any) -> str:
    import yaml

    return yaml.safe_dump([v], default_flow_style=True, width=1 << 16).strip()[1:-1]


def _type(info: FieldInfo) -> str:
    ann = info.annotation
    if typing.get_origin(ann) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(ann)))
    args = typing.get_args(ann)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), ann) if args else ann
    names: dict[Any, str] = {bool: "bool", int: "integer", float: "number", str: "string"}
    name = names.get(base, None)
    if name is None:
        name = "list of rules" if typing.get_origin(ann) is list else getattr(base, "__name__", str(base))
    bounds = []
    for m in info.metadata:
        for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "non-empty")):
            v = getattr(m, k, None)
            if v is not None:
                bounds.append(op if k == "min_length" else f"{op} {v:g}" if isinstance(v, float) else f"{op} {v}")
    text = name + (f", {', '.join(bounds)}" if bounds else "")
    return text + (" or null" if optional else "")


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, width=100, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                         break_on_hyphens=False, break_long_words=False)


def render_yaml() -> str:
    """The default configuration as commented YAML (``configs/distgrad.yaml``)."""
    lines = [
        "# distgrad configuration: every key, with its default. All keys are optional.",
        f"# {_GENERATED}.",
        "# Load with distgrad.instrument(engine, \"configs/distgrad.yaml\"), or put the same keys in a",
        "# \"distgrad\" section of the DeepSpeed config JSON. Unknown keys and bad values are errors;",
        "# documentation: docs/configuration.md.",
    ]

    def model(cls: type[BaseModel], indent: str) -> None:
        for i, (name, info) in enumerate(cls.model_fields.items()):
            if i or not indent:
                lines.append("")
            if _is_section(info):
                lines.extend(_comment((info.annotation.__doc__ or "").split("\n\n")[0].replace("\n", " "), indent))
                lines.append(f"{indent}{name}:")
                model(typing.cast(type[BaseModel], info.annotation), indent + "  ")
                continue
            lines.extend(_comment(info.description or "", indent))
            if info.examples:
                lines.append(f"{indent}# e.g. {name}: {_scalar(info.examples[0])}")
            lines.append(f"{indent}{name}: {_scalar(_default(info))}")

    model(DistgradConfig, "")
    return "\n".join(lines) + "\n"


def render_markdown() -> str:
    """The documentation page (``docs/configuration.md``)."""
    out = [
        "# Configuration",
        "",
        f"<!-- {_GENERATED} -->",
        "",
        "`distgrad.instrument(engine, config, **overrides)` takes a `DistgradConfig`, a dict, a YAML",
        "file ([configs/distgrad.yaml](../configs/distgrad.yaml) lists every key with its default),",
        "a DeepSpeed JSON config whose `\"distgrad\"` section is used, or None (with a DeepSpeed engine",
        "whose own config has a `\"distgrad\"` section, that section is used). Keyword overrides apply",
        "on top, a section as a dict merged key by key (`exporter={\"port\": 0}`), or a dotted key",
        "(`**{\"exporter.port\": 0}`; `launch/train.py --set exporter.port=0`).",
        "",
        "Every value is checked once, when the configuration is built at `instrument()` time: an",
        "unknown key or a bad value raises `distgrad.ConfigError` (a `ValueError`) naming the key, e.g.",
        "`distgrad config: 'spikes.window' must be >= 2 (got 1)`. Types are strict: `\"5\"` is not an",
        "integer and `1` is not `true`; numbers must be finite; paths may not be empty (null leaves",
        "them unset).",
        "",
    ]
    sections: list[tuple[str, FieldInfo]] = []
    top: list[tuple[str, FieldInfo]] = []
    for name, info in DistgradConfig.model_fields.items():
        (sections if _is_section(info) else top).append((name, info))

    def table(prefix: str, cls: type[BaseModel]) -> None:
        rows = []
        nested: list[tuple[str, type[BaseModel]]] = []
        for name, info in cls.model_fields.items():
            if _is_section(info):
                nested.append((f"{prefix}.{name}", typing.cast(type[BaseModel], info.annotation)))
                continue
            desc = (info.description or "").replace("|", "\\|")
            if info.examples:
                desc += f" Example: `{_scalar(info.examples[0])}`."
            rows.append(f"| `{prefix}.{name}` | {_type(info)} | `{_scalar(_default(info))}` | {desc} |"
                        if prefix else f"| `{name}` | {_type(info)} | `{_scalar(_default(info))}` | {desc} |")
        if rows:
            out.extend(["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""])
        for path, sub in nested:
            out.extend([f"### `{path}`", "", (sub.__doc__ or "").strip(), ""])
            table(path, sub)

    out.extend(["## Top level", ""])
    rows = [(n, i) for n, i in top]
    out.extend(["| key | type | default | meaning |", "|---|---|---|---|"])
    out.extend(f"| `{n}` | {_type(i)} | `{_scalar(_default(i))}` | {i.description} |" for n, i in rows)
    out.append("")
    for name, info in sections:
        out.extend([f"## `{name}`", "", (info.annotation.__doc__ or "").strip(), ""])
        table(name, typing.cast(type[BaseModel], info.annotation))
    out.extend([
        "## Naming rules example",
        "",
        "```yaml",
        "naming:",
        "  rules:",
        "    - {pattern: '^encoder\\.stages\\.(\\d+)\\.', layer: '\\1', module_kind: stage}",
        "    - ['^adapter\\.', 'other', adapter]   # the same as a [pattern, layer, module_kind] list",
        "```",
        "",
        "A parameter `encoder.stages.3.conv.weight` is then exported under",
        "`distgrad_layer_grad_norm{layer=\"3\"}` and `distgrad_module_kind_grad_norm{module_kind=\"stage\"}`.",
        "",
    ])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m distgrad.config [--yaml | --markdown | --write | --check]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m distgrad.config", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--yaml", action="store_true", help="print configs/distgrad.yaml")
    g.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    g.add_argument("--write", action="store_true", help="rewrite both files in the repository")
    g.add_argument("--check", action="store_true", help="exit 1 if a committed file is out of date")
    a = ap.parse_args(argv)
    if a.yaml:
        print(render_yaml(), end="")
    elif a.markdown:
        print(render_markdown(), end="")
    else:
        stale = [p for p, text in ((YAML_PATH, render_yaml()), (DOC_PATH, render_markdown()))
                 if not p.is_file() or p.read_text() != text]
        if a.write:
            for p, text in ((YAML_PATH, render_yaml()), (DOC_PATH, render_markdown())):
                p.write_text(text)
        elif stale:
            print("out of date (run python -m distgrad.config --write):", *map(str, stale))
            return 1
    return 0
