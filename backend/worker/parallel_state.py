"""The parallel state the models use: which rank this process is, its tensor-parallel group, and the
collectives the layers and the runner call (all_reduce, gather_last_dim, broadcast_plan).

Global rank r is pipeline stage r // tp and tensor rank r % tp. `init` joins torch.distributed's TCP
rendezvous (master_addr:master_port; NCCL on CUDA, gloo on the CPU); starting the processes that
join it is `backend/worker/distributed.py`'s job.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from backend.config import EngineConfig

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
