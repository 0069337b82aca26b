"""Forward-pass overflow tracer: which module first produced Inf/NaN (or a too-large value).

After HuggingFace transformers' ``DebugUnderflowOverflow`` (``transformers/debug_utils.py``):
forward hooks on every module record, per call, the absolute min / max of the module's own
weights, its inputs and its outputs ("frames"), and the first module whose output holds NaN/Inf
is reported together with the frames that led to it. Differences from the original:

* bounded in time: it traces the next ``max_micro_batches`` forward passes of the root module
  and then removes its hooks (:meth:`OverflowTracer.disarm`); it never raises into training;
* one host synchronisation per micro-batch instead of one per tensor: the statistics are
  computed as device tensors in the hooks and copied to the host when the root module's
  forward returns, then scanned in call order;
* non-finite elements are counted, and an optional ``abs_max_limit`` flags finite outputs that
  are too large (e.g. close to fp16's 65504) before they overflow;
* handles tuple / list / dict (``ModelOutput``) / dataclass outputs, keyword inputs, and
  non-tensor values (recorded by type only).

Hook order: a module's forward hook fires when its ``forward`` returns, i.e. children before
parents, so the first frame with a non-finite output is the innermost module that produced it.
Only calls made while the root module's forward is running are recorded (activation
recomputation during backward is ignored).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["OverflowTracer", "render_report"]

_MAX_DEPTH = 4


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2 / TP): this rank's shard
    if callable(to_local):
        t = to_local()
    return t.detach()


class OverflowTracer:
    """Trace per-module abs-min / abs-max of weights, inputs and outputs for K forward passes.

    Source: HuggingFace transformers ``DebugUnderflowOverflow`` (``debug_utils.py``), same
    frame content (module name and class; ``abs min`` / ``abs max`` of each weight,
    ``input[i]`` and ``output``), bounded frame buffer (``max_frames_to_save`` there).

    Usage::

        tracer = OverflowTracer(model, max_micro_batches=4, abs_max_limit=6e4)
        tracer.arm()
        ...  # the next 4 forward passes of ``model`` are traced (fewer if an event is
             # found), then the hooks are removed
        print(tracer.render()); rep = tracer.report()

    Cost while armed: per module call, two abs-reductions and one non-finite count per floating
    tensor (a boolean temporary the size of the tensor), plus one device-to-host copy per
    micro-batch. Under ZeRO-3 the weights may already be released when the hook runs (shown with
    ``numel`` 0); under FSDP2 / DTensor the local shard is measured.

    Args:
        model: root module; every submodule (``named_modules``, shared modules once) is hooked.
        max_micro_batches: forward passes of ``model`` to trace before disarming (>= 1).
        abs_max_limit: if set, a finite output whose abs-max exceeds it is also an event
            (same unit as the activations).
        max_frames: frames kept (>= 1): the last ``max_frames`` up to and including the event,
            or the last ``max_frames`` traced when there is none.
        max_tensors_per_frame: entries recorded per frame and side (weights / inputs /
            outputs), bounding the cost for modules returning many tensors.

    The tracer also disarms at the end of the micro-batch in which the first event is found
    (the frames are frozen at that event; nothing after it is of diagnostic use).

    Raises:
        ValueError: on ``max_micro_batches < 1``, ``max_frames < 1`` or a non-positive limit.
    """

    def __init__(
        self,
        model: nn.Module,
        max_micro_batches: int = 1,
        abs_max_limit: float | None = None,
        max_frames: int = 64,
        max_tensors_per_frame: int = 16,
    ) -> None:
        if int(max_micro_batches) < 1:
            raise ValueError(f"max_micro_batches must be >= 1, got {max_micro_batches}")
        if int(max_frames) < 1:
            raise ValueError(f"max_frames must be >= 1, got {max_frames}")
        if abs_max_limit is not None and not float(abs_max_limit) > 0:
            raise ValueError(f"abs_max_limit must be > 0, got {abs_max_limit}")
        self.model = model
        self.max_micro_batches = int(max_micro_batches)
        self.abs_max_limit = None if abs_max_limit is None else float(abs_max_limit)
        self.max_frames = int(max_frames)
        self.max_tensors_per_frame = max(1, int(max_tensors_per_frame))
        self._handles: list[Any] = []
        self._reset()

    # ----------------------------------------------------------------------------- lifecycle

    def _reset(self) -> None:
        self._frames: deque[dict[str, Any]] = deque(maxlen=self.max_frames)
        self._frames_dropped = 0
        self._pending: list[tuple[dict[str, Any], list[tuple[dict[str, Any], torch.Tensor]]]] = []
        self._depth = 0
        self._calls = 0
        self.micro_batches = 0
        self.event: dict[str, Any] | None = None
        self.internal_error: str | None = None  # last failure inside the tracer, if any

    @property
    def armed(self) -> bool:
        """True while hooks are registered."""
        return bool(self._handles)

    def arm(self, max_micro_batches: int | None = None) -> OverflowTracer:
        """Register the hooks and start a fresh trace (previous frames and event discarded).

        Args:
            max_micro_batches: overrides the constructor's value for this trace.

        Returns:
            self.
        """
        self.disarm()
        if max_micro_batches is not None:
            if int(max_micro_batches) < 1:
                raise ValueError(f"max_micro_batches must be >= 1, got {max_micro_batches}")
            self.max_micro_batches = int(max_micro_batches)
        self._reset()
        self._names: dict[nn.Module, str] = {}
        for name, m in self.model.named_modules():
            self._names.setdefault(m, name)
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook))
        for m in self._names:
            if m is self.model:
                continue
            self._handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
        self._handles.append(
            self.model.register_forward_hook(self._root_hook, with_kwargs=True, always_call=True)
        )
        return self

    def disarm(self) -> None:
        """Remove all hooks (idempotent); frames and the event stay available."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending = []
        self._depth = 0

    def __enter__(self) -> OverflowTracer:
        return self.arm()

    def __exit__(self, *exc: Any) -> None:
        self.disarm()

    # ----------------------------------------------------------------------------- hooks

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._calls = 0
            self._pending = []
        self._depth += 1

    def _hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._depth <= 0 or self.event is not None:
            return
        try:
            self._capture(module, args, kwargs, output)
        except Exception as e:  # never break training for a debugging aid
            self.internal_error = f"{type(e).__name__}: {e}"[:200]

    def _root_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._depth <= 0:
            return
        if self._depth == 1:
            self._hook(module, args, kwargs, output)
            exc = sys.exc_info()[1]  # set when torch calls this always_call hook on an exception
            if output is None and exc is not None and self._pending:
                self._pending[-1][0]["error"] = f"{type(exc).__name__}: {exc}"[:200]
        self._depth -= 1
        if self._depth > 0:
            return
        try:
            self._finish_micro_batch()
        except Exception as e:  # never break training for a debugging aid
            self.internal_error = f"{type(e).__name__}: {e}"[:200]
        finally:
            self.micro_batches += 1
            done = self.micro_batches >= self.max_micro_batches
            if done or self.event is not None:
                self.disarm()

    # ----------------------------------------------------------------------------- capture

    def _capture(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        frame: dict[str, Any] = {
            "micro_batch": self.micro_batches,
            "call": self._calls,
            "module": self._names.get(module, "?") or "<root>",
            "type": type(module).__name__,
            "weights": [],
            "inputs": [],
            "outputs": [],
        }
        self._calls += 1
        stats: list[tuple[dict[str, Any], torch.Tensor]] = []
        cap = self.max_tensors_per_frame
        for pname, p in module.named_parameters(recurse=False):
            if len(frame["weights"]) >= cap:
                break
            self._leaf(p, pname, frame["weights"], stats)
        leaves_in: list[tuple[str, Any]] = []
        _walk(args, "input", leaves_in, 0, cap)
        if kwargs:
            _walk(dict(kwargs), "input", leaves_in, 0, cap)
        for where, v in leaves_in[:cap]:
            self._leaf(v, where, frame["inputs"], stats)
        leaves_out: list[tuple[str, Any]] = []
        _walk(output, "output", leaves_out, 0, cap)
        for where, v in leaves_out[:cap]:
            self._leaf(v, where, frame["outputs"], stats)
        self._pending.append((frame, stats))

    @staticmethod
    @torch.no_grad()
    def _leaf(
        v: Any, where: str, entries: list[dict[str, Any]], stats: list[tuple[dict[str, Any], Any]]
    ) -> None:
        if not isinstance(v, torch.Tensor):
            entries.append({"where": where, "type": type(v).__name__})
            return
        t = _local(v)
        e: dict[str, Any] = {
            "where": where,
            "dtype": str(t.dtype).replace("torch.", ""),
            "shape": list(t.shape),
            "numel": t.numel(),
        }
        entries.append(e)
        if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
            return
        s = torch.stack(
            [
                torch.linalg.vector_norm(t, float("-inf")).to(torch.float64),
                torch.linalg.vector_norm(t, float("inf")).to(torch.float64),
                torch.count_nonzero(~torch.isfinite(t)).to(torch.float64),
            ]
        )
        stats.append((e, s))

    def _finish_micro_batch(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        # one device-to-host copy per device
        by_dev: dict[torch.device, list[tuple[dict[str, Any], torch.Tensor]]] = {}
        for _, st in pending:
            for e, s in st:
                by_dev.setdefault(s.device, []).append((e, s))
        for items in by_dev.values():
            vals = torch.stack([s for _, s in items]).cpu().tolist()
            for (e, _), (lo, hi, nf) in zip(items, vals):
                e["abs_min"], e["abs_max"], e["nonfinite"] = lo, hi, int(nf)
        for frame, _ in pending:
            if self.event is not None:
                break
            self._frames_dropped += len(self._frames) == self._frames.maxlen
            self._frames.append(frame)
            ev = self._check(frame)
            if ev is not None:
                self.event = ev

    def _check(self, frame: dict[str, Any]) -> dict[str, Any] | None:
        def ev(kind: str, e: dict[str, Any]) -> dict[str, Any]:
            return {
                "kind": kind,
                "module": frame["module"],
                "type": frame["type"],
                "micro_batch": frame["micro_batch"],
                "call": frame["call"],
                "where": e["where"],
                "abs_max": e.get("abs_max"),
                "nonfinite": e.get("nonfinite"),
            }

        for e in frame["outputs"]:
            if e.get("nonfinite", 0) > 0:
                return ev("nonfinite_output", e)
        for e in frame["weights"]:
            if e.get("nonfinite", 0) > 0:
                return ev("nonfinite_weight", e)
        if self.abs_max_limit is not None:
            for e in frame["outputs"]:
                if e.get("abs_max") is not None and e["abs_max"] > self.abs_max_limit:
                    return ev("abs_max_output", e)
        return None

    # ----------------------------------------------------------------------------- output

    def report(self) -> dict[str, Any]:
        """JSON-serialisable trace::

            {"armed": bool, "micro_batches_traced": int, "max_micro_batches": int,
             "abs_max_limit": float | None,
             "event": None | {"kind": "nonfinite_output" | "nonfinite_weight" | "abs_max_output",
                              "module": str, "type": str, "micro_batch": int, "call": int,
                              "where": str, "abs_max": float, "nonfinite": int},
             "frames": [{"micro_batch", "call", "module", "type",
                         "weights" | "inputs" | "outputs": [{"where", "dtype", "shape", "numel",
                                                             "abs_min", "abs_max", "nonfinite"}
                                                            | {"where", "type"}]}],
             "frames_dropped": int, "internal_error": str | None}

        ``abs_min`` / ``abs_max`` are NaN when the tensor holds a NaN (as ``torch.amax``);
        ``call`` numbers module completions within the micro-batch (children first).
        """
        return {
            "armed": self.armed,
            "micro_batches_traced": self.micro_batches,
            "max_micro_batches": self.max_micro_batches,
            "abs_max_limit": self.abs_max_limit,
            "event": None if self.event is None else dict(self.event),
            "frames": list(self._frames),
            "frames_dropped": self._frames_dropped,
            "internal_error": self.internal_error,
        }

    def render(self) -> str:
        """Text rendering of :meth:`report` (see :func:`render_report`)."""
        return render_report(self.report())


def _walk(obj: Any, where: str, out: list[tuple[str, Any]], depth: int, cap: int) -> None:
    """Flatten nested inputs / outputs into ``(path, leaf)`` pairs (at most ``cap``)."""
    if len(out) >= cap:
        return
    if isinstance(obj, torch.Tensor) or depth >= _MAX_DEPTH:
        out.append((where, obj))
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            _walk(x, f"{where}[{i}]", out, depth + 1, cap)
    elif isinstance(obj, Mapping):
        for k, x in obj.items():
            _walk(x, f"{where}.{k}", out, depth + 1, cap)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name), f"{where}.{f.name}", out, depth + 1, cap)
    else:
        out.append((where, obj))


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:10.2e}"


