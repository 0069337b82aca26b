"""Flight recorder: the last N sampled steps, dumped to disk when something goes wrong.

In the spirit of PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, a ring
buffer of recent collectives dumped on a watchdog timeout) and aircraft flight-data
recorders: :class:`FlightRecorder` keeps the last ``capacity`` :class:`~distgrad.record.StepRecord`
objects in a :class:`collections.deque` and, on :meth:`FlightRecorder.dump`, writes

* ``flightrec-step{step}-{reason}.json``: the records (``StepRecord.to_dict``, columnar, with
  ``NaN`` / ``Infinity`` literals), the non-finite provenance, the loss-scale history and the
  run configuration -- :func:`load_dump` reads it back into ``StepRecord`` objects;
* ``flightrec-step{step}-{reason}.txt``: a short human-readable summary (first non-finite
  step, its culprit ranks and the forward replay's culprit module, parameters holding NaN/Inf
  with counts and ranks, the one last in forward order, the global-norm history).

**Last in forward order** (used by :func:`provenance_from` and the summary): among the parameters
whose gradient holds NaN/Inf, the one that comes *last in forward order* (``first_param``, exported
as ``distgrad_nonfinite_last_param_in_forward_order``) is where the backward pass met the NaN
first: the origin of a NaN made in the backward pass. Where a NaN was made in the *forward* pass
is the forward replay's culprit module (:mod:`distgrad.diagnostics.replay`), which the page, the log and the
report's verdict lead with. Backpropagation visits layers in reverse forward order and every
gradient upstream (earlier in forward order) of a non-finite activation-gradient is contaminated
by it, whereas layers after the origin are computed before it and stay finite. Forward order is
the order of ``names`` (module registration order, which is execution order for the usual
``embed -> blocks -> norm -> head`` stacks) unless ``order_key`` supplies the real execution
order. Caveats: a non-finite *loss* (a NaN made anywhere in the forward pass) makes every gradient
non-finite and the rule then names the last layer (head), not the origin; tied or shared weights appear at
their first registration; a NaN produced in the optimizer or by a corrupt weight (not by
backward) need not follow the rule.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.config.sections import FlightRecorderConfig
from distgrad.record import StepRecord

__all__ = ["FlightRecorder", "provenance_from", "load_dump"]

_FORMAT = "distgrad-flightrec"
_VERSION = 1


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------


def _order_keys(
    names: Sequence[str], order_key: Callable[[str], Any] | Mapping[str, Any] | None
) -> list[Any]:
    if order_key is None:
        return list(range(len(names)))
    if isinstance(order_key, Mapping):
        # mapped names after unmapped ones; ties (and unmapped names) by position
        return [
            (1, order_key[n], i) if n in order_key else (0, 0, i) for i, n in enumerate(names)
        ]
    if callable(order_key):
        return [(order_key(n), i) for i, n in enumerate(names)]
    raise TypeError(f"order_key must be None, a callable or a mapping, got {type(order_key)}")


def provenance_from(
    names: Sequence[str],
    per_rank_nan: np.ndarray,
    per_rank_inf: np.ndarray,
    order_key: Callable[[str], Any] | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the provenance dict of a non-finite step from per-rank element counts.

    Args:
        names: parameter names, length P, in registration (forward) order.
        per_rank_nan: NaN element counts of each rank's local shard, shape ``[world, P]``
            (a ``[P]`` array is taken as world size 1); any numeric dtype, NaN counted as 0.
        per_rank_inf: +/-Inf element counts, same shape.
        order_key: forward-order override: a callable ``name -> sortable`` or a mapping
            ``name -> sortable`` (names missing from the mapping rank before all mapped ones).
            Ties are broken by position in ``names``.

    Returns:
        ``{"params": [{"name": str, "nan": int, "inf": int, "ranks": [int, ...]}, ...],
        "first_param": str | None}`` -- rows only for parameters with a non-zero count, sorted
        in forward order; ``nan`` / ``inf`` summed over ranks; ``ranks`` ascending, the ranks
        whose shard held any NaN/Inf of that parameter; ``first_param`` the non-finite parameter *last* in
        forward order (the module docstring says what it is and is not), None if no rows.

    Raises:
        ValueError: if the arrays' shapes disagree with each other or with ``names``.
        TypeError: for an unsupported ``order_key``.
    """
    names = list(names)
    nan = np.nan_to_num(np.asarray(per_rank_nan, dtype=np.float64), nan=0.0)
    inf = np.nan_to_num(np.asarray(per_rank_inf, dtype=np.float64), nan=0.0)
    if nan.ndim == 1:
        nan = nan[None, :]
    if inf.ndim == 1:
        inf = inf[None, :]
    if nan.ndim != 2 or nan.shape != inf.shape or nan.shape[1] != len(names):
        raise ValueError(
            f"provenance_from: {len(names)} names, per_rank_nan {nan.shape}, "
            f"per_rank_inf {inf.shape}; expected [world, P] for both"
        )
    keys = _order_keys(names, order_key)
    tot = nan + inf
    hit = np.flatnonzero(tot.sum(axis=0) > 0)
    order = sorted(hit.tolist(), key=lambda j: keys[j])
    rows = [
        {
            "name": names[j],
            "nan": int(round(nan[:, j].sum())),
            "inf": int(round(inf[:, j].sum())),
            "ranks": np.flatnonzero(tot[:, j] > 0).tolist(),
        }
        for j in order
    ]
    return {"params": rows, "first_param": rows[-1]["name"] if rows else None}


