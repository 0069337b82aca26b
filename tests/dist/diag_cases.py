"""Multi-rank driver for the diagnostics tests (tests/test_diagnostics_multirank.py), one launch.

Case "faults" (ZeRO-2 fp32): a fixed batch per rank and a small learning rate, so that the grad
norm is a smooth, slowly falling series; faults are injected into *distgrad's view* of the
reduced local shards (the training itself is untouched, so later steps stay healthy):
  step 130: NaN in one element of parameter X on rank 1 only;
  step 135: +Inf in one element of parameter Y on rank 0 only;
  step 145: every gradient x100 on every rank (a grad-norm spike);
  steps >= 150: parameter Z's gradient zeroed (a frozen / dead layer).
Case "fp16" (ZeRO-2 fp16, hysteresis 1): a real +Inf in a gradient during backward on rank 1 at
step 3: DeepSpeed overflows, skips the step and halves the loss scale.
Case "bf16" (ZeRO-2 bf16): a NaN in distgrad's view at step 2: counted, no loss-scale wording.
Case "resume" (ZeRO-2 fp32): the same 14 steps (a x100 grad-norm spike at step 11) run straight
through, and run with a DeepSpeed checkpoint at step 8 carrying ``Instrument.state_dict()`` in
its client_state, then a restart on a fresh engine (other initial weights) loaded from it, with
and without restoring distgrad's state.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as tdist


import distgrad

from tests.dist.common import driver_args, TinyModel, batch_for
from tests.dist.engines import build_deepspeed, init_distributed


def _engine(stage: int, dtype: str, seed: int = 7, **ds_extra):
    torch.manual_seed(seed)
    model = TinyModel()
    engine, _ = build_deepspeed(model, stage, dtype, 1, lr=1e-4, **ds_extra)
    return engine


def _slim(rec) -> dict:
    sc = rec.scaler
    return {"step": rec.step, "grad_norm": rec.grad_norm, "loss": rec.loss, "loss_scale": rec.loss_scale,
            "overflow": rec.overflow, "step_applied": rec.step_applied, "counters": dict(rec.counters),
            "nonfinite_ranks": rec.nonfinite_ranks, "spikes": rec.spikes.flagged,
            "rank_loss_max_rank": rec.ranks.loss_max_rank if rec.ranks else None,
            "rank_loss_max": list(rec.ranks.loss_max) if rec.ranks else None,
            "grad_norm_spikes_total": rec.spikes.total["grad_norm"],
            "loss_spikes_total": rec.spikes.total["loss"], "vanishing": rec.health.vanishing,
            "provenance": rec.provenance.to_dict() if rec.provenance else None, "report": rec.flight_recorder_report,
            # the record's fields that are set (not None)
            "set_fields": sorted(k for k, v in rec.to_dict().items() if v is not None),
            "consecutive_overflow_steps": sc.consecutive_overflow_steps if sc else None,
            "loss_scale_at_minimum": int(sc.loss_scale_at_minimum) if sc else None,
            "loss_scale_drop_factor": sc.loss_scale_drop_factor if sc else None,
            "loss_scale_collapsed": int(sc.loss_scale_collapsed) if sc else None}


class _Lines(logging.Handler):
    """Keeps the messages of the ``distgrad`` logger on this rank (what it writes to stderr)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def faults_case(rank: int, out_dir: str) -> dict:
    lines = _Lines()
    logging.getLogger("distgrad").addHandler(lines)
    try:
        return _faults_case(rank, out_dir, lines)
    finally:
        logging.getLogger("distgrad").removeHandler(lines)


def _faults_case(rank: int, out_dir: str, lines: _Lines) -> dict:
    engine = _engine(2, "fp32")
    inst = distgrad.instrument(engine, exporter={"enabled": False}, flight_recorder={"dir": out_dir}, tracer={"micro_batches": 1})
    src = inst.source
    offsets = src.local_offsets()
    # X: a parameter rank 1 holds a piece of; Y: one rank 0 holds; chosen on the owner, broadcast
    choice = torch.tensor([-1, -1])
    mine = [i for i, o in enumerate(offsets) if o is not None and o[1] > 0]
    choice[rank] = mine[-1]
    tdist.all_reduce(choice, op=tdist.ReduceOp.MAX)
    y_idx, x_idx = int(choice[0]), int(choice[1])
    z_idx = src.names.index("blocks.0.1.weight")
    real = src.local_pieces
    state = {"step": 0}

    def view():
        pieces = [p.clone() if p is not None else None for p in real()]
        s = state["step"]
        if s == 130 and rank == 1:
            pieces[x_idx][0] = float("nan")
        if s == 135 and rank == 0:
            pieces[y_idx][0] = float("inf")
        if s == 145:
            pieces = [p * 100.0 if p is not None else None for p in pieces]
        if s >= 150 and pieces[z_idx] is not None:
            pieces[z_idx].zero_()
        return pieces
    src.local_pieces = view
    recs = []
    x, y = batch_for(0, 0, rank)
    for step in range(160):
        state["step"] = step
        engine.backward(engine(x, y))
        engine.step()
        recs.append(_slim(inst.last_record))
    inst.close()
    logs: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(logs, lines.lines)  # every rank's distgrad log lines, for rank 0's JSON
    out = {"records": recs, "X": src.names[x_idx], "Y": src.names[y_idx], "Z": src.names[z_idx],
           "reports": [str(p) for p in inst.diagnostics.reports], "counters": dict(inst.counters), "logs": logs}
    return out


