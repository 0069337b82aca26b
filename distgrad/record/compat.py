"""Reading schema-1 JSONL records (distgrad before the typed record): their diagnostics were in
one untyped ``"extra"`` object; :func:`from_extra` maps it to the typed fields of
:class:`~distgrad.record.StepRecord` (in their dict form), for ``StepRecord.from_dict``.
"""

from __future__ import annotations

from typing import Any

_SERIES = ("grad_norm", "loss")
_AGG_KEYS = ("layer_norm", "layer_nonfinite", "layer_zero_ratio", "layer_headroom", "module_kind_norm")


def from_extra(x: dict[str, Any]) -> dict[str, Any]:
    """The typed fields (in their dict form) of a schema-1 record's ``extra`` object."""
    kw: dict[str, Any] = {k: x[k] for k in ("grad_dtype", "grad_scale", "headroom", "replica_mismatch_rank",
                                            "update_ratio", "nonfinite_params", "provenance",
                                            "nonfinite_event", "flight_recorder_report", "unsampled_nonfinite")
                                           if k in x}
    if "spikes" in x or any(f"{s}_{k}" in x for s in _SERIES for k in ("zscore", "spikes_total")):
        kw["spikes"] = {"flagged": list(x.get("spikes") or []),
                        "zscore": {s: x[f"{s}_zscore"] for s in _SERIES if f"{s}_zscore" in x},
                        "total": {s: x[f"{s}_spikes_total"] for s in _SERIES if f"{s}_spikes_total" in x}}
    if any(k in x for k in ("vanishing_params", "exploding_params", "vanishing", "exploding")):
        van, exp = list(x.get("vanishing") or []), list(x.get("exploding") or [])
        kw["health"] = {"n_vanishing": int(x.get("vanishing_params", len(van))),
                        "n_exploding": int(x.get("exploding_params", len(exp))), "vanishing": van, "exploding": exp}
    if "clip_ratio" in x:
        kw["clip"] = {"ratio": x["clip_ratio"], "post_clip_norm": x.get("post_clip_norm", float("nan"))}
    if any(k in x for k in (*_AGG_KEYS, "exported_params")):
        kw["aggregates"] = {**{k: x.get(k) or {} for k in _AGG_KEYS}, "exported_params": x.get("exported_params")}
    if "consecutive_overflow_steps" in x or "loss_scale_at_minimum" in x:
        kw["scaler"] = {"consecutive_overflow_steps": int(x.get("consecutive_overflow_steps", 0)),
                        "loss_scale_at_minimum": bool(x.get("loss_scale_at_minimum", 0))}
    return kw


# the loss-analysis parts (distgrad/record/loss.py), registered here so that every record reads them
