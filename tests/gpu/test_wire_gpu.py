"""The add-a-part test of tests/test_wire.py over NCCL and peer memory (GPU tier).

A ``topk_ids`` part (int32 ``[n, 3]``) declared through :func:`afd_ext.wire.declare_part`
travels 2A1F through the connector's four calls on CUDA tensors, touching only the
declaration and the connector's argument: the ops and the transports move it as one more
tensor of their list (the NCCL group; the peer plane's region gets a part for it).
Processes are placed by :func:`afd_ext.testing.place_processes` (one GPU: all on GPU 0,
with per-process ``NCCL_HOSTID``).

Run: ``pytest -m gpu tests/gpu/test_wire_gpu.py -v``.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from afd_ext import ops  # noqa: E402
from afd_ext.testing import find_free_port, place_processes, run_workers  # noqa: E402
from test_wire import COUNTS, add_a_part_worker, check_add_a_part  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not (ops.is_cuda_built() and torch.cuda.is_available()),
                       reason="needs a CUDA build of afd_ext and a CUDA GPU"),
]


@pytest.mark.parametrize("transport", ["nccl", "peer"])
@pytest.mark.parametrize("strict", [False, True])
def test_add_a_part_moves_end_to_end_on_the_gpu(transport, strict):
    A, F = len(COUNTS), 1
    results = run_workers(add_a_part_worker, A + F,
                          (find_free_port(), strict, ("attention", "ffn"), transport, "cuda:0"),
                          timeout_s=200, per_rank_env=place_processes(A, F).env())
    check_add_a_part(results)
    assert {kind for *_, kind in results} == {transport}
