#!/usr/bin/env bash
# Sets up a virtual environment and runs the test suite: ./scripts/test.sh [pytest args]
# The install runs when what it depends on changed since the last one (a stamp in the venv):
# pyproject.toml, setup.py, the CPU kernels' sources. LOCALSERVE_REINSTALL=1 forces it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LOCALSERVE_VENV:-.venv}
stamp="$venv/.localserve-install"
[ -x "$venv/bin/python" ] || { echo "test.sh: creating $venv"; python3 -m venv "$venv"; }
inputs=$(cat pyproject.toml setup.py kernels/csrc/* | sha256sum | cut -d' ' -f1)
if [ "${LOCALSERVE_REINSTALL:-0}" != 0 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$inputs" ]; then
    # torch first and pinned: an unpinned torch pulls the CUDA build (gigabytes) on a CPU host.
    echo "test.sh: installing torch 2.13.0"
    "$venv/bin/pip" install -q torch==2.13.0
    # llama-cpp-python (the GGUF oracle) compiles from source: about 7 minutes on 2 cores.
    echo "test.sh: installing localserve[test] (compiles the CPU kernels; llama-cpp-python the first time, ~7 min)"
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
    "$venv/bin/pip" install -q -e ".[test]"
    echo "$inputs" > "$stamp"
else
    echo "test.sh: $venv is up to date (pyproject.toml, setup.py, kernels/csrc unchanged; LOCALSERVE_REINSTALL=1 reinstalls)"
fi
echo "test.sh: running the tests"
exec "$venv/bin/python" -m pytest "$@"
