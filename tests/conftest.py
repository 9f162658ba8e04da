"""Shared pytest setup: the ``gpu`` tier, its skip rules and its arrangement.

Tests marked ``gpu`` need a CUDA build of ``afd_ext._C`` and at least one CUDA
GPU. Elsewhere they are skipped with a reason that says exactly that, so a
skipped GPU test is never mistaken for a passed one. Their processes are
placed by :func:`afd_ext.tools.testing.place_processes`: one per GPU where there
are enough GPUs, attention and FFN ranks on different GPUs on two, and every
process on GPU 0 on one GPU (each with its own ``NCCL_HOSTID``: NCCL over
sockets, correctness only). The arrangement is printed in pytest's header.

Tests whose meaning needs distinct GPUs (timings) carry
``@pytest.mark.distinct_gpus(n, why)``: skipped, with ``why``, where fewer
than ``n`` GPUs are visible or ``AFD_TEST_SHARE_GPU=1`` forces sharing.

Run the tier on the GPU machine with ``bash scripts/gpu_tier.sh build tests``
(or ``pytest -m gpu tests -v``).
"""

from __future__ import annotations

import functools
import os

import pytest

# Many ranks share 2 cores in CI: a waiting FFN rank polls for 2 ms after a payload, then
# blocks (serving default: 10 s of polling, one core per FFN rank). Spawned workers inherit it.
os.environ.setdefault("AFD_CONTROL_IDLE_S", "0.002")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA build of afd_ext and a CUDA GPU (one GPU: processes "
                                       "share it, NCCL over sockets)")
    config.addinivalue_line("markers", "distinct_gpus(n, why): needs n distinct GPUs (e.g. timings); skipped "
                                       "with `why` on fewer or when AFD_TEST_SHARE_GPU=1")
    config.addinivalue_line("markers", "slow: slow on the 2-core CI machine")


@functools.lru_cache(maxsize=1)
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
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 1:
        return "GPU tier not run: no CUDA GPU visible (run on the GPU machine: bash scripts/gpu_tier.sh build tests)"
    return None


def pytest_report_header(config):
    if _gpu_tier_missing() is not None:
        return None
    from afd_ext.tools.testing import place_processes

    return [f"GPU arrangement (1A1F): {place_processes(1, 1).describe()}",
            f"GPU arrangement (2A1F): {place_processes(2, 1).describe()}"]


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_tier_missing()
    for item in gpu_items:
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        m = item.get_closest_marker("distinct_gpus")
        if m is not None:
            from afd_ext.tools.testing import distinct_gpus_missing

            why = distinct_gpus_missing(*m.args)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))
