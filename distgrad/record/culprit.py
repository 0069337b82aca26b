"""The culprit module part of a :class:`~distgrad.record.StepRecord` (:mod:`distgrad.diagnostics.replay`)."""

from __future__ import annotations

from dataclasses import dataclass

from distgrad.record.base import _Part

#: what the forward replay of a non-finite step came to (``CulpritModule.outcome``, the
#: ``outcome`` label of ``distgrad_nonfinite_replay_outcome``): ``found`` names a module; every
#: other value says why none is named (see :mod:`distgrad.diagnostics.replay`)
OUTCOMES: tuple[str, ...] = ("found", "finite", "weights_nonfinite", "no_input", "not_kept", "failed", "off",
                             "budget", "async_records", "model_parallel", "uneven_micro_batches")

_WHY = {
    "finite": "the replayed forward stayed finite (the NaN/Inf came from the backward pass, the reduction or "
              "the optimizer, or from an input the loop changed)",
    "weights_nonfinite": "the weights already held NaN/Inf before the step",
    "no_input": "no micro-batch input kept on the replaying rank(s), or one was modified in place after its forward",
    "not_kept": "the offending micro-batch was not among the last ones kept",
    "failed": "the replayed forward raised",
    "off": "replay is off (tracer.replays: 0)",
    "budget": "the run's replay budget (tracer.replays) is spent",
    "async_records": "asynchronous records learn the reduced values after the update (statistics.async_records)",
    "model_parallel": "this rank holds only part of the model (pipeline stages / experts elsewhere)",
    "uneven_micro_batches": "the ranks kept different numbers of micro-batches",
}


@dataclass
class CulpritModule(_Part):
    """The culprit module of the first step of a non-finite streak: the first module whose
    forward output went NaN/Inf when the offending micro-batch was replayed on the culprit rank
    (:mod:`distgrad.diagnostics.replay`).

    Attributes:
        step: the optimizer step replayed.
        outcome: one of :data:`OUTCOMES`; ``"found"`` when ``module`` is named, else why not.
        rank: the rank whose replay named the module (``found``) or whose weights were
            non-finite (``weights_nonfinite``); None otherwise.
        module: the module's dotted name in the user's root module (wrapper prefixes removed;
            ``"<root>"`` for the root itself), None unless found.
        micro_batch: 0-based index of the offending micro-batch within the step on that rank,
            None unless found.
    """

    step: int
    outcome: str
    rank: int | None = None
    module: str | None = None
    micro_batch: int | None = None

    def describe(self) -> str:
        """One line for logs and reports."""
        if self.outcome == "found":
            return (f"first non-finite forward output in module {self.module!r} on rank {self.rank}, "
                    f"micro-batch {self.micro_batch}")
        who = f" (rank {self.rank})" if self.rank is not None else ""
        return f"culprit module unknown: {self.outcome}{who}: {_WHY.get(self.outcome, '')}"
