"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch

from backend.ops import cpu_ops


@pytest.fixture(params=["vectors", "amx"])
def decode_scores(request):
    """The C++ decode kernel's scores on AVX-512 vectors, or on AMX tiles where it has them (skipped
    elsewhere). Where there is no AMX, "vectors" is simply the kernel as built."""
    amx = request.param == "amx"
    if amx and not cpu_ops.decode_on_amx():
        pytest.skip("the decode kernel scores on no AMX tiles on this CPU")
    before = cpu_ops.decode_on_amx()
    cpu_ops.decode_on_amx(amx)
    yield request.param
    cpu_ops.decode_on_amx(before)


def pytest_collection_modifyitems(config, items):
    """AMX scores bfloat16 queries only: the other dtypes' "amx" cases are not collected at all."""
    def float_on_amx(item) -> bool:
        params = getattr(item, "callspec", None) and item.callspec.params
        return bool(params) and params.get("decode_scores") == "amx" and params.get("dtype") != torch.bfloat16
    dropped = [item for item in items if float_on_amx(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not float_on_amx(item)]
