"""Fixtures shared by the kernel tests: each C++ attention kernel on AVX-512 vectors and on AMX tiles."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from backend.ops import cpu_ops

AMX_FIXTURES = ("tiles", "decode_scores")  # each turns a kernel's AMX switch on ("amx") or off ("vectors")


def kernel_switched(request, switch: Callable[..., bool], kernel: str) -> Iterator[str]:
    amx = request.param == "amx"
    if amx and not switch():
        pytest.skip(f"the {kernel} kernel runs no AMX tiles on this CPU")
    before = switch()
    switch(amx)
    yield request.param
    switch(before)


@pytest.fixture(params=["vectors", "amx"])
def tiles(request):
    """The prefill kernel in bfloat16 on AVX-512 vectors, or on AMX tiles where it has them (skipped
    elsewhere)."""
    yield from kernel_switched(request, cpu_ops.prefill_on_amx, "prefill")


@pytest.fixture(params=["vectors", "amx"])
def decode_scores(request):
    """The decode kernel on AVX-512 vectors, or on AMX tiles where it has them (skipped elsewhere):
    the scores, and an 8-bit cache's output at head size 64. Where there is no AMX, "vectors" is the
    kernel as built."""
    yield from kernel_switched(request, cpu_ops.decode_on_amx, "decode")


def pytest_collection_modifyitems(config, items):
    """AMX multiplies bfloat16 queries only: a test's float32 cases on AMX are not collected."""
    def float_on_amx(item) -> bool:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        return "dtype" in params and params["dtype"] != torch.bfloat16 and any(
            params.get(name) == "amx" for name in AMX_FIXTURES)
    dropped = [item for item in items if float_on_amx(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not float_on_amx(item)]
