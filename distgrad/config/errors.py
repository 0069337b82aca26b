"""``ConfigError`` and the translation of pydantic's validation errors into messages that name
the key as the user writes it (``distgrad config: 'spikes.window' must be >= 2 (got 1)``)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A distgrad configuration key is unknown or has a bad value. The message names the key
    (as a dotted path, ``'spikes.window'``) and says what would be accepted."""


def _bound(ctx: Mapping[str, Any], key: str) -> str:
    v = ctx.get(key)
    return repr(v) if isinstance(v, str) else f"{v:g}" if isinstance(v, float) else str(v)


_WHY = {
    "greater_than_equal": lambda c: f"must be >= {_bound(c, 'ge')}",
    "greater_than": lambda c: f"must be > {_bound(c, 'gt')}",
    "less_than_equal": lambda c: f"must be <= {_bound(c, 'le')}",
    "less_than": lambda c: f"must be < {_bound(c, 'lt')}",
    "int_type": lambda c: "must be an integer",
    "bool_type": lambda c: "must be true or false",
    "float_type": lambda c: "must be a finite number",
    "finite_number": lambda c: "must be a finite number",
    "string_type": lambda c: "must be a string (null to leave it unset)",
    "string_too_short": lambda c: "must not be empty",
    "list_type": lambda c: "must be a list",
    "model_type": lambda c: "must be a mapping of keys to values",
    "dict_type": lambda c: "must be a mapping of keys to values",
    "missing": lambda c: "is required",
    "literal_error": lambda c: f"must be {c.get('expected')}",
}


def _range(section: Any, field: str) -> str | None:
    """``"must be in 0..65535"`` / ``"must be in (0, 1)"`` for a field bounded on both sides."""
    info = getattr(section, "model_fields", {}).get(field) if section is not None else None
    if info is None:
        return None
    lo = hi = None
    for m in info.metadata:
        for k in ("ge", "gt"):
            if getattr(m, k, None) is not None:
                lo = (k, getattr(m, k))
        for k in ("le", "lt"):
            if getattr(m, k, None) is not None:
                hi = (k, getattr(m, k))
    if lo is None or hi is None:
        return None
    if lo[0] == "ge" and hi[0] == "le" and isinstance(lo[1], int) and isinstance(hi[1], int):
        return f"must be in {lo[1]}..{hi[1]}"
    return f"must be in {'[' if lo[0] == 'ge' else '('}{lo[1]:g}, {hi[1]:g}{']' if hi[0] == 'le' else ')'}"


def _section_at(root: Any, loc: tuple) -> Any:
    """The pydantic model class that holds the field at ``loc`` (``None`` if unknown)."""
    model = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        info = getattr(model, "model_fields", {}).get(part)
        if info is None:
            return None
        ann = info.annotation
        inner = getattr(ann, "__args__", None)
        if inner and not hasattr(ann, "model_fields"):  # list[Rule], Optional[...]
            ann = next((a for a in _flatten(inner) if hasattr(a, "model_fields")), ann)
        model = ann
    return model


def _flatten(args: tuple) -> list:
    out = []
    for a in args:
        out.append(a)
        out.extend(_flatten(getattr(a, "__args__", ()) or ()))
        origin = getattr(a, "__origin__", None)
        if origin is not None:
            out.append(origin)
    return out


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(exc: Any, *, prefix: str = "", root: Any = None) -> str:
    """Message for a pydantic ``ValidationError`` raised while building a configuration.

    Args:
        exc: the ``pydantic.ValidationError``.
        prefix: dotted path of the model that was validated (``"spikes"`` for a section built on
            its own, ``""`` for the whole configuration).
        root: the model class that was validated (for ranges and the list of known keys).

    Returns:
        One line per error, each ``distgrad config: '<key>' <why> (got <value>)``.
    """
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        typ, ctx = err["type"], err.get("ctx") or {}
        section = _section_at(root, loc) if root is not None else None
        cause = ctx.get("error")
        if typ == "value_error" and cause is not None and getattr(cause, "field", None):  # sections.SettingError
            loc = (*loc, cause.field)
            why, got = cause.why, cause.value
        elif typ == "extra_forbidden":
            known = sorted(getattr(section, "model_fields", {})) if section is not None else []
            key = _dotted((prefix,) + loc if prefix else loc)
            near = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            where = f"keys of {_dotted(loc[:-1])!r}" if loc[:-1] else "known keys"
            lines.append(f"distgrad config: unknown key {key!r}{hint} ({where} are {known})")
            continue
        else:
            why = None
            if typ in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
                why = _range(section, str(loc[-1])) if loc else None
            if why is None:
                why = _WHY[typ](ctx) if typ in _WHY else (
                    str(cause) if typ == "value_error" and cause is not None else err["msg"])
            got = err.get("input")
        key = _dotted((prefix,) + loc if prefix else loc) or prefix or "config"
        lines.append(f"distgrad config: {key!r} {why} (got {got!r})")
    return "\n".join(lines)
