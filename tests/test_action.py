"""The opt-in action (config ``action``, distgrad/diagnostics/action.py): on a non-finite step or a paging
spike the optimizer update is skipped on every rank (parameters and optimizer state bit for bit
unchanged), or skipped and the run stopped after the ``on_stop`` callbacks; counted, exported,
and the step's sample indices written per rank. Multi-rank cases: tests/dist/action_cases.py
(one 2-rank launch); single-process checks of each torch optimizer and of the refusals here."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.config import ConfigError
from tests.helpers import launch

BAD_NAN, BAD_SPIKE = 4, 14


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("action") / "action_cases.json"
    res = launch("action_cases.py", out)["cases"]
    for key, case in res.items():
        for r in case["ranks"]:
            assert "error" not in r, f"{key}: {r.get('traceback')}"
    return res


def _indices(step: int, rank: int, n: int = 16) -> list[int]:
    return [100_000 * rank + 1000 * step + i for i in range(n)]


@pytest.mark.parametrize("key", ["ddp-skip", "fsdp2-skip"])
def test_nan_from_one_ranks_batch_skips_the_update_on_every_rank(cases, key):
    for rank, res in enumerate(cases[key]["ranks"]):
        steps = res["steps"]
        assert [s["step"] for s in steps] == list(range(8))
        # the bad step: parameters and optimizer state bit for bit as before, on every rank
        assert [s["changed"] for s in steps] == [s["step"] != BAD_NAN for s in steps], rank
        bad = steps[BAD_NAN]
        assert bad["applied"] is False
        assert bad["action"]["cause"] == "nonfinite" and bad["action"]["skipped"] is True
        assert [s["action"]["skipped"] for s in steps] == [s["step"] == BAD_NAN for s in steps]
        # training went on, on finite weights; distgrad's skip is not the engine's
        assert all(s["finite"] for s in steps)
        assert steps[-1]["counters"]["action_skipped_nonfinite"] == 1
        assert steps[-1]["counters"]["action_skipped_spike"] == 0
        assert steps[-1]["counters"]["skipped_steps"] == 0
        assert res["should_stop"] is False and res["stops"] == []
        # this rank's sample indices of the skipped step (rank 1's batch held the zero sample)
        assert [(d["step"], d["rank"], d["cause"], d["mode"]) for d in res["file"]] == [(BAD_NAN, rank, "nonfinite", "skip")]
        assert res["file"][0]["samples_by_micro_batch"] == {"0": _indices(BAD_NAN, rank)}
    served = cases[key]["ranks"][0]["served"]
    assert 'distgrad_action_skipped_steps_total{cause="nonfinite"} 1.0' in served
    assert 'distgrad_action_skipped_steps_total{cause="spike"} 0.0' in served
    assert "distgrad_action_stop_requested 0.0" in served
    assert "distgrad_skipped_steps_total 0.0" in served


def test_default_off_applies_the_nan_update_as_before(cases):
    for res in cases["ddp-off"]["ranks"]:
        steps = res["steps"]
        assert all(s["changed"] and s["applied"] and s["action"] is None for s in steps)
        assert [s["finite"] for s in steps] == [s["step"] < BAD_NAN for s in steps]  # AdamW spread the NaN
        assert res["file"] == []
    assert "distgrad_action" not in cases["ddp-off"]["ranks"][0]["served"]


def test_stop_runs_the_callback_on_every_rank_and_stops_at_that_step(cases):
    states = set()
    for rank, res in enumerate(cases["ddp-stop"]["ranks"]):
        steps = res["steps"]
        assert [s["step"] for s in steps] == list(range(BAD_NAN + 1))  # the loop left on should_stop
        assert res["should_stop"] is True
        assert not steps[-1]["changed"] and steps[-1]["applied"] is False
        assert steps[-1]["action"] == {**steps[-1]["action"], "cause": "nonfinite", "mode": "stop", "skipped": True,
                                       "stop_requested": True}
        # the callback ran once, at the stopping step, with every rank there (its all-reduce
        # summed one per rank), on the state from before the offending update
        assert [(s["step"], s["cause"], s["ranks_here"]) for s in res["stops"]] == [(BAD_NAN, "nonfinite", 2)]
        assert res["stops"][0]["state"] == steps[-1]["before"]
        assert [d["mode"] for d in res["file"]] == ["stop"]
        states.add(res["stops"][0]["state"])
    assert len(states) == 1  # DDP replicas: the same weights and optimizer state on both ranks
    assert "distgrad_action_stop_requested 1.0" in cases["ddp-stop"]["ranks"][0]["served"]


@pytest.mark.parametrize("key", ["ds-spike", "ds3-bf16-spike"])
def test_paging_spike_under_deepspeed_skips_the_update(cases, key):
    """ZeRO-2 fp32 and ZeRO-3 bf16: training weights, fp32 master partitions and the moments are
    bit for bit unchanged by the skipped step, on every rank."""
    for rank, res in enumerate(cases[key]["ranks"]):
        steps = res["steps"]
        assert [s["changed"] for s in steps] == [s["step"] != BAD_SPIKE for s in steps], rank
        assert steps[BAD_SPIKE]["moments"] > 0  # the digest covered the optimizer's state
        bad = steps[BAD_SPIKE]
        assert bad["fired"] == {"loss": ["robust"]}  # the record's own detector agrees with the decision
        assert bad["action"]["cause"] == "spike" and bad["action"]["skipped"] is True
        assert bad["applied"] is False and bad["engine_applied"] is False
        assert bad["lr_stepped"] is False and steps[BAD_SPIKE + 1]["lr_stepped"] is True  # as on DeepSpeed's own skips
        assert sum(s["action"]["skipped"] for s in steps) == 1
        assert steps[-1]["counters"]["action_skipped_spike"] == 1
        assert [(d["step"], d["cause"]) for d in res["file"]] == [(BAD_SPIKE, "spike")]
        assert res["file"][0]["samples_by_micro_batch"] == {"0": _indices(BAD_SPIKE, rank)}
    assert 'distgrad_action_skipped_steps_total{cause="spike"} 1.0' in cases[key]["ranks"][0]["served"]


# ---------------------------------------------------------------------------------------------
# single process: every torch optimizer leaves parameters and state alone on a skipped step

def _opt(name: str, params):
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
            "adam": lambda: torch.optim.Adam(params, lr=1e-2),
            "adamw-foreach": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
            "adamw-fused": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-2, momentum=0.5),
            "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-2)}[name]()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw-foreach", "adamw-fused", "rmsprop", "adagrad"])
def test_skipped_step_leaves_parameters_and_state_bit_identical(name, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = _opt(name, model.parameters())
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False},
                               action={"on_nonfinite": "skip", "samples_dir": str(tmp_path)})
    for step in range(4):
        x = torch.randn(3, 4)
        if step == 2:
            x[1, 0] = float("inf") * 0  # NaN
        loss = model(x).pow(2).mean()
        inst.observe_loss(loss, samples=torch.tensor([7 * step, 7 * step + 1, 7 * step + 2]))
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        opt.step()
        after = (model.state_dict(), opt.state_dict())
        same = all(torch.equal(before[0][k], after[0][k]) for k in after[0]) and _same_state(before[1], after[1])
        assert same == (step == 2), (name, step)
        assert [p.grad for p in model.parameters()] == grads  # given back after the step
        opt.zero_grad()
    inst.close()
    lines = [json.loads(ln) for ln in (tmp_path / "action-rank0.jsonl").read_text().splitlines()]
    assert [(d["step"], d["samples_by_micro_batch"]) for d in lines] == [(2, {"0": [14, 15, 16]})]


def _same_state(a: dict, b: dict) -> bool:
    if a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][k][n]))
               for k, st in a["state"].items() for n, v in st.items())


def test_refusals_name_the_keys_and_the_fix():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"action.on_spike: stop.*'sampling.interval' 1 \(got 4\).*sampling.interval: 1"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, sampling={"interval": 4},
                            action={"on_spike": "stop"})
    with pytest.raises(ConfigError, match=r"action.on_nonfinite: skip.*'statistics.async_records' on.*async_records: off"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "on"},
                            action={"on_nonfinite": "skip"})
    with pytest.raises(ConfigError, match="action.on_nonfinite"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, action={"on_nonfinite": "pause"})
    # auto resolves to synchronous records when an action is configured (the decision needs them)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, action={"on_nonfinite": "skip"})
    assert inst.async_records is False and inst.action.active
    inst.close()
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    assert not inst.action.active and inst.should_stop is False
    inst.close()


def test_lightning_stop_path_skips_the_update_runs_the_callback_and_stops_the_fit():
    import lightning as L

    from distgrad.integrations.lightning import DistgradCallback

    torch.manual_seed(0)
    bad = 3
    states: list[dict] = []
    stops: list = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            if self.trainer.global_step == bad:
                x = x.clone()
                x[0, 0] = float("nan")  # one NaN input: loss and gradients NaN
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    cb = DistgradCallback(exporter={"enabled": False}, action={"on_nonfinite": "stop"})

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            cb.instrument.on_stop(lambda d: stops.append((d.step, trainer.global_step)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            states.append({"params": [p.detach().clone() for p in pl_module.parameters()],
                           "exp_avg": [opt.state[p]["exp_avg"].clone() for p in pl_module.parameters()]})

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Watch()])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    assert len(states) == bad + 1  # the fit stopped after the bad batch
    assert stops == [(bad, bad)]  # once, inside the bad step (before Lightning counted it)
    for key in ("params", "exp_avg"):
        assert all(torch.equal(a, b) for a, b in zip(states[bad - 1][key], states[bad][key]))  # skipped
        assert not all(torch.equal(a, b) for a, b in zip(states[bad - 2][key], states[bad - 1][key]))
    assert all(torch.isfinite(p).all() for p in states[-1]["params"])
    assert cb.instrument.should_stop


def test_framework_loss_names_the_micro_batch_that_made_it_nonfinite(tmp_path):
    """Lightning pre-scales each micro-batch loss by 1/GA ("sum" loss reduction): the rank's
    largest micro-batch (``loss_max_micro``, the loss report's ``micro_batch``) is still the
    one whose loss was largest or NaN, as the loop computed it (it was 0 on every step)."""
    import lightning as L

    from distgrad.integrations.lightning import DistgradCallback

    torch.manual_seed(0)
    ga, bad_step, bad_micro = 3, 2, 1
    losses: list[list[float]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            if batch_idx % ga == 0:
                losses.append([])
            if self.trainer.global_step == bad_step and batch_idx % ga == bad_micro:
                x = x.clone()
                x[0, 0] = float("nan")
            loss = self.net(x).pow(2).mean()
            losses[-1].append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    records: list = []
    cb = DistgradCallback(exporter={"enabled": False}, action={"on_nonfinite": "skip"},
                          flight_recorder={"dir": str(tmp_path)})

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            cb.instrument.add_hook(records.append)

    data = torch.utils.data.TensorDataset(torch.randn(60, 4) * torch.linspace(0.1, 3, 60)[:, None])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=ga, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb, Watch()])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    assert [r.step for r in records] == list(range(5)) and len(losses) == 5
    for rec, step_losses in zip(records, losses):
        expect = bad_micro if rec.step == bad_step else max(range(ga), key=step_losses.__getitem__)
        assert rec.ranks.loss_max_micro == [expect], (rec.step, step_losses)
    assert any(max(range(ga), key=ls.__getitem__) != 0 for ls in losses)  # the check can fail
    doc = json.loads((tmp_path / f"lossspike-step{bad_step}-rank0.json").read_text())
    assert doc["reason"] == "nonfinite_loss" and doc["micro_batch"] == bad_micro


def test_hugging_face_trainer_stop_path_saves_the_last_good_state_and_stops(tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from distgrad.integrations.hf import attach

    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    reset()
    bad = 3

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.poison = False

        def forward(self, x, labels):
            if self.poison:
                x = x.clone()
                x[0, 0] = float("nan")  # one NaN input on this step: loss and gradients NaN
            return {"loss": (self.net(x).squeeze(-1) - labels).pow(2).mean()}

    torch.manual_seed(0)
    model = Model()
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(64)]
    snapshots: list[list[torch.Tensor]] = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            model.poison = state.global_step == bad

        def on_step_end(self, args, state, control, **kw):
            snapshots.append([p.detach().clone() for p in model.parameters()])

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=10, report_to=[],
                             save_strategy="no", logging_steps=1, learning_rate=1e-2, max_grad_norm=1.0,
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=5)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Watch()])
    cb = attach(trainer, exporter={"enabled": False}, action={"on_nonfinite": "stop"})
    try:
        trainer.train()
    finally:
        reset()
    assert trainer.state.global_step == bad + 1 and len(snapshots) == bad + 1  # stopped after the bad step
    assert cb.instrument.should_stop
    assert all(torch.equal(a, b) for a, b in zip(snapshots[bad - 1], snapshots[bad]))  # its update skipped
    assert all(torch.isfinite(p).all() for p in snapshots[bad])
    # the Trainer saved a checkpoint of that state before stopping
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / f"checkpoint-{bad + 1}" / "model.safetensors"))
    assert all(torch.equal(saved[n], p) for (n, _), p in zip(model.named_parameters(), snapshots[bad]))
