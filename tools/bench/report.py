"""What a run measured, in figures: per-request records summed into throughput and latency
percentiles, the engine counters around a run, the printed table and the PNG."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from tools.bench.cpu_usage import format_usage


@dataclass
class RequestRecord:
    input_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = (len(ordered) - 1) * q / 100
    low, high = math.floor(index), math.ceil(index)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)


def request_tpot(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (tokens - 1); None for a request of one token or without both timings."""
    if record.ttft is None or record.e2e is None or record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


# `--goodput` keys (vLLM's names) -> a request's latency in seconds, or None where it has none.
GOODPUT_METRICS = {
    "ttft": lambda r: r.ttft,
    "tpot": lambda r: request_tpot(r) or 0.0,  # one token: no decode, which vLLM counts as 0
    "e2el": lambda r: r.e2e,
}


def summarize(records: list[RequestRecord], elapsed: float, objectives: dict[str, float] | None = None) -> dict:
    """Throughput and latency percentiles; with `objectives` ({"ttft": ms, ...}, `--goodput`) also
    goodput: the requests/s that met every objective, as `vllm bench serve --goodput` counts it."""
    ok = [r for r in records if r.error is None]
    tpots = [tpot for tpot in map(request_tpot, ok) if tpot is not None]
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": tpots,
              "itl": [gap for r in ok for gap in r.itls], "e2e": [r.e2e for r in ok if r.e2e is not None]}
    summary = {"requests": len(records), "failed": len(records) - len(ok), "seconds": elapsed,
               "request_throughput": len(ok) / elapsed,
               "input_tokens_per_s": sum(r.input_tokens for r in ok) / elapsed,
               "output_tokens_per_s": sum(r.output_tokens for r in ok) / elapsed}
    for name, values in series.items():
        for q in (50, 90, 99):
            value = percentile(values, q)
            summary[f"{name}_p{q}_ms"] = None if value is None else value * 1000
    if objectives:
        good = [r for r in ok if all((latency := GOODPUT_METRICS[key](r)) is not None and latency * 1000 <= limit
                                     for key, limit in objectives.items())]
        summary["goodput"] = len(good) / elapsed
    return summary


def run_counters(metrics: dict[str, float]) -> dict[str, float]:
    """Preemptions and prefix-cache lookups from vLLM-named metrics: the engine's own (offline) or
    a server's Prometheus page, whose counters carry a `_total` suffix."""
    def counter(name: str) -> float:
        return metrics.get(f"{name}_total", metrics.get(name, 0.0))

    return {"preemptions": counter("vllm:num_preemptions"), "prefix_hits": counter("vllm:prefix_cache_hits"),
            "prefix_queries": counter("vllm:prefix_cache_queries")}


def counters_difference(before: dict | None, after: dict | None) -> dict:
    """A run's preemptions and prefix-cache hit rate, from the counters around it."""
    if before is None or after is None:
        return {"preemptions": None, "prefix_cache_hit_rate": None}
    queries = after["prefix_queries"] - before["prefix_queries"]
    return {"preemptions": after["preemptions"] - before["preemptions"],
            "prefix_cache_hit_rate": (after["prefix_hits"] - before["prefix_hits"]) / queries if queries else None}


