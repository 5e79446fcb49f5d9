"""scripts/test.sh (what CI and the README run) installs only when what the install depends
on changed: run against a venv whose pip and python are recorders, nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fake_venv(root: Path) -> tuple[Path, Path]:
    venv, calls = root / "venv", root / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    for tool in ("pip", "python"):
        script = venv / "bin" / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\n')
        script.chmod(0o755)
    return venv, calls


def run(venv: Path, **env: str) -> str:
    done = subprocess.run([str(ROOT / "scripts" / "test.sh"), "-k", "nothing"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "LOCALSERVE_VENV": str(venv), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_installs_once_then_only_when_asked(tmp_path: Path) -> None:
    venv, calls = fake_venv(tmp_path)
    first = run(venv)
    assert "installing localserve[test]" in first
    assert calls.read_text().splitlines() == ["pip install -q torch==2.13.0", "pip install -q -e .[test]",
                                              "python -m pytest -k nothing"]
    calls.unlink()
    second = run(venv)
    assert "up to date" in second
    assert calls.read_text().splitlines() == ["python -m pytest -k nothing"]  # no pip
    calls.unlink()
    run(venv, LOCALSERVE_REINSTALL="1")
    assert calls.read_text().count("pip install") == 2
    # A stamp from other sources (an edited setup.py, kernel or pyproject) reinstalls.
    (venv / ".localserve-install").write_text("another tree\n")
    calls.unlink()
    run(venv)
    assert calls.read_text().count("pip install") == 2
