"""Shared pytest setup: the ``gpu`` tier and its skip rule.

Tests marked ``gpu`` need a CUDA build of ``afd_ext._C`` and at least two CUDA
GPUs. Elsewhere they are skipped with a reason that says exactly that, so a
skipped GPU test is never mistaken for a passed one. Run the tier on the
2-GPU machine with ``pytest -m gpu tests/gpu -v``.
"""

from __future__ import annotations

import os

import pytest

# Many ranks share 2 cores in CI: a waiting FFN rank polls for 2 ms after a payload, then
# blocks (serving default: 10 s of polling, one core per FFN rank). Spawned workers inherit it.
os.environ.setdefault("AFD_CONTROL_IDLE_S", "0.002")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA build of afd_ext and >= 2 CUDA GPUs")
    config.addinivalue_line("markers", "slow: slow on the 2-core CI machine")


def _gpu_tier_missing() -> str | None:
    """Why the GPU tier cannot run here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "GPU tier not run: torch is not installed"
    try:
        from afd_ext import ops
    except ImportError as e:
        return f"GPU tier not run: afd_ext._C is not built ({e}); pip install --no-build-isolation -e ."
    if not ops.is_cuda_built():
        return "GPU tier not run: afd_ext was built without CUDA (rebuild with a CUDA torch and CUDA_HOME)"
    n = torch.cuda.device_count()
    if n < 2:
        return f"GPU tier not run: needs >= 2 CUDA GPUs, found {n} (run on the 2-GPU machine: pytest -m gpu tests/gpu)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_tier_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)
