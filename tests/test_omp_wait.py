"""localserve sets OpenMP's wait policy (a short spin, then sleep) when it is imported,
before torch loads the runtime, and leaves a user's own setting alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localserve.omp_wait import SPIN_COUNT

PROBE = ("import os, sys; import localserve; "
         "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")


def probe(**env: str) -> str:
    clean = {key: value for key, value in os.environ.items() if key not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


def test_importing_localserve_sets_a_short_spin_before_torch_loads() -> None:
    assert probe() == f"{SPIN_COUNT} False"


@pytest.mark.parametrize(("env", "expected"), [
    ({"GOMP_SPINCOUNT": "77"}, "77 False"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "None False"),
])
def test_a_users_own_setting_is_kept(env: dict[str, str], expected: str) -> None:
    assert probe(**env) == expected
