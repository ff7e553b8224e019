"""Tensor and pipeline parallelism: the worker processes (the parallel state the models use is
`backend/worker/parallel_state.py`).

Global rank r is pipeline stage r // tp and tensor rank r % tp. Rank 0 lives in the engine (inside
the Triton model instance or the offline `LLM`) and is the only one that schedules: each step it
broadcasts the step's flat tensors, every rank runs its shard, and rank 0 gets the logits. Rank 0
starts the other ranks of its host as fresh interpreters (`python -m backend.worker.rank`, never a fork);
other hosts start theirs with `tritonllm worker`. All meet at torch.distributed's TCP rendezvous
(master_addr:master_port): NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from backend.config import EngineConfig

logger = logging.getLogger(__name__)


def rendezvous(config: EngineConfig) -> tuple[str, int]:
    """master_addr and master_port: the config's, else $MASTER_ADDR/$MASTER_PORT, else (one host
    only) localhost and a free port."""
    address = config.master_addr or os.environ.get("MASTER_ADDR")
    port = config.master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if config.nnodes > 1 and not (address and port):
        raise ValueError("master_addr and master_port (or $MASTER_ADDR and $MASTER_PORT) are required "
                         "when nnodes > 1: every host must reach rank 0's rendezvous")
    return address or "127.0.0.1", port or free_port()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_executable() -> str:
    """This interpreter, or the first python3 on PATH when embedded (Triton's stub)."""
    name = Path(sys.executable or "").name
    if name.startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError("cannot find a python3 to start tensor-parallel workers")
    return found


class WorkerProcesses:
    """The ranks this host starts: rank 0's engine starts ranks 1..local-1 of host 0; `tritonllm
    worker` starts all of another host's. A watchdog notices a rank that exits and calls on_failure
    once; stop() ends them all (and runs at interpreter exit, so none outlives its starter)."""

    def __init__(self, config: EngineConfig, ranks: list[int], model_path: str, max_model_len: int,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.on_failure = on_failure
        self.failure: str | None = None
        self._stopping = False
        spec = json.dumps({"config": config.to_dict(), "model_path": model_path, "max_model_len": max_model_len})
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        threads = max(1, (os.cpu_count() or 1) // (config.tensor_parallel_size * config.pipeline_parallel_size
                                                  // config.nnodes))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        self.processes = {rank: subprocess.Popen([python_executable(), "-m", "backend.worker.rank", "--rank", str(rank),
                                                  "--parent-pid", str(os.getpid())],
                                                 stdin=subprocess.PIPE, env=env, cwd=root)
                          for rank in ranks}
        for process in self.processes.values():  # the spec goes by stdin: no secrets on command lines
            process.stdin.write(spec.encode())
            process.stdin.close()
        atexit.register(self.stop)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stopping:
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None and not self._stopping:
                    self.failure = f"tensor/pipeline-parallel worker rank {rank} exited with code {code}"
                    logger.error("%s", self.failure)
                    if self.on_failure is not None:
                        self.on_failure(self.failure)
                    return
            time.sleep(0.2)

    def wait(self) -> int:
        """Block until any rank exits; returns its exit code (for `tritonllm worker`)."""
        while True:
            for process in self.processes.values():
                code = process.poll()
                if code is not None:
                    return code
            time.sleep(0.5)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def local_ranks(config: EngineConfig) -> list[int]:
    """The global ranks that run on this host (node_rank), in order."""
    per_node = config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes
    return list(range(config.node_rank * per_node, (config.node_rank + 1) * per_node))
