"""The GPU proof: one command that installs localserve offline, then proves its CUDA path on
this machine's GPU and measures it, each stage under its own time limit.

    scripts/gpu_proof.sh [--out DIR] [--dry-run] [--skip-install] [--stages ...]

Stages (docs/gpu.md says what each figure means):

1. install   the wheels in ./wheelhouse (scripts/gpu_wheelhouse.sh), then this checkout,
             with no network (pip --no-index); the build compiles the CPU kernels.
2. facts     torch, Triton, CUDA, the driver, the GPU's name, SMs and memory.
3. doctor    ``localserve doctor --json --no-bench``: every kernel against its torch
             reference on the device, the demo model's tokens against the CPU's.
4. tests     the GPU-marked tests (``pytest -m gpu``): the Triton kernels against their
             references (paged attention with fp16/int8/fp8 caches, quantized GEMM for
             GPTQ, AWQ and each GGUF type family, fused MoE), sampling, CUDA-graph capture
             and replay of decode steps.
5. kernels   benchmarks/gpu_kernels.py: each kernel at 8B / 30B-A3B shapes as a share of
             the limit it is bound by, beside torch's baseline.
6. serving   benchmarks/gpu_serving.py: an 8B-shaped model served and benchmarked at 1-256
             clients, with a small KV pool (offload), and an MoE shape with --cpu-moe.

Writes ``gpu_proof.json`` and ``gpu_proof.txt`` into ``--out`` (default ``$OUT``, else
./gpu-proof), each stage's log beside them, and exits 1 when a correctness check failed
(install, doctor, a test, a kernel that crashed, a failed request). Speed targets are
recorded, never a reason to fail. ``--dry-run`` runs every step a machine without a GPU can:
the wheel folder checked by pip without installing, doctor on the CPU, the GPU tests collected,
the kernel and serving harnesses at tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BUDGET_S = 470.0  # all stages together: under 8 minutes, whatever each stage's own limit
TAIL = 3000  # characters of a stage's output kept in the JSON


@dataclass
class Stage:
    name: str
    limit_s: float
    status: str = "not run"  # pass, fail, skip, timeout
    seconds: float = 0.0
    commands: list[list[str]] = field(default_factory=list)
    detail: str = ""
    result: object = None
    tail: str = ""


@dataclass
class Proof:
    out: Path
    dry_run: bool
    deadline: float
    serving_runs: list[str] = field(default_factory=list)  # empty: every run
    stages: list[Stage] = field(default_factory=list)

    def run(self, stage: Stage, command: list[str], timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
        """``command`` under the stage's limit (and the whole proof's), its output in the stage's log."""
        limit = min(timeout_s or stage.limit_s, max(self.deadline - time.monotonic(), 1.0))
        stage.commands.append(command)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.out / f"{stage.name}.log", "a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            try:
                done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=limit, env=env)
            except subprocess.TimeoutExpired as exc:
                text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
                log.write(text)
                stage.tail = text[-TAIL:]
                raise StageTimeout(f"over its limit of {limit:.0f} s") from None
            log.write(done.stdout)
        stage.tail = done.stdout[-TAIL:]
        return done


class StageTimeout(Exception):
    pass


class StageFailed(Exception):
    pass


class Skip(Exception):
    pass


# -- stages ------------------------------------------------------------------------------------

def install(proof: Proof, stage: Stage) -> None:
    wheels = sorted((ROOT / "wheelhouse").glob("*.whl"))
    pip = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    if proof.dry_run:
        if not wheels:
            raise Skip("no ./wheelhouse (scripts/gpu_wheelhouse.sh makes it); the project is installed already")
        # As the GPU machine's Python (3.12, manylinux x86-64) would take them, whatever runs this.
        platforms = [arg for tag in ("manylinux_2_31", "manylinux_2_28", "manylinux_2_17", "manylinux2014")
                     for arg in ("--platform", f"{tag}_x86_64")]
        done = proof.run(stage, [*pip, "--dry-run", "--target", str(proof.out / "wheel-target"), "--python-version",
                                 "3.12", "--implementation", "cp", "--only-binary=:all:", *platforms,
                                 *map(str, wheels)])
        if done.returncode:
            raise StageFailed(f"pip cannot install the wheel folder: {done.stdout.strip()[-400:]}")
        stage.detail = f"{len(wheels)} wheels would install offline (dry run: nothing installed)"
        return
    if wheels:
        done = proof.run(stage, [*pip, *map(str, wheels)])
        if done.returncode:
            raise StageFailed(f"installing the wheels failed: {done.stdout.strip()[-400:]}")
    done = proof.run(stage, [*pip, "--no-build-isolation", "-e", "."])
    if done.returncode:
        raise StageFailed(f"installing localserve failed: {done.stdout.strip()[-600:]}")
    check = proof.run(stage, [PYTHON, "-c", "import localserve.server.app, localserve.cli.main"])
    if check.returncode:
        raise StageFailed(f"localserve does not import: {check.stdout.strip()[-400:]}")
    stage.detail = f"{len(wheels)} wheels and localserve installed offline"


