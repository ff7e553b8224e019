"""Tensor and pipeline parallelism: the ranks, their process groups, and the worker processes.

Global rank r is pipeline stage r // tp and tensor rank r % tp. Rank 0 lives in the engine (inside
the Triton model instance or the offline `LLM`) and is the only one that schedules: each step it
broadcasts the step's flat tensors, every rank runs its shard, and rank 0 gets the logits. Rank 0
starts the other ranks of its host as fresh interpreters (`python -m backend.worker`, never a fork);
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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from backend.config import EngineConfig

logger = logging.getLogger(__name__)

# A collective that waits longer than this has lost a peer (NCCL does not notice a dead one itself).
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("TRITONLLM_COLLECTIVE_TIMEOUT_S", "300")))


@dataclass
class ParallelState:
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_group: Any = None  # this stage's tensor-parallel process group

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank with this tensor rank in another stage."""
        return stage * self.tp_size + self.tp_rank

    @property
    def last_stage_leader(self) -> int:
        """The rank that gathers the logits (tensor rank 0 of the last stage)."""
        return (self.pp_size - 1) * self.tp_size


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


def init(config: EngineConfig, rank: int, device: torch.device,
         failure: Callable[[], str | None] = lambda: None) -> ParallelState:
    """Join the process group (every rank calls this with the same config) and make the groups.
    Rank 0 waits for the others to check in, giving up as soon as `failure()` reports a rank that
    died while starting (rather than waiting out the rendezvous timeout)."""
    state = ParallelState(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    if state.world_size == 1:
        return state
    store = dist.TCPStore(config.master_addr, config.master_port, state.world_size, is_master=rank == 0,
                          timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    store.set(f"tritonllm/joined/{rank}", "1")
    if rank == 0:
        joined = [f"tritonllm/joined/{r}" for r in range(state.world_size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(joined):
            if failure() is not None:
                raise RuntimeError(f"while starting: {failure()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only some of the {state.world_size} ranks reached the rendezvous at "
                                   f"{config.master_addr}:{config.master_port} in {COLLECTIVE_TIMEOUT}")
            time.sleep(0.1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=state.world_size, timeout=COLLECTIVE_TIMEOUT)
    for stage in range(state.pp_size):  # every rank creates every group, in the same order
        group = dist.new_group([stage * state.tp_size + i for i in range(state.tp_size)])
        if stage == state.stage:
            state.tp_group = group
    return state


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum over the tensor-parallel ranks (in place): after row-parallel layers."""
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor | None:
    """Concatenate the tensor ranks' shards along the last dim on tensor rank 0 (None elsewhere)."""
    if state.tp_size == 1:
        return x
    leader = state.stage * state.tp_size
    shards = [torch.empty_like(x) for _ in range(state.tp_size)] if state.tp_rank == 0 else None
    dist.gather(x.contiguous(), shards, dst=leader, group=state.tp_group)
    return torch.cat(shards, dim=-1) if shards is not None else None


def broadcast_plan(plan: Any, state: ParallelState) -> Any:
    """Rank 0's step plan (any picklable object; tensors on the CPU) to every rank."""
    box = [plan]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        threads = max(1, (os.cpu_count() or 1) // (config.tensor_parallel_size * config.pipeline_parallel_size
                                                  // config.nnodes))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        self.processes = {rank: subprocess.Popen([python_executable(), "-m", "backend.worker", "--rank", str(rank),
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
