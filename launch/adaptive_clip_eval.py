#!/usr/bin/env python3
"""Adaptive clipping, measured (issue 26, item 4; the table in docs/action.md, "Adaptive clipping"):
the tiny causal LM of tests/clip_lm.py trained per seed with ``adaptive_clip.mode`` off, zclip and
adagc, on three schedules: ``unstable`` (learning rate x``--mult`` for 3 steps every 60 from step
120), ``garbage`` (bursts of 3 corrupted batches, each sequence one repeated token, every 40 steps
from step 100: a huge gradient that damages the weights) and ``healthy``; loss spike episodes
counted by one detector for every run (distgrad's RobustJumpDetector on the loss series; for
``garbage`` on the clean-batch steps only, the corrupted batches' own losses left out), the peak
loss after the first fault (clean steps), the final loss (mean of the last 20 steps) and the steps
adaptive clipping clipped.

    python launch/adaptive_clip_eval.py --jobs 3                      # the table's settings
    python launch/adaptive_clip_eval.py --jobs 3 --schedules garbage  # only the garbage rows
    python launch/adaptive_clip_eval.py --optim adamw --lr 3e-3 --modes off,zclip

One process, CPU; about 0.1 s per step on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.clip_lm import (  # noqa: E402
    GARBAGE_EVERY,
    GARBAGE_LEN,
    GARBAGE_START,
    SPIKE_EVERY,
    SPIKE_LEN,
    SPIKE_START,
    garbage_steps,
    spikes,
    train,
)

SCHEDULES = ("unstable", "garbage", "healthy")


def one(job: tuple) -> tuple:
    """One run: ``(seed, schedule, mode, episodes, flagged steps, peak loss from the first fault on
    (``SPIKE_START`` for unstable / healthy, ``GARBAGE_START`` for garbage; clean steps), final
    loss, clipped steps, smallest factor, seconds)``; spikes counted on the clean steps' losses."""
    seed, schedule, mode, steps, lr, optim, mult = job
    t = time.time()
    bad = garbage_steps(steps) if schedule == "garbage" else []
    r = train(mode, seed, steps, schedule == "unstable", lr=lr, optim=optim, mult=mult, garbage=bad)
    ep, fl = spikes(r.clean_losses())
    start = GARBAGE_START if schedule == "garbage" else SPIKE_START
    peak = max(v for s, v in enumerate(r.losses) if s >= start and s not in set(bad))
    return (seed, schedule, mode, ep, fl, peak, r.final_loss(), r.clipped_steps, r.min_factor, time.time() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--optim", default="sgd", choices=("adamw", "sgd"))
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--mult", type=float, default=30.0, help="learning-rate multiplier of the unstable schedule's "
                    f"spikes ({SPIKE_LEN} steps every {SPIKE_EVERY} from step {SPIKE_START})")
    ap.add_argument("--modes", default="off,zclip,adagc")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"some of {','.join(SCHEDULES)}")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    args = ap.parse_args()
    logging.getLogger("distgrad").setLevel(logging.ERROR)  # the runs' own spike logs: not the table
    modes, schedules = args.modes.split(","), args.schedules.split(",")
    if not set(schedules) <= set(SCHEDULES):
        ap.error(f"--schedules: some of {SCHEDULES}, got {schedules}")
    print(f"tiny LM (tests/clip_lm.py), {args.optim} lr {args.lr}, {args.steps} steps, seeds 0-{args.seeds - 1}; "
          f"unstable: lr x{args.mult:g} for {SPIKE_LEN} steps every {SPIKE_EVERY} from step {SPIKE_START}; "
          f"garbage: {GARBAGE_LEN} corrupted batches every {GARBAGE_EVERY} from step {GARBAGE_START} "
          "(spikes counted on the clean steps)", flush=True)
    jobs = [(seed, schedule, mode, args.steps, args.lr, args.optim, args.mult)
            for seed in range(args.seeds) for schedule in schedules for mode in modes]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, jobs))
    rows: dict[tuple[str, str], list] = {}
    for seed, schedule, mode, ep, fl, peak, final, clipped, fmin, sec in results:
        rows.setdefault((schedule, mode), []).append((ep, fl, peak, final, clipped))
        print(f"  seed {seed} {schedule:8s} {mode:5s}: spike episodes {ep}, flagged steps {fl}, peak loss {peak:.3f}, "
              f"final loss {final:.4f}, clipped steps {clipped}, smallest factor {fmin:.3g} ({sec:.0f} s)")
    print()
    print("| schedule | adaptive_clip.mode | loss spike episodes per seed (total) | steps flagged (total) "
          "| peak loss after the first fault, mean | final loss, mean +- sd over seeds | clipped steps per seed |")
    print("|---|---|---|---|---|---|---|")
    for (schedule, mode), rs in sorted(rows.items(), key=lambda kv: (schedules.index(kv[0][0]), modes.index(kv[0][1]))):
        ep, fl, peak, final, cl = zip(*rs)
        sd = statistics.stdev(final) if len(final) > 1 else 0.0
        print(f"| {schedule} | {mode} | {', '.join(map(str, ep))} ({sum(ep)}) | {sum(fl)} "
              f"| {statistics.mean(peak):.3f} | {statistics.mean(final):.4f} +- {sd:.4f} | {', '.join(map(str, cl))} |")


if __name__ == "__main__":
    main()