def progress(total: int, label: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def labelled(mode: str, figures: dict | list[dict]) -> list[tuple[str, dict]]:
    """A mode's figures with their report labels: a server mode has one per concurrency."""
    return [(mode + (f" c={entry['concurrency']}" if "concurrency" in entry else ""), entry)
            for entry in (figures if isinstance(figures, list) else [figures])]


def print_report(results: dict, references: dict[str, str | None]) -> None:
    """One line per figure; `references` names each label's offline run at the same dtype."""
    print(f"{'mode':<40}{'out tok/s':>10}{'in tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p50':>9}"
          f"{'E2E p99':>10}{'peak KV':>9}{'preempt':>8}{'prefix hit':>11}{'vs offline':>11}{'goodput':>9}")
    for mode, figures in results.items():
        reference = results.get(references.get(mode) or "", {}).get("output_tokens_per_s")
        for label, entry in labelled(mode, figures):
            ratio = entry["output_tokens_per_s"] / reference if reference else None
            print(f"{label:<40}{fmt(entry['output_tokens_per_s']):>10}{fmt(entry.get('input_tokens_per_s'), 0):>10}"
                  f"{fmt(entry.get('request_throughput'), 2):>8}"
                  f"{fmt(entry.get('ttft_p50_ms'), 0):>10}{fmt(entry.get('tpot_p50_ms'), 0):>10}"
                  f"{fmt(entry.get('itl_p50_ms'), 0):>9}{fmt(entry.get('e2e_p99_ms'), 0):>10}"
                  f"{fmt(entry.get('peak_kv_usage'), 2):>9}{fmt(entry.get('preemptions'), 0):>8}"
                  f"{fmt(entry.get('prefix_cache_hit_rate'), 2):>11}"
                  f"{fmt(ratio, 2) + 'x' if ratio else '-':>11}{fmt(entry.get('goodput'), 2):>9}")
    for mode, figures in results.items():
        for label, entry in labelled(mode, figures):
            if entry.get("cpu"):
                print("\n".join(format_usage(label, entry["cpu"])))
            if entry.get("linear_gflops") and entry.get("fma_peak_gflops"):
                print(f"{label}: linears at {entry['linear_gflops']:.1f} GFLOP/s over the run, "
                      f"{entry['linear_gflops'] / entry['fma_peak_gflops']:.0%} of this CPU's measured float32 "
                      f"FMA peak ({entry['fma_peak_gflops']:.1f} GFLOP/s)")


def plot(results: dict, path: str) -> None:
    """Throughput and latency against concurrency when a server mode swept several; otherwise (one
    concurrency, as in the issue's table) bars: output tokens/s of every run, TTFT / TPOT p50 of
    the served ones."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(isinstance(entries, list) and len(entries) > 1 for entries in results.values()):
        _plot_bars(results, plt).savefig(path, dpi=120)
        return
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (mode, entries) in enumerate(results.items()):
        if isinstance(entries, list):
            xs = [e["concurrency"] for e in entries]
            throughput.plot(xs, [e["output_tokens_per_s"] for e in entries], marker="o", label=mode)
            latency.plot(xs, [e["ttft_p50_ms"] for e in entries], marker="o", label=f"{mode} TTFT p50")
            latency.plot(xs, [e["tpot_p50_ms"] for e in entries], marker="x", linestyle="--", label=f"{mode} TPOT p50")
        else:
            throughput.axhline(entries["output_tokens_per_s"], linestyle=":", label=mode, color=f"C{index % 10}")
    throughput.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
    latency.set(xlabel="concurrency", ylabel="ms", xscale="log", yscale="log", title="latency")
    for axes in (throughput, latency):
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _plot_bars(results: dict, plt):
    rows = [row for mode, figures in results.items() for row in labelled(mode, figures)]
    served = [(label, e) for label, e in rows if e.get("ttft_p50_ms") is not None and "concurrency" in e]
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 0.6 + 0.32 * len(rows)),
                                                 gridspec_kw={"width_ratios": [3, 2]})
    labels, values = [label for label, _ in rows][::-1], [e["output_tokens_per_s"] for _, e in rows][::-1]
    bars = throughput.barh(labels, values, color=["C0" if label.startswith(("offline", "openai", "triton"))
                                                  else "C7" for label in labels])
    throughput.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    throughput.set(xlabel="output tokens/s", title="throughput (tritonllm in blue)")
    if served:
        names = [label for label, _ in served][::-1]
        positions = range(len(names))
        ttft = [e["ttft_p50_ms"] / 1000 for _, e in served][::-1]
        tpot = [(e.get("tpot_p50_ms") or 0) / 1000 for _, e in served][::-1]
        latency.barh([p + 0.2 for p in positions], ttft, height=0.4, label="TTFT p50")
        latency.barh([p - 0.2 for p in positions], tpot, height=0.4, label="TPOT p50")
        latency.set_yticks(list(positions), names, fontsize=7)
        latency.set(xlabel="seconds", title="served latency")
        latency.legend(fontsize=7)
    else:
        latency.axis("off")
    throughput.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    return figure
