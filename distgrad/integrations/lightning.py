"""PyTorch Lightning (tested with lightning 2.6): one callback.

    from distgrad.integrations.lightning import DistgradCallback
    trainer = L.Trainer(..., callbacks=[DistgradCallback(exporter={"port": 9400})])

What Lightning does, and what the callback does about it (measured on lightning 2.6.6):

- ``DeepSpeedStrategy``: ``trainer.model`` is the ``DeepSpeedEngine``; it is instrumented at
  ``on_train_start`` exactly like a raw engine (boundary inside ``engine.step()``, before
  DeepSpeed's own clipping). With ``accumulate_grad_batches`` = GA > 1 under automatic
  optimization, Lightning divides ``training_step``'s loss by GA and ``engine.backward`` divides
  it by GA again (DeepSpeed's ``scale_wrt_gas``), so the gradient DeepSpeed clips and applies is
  the gradient of the step's mean loss divided by GA. distgrad reports that gradient, as applied
  (it equals ``engine.get_global_grad_norm()``, and the clip ratio is the one DeepSpeed uses),
  and warns once at ``on_train_start`` that its norms are 1/GA of those the same run would show
  under DDP or FSDP; ``distgrad_loss`` is still the step's mean loss.
- ``FSDPStrategy`` (FSDP1), ``ModelParallelStrategy`` (FSDP2 via ``fully_shard`` in
  ``configure_model``), ``DDPStrategy``, one device: under automatic optimization Lightning runs
  ``training_step`` and ``backward`` inside ``optimizer.step(closure)``, i.e. *after* the
  optimizer's step pre-hooks, so a pre-hook would read the previous step's gradients. The
  callback reads in ``on_before_optimizer_step`` instead, which Lightning calls after the
  closure (after the step's last backward) and before it clips (``gradient_clip_val``), under
  automatic and manual optimization alike (``boundary.read_at = "external"``); the optimizer's
  step post-hook publishes the step. ``gradient_clip_val`` (norm clipping) becomes distgrad's
  ``clip.max_grad_norm`` (clip ratio, post-clip norm) unless the config or an override sets it.
- Gradient noise scale (``noise_scale.enabled``, docs/signals.md): ``noise_scale.micro_batch_size``
  unset is filled from the train dataloader's ``batch_size`` (under every strategy, DeepSpeed
  too: Lightning sets ``train_micro_batch_size_per_gpu`` to 1 when it cannot tell); when the
  dataloader does not say (several loaders, a custom ``batch_sampler``), ``on_train_start``
  raises a ConfigError naming the key. Lightning's division of the loss by
  ``accumulate_grad_batches`` (twice under DeepSpeed) scales every micro-batch gradient and the
  reduced gradient alike: the noise scale is unchanged (its two terms scale by the same factor).
- Loss: ``on_before_backward`` receives the loss handed to backward (``training_step``'s loss
  divided by ``accumulate_grad_batches`` under automatic optimization); ``distgrad_loss`` is its
  sum over the step's micro-batches averaged over ranks, i.e. the mean training loss of the step
  (``Instrument.loss_reduction = "sum"``). Under DeepSpeed the engine's ``backward`` captures the
  same value.

- Lost to underflow (``underflow.enabled``, docs/signals.md "The loss factor"): the signal's
  recomputation divides the forward's loss by ``accumulate_grad_batches`` under automatic
  optimization (none under manual optimization), then under DeepSpeed by the engine's accumulation
  steps, as Lightning and ``engine.backward`` do; under ``precision="16-mixed"`` it multiplies by the
  precision plugin's ``GradScaler`` scale, as the plugin does. It recomputes the LightningModule's ``forward``
  (not Lightning's redirected ``training_step`` call under DDP / DeepSpeed): ``training_step`` must
  compute the loss through ``self(...)`` (times ``underflow.loss_factor``), else nothing is kept
  and nothing measured.

One optimizer per LightningModule is supported (several raise at ``on_train_start``).

Opt-in action ``stop`` (docs/action.md): ``trainer.should_stop`` is set at the end of the stopping
batch (the offending update was skipped, the ``on_stop`` callbacks ran).

Checkpoints (docs/checkpointing.md): the callback's ``state_dict()`` is distgrad's state
(:meth:`distgrad.Instrument.state_dict`), which Lightning stores in every checkpoint under
``checkpoint["callbacks"]["DistgradCallback"]`` (the default ``state_key``, the class name: one
DistgradCallback per Trainer); ``trainer.fit(..., ckpt_path=...)`` hands it to
``load_state_dict()`` on every rank before training starts, and it is restored into the new
instrument at ``on_train_start``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import distgrad
from distgrad.engines.deepspeed import is_deepspeed_engine
from distgrad.integrations import (
    checkpoint_state,
    restore_state,
    underflow_signal,
    with_clip_threshold,
    with_micro_batch_size,
)

if TYPE_CHECKING:  # checked against the lightning package (the `lightning` extra)
    from lightning.pytorch.callbacks import Callback
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # pragma: no cover - the standalone package
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError as e:
            raise ImportError("distgrad.integrations.lightning needs lightning: "
                              "pip install 'distgrad[lightning]'") from e

log = logging.getLogger("distgrad")


def _loader_batch_size(trainer: Any) -> int | None:
    """The train dataloader's ``batch_size`` (samples per micro-batch per rank) if Lightning has
    loaded one ``torch.utils.data.DataLoader`` with an int ``batch_size`` by ``on_train_start``;
    None otherwise (several loaders, a custom ``batch_sampler``, an IterableDataset batching
    itself: the noise scale then needs ``noise_scale.micro_batch_size``)."""
    try:
        loader = trainer.train_dataloader
    except Exception:  # noqa: BLE001 - not loaded: unknown
        return None
    b = getattr(loader, "batch_size", None)
    return b if isinstance(b, int) and not isinstance(b, bool) and b >= 1 else None


def _redirected(module: Any) -> bool:
    """Whether ``module``'s ``forward`` is patched on the instance to something other than its
    class's ``forward`` (Lightning's ``_ForwardRedirection`` while it routes ``training_step``
    through a wrapper; afterwards it leaves the bound original method there)."""
    f = vars(module).get("forward")
    return f is not None and getattr(f, "__func__", None) is not type(module).forward


class DistgradCallback(Callback):
    """Instruments the strategy's engine or wrapped model at ``on_train_start`` (every rank) and
    closes the instrument at ``on_train_end``.

    Args:
        config: as for :func:`distgrad.instrument` (DistgradConfig, dict, YAML path or None; under
            DeepSpeed with None, the DeepSpeed config's ``"distgrad"`` section).
        **overrides: config sections or dotted keys (``exporter={"port": 0}``,
            ``sampling={"interval": 10}``; see docs/configuration.md).

    Attributes:
        instrument: the :class:`distgrad.Instrument` once training has started, else None.

    Raises (at ``on_train_start``):
        ValueError: the LightningModule configures several optimizers.
        TypeError / ValueError: from :func:`distgrad.instrument` (unsupported strategy).
        ConfigError: ``noise_scale.enabled`` with ``noise_scale.micro_batch_size`` unset and a
            train dataloader without an int ``batch_size``.
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        self.config = config
        self.overrides = overrides
        self.instrument: distgrad.Instrument | None = None
        self._deepspeed = False
        self._restored: dict[str, Any] | None = None  # from a checkpoint, until on_train_start

    def state_dict(self) -> dict[str, Any]:
        """Lightning's checkpoint hook: distgrad's state (:meth:`distgrad.Instrument.state_dict`,
        plain Python types) after building the parked record of the last sampled step
        (asynchronous records; Lightning builds a checkpoint on every rank, so the flush may make
        its collective). Before training starts: the state read from a checkpoint and not yet
        restored, else ``{}`` (Lightning then stores nothing). Never raises."""
        if self.instrument is None:
            return dict(self._restored or {})
        return checkpoint_state(self.instrument, flush=True) or {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore hook (``fit(ckpt_path=...)``, every rank, before ``on_train_start``):
        keep ``state_dict`` until the instrument exists, then restore it (a state it cannot use:
        the detectors start from scratch, said once on rank 0)."""
        if self.instrument is not None:
            restore_state(self.instrument, state_dict, "the Lightning checkpoint")
        else:
            self._restored = dict(state_dict)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Instrument the strategy's engine or wrapped model, then restore the state read from
        the checkpoint, if any (:meth:`load_state_dict`)."""
        if self.instrument is not None:
            return
        self._instrument(trainer, pl_module)
        restored, self._restored = self._restored, None
        if self.instrument is not None and restored is not None:
            restore_state(self.instrument, restored, "the Lightning checkpoint")

    def _instrument(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.model
        base = with_micro_batch_size(self.config, self.overrides, _loader_batch_size(trainer),
                                     "the train dataloader's batch_size")
        if is_deepspeed_engine(model):
            self._deepspeed = True
            self.instrument = distgrad.instrument(model, self.config, **base)
            self.instrument.loss_reduction = "sum"
            self._underflow_scale(trainer, pl_module, model)
            self._warn_double_division(trainer, pl_module)
            return
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise ValueError(f"DistgradCallback supports one optimizer, the LightningModule has {len(optimizers)}")
        opt = getattr(optimizers[0], "_optimizer", optimizers[0])  # a LightningOptimizer's torch optimizer
        algo = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm").lower()
        clip = trainer.gradient_clip_val if algo.endswith("norm") else None
        overrides = with_clip_threshold(self.config, base, clip)
        self.instrument = distgrad.instrument(model, self.config, optimizer=opt, **overrides)
        boundary = self.instrument.boundary
        if boundary is not None:  # None: enabled: false
            self.instrument.loss_reduction = "sum"
            boundary.read_at = "external"
        self._underflow_scale(trainer, pl_module, None)

    def _underflow_scale(self, trainer: Any, pl_module: Any, engine: Any) -> None:
        """``underflow.enabled``: tell the underflow signal how Lightning scales the forward's loss
        before backward (lightning 2.6): under automatic optimization ``training_step``'s loss is
        divided by ``accumulate_grad_batches`` (``_AutomaticOptimization``'s closure), under manual
        optimization ``manual_backward`` does not scale it; under DeepSpeed ``engine.backward`` then
        divides by the engine's accumulation steps. The forward recomputed is the LightningModule's:
        ``training_step`` must return the loss its ``forward`` (``self(...)``) returned (times
        ``underflow.loss_factor``). Under a wrapper (DDP, DeepSpeed) Lightning calls
        ``training_step`` through the wrapper's forward by patching the LightningModule's
        ``forward`` on the instance for that call (``_ForwardRedirection``): that call is not kept
        (it is not the module's forward; replaying it would rerun ``training_step``), the nested
        ``self(...)`` is. Under ``precision="16-mixed"`` the precision plugin's ``GradScaler``
        then multiplies the loss by its scale; the signal multiplies by the same scale."""
        uf = underflow_signal(self.instrument)
        if uf is None:
            return
        uf.skip_call = _redirected
        if engine is None:  # "16-mixed": the precision plugin's GradScaler multiplies the loss after the division
            uf.loss_scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)

        def scale(_: tuple, __: dict) -> tuple[float, tuple[float, ...]]:
            divs: list[float] = []
            if getattr(pl_module, "automatic_optimization", True):
                divs.append(float(int(getattr(trainer, "accumulate_grad_batches", 1) or 1)))
            gas = getattr(engine, "gradient_accumulation_steps", None)
            if callable(gas):
                divs.append(float(gas()))
            return 1.0, tuple(divs)

        uf.framework_scale = scale

    @staticmethod
    def _warn_double_division(trainer: Any, pl_module: Any) -> None:
        """Lightning + DeepSpeed, automatic optimization, accumulate_grad_batches > 1: the loss is
        divided by the accumulation twice before backward (Lightning's closure, then
        ``engine.backward``); say once (rank 0) what the served gradient statistics are."""
        ga = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        if ga <= 1 or not getattr(pl_module, "automatic_optimization", True) or trainer.global_rank != 0:
            return
        log.warning(
            "distgrad: Lightning's DeepSpeedStrategy with accumulate_grad_batches=%d divides the loss by %d "
            "and DeepSpeed's engine.backward divides it by %d again, so the gradient DeepSpeed clips and "
            "applies is the gradient of the step's mean loss divided by %d. distgrad reports that gradient as "
            "applied (its norms equal engine.get_global_grad_norm(); the clip ratio is DeepSpeed's): they are "
            "1/%d of the norms of the same run under DDP or FSDP (and DeepSpeed's gradient_clipping compares "
            "against them). distgrad_loss is the step's mean loss.", ga, ga, ga, ga, ga)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.instrument is not None and not self._deepspeed:
            self.instrument.observe_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.instrument is not None and not self._deepspeed:
            boundary = getattr(self.instrument, "boundary", None)
            if boundary is not None:
                boundary.read_now()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The opt-in action's stop (config ``action.on_*: stop``, docs/action.md): the offending
        update was skipped and the ``on_stop`` callbacks ran; ``trainer.should_stop`` ends the fit
        after this batch, on every rank."""
        if self.instrument is not None and self.instrument.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.instrument is not None:
            self.instrument.close()


__all__ = ["DistgradCallback"]