def render_report(rep: dict[str, Any]) -> str:
    """HF ``DebugUnderflowOverflow``-style text of an :meth:`OverflowTracer.report` dict:
    a header naming the event, then per frame the module line and one ``abs min  abs max
    nonfinite  where`` row per weight / input / output."""
    lines = []
    ev = rep.get("event")
    if ev:
        lines.append(
            f"OverflowTracer: {ev['kind']} in {ev['module']} ({ev['type']}) at {ev['where']}, "
            f"micro-batch {ev['micro_batch']}, call {ev['call']}"
        )
    else:
        lines.append("OverflowTracer: no non-finite or over-limit output found")
    lines.append(
        f"traced {rep['micro_batches_traced']}/{rep['max_micro_batches']} micro-batches, "
        f"armed: {'yes' if rep['armed'] else 'no'}, abs_max_limit: {rep['abs_max_limit']}, "
        f"{len(rep['frames'])} frame(s) kept, {rep['frames_dropped']} dropped"
    )
    lines.append(f"{'abs min':>10} {'abs max':>10} {'nonfinite':>9}  where")
    for fr in rep["frames"]:
        err = f"  (forward raised {fr['error']})" if fr.get("error") else ""
        lines.append(
            f"{'':>31}  [mb {fr['micro_batch']} call {fr['call']}] {fr['module']} {fr['type']}{err}"
        )
        for side in ("weights", "inputs", "outputs"):
            for e in fr[side]:
                if "type" in e and "dtype" not in e:
                    lines.append(f"{'not a tensor':>21} {'':>9}  {e['where']} ({e['type']})")
                elif "abs_max" in e:
                    lines.append(
                        f"{_num(e['abs_min'])} {_num(e['abs_max'])} {e['nonfinite']:>9d}  "
                        f"{e['where']} {e['dtype']}{e['shape']}"
                    )
                else:
                    lines.append(
                        f"{'-':>10} {'-':>10} {'-':>9}  {e['where']} {e['dtype']}{e['shape']}"
                    )
    return "\n".join(lines) + "\n"
