"""DeepSpeed adapter: where a ``DeepSpeedEngine`` keeps the reduced local gradient on each ZeRO
stage, its loss scale and overflow state (measured against deepspeed 0.19; see
``docs/engines.md``).

- Stage 0: ``param.grad`` is the full gradient averaged over ranks, identical on every rank.
- Stage 1/2: ``param.grad`` is None; ``param._hp_mapping.get_lp_grad_fragment(
  param._index_in_param_group)`` is the reduced fragment owned by this rank, at
  ``_hp_mapping.lp_fragment_address`` (start, numel) of the flattened parameter; with
  ``BF16_Optimizer`` the returned tensor is the full-size gradient and is narrowed to that
  address. ``_hp_mapping`` is None when this rank owns no element of the parameter.
- Stage 3: ``deepspeed.utils.safe_get_local_grad(param)`` is the rank's fp32 partition of
  ``ceil(numel / W)`` elements; the last ranks' partitions are zero-padded, so only
  ``max(0, min(P, numel - rank * P))`` elements are real.

The boundary hook wraps ``engine._take_model_step`` on the instance: DeepSpeed calls it once per
optimizer step, on the gradient-accumulation boundary, after the all-reduce (stage 0/1) or
reduce-scatter (stage 2/3) has completed (also in unmanaged accumulation mode, where
``step()`` finalises the reduction first) and before clipping and the optimizer update.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from distgrad.core.step import StepOutcome
from distgrad.engines.base import GradSource
from distgrad.naming.canonical import clean_name


def is_deepspeed_engine(obj: object) -> bool:
    """True if ``obj`` is a ``deepspeed.runtime.engine.DeepSpeedEngine``.

    Never imports DeepSpeed (an optional extra, ``distgrad[deepspeed]``): an engine can only
    exist once its module is loaded, so the class is looked up in ``sys.modules``, and
    PyTorch-only users neither need DeepSpeed nor pay for its import."""
    mod = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(mod, "DeepSpeedEngine", None)
    return isinstance(cls, type) and isinstance(obj, cls)



def _ds_numel(p: torch.nn.Parameter) -> int:
    """ZeRO-3's element count of the full parameter ``p``: DeepSpeed sets ``ds_numel`` on the
    parameters it partitions (whose own ``numel()`` is then 0); torch's type does not declare it."""
    return int(p.ds_numel)  # type: ignore[attr-defined]

