"""The framework integrations save distgrad's state in the framework's own checkpoint and restore
it on resume, without user code (docs/checkpointing.md, "Framework integrations"):

- Hugging Face Trainer: ``trainer_state.json`` -> ``stateful_callbacks["DistgradState"]``,
  restored at ``on_train_begin`` of ``trainer.train(resume_from_checkpoint=...)``;
- PyTorch Lightning: ``DistgradCallback.state_dict()`` in ``checkpoint["callbacks"]``, restored
  through ``load_state_dict()`` by ``trainer.fit(ckpt_path=...)``;
- Accelerate: an object registered with ``accelerator.register_for_checkpointing``, saved by
  ``accelerator.save_state`` and restored by ``accelerator.load_state``.

Each case (tests/dist/ckpt_cases.py) trains a random-init 2-layer Llama for 8 optimizer steps,
with the spike detectors' warm-ups and windows shortened to 3 samples so that they test by the
checkpoint after step 4, on 2 gloo ranks (DDP, and DeepSpeed ZeRO-2 under the Trainer; one
launch) and, for Accelerate and Lightning, on one process (in this process; the Trainer on one
process: the last test). The reference is the same run without interruption: a new Trainer / loop with a model built from
another seed resumes from its step-4 checkpoint, and the resumed run's records of steps 4..7
(step numbers, gradient norm, loss, spike z-scores and decisions, spike totals, health, counters)
and its final distgrad state must equal the uninterrupted run's exactly, on every rank (compared
as JSON text, so that NaN equals NaN). Without the restore the step numbers would restart at 0,
the counters at 0 and the z-scores would be NaN (a new warm-up): the first resumed record is
checked for each.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import launch
from tests.reference import case

@pytest.fixture
def ckpt_cases(monkeypatch):
    """tests/dist/ckpt_cases.py, with the environment a one-process accelerate state needs;
    reset afterwards."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # make_state sets both; restored afterwards
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    from tests.dist import ckpt_cases

    yield ckpt_cases
    ckpt_cases.reset_accelerate()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch("ckpt_cases.py", tmp_path_factory.mktemp("ckpt") / "ckpt.json")


def _text(x) -> str:
    return json.dumps(x, sort_keys=True)


def _check_resumed(c: dict, steps: int, cut: int) -> None:
    straight, resumed = c["straight"], c["resumed"]
    assert [r["step"] for r in straight] == list(range(steps))
    assert [r["step"] for r in resumed] == list(range(cut, steps))
    # the same model, optimizer and data after the restart: the detectors' inputs agree exactly
    assert [(r["grad_norm"], r["loss"]) for r in resumed] == [(r["grad_norm"], r["loss"]) for r in straight[cut:]]
    # the detectors were testing at the cut (not a warm-up again), and continue exactly as uninterrupted
    first = resumed[0]["spikes"]["zscore"]
    assert first["grad_norm"] and all(math.isfinite(z) for s in ("grad_norm", "loss") for z in first[s].values())
    assert resumed[0]["counters"]["sampled_steps"] == cut + 1
    assert _text(resumed) == _text(straight[cut:])
    if c["straight_state"]["boundary"] is None:  # DeepSpeed: the engine's global_steps, restored by its checkpoint
        assert c["resumed_state"]["boundary"] is None
    else:
        assert c["resumed_state"]["boundary"] == {"step": steps, "micro": c["straight_state"]["boundary"]["micro"]}
    assert _text(c["resumed_state"]) == _text(c["straight_state"])
    # what the framework's checkpoint files hold, read back: the state after step cut - 1 (with
    # asynchronous records too: its record was built before the state was taken)
    assert c["saved_cut"]["counters"]["sampled_steps"] == cut
    assert c["saved_cut"]["boundary"] is None or c["saved_cut"]["boundary"]["step"] == cut
    if "saved" in c:
        assert _text(c["saved"]["a"]) == _text(c["saved"]["b"]) == _text(c["straight_state"])


@pytest.mark.parametrize("name", ["accelerate", "lightning"])  # the Trainer: below and the 2-rank case
def test_one_process_resume_equals_uninterrupted_run_with_async_records(ckpt_cases, tmp_path, name):
    # asynchronous records (the default on CUDA; forced here): the last sampled step's record is
    # parked until the next boundary, and is built before the framework takes the state
    c = ckpt_cases.run_case(name, "single", str(tmp_path), async_records=True)
    _check_resumed(c, ckpt_cases.STEPS, ckpt_cases.CUT)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["trainer_ddp", "trainer_ds", "accelerate_ddp", "lightning_ddp"])
def test_two_ranks_resume_equals_uninterrupted_run_on_every_rank(two_ranks, name):
    ranks = case(two_ranks, name)["ranks"]
    assert len(ranks) == 2
    for c in ranks:
        assert "error" not in c, c.get("traceback")
        _check_resumed(c, 8, 4)
        if name.startswith("trainer"):  # the DistgradState callback saved the live instrument's state
            assert c["holder_linked"] == [True, True]
    # every rank restored the same state (each rank read the checkpoint rank 0 wrote)
    assert _text(ranks[0]["resumed_state"]) == _text(ranks[1]["resumed_state"])


def test_hf_trainer_rebuilding_callbacks_and_old_checkpoints(ckpt_cases, tmp_path):
    """``restore_callback_states_from_checkpoint=True`` (the Trainer rebuilds stored callbacks from
    their args) still restores distgrad's state; a checkpoint written without distgrad resumes
    with fresh detectors and the next checkpoint carries the state (the Trainer's save looks the
    key up)."""
    from distgrad.integrations.hf import STATE_KEY

    def train(run: str, steps: int, resume: str | None = None, **kw) -> dict | None:
        return ckpt_cases.train_trainer("single", str(tmp_path / run), 1234, resume=resume, steps=steps,
                                        save_steps=2, **kw)

    def saved(run: str, step: int) -> dict:
        text = (tmp_path / run / f"checkpoint-{step}" / "trainer_state.json").read_text()
        return json.loads(text)["stateful_callbacks"][STATE_KEY]["instrument"]

    # asynchronous records: the callback builds the parked record of step 1 before the Trainer
    # saves at step 2 (else the checkpoint would hold 1 sampled step, and the end 3)
    two = train("a", 2, async_records=True)
    assert saved("a", 2)["counters"]["sampled_steps"] == 2
    four = train("b", 4, resume=str(tmp_path / "a" / "checkpoint-2"), restore_callback_states_from_checkpoint=True,
                 async_records=True)
    assert four["holder_linked"]
    assert [r["step"] for r in four["records"]] == [2, 3]
    assert four["state"]["counters"]["sampled_steps"] == two["state"]["counters"]["sampled_steps"] + 2 == 4
    assert _text(saved("b", 4)) == _text(four["state"])

    train("c", 2, with_distgrad=False)
    fresh = train("d", 4, resume=str(tmp_path / "c" / "checkpoint-2"))
    assert fresh["state"]["counters"]["sampled_steps"] == 2 and fresh["state"]["boundary"]["step"] == 2  # from scratch
    assert _text(saved("d", 4)) == _text(fresh["state"])
