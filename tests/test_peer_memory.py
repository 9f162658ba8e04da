"""The peer-memory plane on the CPU tier: layouts, the memory formula, fakes, compile, errors, set-up verdicts.

The kernels themselves run in tests/gpu/test_peer_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

ops = pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from afd_ext.errors import (  # noqa: E402
    AFDAbortedError,
    AFDProtocolError,
    AFDTimeoutError,
    PeerMemoryUnavailableError,
    TransportUnavailableError,
)
from afd_ext.transport.peer.plane import (  # noqa: E402
    FLAG_STRIDE,
    OP_RECV_ATTN,
    OP_RECV_FFN,
    REGION_ALIGN,
    PeerFailure,
    RegionLayout,
    WireSpec,
    failure_error,
)
from afd_ext.schedule import ScheduleConfig  # noqa: E402
from afd_ext.topology import ATTENTION, FFN, Topology  # noqa: E402


def _spec(hidden, dtype, width=0, ldtype=torch.float32, ids=False, fp8=False):
    """The plane's spec of a connector config: its wire layout (afd_ext.wire)."""
    return WireSpec.of(ScheduleConfig(1, hidden, dtype, width or None, ldtype, ids,
                                      hidden_wire="fp8_e4m3" if fp8 else None))


TOPOLOGIES = [(1, 1), (2, 1), (4, 2), (3, 2), (1, 2), (2, 2)]
SPECS = [
    _spec(7168, torch.bfloat16, 256, torch.float32, True),
    _spec(96, torch.float16),
    _spec(33, torch.float32, 7, torch.bfloat16, False),
    _spec(5, torch.float8_e4m3fn, 0, torch.float32, True),
    _spec(256, torch.bfloat16, 8, torch.float32, True, fp8=True),
]


def _intervals(lay: RegionLayout):
    out = [(0, lay.num_stages * lay.num_peers * FLAG_STRIDE, "flags")]
    for s in range(lay.num_stages):
        for k, rb in enumerate(lay.row_bytes):
            off = lay.part_offset(s, k)
            out.append((off, off + lay.capacity_rows * rb, f"stage {s} part {k}"))
    return sorted(out)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.signature())
@pytest.mark.parametrize("a,f", TOPOLOGIES)
@pytest.mark.parametrize("stages", [1, 2])
def test_every_part_is_aligned_disjoint_and_inside_its_region(a, f, stages, spec):
    topo = Topology(a, f)
    for role, n in ((ATTENTION, a), (FFN, f)):
        for r in range(n):
            lay = RegionLayout.for_rank(topo, role, r, spec, max_tokens=37, num_stages=stages)
            iv = _intervals(lay)
            for (s0, e0, n0), (s1, _e1, n1) in zip(iv, iv[1:]):
                assert e0 <= s1, f"{role} {r}: {n0} overlaps {n1}"
            assert iv[-1][1] <= lay.nbytes
            assert all(start % REGION_ALIGN == 0 for start, _, name in iv if name != "flags")
            flags = {lay.flag_offset(s, i) for s in range(stages) for i in range(lay.num_peers)}
            assert len(flags) == stages * lay.num_peers and all(o % 8 == 0 for o in flags)
            peers = topo.ffn_peers(r) if role == FFN else topo.attention_peers(r)
            assert lay.num_peers == len(peers)


def test_memory_formula_ranks_tokens_row_bytes_stages():
    # 4A2F, DeepSeek-V3-like wire: hidden 7168 bf16 + 256 fp32 logits + int32 id, 8192 tokens, 2 stages.
    spec, T, S = SPECS[0], 8192, 2
    topo = Topology(4, 2)
    ffn = RegionLayout.for_rank(topo, FFN, 0, spec, max_tokens=T, num_stages=S)
    row = 7168 * 2 + 256 * 4 + 4
    # ranks x tokens x row bytes x stages (every part here is already 256-aligned) + one 256 B flag area.
    assert ffn.nbytes == S * 2 * T * row + REGION_ALIGN
    att = RegionLayout.for_rank(topo, ATTENTION, 3, spec, max_tokens=T, num_stages=S)
    assert att.nbytes == S * T * 7168 * 2 + REGION_ALIGN
    # Parts are padded to the alignment, never shrunk.
    small = RegionLayout.for_rank(Topology(1, 1), FFN, 0, _spec(3, torch.float32, 0, torch.float32, True),
                                  max_tokens=5, num_stages=1)
    assert small.nbytes == REGION_ALIGN + REGION_ALIGN + REGION_ALIGN


