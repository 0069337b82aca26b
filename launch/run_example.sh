#!/usr/bin/env bash
# Set up everything (first run only) and start the example training job under the deepspeed
# launcher: 2 CPU ranks with gloo by default, all local GPUs with NCCL when CUDA is available.
# Metrics: http://127.0.0.1:9400/metrics on rank 0 while it trains.
#
#   bash launch/run_example.sh                                   # ZeRO-2 fp32, 200 steps
#   bash launch/run_example.sh --ds-config configs/ds_zero3_bf16.json --steps 500
#   bash launch/run_example.sh --inject nan --inject-step 20     # test your paging
#
# Extra arguments go to launch/train.py (see --help). NPROC overrides the number of ranks,
# MASTER_PORT the rendezvous port (default 29500); DISTGRAD_SETUP=0 skips the set-up step (the
# tests run it from the environment they run in).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ "${DISTGRAD_SETUP:-1}" = 0 ] || bash "$here/scripts/setup_env.sh"
venv="${DISTGRAD_VENV:-$here/.venv}"
export PATH="$venv/bin:$PATH"
cd "$here"
if "$venv/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  nproc="${NPROC:-$("$venv/bin/python" -c 'import torch; print(torch.cuda.device_count())')}"
else
  export DS_ACCELERATOR=cpu
  nproc="${NPROC:-2}"
  # two CPU ranks share the cores: one intra-op thread each (torchrun does this by default)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nproc > 0 ? $(nproc) / nproc : 1 ))}"
fi
exec deepspeed --num_gpus "$nproc" --master_port "${MASTER_PORT:-29500}" launch/train.py "$@"