class DeepSpeedSource(GradSource):
    """Reads the post-reduction local gradient pieces of a ``deepspeed.DeepSpeedEngine``.

    Raises:
        TypeError: ``engine`` is not a DeepSpeedEngine.
        ValueError: the engine has no optimizer (inference engine) or uses a configuration
            whose reduced gradients distgrad cannot locate (named in the message).
    """

    engine_name = "deepspeed"

    def __init__(self, engine: Any) -> None:
        if not is_deepspeed_engine(engine):
            raise TypeError(f"expected a deepspeed.DeepSpeedEngine, got {type(engine).__name__}")
        if engine.optimizer is None:
            raise ValueError("the DeepSpeed engine has no optimizer: distgrad watches training "
                             "gradients; pass an optimizer (or an 'optimizer' config section) "
                             "to deepspeed.initialize")
        if not hasattr(engine, "_take_model_step"):
            raise ValueError("this DeepSpeed version has no DeepSpeedEngine._take_model_step; "
                             "distgrad supports deepspeed 0.19 (pyproject.toml: deepspeed>=0.19,<0.20)")
        self.engine = engine
        self.zero_stage = int(engine.zero_optimization_stage())
        self.replicated = self.zero_stage == 0
        self._stage_ranks: tuple[int, ...] | None = None
        if type(engine).__name__ == "PipelineEngine":
            self._pipeline(engine)
        self._params: list[torch.nn.Parameter] = []
        self.names, self.numels, raw = [], [], []
        for name, p in engine.module.named_parameters():  # dedups tied weights
            if not p.requires_grad:
                continue
            self._params.append(p)
            raw.append(name)
            self.numels.append(int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel())
        from distgrad.engines.deepspeed_moe import expert_layout

        moe = expert_layout(engine, raw, self._params, self.zero_stage)
        self._holders = moe[1] if moe is not None else None
        self.names = [clean_name(n) for n in (moe[0] if moe is not None else raw)]
        if engine.fp16_enabled():
            self.grad_dtype = self.compute_dtype = torch.float16
        elif engine.bfloat16_enabled():
            self.grad_dtype = self.compute_dtype = torch.bfloat16
        else:
            self.grad_dtype = self.compute_dtype = torch.float32
        # ZeRO-3 partitions each parameter over the optimizer's data-parallel group: this rank's
        # index in it and its size (unused, 0 and 1, under the other stages)
        self.rank, self.world = 0, 1
        if self.zero_stage == 3:
            import torch.distributed as dist

            grp = getattr(engine.optimizer, "dp_process_group", None)
            self.rank = dist.get_rank(grp)
            self.world = dist.get_world_size(grp)

    def _pipeline(self, engine: Any) -> None:
        """``PipelineEngine`` (ZeRO 0/1; DeepSpeed refuses 2/3 with pipelines): this rank's
        ``PipelineModule`` holds its stage's layers, named by their global layer index
        (``PipelineModule._build``: ``add_module(str(layer_idx), ...)``), whose gradients are
        reduced over the stage's data-parallel group (``engine.mpu.get_data_parallel_group()``,
        the group ZeRO-1 partitions over), so the stage joins the job-wide list of
        :mod:`distgrad.core.job`; ``engine._take_model_step`` is called once per ``train_batch()`` on
        every stage. Tied layers (``TiedLayerSpec``) live on several stages, as copies whose
        gradients are all-reduced across them: refused.

        Raises:
            ValueError: tied layers."""
        import torch.distributed as dist

        tied = list(getattr(engine.module, "tied_modules", {}) or {})
        if tied:
            raise ValueError(f"DeepSpeed PipelineEngine with tied layers {tied} is not supported: each tied "
                             "weight is a separate copy on every stage that uses it, and distgrad would add the "
                             "copies; untie them (separate LayerSpecs) or instrument without pipeline parallelism")
        self.group = engine.mpu.get_data_parallel_group()
        self._stage_ranks = tuple(int(r) for r in dist.get_process_group_ranks(self.group))

    def param_holders(self) -> list[tuple[int, ...]]:
        """Per parameter, the global ranks its gradient is reduced over: every rank, except
        experts under expert parallelism (their expert-data-parallel group; see
        :mod:`distgrad.engines.deepspeed_moe`), which puts them in the job-wide list."""
        if self._holders is not None:
            return list(self._holders)
        if self._stage_ranks is not None:
            return [self._stage_ranks] * len(self.names)
        import torch.distributed as dist

        return [tuple(range(dist.get_world_size()))] * len(self.names)

    # ------------------------------------------------------------------------------------
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        if self.zero_stage == 0:
            return [p.grad.reshape(-1) if p.grad is not None else None for p in self._params]
        if self.zero_stage in (1, 2):
            return [self._fragment_12(p) for p in self._params]
        return [self._partition_3(p) for p in self._params]

    def local_offsets(self) -> list[tuple[int, int] | None]:
        """Per parameter, ``(start, numel)`` of this rank's piece within the flattened full
        parameter (None if it holds none); replicated (stage 0): the whole parameter."""
        out: list[tuple[int, int] | None] = []
        for p, n in zip(self._params, self.numels):
            if self.zero_stage == 0:
                out.append((0, n))
            elif self.zero_stage in (1, 2):
                m = getattr(p, "_hp_mapping", None)
                out.append(None if m is None else (int(m.lp_fragment_address.start),
                                                   int(m.lp_fragment_address.numel)))
            else:
                part = int(p.ds_tensor.ds_numel) if hasattr(p, "ds_tensor") else -(-n // self.world)
                keep = max(0, min(part, n - self.rank * part))
                out.append((self.rank * part, keep) if keep else None)
        return out

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """fp32 master weights: stage 0 the parameters themselves (the optimizer's own
        parameters), stage 1/2 ``_hp_mapping.hp_fragment`` (this rank's fp32 fragment), stage 3
        ``safe_get_local_fp32_param`` without its padding."""
        if self.zero_stage == 0:
            return [p.detach().reshape(-1) for p in self._params]
        if self.zero_stage in (1, 2):
            out = []
            for p in self._params:
                m = getattr(p, "_hp_mapping", None)
                out.append(None if m is None else m.hp_fragment.detach().reshape(-1))
            return out
        from deepspeed.utils import safe_get_local_fp32_param

        out = []
        for p in self._params:
            w = safe_get_local_fp32_param(p)
            if w is None:
                out.append(None)
                continue
            w = w.detach().reshape(-1)
            keep = max(0, min(w.numel(), _ds_numel(p) - self.rank * w.numel()))
            out.append(w.narrow(0, 0, keep))
        return out

    def optimizer_slots(self) -> list[Any] | None:
        """The torch optimizer's state next to each gradient piece
        (:mod:`distgrad.engines.optimizer_state`): stage 0 the parameters' own state (fp32, no
        wrapper only), stage 1/2 the fp32 flat partition of the parameter's group cut at
        ``_hp_mapping.hp_fragment_address``, stage 3 ``fp32_partitioned_groups_flat`` at
        ``grad_position`` without padding. None when not located (a fp16 stage-0 wrapper,
        ZeRO-3 optimizer state swapped to NVMe, an unknown layout). ZeRO-3's hyperparameters: the
        inner group ``sub_group_to_group_id[g]`` (its ``params`` are emptied outside the step)."""
        from distgrad.engines.optimizer_state import OptimizerSlot, flat, group_of, narrow, torch_slots

        zopt = self.engine.optimizer
        if self.zero_stage == 0:
            if isinstance(zopt, torch.optim.Optimizer) and not hasattr(zopt, "optimizer"):
                return torch_slots(zopt, [(p, flat) for p in self._params])
            if not any(getattr(p, "_hp_mapping", None) is not None for p in self._params):
                return None
        inner = getattr(zopt, "optimizer", None)
        if inner is None or not hasattr(inner, "state"):
            return None
        out: list[Any] = []
        if self.zero_stage == 3:
            if getattr(zopt, "optimizer_swapper", None) is not None or not hasattr(zopt, "grad_position"):
                return None
            for p in self._params:
                g, offset, numel = zopt.grad_position[zopt.get_param_id(p)]
                key = zopt.fp32_partitioned_groups_flat[g]
                keep = max(0, min(int(numel), _ds_numel(p) - self.rank * int(numel)))
                # the inner optimizer's groups hold the flat only during its step
                grp = inner.param_groups[zopt.sub_group_to_group_id[g]]
                out.append(None if keep == 0 else
                           OptimizerSlot(inner, grp, key, narrow(int(offset), int(numel), keep)))
            return out
        flats = getattr(zopt, "single_partition_of_fp32_groups", None)
        if flats is None:
            flats = getattr(zopt, "fp32_groups_flat_partition", None)  # BF16_Optimizer
        if flats is None:
            return None
        for p in self._params:
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                out.append(None)
                continue
            key = flats[m.param_group_index]
            grp = group_of(inner, key)
            addr = m.hp_fragment_address
            out.append(None if grp is None else
                       OptimizerSlot(inner, grp, key, narrow(int(addr.start), int(addr.numel))))
        return out

    @staticmethod
    def _fragment_12(p: torch.nn.Parameter) -> torch.Tensor | None:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return None
        # set by DeepSpeed's ZeRO-1/2 optimizer on its parameters; torch's type does not declare it
        frag = mapping.get_lp_grad_fragment(p._index_in_param_group)  # type: ignore[attr-defined]
        if frag is None:
            return None
        flat = frag.reshape(-1)
        addr = mapping.lp_fragment_address
        if flat.numel() != addr.numel:
            flat = flat.narrow(0, addr.start, addr.numel)
        return flat

    def _partition_3(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_grad

        g = safe_get_local_grad(p)
        if g is None:
            return None
        g = g.reshape(-1)
        part = g.numel()
        keep = max(0, min(part, _ds_numel(p) - self.rank * part))
        return g.narrow(0, 0, keep)

    # ------------------------------------------------------------------------------------
    def has_loss_scaler(self) -> bool:
        return bool(self.engine.fp16_enabled())

    def loss_scale(self) -> float | None:
        if not self.has_loss_scaler():
            return None
        opt = self.engine.optimizer
        for attr in ("cur_scale", "loss_scale"):
            v = getattr(opt, attr, None)
            if v is not None:
                return float(v)
        cfg = getattr(opt, "loss_scale_config", None)
        if cfg is not None and getattr(cfg, "cur_scale", None) is not None:
            return float(cfg.cur_scale)
        return None

    def min_loss_scale(self) -> float | None:
        if not self.has_loss_scaler():
            return None
        opt = self.engine.optimizer
        for holder in (opt, getattr(opt, "loss_scaler", None), getattr(opt, "loss_scale_config", None)):
            v = getattr(holder, "min_loss_scale", None) if holder is not None else None
            if v is not None:
                return float(v)
        try:
            return float(self.engine.config["fp16"].get("min_loss_scale", 1))
        except Exception:  # noqa: BLE001
            return 1.0

    def grad_scale(self) -> float:
        """ZeRO 1-3 under fp16 keep the loss-scaled gradient until ``step()`` unscales it.
        Stage 0 fp16 was measured unscaled at this point on deepspeed 0.19 CPU (docs/engines.md);
        the reference tests pin both behaviours."""
        if not self.has_loss_scaler() or self.zero_stage == 0:
            return 1.0
        s = self.loss_scale()
        return float(s) if s else 1.0

    def overflow(self) -> bool | None:
        if not self.has_loss_scaler():
            return None
        return bool(getattr(self.engine.optimizer, "overflow", False))

    def samples(self) -> int | None:
        return int(getattr(self.engine, "global_samples", 0))


def inner_optimizer(engine: Any) -> Any:
    """The ``torch.optim.Optimizer`` that updates the engine's (fp32 master) weights: the
    optimizer a DeepSpeed wrapper (ZeRO 1-3, ``BF16_Optimizer``, ``FP16_Optimizer``) holds as
    ``.optimizer``, or the engine's optimizer itself (ZeRO 0 fp32).

    Raises:
        TypeError: none is found (an unknown wrapper)."""
    opt = engine.optimizer
    for cand in (getattr(opt, "optimizer", None), opt):
        if isinstance(cand, torch.optim.Optimizer):
            return cand
    raise TypeError(f"no torch.optim.Optimizer inside the DeepSpeed optimizer {type(opt).__name__}")


def take_without_update(engine: Any, take: Any, args: tuple, kwargs: dict) -> Any:
    """``engine._take_model_step`` with the update left out (the opt-in action,
    :mod:`distgrad.diagnostics.action`): the engine runs its whole step -- clipping, its overflow check, the
    copy of the fp32 master weights back into the training weights, releasing and zeroing the
    reduced gradients (ZeRO's buffers included) -- except that the inner optimizer's ``step``
    does nothing, so neither the master weights nor the optimizer's moments change and the
    training weights are re-written with the values they had. The engine's LR scheduler is not
    stepped (as on DeepSpeed's own overflow skips) and ``engine.was_step_applied()`` is False
    afterwards. Returns what ``take`` returns."""
    inner = inner_optimizer(engine)
    own = "step" in vars(inner)
    step, sched = inner.step, engine.lr_scheduler
    inner.step = lambda *a, **k: None  # on this instance only, for this one step
    engine.lr_scheduler = None
    try:
        out = take(*args, **kwargs)
    finally:
        if own:
            inner.step = step
        else:
            vars(inner).pop("step", None)
        engine.lr_scheduler = sched
    engine._step_applied = False
    return out


def attach_deepspeed(inst: Any, engine: Any, source: DeepSpeedSource) -> None:
    """The DeepSpeed boundary: wrap ``engine._take_model_step`` (called once per optimizer step,
    after the reduction, before clipping and the update; see the module docstring) and
    ``engine.backward`` (loss capture) on this engine instance only, through the
    :class:`~distgrad.Instrument` boundary API; :meth:`Instrument.close` restores them."""
    if inst.action.active:
        inner_optimizer(engine)  # raises now, not at the first skipped step
    take = engine._take_model_step
    backward = engine.backward
    # StepRecord.micro_step: micro-batches processed up to this boundary, this step's included,
    # as the PyTorch boundary counts them. engine.micro_steps counts engine.step() calls before
    # the current one: one per micro-batch in a plain loop (g*(k+1) - 1 at boundary k with g
    # micro-batches), but one per optimizer step where engine.step() runs only at the boundary
    # (Accelerate, the Hugging Face Trainer: k). The backward calls since the last boundary (n)
    # against the engine's count (d) give the micro-batches it did not count (n - d per step).
    micro = {"extra": 0, "n": 0, "start": 0}

    def _micro_at_boundary() -> int:
        now = int(engine.micro_steps)
        if micro["n"]:  # a pipeline engine's backward bypasses the wrapper: n == 0, nothing to add
            micro["extra"] += micro["n"] - (now - micro["start"] + 1)
        micro["n"] = 0
        return now + 1 + micro["extra"]

    def _take_model_step(*args: Any, **kwargs: Any) -> Any:
        step, micro_step = int(engine.global_steps), _micro_at_boundary()
        gscale = 1.0
        if inst.is_sampled(step):
            try:
                gscale = source.grad_scale()
            except Exception:  # noqa: BLE001
                inst.count_error("reading the loss scale")
        token = inst.begin_step(step)
        skip = inst.decide_action(token, gscale) is not None
        out = take_without_update(engine, take, args, kwargs) if skip else take(*args, **kwargs)
        try:
            outcome = StepOutcome(overflow=source.overflow(), step_applied=bool(engine.was_step_applied()),
                                  loss_scale=source.loss_scale(), samples=source.samples())
        except Exception:  # noqa: BLE001
            inst.count_error("reading the optimizer state")
            outcome = StepOutcome(overflow=None, step_applied=not skip)
        outcome.grad_scale, outcome.micro_step = gscale, micro_step
        inst.end_step(token, outcome)
        return out

    def _backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        if micro["n"] == 0:
            micro["start"] = int(engine.micro_steps)
        micro["n"] += 1
        inst.observe_loss(loss, automatic=True)  # ignored once the user observes losses
        out = backward(loss, *args, **kwargs)
        inst.after_micro_batch()
        return out

    def _forward_pre(module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            inst.forward_started()  # the step's first forward ends its data time

    engine._take_model_step = _take_model_step
    engine.backward = _backward
    handle = engine.register_forward_pre_hook(_forward_pre, prepend=True)

    def restore() -> None:
        engine._take_model_step = take
        engine.backward = backward
        handle.remove()

    inst.on_close(restore)
