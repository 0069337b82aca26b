"""Driver of tests/test_docs_code.py (one torchrun launch, world size 1, gloo on CPU): runs every
python block of README.md and docs/*.md (tests/docs_blocks.py) that is not marked skip, each in
a fresh namespace prepared by its context (``<!-- doctest: context=NAME -->``; a block without
a marker runs as it stands), then checks what the block claims against a reference computed
another way (float64 recomputations, the state that was saved, the loop's own counts).

Harness adaptations: for every block ``distgrad.instrument`` is wrapped so that the
exporter binds a free port (``exporter.port=0``, never the fixed default 9400) and every record
is captured (``add_hook``); every instrument a block made is closed after it. In the
``checkpoint`` context, instrumenting an engine that is already instrumented first closes the
old instrument: that is the restart the block's "after the restart" comment stands for. In the
``torch_loop`` context ``FSDP`` is FSDP1 with ``device_id=cpu`` (it refuses a machine without
an accelerator otherwise) and ``clip_grad_norm_`` records the float64 norm it sees before
clipping.
Writes ``[{"where", "context", "ok", "error", "facts"}]`` as JSON to the path given by --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distgrad
from tests.docs_blocks import blocks
from tests.dist.engines import build_deepspeed

_REAL_INSTRUMENT = distgrad.instrument
MADE: list = []  # instruments made by the current block
RECORDS: list = []  # records of every instrument of the current block
RESTART = {"on": False}


def _instrument(engine: Any, config: Any = None, **kw: Any) -> Any:
    exporter = dict(kw.pop("exporter", None) or {})
    exporter.setdefault("port", 0)
    old = getattr(engine, "_distgrad_instrument", None)
    if RESTART["on"] and old is not None:
        old.close()  # the restart: the old process and its instrument are gone
    inst = _REAL_INSTRUMENT(engine, config, exporter=exporter, **kw)
    inst.add_hook(RECORDS.append)
    MADE.append(inst)
    return inst


distgrad.instrument = _instrument


def _data(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


class _LossModel(nn.Module):
    """forward(batch=(x, y)) -> cross-entropy loss (what a DeepSpeed engine's module returns);
    ``float64_losses``: the same loss of every forward recomputed in float64 from its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.float64_losses: list[float] = []

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.float64_losses.append(float(F.cross_entropy(logits.detach().double(), y)))
        return F.cross_entropy(logits, y)


_DS_CONFIG = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def _ds_engine(model: nn.Module) -> Any:
    return build_deepspeed(model, config=dict(_DS_CONFIG))[0]


def _close_enough(a: float, b: float, rtol: float = 1e-6) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


# ---- contexts: (namespace, check(ns) -> facts; raises AssertionError) --------------------------

def ctx_none(tmp: Path):
    return {}, lambda ns: {}


def ctx_deepspeed(tmp: Path):
    import deepspeed

    ns = {"deepspeed": deepspeed, "distgrad": distgrad, "model": _LossModel(), "ds_config": dict(_DS_CONFIG),
          "loader": [_data(s) for s in range(3)]}

    def check(ns):
        refs = ns["model"].float64_losses  # the loss picked up from engine.backward, per step
        assert [r.step for r in RECORDS] == [0, 1, 2] and len(refs) == 3, ([r.step for r in RECORDS], refs)
        for rec, ref in zip(RECORDS, refs):
            assert _close_enough(rec.loss, ref), (rec.loss, ref)
            assert math.isfinite(rec.grad_norm) and rec.grad_norm > 0, rec.grad_norm
        return {"loss": [r.loss for r in RECORDS], "loss_ref_float64": refs}

    return ns, check


def ctx_torch_loop(tmp: Path):
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel as DDP

    # FSDP1 refuses a CPU-only machine unless told the device (the README's line is for GPUs)
    FSDP = functools.partial(FullyShardedDataParallel, device_id=torch.device("cpu"))

    pre_clip: list[float] = []

    def clip_grad_norm_(params, max_norm):  # records the float64 norm the clip sees, then clips
        params = [p for p in params if p.grad is not None]
        pre_clip.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params)))
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    loader = [[_data(2 * s), _data(2 * s + 1)] for s in range(3)]
    ns = {"torch": torch, "F": F, "distgrad": distgrad, "FSDP": FSDP, "DDP": DDP, "model": _net(),
          "clip_grad_norm_": clip_grad_norm_, "loader": loader}

    def check(ns):
        assert len(RECORDS) == 3 and len(pre_clip) == 3, (len(RECORDS), pre_clip)
        for rec, ref in zip(RECORDS, pre_clip):
            assert _close_enough(rec.grad_norm, ref), (rec.grad_norm, ref)  # the pre-clip norm
            assert _close_enough(rec.clip.post_clip_norm, min(ref, 1.0), 1e-5), (rec.clip.post_clip_norm, ref)
        return {"grad_norm": [r.grad_norm for r in RECORDS], "pre_clip_ref": pre_clip,
                "post_clip": [r.clip.post_clip_norm for r in RECORDS]}

    return ns, check


