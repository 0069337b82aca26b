"""What distgrad costs, measured in one run on the same model and gradients (GitHub issue #7).

    .venv/bin/python launch/benchmark.py                       # full run (6 min on 2 CPU cores)
    .venv/bin/python launch/benchmark.py --sizes 10m --trials 5 --e2e-steps 10   # quick look

Not part of the test suite. Without CUDA it starts 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``,
``OMP_NUM_THREADS=1``); with CUDA one process per GPU (NCCL), the same code. For each model size
(GPT-style decoder of ``launch/train.py``; ``10m`` = 6 x 384, ``100m`` = 16 x 768):

1. micro-benchmark (this script again, under the ``deepspeed`` launcher, DeepSpeed ZeRO-2 fp32):
   one forward/backward to the accumulation boundary, then on those reduced gradients, trials
   interleaved row by row (so that a slow moment of a shared machine hits every row alike), the
   median of each row over ``--trials``:
   - the floor, ``torch._foreach_norm`` over this rank's gradient pieces (one read of every byte);
   - distgrad's statistics pass (``stats.pack_local``, no collectives) with each kernel, its
     ``Instrument.collect`` (pieces + statistics + 2 all-reduces + 1 device-to-host copy) and the
     whole sampled step (``collect`` + ``finish``: record, diagnostics, Prometheus update), and
     that step with asynchronous records (steady state: publish the previous step + enqueue
     this one; on CPU there is no Triton row: its interpreter's times mean nothing);
   - baselines re-implemented as people write them: a per-parameter loop with ``.item()`` per
     statistic; Composer's OptimizerMonitor (per-metric ``all_reduce`` + host read, with its
     default metric, the grad norm, and with distgrad's statistics); wandb.watch's
     ``log_tensor_stats`` (clone + histc + copy to host, 64 bins); DeepSpeed's
     ``safe_get_full_grad`` loop for per-parameter norms;
   - each packed signal (``distgrad.signals``: histogram, optimizer signals, noise scale,
     curvature, MoE router health) alone on top of the sampled step without packed signals, and the
     noise scale's per-micro-batch hook work and the logit precursors' and router hooks'
     per-sampled-micro-batch forward work;
   - per row, in separate untimed passes: collectives and host syncs (the methods that wait for
     the device: ``item``, ``cpu``, ``tolist``, ``__bool__``, ``__float__``, ..., and waits for
     an asynchronous record's copy that had not completed), the extra peak memory (CUDA:
     ``max_memory_allocated``; CPU: torch allocations from the profiler) and, on CUDA, the GPU
     kernels and memory copies (torch profiler);
   - the accuracy of each kernel's per-parameter norms against float64 on the same pieces.
2. end-to-end: ``launch/train.py`` three times under ``deepspeed`` (no distgrad, sampling every
   step, sampling every 10 steps), fixed ``--steps``; the job reports the median step time.

Prints tables (and ``--markdown FILE`` writes them; ``--json FILE`` the raw results).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
from dist_env import free_port  # noqa: E402  (a port below the ephemeral range)
SIZES = {  # name: (layers, width, heads)
    "10m": (6, 384, 6),
    "100m": (16, 768, 12),
}

#: signal name -> the StepRecord field it fills
FIELDS = {"grad_histogram": "grad_histogram", "optimizer_signals": "optimizer_signals", "noise_scale": "noise_scale",
          "curvature": "curvature", "update_geometry": "update_geometry"}
#: (row key, label, signal name in distgrad.signals.FACTORIES, config overrides switching it on)
SIGNAL_ROWS = [
    ("sig_histogram", "signal: log2|g| histogram per layer (histogram.enabled)", "grad_histogram",
     {"histogram": {"enabled": True}}),
    ("sig_optimizer", "signal: Adam update RMS, spike fraction, moments, Fisher, cosine "
     "(optimizer_signals.enabled)", "optimizer_signals",
     # every: 1 so that each timed call computes them (the default every: 8 would time the steps left out)
     {"optimizer_signals": {"enabled": "on", "every": 1}}),
    ("sig_noise_scale", "signal: gradient noise scale, packing and estimate (noise_scale.enabled)", "noise_scale",
     {"noise_scale": {"enabled": True}}),
    ("sig_curvature", "signal: curvature along the last update (curvature.enabled)", "curvature",
     {"curvature": {"enabled": True}}),
    ("sig_update", "signal: applied update RMS and update/weight ratio per parameter and layer, weight copy "
     "included (update_geometry.enabled)", "update_geometry", {"update_geometry": {"enabled": True}}),
    ("sig_update_spectral", "signal: the same with the spectral norm's power iteration (update_geometry.spectral)",
     "update_geometry", {"update_geometry": {"enabled": True, "spectral": True}}),
]
# end-to-end on CPU: ds-config overrides per size, (micro-batch, accumulation steps). The 100M
# model at the example's 8 x 128 x 2 tokens per rank takes ~30 s per step on 2 CPU cores; 1 x 128
# x 1 keeps its three runs within a few minutes (a shorter step makes distgrad's share larger).
# On CUDA the example's batch is used.
E2E_BATCH = {"10m": None, "100m": (1, 1)}
E2E_WARMUP = 3  # optimizer steps left out of the end-to-end medians
SYNCING = ("cpu", "item", "tolist", "__bool__", "__float__", "__int__", "__index__")  # as tests/dist/common.py HostSyncs
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "reduce_scatter_tensor", "reduce_scatter", "reduce", "gather", "scatter", "barrier",
               "all_to_all_single", "broadcast_object_list")




# ----------------------------------------------------------------------------------------------
# worker: runs on every rank under the deepspeed launcher
class Counter:
    """Counts collectives (torch.distributed calls, outermost only) and host syncs (tensor methods
    that wait for the device) while active. Only used in untimed passes."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as tdist

        self.tdist = tdist
        self.collectives = 0
        self.syncs = 0
        self._depth = 0
        self._orig = {n: getattr(tdist, n) for n in COLLECTIVES if hasattr(tdist, n)}
        counter = self

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in SYNCING:
                    counter.syncs += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*a: Any, **kw: Any) -> Any:
            if self._depth == 0:
                self.collectives += 1
            self._depth += 1
            try:
                return fn(*a, **kw)
            finally:
                self._depth -= 1
        return wrapped

    def run(self, fn: Callable[[], Any]) -> tuple[int, int]:
        """(collectives, host syncs) of one call of ``fn``; a wait for an asynchronous record's
        host copy (``HostCopy.wait``) counts as a sync when the copy had not completed."""
        from distgrad.stats import HostCopy

        self.collectives = self.syncs = 0
        for n, f in self._orig.items():
            setattr(self.tdist, n, self._wrap(n, f))
        real_wait = HostCopy.wait
        counter = self

        def wait(hc: Any) -> Any:
            if not hc.ready():
                counter.syncs += 1
            return real_wait(hc)

        HostCopy.wait = wait
        try:
            with self.mode:
                fn()
        finally:
            HostCopy.wait = real_wait
            for n, f in self._orig.items():
                setattr(self.tdist, n, f)
        return self.collectives, self.syncs


