"""`tritonllm worker`: the tensor/pipeline-parallel ranks of one more host (multi-node).

Host 0 runs the engine (`tritonllm serve` or `LLM(...)`) with `--nnodes N --node-rank 0`; every
other host runs `tritonllm worker` with the same model and parallel sizes, its own `--node-rank`,
and rank 0's `--master-addr`/`--master-port` (or $MASTER_ADDR/$MASTER_PORT). It starts this host's
ranks and exits when any of them does (rank 0 stopping ends them all).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from backend.config import EngineConfig


def run_worker(config: EngineConfig) -> int:
    from backend.worker import distributed
    from backend.config import resolve_limits
    from backend.worker.model_loader import load_hf_config, resolve_device
    from backend.model_paths import resolve_model_path

    if config.node_rank == 0:
        print("tritonllm worker: node 0 runs the engine (tritonllm serve); give --node-rank >= 1", file=sys.stderr)
        return 2
    address, port = distributed.rendezvous(config)
    config = EngineConfig.from_dict({**config.to_dict(), "master_addr": address, "master_port": port})
    model_path = str(Path(resolve_model_path(config.model, config.revision)).resolve())
    max_model_len = resolve_limits(config, load_hf_config(model_path), resolve_device(config).type).max_model_len
    workers = distributed.WorkerProcesses(config, distributed.local_ranks(config), model_path, max_model_len)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"tritonllm worker: ranks {distributed.local_ranks(config)} of "
          f"{config.tensor_parallel_size * config.pipeline_parallel_size}, rendezvous {address}:{port}", flush=True)
    try:
        return workers.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        workers.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
