#!/usr/bin/env python3
"""Paging precision of a rule file, measured on the healthy-run corpus and the fault runs of
tests/dist/corpus_cases.py (issue 23, item 3): false pages per 10,000 healthy optimizer steps
(tune set and held-out set separately) and each failure's detection delay.

Offline (always): every run's JSONL records are replayed through distgrad's exporter code and the
rules (grafana/rule_replay.py: promtool backfill + Prometheus ``query_range`` of each alerting
rule's expression, ``for:`` applied, one sampled step per second), for the rule file given and
for a baseline rule file (by default today's rules as of --baseline REV, read with git show).
A page is one firing episode of a critical rule; a ticket one of a warning rule.

``--live``: also serve the corpus to a real Prometheus + Alertmanager + echo receiver
(tests/monitoring/corpus_live.py, the same as tests/monitoring/test_paging_corpus.py) and print
each failure's delay in seconds: fault step -> alert firing in Prometheus -> notification
received (1 s scrape and evaluation, route timings shortened to 1 s).

    python launch/paging_eval.py                       # generate the corpus, offline tables
    python launch/paging_eval.py --jsonl-dir DIR       # offline over existing JSONL logs
    python launch/paging_eval.py --live                # + the live delays
    python launch/paging_eval.py --opt-in --baseline ""  # the corpus with the opt-in families on
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grafana import rule_replay
from tests.dist.corpus_cases import RUNS

RULES = ROOT / "grafana" / "alerts" / "distgrad.rules.yml"
#: "today's rules" for comparison: main before the issue-23 detection-policy work
BASELINE = "7dbdb2c"


def generate(out: Path, opt_in: bool = False) -> None:
    """Run the whole corpus (1-process and 2-rank launches) writing JSONL logs into ``out``;
    ``opt_in``: with the opt-in families of ``corpus_cases.OPT_IN`` switched on."""
    from tests.helpers import launch

    extra = ("--opt-in",) if opt_in else ()
    facts = {**launch("corpus_cases.py", out / "one.json", "--set", "tune,heldout", "--jsonl-dir", str(out), *extra,
                      nproc=1)["runs"],
             **launch("corpus_cases.py", out / "two.json", "--set", "all", "--jsonl-dir", str(out), *extra,
                      nproc=2)["runs"]}
    failed = {name: res["error"] for name, res in facts.items() if "error" in res}
    if failed:  # a run that did not train would read as a silent one
        raise SystemExit("corpus runs failed:\n" + "\n".join(f"  {n}: {e}" for n, e in failed.items()))


def table(evals: dict, label: str) -> list[str]:
    lines = [f"rules: {label}",
             "| set | runs | healthy steps | pages (critical) | tickets (warning) | pages / 10k steps | tickets / 10k steps |",
             "|---|---|---|---|---|---|---|"]
    for s in ("tune", "heldout"):
        runs = [r for r in RUNS if r.set == s and r.name in evals]
        steps = sum(evals[r.name].steps for r in runs)
        crit = sum(len(evals[r.name].pages("critical")) for r in runs)
        warn = sum(len(evals[r.name].pages("warning")) for r in runs)
        if steps:
            lines.append(f"| {s} | {len(runs)} | {steps} | {crit} | {warn} | {1e4 * crit / steps:.1f} | {1e4 * warn / steps:.1f} |")
    for r in RUNS:
        if r.set != "faults" and r.name in evals and evals[r.name].pages():
            lines.append(f"  {r.name}: " + ", ".join(f"{a} ({evals[r.name].alerts[a].severity}) at step {st}"
                                                   for a, st in evals[r.name].pages()))
    lines += ["", "| failure | fault step | first page (critical) | delay, sampled steps | alerts fired (step) |",
              "|---|---|---|---|---|"]
    for r in RUNS:
        if r.set == "faults" and r.name in evals:
            ev = evals[r.name]
            crit = ev.pages("critical")
            first = crit[0] if crit else None
            fired = ", ".join(f"{a} ({ev.alerts[a].severity}, {st})" for a, st in ev.pages()) or "none"
            what = f"{r.fault} x{r.lr_mult:g}" if r.fault == "lr" else r.fault
            what += "" if r.pages else " (recovers: must not page)"
            lines.append(f"| {what} (`{r.name}`) | {r.fault_step} | {first[0] + ' at ' + str(first[1]) if first else 'NONE'} "
                         f"| {first[1] - r.fault_step if first else '-'} | {fired} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl-dir", type=Path, default=None, help="existing JSONL logs (<run>.jsonl); default: generate")
    ap.add_argument("--rules", type=Path, default=RULES)
    ap.add_argument("--baseline", default=BASELINE, help="git revision whose rule file is compared ('' to skip)")
    ap.add_argument("--live", action="store_true", help="also measure the live delays (Prometheus + Alertmanager)")
    ap.add_argument("--opt-in", action="store_true",
                    help="generate the corpus with the opt-in families whose alerts apply switched on "
                         "(attention and output logits, update geometry, replica weight hashes)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="work in this directory and keep it (JSONL logs, notifications.json, Prometheus logs)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="paging-eval-") as tmp:
        tmp = Path(tmp) if args.keep is None else args.keep.resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        jsonl = args.jsonl_dir
        live = None
        if args.live:
            from tests.monitoring.corpus_live import (
                alerts_of,
                pages_of,
                run_corpus_live,
            )

            live = run_corpus_live(tmp / "live", rules=args.rules)
            jsonl = jsonl or tmp / "live" / "jsonl"
        elif jsonl is None:
            jsonl = tmp / "corpus"
            jsonl.mkdir()
            generate(jsonl, args.opt_in)
        paths = {r.name: jsonl / f"{r.name}.jsonl" for r in RUNS if (jsonl / f"{r.name}.jsonl").exists()}
        print(f"corpus: {len(paths)} runs from {jsonl}\n")
        print("\n".join(table(rule_replay.evaluate_jsonl(paths, args.rules), str(args.rules.relative_to(ROOT)
                                                                                if args.rules.is_relative_to(ROOT) else args.rules))))
        if args.baseline:
            base = tmp / "baseline.rules.yml"
            base.write_text(subprocess.run(["git", "show", f"{args.baseline}:grafana/alerts/distgrad.rules.yml"], cwd=ROOT,
                                           check=True, capture_output=True, text=True).stdout)
            print()
            print("\n".join(table(rule_replay.evaluate_jsonl(paths, base), f"baseline ({args.baseline})")))
        if live is not None:
            print("\nlive (1 s scrape and evaluation, route timings 1 s): fault step -> firing -> notification")
            print("| failure | first alert firing | firing after (s) | page after (s) | pages | pager notifications |")
            print("|---|---|---|---|---|---|")
            for r in RUNS:
                if r.set != "faults":
                    continue
                res, seen = live["runs"][r.name], live["seen"][r.name]
                pages = pages_of(live["notifications"], r.name)
                sent = sum(1 for _, p, n in live["notifications"] if p == "/pager" and alerts_of(n, r.name))
                first = min(seen["first_firing"].items(), key=lambda kv: kv[1], default=None)
                t_page = pages[0][0] - res["t_fault"] if pages else None
                what = f"{r.fault} x{r.lr_mult:g}" if r.fault == "lr" else r.fault
                print(f"| {what} | {first[0] if first else 'none'} | "
                      f"{first[1] - res['t_fault']:.1f} | " if first else f"| {what} | none | - | ", end="")
                print(f"{t_page:.1f} | {len(pages)} | {sent} |" if t_page is not None else f"- | 0 | {sent} |")
            healthy = [r.name for r in RUNS if r.set != "faults"]
            for path in ("/pager", "/ticket"):
                n = sum(1 for _, p, nt in live["notifications"] for name in healthy if p == path and alerts_of(nt, name))
                print(f"live notifications to {path} about healthy runs: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
