"""`localserve doctor` on this CPU-only host, and its GPU code on what can run here: the
microbenchmarks' code on CPU tensors, the peak bandwidth of a faked card."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from localserve.doctor.bench import _decode_attention, _gemm, _gemv
from localserve.doctor.host import peak_bandwidth
from localserve.doctor.report import Report

from .fake_cuda import A100_80GB, RTX_4090, Card, fake_gpu


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localserve.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=300)


def test_doctor_on_a_cpu_host_reports_and_passes() -> None:
    result = doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "no GPU found" in out
    assert "cpu isa" in out and "cpu kernels" in out
    for check in ("paged attention (CPU kernel)", "4-bit linear, groups of 128", "fused MoE", "demo model on cpu"):
        assert f"PASS  {check}" in out, out
    assert "FAIL" not in out


def test_doctor_json_is_a_bug_report() -> None:
    result = doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failed"] is False
    assert report["facts"]["torch"].startswith(torch.__version__)
    errors = [c["figures"]["relative_error"] for c in report["checks"] if "relative_error" in c["figures"]]
    assert len(errors) == 4 and max(errors) < 1e-4
    demo = next(c for c in report["checks"] if c["name"] == "demo model on cpu")
    speed = demo["figures"]
    assert 0 < speed["tokens_per_second_min"] <= speed["tokens_per_second"] <= speed["tokens_per_second_max"]
    assert speed["other_programs_cores"] >= 0 and "median of 5" in demo["detail"]


def test_a_busy_host_is_said() -> None:
    """Another program spinning on a core while the figure is taken is counted and named."""
    from localserve.doctor.checks import Speed, others_busy_cores

    spinner = subprocess.Popen([sys.executable, "-c", "import time\nprint(flush=True)\nend = time.time() + 3\n"
                                "while time.time() < end: pass"], stdout=subprocess.PIPE, text=True)
    try:
        spinner.stdout.readline()  # it runs
        others = others_busy_cores(lambda: time.sleep(1.0))
    finally:
        spinner.kill()
        spinner.wait(timeout=10)
    assert others >= 0.7, others
    line = Speed([90.0, 100.0, 110.0], others).describe()
    assert line.startswith("100 tokens/s (median of 3, 90-110); the host was busy: other programs used")
    assert "busy" not in Speed([100.0], 0.1).describe()


def test_benchmark_code_runs_on_cpu_tensors() -> None:
    """The microbenchmarks' code, timed by one call each, so the first GPU run does not
    find a bug in it: the GEMV is an information line where no peak is known."""
    report = Report()
    cpu = torch.device("cpu")

    def once(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        return 1e-3

    _gemv(report, cpu, once)
    _gemm(report, cpu, once)
    _decode_attention(report, cpu, once)
    names = [check.name for check in report.checks]
    assert names == ["4-bit GEMV, batch 1", "4-bit GEMM vs fp16 matmul, 1 rows", "4-bit GEMM vs fp16 matmul, 16 rows",
                     "4-bit GEMM vs fp16 matmul, 64 rows", "paged decode attention vs SDPA"]
    gemv = report.checks[0]
    assert gemv.status == "info"
    # 4096 x 14336 codes at 4 bits, an fp16 scale and a uint8 zero per 128: 30.2 MB in 1 ms.
    assert gemv.figures["bandwidth_bytes_per_second"] == pytest.approx(4096 * 14336 * (0.5 + 3 / 128) / 1e-3,
                                                                        rel=0.01)
    assert report.checks[-1].status == "pass"  # equal times: a ratio of 1


@pytest.mark.parametrize("card,gbps", [(A100_80GB, 2039), (RTX_4090, 1008)], ids=["a100", "4090"])
def test_peak_bandwidth_of_a_known_card(card: Card, gbps: int) -> None:
    with fake_gpu(card):
        assert peak_bandwidth(0) == gbps * 1e9
