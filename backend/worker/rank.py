"""A tensor/pipeline-parallel rank other than 0: it loads its shard of the model and of the KV
cache, then runs every step plan rank 0 broadcasts until told to stop.

Started by `backend.worker.distributed.WorkerProcesses` as `python -m backend.worker.rank --rank R`, with the
engine's configuration on stdin. It exits when its starter does, when rank 0 says stop, and when a
collective fails (a peer died): never lingering as an orphan.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

from backend.worker.cpu_policy import reclaim_for_compute


def watch_parent(parent_pid: int) -> None:
    """Exit at once when the process that started this one is gone."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    reclaim_for_compute()  # before torch starts its threads: they inherit this thread's policy
    threading.Thread(target=watch_parent, args=(args.parent_pid,), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")

    import torch  # after the watchdog: importing torch takes seconds

    from backend.config import EngineConfig
    from backend.worker.model_loader import load_hf_config
    from backend.worker.model_runner import ModelRunner

    spec = json.loads(sys.stdin.read())
    config = EngineConfig.from_dict(spec["config"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runner = ModelRunner(config, spec["model_path"], load_hf_config(spec["model_path"]), spec["max_model_len"],
                         rank=args.rank)
    runner.serve_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
