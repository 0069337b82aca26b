"""The plain-text summary of a :class:`~distgrad.report.analysis.RunAnalysis`
(``distgrad summary``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from distgrad.report.analysis import ANOMALY_LABELS, RunAnalysis
from distgrad.report.loss import summary_lines
from distgrad.report.signals import summary_lines as signal_lines


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return repr(v)
        return f"{v:.6g}"
    return str(v)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    rows = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return out


def worst_layers(a: RunAnalysis, top: int = 10) -> list[int]:
    """Indices into ``a.layers`` of the ``top`` worst layers: non-finite ones first (most
    non-finite steps), then by largest finite grad norm over the run."""
    def key(j: int) -> tuple[float, float]:
        m = a.layer_max_norm[j]
        return (-float(a.layer_nonfinite_steps[j]), -(m if math.isfinite(m) else -math.inf))
    return sorted(range(len(a.layers)), key=key)[:max(0, top)]


def format_summary(a: RunAnalysis, top: int = 10) -> str:
    """Plain-text summary: run line, last step, verdict, anomaly counts, worst layers."""
    out = [f"distgrad summary: {a.path}"]
    if a.n_records == 0:
        out.append("verdict: " + a.verdict())
        return "\n".join(out) + "\n"
    out.append(f"records: {a.n_records} sampled steps, steps {a.first_step}..{a.last_step}, world size {a.world_size}")
    out.append(f"last step: {a.last_step}  loss {_fmt(a.last['loss'])}  grad norm {_fmt(a.last['grad_norm'])}"
               f"  loss scale {_fmt(a.last['loss_scale'])}")
    out.append("verdict: " + a.verdict())
    if a.bad_lines:
        out.append(f"warning: skipped {a.bad_lines} malformed line(s); first: {a.first_bad_line}")
    if a.restarts:
        out.append(f"warning: the optimizer step went back {a.restarts} time(s): several runs were "
                   "appended to this file; use one sinks.jsonl.path per run")
    out.append("")
    rows = [(ANOMALY_LABELS[k], a.counts.get(k, 0), a.first_step_of.get(k)) for k in ANOMALY_LABELS]
    rows.append(("longest overflow streak", a.max_overflow_streak, None))
    for k in ("internal_errors", "replica_mismatch", "nonfinite_steps", "nonfinite_unsampled_steps",
              "nonfinite_loss_steps", "overflow_steps", "skipped_steps", "sampled_steps"):
        if k in a.counters:
            rows.append((f"counter {k} (last record)", a.counters[k], None))
    out += _table(("anomaly", "count", "first step"), rows)
    out.append(f"(spikes: {'from the records' if a.spikes_source == 'record' else 'rolling median/MAD rule'})")
    out.append("")
    loss_lines = summary_lines(a.loss) if a.loss is not None else []
    if loss_lines:
        out += loss_lines + [""]
    sig_lines = signal_lines(a.signals)
    if sig_lines:
        out += sig_lines + [""]
    idx = worst_layers(a, top)
    out.append(f"worst layers (of {len(a.layers)}) by non-finite steps, then max grad norm")
    out += _table(("layer", "max norm", "at step", "last norm", "non-finite elems", "non-finite steps"),
                  [(a.layers[j], float(a.layer_max_norm[j]),
                    int(a.layer_max_norm_step[j]) if a.layer_max_norm_step[j] >= 0 else None,
                    float(a.layer_last_norm[j]), int(a.layer_nonfinite_elems[j]), int(a.layer_nonfinite_steps[j]))
                   for j in idx])
    return "\n".join(out) + "\n"