def fp16_case(rank: int) -> dict:
    # scale 2**1 with floor 1: the overflow halves it onto its minimum
    engine = _engine(2, "fp16", fp16={"hysteresis": 1, "initial_scale_power": 1, "min_loss_scale": 1})
    # collapse_factor 2: one halving below the last applied scale is a "collapse" here
    inst = distgrad.instrument(engine, exporter={"enabled": False}, loss_scale={"collapse_factor": 2})
    target = dict(engine.module.named_parameters())["blocks.1.1.weight"]
    recs = []
    for step in range(6):
        x, yb = batch_for(step, 0, rank)
        h = None
        if step == 3 and rank == 1:
            def poison(g):
                g = g.clone()
                g.view(-1)[0] = float("inf")
                return g
            h = target.register_hook(poison)
        engine.backward(engine(x.half(), yb))
        if h is not None:
            h.remove()
        engine.step()
        recs.append(_slim(inst.last_record))
    out = {"records": recs, "counters": dict(inst.counters), "engine_skipped": int(engine.skipped_steps),
           "min_loss_scale": inst.source.min_loss_scale()}
    inst.close()
    return out


def bf16_case(rank: int) -> dict:
    from distgrad.export.prometheus import PrometheusSink
    from prometheus_client import generate_latest

    engine = _engine(2, "bf16")
    inst = distgrad.instrument(engine, exporter={"enabled": False})
    real = inst.source.local_pieces
    state = {"step": 0}

    def view():
        pieces = [p.clone() if p is not None else None for p in real()]
        if state["step"] == 2:
            for p in pieces:
                if p is not None and p.numel():
                    p[0] = float("nan")
                    break
        return pieces
    inst.source.local_pieces = view
    recs = []
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "deepspeed"}, 2, serve=False,
                          has_loss_scaler=inst.source.has_loss_scaler())
    texts = []
    for step in range(4):
        state["step"] = step
        x, yb = batch_for(step, 0, rank)
        engine.backward(engine(x.bfloat16(), yb))
        engine.step()
        recs.append(_slim(inst.last_record))
        sink.write(inst.last_record)
        texts.append(generate_latest(sink.registry).decode())
    inst.close()
    return {"records": recs, "metrics_text": texts[2]}


RESUME_STEPS, RESUME_CUT, RESUME_SPIKE = 14, 8, 11
_RESUME_KNOBS = dict(exporter={"enabled": False}, spikes={"ema_warmup": 4, "window": 5}, health={"patience": 2})


def _resume_train(engine, inst, steps, rank: int) -> list[dict]:
    real = inst.source.local_pieces
    state = {"step": 0}

    def view():  # a x100 grad-norm spike in distgrad's view (training untouched)
        pieces = real()
        return [p * 100.0 if p is not None and state["step"] == RESUME_SPIKE else p for p in pieces]
    inst.source.local_pieces = view
    out = []
    for step in steps:
        state["step"] = step
        x, y = batch_for(step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()
        r = inst.last_record
        out.append({"step": r.step, "grad_norm": r.grad_norm, "loss": r.loss, "spikes": r.spikes.to_dict(),
                    "health": r.health.to_dict(), "counters": dict(r.counters)})
    return out


def resume_case(rank: int, ckpt_dir: str) -> dict:
    engine = _engine(2, "fp32")
    inst = distgrad.instrument(engine, **_RESUME_KNOBS)
    straight = _resume_train(engine, inst, range(RESUME_STEPS), rank)
    straight_state = inst.state_dict()
    inst.close()

    engine = _engine(2, "fp32")
    inst = distgrad.instrument(engine, **_RESUME_KNOBS)
    first = _resume_train(engine, inst, range(RESUME_CUT), rank)
    engine.save_checkpoint(ckpt_dir, tag="cut", client_state={"distgrad": inst.state_dict()})
    inst.close()

    runs = {}
    for restore in (True, False):  # restart: a fresh engine from the checkpoint
        engine = _engine(2, "fp32", seed=99)
        _, client = engine.load_checkpoint(ckpt_dir, tag="cut")
        inst = distgrad.instrument(engine, **_RESUME_KNOBS)
        if restore:
            inst.load_state_dict(client["distgrad"])
        runs[restore] = _resume_train(engine, inst, range(RESUME_CUT, RESUME_STEPS), rank)
        if restore:
            resumed_state = inst.state_dict()
        inst.close()
    return {"straight": straight, "first": first, "resumed": runs[True], "not_restored": runs[False],
            "cut": RESUME_CUT, "spike_step": RESUME_SPIKE,
            "straight_state": straight_state["diagnostics"], "resumed_state": resumed_state["diagnostics"]}


def main() -> None:
    args = driver_args()
    rank, _ = init_distributed(fp16=True)
    out_dir = os.path.join(os.path.dirname(args.out), "flightrec")
    results = {}
    for name, fn in (("faults", lambda: faults_case(rank, out_dir)), ("fp16", lambda: fp16_case(rank)),
                     ("bf16", lambda: bf16_case(rank)),
                     ("resume", lambda: resume_case(rank, os.path.join(os.path.dirname(args.out), "ckpt")))):
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    tdist.barrier()


if __name__ == "__main__":
    main()
