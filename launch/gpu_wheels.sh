#!/usr/bin/env bash
# Prepare ./.whl/ (git-ignored) with the Python packages launch/gpu_check.sh needs on a GPU
# machine that cannot reach a package index and already has CUDA torch, triton, numpy, pytest,
# prometheus_client, pyyaml and mpi4py (the lent H200 image: Python 3.12): DeepSpeed (built
# here as a pure-Python wheel, no ops) and the packages it needs that such an image lacks.
# Run it where pip reaches PyPI; then carry .whl to the GPU machine with the repository.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
pyver="${GPU_PYTHON_VERSION:-3.12}"
dest="$here/.whl"
mkdir -p "$dest"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
plat=()
for n in 2_28 2_27 2_17 2014 1; do
  case $n in 2014) plat+=(--platform manylinux2014_x86_64) ;; 1) plat+=(--platform manylinux1_x86_64) ;;
    *) plat+=(--platform "manylinux_${n}_x86_64") ;; esac
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${plat[@]}" -d "$dest" hjson "pydantic==${PYDANTIC_VERSION:-2.14.4}" "pydantic-core==${PYDANTIC_CORE_VERSION:-2.50.5}" \
  annotated-types typing-inspection
ls -la "$dest"
du -sh "$dest"
