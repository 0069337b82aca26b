"""The base of the record's typed parts (:class:`_Part`), in a module of its own so that the parts
(``distgrad/record/<part>.py``) import it without importing the record that collects them.

A part is a dataclass; its JSON form is :func:`dataclasses.asdict` and it is read back by
pydantic (:func:`adapter`) from the dataclass's own annotations, nested parts included: a new
part needs no registration. A plug-in's part (a signal's nested ``Part``, see
:mod:`distgrad.signals`) is registered by :func:`register_part` when its class is defined and
becomes an attribute of :class:`~distgrad.record.StepRecord` (None when absent) and a key of its
JSON form."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any


@functools.cache
def adapter(tp: Any) -> Any:
    """pydantic's validator (``TypeAdapter``) of a type annotation: a part dataclass,
    ``Part | None``, ``list[Part] | None``...; built once per annotation, on first use (when
    every part module is imported, so that string annotations resolve)."""
    from pydantic import TypeAdapter

    return TypeAdapter(tp)


class _Part:
    """Base of the record's typed parts (dataclasses): JSON form by :func:`dataclasses.asdict`,
    read back by pydantic from the dataclass's own annotations (nested parts included)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (nested parts as dicts); inverse of :meth:`from_dict`."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        """Inverse of :meth:`to_dict`, validated against the field annotations by pydantic
        (nested parts built from their dicts; unknown keys ignored; numbers converted where
        lossless, e.g. ``3.0`` to an ``int`` field, numpy scalars to Python ones).

        Raises:
            pydantic.ValidationError (a ValueError): a missing field or a value of the wrong
                type (each named).
        """
        return adapter(typing.cast(Any, cls)).validate_python(d)


#: ``StepRecord`` attribute -> part class, for the parts declared by plug-ins (a signal's nested
#: ``Part``), in registration order (the order of their keys in the JSON form, after the fields)
PLUGIN_PARTS: dict[str, type[_Part]] = {}


def register_part(name: str, cls: type[_Part]) -> None:
    """Make ``cls`` (a dataclass on :class:`_Part`) the record part ``StepRecord.<name>``.

    Raises:
        ValueError: ``name`` already registered for another class, or ``cls`` not a ``_Part``
            dataclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, _Part) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"record part {name!r}: {cls!r} is not a dataclass on distgrad.record.base._Part")
    if PLUGIN_PARTS.get(name, cls) is not cls:
        raise ValueError(f"record part {name!r} declared twice")
    PLUGIN_PARTS[name] = cls
