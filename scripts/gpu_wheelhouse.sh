#!/usr/bin/env bash
# Downloads, on any machine with network, the wheels a GPU machine without network needs to
# install localserve (scripts/gpu_wheels.txt), for CPython 3.12 on manylinux x86-64, into
# ./wheelhouse (or $1), and checks the folder stays under 50 MiB.
#   ./scripts/gpu_wheelhouse.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheelhouse}
limit_mib=50
python=${PYTHON:-python3}
mkdir -p "$dir"
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir" -r scripts/gpu_wheels.txt
# A folder kept from an older list may hold other versions too; keep exactly the list's.
"$python" - "$dir" <<'PY'
import re, sys
from pathlib import Path

folder = Path(sys.argv[1])
wanted = {}
for line in Path("scripts/gpu_wheels.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        wanted[re.sub(r"[-_.]+", "_", name).lower()] = version
for wheel in folder.glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    if wanted.get(re.sub(r"[-_.]+", "_", name).lower()) != version:
        print(f"removing {wheel.name}: not in scripts/gpu_wheels.txt")
        wheel.unlink()
missing = set(wanted) - {re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() for w in folder.glob("*.whl")}
if missing:
    sys.exit(f"no wheel for {', '.join(sorted(missing))}")
PY
size_kib=$(du -sk "$dir" | cut -f1)
echo "$(ls "$dir"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB in $dir"
if (( size_kib > limit_mib * 1024 )); then
    echo "the wheel folder is over ${limit_mib} MiB" >&2
    exit 1
fi
