"""GPU tier of the compiled core: NCCL ops and CUDA kernels.

Run on the GPU machine, from the repository root, after the CUDA build
(``pip install --no-build-isolation -e .``):

    pytest -m gpu tests/gpu/test_ops_gpu.py -v

Layout: process 0 is the FFN rank, processes 1..A are attention ranks, placed
by :func:`afd_ext.tools.testing.place_processes` (two GPUs: FFN on GPU 1, attention
on GPU 0; one GPU: all on GPU 0, each with its own ``NCCL_HOSTID``, NCCL over
sockets). ``CUDA_VISIBLE_DEVICES`` is set per process before its interpreter
starts, so each process sees its GPU as ``cuda:0``. One NCCL communicator per
(attention, FFN) edge, FFN = rank 0 and attention = rank 1 in it; unique ids
travel through a ``torch.distributed.TCPStore`` hosted by the test process.
Several processes on one GPU are time-sliced by the driver: these tests prove
correctness only; never quote their timings.

Every input is a pure function of (attention rank, iteration), so each side
can check what it received, bit for bit, without another exchange.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")
from afd_ext.tools.testing import find_free_port, place_processes, run_workers  # noqa: E402

# No CUDA call at import time: spawned workers import this module before they
# set CUDA_VISIBLE_DEVICES.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(420)]

HIDDEN = 96
EXPERTS = 8
TIMEOUT_S = 300.0
STORE_TIMEOUT = timedelta(seconds=120)


# ---------------------------------------------------------------------------
# Helpers run inside the workers
# ---------------------------------------------------------------------------


def _env(num_attention: int) -> list[dict]:
    """Process 0 (FFN) then the attention processes: AFD world order, as placed for an AF topology."""
    return place_processes(num_attention, 1).env()


def _store(port: int):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)


def _connect(rank: int, nprocs: int, port: int):
    """Communicators of this process: FFN -> one per attention rank; attention -> its one edge."""
    torch.cuda.set_device(0)
    store = _store(port)
    if rank == 0:
        uids = [ops.nccl_unique_id() for _ in range(nprocs - 1)]
        for a, uid in enumerate(uids):
            store.set(f"uid/{a}", bytes(uid.tolist()))
        comms = [ops.comm_create(uid, 2, 0, 0) for uid in uids]
    else:
        raw = store.get(f"uid/{rank - 1}")
        uid = torch.tensor(list(raw), dtype=torch.uint8)
        comms = [ops.comm_create(uid, 2, 1, 0)]
    return store, comms


def _barrier(store, nprocs: int, name: str) -> None:
    """Every process arrives (bounded by the store timeout)."""
    key = f"barrier/{name}"
    store.add(key, 1)
    end = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while int(store.add(key, 0)) < nprocs:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name}: {store.add(key, 0)} of {nprocs} processes arrived")
        time.sleep(0.01)


def _close(store, comms, nprocs: int) -> None:
    torch.cuda.synchronize()
    _barrier(store, nprocs, "close")
    for c in comms:
        assert ops.comm_async_error(c) == 0
        ops.comm_destroy(c)
        ops.comm_destroy(c)  # idempotent


def _inputs(a: int, it: int, rows: int, device="cuda"):
    """Attention rank a's wire tensors at iteration it: hidden bf16, logits fp32, ids int32."""
    g = torch.Generator().manual_seed(1000 * a + it + 7)
    h = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
    lg = torch.randn(rows, EXPERTS, generator=g)
    ids = torch.randint(0, 2**31 - 1, (rows,), generator=g, dtype=torch.int64).to(torch.int32)
    return h.to(device), lg.to(device), ids.to(device)


def _ffn_compute(h: torch.Tensor) -> torch.Tensor:
    """Row-independent stand-in for the FFN: exact in bf16 (x*2 exact, then one rounding)."""
    return (h.float() * 2 + 1).to(torch.bfloat16)


def _offsets(rows):
    out, o = [], 0
    for r in rows:
        out.append(o)
        o += r
    return out


