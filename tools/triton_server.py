"""Run a real `tritonserver` on our model repository: find the binary, lay out the Python backend
with the stub for the running Python, write a runtime copy of the repository with the chosen
engine arguments, start the process and wait until it is ready, stop it cleanly.

Two installations are supported: the NGC image (`/opt/tritonserver`, whose Python backend already
matches the image's Python) and the `nvidia-pytriton` wheel, which carries a tritonserver binary,
the Python backend and one stub per Python version, plus the shared libraries they link against.
"""

from __future__ import annotations

import compileall
import ctypes
import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

NGC_ROOT = Path("/opt/tritonserver")
SOURCE_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
MODEL_NAME = "llm"
BACKEND_NAME = "tritonllm"  # `backend: "tritonllm"` in a config.pbtxt (docs/triton.md)
BACKEND_FILES = ("model.py", "auto_complete.py", "request_parsing.py", "triton_metrics.py")
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"
PR_SET_PDEATHSIG = 1
# Loaded here, not between fork and exec, where another thread may hold the loader's lock.
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@dataclass
class TritonInstall:
    binary: Path
    backend_directory: Path
    library_path: Path | None       # extra LD_LIBRARY_PATH entry


def install_backend(backends: Path, source: Path = SOURCE_REPOSITORY) -> Path:
    """Lay out the `tritonllm` Python-based backend in a Triton backend directory: a folder
    `<backends>/tritonllm/` holding the llm model's code, which Triton's Python backend (in
    `<backends>/python`) loads for every model whose config says `backend: "tritonllm"`."""
    folder = Path(backends) / BACKEND_NAME
    folder.mkdir(parents=True, exist_ok=True)
    for name in BACKEND_FILES:
        shutil.copy2(source / MODEL_NAME / "1" / name, folder / name)
    compileall.compile_dir(folder, quiet=1)  # as for the repository: the stub writes nothing there
    return folder


def find_triton(workdir: Path) -> TritonInstall:
    """The NGC image's tritonserver if present, else the one inside the nvidia-pytriton wheel;
    either way with a backend directory in `workdir/backends` that holds the `tritonllm` backend.

    For the wheel, the Python backend is copied into `workdir/backends/python` together with the
    stub built for the running Python (the wheel keeps one per version). For the image, its
    backends are linked there.
    """
    backends = workdir / "backends"
    if (NGC_ROOT / "bin" / "tritonserver").is_file():
        backends.mkdir(parents=True, exist_ok=True)
        for entry in (NGC_ROOT / "backends").iterdir():
            link = backends / entry.name
            if entry.name != BACKEND_NAME and not link.exists():
                link.symlink_to(entry)
        install_backend(backends)
        return TritonInstall(NGC_ROOT / "bin" / "tritonserver", backends, None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no tritonserver found: not in /opt/tritonserver (the NGC image) and "
                           "the nvidia-pytriton wheel is not installed (pip install nvidia-pytriton)")
    dist = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    python_backend = workdir / "backends" / "python"
    if python_backend.exists():
        shutil.rmtree(python_backend)
    shutil.copytree(dist / "backends" / "python", python_backend,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, python_backend / "triton_python_backend_stub")
    install_backend(workdir / "backends")
    return TritonInstall(dist / "bin" / "tritonserver", workdir / "backends",
                         dist.parent.parent / "nvidia_pytriton.libs")


def write_model_repository(target: Path, engine_args: dict, source: Path = SOURCE_REPOSITORY) -> Path:
    """Copy the model repository to `target` and merge `engine_args` into the LLM's model.json."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    model_json = target / MODEL_NAME / "1" / "model.json"
    values = json.loads(model_json.read_text())
    values.update(engine_args)
    model_json.write_text(json.dumps(values, indent=2) + "\n")
    # The stub imports model.py and its neighbours, and Python would write their bytecode into a
    # new __pycache__ inside the version folder after Triton has recorded its timestamps: the first
    # explicit load then saw a changed model and reloaded the whole LLM (issue 31.1). Compiled now,
    # by this Python (the stub's), the stub finds the bytecode current and writes nothing.
    compileall.compile_dir(target, quiet=1)
    return target


def die_with_parent() -> None:
    """A preexec_fn: the child gets SIGKILL when the thread that started it ends, even by `kill -9`
    of its process (Linux's parent-death signal; children in sessions of their own outlive their
    parent otherwise). Linux counts the *thread* that forked as the parent: start such children with
    `popen_with_parent`, which forks from a thread that lasts as long as the process. Triton's Python
    stubs follow a dead tritonserver by themselves."""
    parent = os.getppid()
    if LIBC is None or LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not Linux: the child may outlive us, as before
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


_launches: queue.Queue = queue.Queue()
_launcher_lock = threading.Lock()
_launcher: threading.Thread | None = None


def _launch_forever() -> None:
    while True:
        args, kwargs, done = _launches.get()
        try:
            done.set_result(subprocess.Popen(*args, **kwargs, preexec_fn=die_with_parent))
        except BaseException as error:  # handed to the caller
            done.set_exception(error)


def popen_with_parent(*args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` whose child dies with this process (`die_with_parent`). From a thread
    other than the main one, the fork happens on a daemon thread that never ends: a child started
    from a worker thread (`asyncio.to_thread`, a thread pool) would otherwise be killed as soon as
    that thread exits, which the soak test met as replicas dying after a restart."""
    global _launcher
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs, preexec_fn=die_with_parent)
    with _launcher_lock:
        if _launcher is None:
            _launcher = threading.Thread(target=_launch_forever, name="tritonllm-launcher", daemon=True)
            _launcher.start()
    done: futures.Future = futures.Future()
    _launches.put((args, kwargs, done))
    return done.result()


