"""The contract of a per-step plug-in (a packed signal, :mod:`distgrad.signals`, or a host-side
diagnostic, :mod:`distgrad.diagnostics`): what it declares next to its code, registered when its
class is defined.

A subclass of :class:`Declares` may set

* ``Config``: its configuration section, a nested :class:`~distgrad.config.sections.Section`
  subclass with ``section_key``: :class:`~distgrad.config.DistgradConfig` gets the field
  ``section_key`` (and the generated ``docs/configuration.md`` / ``configs/distgrad.yaml`` its
  section), after the built-in sections;
* ``Part``: its record part, a nested dataclass on :class:`~distgrad.record.base._Part`: the
  :class:`~distgrad.record.StepRecord` attribute ``part_name`` (default ``section_key``), None
  when unset, written to JSON Lines and read back by pydantic;
* ``METRICS``: its Prometheus metrics (:class:`~distgrad.export.metrics.Metric` entries whose
  ``when`` it declares with :func:`distgrad.export.metrics.condition`), added to the catalogue
  (``docs/metrics.md``, the series budget, the catalogue test), and :meth:`Declares.samples`,
  its part -> ``{metric name: value}``, which the Prometheus sink serves.

This module sits below the plug-ins and imports only the three registries
(:func:`~distgrad.config.sections.register_section`,
:func:`~distgrad.record.base.register_part`, :func:`~distgrad.export.metrics.register`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from distgrad.config.sections import Section, register_section
from distgrad.export import metrics as _metrics
from distgrad.record.base import _Part, register_part

__all__ = ["Declares"]


class Declares:
    """Mixin: a plug-in's configuration section, record part and metrics, declared on its class
    (see the module docstring). Each is optional; only what a class declares itself (in its own
    body) is registered, so subclasses do not register their parents' twice."""

    #: its configuration section: a nested :class:`~distgrad.config.sections.Section` subclass
    #: with ``section_key`` (the config key), or None
    Config: ClassVar[type[Section] | None] = None
    #: its record part: a nested dataclass on :class:`~distgrad.record.base._Part`, or None
    Part: ClassVar[type[_Part] | None] = None
    #: the :class:`~distgrad.record.StepRecord` attribute holding :attr:`Part` (default: the
    #: config's ``section_key``)
    part_name: ClassVar[str | None] = None
    #: its Prometheus metrics (:class:`~distgrad.export.metrics.Metric` entries; their ``when``
    #: declared with :func:`distgrad.export.metrics.condition`)
    METRICS: ClassVar[tuple[_metrics.Metric, ...]] = ()
    #: True: the Prometheus sink keeps serving the last samples of :attr:`Part` on records whose
    #: part is None (a plug-in computed on some sampled steps only), with the optimizer step they
    #: come from as ``distgrad_<part_name>_step``, which :attr:`METRICS` must declare. The JSONL
    #: record keeps None on those steps.
    hold: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        """Register what the subclass declares in its own body.

        Raises:
            ValueError: a config key, part name or metric declared twice, or a ``Part`` with
                neither ``part_name`` nor ``Config``.
        """
        super().__init_subclass__(**kw)
        own = cls.__dict__
        if own.get("Config") is not None:
            register_section(own["Config"])
        if own.get("Part") is not None:
            name = cls.part_name or (cls.Config.section_key if cls.Config is not None else None)
            if name is None:
                raise ValueError(f"{cls.__qualname__}: a Part needs part_name or a Config")
            cls.part_name = name
            register_part(name, own["Part"])
        if own.get("METRICS"):
            _metrics.register(own["METRICS"], cls.part_name, cls.samples, hold=bool(cls.hold))

    @classmethod
    def section_of(cls, config: Any) -> Any:
        """This plug-in's section of a :class:`~distgrad.config.DistgradConfig` (an instance of
        :attr:`Config`). The field is added to ``DistgradConfig`` when the plug-in's class is
        defined, so a type checker cannot see ``config.<key>``; read it through here.

        Raises:
            TypeError: the class declares no ``Config``.
        """
        if cls.Config is None:
            raise TypeError(f"{cls.__qualname__} declares no Config section")
        return getattr(config, cls.Config.section_key)

    @classmethod
    def set_part(cls, rec: Any, part: Any) -> None:
        """Set this plug-in's record part on a :class:`~distgrad.record.StepRecord` (the attribute
        :attr:`part_name`, added when the class is defined: invisible to a type checker, like
        :meth:`section_of`).

        Raises:
            TypeError: the class declares no ``Part``.
        """
        if cls.part_name is None:
            raise TypeError(f"{cls.__qualname__} declares no Part")
        setattr(rec, cls.part_name, part)

    @staticmethod
    def samples(part: Any) -> dict[str, Any]:
        """The Prometheus samples of the record part (:attr:`Part`, never None here):
        ``{metric name: value}``, the value a number (an unlabelled metric), a ``{label value:
        number}`` dict (a metric with one label; empty: no series) or None (no series). Every
        name must be one of :attr:`METRICS`. Default: none."""
        return {}