def test_an_attention_rank_with_several_ffn_peers_writes_identical_layouts():
    # 1A2F: one put writes the same part offsets into both FFN ranks' regions.
    topo = Topology(1, 2)
    lays = [RegionLayout.for_rank(topo, FFN, f, SPECS[0], max_tokens=16, num_stages=2) for f in range(2)]
    assert lays[0] == lays[1]
    assert [topo.ffn_peers(f).index(0) for f in range(2)] == [0, 0]


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_tokens"):
        RegionLayout.for_rank(Topology(1, 1), FFN, 0, SPECS[1], max_tokens=0, num_stages=1)
    with pytest.raises(ValueError, match="role"):
        RegionLayout.for_rank(Topology(1, 1), "mlp", 0, SPECS[1], max_tokens=1, num_stages=1)
    with pytest.raises(ValueError, match="columns >= 1"):
        WireSpec(((torch.bfloat16, (0,)),), ((torch.bfloat16, (0,)),), ((torch.bfloat16, (0,)),))


# ------------------------------------------------------------------ ops without a GPU


def _put_args(n=4, h=None):
    h = torch.zeros(n, 8) if h is None else h
    return ([h], 1, 0, [1], [n], [0], [256], [0])


def _wait_args(n=4, out=None):
    return ([torch.zeros(n, 8)], out, 1, 2, 1, [0], [0], OP_RECV_FFN, 0, 0, 10**9)


def test_cpu_tensors_get_a_clear_error():
    with pytest.raises(RuntimeError, match="peer_put: .*(CUDA tensors|built without CUDA)"):
        ops.peer_put(*_put_args())
    with pytest.raises(RuntimeError, match="peer_wait: .*(CUDA tensors|built without CUDA)"):
        ops.peer_wait(*_wait_args())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_plane_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="peer_plane_create: (device 0 is not a CUDA device|.*built without CUDA)"):
        ops.peer_plane_create(0, 1, 2, 1)


def test_unknown_handles_are_named():
    msg = "(never issued|built without CUDA)"
    for call in (lambda: ops.peer_plane_error(987654), lambda: ops.peer_plane_abort(987654),
                 lambda: ops.peer_plane_destroy(987654), lambda: ops.peer_region_close(987654),
                 lambda: ops.peer_region_view(987654, 0, 8), lambda: ops.peer_region_alloc(987654, 64)):
        with pytest.raises(RuntimeError, match=msg):
            call()


# ------------------------------------------------------------------ fakes


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def test_peer_fakes_accept_well_formed_calls(fake):
    h = torch.empty(6, 8, device="cuda")
    lg = torch.empty(6, 4, device="cuda")
    ids = torch.empty(6, dtype=torch.int32, device="cuda")
    ops.peer_put([h, lg, ids], 1, 0, [1, 2], [2, 4], [0, 0], [256, 512, 768], [0, 64])
    ops.peer_wait([h, lg, ids], None, 1, 2, 1, [0, 64], [0, 1], OP_RECV_ATTN, 3, 1, 10**9)
    ops.peer_wait([h], torch.empty(6, 8, device="cuda"), 1, 2, 1, [0], [0], OP_RECV_FFN, 3, 1, 10**9)


