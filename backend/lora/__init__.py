"""Multi-LoRA serving: many peft adapters on one base model, in one batch.

- `LoRARequest(name, int_id, path)` names an adapter for a request (vLLM's offline API).
- `parse_lora_modules` reads the `lora_modules` knob (`name=path` pairs, a dict, vLLM's JSON form).
- `LoRARegistry` maps the names a server knows to LoRARequests (static ones and runtime ones);
  `runtime_lora_updating()` says whether vLLM's RUNTIME_LORA_ENV allows adding them by path.
- `backend/lora/adapter.py` reads and checks a peft adapter folder; `backend/lora/layers.py`
  wraps the model's projections and keeps `max_loras` adapters in slots (an LRU).

This module imports no torch: the config and the servers' edges use it.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

from backend.errors import NOT_FOUND, EngineError, check

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's opt-in, honoured as is


def runtime_lora_updating() -> bool:
    """Whether RUNTIME_LORA_ENV allows loading adapters by path at runtime (the Triton model and the
    OpenAI frontend read it alike)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: `lora_int_id` (> 0) identifies it in the engine (its slot, its
    prefix-cache blocks), `lora_path` is a peft folder (adapter_config.json + adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        check(isinstance(self.lora_name, str) and bool(self.lora_name), "lora_name", "must be a non-empty string",
              self.lora_name)
        check(isinstance(self.lora_int_id, int) and self.lora_int_id > 0, "lora_int_id",
              "must be a positive integer", self.lora_int_id)
        check(isinstance(self.lora_path, str) and bool(self.lora_path), "lora_path", "must name an adapter folder",
              self.lora_path)

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(value: Any) -> dict[str, str]:
    """`lora_modules` as {name: absolute path}. Accepts a dict, a list of `name=path` strings or of
    vLLM's `{"name": ..., "path": ...}` objects, or one string of either (space-separated pairs or JSON)."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("{", "[")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise EngineError("lora_modules", f"not valid JSON ({error})") from None
        else:
            value = text.split()
    if isinstance(value, dict) and set(value) >= {"name", "path"} and isinstance(value.get("name"), str) \
            and len(value) <= 3:
        value = [value]  # one of vLLM's {"name", "path", "base_model_name"} objects
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for entry in value:
            if isinstance(entry, dict):
                check("name" in entry and "path" in entry, "lora_modules",
                      'objects need "name" and "path"', entry)
                items.append((entry["name"], entry["path"]))
            else:
                name, sep, path = str(entry).partition("=")
                check(bool(sep and name and path), "lora_modules", "expected name=path", entry)
                items.append((name, path))
    else:
        raise EngineError("lora_modules", "expected name=path pairs or a {name: path} object", value=value)
    modules = {}
    for name, path in items:
        check(isinstance(name, str) and isinstance(path, str) and bool(name.strip()) and bool(path.strip()),
              "lora_modules", "names and paths must be non-empty strings", (name, path))
        check(name not in modules, "lora_modules", "names must be unique", name)
        modules[name.strip()] = os.path.abspath(os.path.expanduser(path.strip()))
    return modules


class LoRARegistry:
    """The adapters a server serves by name. Ids are handed out once per (name, path), so a name
    re-registered with a new path gets a new id (and never shares KV blocks with the old one)."""

    def __init__(self, modules: dict[str, str] | None = None) -> None:
        self._ids = itertools.count(1)
        self._by_key: dict[tuple[str, str], int] = {}
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in (modules or {}).items():
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        path = os.path.abspath(os.path.expanduser(path))
        key = (name, path)
        if key not in self._by_key:
            self._by_key[key] = next(self._ids)
        self.adapters[name] = LoRARequest(name, self._by_key[key], path)
        return self.adapters[name]

    def remove(self, name: str) -> None:
        check(name in self.adapters, "lora_name", "no adapter of that name is loaded", name, code=NOT_FOUND)
        del self.adapters[name]

    def get(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise EngineError("lora_name", f"unknown LoRA adapter (known: {known})", value=name)
        return self.adapters[name]

    def names(self) -> list[str]:
        return list(self.adapters)


__all__ = ["RUNTIME_LORA_ENV", "LoRARequest", "LoRARegistry", "parse_lora_modules", "runtime_lora_updating"]
