#!/usr/bin/env bash
# The GPU proof (scripts/gpu_proof.py): run from the repository root on a machine with an
# NVIDIA GPU, after scripts/gpu_wheelhouse.sh filled ./wheelhouse on a machine with network.
#   ./scripts/gpu_proof.sh [--out DIR] [--dry-run] [--skip-install] [--stages ...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_proof.py "$@"