def device_ops(fn: Callable[[], Any], cuda: bool) -> list[int] | None:
    """CUDA only: [kernels, memory copies/sets] that one call of ``fn`` runs on the GPU (torch
    profiler; Triton launches included)."""
    if not cuda:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = copies = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                copies += 1
            else:
                kernels += 1
    return [kernels, copies]


def peak_extra_bytes(fn: Callable[[], Any], cuda: bool) -> int:
    """Largest amount of memory allocated above what was allocated before ``fn`` started."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return int(peak)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as tdist

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    sys.path.insert(0, str(ROOT / "launch"))
    from train import GPT, skip_cpu_shm_op  # noqa: E402

    import distgrad
    from distgrad import stats as dstats

    acc = get_accelerator()
    cuda = acc.device_name() != "cpu"
    if not cuda:
        skip_cpu_shm_op()
    deepspeed.init_distributed(dist_backend="gloo" if not cuda else acc.communication_backend_name())
    rank, world = tdist.get_rank(), tdist.get_world_size()
    layers, width, heads = SIZES[args.size]
    torch.manual_seed(0)
    model = GPT(layers, width, heads, 128)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    inst = distgrad.instrument(engine, exporter={"port": 0}, sampling={"interval": 1})
    device = inst.source.device()
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randint(0, 256, (1, 128), generator=g).to(engine.device)
    y = torch.randint(0, 256, (1, 128), generator=g).to(engine.device)
    # one full optimizer step first, so that the optimizer state exists (Adam's moments: without
    # them the optimizer signals have nothing to read, and their row would measure nothing)
    engine.backward(engine(x, y))
    engine.step()
    loss = engine(x, y)
    engine.backward(loss)  # distgrad's wrapper records the loss; no step: the gradients stay
    assert engine.is_gradient_accumulation_boundary()
    pieces = list(inst.source.local_pieces())
    present = [p for p in pieces if p is not None and p.numel()]
    names = inst.source.names
    named = [(n, p) for n, p in zip(names, pieces) if p is not None and p.numel()]
    layout = dstats.Layout(len(pieces), world)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    local_elems = sum(p.numel() for p in present)
    ds_params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]

    def stats_pass(kernel: str) -> Callable[[], Any]:
        def fn() -> Any:
            prev = dstats.stats_kernel()
            dstats.set_stats_kernel(kernel)
            try:
                return dstats.pack_local(pieces, layout, rank, device)
            finally:
                dstats.set_stats_kernel(prev)
        return fn

    def sampled_step() -> None:
        inst.async_records = False
        host = inst.collect(0)
        inst.finish(distgrad.StepToken(0, True, host), distgrad.StepOutcome(micro_step=0))

    def collect_sync() -> Any:
        inst.async_records = False
        return inst.collect(0)

    parked: list = [None]

    def sampled_step_async() -> None:
        """Steady state of the asynchronous mode: publish the previous (parked) step, then
        enqueue this one (its record is built at the next call); the parked step is set aside
        between calls so that the other rows never publish it."""
        inst.async_records = True
        inst._parked, parked[0] = parked[0], None
        try:
            host = inst.collect(0)
            inst.finish(distgrad.StepToken(0, True, host), distgrad.StepOutcome(micro_step=0))
        finally:
            parked[0], inst._parked = inst._parked, None
            inst.async_records = False

    # --- baselines, re-implemented as they are usually written ------------------------------
    def tutorial_loop() -> dict:
        out = {}
        for n, g_ in named:
            out[n] = {"norm": g_.norm().item(), "mean": g_.mean().item(), "std": g_.std().item(),
                      "min": g_.min().item(), "max": g_.max().item(),
                      "nan": torch.isnan(g_).sum().item(), "inf": torch.isinf(g_).sum().item(),
                      "zero_frac": (g_ == 0).float().mean().item()}
        return out

    def composer(metric_set: str) -> Callable[[], dict]:
        """Composer OptimizerMonitor.batch_end + dist_reduce_metrics: per parameter
        ``vector_norm(p.grad)`` (squared before the reduction), the metric keys gathered with
        ``all_gather_object``, then per metric one ``all_reduce`` and a host read
        (``math.sqrt(reduced)``), ``.item()`` on what is left. ``metric_set="distgrad"`` extends
        the same loop to distgrad's statistics (sum, sum of squares, min, max, NaN, Inf, zeros)."""
        def fn() -> dict:
            metrics: dict[str, tuple[torch.Tensor, Any]] = {}
            SUM, MAX, MIN = tdist.ReduceOp.SUM, tdist.ReduceOp.MAX, tdist.ReduceOp.MIN
            for n, g_ in named:
                if metric_set == "norm":
                    metrics[f"l2_norm/grad/{n}"] = (torch.linalg.vector_norm(g_) ** 2, SUM)
                else:
                    gf = g_.float()
                    metrics[f"sumsq/grad/{n}"] = (torch.linalg.vector_norm(gf) ** 2, SUM)
                    metrics[f"sum/grad/{n}"] = (gf.sum(), SUM)
                    metrics[f"min/grad/{n}"] = (gf.min(), MIN)
                    metrics[f"max/grad/{n}"] = (gf.max(), MAX)
                    metrics[f"nan/grad/{n}"] = (torch.isnan(gf).sum().float(), SUM)
                    metrics[f"inf/grad/{n}"] = (torch.isinf(gf).sum().float(), SUM)
                    metrics[f"zeros/grad/{n}"] = (((gf == 0).sum()).float(), SUM)
            keys: list = [None] * world
            tdist.all_gather_object(keys, sorted(metrics))
            out = {}
            for k in sorted(set().union(*keys)):
                if k in metrics:
                    t, op = metrics[k]
                    t = t.clone()
                else:  # this rank holds no element of the parameter: the reduction's identity
                    op = MIN if k.startswith("min/") else MAX if k.startswith("max/") else SUM
                    ident = math.inf if op == MIN else -math.inf if op == MAX else 0.0
                    t = torch.tensor(ident, device=device)
                tdist.all_reduce(t, op=op)
                out[k] = math.sqrt(t) if k.startswith("l2_norm") or k.startswith("sumsq") else float(t)
            if metric_set == "norm":
                out["l2_norm/grad/global"] = math.sqrt(sum(v ** 2 for v in out.values()))
            return out
        return fn

    def wandb_watch() -> None:
        """wandb.watch(log="gradients") -> TorchHistory.log_tensor_stats per gradient tensor
        (64 bins), without building the wandb.Histogram object."""
        for n, g_ in named:
            flat = g_.detach().clone().reshape(-1)
            if flat.dtype not in (torch.float32, torch.float64):
                flat = flat.float()
            if flat.shape == torch.Size([0]) or (~torch.isfinite(flat)).all().item():
                continue
            if not torch.isfinite(flat).all():
                flat = flat[torch.isfinite(flat)]
            tmin, tmax = flat.min().item(), flat.max().item()
            if tmin == tmax:
                hist, bins = torch.Tensor([flat.numel()]), torch.Tensor([tmin, tmax])
            else:
                hist = flat.histc(bins=64, min=tmin, max=tmax).cpu().detach().clone()
                bins = torch.linspace(tmin, tmax, steps=65)
            hist.tolist(), bins.tolist()

    def ds_full_grad_norms() -> dict:
        """The documented way to read per-parameter gradients under ZeRO: one collective each."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for n, p in ds_params:
            full = safe_get_full_grad(p)
            out[n] = full.norm().item() if full is not None else None
        return out

    # --- the loss analysis (issue #16): one micro-batch's observe_loss, plain and with components
    # and per-token losses (from the logits: a cross-entropy recomputed in bounded chunks; or
    # given), and a sampled step that carries them (the same 2 collectives + 1 copy)
    vocab = 256
    logits = torch.randn(1, 128, vocab, generator=g).to(engine.device)
    tok_losses = torch.nn.functional.cross_entropy(logits.view(-1, vocab), y.view(-1), reduction="none").view(1, 128)
    loss_t = loss.detach()

    def observe_plain() -> None:
        inst.observe_loss(loss_t)
        inst.loss.drop()

    def observe_parts(from_logits: bool) -> Callable[[], None]:
        def fn() -> None:
            comps = {"lm": loss_t, "aux": loss_t * 0.01}
            if from_logits:
                inst.observe_loss(loss_t, components=comps, logits=logits, labels=y, sources=["web"])
            else:
                inst.observe_loss(loss_t, components=comps, token_losses=tok_losses, sources=["web"])
            inst.loss.drop()
        return fn

    def sampled_step_loss() -> None:
        inst.observe_loss(loss_t, components={"lm": loss_t, "aux": loss_t * 0.01}, token_losses=tok_losses,
                          sources=["web"])
        sampled_step()

    rows: list[tuple[str, str, Callable[[], Any]]] = [
        ("floor", "floor: torch._foreach_norm over the local gradient pieces", lambda: torch._foreach_norm(present)),
    ]
    if cuda:
        from distgrad.stats import triton_kernel

        auto = "triton" if triton_kernel.available(device) else "eager"
    else:  # the Triton kernel runs on CPU only under its interpreter: no row (meaningless times)
        auto = "native" if dstats._native() is not None else "eager"
    rows.append(("stats_auto", f"distgrad statistics pass, default kernel ({auto})", stats_pass("auto")))
    if auto != "eager":
        rows.append(("stats_eager", "distgrad statistics pass, eager kernel (before #7)", stats_pass("eager")))
    if not args.skip_compile:
        rows.append(("stats_compile", "distgrad statistics pass, torch.compile kernel", stats_pass("compile")))
    rows += [
        ("collect", "distgrad collect: pieces + stats + 2 all-reduce + 1 D2H copy", collect_sync),
        ("sampled_step", "distgrad full sampled step: collect + finish (record, diagnostics, exporter)",
         sampled_step),
        ("sampled_step_async", "distgrad sampled step, async records (publish previous + enqueue this; "
         "pinned copy + event)", sampled_step_async),
        ("tutorial", "baseline: per-parameter loop, .item() per statistic (8 statistics)", tutorial_loop),
        ("composer_norm", "baseline: Composer OptimizerMonitor, per-metric all_reduce + host read (grad norm)",
         composer("norm")),
        ("composer_all", "baseline: the same per-metric loop over distgrad's 7 statistics", composer("distgrad")),
        ("wandb", "baseline: wandb.watch histograms (clone + histc + copy to host, 64 bins)", wandb_watch),
        ("ds_full_grad", "baseline: DeepSpeed safe_get_full_grad + norm().item() per parameter", ds_full_grad_norms),
        ("observe_loss", "loss: observe_loss(loss), per micro-batch", observe_plain),
        ("observe_loss_tokens", "loss: observe_loss with 2 components + per-token losses [1, 128] + source, "
         "per micro-batch", observe_parts(False)),
        ("observe_loss_logits", f"loss: the same from logits [1, 128, {vocab}] and labels (cross-entropy "
         "recomputed in chunks), per micro-batch", observe_parts(True)),
        ("sampled_step_loss", "distgrad full sampled step with components + token losses observed",
         sampled_step_loss),
    ]
    # --- the packed signals (distgrad.signals, issue 15): each alone on top of the bare sampled
    # step (no packed signal), built by its own factory with its config key switched on --------
    from distgrad.signals import FACTORIES, SignalPack

    factories = dict(FACTORIES)
    default_signals = [sig.name for sig in inst.signals.signals]

    def make_signal(name: str, overrides: dict) -> Any:
        saved = inst.config
        inst.config = saved.with_overrides(overrides)
        try:
            return factories[name](inst)
        finally:
            inst.config = saved

    def with_signals(pack: Any) -> Callable[[], None]:
        # each signal row numbers its calls as consecutive optimizer steps of its own (the
        # curvature pairs a step with the one before), far from the other rows' step 0
        steps = iter(range(1000 * (len(rows) + 1), 10**9))

        def fn() -> None:
            saved = inst.signals
            inst.signals = pack
            inst.async_records = False
            try:
                k = next(steps)
                host = inst.collect(k)
                inst.finish(distgrad.StepToken(k, True, host), distgrad.StepOutcome(micro_step=k))
            finally:
                inst.signals = saved
        return fn

    parts: dict[str, str] = {}  # signal row -> the record field its signal fills
    rows.append(("sampled_step_bare", "distgrad full sampled step without packed signals",
                 with_signals(SignalPack([]))))
    signal_rows = []
    for key, label, name, over in SIGNAL_ROWS:
        sig = make_signal(name, over)
        if sig is None:
            continue
        signal_rows.append(key)
        fn = with_signals(SignalPack([sig]))
        if name == "noise_scale":  # what its hooks would have gathered in the backward (2 micro-batches)
            fn = (lambda f, sig: lambda: (sig.norms.reset(), sig.norms._calls.update({0: 1}),
                                          setattr(sig.norms, "_acc", torch.ones((), dtype=torch.float64,
                                                                               device=device)), f()))(fn, sig)
        rows.append((key, label + (" [default on]" if name in default_signals else " [opt-in]"), fn))
        parts[key] = FIELDS[name]
    gns = make_signal("noise_scale", {"noise_scale": {"enabled": True}})
    fake_local = [torch.randn_like(p, device=device) for _, p in ds_params]

    def gns_hooks() -> None:
        """The noise scale's work in the backward pass, per micro-batch: its tensor hook on every
        local (pre-reduction, full-size) gradient; here on random tensors of those shapes."""
        for i, t in enumerate(fake_local):
            gns.norms._hook(i, t)
        gns.norms.reset()

    signal_rows.append("gns_hooks")
    rows.append(("gns_hooks", "signal: gradient noise scale, its hooks' work per micro-batch in the backward "
                 "(|h|^2 of every full-size local gradient) [opt-in]", gns_hooks))
    from distgrad.signals.logits import attention_head_max, output_logit_stats

    hd = width // heads
    fake_qk = [(torch.randn(1, heads, 128, hd, generator=g).to(device), torch.randn(1, heads, 128, hd, generator=g).to(device))
               for _ in range(layers)]

    def logits_hooks() -> None:
        """The logit precursors' work in the forward pass of one sampled micro-batch (logits.attention
        and logits.output): per layer the max of q k^T / sqrt(d) per head, and the output logits'
        log-sum-exp statistics; on random tensors of the model's shapes ([1, heads, 128, d] per
        layer, logits [1, 128, vocab])."""
        for q, k in fake_qk:
            attention_head_max(q, k, is_causal=True)
        output_logit_stats(logits)

    signal_rows.append("logits_hooks")
    rows.append(("logits_hooks", f"signal: logit precursors, their work per sampled micro-batch in the forward "
                 f"(max q k^T/sqrt(d) per head of {layers} layers + logsumexp of logits [1, 128, {vocab}]) [opt-in]",
                 logits_hooks))
    # the lost-to-underflow recomputation (underflow.enabled): on a recomputation step its local()
    # runs two forward+backward passes of the step's first micro-batch (training precision, float32)
    uf = make_signal("underflow", {"underflow": {"enabled": True, "interval": 1}})
    uf.attach(inst, engine.module)()  # its layers; the forward pre-hook removed at once: the row keeps (x, y)
    uf_step = with_signals(SignalPack([uf]))

    def underflow_step() -> None:
        """A sampled step with the underflow signal on its recomputation step: the micro-batch (x, y)
        kept as its forward pre-hook keeps it, then the boundary (both passes, the per-layer counts)."""
        uf._pre(engine.module, (x, y), {})
        uf_step()

    ds_leaves = [p for _, p in ds_params]

    def fwd_bwd() -> None:
        """What the recomputation is measured against: one forward+backward of the same micro-batch
        (autograd.grad, so that no engine hook runs and no .grad is written)."""
        torch.autograd.grad(engine.module(x, y), ds_leaves)

    rows.append(("fwd_bwd", "reference: one forward+backward of the micro-batch [1, 128] (the training step's own "
                 "work per micro-batch)", fwd_bwd))
    signal_rows.append("sig_underflow")
    rows.append(("sig_underflow", "signal: lost to underflow, a recomputation step (underflow.enabled: two "
                 "forward+backward passes of one micro-batch [1, 128], training precision and float32) [opt-in]",
                 underflow_step))
    parts["sig_underflow"] = "underflow"
    try:  # the FP8 scaling health needs torchao (the fp8 extra)
        from distgrad.signals.fp8 import cast_stats

        fp8_ok = True
    except Exception:  # noqa: BLE001
        fp8_ok = False
    if fp8_ok:
        fake_f8 = [(torch.randn(128, width, generator=g).to(device), torch.randn(width, width, generator=g).to(device),
                    torch.randn(128, width, generator=g).to(device) * 1e-4) for _ in range(4 * layers)]

        def fp8_hooks() -> None:
            """The FP8 scaling health's work per sampled micro-batch (fp8.enabled): per float8 linear,
            torchao's amax and scale and the underflow / saturation counts of its input, weight and
            grad_output; 4 float8 linears per layer ([128, width] input and grad_output, [width,
            width] weight), random tensors."""
            for x, w, go in fake_f8:
                cast_stats(x, torch.float8_e4m3fn)
                cast_stats(w, torch.float8_e4m3fn)
                cast_stats(go, torch.float8_e5m2)

        signal_rows.append("fp8_hooks")
        rows.append(("fp8_hooks", f"signal: FP8 scaling health, its work per sampled micro-batch (amax, scale, "
                     f"underflow / saturation counts of input, weight, grad_output of {4 * layers} float8 linears "
                     f"[128, {width}] x [{width}, {width}]) [opt-in]", fp8_hooks))
    # MoE router health (router.enabled) on a model of the same depth with n_exp experts, top-2
    # per layer: (a) its packing and record at the boundary, (b) its forward work per sampled
    # micro-batch and router (DeepSpeed's case, the upper bound: the [T, d] x [d, E] logits
    # recomputed from the gate's input; Hugging Face's hook receives them), on random tensors
    from distgrad.signals.router import RouterHealth, expert_counts, router_entropy_sum

    n_exp, top_k = 8, 2
    rsig = RouterHealth(1)
    rsig.set_layers([str(i) for i in range(layers)], [n_exp] * layers)
    racc = torch.zeros(rsig.sum_size, dtype=torch.float64, device=device)
    for o in rsig._offsets:  # one forward of 128 tokens per layer, spread evenly
        racc[o:o + 5] = torch.tensor([1.0, 1.0, 128.0, 128.0 * math.log(n_exp), 1.0], dtype=torch.float64)
        racc[o + 5:o + 5 + n_exp] = 128.0 * top_k / n_exp
    fn = with_signals(SignalPack([rsig]))
    rows.append(("sig_router", f"signal: MoE router health, packing and record ({layers} layers x {n_exp} experts; "
                 "router.enabled) [opt-in]", (lambda f: lambda: (setattr(rsig, "_acc", racc.clone()), f()))(fn)))
    parts["sig_router"] = "router"
    signal_rows.append("sig_router")
    fake_router = [(torch.randn(128, width, generator=g).to(device), torch.randn(n_exp, width, generator=g).to(device))
                   for _ in range(layers)]
    fake_idx = [torch.topk(x @ w.T, top_k, dim=-1).indices for x, w in fake_router]

    def router_hooks() -> None:
        """The router hooks' work in the forward pass of one sampled micro-batch: per MoE layer the
        gate logits recomputed from its input (DeepSpeed), their float64 softmax entropy and the
        scatter-add of the top-k indices ([128, width] tokens, 8 experts, top-2)."""
        for (x, w), idx in zip(fake_router, fake_idx):
            router_entropy_sum(torch.nn.functional.linear(x.float(), w.float()))
            expert_counts(idx, n_exp)

    signal_rows.append("router_hooks")
    rows.append(("router_hooks", f"signal: MoE router health, its work per sampled micro-batch in the forward "
                 f"({layers} routers: logits [128, {n_exp}] from [128, {width}], float64 entropy, counts) [opt-in]",
                 router_hooks))
    # warm-up (compiles the native kernel and, if listed, the torch.compile kernel)
    t_warm = {}
    for key, _, fn in rows:
        t0 = time.perf_counter()
        fn()
        sync()
        t_warm[key] = time.perf_counter() - t0
    # each signal row's record carries its signal's part (else the row would time a no-op)
    parts_present = {}
    for key, _, fn in rows:
        if key in parts:
            fn()  # the second call: signals comparing with the previous step have it now
            parts_present[key] = getattr(inst.last_record, parts[key], None) is not None
    times: dict[str, list[float]] = {k: [] for k, _, _ in rows}
    for _ in range(args.trials):
        for key, _, fn in rows:
            tdist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - t0)
    counts, mem, ops = {}, {}, {}
    counter = Counter()
    for key, _, fn in rows:
        tdist.barrier()
        counts[key] = counter.run(fn)
        tdist.barrier()
        mem[key] = peak_extra_bytes(fn, cuda)
        tdist.barrier()
        ops[key] = device_ops(fn, cuda)
    # accuracy of the per-parameter norms on these pieces, against float64
    ref = [float(p.double().pow(2).sum()) for p in present]

    def rel_err(sumsq: list[float]) -> float:
        return max((abs(math.sqrt(max(a, 0.0)) - math.sqrt(b)) / math.sqrt(b) if b > 0 else 0.0)
                   for a, b in zip(sumsq, ref))

    acc_err: dict[str, float] = {"floor": rel_err([float(t) ** 2 for t in torch._foreach_norm(present)])}
    exact: dict[str, bool] = {}
    idx = [i for i, p in enumerate(pieces) if p is not None and p.numel()]
    eager_tab = None
    for key, _, fn in rows:
        if key.startswith("stats_"):
            sum_block, max_block = fn()
            per = sum_block[: layout.rank_offset].view(-1, len(dstats.SUM_COLS)).cpu().numpy()
            mx = max_block.view(-1, len(dstats.MAX_COLS)).cpu().numpy()
            acc_err[key] = rel_err([float(per[i, 2]) for i in idx])
            tab = np.concatenate([per[:, [0, 3, 4, 5]], mx], axis=1)
            if key == "stats_eager" or (key == "stats_auto" and auto == "eager"):
                eager_tab = tab
            exact[key] = tab
    exact_vs_eager = {k: bool(np.array_equal(v, eager_tab)) for k, v in exact.items()} if eager_tab is not None else {}
    # every rank's medians: the slowest rank is what training waits for
    med = {k: statistics.median(v) for k, v in times.items()}
    gathered: list = [None] * world
    tdist.all_gather_object(gathered, med)
    result = {
        "size": args.size, "layers": layers, "width": width, "heads": heads, "params": n_params,
        "world_size": world, "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": tdist.get_backend(), "torch_threads": torch.get_num_threads(),
        "local_pieces": len(present), "local_elements": local_elems, "trials": args.trials,
        "default_kernel": auto, "rows": [[k, label] for k, label, _ in rows],
        "times_s": times, "median_s": med, "median_s_per_rank": gathered, "warmup_s": t_warm,
        "counts": {k: list(v) for k, v in counts.items()}, "peak_extra_bytes": mem, "device_ops": ops,
        "stats_kernel_use": dstats.kernel_use(), "signal_rows": signal_rows,
        "default_signals": default_signals, "signal_parts_present": parts_present,
        "adam_every": int(inst.config.optimizer_signals.every),
        "norm_rel_err_vs_fp64": acc_err, "extrema_counts_equal_to_eager": exact_vs_eager,
    }
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    tdist.barrier()
    inst.close()
    tdist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# orchestrator
def launcher_cmd(nproc: int) -> list[str]:
    ds = Path(sys.executable).parent / "deepspeed"
    return [str(ds) if ds.exists() else "deepspeed", "--num_gpus", str(nproc), "--master_port", str(free_port())]


def run_env(cuda: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if not cuda:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def run(cmd: list[str], env: dict, timeout: float, log: Path) -> None:
    with open(log, "w") as f:
        p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"failed (rc={p.returncode}): {' '.join(cmd)}\n{tail}")


def micro(size: str, args: argparse.Namespace, nproc: int, cuda: bool, tmp: Path) -> dict:
    out = tmp / f"micro-{size}.json"
    trials = args.trials if args.trials else (20 if size == "10m" else 5)
    cmd = launcher_cmd(nproc) + [str(ROOT / "launch" / "benchmark.py"), "--worker", "--size", size,
                                 "--trials", str(trials), "--out", str(out)]
    if args.skip_compile:
        cmd.append("--skip-compile")
    t0 = time.time()
    run(cmd, run_env(cuda), args.timeout, tmp / f"micro-{size}.log")
    res = json.loads(out.read_text())
    res["wall_s"] = time.time() - t0
    return res


def run_timed_steps(cmd: list[str], env: dict, timeout: float, log: Path) -> list[float]:
    """Run ``launch/train.py`` (``--log-every 1``) and time its steps from the arrival of rank 0's
    ``[train] step N`` lines (printed right after each optimizer step): the differences between
    consecutive lines are the step times (the first step has none)."""
    import re

    pat = re.compile(r"\[train\] step\s+(\d+)\s")
    arrivals: list[tuple[int, float]] = []
    deadline = time.monotonic() + timeout
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             bufsize=1)
        assert p.stdout is not None
        for line in p.stdout:
            t = time.perf_counter()
            f.write(line)
            m = pat.search(line)
            if m:
                arrivals.append((int(m.group(1)), t))
            if time.monotonic() > deadline:
                p.kill()
                break
        rc = p.wait()
    if rc != 0:
        raise SystemExit(f"failed (rc={rc}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return [t1 - t0 for (s0, t0), (s1, t1) in zip(arrivals, arrivals[1:]) if s1 == s0 + 1]


def median_ratio_ci(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median(b) / median(a) - 1 (within-run noise only)."""
    import random

    rng = random.Random(0)
    r = sorted(statistics.median(rng.choices(b, k=len(b))) / statistics.median(rng.choices(a, k=len(a))) - 1
               for _ in range(n))
    return r[int(0.025 * n)], r[int(0.975 * n) - 1]


