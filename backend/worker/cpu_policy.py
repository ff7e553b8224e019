"""Who gets a core first on a small host: the engine's compute threads, over everything that serves.

On a CPU the engine's step runs on every core in lockstep (OpenMP teams that meet at barriers), and
a served step's outputs wake the serving path (the model's sender, Triton, the frontend) while the
next step runs. A task that wakes preempts a running one at once, so each of those many small
wake-ups stops one compute thread while the others wait for it at the next barrier. `tritonllm
serve` therefore starts Triton and the frontend as SCHED_BATCH (Linux: they still get their fair
share of CPU time, but a wake-up of theirs waits for the running slice instead of preempting it)
and says so in SERVING_POLICY_ENV; the engine's stepping thread, before it starts its OpenMP team,
returns itself to the normal policy, which its team's threads then inherit. What it is worth is
measured in docs/benchmarks.md (#37).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

SERVING_POLICY_ENV = "TRITONLLM_SERVING_SCHED"  # "batch" under `tritonllm serve` (tools/serve.py)


def yield_to_compute() -> bool:
    """Make the calling thread, and what it starts, SCHED_BATCH; False where the OS has no such policy."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as error:
        logger.warning("could not run the serving processes as SCHED_BATCH: %s", error)
        return False
    os.environ[SERVING_POLICY_ENV] = "batch"
    return True


def reclaim_for_compute() -> None:
    """On the thread that will run the engine's steps, before its first parallel region: back to the
    normal policy if the serving processes were started as SCHED_BATCH (a no-op otherwise, so a
    policy the operator chose for the whole server stays as it is)."""
    if os.environ.get(SERVING_POLICY_ENV) != "batch" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError as error:
        logger.warning("the engine's thread stays SCHED_BATCH: %s", error)