@pytest.mark.parametrize("call,pattern", [
    (lambda: ops.peer_put([torch.empty(6, 8)], 1, 0, [1, 2], [2], [0, 0], [256], [0, 64]),
     "equal lengths"),
    (lambda: ops.peer_put([torch.empty(6, 8)], 1, 0, [1], [5], [0], [256], [0]), "add up to 5"),
    (lambda: ops.peer_put([torch.empty(6, 8)], 1, 0, [1], [6], [0], [256, 512], [0]), "part_offsets"),
    (lambda: ops.peer_wait([torch.empty(6, 8)], None, 1, 2, 1, [0, 64], [0], 1, 0, 0, 1), "equal lengths"),
    (lambda: ops.peer_wait([torch.empty(6, 8)], torch.empty(5, 8), 1, 2, 1, [0], [0], 1, 0, 0, 1),
     "out must match"),
])
def test_peer_fakes_check_their_arguments(fake, call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


@pytest.mark.parametrize("call", [
    lambda: ops.peer_plane_create(0, 1, 2, 1), lambda: ops.peer_plane_destroy(1), lambda: ops.peer_plane_error(1),
    lambda: ops.peer_plane_abort(1), lambda: ops.peer_region_alloc(1, 64), lambda: ops.peer_region_close(1),
    lambda: ops.peer_region_view(1, 0, 8), lambda: ops.peer_region_open(1, torch.zeros(64, dtype=torch.uint8), 64),
    lambda: ops.peer_region_export(1),
])
def test_peer_host_side_ops_refuse_to_be_traced(call):
    for name in ("peer_plane_create", "peer_plane_destroy", "peer_plane_error", "peer_plane_abort",
                 "peer_region_alloc", "peer_region_export", "peer_region_open", "peer_region_close",
                 "peer_region_view"):
        entry = torch._library.simple_registry.singleton.find(f"afd_ext::{name}")
        assert entry.fake_impl.kernel is not None
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match="cannot be traced"):
            call()


def test_peer_data_ops_are_side_effecting_for_fx():
    from torch.fx.node import _side_effectful_functions

    assert torch.ops.afd_ext.peer_put.default in _side_effectful_functions
    assert torch.ops.afd_ext.peer_wait.default in _side_effectful_functions


# ------------------------------------------------------------------ torch.compile keeps every call in order


@pytest.fixture
def peer_log():
    log: list[tuple[str, int]] = []
    lib = torch.library.Library("afd_ext", "IMPL")

    def put(tensors, plane, slot, regions, rows, dst_rows, parts, flags, *quantize_first):
        log.append(("peer_put", slot))

    def wait(tensors, out, plane, slot, region, flags, peers, op, layer, stage, timeout_ns, *dequantize):
        log.append(("peer_wait", layer))
        if out is not None:
            out.copy_(tensors[0] + 1)

    lib.impl("peer_put", put, "CPU")
    lib.impl("peer_wait", wait, "CPU")
    try:
        yield log
    finally:
        lib._destroy()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layer_loop_keeps_every_put_and_wait_in_order(backend, peer_log):
    reply = torch.zeros(4, 8)

    def forward(x):
        for layer in range(3):
            h = x * 2  # a temporary that nothing reads after the put
            ops.peer_put([h], 1, layer, [1], [4], [0], [256], [0])
            out = torch.empty_like(reply)
            ops.peer_wait([reply], out, 1, 2, 1, [0], [0], OP_RECV_FFN, layer, 0, 10**9)
            x = out + x
        return x

    torch._dynamo.reset()
    got = torch.compile(forward, backend=backend, fullgraph=True)(torch.ones(4, 8))
    assert peer_log == [("peer_put", 0), ("peer_wait", 0), ("peer_put", 1), ("peer_wait", 1),
                        ("peer_put", 2), ("peer_wait", 2)]
    assert torch.equal(got, torch.full((4, 8), 4.0))  # x -> x + 1 three times


# ------------------------------------------------------------------ failure record -> named errors


def _rec(code, op=OP_RECV_ATTN, peer=1, layer=5, stage=1, want=7, seen=(3 << 48) | 6, waited=2_500_000_000):
    return PeerFailure(code, op, peer, layer, stage, want, seen, waited)


def test_a_timeout_record_becomes_the_named_timeout_error():
    err = failure_error(_rec(ops.PEER_TIMEOUT), me="FFN rank 0 (world rank 0)",
                        peer="attention rank 1 (world rank 2)", generation=3)
    assert isinstance(err, AFDTimeoutError)
    assert (err.op, err.peer, err.layer, err.stage) == ("recv_attn_output", "attention rank 1 (world rank 2)", 5, 1)
    msg = str(err)
    assert "waited 2.500 s" in msg and "layer 5, stage 1" in msg and "sequence 7" in msg and "sequence 6" in msg


