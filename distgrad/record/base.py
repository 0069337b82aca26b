"""The base of the record's typed parts (:class:`_Part`), in a module of its own so that the parts
(``distgrad/record/<part>.py``) import it without importing the record that collects them."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


class _Part:
    """Base of the record's typed parts: a flat JSON form, nested parts by ``_nested``."""

    #: field name -> part class of its value (a list of parts when the value is a list)
    _nested: ClassVar[dict[str, type]] = {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (nested parts as dicts); inverse of :meth:`from_dict`."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        """Inverse of :meth:`to_dict`; unknown keys are ignored, missing ones raise TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kw = {}
        for k, v in d.items():
            if k not in names:
                continue
            t = cls._nested.get(k)
            if t is not None and v is not None:
                v = [t.from_dict(x) for x in v] if isinstance(v, list) else t.from_dict(v)
            kw[k] = v
        return cls(**kw)
