"""The GPU proof kit (scripts/gpu_proof.sh) rehearsed without a GPU: its dry run goes through
every stage a CPU can run (doctor, the GPU tests collected, the kernel and serving harnesses at
tiny shapes), and a stage that finds a failure makes the proof exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_proof.sh"


def proof(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {key: value for key, value in os.environ.items() if key != "OUT"} | {"PYTHON": sys.executable}
    done = subprocess.run([str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True, env=env,
                          timeout=900)
    return done, json.loads((out / "gpu_proof.json").read_text())


def test_the_dry_run_passes_every_stage_a_cpu_can_run(tmp_path: Path) -> None:
    done, result = proof(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    stages = {stage["name"]: stage for stage in result["stages"]}
    assert list(stages) == ["install", "facts", "doctor", "tests", "kernels", "serving"]
    # The wheel folder is checked by pip when it is there (scripts/gpu_wheelhouse.sh); a clone has none.
    assert stages["install"]["status"] in ("pass", "skip")
    assert all(stage["status"] == "pass" for name, stage in stages.items() if name != "install"), stages
    assert not stages["facts"]["result"]["gpu"] or not torch.cuda.is_available()
    assert not result["failed"] and (tmp_path / "gpu_proof.txt").read_text().startswith("localserve GPU proof")
    # doctor's own checks ran on this CPU and passed.
    checks = stages["doctor"]["result"]["checks"]
    assert any(check["name"].startswith("paged attention") and check["status"] == "pass" for check in checks)
    # The GPU-marked tests: the Triton kernels' modules and tests/test_gpu.py.
    tests = stages["tests"]["result"]
    assert tests["collected"] > 200 and "tests/test_gpu.py" in tests["modules"]
    # Every kernel family measured once at tiny shapes, and each serving run answered every request.
    kernels = stages["kernels"]["result"]
    assert {row["stage"] for row in kernels["rows"]} == {"gemv", "gemm", "attention", "moe"}
    assert not kernels["errors"]
    runs = stages["serving"]["result"]["runs"]
    assert [run["run"] for run in runs] == ["dense", "cpu-moe"]
    for run in runs:
        assert not run["failed"] and all(load["completed"] == load["prompts"] for load in run["loads"]), run


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the facts stage passes")
def test_a_failed_stage_fails_the_proof(tmp_path: Path) -> None:
    """Without --dry-run on a machine with no GPU the facts stage fails, and so does the proof."""
    done, result = proof(tmp_path, "--stages", "facts")
    assert done.returncode == 1
    (facts,) = result["stages"]
    assert facts["status"] == "fail" and "sees no GPU" in facts["detail"]
    assert result["failed"]