def test_a_protocol_record_and_a_host_abort_become_their_errors():
    err = failure_error(_rec(ops.PEER_PROTOCOL, op=OP_RECV_FFN, want=4, seen=(3 << 48) | 5), me="me",
                        peer="FFN rank 0 (world rank 0)", generation=3)
    assert isinstance(err, AFDProtocolError) and err.op == "recv_ffn_output" and "sequence 5" in str(err)
    err = failure_error(_rec(ops.PEER_ABORTED, op=0), me="me", peer=None, generation=3)
    assert isinstance(err, AFDAbortedError) and err.op == "abort"


def test_a_set_up_record_names_no_layer():
    err = failure_error(_rec(ops.PEER_TIMEOUT, layer=-1, stage=0), me="me", peer="p", generation=1)
    assert err.layer is None and "set-up, stage 0" in str(err)


# ------------------------------------------------------------------ collective set-up verdicts


def _open_without_gpu(rank, nprocs, port, kind):
    import datetime

    import torch.distributed as dist

    from afd_ext import rendezvous
    from afd_ext.transport.peer.plane import open_plane

    topo = Topology(1, 1)
    role, role_rank = (FFN, 0) if rank == 0 else (ATTENTION, 0)
    if kind == "afd":
        store, gen = rendezvous.connect("127.0.0.1", port, rank, 2, 60.0, num_ffn_ranks=1), None
    else:  # a plain torch store, as the benchmark has
        base = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        store, gen = dist.PrefixStore("case-1/", base), 1
    try:
        open_plane(store, topo, role, role_rank, SPECS[1], max_tokens=8, num_stages=1, device="cuda:0",
                   timeout_s=5.0, setup_timeout_s=60.0, generation=gen)
    except PeerMemoryUnavailableError as e:
        # Both ranks read every verdict before either leaves (rank 0 hosts the store).
        if kind == "afd":
            rendezvous.barrier(store, rank, 2, "done", 60.0)
        elif rank == 0:  # the store's host leaves last
            store.set("left/0", b"1")
            store.wait(["left/1"])
        else:
            store.wait(["left/0"])
            store.set("left/1", b"1")
        return sorted(e.reasons), str(e)
    return None, "opened"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the verdict on a machine without a GPU")
@pytest.mark.parametrize("kind", ["afd", "torch"])
def test_every_rank_learns_together_that_the_plane_is_unavailable(kind):
    from afd_ext.tools.testing import find_free_port, run_workers

    results = run_workers(_open_without_gpu, 2, (find_free_port(), kind), timeout_s=180)
    for reasons, msg in results:
        assert reasons == ["FFN rank 0 (world rank 0)", "attention rank 0 (world rank 1)"], msg
        assert "allocating the regions" in msg and "region not allocated" in msg


# ------------------------------------------------------------------ configuration


def test_peer_and_auto_transports_and_their_settings_are_configurable():
    from afd_ext.config import AfdExtConnectorConfig

    for kind in ("peer", "auto"):
        assert AfdExtConnectorConfig.from_mapping({"transport": kind}).transport == kind
    cfg = AfdExtConnectorConfig.from_mapping({"peer_max_tokens": "4096", "peer_stages": 1, "peer_fallback": "false"})
    assert (cfg.peer_max_tokens, cfg.peer_stages, cfg.peer_fallback) == (4096, 1, False)
    assert AfdExtConnectorConfig().peer_fallback is True
    for bad in ({"peer_max_tokens": 0}, {"peer_stages": 0}, {"transport": "ipc"}):
        with pytest.raises(ValueError):
            AfdExtConnectorConfig.from_mapping(bad)


# ------------------------------------------------------------------ the connector's transport selection


def test_auto_on_cpu_tensors_is_gloo_and_the_connector_reports_it():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import connector_scenarios as cs

    from afd_ext.tools.testing import find_free_port, run_workers

    sc = cs.Scenario(A=2, F=1, steps=cs.default_steps(2), transport="auto")
    if cs.device_for(sc).type != "cpu":
        pytest.skip("a GPU is visible: auto would pick a CUDA transport")
    results = run_workers(cs.scenario_worker, sc.nprocs, ((sc,), find_free_port()), timeout_s=120)
    cs.check_scenario_results(sc, [r[0] for r in results])
    assert [r[0]["transport"] for r in results] == ["gloo"] * 3


