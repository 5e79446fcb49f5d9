#!/usr/bin/env bash
# Sets up a virtual environment and runs the test suite: ./scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LOCALSERVE_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# torch first and pinned: an unpinned torch pulls the CUDA build (gigabytes) on a CPU host.
"$venv/bin/pip" install -q torch==2.13.0
# llama-cpp-python (the GGUF oracle) compiles from source: about 7 minutes on 2 cores.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
"$venv/bin/pip" install -q -e ".[test]"
exec "$venv/bin/python" -m pytest "$@"