def _make(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    hi = 255 if dtype == torch.uint8 else 2**31 - 1
    return torch.randint(0, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


# ---------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------


def _w_send_recv(rank, nprocs, port):
    store, comms = _connect(rank, nprocs, port)
    c = comms[0]
    for i, dtype in enumerate(ops.WIRE_DTYPES):
        for shape in [(7, 33), (0, 4), (1,), (64, 1024)]:
            x = _make(dtype, shape, seed=i * 31 + len(shape))
            if rank == 1:  # attention sends
                ops.send(x.cuda(), c, 0)
            else:
                out = torch.zeros(shape, dtype=dtype, device="cuda")
                ops.recv(out, c, 1)
                torch.cuda.synchronize()
                assert _same_bits(out.cpu(), x), f"recv {dtype} {shape} differs"
    # The other direction, one dtype, to show both ends can send.
    y = _make(torch.bfloat16, (5, 17), seed=99)
    if rank == 0:
        ops.send(y.cuda(), c, 1)
    else:
        out = torch.empty_like(y, device="cuda")
        ops.recv(out, c, 0)
        torch.cuda.synchronize()
        assert _same_bits(out.cpu(), y)
    _close(store, comms, nprocs)
    return len(ops.WIRE_DTYPES)


def _w_fan_in_split_back(rank, nprocs, port, rows):
    store, comms = _connect(rank, nprocs, port)
    A = nprocs - 1
    for it in range(3):
        if rank == 0:
            n = sum(rows)
            h = torch.full((n, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
            lg = torch.full((n, EXPERTS), float("nan"), device="cuda")
            ids = torch.full((n,), -1, dtype=torch.int32, device="cuda")
            ops.fan_in([h, lg, ids], comms, [1] * A, rows)
            out = _ffn_compute(h)
            ops.split_back([out], comms, [1] * A, rows)
            torch.cuda.synchronize()
            for a, (o, r) in enumerate(zip(_offsets(rows), rows)):
                eh, elg, eids = _inputs(a, it, r)
                assert _same_bits(h[o : o + r], eh), f"fan-in hidden rows of peer {a}"
                assert _same_bits(lg[o : o + r], elg), f"fan-in logits rows of peer {a}"
                assert _same_bits(ids[o : o + r], eids), f"fan-in token ids of peer {a}"
        else:
            a = rank - 1
            r = rows[a]
            h, lg, ids = _inputs(a, it, r)
            reply = torch.full((r, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
            ops.split_back([h, lg, ids], comms, [0], [r])
            ops.fan_in([reply], comms, [0], [r])
            torch.cuda.synchronize()
            assert _same_bits(reply, _ffn_compute(h)), f"attention {a} got back other rows"
    _close(store, comms, nprocs)
    return True


def _w_graph(rank, nprocs, port, rows, replays):
    """Eager warm-up, capture, then `replays` replays with fresh inputs in the static buffers."""
    store, comms = _connect(rank, nprocs, port)
    A = nprocs - 1
    n = sum(rows)
    if rank == 0:
        h = torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device="cuda")
        lg = torch.zeros(n, EXPERTS, device="cuda")
        ids = torch.zeros(n, dtype=torch.int32, device="cuda")
        out = torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device="cuda")

        def step():
            ops.fan_in([h, lg, ids], comms, [1] * A, rows)
            out.copy_(_ffn_compute(h))
            ops.split_back([out], comms, [1] * A, rows)
    else:
        a = rank - 1
        r = rows[a]
        h, lg, ids = (torch.zeros_like(t) for t in _inputs(a, 0, r))
        reply = torch.zeros(r, HIDDEN, dtype=torch.bfloat16, device="cuda")

        def step():
            ops.split_back([h, lg, ids], comms, [0], [r])
            ops.fan_in([reply], comms, [0], [r])

    def feed(it):
        if rank != 0:
            for dst, src in zip((h, lg, ids), _inputs(rank - 1, it, rows[rank - 1])):
                dst.copy_(src)

    def check(it, what):
        torch.cuda.synchronize()
        if rank == 0:
            for a, (o, r) in enumerate(zip(_offsets(rows), rows)):
                eh, elg, eids = _inputs(a, it, r)
                assert _same_bits(h[o : o + r], eh) and _same_bits(lg[o : o + r], elg), f"{what} {it}: peer {a}"
                assert _same_bits(ids[o : o + r], eids), f"{what} {it}: peer {a} ids"
        else:
            expected = _ffn_compute(_inputs(rank - 1, it, rows[rank - 1])[0])
            assert _same_bits(reply, expected), f"{what} {it}: reply of attention {rank - 1}"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (connects every edge) on the capture stream
        for it in range(2):
            feed(it)
            step()
            check(it, "eager warm-up")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    _barrier(store, nprocs, "captured-after-warmup")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    _barrier(store, nprocs, "captured")
    for it in range(100, 100 + replays):
        feed(it)
        graph.replay()
        check(it, "replay")
    # Eager again after the replays: the communicators still work outside the graph.
    feed(7)
    step()
    check(7, "eager after replay")
    del graph
    _close(store, comms, nprocs)
    return replays


def _w_bad_input(rank, nprocs, port):
    store, comms = _connect(rank, nprocs, port)
    c = comms[0]
    r = 4
    errors = []

    def expect(pattern, fn):
        try:
            fn()
        except RuntimeError as e:
            assert re.search(pattern, str(e)), f"{pattern!r} not in {e}"
            errors.append(pattern)
            return
        raise AssertionError(f"no error for {pattern!r}")

    if rank == 1:
        h, lg, ids = _inputs(0, 0, r)
        reply = torch.zeros(r, HIDDEN, dtype=torch.bfloat16, device="cuda")
        expect(r"tensors\[0\] has 4 rows but rows add up to 5", lambda: ops.split_back([h, lg, ids], comms, [0], [5]))
        expect(r"tensors\[1\] must be a CUDA tensor", lambda: ops.split_back([h, lg.cpu(), ids], comms, [0], [r]))
        expect(r"has dtype Double", lambda: ops.send(torch.zeros(3, dtype=torch.float64, device="cuda"), c, 0))
        expect(r"must have contiguous rows", lambda: ops.send(torch.zeros(4, 6, device="cuda")[:, ::2], c, 0))
        expect(r"peers\[0\]=1 must be a rank of communicator", lambda: ops.send(h, c, 1))
        expect(r"peers\[0\]=2 must be a rank", lambda: ops.fan_in([reply], comms, [2], [r]))
        expect(r"equal lengths", lambda: ops.fan_in([reply], comms, [0, 0], [r]))
        expect(r"rows\[0\]=-1 must be >= 0", lambda: ops.fan_in([reply], comms, [0], [-1]))
        expect(r"is not a live communicator", lambda: ops.send(h, 987654, 0))
        expect(r"tensors\[0\] has \d+ rows but rows add up to", lambda: ops.fan_in([reply[:1]], comms, [0], [r]))
        # The communicator still works: a full exchange after every refusal.
        ops.split_back([h, lg, ids], comms, [0], [r])
        ops.fan_in([reply], comms, [0], [r])
        torch.cuda.synchronize()
        assert _same_bits(reply, _ffn_compute(h))
    else:
        h = torch.zeros(r, HIDDEN, dtype=torch.bfloat16, device="cuda")
        lg = torch.zeros(r, EXPERTS, device="cuda")
        ids = torch.zeros(r, dtype=torch.int32, device="cuda")
        # The op checks device and layout of each part (dtypes are the schedule's: test_schedule.py).
        expect(r"tensors\[2\] must be a CUDA tensor on cuda:0", lambda: ops.fan_in([h, lg, ids.cpu()], comms, [1], [r]))
        ops.fan_in([h, lg, ids], comms, [1], [r])
        ops.split_back([_ffn_compute(h)], comms, [1], [r])
        torch.cuda.synchronize()
        eh, elg, eids = _inputs(0, 0, r)
        assert _same_bits(h, eh) and _same_bits(lg, elg) and _same_bits(ids, eids)
    assert ops.comm_async_error(c) == 0
    _close(store, comms, nprocs)
    ops.comm_abort(c)  # after destroy: a no-op
    return len(errors)


def _run(fn, num_attention, *args):
    from torch.distributed import TCPStore

    port = find_free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    try:
        return run_workers(fn, 1 + num_attention, (port, *args), timeout_s=TIMEOUT_S, per_rank_env=_env(num_attention))
    finally:
        del store


def test_send_recv_every_dtype():
    assert _run(_w_send_recv, 1)[0] == len(ops.WIRE_DTYPES)


ROW_CASES = [[5, 3], [1, 7], [0, 8], [8, 0], [3, 0, 4]]


@pytest.mark.parametrize("rows", ROW_CASES, ids=lambda r: "rows" + "-".join(map(str, r)))
def test_fan_in_and_split_back(rows):
    assert all(_run(_w_fan_in_split_back, len(rows), rows))


@pytest.mark.parametrize("rows", [[5, 3], [0, 8]], ids=lambda r: "rows" + "-".join(map(str, r)))
def test_cuda_graph_capture_and_replay_bit_exact(rows):
    assert _run(_w_graph, len(rows), rows, 100) == [100] * (1 + len(rows))


def test_bad_input_raises_and_the_communicator_still_works():
    counts = _run(_w_bad_input, 1)
    assert counts == [1, 10]  # the FFN rank: its device refusal (dtypes are the schedule's, test_schedule.py)