def ctx_checkpoint(tmp: Path):
    import torch.distributed.checkpoint as dcp

    RESTART["on"] = True
    engine = _ds_engine(_LossModel())
    dg = distgrad.instrument(engine)
    for s in range(2):
        engine.backward(engine(_data(s)))
        engine.step()
    saved = json.dumps(dg.state_dict(), sort_keys=True)
    ns = {"engine": engine, "dg": dg, "distgrad": distgrad, "config": None, "ckpt_dir": str(tmp / "ds"),
          "tag": "step2", "path": str(tmp / "ckpt.pt"), "d": str(tmp / "dcp"), "json": json, "torch": torch,
          "dist": dist, "dcp": dcp, "model_sd": engine.module.state_dict(),
          "optim_sd": {"lr": torch.tensor(1e-3)}}

    def check(ns):
        RESTART["on"] = False
        assert json.loads(saved)["counters"]["sampled_steps"] == 2
        restored = json.dumps(ns["dg"].state_dict(), sort_keys=True)
        assert restored == saved, "the restored instrument's state differs from the saved one"
        return {"restored_equals_saved": True, "new_instrument": ns["dg"] is not dg}

    return ns, check


def ctx_action_stop(tmp: Path):
    saves: list[str] = []
    seen: list[int] = []

    def loader():
        for s in range(6):
            seen.append(s)
            x, y = _data(s)
            if s == 2:
                x[0, 0] = float("nan")  # a non-finite loss and gradient at step 2
            yield x, y

    model = _net()
    ns = {"distgrad": distgrad, "F": F, "model": model, "opt": torch.optim.AdamW(model.parameters()),
          "save_checkpoint": saves.append, "loader": loader()}

    def check(ns):
        bad = [r.step for r in RECORDS if not math.isfinite(r.grad_norm)]
        assert bad == [2], bad
        assert saves == ["ckpt/stopped-at-2"], saves
        assert seen == [0, 1, 2], seen  # the loop stopped right after the non-finite step
        return {"saves": saves, "iterations": len(seen)}

    return ns, check


def ctx_diagnostic_plugin(tmp: Path):
    from distgrad.diagnostics import Diagnostic, register
    from distgrad.diagnostics.base import REGISTRY

    before = list(REGISTRY)
    ns = {"register": register, "Diagnostic": Diagnostic}

    def check(ns):
        cls = ns["MyDiagnostic"]
        added = [c for c in REGISTRY if c not in before]
        REGISTRY[:] = before  # registered for every later instrument: undone for the other blocks
        assert added == [cls] and cls.name == "my_signal", added
        return {"registered": cls.__name__}

    return ns, check


