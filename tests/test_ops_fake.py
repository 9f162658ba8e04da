"""Fakes (FakeTensorMode / meta tensors) of every afd_ext op, and the CPU-side
validation of the communication ops (what a CI machine without GPU can check)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from afd_ext.errors import AFDConfigError

ops = pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")
A = torch.ops.afd_ext


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def _wire_tensors(n, device="cpu"):
    return (
        torch.empty(n, 16, dtype=torch.bfloat16, device=device),
        torch.empty(n, 8, dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.int32, device=device),
    )


# --- communication ops: fakes return nothing and check row counts ---------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_comm_op_fakes_accept_well_formed_calls(fake, device):
    # FakeTensorMode can make CUDA fake tensors without a GPU.
    h, lg, ids = _wire_tensors(8, device)
    assert A.send(h, 1, 1) is None
    assert A.recv(h, 1, 1) is None
    assert A.fan_in([h, lg, ids], [1, 2], [1, 1], [5, 3]) is None
    assert A.split_back([h], [1, 2, 3], [0, 0, 0], [3, 0, 5]) is None
    # Outputs keep their shapes and dtypes (the ops write in place).
    assert h.shape == (8, 16) and h.dtype == torch.bfloat16 and h.device.type == device


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda h, lg, ids: A.fan_in([h, lg, ids], [1, 2], [1, 1], [5, 2]), r"tensors\[0\] has 8 rows but rows=\[5, 2\]"),
        (lambda h, lg, ids: A.split_back([h, lg], [1], [1, 1], [8]), r"equal lengths"),
        (lambda h, lg, ids: A.fan_in([h, lg[:4]], [1], [1], [8]), r"tensors\[1\] has 4 rows"),
    ],
)
def test_comm_op_fakes_check_rows(fake, call, pattern):
    h, lg, ids = _wire_tensors(8)
    with pytest.raises(RuntimeError, match=pattern):
        call(h, lg, ids)


def test_comm_ops_run_on_meta_tensors():
    h, lg, ids = _wire_tensors(4, "meta")
    A.fan_in([h, lg, ids], [1], [1], [4])
    A.split_back([h, lg, ids], [1], [1], [4])
    A.send(h, 1, 1)
    A.recv(h, 1, 1)


# --- communicator management --------------------------------------------------------------------


def test_nccl_version_fake_is_the_real_constant(fake):
    assert A.nccl_version() == ops.nccl_version()


def test_nccl_unique_id_fake_checks_its_buffer(fake):
    A.nccl_unique_id(torch.empty(128, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"uint8 \[128\]"):
        A.nccl_unique_id(torch.empty(64, dtype=torch.uint8))


@pytest.mark.parametrize(
    "call",
    [
        lambda: A.comm_create(torch.zeros(128, dtype=torch.uint8), 2, 0, 0),
        lambda: A.comm_destroy(1),
        lambda: A.comm_abort(1),
        lambda: A.comm_async_error(1),
    ],
    ids=["comm_create", "comm_destroy", "comm_abort", "comm_async_error"],
)
def test_host_side_ops_refuse_to_be_traced(fake, call):
    with pytest.raises(AFDConfigError, match="host-side communicator call and cannot be traced"):
        call()


def test_host_side_ops_break_fullgraph_compile_loudly():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        ops.comm_abort(1)
        return x + 1

    with pytest.raises(Exception, match="cannot be traced"):
        f(torch.ones(2))


# --- CPU-side validation of the real kernels ----------------------------------------------------


def _no_cuda_or(pattern_cuda: str) -> str:
    return pattern_cuda if ops.is_cuda_built() else "afd_ext was built without CUDA"


@pytest.mark.parametrize(
    "call",
    [
        lambda h, lg, ids: ops.send(h, 1, 1),
        lambda h, lg, ids: ops.recv(h, 1, 1),
        lambda h, lg, ids: ops.fan_in([h, lg, ids], [1], [1], [8]),
        lambda h, lg, ids: ops.split_back([h, lg, ids], [1], [1], [8]),
    ],
    ids=["send", "recv", "fan_in", "split_back"],
)
def test_cpu_tensors_to_nccl_ops_get_a_clear_error(call):
    h, lg, ids = _wire_tensors(8)
    with pytest.raises(RuntimeError, match=_no_cuda_or("got CPU tensors, but the NCCL ops move CUDA tensors")):
        call(h, lg, ids)


def test_unknown_handles_are_named():
    if not ops.is_cuda_built():
        with pytest.raises(RuntimeError, match="afd_ext was built without CUDA"):
            ops.comm_async_error(1)
        return
    with pytest.raises(RuntimeError, match=r"handle=0 is not a live communicator \(never issued"):
        ops.comm_async_error(0)
    with pytest.raises(RuntimeError, match=r"handle 999999 was never issued"):
        ops.comm_destroy(999999)
    with pytest.raises(RuntimeError, match=r"handle 999999 was never issued"):
        ops.comm_abort(999999)


def test_comm_create_checks_its_arguments_before_nccl():
    if not ops.is_cuda_built():
        with pytest.raises(RuntimeError, match="afd_ext was built without CUDA"):
            ops.comm_create(torch.zeros(128, dtype=torch.uint8), 2, 0, 0)
        return
    with pytest.raises(RuntimeError, match=r"unique_id must be a contiguous CPU uint8 tensor of 128"):
        ops.comm_create(torch.zeros(64, dtype=torch.uint8), 2, 0, 0)
    with pytest.raises(RuntimeError, match=r"rank must be in \[0, 2\)"):
        ops.comm_create(torch.zeros(128, dtype=torch.uint8), 2, 2, 0)
    with pytest.raises(RuntimeError, match=r"world_size must be >= 1"):
        ops.comm_create(torch.zeros(128, dtype=torch.uint8), 0, 0, 0)
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=rf"device must be in \[0, {n}\)"):
        ops.comm_create(torch.zeros(128, dtype=torch.uint8), 2, 0, n)


def test_management_ops_refuse_a_non_cuda_torch_device_before_the_core():
    # Both creators normalise a torch.device in one place; a CPU device is the caller's error.
    with pytest.raises(AFDConfigError, match=r"device must be a CUDA device, got cpu"):
        ops.comm_create(torch.zeros(128, dtype=torch.uint8), 2, 0, torch.device("cpu"))
    with pytest.raises(AFDConfigError, match=r"device must be a CUDA device, got cpu"):
        ops.peer_plane_create(torch.device("cpu"), 1, 4, 2)


def test_nccl_unique_id():
    if not ops.is_cuda_built():
        with pytest.raises(RuntimeError, match="afd_ext was built without CUDA"):
            ops.nccl_unique_id()
        return
    a, b = ops.nccl_unique_id(), ops.nccl_unique_id()
    assert a.dtype == torch.uint8 and a.shape == (128,)
    assert not torch.equal(a, b), "two unique ids must differ"
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU uint8 tensor of 128"):
        ops.nccl_unique_id(torch.empty(128, dtype=torch.float32))
