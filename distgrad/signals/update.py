"""Update geometry for any optimizer (opt-in, ``update_geometry.enabled``): the update the
optimizer *applied*, measured from the parameters before and after its step, so it is the same
signal for SGD, AdamW, Muon, Adafactor, DeepSpeed's FusedAdam / DeepSpeedCPUAdam or any other
optimizer (issue #26, item 1).

Definitions, for the update ``dW = W_after - W_before`` of one optimizer step (``W`` this rank's
owned share of the master weights, :func:`distgrad.core.step_collectives.weight_pieces`, each
element counted once by exactly one rank under DDP, ZeRO 0-3, FSDP1/2 and HSDP):

- update RMS ``sqrt(sum dW**2 / n)`` (parameter units), per parameter, per layer label and
  overall;
- update/weight ratio ``||dW|| / ||W_before||`` (CS231n's "ratio of the update magnitudes to
  the value magnitudes", typically ~1e-3), per parameter, per layer and overall;
- opt-in (``update_geometry.spectral``), per matrix (a parameter of 2 or more dimensions viewed as
  ``shape[0] x rest``): a lower bound of the spectral norm ``sigma_max(dW)`` by a power iteration
  warm-started across sampled updates. Its two unit vectors ``v`` (columns) and ``u`` (rows) are
  the same on every rank; after the optimizer step the rank takes the partial products ``dW v``
  and ``dW^T u`` of its own elements (exact sums under any flat sharding: DDP slices, FSDP rows,
  ZeRO partitions that cut rows), which ride in the next sampled step's SUM collective; the
  estimate is ``max(|dW v|, |dW^T u|)`` (each at most ``sigma_max``, equal to it for the top
  singular vectors), and the vectors become ``u <- dW v / |dW v|``, ``v <- dW^T u / |dW^T u|``.
  The reduced products of update t arrive after update t+1's products are taken, so update t+2
  uses them: two interleaved chains, each a full power iteration every four sampled updates, on
  updates whose top singular directions move slowly (tests/test_update_geometry.py: within 1e-3
  of sigma_max after 30 sampled steps of a fixed update). The vectors are checkpointed.
- Muon (``torch.optim.Muon``, whose step is ``W <- (1 - lr wd) W - lr_adj O``, ``O`` the
  Newton-Schulz orthogonalised momentum): the RMS of the orthogonalised step
  ``W_after - (1 - lr wd) W_before`` divided by ``lr``, over the Muon parameters. With
  ``adjust_lr_fn="match_rms_adamw"`` (``lr_adj = 0.2 lr sqrt(max(A, B))``) it is about 0.2 by
  construction (Moonlight, Liu et al. 2025, arXiv 2502.16982, section 2.2: the update RMS matched
  to AdamW's 0.2-0.4); the exported ratio to that target (``muon_rms_ratio``) reads ~0.9 with
  torch's quintic Newton-Schulz (singular values in ~[0.7, 1.1]), and drifts away when the
  orthogonalisation breaks down (a rank-deficient or non-finite momentum).
- Adafactor (``torch.optim.Adafactor``): the trace of its second-moment estimate after the step
  (the one the step divided by): ``sum(variance)`` for vectors and, for matrices, the factored
  ``V = row_var col_var / max(mean(row_var), eps1)`` whose trace is
  ``sum(col_var) sum(row_var) / max(mean(row_var), eps1)`` (Shazeer and Stern 2018, arXiv
  1804.04235, Algorithm 4; torch's ``_single_tensor_adafactor``). Matrices are read on the first
  holder of a replicated parameter (DDP, ZeRO-0); ZeRO-1/2 step Adafactor on flat partitions,
  where it keeps the unfactored ``variance``, read exactly per owned element; where a factored
  state is sharded (not located) the trace is absent (torch's Adafactor does not run on FSDP2's
  DTensors at all in torch 2.13).
- a failed-root counter: no optimizer shipped with torch 2.13 or DeepSpeed exposes one
  (Distributed Shampoo's root-inverse failures live in its own logger); not exported.

Timing: at a sampled step's boundary (:meth:`UpdateGeometry.local`, before the optimizer runs)
the rank copies its owned weight share; right after the optimizer step (``after_step``) it
computes every sum above on the device (no host sync) and frees the copy; the sums ride in the
*next* sampled step's SUM collective, so the record of sampled step ``s`` carries the update of
the previous sampled step (``Part.step``). No extra collective, no host read. A step whose copy
is missing on any rank (the first sampled step, a refused step, a failure) has no part.

Memory: one copy of the rank's owned weight share (float32: 4 bytes per owned element; under
DDP each rank owns 1/W of each parameter). On accelerators it is allocated at the boundary of a
sampled step and freed at the end of its optimizer step (the caching allocator reuses it); on the
CPU its buffers are kept from one sampled step to the next, since a fresh allocation there costs
a page fault per 4 KiB (22 ms against 1.9 ms for a 5.45M-element copy, measured). Plus the
spectral vectors (``sum over matrices of rows + cols`` float64).
Collectives: ``1 + 4 P + 4`` float64 in the SUM part (plus ``sum(rows + cols)`` with ``spectral``),
nothing in the MAX part. Cost: one read of the owned weights at the copy, one read of the weights
and the copy after the step (two with Muon parameters), on sampled steps only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.engines.base import GradSource, slice_for_rank
from distgrad.export.metrics import Metric, condition
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal
from distgrad.signals.adam import _inner_optimizer
from distgrad.stats.eager import sum_of_squares

#: per-parameter SUM columns: sum dW^2, sum W_before^2, Muon's sum (orthogonalised step / lr)^2,
#: Adafactor's second-moment trace
COLS = 4
#: Moonlight's update RMS target of Muon with ``adjust_lr_fn="match_rms_adamw"`` (arXiv 2502.16982)
MUON_TARGET = 0.2
#: overall SUM columns after the per-parameter ones: Muon's owned elements, Muon entries not on
#: ``match_rms_adamw``, Adafactor entries seen, Adafactor entries whose factored state is not located
N_EXTRA = 4


def _shape(p: Any) -> tuple[int, ...]:
    """The full (unsharded) shape of a parameter (DeepSpeed ZeRO-3: ``ds_shape``)."""
    s = getattr(p, "ds_shape", None)
    return tuple(int(x) for x in (s if s is not None else p.shape))


def matrix_products(d: torch.Tensor, start: int, cols: int, v: torch.Tensor,
                    u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial ``(A v, A^T u)`` of the elements ``d`` (1-D) of a row-major ``rows x cols`` matrix A
    at flat positions ``[start, start + d.numel())``, the other elements taken as 0.

    Args:
        d: 1-D float tensor, the rank's piece of A.
        start: flat offset of ``d[0]`` in A.
        cols: columns of A.
        v: ``[cols]`` float32, u: ``[rows]`` float32, on ``d``'s device.

    Returns:
        ``([rows], [cols])`` float64 on ``d``'s device: summed over ranks holding disjoint pieces
        they give ``A v`` and ``A^T u`` exactly (up to float32 products).
    """
    rows = u.numel()
    av = torch.zeros(rows, dtype=torch.float64, device=d.device)
    atu = torch.zeros(cols, dtype=torch.float64, device=d.device)
    d = d.float()
    pos, end = start, start + d.numel()
    if pos % cols and pos < end:  # the partial first row
        r, c0 = divmod(pos, cols)
        c1 = min(cols, c0 + end - pos)
        seg = d[: c1 - c0]
        av[r] += torch.dot(seg, v[c0:c1]).double()
        atu[c0:c1] += (seg * u[r]).double()
        pos += c1 - c0
    full = (end - pos) // cols
    if full:  # whole rows: a view, no copy
        r = pos // cols
        m = d[pos - start: pos - start + full * cols].view(full, cols)
        av[r:r + full] += (m @ v).double()
        atu += (m.t() @ u[r:r + full]).double()
        pos += full * cols
    if pos < end:  # the partial last row
        r = pos // cols
        seg = d[pos - start:]
        av[r] += torch.dot(seg, v[: seg.numel()]).double()
        atu[: seg.numel()] += (seg * u[r]).double()
    return av, atu