class _Made:
    def __init__(self, kind):
        self.kind = kind


class _FakeTransport:
    """A registry entry that builds a :class:`_Made` of its ``kind`` (always available)."""

    kind = ""
    device_type = "cuda"

    @classmethod
    def unavailable(cls):
        return None

    @classmethod
    def from_setup(cls, setup):
        return _Made(cls.kind)


class _PeerUnavailable(_FakeTransport):
    @classmethod
    def from_setup(cls, setup):
        raise PeerMemoryUnavailableError("no peer memory here", reasons={"FFN rank 0 (world rank 0)": "test"})


class _PeerOk(_FakeTransport):
    kind = "peer"


class _Nccl(_FakeTransport):
    kind = "nccl"


class _NcclUnavailable(_FakeTransport):
    @classmethod
    def from_setup(cls, setup):
        raise TransportUnavailableError("NCCL cannot serve this world here")


class _Gloo(_FakeTransport):
    kind, device_type = "gloo", "cpu"


# NCCL goes first on CUDA (peer memory stays behind it until a two-GPU timing shows it ahead, #35);
# the plane runs where NCCL's set-up cannot serve the world.
@pytest.mark.parametrize("device,peer,nccl,want", [
    ("cpu", _PeerOk, _Nccl, "gloo"), ("cuda:0", _PeerOk, _Nccl, "nccl"), ("cuda:0", _PeerUnavailable, _Nccl, "nccl"),
    ("cuda:0", _PeerOk, _NcclUnavailable, "peer"),
])
def test_the_auto_rule(monkeypatch, device, peer, nccl, want):
    import afd_ext.transport as tr
    from afd_ext.transport.base import PeerMap, TransportSetup

    monkeypatch.setitem(tr._REGISTRY, "peer", peer)
    monkeypatch.setitem(tr._REGISTRY, "nccl", nccl)
    monkeypatch.setitem(tr._REGISTRY, "gloo", _Gloo)
    for name in ("peer", "nccl", "gloo"):
        monkeypatch.setitem(tr._REGISTRY, name, f"{__name__}:{tr._REGISTRY[name].__name__}")
    setup = TransportSetup(None, Topology(1, 1), PeerMap("ffn", 0, 1, 1), torch.device(device), 1.0, 1.0)
    plain, checked = tr.create_transport("auto", setup)
    assert plain.kind == want and checked is plain


# ------------------------------------------------------------------ the peer transport's routing (no GPU)


class _FakePlane:
    """What PeerTransport uses of a PeerPlane, recording the puts (no device)."""

    def __init__(self, topo, role, rank, spec, max_tokens, stages):
        self.topology, self.role, self.role_rank, self.spec = topo, role, rank, spec
        self.peers = topo.ffn_peers(rank) if role == FFN else topo.attention_peers(rank)
        self.max_tokens, self.num_stages = max_tokens, stages
        self.device = torch.device("cpu")
        self.timeout_ns = 10**9
        self.puts: list = []

    def put(self, stage, tensors, rows, dst_rows):
        self.puts.append((stage, len([t for t in tensors if t is not None]), list(rows), list(dst_rows)))

    def failure(self):
        return None

    def abort(self):
        pass

    def close(self):
        pass


def _schedule(topo, counts_by_stage):
    from afd_ext.metadata import AFDControlPayload
    from afd_ext.schedule import ScheduleConfig, build_step_schedule

    cfg = ScheduleConfig(num_layers=1, hidden_size=8, hidden_dtype=torch.bfloat16, router_logits_width=4,
                         send_token_ids=True)
    payload = AFDControlPayload(dp_metadata_list={s: list(c) for s, c in counts_by_stage.items()})
    return build_step_schedule(topo, payload, cfg)


def _transport(plane):
    from afd_ext.transport.base import PeerMap, TransportSetup
    from afd_ext.transport.peer import PeerTransport

    topo = plane.topology
    setup = TransportSetup(None, topo, PeerMap(plane.role, plane.role_rank, topo.A, topo.F), plane.device, 1.0, 1.0)
    return PeerTransport(setup, plane, None)


