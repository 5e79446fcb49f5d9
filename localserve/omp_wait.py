"""How the CPU's worker threads wait for each other: a short spin, then sleep.

torch and the CPU kernels share one OpenMP runtime per process (libgomp). Left to its
default, a thread that waits at a barrier, or for the next parallel region, spins about
300,000 times before it sleeps. On a quiet machine that hides the wake-up latency; on a
desktop with other work it burns the core another program (or the thread it waits for)
needs: with one core's worth of competing work, one client's decode kept a third of its
quiet speed. A short spin keeps a decode step's back-to-back barriers fast and puts a
waiting thread to sleep soon after (docs/benchmarks.md, "Speed on a busy machine").

libgomp reads the setting once, when it loads (with torch), so it is set when localserve is
imported; a user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
"""

from __future__ import annotations

import os

SPIN_COUNT = 3000
SET_HERE: set[str] = set()  # what share_cores set (the benchmarks start other servers without it)


def share_cores() -> None:
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        SET_HERE.add("GOMP_SPINCOUNT")
