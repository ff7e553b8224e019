"""Where a served run's CPU went: every process and thread of the host read from /proc before and
after the run, the difference grouped by process (the engine's stub, tritonserver, the frontend,
the client, ...) with each process's busiest threads, and the context switches per streamed token.
Linux only; elsewhere the figures are absent."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

CHILD_CLIENT = "client (child processes, start-up included)"
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


@dataclass
class ThreadSample:
    process: str  # the process's role (see `role`), with its pid
    thread: str  # the thread's name (comm) and tid
    cpu_s: float
    switches: int  # voluntary + involuntary
    involuntary: int


def role(pid: str) -> str:
    """A readable name for a process from its command line: the server's parts and the clients."""
    try:
        argv = (PROC / pid / "cmdline").read_bytes().split(b"\0")
        comm = (PROC / pid / "comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    line = b" ".join(argv).decode("utf-8", "replace")
    for needle, name in (("triton_python_backend_stub", "python stub"), ("tritonserver", "tritonserver"),
                         ("openai_frontend", "frontend"), ("tools.cli serve", "tritonllm serve"),
                         ("api_server", "vllm serve"),
                         ("tools.bench", "bench (client)"), ("tools.cli bench", "bench (client)")):
        if needle in line:
            return name
    return comm


def _thread_sample(task: Path, process: str) -> tuple[str, ThreadSample] | None:
    try:
        stat = (task / "stat").read_text(encoding="utf-8", errors="replace")
        status = (task / "status").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    switches = {key: int(value) for key, _, value in (line.partition(":\t") for line in status.splitlines())
                if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
    involuntary = switches.get("nonvoluntary_ctxt_switches", 0)
    return f"{process}/{task.name}", ThreadSample(
        process, f"{name} {task.name}", (int(fields[11]) + int(fields[12])) / TICKS,
        switches.get("voluntary_ctxt_switches", 0) + involuntary, involuntary)


def snapshot() -> dict[str, ThreadSample]:
    """Every thread of every process on the host, keyed by pid/tid."""
    samples: dict[str, ThreadSample] = {}
    if not PROC.is_dir():
        return samples
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        name = role(entry.name)
        if not name:
            continue
        try:
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            sample = _thread_sample(task, f"{name} {entry.name}")
            if sample is not None:
                samples[sample[0]] = sample[1]
    return samples


def host_idle_s() -> float | None:
    """The seconds the host's CPUs have spent idle (or waiting on I/O) since boot, summed over CPUs:
    a run's difference is CPU time no process took (none where /proc/stat is absent)."""
    try:
        fields = (PROC / "stat").read_text(encoding="utf-8").split("\n", 1)[0].split()
    except OSError:
        return None
    return (int(fields[4]) + int(fields[5])) / TICKS if fields[0] == "cpu" and len(fields) > 5 else None


def client_times() -> dict[str, tuple[float, int, int]]:
    """This process's and its finished children's CPU-s and context switches: the client of a run
    (this bench's own, or `vllm bench serve`, which has exited by the time the run is read). A child's
    figure is its whole life, start-up included: `vllm bench serve` spends most of its CPU importing
    vLLM before it sends a request (docs/benchmarks.md), so read it as an upper bound on the run's."""
    def figures(usage) -> tuple[float, int, int]:
        return usage.ru_utime + usage.ru_stime, usage.ru_nvcsw + usage.ru_nivcsw, usage.ru_nivcsw

    return {"client (this bench)": figures(resource.getrusage(resource.RUSAGE_SELF)),
            CHILD_CLIENT: figures(resource.getrusage(resource.RUSAGE_CHILDREN))}


def difference(before: dict[str, ThreadSample], after: dict[str, ThreadSample], output_tokens: int,
               min_cpu_s: float = 0.05, clients: tuple[dict, dict] | None = None,
               idle: tuple[float | None, float | None] = (None, None)) -> dict:
    """The run's CPU by process, busiest first, each with its threads over 5% of it (`clients`:
    `client_times()` before and after, always shown; `idle`: `host_idle_s()` before and after, the
    CPU time nobody used). Threads born during the run count from zero; a thread that ended during
    the run is not seen (/proc/<pid>/task no longer lists it)."""
    processes: dict[str, dict] = {}
    for key, end in after.items():
        start = before.get(key)
        cpu = end.cpu_s - (start.cpu_s if start else 0.0)
        switches = end.switches - (start.switches if start else 0)
        involuntary = end.involuntary - (start.involuntary if start else 0)
        entry = processes.setdefault(end.process, {"cpu_s": 0.0, "switches": 0, "involuntary": 0, "threads": {}})
        entry["cpu_s"] += cpu
        entry["switches"] += switches
        entry["involuntary"] += involuntary
        if cpu > 0 or switches > 0:
            entry["threads"][end.thread] = {"cpu_s": cpu, "switches": switches, "involuntary": involuntary}
    for name, (cpu, switches, involuntary) in (clients[1] if clients else {}).items():
        cpu_before, switches_before, involuntary_before = clients[0][name]
        if name == "client (this bench)":  # seen in /proc as well: counted once, as the client
            processes = {key: entry for key, entry in processes.items() if not key.startswith("bench (client)")}
        processes[name] = {"cpu_s": cpu - cpu_before, "switches": switches - switches_before,
                           "involuntary": involuntary - involuntary_before, "threads": {}}
    busy = {name: entry for name, entry in processes.items()
            if entry["cpu_s"] >= min_cpu_s or name.startswith("client (") and entry["cpu_s"] > 0}
    for entry in busy.values():
        threads = sorted(entry["threads"].items(), key=lambda item: -item[1]["cpu_s"])
        entry["threads"] = {name: figures for name, figures in threads
                            if figures["cpu_s"] >= max(min_cpu_s, 0.05 * entry["cpu_s"])}
    ordered = dict(sorted(busy.items(), key=lambda item: -item[1]["cpu_s"]))
    switches = sum(entry["switches"] for entry in processes.values())
    return {"processes": ordered, "cpu_s": sum(entry["cpu_s"] for entry in processes.values()),
            "switches_per_token": switches / output_tokens if output_tokens else None,
            "idle_s": idle[1] - idle[0] if idle[0] is not None and idle[1] is not None else None}


def format_usage(label: str, usage: dict, max_processes: int = 8) -> list[str]:
    """The report's lines for one run: a line per busy process (the busiest few; every one is in
    `--json`), its busiest threads indented."""
    per_token = usage.get("switches_per_token")
    idle = usage.get("idle_s")
    lines = [f"{label}: {usage['cpu_s']:.1f} CPU-s on the host"
             + (f", {idle:.1f} CPU-s idle" if idle is not None else "")
             + (f", {per_token:.1f} context switches per output token" if per_token is not None else "")]
    for name, entry in list(usage["processes"].items())[:max_processes]:
        lines.append(f"    {name:<34}{entry['cpu_s']:>8.2f} CPU-s {entry['switches']:>9} switches "
                     f"({entry['involuntary']} involuntary)")
        for thread, figures in entry["threads"].items():
            lines.append(f"        {thread:<30}{figures['cpu_s']:>8.2f} CPU-s {figures['switches']:>9} switches "
                         f"({figures['involuntary']} involuntary)")
    return lines
