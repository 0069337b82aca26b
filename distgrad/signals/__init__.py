"""Packed signals: statistics beyond the core per-parameter columns that ride in the sampled
step's existing two collectives (the SUM and the MAX all-reduce) and its one host copy.

A signal (:class:`PackedSignal`) contributes, on every rank and every sampled step, a float64
SUM part and a float64 MAX part computed on the device from this rank's gradient pieces (and
whatever else the rank holds next to them: optimizer state shards, a kept copy of the previous
gradient); after the reduction it turns its reduced parts into a typed record part on the host.
Sums of counts, sums and sums of products are exact under any sharding as long as each element
is counted once, which the pieces handed to :meth:`PackedSignal.local` guarantee (this rank's
owned share, :class:`~distgrad.engines.base.Ownership`).

Every rank must build the same signals with the same sizes (they are decided once, at
``instrument()``, from the configuration and the parameter list, never from rank-local state),
so the packed tensors have the same length on every rank.

**The contract** (one module per signal, OLMo-core callback / torchtitan ``Config`` style,
:class:`distgrad.config.contract.Declares`): a :class:`PackedSignal` subclass declares, next to
its code,

* ``Config``: its configuration section (a nested :class:`~distgrad.config.sections.Section`
  subclass with ``section_key``), added to :class:`~distgrad.config.DistgradConfig` as the field
  ``section_key`` (and to the generated ``docs/configuration.md`` / ``configs/distgrad.yaml``);
* ``Part``: its record part (a nested dataclass on :class:`~distgrad.record.base._Part`), the
  :class:`~distgrad.record.StepRecord` attribute ``part_name`` (default ``section_key``), written
  to and read back from JSON Lines by pydantic like every part;
* ``METRICS``: its Prometheus metrics (catalogue entries,
  :class:`~distgrad.export.metrics.Metric`, whose ``when`` is a condition it declares with
  :func:`distgrad.export.metrics.condition`), added to
  :data:`distgrad.export.metrics.CATALOGUE` (and so to ``docs/metrics.md``, the series budget and
  the catalogue test);
* :meth:`PackedSignal.samples`: its part -> ``{metric name: value}``, which the Prometheus sink
  serves (a number, or ``{label value: number}`` for a metric with one label);
* :meth:`PackedSignal.build`: the factory, called at ``instrument()``;
* its checkpointed state: :meth:`PackedSignal.state_dict` / :meth:`load_state_dict`.

Defining the class registers all of it (``__init_subclass__``); the module is listed once in
``distgrad/signals/builtin.py`` (the import order is the order in the packed tensors), which
:mod:`distgrad.config` imports, so every contract is registered once ``distgrad`` is imported.
No other file names the signal.

Every built-in signal (histogram, optimizer signals, logits, noise scale, curvature, replica
checks) follows this contract; defining the class registers its ``build`` with :func:`register`,
and :func:`distgrad.signals.builtin.build` calls every factory at ``instrument()`` time. A
factory returns None when the signal is switched off, and raises
:class:`~distgrad.config.ConfigError` (or ``ValueError``) naming the key for a configuration it
cannot serve (this is the "clear error at instrument() time" path).

The signals together are one of the step's blocks (:class:`SignalPack`, ``"signals"``, a
:class:`distgrad.stats.layout.StepBlock`), between the loss block and the unsampled-step flags.

Failure handling: each signal's SUM part is prefixed by one failure slot. A rank whose
:meth:`PackedSignal.local` raises contributes the identities (0 for SUM, -inf for MAX) with the
slot set to 1 and counts an internal error; after the reduction a signal whose slot is non-zero
is skipped for that step (its record part stays None: nothing is exported that a rank could not
vouch for), on every rank alike.

A signal needs no collective of its own but for :meth:`PackedSignal.exchange` (default none),
which :class:`SignalPack` calls on every rank of every sampled step before the packed parts are
built: the only place a signal may add one (the underflow recomputation on FSDP2 gathers the
parameters there on its recomputation steps).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from distgrad.config.contract import Declares

log = logging.getLogger("distgrad")

__all__ = ["PackedSignal", "SignalPack", "register", "FACTORIES"]


class PackedSignal(Declares, abc.ABC):
    """One statistic carried in the sampled step's two collectives.

    Subclasses set :attr:`name` (short, snake_case; used in error messages and the
    ``distgrad_internal_errors`` log) and the two sizes, fixed at construction.
    """

    #: short name, e.g. ``"grad_histogram"``
    name: str = "signal"

    def __init_subclass__(cls, **kw: Any) -> None:
        """Register what the subclass declares (:class:`~distgrad.config.contract.Declares`:
        ``Config``, ``Part``, ``METRICS``) and its own ``build`` as its factory.

        Raises:
            ValueError: a config key, part name, metric or signal name declared twice.
        """
        super().__init_subclass__(**kw)
        if "build" in cls.__dict__:
            register(cls.name)(cls.build)

    @classmethod
    def build(cls, inst: Any) -> PackedSignal | None:
        """The factory, called once at ``instrument()`` on every rank with the
        :class:`~distgrad.Instrument` (``inst.config.<section_key>`` is :attr:`Config`):
        the signal, or None when it is off.

        Raises:
            distgrad.config.ConfigError (or ValueError): a configuration it cannot serve,
                naming the key (``instrument()`` fails with it).
        """
        return None

    @property
    @abc.abstractmethod
    def sum_size(self) -> int:
        """Number of float64 elements of the SUM part (without the failure slot)."""

    @property
    def max_size(self) -> int:
        """Number of float64 elements of the MAX part (default 0)."""
        return 0

    @abc.abstractmethod
    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's contribution, on ``device``, with no host synchronisation.

        Args:
            inst: the :class:`~distgrad.Instrument` (``inst.names``, ``inst.source``,
                ``inst.own``, ``inst.config``, ``inst.rank``, ``inst.world_size``).
            pieces: length ``len(inst.names)``; per parameter the 1-D piece of the (still
                loss-scaled, see ``grad_scale`` in :meth:`finish`) gradient this rank counts,
                or None.
            device: the device of the packed tensors.

        Returns:
            ``(sum_part, max_part)``: float64 1-D tensors of :attr:`sum_size` and
            :attr:`max_size` elements (``max_part`` may be None when ``max_size`` is 0).
        Raises:
            anything: caught by :class:`SignalPack` (counted; the step's signal is dropped).
        """

    def exchange(self, inst: Any, device: torch.device) -> None:
        """Collectives of the signal's own on a sampled step, before :meth:`local`: called by
        :meth:`SignalPack.block` on every rank of every sampled step, whether or not the rank
        has gradient pieces this step (a step refused or failed as a whole included), so a
        signal that needs data from the other ranks (the underflow recomputation's parameter
        all-gather on FSDP2, :mod:`distgrad.signals.underflow`) makes the same collectives in
        the same order on every rank. Decide from the step number (``inst.sampled_step``) and
        settings fixed at ``instrument()`` only, never from rank-local state; keep the result
        for :meth:`local`. No host synchronisation. Default: nothing (the step keeps its two
        collectives).

        Raises:
            anything: caught by :class:`SignalPack` (counted as an internal error)."""

    def after_step(self, inst: Any, step_applied: bool) -> None:
        """Called on every rank after the optimizer step of a sampled step (device work only,
        no collective, no host sync), e.g. to keep a copy of the update. Default: nothing."""

    def attach(self, inst: Any, module: Any) -> Callable[[], None] | None:
        """Called once at ``instrument()``, after the engine's boundary is installed, with the
        module whose forward the user's loop runs (``DeepSpeedEngine.module``, the DDP / FSDP
        root, the plain model), e.g. to install gradient hooks. Returns a function undoing
        it (called at ``close()``), or None. Raising here fails ``instrument()`` (a clear
        set-up error). Default: nothing."""
        return None

    def skip(self, inst: Any, step: int) -> None:
        """Called on every rank at the boundary of an optimizer step that is *not* sampled
        (``interval`` > 1), before the optimizer consumes the gradients (device work only, no
        collective, no host sync), e.g. to forget what hooks gathered during that step.
        Default: nothing."""

    @abc.abstractmethod
    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        """Host side: write the record part from the reduced parts (float64 numpy arrays of
        :attr:`sum_size` / :attr:`max_size` elements). ``grad_scale``: the factor the reduced
        gradient pieces still carried (the loss scale under fp16, else 1.0); divide by it."""

    def state_dict(self) -> dict | None:
        """JSON-serialisable state to checkpoint (e.g. an EMA), or None (default)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""


#: factory(inst) -> PackedSignal | None, in registration order (the order of the parts in the pack)
FACTORIES: list[tuple[str, Callable[[Any], PackedSignal | None]]] = []


def register(name: str) -> Callable[[Callable[[Any], PackedSignal | None]], Callable[[Any], PackedSignal | None]]:
    """Decorator registering a signal factory under ``name`` (import the module in
    ``distgrad/signals/builtin.py`` so it is registered)."""
    def deco(fn: Callable[[Any], PackedSignal | None]) -> Callable[[Any], PackedSignal | None]:
        if any(n == name for n, _ in FACTORIES):
            raise ValueError(f"signal {name!r} registered twice")
        FACTORIES.append((name, fn))
        return fn
    return deco


class SignalPack:
    """The signals of one :class:`~distgrad.Instrument`, and their place in the packed tensors.

    SUM part: for each signal ``[failure slot, sum part...]``; MAX part: each signal's max part.
    The pack is one of the step's blocks (:class:`distgrad.stats.layout.StepBlock`, ``"signals"``,
    after the loss block); :meth:`distgrad.stats.layout.StepBlocks.split` takes it off the reduced
    host array again (:meth:`Instrument.split_reduced`).
    """

    #: its name among the step's blocks (:class:`distgrad.stats.layout.StepBlocks`)
    name = "signals"

    def __init__(self, signals: Sequence[PackedSignal]) -> None:
        self.signals = list(signals)
        #: the sampled step whose exchanges ran (``inst.sampled_step``): a second :meth:`block` in
        #: the same step (the error path after a failure inside the first) must not issue them
        #: again on this rank alone
        self._exchanged: int | None = None

    @property
    def sum_size(self) -> int:
        return sum(1 + s.sum_size for s in self.signals)

    @property
    def max_size(self) -> int:
        return sum(s.max_size for s in self.signals)

    def __bool__(self) -> bool:
        return bool(self.signals)

    def block(self, inst: Any, pieces: Sequence[torch.Tensor | None] | None,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(sum [sum_size], max [max_size])``; ``pieces`` None: identities without
        failure flags (the step is refused or failed as a whole and dropped anyway). Each
        signal's :meth:`PackedSignal.exchange` runs first, in both cases, once per sampled step
        (``inst.sampled_step``): called again in the same step (the caller's error path after a
        failure inside the first call) the exchanges are not repeated, so every rank still issues
        them exactly once."""
        sums: list[torch.Tensor] = []
        maxes: list[torch.Tensor] = []
        step = getattr(inst, "sampled_step", None)
        exchange = step is None or self._exchanged != step
        self._exchanged = step
        for sig in self.signals:
            s = m = None
            failed = False
            try:  # on every rank, pieces or not: the signal's own collectives (PackedSignal.exchange)
                if exchange:
                    sig.exchange(inst, device)
            except Exception:  # noqa: BLE001 - counted; local() then finds nothing exchanged
                inst._internal_error(f"signal {sig.name} exchange")
            if pieces is not None:
                try:
                    s, m = sig.local(inst, pieces, device)
                    s = s.to(device=device, dtype=torch.float64).reshape(-1)
                    m = (torch.zeros(0, dtype=torch.float64, device=device) if m is None
                         else m.to(device=device, dtype=torch.float64).reshape(-1))
                    if s.numel() != sig.sum_size or m.numel() != sig.max_size:
                        raise ValueError(f"signal {sig.name}: parts of {s.numel()}/{m.numel()} elements, "
                                         f"expected {sig.sum_size}/{sig.max_size}")
                except Exception:  # noqa: BLE001 - counted; identities with the failure flag
                    inst._internal_error(f"signal {sig.name}")
                    s = m = None
                    failed = True
            if s is None or m is None:  # both None or both set
                s = torch.zeros(sig.sum_size, dtype=torch.float64, device=device)
                m = torch.full((sig.max_size,), -float("inf"), dtype=torch.float64, device=device)
            flag = torch.full((1,), 1.0 if failed else 0.0, dtype=torch.float64, device=device)
            sums += [flag, s]
            maxes.append(m)
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        return (torch.cat(sums) if sums else empty), (torch.cat(maxes) if maxes else empty)

    def after_step(self, inst: Any, step_applied: bool) -> None:
        """:meth:`PackedSignal.after_step` of each signal; failures are counted, never raised."""
        for sig in self.signals:
            try:
                sig.after_step(inst, step_applied)
            except Exception:  # noqa: BLE001
                inst._internal_error(f"signal {sig.name} after the step")

    def attach(self, inst: Any, module: Any) -> None:
        """:meth:`PackedSignal.attach` of each signal; the undo functions run at ``close()``.
        Raises what a signal raises (``instrument()`` then fails and closes)."""
        for sig in self.signals:
            undo = sig.attach(inst, module)
            if undo is not None:
                inst.on_close(undo)

    def skip(self, inst: Any, step: int) -> None:
        """:meth:`PackedSignal.skip` of each signal; failures are counted, never raised."""
        for sig in self.signals:
            try:
                sig.skip(inst, step)
            except Exception:  # noqa: BLE001
                inst._internal_error(f"signal {sig.name} on an unsampled step")

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray, grad_scale: float) -> None:
        """Each signal's :meth:`PackedSignal.finish` on its reduced parts; a signal a rank
        failed on is skipped for this step; failures are counted, never raised."""
        i = j = 0
        for sig in self.signals:
            flag = sum_part[i]
            s = sum_part[i + 1:i + 1 + sig.sum_size]
            m = max_part[j:j + sig.max_size]
            i += 1 + sig.sum_size
            j += sig.max_size
            if flag != 0:
                continue
            try:
                sig.finish(inst, rec, s, m, grad_scale)
            except Exception:  # noqa: BLE001
                inst._internal_error(f"signal {sig.name} on the host")

    def state_dict(self) -> dict:
        """Per signal name, its :meth:`PackedSignal.state_dict` (None entries omitted)."""
        out = {}
        for sig in self.signals:
            st = sig.state_dict()
            if st is not None:
                out[sig.name] = st
        return out

    def load_state_dict(self, state: dict) -> None:
        for sig in self.signals:
            if sig.name in state:
                sig.load_state_dict(state[sig.name])