def remove_stale_shm_regions(shm: Path = Path("/dev/shm")) -> list[Path]:
    """Delete the Python backend's shared-memory regions that a killed tritonserver left behind:
    ours (same owner) and open or mapped by no live process. Returns what was removed."""
    regions = [p for p in shm.glob(SHM_REGION_PREFIX + "*")
               if p.is_file() and p.stat().st_uid == os.getuid()]
    if not regions:
        return []
    in_use = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            in_use.update(line.split(maxsplit=5)[5].strip() for line in
                          (proc / "maps").read_text().splitlines() if SHM_REGION_PREFIX in line)
            in_use.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
        except (OSError, IndexError):
            continue  # gone, or not ours to read (then its regions are not ours either)
    removed = []
    for region in regions:
        if str(region) not in in_use and f"{region} (deleted)" not in in_use:
            try:
                region.unlink()
                removed.append(region)
            except OSError:
                pass
    return removed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_environment(install: TritonInstall) -> dict[str, str]:
    """The environment the server and its Python stubs need.

    The stub embeds the Python it was built for and takes its prefix (so its site-packages) from
    the first `python3` on PATH, so the running interpreter's folder goes first. The stub starts
    Python isolated (PYTHONPATH is ignored): `backend` must be installed there (`pip install -e .`).
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if install.library_path is None:  # the NGC image: its stub matches its Python already
        return env
    library_path = [env.get("LD_LIBRARY_PATH", "")]
    # The wheel's stub links libpython3.X.so.1.0; it must be this Python's, not another 3.X the
    # system has (a different patch release fails on this Python's extension modules).
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        library_path.append(libdir)
    library_path.append(str(install.library_path))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in library_path if p)
    return env


class TritonServer:
    """One tritonserver process on a model repository; a context manager that stops it on exit."""

    def __init__(self, model_repository: Path, workdir: Path, *, http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, host: str = "127.0.0.1",
                 extra_args: list[str] = (), log_file: Path | None = None) -> None:
        self.model_repository = Path(model_repository)
        self.workdir = Path(workdir)
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.extra_args = list(extra_args)
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall) -> list[str]:
        command = [str(install.binary), f"--model-repository={self.model_repository}",
                   f"--http-address={self.host}", f"--http-port={self.http_port}",
                   f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                   f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}"]
        command.append(f"--backend-directory={install.backend_directory}")
        return command + self.extra_args

    def start(self) -> "TritonServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        install = find_triton(self.workdir)
        output = open(self.log_file, "ab") if self.log_file else None
        for region in remove_stale_shm_regions():
            print(f"removed {region}, left by a tritonserver that was killed", file=sys.stderr)
        # A session of its own, so a Ctrl-C in the terminal reaches us, and we decide how Triton
        # stops (SIGINT: finish in-flight requests, unload models, exit); killed if we die.
        self.process = popen_with_parent(self.command(install), env=server_environment(install),
                                         stdout=output, stderr=subprocess.STDOUT if output else None,
                                         start_new_session=True)
        if output:
            output.close()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until /v2/health/ready answers 200 and the metrics port answers too (it can open
        a moment after the HTTP one); raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        self._wait_for(f"http://{self.http_url}/v2/health/ready", deadline, timeout)
        if "--allow-metrics=false" not in self.extra_args:
            self._wait_for(self.metrics_url, deadline, timeout)

    def _wait_for(self, url: str, deadline: float, timeout: float) -> None:
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited before it was ready{self._log_hint()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        if not self.log_file or not Path(self.log_file).exists():
            return ""
        tail = Path(self.log_file).read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
        return "; log tail:\n" + "\n".join(tail)

    def stub_pids(self, model: str = MODEL_NAME) -> list[int]:
        """The live Python-backend stubs serving `model` (children of this tritonserver)."""
        if self.process is None:
            return []
        marker = f"/{model}/"
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit():
                    continue
                stat = (proc / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ...
                if int(fields[1]) != self.process.pid or fields[0] == "Z":
                    continue
                command = (proc / "cmdline").read_bytes().split(b"\0")
                if b"triton_python_backend_stub" in command[0] and marker.encode() in command[1]:
                    pids.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                continue
        return pids

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGINT (graceful), then SIGKILL after `timeout`; return the server's exit code.

        Python stubs that outlive the server (one stuck in a model's finalize, say) share its
        process group and are killed with it.
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.triton_server install-backend DIR`: put the `tritonllm` backend into your
    own Triton's backend directory (e.g. /opt/tritonserver/backends)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.triton_server", description=main.__doc__)
    parser.add_argument("command", choices=("install-backend",))
    parser.add_argument("backends", type=Path, help="Triton's backend directory")
    args = parser.parse_args(argv)
    print(f"installed {install_backend(args.backends)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
