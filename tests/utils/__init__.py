"""What the tests share, so that no test module imports another: `wait_for` here, tiny random
models and their Hugging Face references (`models`), a tiny LLaVA and images for it (`vision`),
servers and their clients (`triton` for tritonserver, `serve` for `tritonllm serve` and the OpenAI
frontend), the kernels' test inputs (`kernels`). Fixtures are in tests/conftest.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: where tests run commands and find tests/data


def wait_for(condition: Callable[[], object], timeout: float = 30.0, message: str = "condition") -> float:
    """Polls `condition()` until it holds; the seconds that took. Fails the test at `timeout`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out waiting for {message}"
        time.sleep(0.2)
    return time.monotonic() - started
