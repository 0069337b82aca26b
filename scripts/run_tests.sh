#!/usr/bin/env bash
# Set up everything (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup_env.sh"
venv="${DISTGRAD_VENV:-$here/.venv}"
export PATH="$venv/bin:$PATH" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
cd "$here"
exec "$venv/bin/python" -m pytest -ra --durations=30 "$@"
