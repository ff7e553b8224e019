"""`tritonllm serve` runs the serving path as SCHED_BATCH and the engine's compute threads at the
normal policy (backend/worker/cpu_policy.py)."""

from __future__ import annotations

import os
import threading

import pytest

from backend.worker import cpu_policy

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux CPU policies")


def on_a_thread(function):
    """Run `function` on a thread of its own (a policy is per thread: the test's stays untouched)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", function()))
    thread.start()
    thread.join()
    return result["value"]


def test_the_engine_thread_and_the_threads_it_starts_take_back_the_normal_policy(monkeypatch):
    monkeypatch.delenv(cpu_policy.SERVING_POLICY_ENV, raising=False)

    def serving_then_engine():
        assert cpu_policy.yield_to_compute()
        serving = os.sched_getscheduler(0)
        engine = on_a_thread(lambda: (cpu_policy.reclaim_for_compute(), os.sched_getscheduler(0),
                                      on_a_thread(lambda: os.sched_getscheduler(0)))[1:])
        return serving, engine

    serving, (engine, engine_child) = on_a_thread(serving_then_engine)
    assert os.environ[cpu_policy.SERVING_POLICY_ENV] == "batch"
    assert serving == os.SCHED_BATCH
    assert engine == engine_child == os.SCHED_OTHER


def test_a_policy_chosen_without_tritonllm_serve_is_left_alone(monkeypatch):
    monkeypatch.delenv(cpu_policy.SERVING_POLICY_ENV, raising=False)

    def batch_then_reclaim():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        cpu_policy.reclaim_for_compute()
        return os.sched_getscheduler(0)

    assert on_a_thread(batch_then_reclaim) == os.SCHED_BATCH