def _provenance_from_record(rec: StepRecord) -> dict[str, Any]:
    """Provenance from a record alone (ranks unknown per parameter: the record's
    ``nonfinite_ranks`` are attached to every row)."""
    p = rec.params
    prov = provenance_from(p.names, p.nan, p.inf)
    for row in prov["params"]:
        row["ranks"] = sorted(int(r) for r in rec.nonfinite_ranks)
    return prov


# --------------------------------------------------------------------------------------------
# JSON helpers
# --------------------------------------------------------------------------------------------


def _jsonable(o: Any) -> Any:
    """``json.dump`` fallback for numpy / torch / paths / sets / dataclasses."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if hasattr(o, "detach") and hasattr(o, "tolist"):  # torch.Tensor
        return o.detach().cpu().tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    return repr(o)


def load_dump(path: str | Path) -> dict[str, Any]:
    """Read a ``flightrec-*.json`` file written by :meth:`FlightRecorder.dump`.

    Returns:
        the JSON object with ``"records"`` converted to a list of :class:`StepRecord`.

    Raises:
        OSError: if the file cannot be read; ValueError: if it is not a flight-recorder dump.
    """
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if d.get("format") != _FORMAT:
        raise ValueError(f"{path}: not a distgrad flight-recorder dump")
    d["records"] = [StepRecord.from_dict(r) for r in d.get("records", [])]
    return d


def _fmt(x: Any, spec: str = ".6g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return str(x)


_REASON_RE = re.compile(r"[^A-Za-z0-9_.-]+")


# --------------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------------


class FlightRecorder:
    """Ring buffer of the last ``capacity`` step records, dumped to JSON + text on demand.

    Memory: the records themselves (not copies) are kept; a record costs about ``64 * P`` bytes
    of float64 statistics (P trainable parameter tensors), so ``capacity=64`` with P=1000 is
    ~4 MiB. Records must not be mutated after :meth:`record` if the dump is to reflect them.

    Args:
        capacity: records kept (>= 1; default: the ``flight_recorder.steps`` default, 64); older ones
            are dropped first.
        out_dir: directory for dumps; created on the first dump.
        config: run configuration copied into every dump (JSON-serialisable; numpy / paths are
            converted, anything else is written as its ``repr``).
        dump_on_overflow: when False, :meth:`maybe_dump_on_nonfinite` ignores non-finite steps
            that the fp16 loss scaler handled (``rec.overflow is True``). Default True (dump on
            the first non-finite step whatever its cause); under fp16 dynamic loss scaling,
            where early overflows are routine, False is usually wanted.

    Raises:
        ValueError: on ``capacity < 1``.
    """

    def __init__(
        self,
        capacity: int = FlightRecorderConfig().steps,
        out_dir: str | Path = ".",
        config: dict[str, Any] | None = None,
        dump_on_overflow: bool = True,
    ) -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.out_dir = Path(out_dir)
        self.config = dict(config or {})
        self.dump_on_overflow = bool(dump_on_overflow)
        self._buf: deque[StepRecord] = deque(maxlen=self.capacity)
        self.dumped_nonfinite: Path | None = None  # path of the one automatic dump, once done
        self.dumps: list[Path] = []

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def records(self) -> list[StepRecord]:
        """The buffered records, oldest first (a new list)."""
        return list(self._buf)

    def record(self, rec: StepRecord) -> None:
        """Append one sampled step (the oldest is dropped when full)."""
        self._buf.append(rec)

    def clear(self) -> None:
        """Empty the buffer (e.g. after a checkpoint reload)."""
        self._buf.clear()

    def rearm(self) -> None:
        """Allow :meth:`maybe_dump_on_nonfinite` to dump again."""
        self.dumped_nonfinite = None

    def maybe_dump_on_nonfinite(
        self,
        rec: StepRecord,
        provenance: dict[str, Any] | None = None,
        loss_scale_history: Any = None,
        reason: str = "nonfinite",
    ) -> Path | None:
        """Record ``rec`` (unless it already is the newest record) and, if it is the first
        non-finite step since creation / :meth:`rearm`, :meth:`dump`.

        Returns:
            the JSON path when a dump was written, else None.

        Raises:
            OSError: if writing fails (the recorder stays armed, so a later step retries).
        """
        if not self._buf or self._buf[-1] is not rec:
            self.record(rec)
        if self.dumped_nonfinite is not None or not rec.nonfinite:
            return None
        if rec.overflow is True and not self.dump_on_overflow:
            return None
        path = self.dump(reason, provenance=provenance, loss_scale_history=loss_scale_history)
        self.dumped_nonfinite = path
        return path

    def _loss_scale_history(self, given: Any) -> list[Any]:
        if given is not None:
            if isinstance(given, Mapping):
                return [[k, v] for k, v in given.items()]
            return [list(x) if isinstance(x, (tuple, list)) else x for x in given]
        return [[r.step, r.loss_scale] for r in self._buf if r.loss_scale is not None]

    def dump(
        self,
        reason: str,
        provenance: dict[str, Any] | None = None,
        loss_scale_history: Any = None,
        step: int | None = None,
    ) -> Path:
        """Write ``flightrec-step{step}-{reason}.json`` and the ``.txt`` summary next to it.

        Args:
            reason: short cause (``"nonfinite"``, ``"spike"``, ``"manual"``); characters other
                than ``[A-Za-z0-9_.-]`` become ``_`` in the file name.
            provenance: the dict of :func:`provenance_from` for the newest step; when None and
                a buffered record is non-finite, one is derived from the first such record
                (per-parameter ranks then unknown: the record's ``nonfinite_ranks`` are used).
            loss_scale_history: ``[(step, scale), ...]``, ``{step: scale}`` or a list of
                scales; default: ``(step, loss_scale)`` of the buffered records that have one.
            step: step in the file name; default the newest record's step (-1 when empty).

        Returns:
            the path of the JSON file. An existing file of the same name is not overwritten:
            ``-2``, ``-3``, ... is appended to the stem.

        Raises:
            OSError: if the directory or files cannot be written.
        """
        recs = list(self._buf)
        if step is None:
            step = recs[-1].step if recs else -1
        safe = _REASON_RE.sub("_", str(reason)).strip("_") or "dump"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"flightrec-step{int(step)}-{safe}"
        json_path = self.out_dir / f"{stem}.json"
        k = 2
        while json_path.exists() or json_path.with_suffix(".txt").exists():
            json_path = self.out_dir / f"{stem}-{k}.json"
            k += 1

        first_nf = next((r for r in recs if r.nonfinite), None)
        derived = False
        if provenance is None and first_nf is not None:
            provenance = _provenance_from_record(first_nf)
            derived = True
        ls_hist = self._loss_scale_history(loss_scale_history)
        doc = {
            "format": _FORMAT,
            "version": _VERSION,
            "reason": str(reason),
            "step": int(step),
            "created": time.time(),
            "capacity": self.capacity,
            "first_nonfinite_step": None if first_nf is None else first_nf.step,
            "provenance": provenance,
            "provenance_derived_from_record": derived,
            "loss_scale_history": ls_hist,
            "config": self.config,
            "records": [r.to_dict() for r in recs],
        }
        text = self.render_summary(recs, doc)
        _atomic_write(json_path, json.dumps(doc, default=_jsonable, allow_nan=True, indent=1))
        try:
            _atomic_write(json_path.with_suffix(".txt"), text)
        except BaseException:  # both files or neither (a lone one would shift the next name)
            json_path.unlink(missing_ok=True)
            raise
        self.dumps.append(json_path)
        return json_path

    @staticmethod
    def render_summary(
        recs: Sequence[StepRecord], doc: dict[str, Any], max_rows: int = 40, max_history: int = 32
    ) -> str:
        """The text summary of a dump (``doc`` as built by :meth:`dump`)."""
        lines: list[str] = []
        w = lines.append
        w(f"distgrad flight recorder dump -- reason: {doc['reason']}, step {doc['step']}")
        w(time.strftime("written %Y-%m-%d %H:%M:%S %Z", time.localtime(doc["created"])))
        if recs:
            w(
                f"{len(recs)} record(s) buffered (capacity {doc['capacity']}), steps "
                f"{recs[0].step}..{recs[-1].step}, world size {recs[-1].world_size}"
            )
        else:
            w("no records buffered")
        w("")
        first_nf = next((r for r in recs if r.nonfinite), None)
        cm = None
        if first_nf is None:
            w("no non-finite gradient in the buffered steps")
        else:
            w(
                f"first non-finite step: {first_nf.step} (grad_norm {_fmt(first_nf.grad_norm)}, "
                f"loss {_fmt(first_nf.loss)}, loss_scale {_fmt(first_nf.loss_scale)}, "
                f"overflow {_fmt(first_nf.overflow)})"
            )
            ev = first_nf.nonfinite_event
            cm = first_nf.culprit_module or (ev.culprit_module if ev is not None else None)
            culprits = first_nf.culprits or (ev.culprits if ev is not None else [])
            if culprits:
                w("culprit rank(s), whose own loss / gradient was non-finite before the reduction: " + ", ".join(
                    f"{c.rank} ({'+'.join(k for k in ('loss', 'grad') if getattr(c, k)) or '?'})" for c in culprits))
            if cm is not None:
                w(f"forward replay of step {cm.step}: {cm.describe()}")
        rr = getattr(recs[-1], "rerun", None) if recs else None
        if rr is not None and rr.verdict is not None:  # distgrad.diagnostics.rerun
            q = (f"; quarantine rank {rr.quarantine_rank} on host {rr.quarantine_host}" if rr.quarantine_rank >= 0
                 else "")
            w(f"rerun attribution of step {rr.step} ({rr.trigger}, culprit rank {rr.culprit_rank}, compared on "
              f"rank {rr.other_rank}): {rr.verdict}: {rr.reason}{q}")
        prov = doc.get("provenance")
        if prov and prov.get("params"):
            rows = prov["params"]
            fp = prov.get("first_param")
            if fp:  # the backward-order view: the origin only when the NaN was made in the backward pass
                why = ("not the origin: the forward replay above found where the NaN was made"
                       if cm is not None and cm.outcome == "found" else
                       "where the backward pass met the NaN first; the origin of a NaN made in the backward pass")
                w(f"non-finite parameter last in forward order: {fp} ({why})")
            src = " (ranks from the record, not per parameter)" if doc.get(
                "provenance_derived_from_record") else ""
            derived = first_nf is not None and doc.get("provenance_derived_from_record")
            at = first_nf.step if first_nf is not None and derived else doc["step"]
            w(f"parameters with NaN/Inf at step {at}, forward order{src}:")
            width = max(8, min(60, max(len(r["name"]) for r in rows)))
            w(f"  {'name':<{width}} {'nan':>12} {'inf':>12}  ranks")
            for r in rows[:max_rows]:
                ranks = ",".join(str(x) for x in r.get("ranks", [])) or "?"
                w(f"  {r['name']:<{width}} {r['nan']:>12d} {r['inf']:>12d}  {ranks}")
            if len(rows) > max_rows:
                w(f"  ... {len(rows) - max_rows} more")
            all_ranks = sorted({int(x) for r in rows for x in r.get("ranks", [])})
            w(f"ranks with non-finite shards: {', '.join(map(str, all_ranks)) or '?'}")
        elif first_nf is not None and first_nf.nonfinite_ranks:
            w(f"ranks with non-finite shards: {', '.join(map(str, first_nf.nonfinite_ranks))}")
        w("")
        hist = recs[-max_history:]
        w(f"global gradient norm, last {len(hist)} sampled step(s):")
        w(f"  {'step':>10} {'grad_norm':>12} {'loss':>12} {'loss_scale':>12} {'overflow':>8} "
          f"{'applied':>7} {'nonfinite':>9}")
        for r in hist:
            w(
                f"  {r.step:>10d} {_fmt(r.grad_norm):>12} {_fmt(r.loss):>12} "
                f"{_fmt(r.loss_scale):>12} {_fmt(r.overflow):>8} {_fmt(r.step_applied):>7} "
                f"{int(r.params.nonfinite.sum()):>9d}"
            )
        ls = doc.get("loss_scale_history") or []
        if ls:
            w("")
            tail = ls[-max_history:]
            w("loss-scale history (last {}): {}".format(
                len(tail), ", ".join(
                    f"{x[0]}:{_fmt(x[1])}" if isinstance(x, list) and len(x) == 2 else _fmt(x)
                    for x in tail)))
        return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (temporary file + rename; no partial or 0-byte file is
    left behind when the disk is full)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