def e2e(size: str, args: argparse.Namespace, nproc: int, cuda: bool, tmp: Path) -> dict:
    from distgrad.config import DistgradConfig

    layers, width, heads = SIZES[size]
    default_interval = DistgradConfig().sampling.interval
    variants = [("off", "no distgrad", ["--no-distgrad"]),
                ("every", "distgrad, sampling every step (interval 1)", ["--interval", "1"])]
    if default_interval != 1:
        variants.append(("default", f"distgrad, default interval ({default_interval})",
                         ["--interval", str(default_interval)]))
    else:
        variants.append(("sparse", "distgrad, interval 10", ["--interval", "10"]))
    ds_cfg = json.loads((ROOT / "configs" / "ds_zero2_fp32.json").read_text())
    if E2E_BATCH.get(size) and not cuda:  # CPU only: a GPU runs the example's full batch
        ds_cfg["train_micro_batch_size_per_gpu"], ds_cfg["gradient_accumulation_steps"] = E2E_BATCH[size]
    cfg_path = tmp / f"ds-{size}.json"
    cfg_path.write_text(json.dumps(ds_cfg))
    steps = args.e2e_steps if args.e2e_steps else (30 if size == "10m" else 10)
    tokens = ds_cfg["train_micro_batch_size_per_gpu"] * ds_cfg["gradient_accumulation_steps"] * 128 * nproc
    runs: dict[str, list[dict]] = {k: [] for k, _, _ in variants}
    times: dict[str, list[float]] = {k: [] for k, _, _ in variants}
    for rep in range(args.e2e_repeats):
        order = variants if rep % 2 == 0 else variants[::-1]
        for key, _, extra in order:
            summary = tmp / f"e2e-{size}-{key}-{rep}.json"
            log = tmp / f"e2e-{size}-{key}-{rep}.log"
            cmd = launcher_cmd(nproc) + [str(ROOT / "launch" / "train.py"), "--ds-config", str(cfg_path),
                                         "--layers", str(layers), "--width", str(width), "--heads", str(heads),
                                         "--steps", str(steps), "--log-every", "1", "--port", "0",
                                         "--summary-json", str(summary), *extra]
            per_step = run_timed_steps(cmd, run_env(cuda), args.timeout, log)  # steps 1, 2, ...
            runs[key].append(json.loads(summary.read_text()))
            skip = max(E2E_WARMUP - 1, 0)
            times[key] += per_step[skip:] if len(per_step) > skip else per_step
    med = {k: (statistics.median(v) if v else statistics.median(r["median_step_s"] for r in runs[k]))
           for k, v in times.items()}
    ci = {k: median_ratio_ci(times["off"], v) for k, v in times.items() if k != "off" and v and times["off"]}
    return {"size": size, "steps": steps, "warmup_steps": E2E_WARMUP, "ds_config": ds_cfg,
            "tokens_per_step": tokens, "default_interval": default_interval,
            "variants": [[k, label] for k, label, _ in variants], "median_step_s": med, "overhead_ci95": ci,
            "step_times_s": times, "summaries": runs}


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:,.1f}" if ms < 100 else f"{ms:,.0f}"


