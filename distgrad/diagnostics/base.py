"""The plug-in interface of distgrad's diagnostics: :class:`Diagnostic`, the
:class:`DiagnosticContext` it is built from, and the :data:`REGISTRY` of the diagnostics a run
gets (see :mod:`distgrad.diagnostics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from distgrad.config.contract import Declares
from distgrad.record import StepRecord

if TYPE_CHECKING:  # distgrad.config imports the diagnostics (their declared sections)
    from distgrad.config import DistgradConfig


@dataclass
class DiagnosticContext:
    """What a plug-in may use to set itself up for a run.

    Attributes:
        config: thresholds and options (one place: :class:`DistgradConfig`).
        names: P parameter names in registration (forward) order.
        global_rank: this process's global rank (rank 0 writes files).
        max_norm: the clipping threshold in force (``config.clip.max_grad_norm`` when set, else the
            engine's, e.g. DeepSpeed ``gradient_clipping``), or None.
        model: the module (for hooks such as the overflow tracer's), or None.
        run_info: JSON-serialisable description of the run for reports.
        reports: shared list of the files the plug-ins wrote (appended to).
    """

    config: DistgradConfig
    names: list[str]
    global_rank: int = 0
    max_norm: float | None = None
    model: Any = None
    run_info: dict[str, Any] = field(default_factory=dict)
    reports: list[Path] = field(default_factory=list)

    @property
    def rules(self) -> Any:
        """The user's naming rules (``naming.rules``), applied wherever a name is classified."""
        return self.config.naming.tuples


class Diagnostic(Declares):
    """Base class of a diagnostic plug-in.

    Subclasses set :attr:`name` (unique, the key of their state in a checkpoint), implement
    :meth:`on_record`, and override :meth:`state_dict` / :meth:`load_state_dict` when they keep
    state across steps. ``__init__`` takes the :class:`DiagnosticContext`; :meth:`create`
    returns None when the run's config disables the diagnostic.

    Like a packed signal, a diagnostic may declare on its class its configuration section
    (nested ``Config``), its record part (nested ``Part``, set in :meth:`on_record`) and its
    metrics (``METRICS`` and ``samples``): :class:`~distgrad.config.contract.Declares`.
    """

    name: ClassVar[str] = ""
    #: the ``sink`` label under which a file this plug-in fails to write is counted
    #: (``distgrad_sink_errors_total``) when it raises :class:`~distgrad.export.base.SinkError`
    sink_name: ClassVar[str] = "flight_recorder"  # the reports directory (a bounded `sink` label value)

    def __init__(self, ctx: DiagnosticContext) -> None:
        self.ctx = ctx

    @classmethod
    def create(cls, ctx: DiagnosticContext) -> Diagnostic | None:
        """The plug-in for this run, or None when it does not apply."""
        return cls(ctx)

    def on_record(self, rec: StepRecord) -> None:
        """Fold in one sampled step and write this diagnostic's part of ``rec``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (JSON-serialisable plain Python types); {} when stateless."""
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (this instance's configuration is kept).

        Raises:
            ValueError / KeyError / TypeError: on a state this plug-in cannot read.
        """

    def on_micro_batch(self) -> None:
        """Called after every forward/backward on this rank (optional)."""

    def close(self) -> None:
        """Release hooks / files at the end of the run (optional)."""


#: the diagnostics a run gets, in the order they run (see :func:`register`)
REGISTRY: list[type[Diagnostic]] = []


def register(cls: type[Diagnostic]) -> type[Diagnostic]:
    """Class decorator: add a :class:`Diagnostic` subclass to :data:`REGISTRY` (run last).

    Raises:
        ValueError: if the class has no ``name`` or its name is taken.
    """
    if not cls.name or any(c.name == cls.name for c in REGISTRY if c is not cls):
        raise ValueError(f"diagnostic {cls.__name__}: name {cls.name!r} is empty or already registered")
    if cls not in REGISTRY:
        REGISTRY.append(cls)
    return cls


