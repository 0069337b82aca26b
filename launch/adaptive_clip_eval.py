#!/usr/bin/env python3
"""Adaptive clipping, measured (issue 26, item 4; the table in docs/action.md, "Adaptive clipping"):
the tiny causal LM of tests/clip_lm.py trained per seed with ``adaptive_clip.mode`` off, zclip and
adagc, on an unstable schedule and on a healthy one; loss spike episodes counted by one detector
for every run (distgrad's RobustJumpDetector on the loss series), the final loss (mean of the last
20 steps) and the steps adaptive clipping clipped.

    python launch/adaptive_clip_eval.py                         # defaults of the table
    python launch/adaptive_clip_eval.py --seeds 5 --steps 300 --optim sgd --lr 0.3 --mult 10

One process, CPU; about 0.1 s per step on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.clip_lm import SPIKE_EVERY, SPIKE_LEN, spike_episodes, train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--optim", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mult", type=float, default=30.0, help="learning-rate multiplier of the unstable schedule's "
                    f"spikes ({SPIKE_LEN} steps every {SPIKE_EVERY})")
    ap.add_argument("--modes", default="off,zclip,adagc")
    args = ap.parse_args()
    modes = args.modes.split(",")
    print(f"tiny LM (tests/clip_lm.py), {args.optim} lr {args.lr}, {args.steps} steps, seeds 0-{args.seeds - 1}; "
          f"unstable: lr x{args.mult:g} for {SPIKE_LEN} steps every {SPIKE_EVERY}", flush=True)
    rows: dict[tuple[str, str], list] = {}
    for seed in range(args.seeds):
        for schedule in ("unstable", "healthy"):
            for mode in modes:
                t = time.time()
                r = train(mode, seed, args.steps, schedule == "unstable", lr=args.lr, optim=args.optim, mult=args.mult)
                spikes = spike_episodes(r.losses)
                rows.setdefault((schedule, mode), []).append((spikes, r.final_loss(), r.clipped_steps))
                print(f"  seed {seed} {schedule:8s} {mode:5s}: spike episodes {spikes}, final loss {r.final_loss():.4f}, "
                      f"clipped steps {r.clipped_steps}, smallest factor {r.min_factor:.3g} ({time.time() - t:.0f} s)",
                      flush=True)
    print()
    print("| schedule | adaptive_clip.mode | loss spike episodes per seed (total) | final loss, mean +- sd over seeds "
          "| clipped steps per seed |")
    print("|---|---|---|---|---|")
    for (schedule, mode), rs in rows.items():
        sp, fl, cl = zip(*rs)
        sd = statistics.stdev(fl) if len(fl) > 1 else 0.0
        print(f"| {schedule} | {mode} | {', '.join(map(str, sp))} ({sum(sp)}) | {statistics.mean(fl):.4f} +- {sd:.4f} "
              f"| {', '.join(map(str, cl))} |")


if __name__ == "__main__":
    main()
