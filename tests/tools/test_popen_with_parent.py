"""tools.triton_server.popen_with_parent: the children `tritonllm serve` and the tests start
(tritonserver, the frontend) die with the process that started them, and only then, whatever
thread started them. Linux's parent-death signal counts the forking *thread* as the parent: a child
forked on a worker thread used to be killed when that thread ended (the soak test's restarted
replicas died when asyncio.run shut its thread pool down)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil

from tests.utils import ROOT, wait_for
from tools.triton_server import popen_with_parent


def test_a_child_started_on_a_worker_thread_outlives_the_thread():
    started: list[subprocess.Popen] = []
    worker = threading.Thread(target=lambda: started.append(popen_with_parent(["sleep", "60"])))
    worker.start()
    worker.join()
    try:
        time.sleep(0.5)  # the parent-death signal, were it due, comes as the thread exits
        assert started[0].poll() is None, "the child died with the thread that started it"
    finally:
        started[0].kill()
        started[0].wait()


def test_the_child_dies_with_its_process_even_by_kill_9():
    """A process that starts `sleep` from a worker thread (which then ends) and is SIGKILLed: the
    child goes with it."""
    script = ("import threading, time\n"
              "from tools.triton_server import popen_with_parent\n"
              "children = []\n"
              "t = threading.Thread(target=lambda: children.append(popen_with_parent(['sleep', '60'])))\n"
              "t.start(); t.join()\n"
              "print(children[0].pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.kill()
        parent.wait()
        wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10,
                 "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait()