@pytest.mark.parametrize("A,F", TOPOLOGIES)
def test_every_put_lands_at_the_offsets_the_receiver_expects(A, F):
    from afd_ext.transport.base import MessageTag

    topo = Topology(A, F)
    counts = {0: [(3 * a + 2) % 7 for a in range(A)]}
    sch = _schedule(topo, counts)
    spec = _spec(8, torch.bfloat16, 4, torch.float32, True)
    for role, n in ((ATTENTION, A), (FFN, F)):
        for r in range(n):
            plane = _FakePlane(topo, role, r, spec, max_tokens=16, stages=1)
            tr = _transport(plane)
            try:
                tr.begin_step(sch)
                assert tr.step_kind == "peer"
                if role == ATTENTION:
                    plan = sch.attention_plan(0, r)
                    tensors = [torch.zeros(plan.total, 8), torch.zeros(plan.total, 4),
                               torch.zeros(plan.total, dtype=torch.int32)]
                    tr.split_back(tensors, plan.peers, plan.rows, tag=MessageTag("t", "a2f", 1, 0, 0))
                    # Independent expectation: my rows to f land after every earlier peer of f's rows to f.
                    want_dst = []
                    for f in plane.peers:
                        off = 0
                        for a in topo.ffn_peers(f):
                            if a == r:
                                break
                            off += next(c for ff, _, c in topo.split_rows(a, counts[0][a]) if ff == f)
                        want_dst.append(off)
                    want_rows = [c for _, _, c in topo.split_rows(r, counts[0][r])]
                    assert plane.puts == [(0, 3, want_rows, want_dst)]
                else:
                    plan = sch.ffn_plan(0, r)
                    tr.split_back([torch.zeros(plan.total, 8)], plan.peers, plan.rows,
                                  tag=MessageTag("t", "f2a", 1, 0, 0))
                    shares = [next((s, c) for ff, s, c in topo.split_rows(a, counts[0][a]) if ff == r)
                              for a in plane.peers]
                    assert plane.puts == [(0, 1, [c for _, c in shares], [s for s, _ in shares])]
            finally:
                tr.close()


def test_steps_beyond_capacity_go_over_the_fallback_and_without_it_are_refused():
    topo = Topology(2, 1)
    spec = _spec(8, torch.bfloat16, 4, torch.float32, True)
    plane = _FakePlane(topo, ATTENTION, 0, spec, max_tokens=4, stages=2)
    tr = _transport(plane)
    try:
        assert tr.fits(_schedule(topo, {0: [4, 4], 1: [0, 3]}))
        assert not tr.fits(_schedule(topo, {0: [4, 5]}))  # a peer's rows beyond capacity
        assert not tr.fits(_schedule(topo, {0: [1, 1], 1: [1, 1], 2: [1, 1]}))  # a third stage
        with pytest.raises(ValueError, match="does not fit the peer-memory plane"):
            tr.begin_step(_schedule(topo, {0: [9, 1]}))
    finally:
        tr.close()


def test_a_plane_is_kept_not_freed_while_an_nccl_teardown_of_its_fallback_still_runs(monkeypatch):
    # freeing the plane (cudaFree) waits for the whole device, where the overrunning NCCL abort still runs
    from afd_ext.transport import nccl
    from afd_ext.transport.peer import transport as peer_transport

    class _Fallback:
        def close(self, buffers=()):
            pass

    topo = Topology(1, 1)
    plane = _FakePlane(topo, ATTENTION, 0, _spec(8, torch.bfloat16, 4, torch.float32, True), 4, 1)
    events = []
    plane.abort, plane.close = (lambda: events.append("abort")), (lambda: events.append("close"))
    tr = _transport(plane)
    tr.fallback = _Fallback()
    monkeypatch.setattr(nccl, "pending_releases", lambda: ["ncclCommAbort (attention rank 0)"])
    monkeypatch.setattr(peer_transport, "_KEPT_PLANES", [])
    tr.close()
    assert events == ["abort"] and peer_transport._KEPT_PLANES == [plane]
    monkeypatch.setattr(nccl, "pending_releases", lambda: [])
    tr2 = _transport(plane)
    tr2.fallback = _Fallback()
    tr2.close()
    assert events == ["abort", "close"]