FACTS = r"""
import json, subprocess, torch
facts = {"python": __import__("sys").version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
         "gpu": torch.cuda.is_available()}
try:
    import triton
    facts["triton"] = triton.__version__
except ImportError:
    facts["triton"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    facts.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                 memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                 l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["driver"] = None
print(json.dumps(facts))
"""


def facts(proof: Proof, stage: Stage) -> None:
    done = proof.run(stage, [PYTHON, "-c", FACTS])
    if done.returncode:
        raise StageFailed(f"torch does not start: {done.stdout.strip()[-400:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["host"] = f"{platform.node()}, {os.cpu_count()} CPUs"
    stage.result = found
    if found["gpu"]:
        stage.detail = (f"{found['name']} (compute {found['capability']}, {found['sms']} SMs, {found['memory_gib']} GiB), "
                        f"driver {found['driver']}, torch {found['torch']} (CUDA {found['cuda']}), "
                        f"Triton {found['triton']}")
    elif proof.dry_run:
        stage.detail = f"no GPU (dry run); torch {found['torch']}, Triton {found['triton']}"
    else:
        raise StageFailed(f"torch {found['torch']} sees no GPU: is this a CUDA build and a GPU machine?")


def doctor(proof: Proof, stage: Stage) -> None:
    done = proof.run(stage, [PYTHON, "-m", "localserve.cli", "doctor", "--json", "--no-bench"])
    try:
        report = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        raise StageFailed(f"doctor printed no report (exit {done.returncode}): {done.stdout.strip()[-400:]}") from None
    stage.result = report
    (proof.out / "doctor.json").write_text(json.dumps(report, indent=1))
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    passed = sum(c["status"] == "pass" for c in report["checks"])
    stage.detail = f"{passed} checks passed" + "".join(f"; FAIL {c['name']}: {c['detail']}" for c in failed)
    if failed:
        raise StageFailed(stage.detail)


def tests(proof: Proof, stage: Stage) -> None:
    xml = proof.out / "tests.xml"
    # Only the modules that carry the marker: collecting the others imports what a GPU machine
    # need not have (the API tests' official clients, llama-cpp-python).
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                    if "pytest.mark.gpu" in path.read_text())
    command = [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *marked]
    if proof.dry_run:
        done = proof.run(stage, [*command, "--collect-only"])
        if done.returncode:
            raise StageFailed(f"the GPU tests do not collect: {done.stdout.strip()[-600:]}")
        line = next((line for line in reversed(done.stdout.splitlines()) if "collected" in line), "")
        stage.result = {"collected": int(line.split()[0].split("/")[0]) if line[:1].isdigit() else 0,
                        "modules": marked}
        stage.detail = f"{stage.result['collected']} GPU tests in {len(marked)} modules collected (dry run)"
        return
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if _has_module("xdist") else []
    per_test = ["--timeout=120"] if _has_module("pytest_timeout") else []
    done = proof.run(stage, [*command, *workers, *per_test, f"--junitxml={xml}"])
    counts = _junit_counts(xml) if xml.exists() else {}
    stage.result = counts
    summary = next((line for line in reversed(done.stdout.splitlines()) if " in " in line and "=" in line),
                   done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")
    stage.detail = summary.strip("= ") + "".join(f"; FAIL {name}" for name in counts.get("failed", [])[:20])
    if done.returncode:
        raise StageFailed(stage.detail)


def kernels(proof: Proof, stage: Stage) -> None:
    target = proof.out / "kernels.json"
    done = proof.run(stage, [PYTHON, "benchmarks/gpu_kernels.py", "--json", str(target),
                             *(["--dry-run"] if proof.dry_run else [])])
    if not target.exists():
        raise StageFailed(f"no figures (exit {done.returncode}): {done.stdout.strip()[-600:]}")
    result = json.loads(target.read_text())
    result["lines"] = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "INFO", "limits"))]
    stage.result = result
    misses = [row["name"] for row in result["rows"] if row["status"] == "fail"]
    stage.detail = (f"{len(result['rows'])} figures" + (f"; targets missed: {', '.join(misses)}" if misses else "")
                    + "".join(f"; FAIL {name}: {error}" for name, error in result["errors"].items()))
    if result["errors"]:  # a kernel that crashed is a correctness failure; a missed target is not
        raise StageFailed(stage.detail)