def ctx_landscape(tmp: Path):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x, y):
            return F.cross_entropy(self.net(x), y)

    model = Model()
    batches = [dict(zip("xy", _data(s))) for s in range(2)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    os.chdir(tmp)
    ns = {"model": model, "batches": batches}

    def check(ns):
        r, r2 = ns["r"], ns["r2"]
        assert tuple(r.alphas.shape) == (41,) and tuple(r.loss.shape) == (41,) and tuple(r2.loss.shape) == (31, 31)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # weights restored
        with torch.no_grad():
            ref = sum(float(F.cross_entropy(model.net(b["x"]).double(), b["y"])) for b in batches) / len(batches)
        assert _close_enough(float(r.center), ref, 1e-5), (r.center, ref)
        assert (tmp / "landscape.png").stat().st_size > 0
        return {"center": float(r.center), "center_ref_float64": ref}

    return ns, check


def ctx_loss_components(tmp: Path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    dg = distgrad.instrument(model, optimizer=opt)
    x, y = _data(0)
    logits = model(x)
    lm = F.cross_entropy(logits, y)
    zloss = torch.logsumexp(logits, -1).pow(2).mean()
    ns = {"dg": dg, "lm": lm, "zloss": zloss}

    def check(ns):
        ns["loss"].backward()
        opt.step()
        (rec,) = RECORDS
        lc = rec.loss_components
        got = dict(zip(lc.names, lc.mean))
        assert set(got) == {"lm", "z"} and dict(zip(lc.names, lc.weight))["z"] == 0.01, lc
        ref_lm = float(F.cross_entropy(logits.detach().double(), y))
        ref_z = float(torch.logsumexp(logits.detach().double(), -1).pow(2).mean())
        assert _close_enough(got["lm"], ref_lm, 1e-6) and _close_enough(got["z"], ref_z, 1e-6), (got, ref_lm, ref_z)
        assert _close_enough(rec.loss, ref_lm + 0.01 * ref_z, 1e-6), (rec.loss, ref_lm + 0.01 * ref_z)
        return {"components": got}

    return ns, check


def ctx_token_loss(tmp: Path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11))
    opt = torch.optim.AdamW(model.parameters())
    dg = distgrad.instrument(model, optimizer=opt, loss={"sources": ["web", "code"]})
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[1, 3:] = -100  # padding
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ns = {"F": F, "dg": dg, "logits": logits, "labels": labels, "loss": loss, "batch": {"source": ["web", "code"]}}

    def check(ns):
        ns["loss"].backward()
        opt.step()
        (rec,) = RECORDS
        tl = rec.token_loss
        mask = labels != -100
        ref = F.cross_entropy(logits.detach().double().flatten(0, 1), labels.flatten(), reduction="none")
        ref_mean = float(ref[mask.flatten()].mean())
        assert tl.tokens == int(mask.sum()), tl.tokens
        assert _close_enough(tl.mean, ref_mean, 1e-6), (tl.mean, ref_mean)
        return {"tokens": tl.tokens, "mean": tl.mean, "mean_ref_float64": ref_mean}

    return ns, check


CONTEXTS: dict[str, Callable] = {name[4:]: fn for name, fn in globals().items() if name.startswith("ctx_")}


def run_block(b) -> dict:
    name = b.marker.get("context", "none")
    out: dict[str, Any] = {"where": b.where, "context": name, "ok": False, "error": None, "facts": {}}
    MADE.clear()
    RECORDS.clear()
    cwd = os.getcwd()
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="docs-block-") as tmp:
            ns, check = CONTEXTS[name](Path(tmp))
            ns.setdefault("__name__", "__doc_block__")
            exec(compile(b.code, b.where, "exec"), ns)
            out["facts"] = check(ns)
            out["ok"] = True
    except Exception:  # noqa: BLE001  reported per block
        out["error"] = traceback.format_exc()[-3000:]
    finally:
        RESTART["on"] = False
        os.chdir(cwd)
        for inst in MADE:
            inst.close()
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None, help="run only the blocks whose where contains this")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    results = [run_block(b) for b in blocks()
               if b.lang == "python" and "skip" not in b.marker and (args.only is None or args.only in b.where)]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
