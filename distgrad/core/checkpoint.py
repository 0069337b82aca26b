"""Checkpointing distgrad's own state with the training job's checkpoint.

A resumed run should not start distgrad from scratch: every spike detector would go through a
new warm-up (a blind period, then false alarms on a window filled only with post-restart
values), the health streaks and the non-finite event would be forgotten and the ``_total``
counters would restart at 0. :meth:`Instrument.state_dict` (:func:`instrument_state`) returns
all of it as plain Python types, to be saved with the checkpoint, and
:meth:`Instrument.load_state_dict` (:func:`load_instrument_state`) puts it back.

Every rank holds the same state (it is derived from the reduced record, identical on all
ranks), so the copy saved by any one rank serves all of them; nothing here makes a collective.

With DeepSpeed (``client_state`` is stored with the model states and returned by
``load_checkpoint`` on every rank)::

    engine.save_checkpoint(ckpt_dir, tag, client_state={"distgrad": dg.state_dict()})
    ...
    _, client_state = engine.load_checkpoint(ckpt_dir, tag)
    dg = distgrad.instrument(engine, ...)
    dg.load_state_dict(client_state["distgrad"])

With FSDP / DDP / plain PyTorch (``torch.save`` or ``torch.distributed.checkpoint``)::

    torch.save({"model": ..., "optim": ..., "distgrad": dg.state_dict()}, path)   # rank 0
    ...
    dg.load_state_dict(torch.load(path)["distgrad"])                             # every rank

The framework integrations (:mod:`distgrad.integrations`: the Hugging Face Trainer, Accelerate,
Lightning) do both through the framework's own checkpoint, with no user code
(docs/checkpointing.md, "Framework integrations").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distgrad.core.instrument import Instrument

#: the ``format`` tag of an instrument state
FORMAT = "distgrad-instrument"
#: layout version of :func:`instrument_state`'s output
VERSION = 1


def instrument_state(inst: Instrument) -> dict[str, Any]:
    """The state of ``inst`` for a checkpoint.

    Returns:
        ``{"format": "distgrad-instrument", "version": 1, "n_params": P, "counters": {name: int},
        "consecutive_overflow_steps": int, "replica_mismatch_rank": int, "diagnostics":
        Diagnostics.state_dict() | None, "signals": {signal name: state}}`` (the packed
        signals' states, :mod:`distgrad.signals`), ``"replay"``: the culprit-module replays made
        and whether a non-finite streak is open (:mod:`distgrad.diagnostics.replay`), ``"boundary"``: the
        PyTorch optimizer boundary's counters ``{"step": int, "micro": int}`` (optimizer steps and
        micro-batches since ``instrument()``, which decide sampling and number the records; None
        under DeepSpeed, whose engine's ``global_steps`` is restored by its own checkpoint),
        JSON-serialisable (NaN as a float where a detector has no statistics yet).
    """
    d = inst.diagnostics
    b = getattr(inst, "boundary", None)
    counters = ({"step": int(b.step), "micro": int(b.micro)}
                if b is not None and hasattr(b, "step") and hasattr(b, "micro") else None)
    return {"format": FORMAT, "version": VERSION, "n_params": len(inst.names),
            "counters": dict(inst.counters), "consecutive_overflow_steps": inst._consecutive_overflow,
            "replica_mismatch_rank": inst._replica_mismatch_rank,
            "diagnostics": d.state_dict() if d is not None else None,
            "signals": inst.signals.state_dict(),
            "replay": inst.replay.state_dict() if getattr(inst, "replay", None) is not None else None,
            "boundary": counters}


def load_instrument_state(inst: Instrument, state: dict[str, Any]) -> None:
    """Restore :func:`instrument_state`'s output into ``inst`` (its config is kept: thresholds
    and windows of this run apply from now on) and publish the restored counters.

    Raises:
        ValueError: if ``state`` is not an instrument state of this version, comes from a
            model with another number of trainable parameters, or a diagnostic cannot read its
            part (the message names it). Nothing is changed then, except by a diagnostic that
            failed half-way.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("distgrad: load_state_dict() needs the dict returned by Instrument.state_dict() "
                         f"(got a {type(state).__name__} without format {FORMAT!r})")
    if state.get("version") != VERSION:
        raise ValueError(f"distgrad: instrument state version {state.get('version')!r} is not {VERSION}: "
                         "it was written by another distgrad version")
    if state.get("n_params") != len(inst.names):
        raise ValueError(f"distgrad: the state is of a model with {state.get('n_params')} trainable parameter "
                         f"tensors, this one has {len(inst.names)}: restore it into the same model")
    if inst.diagnostics is not None and state.get("diagnostics"):
        inst.diagnostics.load_state_dict(state["diagnostics"])
    inst.signals.load_state_dict(state.get("signals") or {})
    if getattr(inst, "replay", None) is not None and state.get("replay"):
        inst.replay.load_state_dict(state["replay"])
    b, counters = getattr(inst, "boundary", None), state.get("boundary")
    if isinstance(counters, dict) and b is not None and hasattr(b, "step") and hasattr(b, "micro"):
        b.step, b.micro = int(counters["step"]), int(counters["micro"])
    inst.counters.update({k: int(v) for k, v in state.get("counters", {}).items() if k in inst.counters})
    inst._consecutive_overflow = int(state.get("consecutive_overflow_steps", 0))
    inst._replica_mismatch_rank = int(state.get("replica_mismatch_rank", -1))
    inst._publish_counters()