def serving(proof: Proof, stage: Stage) -> None:
    target = proof.out / "serving.json"
    left = max(proof.deadline - time.monotonic() - 15, 30)
    done = proof.run(stage, [PYTHON, "benchmarks/gpu_serving.py", "--json", str(target), "--time-limit",
                             f"{min(left, stage.limit_s - 15):.0f}", *(["--dry-run"] if proof.dry_run else []),
                             *(["--runs", *proof.serving_runs] if proof.serving_runs else [])])
    if not target.exists():
        raise StageFailed(f"no figures (exit {done.returncode}): {done.stdout.strip()[-600:]}")
    result = json.loads(target.read_text())
    stage.result = result
    parts = []
    for run in result["runs"]:
        loads = ", ".join(f"{entry['clients']}: {entry.get('output_throughput', 0):.0f} tok/s" for entry in
                          run.get("loads", []))
        parts.append(f"{run['run']}: " + (run.get("error") or run.get("skipped") or loads))
    stage.detail = "; ".join(parts)
    if done.returncode:
        raise StageFailed(stage.detail)


STAGES: dict[str, tuple[Callable[[Proof, Stage], None], float]] = {
    "install": (install, 240), "facts": (facts, 60), "doctor": (doctor, 180), "tests": (tests, 240),
    "kernels": (kernels, 180), "serving": (serving, 330),
}


# -- helpers -----------------------------------------------------------------------------------

def _has_module(name: str) -> bool:
    done = subprocess.run([PYTHON, "-c", f"import {name}"], capture_output=True, timeout=60)
    return done.returncode == 0


def _junit_counts(xml: Path) -> dict[str, object]:
    root = ElementTree.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts: dict[str, object] = {key: sum(int(s.get(key, 0)) for s in suites)
                                 for key in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{case.get('classname')}::{case.get('name')}" for suite in suites for case in suite
                        if case.find("failure") is not None or case.find("error") is not None]
    return counts


def summary(proof: Proof, elapsed: float) -> list[str]:
    lines = [f"localserve GPU proof{' (dry run)' if proof.dry_run else ''}, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{elapsed:.0f} s"]
    for stage in proof.stages:
        lines.append(f"{stage.status.upper():<7} {stage.name:<8} {stage.seconds:5.0f} s  {stage.detail}")
    for stage in proof.stages:
        if stage.name == "kernels" and isinstance(stage.result, dict):
            lines += ["", f"kernels on {stage.result['device']}", *stage.result["lines"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-proof"))
    parser.add_argument("--dry-run", action="store_true", help="every step a machine without a GPU can run")
    parser.add_argument("--skip-install", action="store_true", help="localserve is installed already")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every stage together")
    parser.add_argument("--serving-runs", nargs="+", default=[], choices=["dense", "offload", "cpu-moe"],
                        help="only these serving runs (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proof = Proof(args.out, args.dry_run, start + args.budget, args.serving_runs)
    for name in args.stages:
        step, limit = STAGES[name]
        stage = Stage(name, limit)
        proof.stages.append(stage)
        if name == "install" and args.skip_install:
            stage.status, stage.detail = "skip", "--skip-install"
            continue
        began = time.monotonic()
        if began > proof.deadline - 5:
            stage.status, stage.detail = "timeout", "the proof's time budget ran out before this stage"
            continue
        try:
            step(proof, stage)
            stage.status = "pass"
        except Skip as exc:
            stage.status, stage.detail = "skip", str(exc)
        except StageTimeout as exc:
            stage.status, stage.detail = "timeout", str(exc)
        except StageFailed as exc:
            stage.status, stage.detail = "fail", str(exc)
        except Exception as exc:  # the proof itself broke: recorded, and the next stage runs
            stage.status, stage.detail = "fail", f"{type(exc).__name__}: {exc}"
        stage.seconds = time.monotonic() - began
        print(f"{stage.status.upper():<7} {stage.name:<8} {stage.seconds:5.0f} s  {stage.detail}", flush=True)
        _write(proof, time.monotonic() - start)  # what ran so far survives a kill
        if name == "install" and stage.status == "fail":
            break  # nothing else can run
    lines = _write(proof, time.monotonic() - start)
    print("\n" + "\n".join(lines))
    sys.exit(1 if any(stage.status in ("fail", "timeout") for stage in proof.stages) else 0)


def _write(proof: Proof, elapsed: float) -> list[str]:
    lines = summary(proof, elapsed)
    (proof.out / "gpu_proof.json").write_text(json.dumps(
        {"dry_run": proof.dry_run, "seconds": elapsed, "stages": [asdict(stage) for stage in proof.stages],
         "failed": any(stage.status in ("fail", "timeout") for stage in proof.stages)}, indent=1, default=str))
    (proof.out / "gpu_proof.txt").write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
