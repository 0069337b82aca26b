#!/usr/bin/env bash
# The GPU measurement of issue #17 in one command (docs/performance.md, "On a GPU").
#
#   where pip reaches PyPI, once:  bash launch/gpu_wheels.sh     # DeepSpeed & co. into .whl/
#   on the GPU machine:            bash launch/gpu_check.sh [OUTDIR]
#     (with .whl/ copied along; OUTDIR defaults to $OUT, else ./gpu_check_out; 6 files are
#      written there; the steps are capped at 30 + 150 + 380 s: one 10-minute slot holds it)
#
# Needs CUDA torch and triton on the machine (not installed here: it may have no index). Steps,
# each one's exit status in summary.txt (a failed step does not stop the others):
#   1. env.txt       torch / triton / GPU / driver
#   2. tests.log     the Triton kernel and the asynchronous records on CUDA tensors
#                    (DISTGRAD_TEST_DEVICE=cuda: tests/stats_triton_cases.py against float64 and
#                    the native CPU kernel, grid independence, the forced kernel through
#                    stats_table; tests/test_async_records.py: no host read in the sampled step,
#                    records equal to the synchronous mode, the CUDA event complete when read)
#   3. benchmark.md / benchmark.json / bench.log   launch/benchmark.py on CUDA (one process per
#                    GPU, NCCL): statistics pass per kernel vs the _foreach_norm floor, GPU
#                    kernels + copies per row, host syncs (incl. event waits that blocked), extra
#                    memory, then end-to-end sampling overhead; sizes from GPU_CHECK_SIZES
#                    (default 10m,100m) and GPU_CHECK_E2E (default 100m; empty: none)
# A dry run of the plumbing without a GPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZES=10m GPU_CHECK_E2E=
# PYTHON=.venv/bin/python bash launch/gpu_check.sh /tmp/gc (CPU numbers, interpreter tests).
# Paste benchmark.md into docs/performance.md with the date, the machine and env.txt's versions.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.txt"
: > "$summary"
step() {  # step NAME TIMEOUT CMD...: run, log the exit status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$summary"
}

if ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/distgrad-site \
    .whl/*.whl || echo "wheels: install failed" | tee -a "$summary"
  export PYTHONPATH="$PYTHONPATH:/tmp/distgrad-site" PATH="/tmp/distgrad-site/bin:$PATH"
fi

step env 30 "$py" - > "$out/env.txt" 2>&1 <<'EOF'
import subprocess, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton missing:", e)
try:
    import deepspeed; print("deepspeed", deepspeed.__version__)
except Exception as e: print("deepspeed missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(), torch.cuda.device_count(), "x", p.total_memory // 2**20, "MiB", p.multi_processor_count, "SMs")
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
                          "--format=csv"], capture_output=True, text=True).stdout)
except OSError as e:
    print("nvidia-smi:", e)
EOF
cat "$out/env.txt"

step tests 150 env DISTGRAD_TEST_DEVICE="${GPU_CHECK_DEVICE:-cuda}" "$py" -m pytest -x -q -p no:cacheprovider \
  tests/stats_triton_cases.py tests/test_async_records.py \
  > "$out/tests.log" 2>&1
tail -5 "$out/tests.log"

step benchmark 380 "$py" launch/benchmark.py --sizes "${GPU_CHECK_SIZES:-10m,100m}" \
  --e2e-sizes "${GPU_CHECK_E2E-100m}" --e2e-steps "${GPU_CHECK_E2E_STEPS:-30}" --skip-compile \
  --keep /tmp/distgrad-bench-logs --json "$out/benchmark.json" --markdown "$out/benchmark.md" \
  > "$out/bench.log" 2>&1
tail -40 "$out/bench.log"
cat "$summary"