def fmt_mb(b: int) -> str:
    return f"{b / 2**20:,.2f}" if b < 10 * 2**20 else f"{b / 2**20:,.0f}"


def render(micros: list[dict], e2es: list[dict], args: argparse.Namespace) -> str:
    lines: list[str] = []
    if not micros:
        return ""
    m0 = micros[0]
    where = (f"{m0['world_size']} x {m0['device_name']} ({m0['backend']})" if m0["device"] == "cuda" else
             f"CPU, {m0['world_size']} ranks ({m0['backend']}), {m0['torch_threads']} torch thread(s) per rank")
    lines.append(f"distgrad benchmark: {where}; DeepSpeed ZeRO-2 fp32; times are rank 0's medians over "
                 f"interleaved trials, every row measured in the same run on the same gradients")
    lines.append("")
    for m in micros:
        med = m["median_s"]
        fl = med["floor"]
        ss = med["sampled_step"]
        lines.append(f"## {m['size']}: GPT {m['layers']} x {m['width']}, {m['params'] / 1e6:.1f}M parameters; rank 0 "
                     f"holds {m['local_elements'] / 1e6:.2f}M gradient elements in {m['local_pieces']} pieces; "
                     f"{m['trials']} trials")
        lines.append("")
        co = med["collect"]
        ops = m.get("device_ops") or {}
        gpu = any(v is not None for v in ops.values())
        lines.append("| row | median ms | x floor | x distgrad collect | x distgrad sampled step | collectives "
                     "| host syncs | extra peak MB |" + (" GPU kernels + copies |" if gpu else ""))
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else ""))
        for key, label in m["rows"]:
            t = med[key]
            c, s = m["counts"][key]
            base = key.startswith("stats_") or key in ("floor", "collect", "sampled_step", "sampled_step_async")
            vs_c = "" if base else f"{t / co:,.1f}"
            vs_s = "" if base else f"{t / ss:,.1f}"
            o = ops.get(key)
            lines.append(f"| {label} | {fmt_ms(t)} | {t / fl:,.2f} | {vs_c} | {vs_s} | {c} | {s} | "
                         f"{fmt_mb(m['peak_extra_bytes'][key])} |" + (f" {o[0]} + {o[1]} |" if gpu and o else
                                                                      " |" if gpu else ""))
        lines.append("")
        if "sampled_step_bare" in med:  # issue 26 item 6: the default sampled step against the floor
            bare, k0 = med["sampled_step_bare"], m.get("adam_every", 1)
            on = ", ".join(m.get("default_signals") or []) or "none"
            lines.append(f"Default sampled step against the floor (default signals: {on}; "
                         f"`optimizer_signals.every` is {k0} in this run): a sampled step that computes them "
                         f"{fmt_ms(ss)} ms = {ss / fl:,.2f}x the floor (the worst sampled step); one that "
                         "`optimizer_signals.every` leaves out costs the step "
                         f"without packed signals, {fmt_ms(bare)} ms = {bare / fl:,.2f}x (the typical sampled step "
                         "for every >= 2). Mean over k consecutive sampled steps, (worst + (k - 1) typical) / k:")
            lines.append("")
            lines.append("| optimizer_signals.every | typical sampled step x floor | worst x floor | mean x floor |")
            lines.append("|---:|---:|---:|---:|")
            for k in sorted({1, 2, 4, 8, 16, k0}):
                typ = ss if k == 1 else bare
                lines.append(f"| {k} | {typ / fl:,.2f} | {ss / fl:,.2f} | {(ss + (k - 1) * bare) / k / fl:,.2f} |")
            lines.append("")
        if m.get("signal_rows"):
            bare = med["sampled_step_bare"]
            labels = dict((k, lab) for k, lab in m["rows"])
            on = ", ".join(m.get("default_signals") or []) or "none"
            lines.append(f"Packed signals (issue 15), each alone on top of the sampled step without packed signals "
                         f"({fmt_ms(bare)} ms); on by default in this run: {on}. The hooks rows are work done in the "
                         "backward pass per micro-batch (noise scale) or in the forward (and backward) pass of the "
                         "sampled step's micro-batches (logit precursors, FP8 scaling health, MoE router health), not at the boundary.")
            lines.append("")
            missing = [k for k, ok in (m.get("signal_parts_present") or {}).items() if not ok]
            lines.append("Every signal row's record carried its signal's values." if not missing else
                         f"WARNING: these rows' records carried no values of their signal: {missing}")
            lines.append("")
            lines.append("| signal | median ms | added ms | added x floor | collectives | host syncs | extra peak MB |")
            lines.append("|---|---:|---:|---:|---:|---:|---:|")
            for key in m["signal_rows"]:
                t = med[key]
                added = t if key.endswith("_hooks") else t - bare
                c, sy = m["counts"][key]
                lines.append(f"| {labels[key]} | {fmt_ms(t)} | {fmt_ms(added)} | {added / fl:,.2f} | {c} | {sy} | "
                             f"{fmt_mb(m['peak_extra_bytes'][key])} |")
            lines.append("")
        errs = ", ".join(f"{k} {v:.1e}" for k, v in m["norm_rel_err_vs_fp64"].items())
        lines.append(f"Largest relative error of a per-parameter norm against float64 on these pieces: {errs}.")
        if m["extrema_counts_equal_to_eager"]:
            same = ", ".join(f"{k}: {'identical' if v else 'DIFFERENT'}"
                             for k, v in m["extrema_counts_equal_to_eager"].items())
            lines.append(f"Counts, min and max compared with the eager kernel: {same}.")
        slow = max(range(len(m["median_s_per_rank"])), key=lambda r: m["median_s_per_rank"][r]["sampled_step"])
        lines.append(f"Slowest rank for the full sampled step: rank {slow} "
                     f"({fmt_ms(m['median_s_per_rank'][slow]['sampled_step'])} ms). First call (warm-up) of "
                     f"the default statistics pass: {fmt_ms(m['warmup_s']['stats_auto'])} ms"
                     + (f"; of the torch.compile kernel: {m['warmup_s']['stats_compile']:.1f} s (compilation)"
                        if "stats_compile" in m["warmup_s"] else "") + ".")
        lines.append("")
    if len(micros) > 1:
        a, b = micros[0], micros[-1]
        grow = b["local_elements"] / a["local_elements"]
        lines.append(f"## Growth {a['size']} -> {b['size']} ({grow:.1f}x the gradient elements per rank, "
                     f"{b['local_pieces'] / a['local_pieces']:.1f}x the pieces)")
        lines.append("")
        lines.append(f"| row | {a['size']} ms | {b['size']} ms | growth |")
        lines.append("|---|---:|---:|---:|")
        for key, label in b["rows"]:
            if key in a["median_s"]:
                lines.append(f"| {label} | {fmt_ms(a['median_s'][key])} | {fmt_ms(b['median_s'][key])} | "
                             f"{b['median_s'][key] / a['median_s'][key]:.1f}x |")
        lines.append("")
    if e2es:
        lines.append("## End-to-end: launch/train.py, ZeRO-2 fp32, median optimizer-step time")
        lines.append("")
        lines.append("| size | tokens/step (all ranks) | steps (warm-up left out) | variant | median step ms | "
                     "overhead (95% CI, within-run) | expected: sampled step / interval / step | "
                     "train.py's own median ms |")
        lines.append("|---|---:|---:|---|---:|---:|---:|---:|")
        by_size = {m["size"]: m for m in micros}
        for e in e2es:
            base = e["median_step_s"]["off"]
            for key, label in e["variants"]:
                t = e["median_step_s"][key]
                over = ""
                if key != "off":
                    lo, hi = e["overhead_ci95"].get(key, (math.nan, math.nan))
                    over = f"{(t / base - 1) * 100:+.1f}% ({lo * 100:+.1f}..{hi * 100:+.1f})"
                pred = ""
                if key != "off" and e["size"] in by_size:
                    interval = 1 if key == "every" else (10 if key == "sparse" else e["default_interval"])
                    pred = f"{by_size[e['size']]['median_s']['sampled_step'] / interval / base * 100:.2f}%"
                own = statistics.median(r["median_step_s"] for r in e["summaries"][key])
                lines.append(f"| {e['size']} | {e['tokens_per_step']} | {e['steps']} ({e['warmup_steps']}) | {label} "
                             f"| {fmt_ms(t)} | {over} | {pred} | {fmt_ms(own)} |")
        lines.append("")
        lines.append(f"The default interval in DistgradConfig is {e2es[0]['default_interval']}"
                     + (" (so 'every step' is also the default)." if e2es[0]['default_interval'] == 1 else "."))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10m,100m", help=f"comma-separated, from {sorted(SIZES)}")
    ap.add_argument("--trials", type=int, default=0, help="micro-benchmark trials (default 20 for 10m, 5 for 100m)")
    ap.add_argument("--e2e-sizes", default=None, help="sizes for the end-to-end runs (default: --sizes)")
    ap.add_argument("--e2e-steps", type=int, default=0, help="optimizer steps per end-to-end run "
                    "(default 30 for 10m, 10 for 100m; the first 3 are left out)")
    ap.add_argument("--e2e-repeats", type=int, default=1, help="repeat the three end-to-end runs (order reversed "
                    "every other time); medians over repeats")
    ap.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile kernel row")
    ap.add_argument("--nproc", type=int, default=0, help="processes (default: GPUs, or 2 on CPU)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launched job")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--markdown", default=None, help="write the tables here")
    ap.add_argument("--keep", default=None, help="keep the launched jobs' logs in this directory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="10m", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    import torch

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    e2e_sizes = sizes if args.e2e_sizes is None else [s.strip() for s in args.e2e_sizes.split(",") if s.strip()]
    for s in sizes + e2e_sizes:
        if s not in SIZES:
            raise SystemExit(f"unknown size {s!r}; choose from {sorted(SIZES)}")
    cuda = torch.cuda.is_available()
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="distgrad-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    micros, e2es = [], []
    for s in sizes:
        print(f"[bench] micro-benchmark {s} on {nproc} {'GPU' if cuda else 'CPU'} ranks ...", flush=True)
        micros.append(micro(s, args, nproc, cuda, tmp))
        print(f"[bench]   done in {micros[-1]['wall_s']:.0f} s", flush=True)
    for s in e2e_sizes:
        print(f"[bench] end-to-end {s}: launch/train.py x {3 * args.e2e_repeats} ...", flush=True)
        t1 = time.time()
        e2es.append(e2e(s, args, nproc, cuda, tmp))
        print(f"[bench]   done in {time.time() - t1:.0f} s", flush=True)
    text = render(micros, e2es, args)
    print()
    print(text)
    print(f"[bench] total {time.time() - t0:.0f} s; logs in {tmp}")
    if args.json:
        Path(args.json).write_text(json.dumps({"micro": micros, "e2e": e2es}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
