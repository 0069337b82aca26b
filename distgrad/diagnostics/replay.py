"""The culprit module of a non-finite step: replay the offending micro-batch's forward under the
:class:`~distgrad.diagnostics.tracer.OverflowTracer` at the step's boundary and name the first module whose
output went NaN/Inf, on the culprit rank.

The culprit *rank* (:mod:`distgrad.diagnostics.culprit`) says whose own loss or gradient was non-finite;
the forward tracer armed *after* an event traces later, usually clean, batches. So
:class:`ForwardReplay` keeps, per rank, a *reference* (no copy) to the inputs of the micro-batches
of the current optimizer step (a forward pre-hook on the user's root module, ``with_kwargs``;
only forwards with gradients enabled, at most :data:`KEEP` per step, dropped at every boundary),
with the CPU (and current CUDA device) RNG state and the autocast state the forward ran under.

At the boundary of a sampled step whose *reduced* statistics are non-finite (every rank holds
the same reduced values, so every rank decides alike and the collectives stay matched), and
only on the first such step of each non-finite streak (at most ``tracer.replays`` per run):

1. each rank that must replay re-runs its kept micro-batches' forward through the root module,
   in order, under the tracer, with ``torch.no_grad()``, inside ``torch.random.fork_rng`` with
   each micro-batch's own RNG state set (dropout masks are those of the bad forward; the user's
   RNG streams are untouched afterwards), under the autocast state of the original forward;
   module buffers (BatchNorm running statistics) are copied before and restored after; the
   optimizer is not touched. The boundary runs before the optimizer consumes the gradients
   (PyTorch engines: the optimizer's step pre-hook, or ``scaler.step`` for a step it skips;
   DeepSpeed: ``_take_model_step``, before clipping and the update), so the weights are those
   of the bad forward. DDP replays through its inner module (no DDP forward collectives);
   sharded engines (FSDP1, FSDP2, DeepSpeed ZeRO-3) make all-gathers in the forward, so every
   rank replays all its micro-batches (their count checked equal on every rank first, by one
   MAX all-reduce); elsewhere only the culprit ranks replay (every rank when none is flagged)
   and stop at the first event;
2. one all-gather of 3 float64 per rank (status, module index into the fixed module-name list,
   micro-batch) carries the results; the first culprit rank (else the lowest rank) that found a
   module wins.

Python side effects of the model's forward code (logging, counters it keeps) happen once more
during a replay; tensors are not modified (``no_grad``, buffers restored, FSDP resharded after).

Cost, paid only on the first step of a non-finite streak: up to :data:`KEEP` forward passes under
``no_grad`` with the tracer's per-module reductions (one host copy per micro-batch), a copy of
the module buffers, one all-gather (plus one all-reduce on sharded engines). Every step: one
forward pre-hook storing references and a copy of the CPU RNG state (about 5 KB) per micro-batch.

When no module can be vouched for, :class:`~distgrad.record.culprit.CulpritModule` carries the
``outcome`` instead of a module (see :data:`OUTCOMES`): replay impossible or not run (``off``,
``budget``, ``async_records``: asynchronous records learn the reduced values one step late, after
the update; ``model_parallel``: pipeline stages / experts elsewhere; ``uneven_micro_batches``),
no input kept or an input tensor modified in place since its forward (``no_input``), the
micro-batch not among the :data:`KEEP` kept (``not_kept``), the replay raised (``failed``), the
weights already held NaN/Inf (``weights_nonfinite``), or the replay came out finite (``finite``:
the NaN came from the backward pass, the reduction, or an input the loop changed).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distgrad.diagnostics.tracer import OverflowTracer
from distgrad.naming.canonical import clean_name
from distgrad.record.culprit import OUTCOMES, CulpritModule
from distgrad.stats.layout import CULPRIT_LOSS, RANK_COLS, SUM_COLS

log = logging.getLogger("distgrad")

__all__ = ["ForwardReplay", "KEEP", "OUTCOMES", "decide", "nonfinite_verdict"]

#: micro-batches kept per optimizer step (the last ones); an older offending one is ``not_kept``
KEEP = 16

# per-rank status in the result all-gather
_NOT_ASKED, _FOUND, _FINITE, _FAILED, _NO_INPUT, _NOT_KEPT, _WEIGHTS = range(7)
_STATUS_OUTCOME = {_FINITE: "finite", _FAILED: "failed", _NO_INPUT: "no_input", _NOT_KEPT: "not_kept",
                   _WEIGHTS: "weights_nonfinite"}
#: when no rank found a module: the outcome reported, most telling first
_PRIORITY = (_WEIGHTS, _FAILED, _NO_INPUT, _NOT_KEPT, _FINITE)

_SHARDED = ("fsdp1", "fsdp2")


@dataclasses.dataclass
class _Kept:
    args: tuple
    kwargs: dict
    versions: list[tuple[torch.Tensor, int]]
    cpu_rng: torch.Tensor
    cuda_rng: tuple[int, torch.Tensor] | None
    autocast: list[tuple[str, bool, torch.dtype]]


def _tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for x in obj:
            _tensors(x, out, depth + 1)
    elif depth < 3 and isinstance(obj, Mapping):
        for x in obj.values():
            _tensors(x, out, depth + 1)


def nonfinite_verdict(host: np.ndarray, n_params: int, world: int, loss_scaler: bool) -> list[int] | None:
    """Whether a sampled step's reduced statistics call for a replay, from the reduced host
    array alone (identical on every rank).

    Args:
        host: the reduced float64 array of ``Instrument.collect`` (core SUM block first:
            ``[P, SUM_COLS]``, then ``[W, RANK_COLS]``, then loss sum and count).
        n_params, world: P and W of the layout.
        loss_scaler: the engine trains fp16 with a dynamic loss scaler: then a non-finite
            gradient with a finite loss and no rank's loss flagged is taken for an overflow the
            scaler handles, not replayed.

    Returns:
        None when the step is finite (or an overflow, or a rank failed / refused the step);
        else the culprit ranks (flags in the ``culprit`` slot, ascending; may be empty).
    """
    rank_off = n_params * len(SUM_COLS)
    tail = rank_off + world * len(RANK_COLS)
    per = host[:rank_off].reshape(n_params, len(SUM_COLS))
    ranks = host[rank_off:tail].reshape(world, len(RANK_COLS))
    if np.any(ranks[:, 2] != 0):
        return None  # a rank failed or refused: the step is dropped
    flags = np.nan_to_num(ranks[:, 3]).astype(np.int64)
    loss_bad = not np.isfinite(host[tail])
    grad_bad = bool(per[:, 3:5].sum() > 0) or not np.isfinite(per[:, 2].sum())
    if not (loss_bad or grad_bad or flags.any()):
        return None
    if loss_scaler and not loss_bad and not (flags & CULPRIT_LOSS).any():
        return None
    return [int(r) for r in np.flatnonzero(flags)]


def decide(gathered: np.ndarray, culprits: list[int]) -> tuple[str, int | None, int | None, int | None]:
    """The replay's result from every rank's ``(status, module index, micro-batch)`` row
    (``gathered``, float64 ``[W, 3]``): ``(outcome, rank, module index, micro-batch)``. A rank's
    non-finite weights win (nothing can be vouched for); then the first culprit rank that found a
    module, else the lowest rank that did; else the most telling failure (``_PRIORITY``)."""
    status = gathered[:, 0].astype(np.int64)
    if (status == _WEIGHTS).any():
        return "weights_nonfinite", int(np.flatnonzero(status == _WEIGHTS)[0]), None, None
    found = [int(r) for r in np.flatnonzero(status == _FOUND)]
    if found:
        r = next((c for c in culprits if c in found), found[0])
        return "found", r, int(gathered[r, 1]), int(gathered[r, 2])
    for s in _PRIORITY:
        if (status == s).any():
            return _STATUS_OUTCOME[s], None, None, None
    return "no_input", None, None, None


class ForwardReplay:
    """Keeps the current step's micro-batch inputs and replays them on a non-finite step (see the
    module docstring).

    Args:
        inst: the :class:`~distgrad.core.instrument.Instrument` (rank, world size, group, config,
            ``count_error``).
        root: the user's root module (DDP: its inner ``.module``; DeepSpeed: ``engine.module``).
        sharded: its forward makes collectives (FSDP1/2, ZeRO-3): every rank replays.
        impossible: an outcome that rules replay out for the whole run (``"model_parallel"``),
            or None.
    """

    def __init__(self, inst: Any, root: nn.Module, sharded: bool, impossible: str | None = None) -> None:
        self.inst, self.root, self.sharded, self.impossible = inst, root, sharded, impossible
        self.budget = int(inst.config.tracer.replays)
        self.modules = [clean_name(n, strip_module=False) or "<root>" for n, _ in root.named_modules()]
        self._index = {m: i for i, m in enumerate(self.modules)}
        self._kept: list[_Kept] = []
        self._dropped = 0
        self._in_streak = False
        self._async = False
        self._replaying = False
        self.replays = 0  #: replays made so far
        #: the last step's result (attached to its record), or None
        self.result: CulpritModule | None = None
        self.report: str | None = None  #: this rank's tracer text of the last replay
        #: the opt-in rerun attribution (distgrad.diagnostics.rerun.Rerun, set by its attach_rerun),
        #: fed the same kept micro-batches at the boundary
        self.rerun: Any = None
        keep = self.budget > 0 or bool(inst.config.rerun.enabled)
        self._handle = root.register_forward_pre_hook(self._pre, with_kwargs=True) if keep else None

    def remove(self) -> None:
        """Remove the forward pre-hook and drop the kept inputs."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._kept = []

    def state_dict(self) -> dict[str, Any]:
        """``{"replays": int, "in_streak": bool}`` for a checkpoint (the same on every rank), and
        the rerun attribution's under ``"rerun"`` when it is on."""
        sd: dict[str, Any] = {"replays": self.replays, "in_streak": self._in_streak}
        if self.rerun is not None:
            sd["rerun"] = self.rerun.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the budget of this run's config applies)."""
        self.replays = int(sd.get("replays", 0))
        self._in_streak = bool(sd.get("in_streak", False))
        if self.rerun is not None and isinstance(sd.get("rerun"), dict):
            self.rerun.load_state_dict(sd["rerun"])

    # ------------------------------------------------------------------------------- keeping
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._replaying or not torch.is_grad_enabled() or (self.rerun is not None and self.rerun.running):
            return None
        try:
            ts: list[torch.Tensor] = []
            _tensors(args, ts)
            _tensors(kwargs, ts)
            cuda = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                dev = torch.cuda.current_device()
                cuda = (dev, torch.cuda.get_rng_state(dev))
            ac = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
            self._kept.append(_Kept(tuple(args), dict(kwargs or {}), [(t, t._version) for t in ts],
                                    torch.get_rng_state(), cuda, ac))
            if len(self._kept) > KEEP:
                del self._kept[0]
                self._dropped += 1
        except Exception:  # noqa: BLE001 - never break the forward pass
            self.inst.count_error("keeping the micro-batch for the culprit-module replay")
        return None

    # ------------------------------------------------------------------------------- boundary
    def boundary(self, step: int, host: Any, sampled: bool) -> None:
        """At every optimizer-step boundary, on every rank, after the step's collectives and
        before the optimizer consumes the gradients. ``host``: the reduced host array of a
        sampled step (an asynchronous :class:`~distgrad.stats.HostCopy`, or None when the
        reduction failed). On the first non-finite sampled step of a streak, replays (see the
        module docstring) and sets :attr:`result`. Drops the kept inputs. Never raises."""
        kept, dropped = self._kept, self._dropped
        self._kept, self._dropped = [], 0
        if not sampled:
            return
        self.result = None
        try:
            self._decide(step, host, kept, dropped)
        except Exception:  # noqa: BLE001 - never break training; counted
            self.inst.count_error("culprit-module replay")
        finally:
            self._replaying = False
        if self.rerun is not None:  # after the replay: buffers restored, same weights, same inputs
            self.rerun.boundary(step, host, kept)

    def _decide(self, step: int, host: Any, kept: list[_Kept], dropped: int) -> None:
        inst = self.inst
        if host is None:
            return
        if not isinstance(host, np.ndarray):  # asynchronous records: reduced values come a step late
            self._async = True  # (the record says so: attach)
            return
        culprits = nonfinite_verdict(host, inst.layout.n_params, inst.world_size,
                                     bool(inst.source.has_loss_scaler()))
        if culprits is None:
            self._in_streak = False
            return
        if self._in_streak:
            return  # only the first step of a non-finite streak
        self._in_streak = True
        why_not = "off" if self.budget == 0 else "budget" if self.replays >= self.budget else self.impossible
        if why_not is not None:
            self.result = CulpritModule(step, why_not)
            return
        self.replays += 1
        if self.sharded and not self._even(len(kept)):
            self.result = CulpritModule(step, "uneven_micro_batches")
            return
        ask = self.sharded or not culprits or inst.rank in culprits
        row = (_NOT_ASKED, -1, -1)
        if ask:
            try:
                row = self._replay(kept, dropped, step)
            except Exception:  # noqa: BLE001 - the result all-gather below must still be made
                inst.count_error("culprit-module replay")
                row = (_FAILED, -1, -1)
        gathered = self._gather(row)
        outcome, rank, idx, mb = decide(gathered, culprits)
        if outcome == "found" and idx is not None:  # decide() names the module of a "found"
            self.result = CulpritModule(step, outcome, rank, self.modules[idx], mb)
        else:
            self.result = CulpritModule(step, outcome, rank)
        if inst.global_rank == 0:  # at INFO: the event's one WARNING line (rank 0) carries the result
            log.info("distgrad: step %d: forward replay of the non-finite step: %s", step, self.result.describe())

    def attach(self, rec: Any) -> None:
        """Put the result of ``rec``'s step into ``rec.culprit_module`` (when that step was
        replayed, or could not be). With asynchronous records the reduced values arrive after
        the update: the first non-finite record of a streak then says ``async_records``."""
        if self.rerun is not None:
            self.rerun.attach(rec)
        if self.result is not None and self.result.step == rec.step:
            rec.culprit_module = self.result
        elif self._async:
            first = rec.nonfinite and not rec.overflow and not self._in_streak
            self._in_streak = bool(rec.nonfinite)
            if first:
                rec.culprit_module = CulpritModule(rec.step, "async_records" if self.budget > 0 else "off")

    # ------------------------------------------------------------------------------- collectives
    def _ready(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.inst.world_size > 1

    def _even(self, n: int) -> bool:
        """Every rank kept the same number of micro-batches (one MAX all-reduce)."""
        if not self._ready():
            return True
        t = torch.tensor([float(n), -float(n)], dtype=torch.float64, device=self.inst.source.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.inst.group)
        hi, neg_lo = t.cpu().tolist()
        return hi == -neg_lo

    def _gather(self, row: tuple[int, int, int]) -> np.ndarray:
        local = torch.tensor(row, dtype=torch.float64, device=self.inst.source.device())
        if not self._ready():
            return local.cpu().numpy().reshape(1, 3)
        out = torch.empty(self.inst.world_size * 3, dtype=torch.float64, device=local.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local, group=self.inst.group)
        return out.cpu().numpy().reshape(-1, 3)

    # ------------------------------------------------------------------------------- replay
    def _weights_nonfinite(self) -> bool:
        try:
            return self._check_weights()
        except Exception:  # noqa: BLE001 - the replay must still run on sharded engines
            self.inst.count_error("checking the weights before the culprit-module replay")
            return False

    def _check_weights(self) -> bool:
        bad = []
        for p in self.root.parameters():
            t = getattr(p, "ds_tensor", p)  # ZeRO-3: this rank's partition
            to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard
            t = to_local() if callable(to_local) else t
            if t.numel() and t.is_floating_point():
                bad.append(~torch.isfinite(t.detach()).all())
        return bool(torch.stack(bad).any()) if bad else False

    def _replay(self, kept: list[_Kept], dropped: int, step: int) -> tuple[int, int, int]:
        """This rank's replay: ``(status, module index, micro-batch)``. On sharded engines every
        kept micro-batch is replayed even after an event (the forwards' collectives must match)."""
        weights = self._weights_nonfinite()
        modified = any(t._version != v for k in kept for t, v in k.versions)
        if not self.sharded:  # sharded: replay anyway (the collectives), vouch for nothing after
            if weights:
                return _WEIGHTS, -1, -1
            if not kept or modified:
                return _NO_INPUT, -1, -1
        tracer = OverflowTracer(self.root, max_micro_batches=len(kept))
        buffers = [(b, b.detach().clone()) for b in self.root.buffers()]
        devices = [k.cuda_rng[0] for k in kept[:1] if k.cuda_rng is not None]
        failed = False
        self._replaying = True
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type="cuda"):
                tracer.arm()
                for k in kept:
                    try:
                        torch.set_rng_state(k.cpu_rng)
                        if k.cuda_rng is not None:
                            torch.cuda.set_rng_state(k.cuda_rng[1], k.cuda_rng[0])
                        with _autocast(k.autocast):
                            self.root(*k.args, **k.kwargs)
                    except Exception:  # noqa: BLE001
                        if not self.sharded:
                            raise
                        failed = True  # the other ranks' forwards must still be matched
                    if tracer.event is not None and not self.sharded:
                        break
        except Exception:  # noqa: BLE001
            self.inst.count_error("culprit-module replay forward")
            failed = True
        finally:
            self._replaying = False
            tracer.disarm()
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            _reshard(self.root)
        ev = tracer.event
        self.report = tracer.render()
        self._write_report(step)
        if weights:
            return _WEIGHTS, -1, -1
        if failed:
            return _FAILED, -1, -1
        if not kept or modified:
            return _NO_INPUT, -1, -1
        if ev is None:
            return (_NOT_KEPT if dropped else _FINITE), -1, -1
        if ev["kind"] != "nonfinite_output":
            return _WEIGHTS, -1, -1
        idx = self._index.get(clean_name(ev["module"], strip_module=False) if ev["module"] != "<root>" else "<root>")
        if idx is None:
            return _FAILED, -1, -1
        return _FOUND, idx, int(ev["micro_batch"]) + dropped

    def _write_report(self, step: int) -> None:
        d = self.inst.config.flight_recorder.dir
        if not d or self.report is None:
            return
        try:
            path = Path(d) / f"replay-step{step}-rank{self.inst.global_rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.report)
        except OSError as e:
            log.warning("distgrad: forward-replay report not written to flight_recorder.dir=%r: %s", d, e)


