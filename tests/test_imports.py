"""The import graph of `backend/`: no cycle (module-level or inside functions), and the config at
its bottom, importable without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "backend"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def backend_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(BACKEND.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The backend modules a file imports anywhere it runs (top level, functions, branches; not
    `if TYPE_CHECKING:` blocks, which never run). `from package import name` counts as importing
    package.name when that is a module."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and is_type_checking(block.test)
                 for statement in block.body for node in ast.walk(statement)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != this}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "active" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "active"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "active":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_backend_has_no_import_cycle():
    modules = backend_modules()
    graph = {name: imported_modules(path, modules) for name, path in modules.items()}
    assert "backend.config" in graph["backend.engine.spec_decode"]  # the walk sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The torch-free leaves config may read: the error type, vLLM's argument names, the LoRA module list.
CONFIG_LEAVES = {"backend.errors", "backend.vllm_args", "backend.lora"}


def test_config_imports_only_torch_free_leaves_from_backend():
    modules = backend_modules()
    assert imported_modules(modules["backend.config"], modules) <= CONFIG_LEAVES
    for leaf in CONFIG_LEAVES - {"backend.errors"}:
        assert imported_modules(modules[leaf], modules) <= {"backend.errors"}, leaf


def test_config_imports_without_torch():
    code = ("import sys; import backend.config, backend.model_paths, backend.sampling_params; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr
