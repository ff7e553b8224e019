"""The CPU linear kernels against oneDNN's on one model's projection shapes, with the weights coming
from memory as in a decode step (each call takes the next of enough copies to fill ~300 MB), the
two alternating round after round; the median round's GFLOP/s per shape and the time of one
decoder's worth of calls (each projection once per layer, the LM head once).

    python -m tools.bench_linears [--dtype float32] [--rows 8,64,512,2048] [--rounds 9]

Our kernel is whichever `backend.ops.cpu_ops.PackedLinear` picks here (float32: csrc/cpu_linear_f32.cpp
on AVX2 or AVX-512; bfloat16: csrc/cpu_linear.cpp on AVX512-BF16 without AMX); where it picks
oneDNN too, both columns measure oneDNN.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from backend.ops import cpu_ops

# SmolLM2-135M's projections (in, out): qkv, o, gate_up, down, and the LM head; 30 layers.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
LAYERS = 30
SPREAD_BYTES = 300e6


def median_seconds(calls: dict[str, Callable[[int], object]], copies: int, reps: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            start = time.perf_counter()
            for i in range(reps):
                call(i % copies)
            times[label].append((time.perf_counter() - start) / reps)
    return {label: statistics.median(values) for label, values in times.items()}


def bench_shape(rows: int, in_features: int, out_features: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Seconds per call, oneDNN's and ours, the weights spread over enough copies to come from memory."""
    copies = max(1, int(SPREAD_BYTES / (in_features * out_features * dtype.itemsize)))
    linears = [torch.nn.Linear(in_features, out_features, bias=False).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, in_features, dtype=dtype)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows) for linear in linears]
    ours = [cpu_ops.PackedLinear(linear, batch_size_hint=rows) for linear in linears]
    del linears
    calls = {"onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
             "ours": lambda i: ours[i](x)}
    reps = max(copies, int(6e7 / (rows * in_features * out_features)))
    return median_seconds(calls, copies, reps, rounds)


def bench_rows(rows: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    totals = {"onednn": 0.0, "ours": 0.0}
    for name, (in_features, out_features) in SHAPES.items():
        seconds = bench_shape(rows, in_features, out_features, dtype, rounds)
        flop = 2 * rows * in_features * out_features
        for label, value in seconds.items():
            totals[label] += value * (1 if name == "lm_head" else LAYERS)
        print(f"{name:8s} rows {rows:5d}  oneDNN {flop / seconds['onednn'] / 1e9:6.1f} GFLOP/s  "
              f"ours {flop / seconds['ours'] / 1e9:6.1f}  ours/oneDNN {seconds['onednn'] / seconds['ours']:.2f}x",
              flush=True)
    print(f"one step's linears, rows {rows}: oneDNN {totals['onednn'] * 1e3:.1f} ms, ours {totals['ours'] * 1e3:.1f} ms, "
          f"{totals['onednn'] / totals['ours']:.2f}x", flush=True)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="8,64,512,2048", help="rows per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu_ops.onednn_packing(dtype):
        raise SystemExit(f"oneDNN does not pack {args.dtype} linears on this CPU: nothing to compare with")
    print(f"{torch.get_num_threads()} threads; our {args.dtype} kernel in use: {cpu_ops.own_linear_kernel(dtype)}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            bench_rows(rows, dtype, args.rounds)


if __name__ == "__main__":
    main()
