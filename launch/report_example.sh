#!/usr/bin/env bash
# Regenerate the report pictures shown in the README: an example run (2 CPU ranks, ZeRO-2)
# with a NaN injected at step 80, recorded to JSONL, then `distgrad report` on it.
#   bash launch/report_example.sh [OUT_DIR]     (default docs/img/report)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$here/docs/img/report}"
run="$(mktemp -d)"
NPROC=2 bash "$here/launch/run_example.sh" --steps 120 --port 0 --log-every 20 \
  --inject nan --inject-step 80 --set "sinks.jsonl.path=$run/run.jsonl"
"${DISTGRAD_VENV:-$here/.venv}/bin/distgrad" report "$run/run.jsonl" -o "$out"
"${DISTGRAD_VENV:-$here/.venv}/bin/distgrad" summary "$run/run.jsonl"
rm -rf "$run"