class UpdateGeometry(PackedSignal):
    """Applied-update RMS, update/weight ratio, spectral norm and optimizer extras (module docstring).

    Args:
        inst: the instrument (names, source, ownership, configuration).

    SUM part (float64 ``[1 + 4 P + S]``): ``[1 if this rank holds the sums of the previous sampled
    update, then per parameter (sum dW^2, sum W_before^2, Muon's sum (step/lr)^2, Adafactor's
    trace), then the spectral partial products]``. Record part: :class:`UpdateGeometry.Part`
    (``StepRecord.update_geometry``).
    """

    name = "update_geometry"

    class Config(Section):
        """Update geometry for any optimizer: the RMS, update/weight ratio and (opt-in) spectral norm
        of the update the optimizer applied, measured from the weights before and after its step
        (see docs/signals.md, "Update geometry")."""

        section_key: ClassVar[str] = "update_geometry"
        enabled: bool = Field(False, description=(
            "Measure the applied update of each sampled optimizer step from the weights before and "
            "after it (any optimizer): its RMS and update/weight ratio per parameter, per layer and "
            "overall, Muon's update RMS against its 0.2 target and Adafactor's second-moment trace. "
            "Keeps a float32 copy of this rank's owned weight share from the boundary to the end of "
            "the optimizer step of sampled steps; the sums ride in the next sampled step's SUM "
            "collective (4 float64 per parameter), so a record carries the previous sampled update."))
        spectral: bool = Field(False, description=(
            "With update_geometry.enabled (alone it is refused), also estimate the spectral norm of each "
            "matrix's update by a power iteration warm-started "
            "across sampled updates (a lower bound that converges while the update's top direction moves "
            "slowly: a full iteration every four sampled updates per chain); adds rows + cols float64 per "
            "matrix to the SUM collective and keeps two unit vectors per matrix (checkpointed)."))

    @dataclass
    class Part(_Part):
        """The update the optimizer applied at optimizer step ``step`` (the previous sampled step),
        ``dW = W_after - W_before`` over every element of every parameter.

        Attributes:
            step: the optimizer step whose update this is.
            applied: False when that step's update was skipped (fp16 overflow, the opt-in action):
                every value below is then 0.
            optimizer: the optimizer's class name.
            update_rms: ``sqrt(sum dW^2 / n)`` over all parameters (parameter units).
            update_ratio: ``||dW|| / ||W_before||`` over all parameters (None when ``W_before`` is 0).
            layer_update_rms, layer_update_ratio: the same per layer label.
            param_update_rms, param_update_ratio: the same per parameter name.
            param_update_spectral: ``{matrix: lower bound of sigma_max(dW)}`` (``spectral``).
            layer_update_spectral: the largest of them per layer.
            muon_rms_per_lr: RMS of Muon's orthogonalised step ``W_after - (1 - lr wd) W_before``
                divided by ``lr``, over the Muon parameters (None without Muon).
            muon_rms_ratio: ``muon_rms_per_lr / 0.2`` when every Muon group uses
                ``adjust_lr_fn="match_rms_adamw"`` (about 0.9 healthy), else None.
            adafactor_trace: trace of Adafactor's second-moment estimate after the step, None
                without Adafactor or when a factored state is not located (sharded layouts).
        """

        step: int = 0
        applied: bool = True
        optimizer: str = ""
        update_rms: float = 0.0
        update_ratio: float | None = None
        layer_update_rms: dict[str, float] = field(default_factory=dict)
        layer_update_ratio: dict[str, float] = field(default_factory=dict)
        param_update_rms: dict[str, float] = field(default_factory=dict)
        param_update_ratio: dict[str, float] = field(default_factory=dict)
        param_update_spectral: dict[str, float] = field(default_factory=dict)
        layer_update_spectral: dict[str, float] = field(default_factory=dict)
        muon_rms_per_lr: float | None = None
        muon_rms_ratio: float | None = None
        adafactor_trace: float | None = None

    _when = condition("update_geometry", "`update_geometry.enabled: true`, from the second sampled step on "
                      "(a record carries the previous sampled update)",
                      enabled=lambda c: c.update_geometry.enabled)
    _spec = condition("update_geometry_spectral", "`update_geometry.enabled` and `update_geometry.spectral`, "
                      "for layers with a matrix parameter",
                      enabled=lambda c: c.update_geometry.enabled and c.update_geometry.spectral)
    _muon = condition("update_geometry_muon", "`update_geometry.enabled` with torch.optim.Muon parameters",
                      enabled=lambda c: c.update_geometry.enabled)
    _adaf = condition("update_geometry_adafactor", "`update_geometry.enabled` with torch.optim.Adafactor, "
                      "its factored state located (not under FSDP / ZeRO)",
                      enabled=lambda c: c.update_geometry.enabled)
    METRICS = (
        Metric("distgrad_applied_update_rms", "gauge", (), "param", "RMS of the update the optimizer applied "
               "at the last measured step, from the weights before and after it (any optimizer).", _when),
        Metric("distgrad_applied_update_ratio", "gauge", (), "ratio", "||dW|| / ||W|| of the last measured "
               "update over all parameters (typically ~1e-3).", _when),
        Metric("distgrad_applied_update_step", "gauge", (), "steps", "Optimizer step whose update the "
               "applied-update gauges describe (the previous sampled step).", _when),
        Metric("distgrad_layer_applied_update_rms", "gauge", ("layer",), "param", "RMS of the applied update "
               "over the layer's parameters.", _when),
        Metric("distgrad_layer_applied_update_ratio", "gauge", ("layer",), "ratio", "||dW|| / ||W|| of the "
               "applied update over the layer's parameters.", _when,
               doc="update/weight ratio of the last measured applied update over the layer's parameters "
                   "(`update_geometry.enabled`; CS231n's ~1e-3 rule of thumb; DistgradUpdateRatioHigh)"),
        Metric("distgrad_layer_applied_update_spectral_norm", "gauge", ("layer",), "param", "Largest spectral "
               "norm (power-iteration lower bound) of the applied update of the layer's matrices.", _spec),
        Metric("distgrad_muon_update_rms_per_lr", "gauge", (), "1", "RMS of Muon's orthogonalised step divided "
               "by the learning rate (0.2 targeted by adjust_lr_fn=match_rms_adamw).", _muon),
        Metric("distgrad_adafactor_second_moment_trace", "gauge", (), "grad^2", "Trace of Adafactor's (factored) "
               "second-moment estimate after the last measured step.", _adaf),
    )

    @staticmethod
    def samples(part: UpdateGeometry.Part) -> dict[str, Any]:
        """The overall and per-layer gauges (absent: no value)."""
        return {"distgrad_applied_update_rms": part.update_rms,
                "distgrad_applied_update_ratio": part.update_ratio,
                "distgrad_applied_update_step": part.step,
                "distgrad_layer_applied_update_rms": part.layer_update_rms,
                "distgrad_layer_applied_update_ratio": part.layer_update_ratio,
                "distgrad_layer_applied_update_spectral_norm": part.layer_update_spectral or None,
                "distgrad_muon_update_rms_per_lr": part.muon_rms_per_lr,
                "distgrad_adafactor_second_moment_trace": part.adafactor_trace}

    @classmethod
    def build(cls, inst: Any) -> UpdateGeometry | None:
        """``update_geometry.enabled``: the signal, or None when off.

        Raises:
            ConfigError: the engine does not locate its weight shards (``update_geometry.enabled``);
                ``update_geometry.spectral`` without ``update_geometry.enabled`` (it would measure
                nothing).
        """
        if not inst.config.update_geometry.enabled:
            if inst.config.update_geometry.spectral:
                raise ConfigError("distgrad config: 'update_geometry.spectral' is the spectral norm of the update "
                                  "'update_geometry.enabled' measures, which is off: set update_geometry.enabled: true "
                                  "as well (or spectral: false)")
            return None
        if type(inst.source).local_param_pieces is GradSource.local_param_pieces:
            raise ConfigError(f"distgrad config: 'update_geometry.enabled' is not supported on engine "
                              f"{inst.source.engine_name!r}: its weight shards are not located")
        return cls(inst)

    def __init__(self, inst: Any) -> None:
        self.names = list(inst.names)
        self.n = len(self.names)
        keys = group_keys(self.names, "layer", inst.config.naming.tuples)
        self.layers = sorted(set(keys))
        self.inv = np.array([self.layers.index(k) for k in keys], dtype=np.int64)
        self.numels = np.array([float(x) for x in inst.pieces(list(inst.source.numels))], dtype=np.float64)
        opt = _inner_optimizer(inst)
        self.opt_name = type(opt).__name__ if opt is not None else "unknown"
        params = inst.pieces(list(getattr(inst.source, "_params", [None] * len(inst.source.numels))))
        self.shapes: list[tuple[int, ...] | None] = [None if p is None else _shape(p) for p in params]
        self.spectral = bool(inst.config.update_geometry.spectral)
        #: matrices: (param index, rows, cols, offset into the spectral block)
        self.mats: list[tuple[int, int, int, int]] = []
        off = 0
        if self.spectral:
            for i, s in enumerate(self.shapes):
                if s is not None and len(s) >= 2 and self.numels[i] > 0:
                    rows = s[0]
                    cols = int(self.numels[i]) // rows
                    self.mats.append((i, rows, cols, off))
                    off += rows + cols
        self.spec_size = off
        gen = torch.Generator().manual_seed(0)  # the same start on every rank
        self.v: list[torch.Tensor] = []
        self.u: list[torch.Tensor] = []
        for _, rows, cols, _ in self.mats:
            self.v.append(_unit(torch.randn(cols, generator=gen, dtype=torch.float64)))
            self.u.append(_unit(torch.randn(rows, generator=gen, dtype=torch.float64)))
        self._before: list[torch.Tensor | None] | None = None
        self._info: dict[str, Any] | None = None  # the copy's step and hyperparameters
        self._pending: torch.Tensor | None = None  # after_step's sums, for the next local()
        self._pending_info: dict[str, Any] | None = None
        self._sent: dict[str, Any] | None = None  # what local() put in this step's SUM part
        self._offsets: list[int] | None = None
        #: CPU only: the copies' buffers, reused from one sampled step to the next (module docstring)
        self._kept: list[torch.Tensor | None] | None = None

    @property
    def sum_size(self) -> int:
        return 1 + COLS * self.n + N_EXTRA + self.spec_size

    # -- device side ----------------------------------------------------------------------------
    def _owned_offsets(self, inst: Any) -> list[int]:
        """Per parameter, the flat offset of this rank's owned weight piece in the full parameter
        (the source's piece offset plus the ownership slice's start)."""
        if self._offsets is None:
            offs = inst.pieces(list(inst.source.local_offsets()))
            pieces = inst.pieces(list(inst.source.local_param_pieces()))
            out = []
            for i, (o, p) in enumerate(zip(offs, pieces)):
                base = 0 if o is None else int(o[0])
                c, k = inst.own.copies[i], inst.own.index[i]
                if c > 1 and p is not None:
                    n = p.numel()
                    base += min(n, k * (-(-n // c)))
                out.append(base)
            self._offsets = out
        return self._offsets

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, None]:
        from distgrad.core.step_collectives import weight_pieces

        pending, self._pending = self._pending, None
        self._sent, self._pending_info = self._pending_info, None
        self._before = None
        out = torch.zeros(self.sum_size, dtype=torch.float64, device=device)
        if pending is not None and self._sent is not None:
            out[0] = 1.0
            out[1:] = pending.to(device)
        else:
            self._sent = None
        # the copy for this step's update, and the hyperparameters the optimizer is about to use
        self._before = self._copies(weight_pieces(inst))
        self._info = {"step": int(getattr(inst, "sampled_step", 0) or 0), "hyper": self._hyper(inst)}
        return out, None

    def _copies(self, weights: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """float32 (float64 kept) copies of the weight pieces: fresh tensors on accelerators
        (the caching allocator takes them back after the step), buffers kept between sampled steps
        on the CPU (a fresh allocation there costs a page fault per 4 KiB: 22 ms against 1.9 ms for
        5.45M elements, measured on this project's 2-core machine)."""
        kept = self._kept
        out: list[torch.Tensor | None] = []
        for i, w in enumerate(weights):
            if w is None:
                out.append(None)
                continue
            w = w.detach()
            dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
            if w.device.type != "cpu":
                out.append(w.to(dtype=dtype, copy=True))
                continue
            b = kept[i] if kept is not None and i < len(kept) else None
            if b is None or b.shape != w.shape or b.dtype != dtype:
                b = torch.empty(w.shape, dtype=dtype)
            out.append(b.copy_(w))
        if out and all(b is None or b.device.type == "cpu" for b in out):
            self._kept = out
        return out

    def _hyper(self, inst: Any) -> list[tuple[str, float, float, str | None, Any] | None]:
        """Per parameter ``(optimizer, lr, weight_decay, adjust_lr_fn, slot)`` of the optimizer
        entry that steps it, or None."""
        try:
            slots = inst.pieces(inst.source.optimizer_slots() or [None] * len(inst.source.numels))
        except Exception:  # noqa: BLE001 - the extras are then absent; the geometry does not need them
            slots = [None] * self.n
        out: list[tuple[str, float, float, str | None, Any] | None] = []
        for s in slots:
            if s is None:
                out.append(None)
                continue
            g = s.group
            lr = g.get("lr", 0.0)
            lr = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.item())
            out.append((type(s.optimizer).__name__, lr, float(g.get("weight_decay", 0.0) or 0.0),
                        g.get("adjust_lr_fn"), s))
        return out

    def after_step(self, inst: Any, step_applied: bool) -> None:
        from distgrad.core.step_collectives import weight_pieces

        before, info = self._before, self._info
        self._before = self._info = None
        if before is None or info is None:
            return
        after = weight_pieces(inst)
        dev = next((b.device for b in before if b is not None), torch.device("cpu"))
        z = torch.zeros((), dtype=torch.float64, device=dev)
        cols: list[torch.Tensor] = []
        hyper = info["hyper"]
        muon_n = off_target = adaf_missing = adaf_seen = 0.0
        for i, (b, a) in enumerate(zip(before, after)):
            h = hyper[i] if i < len(hyper) else None
            if b is None or a is None or b.numel() == 0 or a.numel() != b.numel():
                cols += [z, z, z, z]
                continue
            a = a.detach()
            wsq = sum_of_squares(b)
            muon = z
            if h is not None and h[0] == "Muon" and h[1] > 0:
                _, lr, wd, fn, _ = h
                step = a.float() - (1.0 - lr * wd) * b  # the orthogonalised step -lr_adj O
                muon = sum_of_squares(step) / (lr * lr)
                muon_n += float(b.numel())
                off_target += float(fn != "match_rms_adamw")
            torch.sub(a.float(), b, out=b)  # dW, in place of the copy
            dsq = sum_of_squares(b)
            adaf = z
            if h is not None and h[0] == "Adafactor":
                adaf_seen += 1.0
                t = self._adafactor_trace(inst, i, h)
                if t is None:
                    adaf_missing += 1.0
                else:
                    adaf = t.to(dev)
            cols += [dsq.to(dev), wsq.to(dev), muon.to(dev), adaf]
        extra = torch.tensor([muon_n, off_target, adaf_seen, adaf_missing], dtype=torch.float64).to(dev)
        body = torch.cat([torch.stack(cols), extra]) if cols else extra
        spec = []
        if self.mats:
            offs = self._owned_offsets(inst)
            for k, (i, rows, cols_, _) in enumerate(self.mats):
                d = before[i]
                if d is None:
                    spec += [torch.zeros(rows + cols_, dtype=torch.float64, device=dev)]
                    continue
                av, atu = matrix_products(d, offs[i], cols_, self.v[k].float().to(d.device),
                                          self.u[k].float().to(d.device))
                spec.append(torch.cat([av, atu]).to(dev))
        self._pending = torch.cat([body] + spec) if spec else body
        self._pending_info = {"step": info["step"], "applied": bool(step_applied)}

    def _adafactor_trace(self, inst: Any, i: int, h: tuple) -> torch.Tensor | None:
        """This rank's share of the trace of parameter i's Adafactor second moment (float64 0-d),
        or None when its factored state is not located here."""
        slot = h[4]
        st = slot.state
        if st.get("variance") is not None:  # a vector: elementwise, aligned with the pieces
            piece = slice_for_rank(slot.piece("variance"), inst.own.index[i], inst.own.copies[i])
            return None if piece is None else piece.double().sum()
        rv, cv = st.get("row_var"), st.get("col_var")
        if rv is None or cv is None:
            return None
        if type(rv).__name__ == "DTensor" or self.shapes[i] is None or tuple(slot.key.shape) != self.shapes[i] \
                or slot.key.numel() != int(self.numels[i]):
            return None  # a shard of the factored state (FSDP, ZeRO): not located
        if inst.own.index[i] != 0:  # replicated: the first holder counts it
            return torch.zeros((), dtype=torch.float64, device=rv.device)
        eps = slot.group.get("eps")
        eps1 = eps[0] if isinstance(eps, (tuple, list)) else eps
        eps1 = float(torch.finfo(slot.key.dtype).eps) if eps1 is None else float(eps1)
        mean = rv.double().mean(dim=-2, keepdim=True).clamp(min=eps1)
        return (rv.double().sum(dim=-2, keepdim=True) / mean * cv.double().sum(dim=-1, keepdim=True)).sum()

    # -- host side ------------------------------------------------------------------------------
    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        sent, self._sent = self._sent, None
        if sent is None or sum_part[0] < inst.world_size:
            return  # a rank lacks the previous sampled update (first step, refused, failed)
        body = np.asarray(sum_part[1:1 + COLS * self.n], dtype=np.float64).reshape(self.n, COLS)
        dsq, wsq, msq, adaf = body[:, 0], body[:, 1], body[:, 2], body[:, 3]
        n = self.numels
        L = len(self.layers)
        ld = np.bincount(self.inv, weights=dsq, minlength=L)
        lw = np.bincount(self.inv, weights=wsq, minlength=L)
        ln = np.bincount(self.inv, weights=n, minlength=L)
        part = UpdateGeometry.Part(step=int(sent["step"]), applied=bool(sent["applied"]), optimizer=self.opt_name)
        part.update_rms = _rms(dsq.sum(), n.sum())
        part.update_ratio = _ratio(dsq.sum(), wsq.sum())
        part.layer_update_rms = {k: _rms(ld[j], ln[j]) for j, k in enumerate(self.layers) if ln[j] > 0}
        part.layer_update_ratio = {k: r for j, k in enumerate(self.layers)
                                   if (r := _ratio(ld[j], lw[j])) is not None}
        part.param_update_rms = {k: _rms(dsq[i], n[i]) for i, k in enumerate(self.names) if n[i] > 0}
        part.param_update_ratio = {k: r for i, k in enumerate(self.names) if (r := _ratio(dsq[i], wsq[i])) is not None}
        muon_n, off_target, adaf_seen, adaf_missing = (float(x) for x in sum_part[1 + COLS * self.n:][:N_EXTRA])
        if muon_n > 0:
            part.muon_rms_per_lr = _rms(msq.sum(), muon_n)
            if off_target == 0:
                part.muon_rms_ratio = part.muon_rms_per_lr / MUON_TARGET
        if adaf_seen > 0 and adaf_missing == 0:
            part.adafactor_trace = float(adaf.sum())
        if self.mats:
            spec = np.asarray(sum_part[1 + COLS * self.n + N_EXTRA:], dtype=np.float64)
            for k, (i, rows, cols, off) in enumerate(self.mats):
                av, atu = spec[off:off + rows], spec[off + rows:off + rows + cols]
                a, b = float(np.linalg.norm(av)), float(np.linalg.norm(atu))
                if not (math.isfinite(a) and math.isfinite(b)):
                    continue
                part.param_update_spectral[self.names[i]] = max(a, b)
                if a > 0:
                    self.u[k] = torch.from_numpy(av / a)
                if b > 0:
                    self.v[k] = torch.from_numpy(atu / b)
            for i, k in enumerate(self.names):
                if k in part.param_update_spectral:
                    lk = self.layers[self.inv[i]]
                    part.layer_update_spectral[lk] = max(part.layer_update_spectral.get(lk, 0.0),
                                                         part.param_update_spectral[k])
        rec.update_geometry = part

    def state_dict(self) -> dict | None:
        if not self.mats:
            return None
        return {"v": [x.tolist() for x in self.v], "u": [x.tolist() for x in self.u]}

    def load_state_dict(self, state: dict) -> None:
        v, u = state.get("v"), state.get("u")
        if v is None or u is None or len(v) != len(self.v) or len(u) != len(self.u):
            return  # another model: keep the fresh start
        self.v = [torch.tensor(x, dtype=torch.float64) for x in v]
        self.u = [torch.tensor(x, dtype=torch.float64) for x in u]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


def _rms(sq: float, n: float) -> float:
    return math.sqrt(float(sq) / float(n)) if n > 0 else 0.0


def _ratio(dsq: float, wsq: float) -> float | None:
    return math.sqrt(float(dsq)) / math.sqrt(float(wsq)) if wsq > 0 else None
