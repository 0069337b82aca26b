#!/usr/bin/env bash
# Idempotent set-up of everything distgrad, its example job and its tests need, on a fresh
# Debian/Ubuntu machine with Python >= 3.10. Creates ./.venv (override with DISTGRAD_VENV).
#
# torch is installed FIRST and pinned (TORCH_SPEC, default torch==2.13.0): an unpinned torch,
# asked for directly or through deepspeed's requirements, would pull a multi-GB CUDA build.
# On a GPU machine set TORCH_SPEC to the build you want (e.g. "torch==2.13.0" from the CUDA
# index) before running this.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DISTGRAD_VENV:-$here/.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
py="${PYTHON:-python3}"
stamp="$venv/.distgrad-setup-done"

need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin libopenmpi-dev)
if [ "${DISTGRAD_SKIP_MONITORING:-0}" != 1 ]; then
  command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
  command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
  command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "[setup] apt-get install ${need_apt[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv"
  "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  echo "[setup] installing $torch_spec"
  "${pip[@]}" "$torch_spec"
  echo "[setup] installing distgrad and its dependencies (torch stays $torch_spec)"
  # the constraint keeps every other requirement from replacing the pinned torch
  cons="$(mktemp)"; echo "$torch_spec" > "$cons"
  # deepspeed, mpi and fp8 (torchao) are optional extras of distgrad; the example job and the tests
  # need them (torchao==0.18.0 declares no torch requirement: it never replaces the pinned torch)
  DS_BUILD_OPS=0 "${pip[@]}" -c "$cons" -e "$here[test,report,gpu,hf,lightning,deepspeed,mpi,fp8]"
  rm -f "$cons"
  touch "$stamp"
fi
