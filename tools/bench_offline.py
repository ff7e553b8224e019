"""Offline throughput against Hugging Face, the short way: `tritonllm bench` with the offline modes.

    python -m tools.bench_offline [--hf-sequential-prompts N] [--hf-batch] [--dtype D] ...
is `tritonllm bench --modes offline[,hf-sequential][,hf-batch] ...` (64 prompts, 128 in / 128 out).
"""

from __future__ import annotations

import argparse

from tools.bench import cli as bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    bench.add_arguments(parser)
    parser.add_argument("--hf-batch", action="store_true", help="also run HF static batch")
    args = parser.parse_args()
    modes = ["offline"] + (["hf-sequential"] if args.hf_sequential_prompts else []) + (["hf-batch"] if args.hf_batch else [])
    args.modes = ",".join(modes)
    return bench.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