def _reshard(root: nn.Module) -> None:
    """Leave FSDP as a training step leaves it: every unit resharded, its gathered parameters
    freed. Both FSDP versions keep the root unit's gathered parameters after a forward (for the
    backward pass, which frees them; a replay has none): left so, the optimizer would update the
    sharded parameters while the next forward, finding them gathered already, used the stale
    copies. FSDP2: the public ``FSDPModule.reshard()``. FSDP1 has no public equivalent: what its
    post-backward callback does (``_runtime_utils._reshard`` with ``_should_free_in_backward``,
    torch 2.4-2.13)."""
    # FSDP2's FSDPModule is in every torch the package supports (pyproject.toml: 2.13)
    from torch.distributed.fsdp import FSDPModule, _runtime_utils
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
        elif isinstance(m, FSDP1) and (handle := getattr(m, "_handle", None)) is not None:
            _runtime_utils._reshard(m, handle, _runtime_utils._should_free_in_backward(m, handle))


class _autocast:
    """Re-enter the autocast state a kept forward ran under (CPU and CUDA)."""

    def __init__(self, state: list[tuple[str, bool, torch.dtype]]) -> None:
        self.ctx = [torch.autocast(d, dtype=dt, enabled=True) for d, on, dt in state
                    if on and (d == "cpu" or torch.cuda.is_available())]

    def __enter__(self) -> None:
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctx):
            c.__exit__(*exc)


def attach_replay(inst: Any, root: Any, engine_name: str, zero_stage: int | None) -> ForwardReplay | None:
    """Install :class:`ForwardReplay` on ``root`` for ``inst`` (removed at ``close()``); None when
    ``root`` is not a module. Sharded: FSDP1, FSDP2, DeepSpeed ZeRO-3. Impossible for the whole run
    when this rank holds part of the model (pipeline stages, experts elsewhere: ``inst.job``)."""
    if not isinstance(root, nn.Module):
        return None
    sharded = engine_name in _SHARDED or (engine_name == "deepspeed" and zero_stage == 3)
    rep = ForwardReplay(inst, root, sharded, "model_parallel" if inst.job is not None else None)
    inst.replay = rep
    inst.on_close(rep.remove)
    return rep
