"""CPU tier for afd_ext.graphs: graph keys, the per-flag decision, padding, arena, cache.

The capture/replay flow is exercised with ``EagerRecordingBackend`` (capture
records the callable, replay re-runs it), so every rule of ``GraphController``
runs here without a GPU; the real CUDA graphs are in tests/gpu/test_graphs_gpu.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_ext import graphs
from afd_ext.errors import AFDConfigError
from afd_ext.graphs import (
    EagerRecordingBackend,
    GraphBufferError,
    GraphCache,
    GraphController,
    GraphError,
    GraphKeyMismatchError,
    GraphModeError,
    StaticArena,
    StepMode,
    capture_size_for,
    decide_step_mode,
    make_graph_key,
    pad_rows_into,
)


def key(counts, **kw):
    """A key with defaults; ``counts`` is a list (one stage) or a dict stage -> list."""
    if not isinstance(counts, dict):
        counts = {0: counts}
    base = dict(num_layers=2, parts=[HIDDEN, ("f2a", "output", (16,), "bfloat16", None)])
    base.update(kw)
    return make_graph_key(counts, **base)


HIDDEN = ("a2f", "hidden", (16,), "bfloat16", None)


def payload(**flags):
    try:
        from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
    except ImportError:  # metadata.py not there yet: the rule only reads the flags
        return types.SimpleNamespace(**flags)
    return AFDControlPayload(dp_metadata_list={0: AFDDPMetadata(torch.tensor([1], dtype=torch.int32))}, **flags)


# --- the key ----------------------------------------------------------------


def test_key_keeps_per_peer_counts_not_totals():
    a, b = key([4, 4]), key([7, 1])
    assert sum(a.counts(0)) == sum(b.counts(0)) == 8
    assert a != b and hash(a) != hash(b)
    assert "stage_counts" in a.differences(b)[0]
    assert key([4, 4]) == key([4, 4]) and hash(key([4, 4])) == hash(key([4, 4]))


@pytest.mark.parametrize(
    "other",
    [
        dict(parts=[("a2f", "hidden", (16,), "float16", None), ("f2a", "output", (16,), "float16", None)]),
        dict(parts=[HIDDEN, ("a2f", "router_logits", (8,), "float32", None)]),
        dict(parts=[HIDDEN, ("a2f", "token_ids", (), "int32", None)]),
        dict(parts=[("a2f", "hidden", (32,), "bfloat16", None)]),
        dict(num_layers=3),
        dict(topology=(2, 1)),
        dict(hidden_wire="fp8_e4m3"),
    ],
)
def test_key_differs_on_every_field(other):
    base = key([2, 2])
    changed = key([2, 2], **other)
    assert base != changed
    assert len(base.differences(changed)) == 1


def test_key_stage_vector_order_and_stages():
    k = key({1: [3, 5], 0: [1, 2]})
    assert k.stages == (0, 1)
    assert k.counts(1) == (3, 5)
    with pytest.raises(AFDConfigError, match="stage 2"):
        k.counts(2)
    # Swapping which stage carries which counts is a different key.
    assert k != key({0: [3, 5], 1: [1, 2]})
    assert "stage 0: [1, 2]" in k.describe()


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    b=st.lists(st.integers(0, 9), min_size=1, max_size=4),
)
def test_key_equal_iff_counts_equal(a, b):
    assert (key(a) == key(b)) == (a == b)


# --- the decision rule ---------------------------------------------------------


@pytest.mark.parametrize(
    "flags,mode",
    [
        ({}, StepMode.EAGER),
        ({"is_warmup": True}, StepMode.WARMUP),
        ({"is_graph_capturing": True}, StepMode.CAPTURE),
        ({"is_graph_replaying": True}, StepMode.REPLAY),
        ({"is_profile": True}, StepMode.EAGER),
    ],
)
def test_one_rule_per_flag(flags, mode):
    assert decide_step_mode(payload(**flags)) is mode


def test_conflicting_flags_are_refused():
    with pytest.raises(GraphModeError, match="conflicting"):
        decide_step_mode(payload(is_warmup=True, is_graph_replaying=True))


# --- padding --------------------------------------------------------------------


@pytest.mark.parametrize("count,size", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_capture_size_for(count, size):
    assert capture_size_for(count, [1, 2, 4, 8]) == size


def test_default_capture_sizes_are_vllm_style():
    assert graphs.DEFAULT_CAPTURE_SIZES[:4] == (1, 2, 4, 8)
    assert capture_size_for(9) == 16 and capture_size_for(512) == 512 and capture_size_for(513) is None


@pytest.mark.parametrize("sizes", [[], [0, 1], [2, 1], [1, 1], [1.5]])
def test_capture_sizes_validated(sizes):
    with pytest.raises(ValueError):
        capture_size_for(1, sizes)


def _pad(counts, sizes):
    """``schedule.pad_sizes`` (the one padding rule) for per-stage per-attention-rank ``counts`` at ``A x 1``."""
    from afd_ext.metadata import AFDControlPayload
    from afd_ext.schedule import pad_sizes
    from afd_ext.topology import Topology

    A = len(next(iter(counts.values())))
    return pad_sizes(Topology(A, 1), AFDControlPayload(dp_metadata_list={s: list(c) for s, c in counts.items()}), sizes)


def test_padding_pads_every_peer_per_stage():
    assert _pad({0: [3, 0], 1: [7, 1]}, [1, 2, 4, 8]) == {0: 4, 1: 8}
    assert _pad({0: [0, 0]}, [1, 2]) == {0: 1}
    assert _pad({0: [1, 9]}, [1, 2, 4, 8]) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 64), min_size=1, max_size=6))
def test_padded_counts_hold_every_peer_and_are_capture_sizes(counts):
    sizes = [1, 2, 4, 8, 16, 32, 64]
    padded = _pad({0: counts}, sizes)[0]
    assert padded in sizes
    assert all(padded >= c for c in counts)
    smaller = [s for s in sizes if s < padded]
    assert not smaller or max(counts) > smaller[-1]


def test_pad_rows_into_copies_and_zeroes_padding():
    dst = torch.full((4, 3), 7.0)
    src = torch.arange(6.0).reshape(2, 3)
    view = pad_rows_into(src, dst)
    assert torch.equal(view, src) and view.data_ptr() == dst.data_ptr()
    assert torch.equal(dst[2:], torch.zeros(2, 3))
    with pytest.raises(AFDConfigError, match="larger capture size"):
        pad_rows_into(torch.zeros(5, 3), dst)
    with pytest.raises(AFDConfigError, match="dtype"):
        pad_rows_into(torch.zeros(1, 3, dtype=torch.float64), dst)


# --- static arena ----------------------------------------------------------------


def test_arena_returns_same_buffer_and_refuses_changes():
    arena = StaticArena("cpu", label="test")
    t = arena.buffer(("fan_in", 0), (4, 8), torch.float32)
    assert arena.buffer(("fan_in", 0), (4, 8), torch.float32) is t
    assert torch.count_nonzero(t) == 0
    assert arena.nbytes == 4 * 8 * 4
    with pytest.raises(GraphBufferError, match="cannot change shape"):
        arena.buffer(("fan_in", 0), (5, 8), torch.float32)
    arena.freeze()
    with pytest.raises(GraphBufferError, match="not reserved before capture"):
        arena.buffer("reply", (4, 8), torch.float32)
    assert arena.buffer(("fan_in", 0), (4, 8), torch.float32) is t


def test_arena_detects_moved_buffer():
    arena = StaticArena("cpu")
    t = arena.buffer("x", (2, 2), torch.float32)
    arena.check_stable()
    t.set_(torch.zeros(2, 2))  # same shape, new storage: what a reallocation looks like
    with pytest.raises(GraphBufferError, match="moved"):
        arena.check_stable()


def test_arena_detects_resize():
    arena = StaticArena("cpu")
    t = arena.buffer("x", (2, 2), torch.float32)
    t.resize_(64, 64)
    with pytest.raises(GraphBufferError, match="'x'"):
        arena.check_stable()


# --- the cache ---------------------------------------------------------------------


def _entry(k, backend, nbytes_rows=4):
    arena = StaticArena("cpu", label=k.describe())
    arena.buffer("buf", (nbytes_rows, 4), torch.float32)
    arena.freeze()
    return graphs.CapturedGraph(k, (lambda: None,), arena, None, backend)


def test_cache_lru_eviction_releases_graph_and_buffers_together():
    backend = EagerRecordingBackend()
    cache = GraphCache(2)
    e1, e2, e3 = (_entry(key([n]), backend) for n in (1, 2, 4))
    assert cache.put(e1) == [] and cache.put(e2) == []
    assert cache.get(e1.key) is e1  # e1 becomes most recently used
    assert cache.put(e3) == [e2.key]
    assert e2.released and e2.arena.nbytes == 0 and e2.graphs == ()
    assert not e1.released and e1.key in cache and e3.key in cache
    assert (len(cache), cache.evictions) == (2, 1)
    with pytest.raises(GraphError, match="released"):
        e2.replay()


def test_cache_evict_releases_the_entry():
    backend = EagerRecordingBackend()
    cache = GraphCache(1)
    e1 = _entry(key([1]), backend)
    cache.put(e1)
    assert cache.evict(e1.key) and e1.released and backend.released == 1
    assert not cache.evict(e1.key)


def test_cache_size_validated():
    with pytest.raises(ValueError, match="cache size"):
        GraphCache(0)


# --- the controller ----------------------------------------------------------------


def _controller(cache_size=4, **kw):
    return GraphController(role="ffn", cache_size=cache_size, backend=EagerRecordingBackend(), device="cpu", **kw)


def _capture_doubler(ctl, k, rows):
    """Capture a body that doubles the static input into the static output."""
    arena = ctl.new_arena(k)
    x = arena.buffer("x", (rows, 2), torch.float32)
    y = arena.buffer("y", (rows, 2), torch.float32)

    def body():
        torch.mul(x, 2, out=y)
        return y

    return ctl.capture(k, arena, body), x, y


def test_replay_refused_when_key_not_captured():
    ctl = _controller()
    ctl.warmed_up = True
    assert ctl.decide(payload(is_graph_capturing=True), key([4, 4])) is StepMode.CAPTURE
    _capture_doubler(ctl, key([4, 4]), 8)
    # [7, 1] has the same total as [4, 4]: the FFN side must not replay [4, 4] for it.
    with pytest.raises(GraphKeyMismatchError, match=r"\[7, 1\].*closest.*\[4, 4\]"):
        ctl.decide(payload(is_graph_replaying=True), key([7, 1]))
    with pytest.raises(GraphKeyMismatchError):
        ctl.replay(key([7, 1]))
    assert ctl.backend.replays == 0
    assert ctl.decide(payload(is_graph_replaying=True), key([4, 4])) is StepMode.REPLAY
    assert ctl.decide(payload(), key([7, 1])) is StepMode.EAGER


def test_graphs_of_old_links_are_dropped_when_the_connector_was_reinitialised(monkeypatch):
    """Issue 45: a graph holds the communicators and peer buffers of the generation it was captured in; after a
    re-init (AFDConnector.links_id changes: e.g. to meet a restarted peer) it is dropped, never replayed, and
    a capture waits for the new links' warm-up unless init warmed them."""
    from types import SimpleNamespace

    from afd_ext.integrations import graph_runners

    ctl = _controller()
    ctl.follow(1, True)
    assert ctl.warmed_up and ctl.links == 1
    _capture_doubler(ctl, key([4, 4]), 8)
    ctl.follow(1, True)  # the same links: kept
    assert ctl.decide(payload(is_graph_replaying=True), key([4, 4])) is StepMode.REPLAY
    ctl.follow(2, False)
    assert len(ctl.cache) == 0 and not ctl.warmed_up
    with pytest.raises(GraphKeyMismatchError, match="no graph captured yet"):
        ctl.decide(payload(is_graph_replaying=True), key([4, 4]))
    with pytest.raises(GraphModeError, match="warm-up"):
        ctl.decide(payload(is_graph_capturing=True), key([4, 4]))
    # The FFN runner follows the connector's links before every decision.
    conn = SimpleNamespace(device=torch.device("cpu"), warmup_on_init=True, links_id=1)
    monkeypatch.setattr(graph_runners, "_step_key", lambda c, p: (key([4, 4]), None))
    srv = graph_runners.FFNGraphServer(SimpleNamespace(connector=conn), cache_size=2,
                                       backend=EagerRecordingBackend())
    srv.ctl.follow(1, True)
    _capture_doubler(srv.ctl, key([4, 4]), 8)
    conn.links_id = 2  # close(); init_afd_connector()
    with pytest.raises(GraphKeyMismatchError):
        srv.serve_step(payload(is_graph_replaying=True))
    assert srv.ctl.backend.replays == 0 and len(srv.ctl.cache) == 0


def test_capture_refused_before_warmup_with_rows_on_every_peer():
    ctl = _controller()
    with pytest.raises(GraphModeError, match="warm-up"):
        ctl.decide(payload(is_graph_capturing=True), key([2, 2]))
    ctl.note_eager_step(StepMode.WARMUP, _schedule({0: [2, 0]}), 0)  # a cold edge stays cold
    with pytest.raises(GraphModeError, match="warm-up"):
        ctl.decide(payload(is_graph_capturing=True), key([2, 2]))
    ctl.note_eager_step(StepMode.EAGER, _schedule({0: [2, 2]}), 0)  # an eager step is not a warm-up
    assert not ctl.warmed_up
    ctl.note_eager_step(StepMode.WARMUP, _schedule({0: [2, 2]}), 0)
    assert ctl.decide(payload(is_graph_capturing=True), key([2, 2])) is StepMode.CAPTURE
    with pytest.raises(GraphModeError, match="needs the step's graph key"):
        ctl.decide(payload(is_graph_replaying=True))


def test_capture_then_replay_with_fresh_inputs_and_stable_addresses():
    ctl = _controller()
    ctl.warmed_up = True
    entry, x, y = _capture_doubler(ctl, key([2, 2]), 4)
    assert ctl.backend.captures == 1 and ctl.backend.replays == 0  # capture executes nothing
    addresses = entry.arena.addresses()
    for step in range(5):
        fresh = torch.randn(3, 2)
        pad_rows_into(fresh, x)
        # An eager step with other sizes between replays uses its own buffers.
        eager = torch.randn(1000, 2) * 2
        out = ctl.replay(key([2, 2]))
        assert out is y and torch.equal(out[:3], fresh * 2) and torch.equal(out[3:], torch.zeros(1, 2))
        assert eager.shape == (1000, 2)
    assert entry.replays == 5 and entry.arena.addresses() == addresses


def test_an_entry_captured_in_parts_replays_the_part_asked_for_and_refuses_none():
    ctl = _controller()
    ctl.warmed_up = True
    arena = ctl.new_arena(key([2]))
    x = arena.buffer("x", (2, 2), torch.float32)
    y = arena.buffer("y", (2, 2), torch.float32)
    ctl.capture_parts(key([2]), arena, [lambda: torch.mul(x, 2, out=y), lambda: torch.add(y, 1, out=y)], outputs=y)
    x.copy_(torch.ones(2, 2))
    # Part 0 alone would be only the first layer: an entry in parts needs its part (was: part 0, silently).
    for bad in (None, 2, -1, "0"):
        with pytest.raises(GraphError, match=r"has 2 parts: pass part=0\.\.1"):
            ctl.replay(key([2]), **({} if bad is None else {"part": bad}))
    assert ctl.backend.replays == 0
    ctl.replay(key([2]), part=0)
    assert torch.equal(ctl.replay(key([2]), part=1), torch.full((2, 2), 3.0))


def test_replay_refused_when_a_buffer_moved():
    ctl = _controller()
    entry, x, _ = _capture_doubler(ctl, key([1]), 1)
    x.set_(torch.zeros(1, 2))
    with pytest.raises(GraphBufferError, match="'x'"):
        ctl.replay(key([1]))
    assert ctl.backend.replays == 0


class _CapturingBackend(EagerRecordingBackend):
    """Capture runs the body once, so a body that allocates inside capture is caught."""

    def capture(self, body, pool):
        self.captures += 1
        return body, body(), 0


def test_capture_refuses_a_body_that_asks_for_a_new_buffer():
    ctl = GraphController(role="attention", cache_size=2, backend=_CapturingBackend(), device="cpu")
    arena = ctl.new_arena(key([1]))
    with pytest.raises(GraphBufferError, match="not reserved before capture"):
        ctl.capture(key([1]), arena, lambda: arena.buffer("late", (1,), torch.float32))
    assert key([1]) not in ctl.cache


def test_controller_evicts_lru():
    ctl = _controller(cache_size=2)
    entries = [_capture_doubler(ctl, key([n]), n)[0] for n in (1, 2, 4)]
    assert entries[0].released and not entries[1].released and not entries[2].released
    assert ctl.backend.released == 1
    assert len(ctl.cache) == 2 and ctl.cache.evictions == 1
    assert sum(e.arena.nbytes for e in entries[1:]) == 2 * (2 + 4) * 2 * 4
    with pytest.raises(GraphKeyMismatchError, match="no graph was captured"):
        ctl.replay(key([1]))
    # Recapturing a key replaces (and releases) the old entry.
    old = entries[2]
    new, _, _ = _capture_doubler(ctl, key([4]), 4)
    assert old.released and ctl.entry(key([4])) is new
    ctl.close()
    assert new.released and len(ctl.cache) == 0
    ctl.close()


def test_controller_arguments_validated():
    with pytest.raises(ValueError, match="role"):
        GraphController(role="moe", cache_size=1, backend=EagerRecordingBackend(), device="cpu")
    with pytest.raises(ValueError, match="cache size"):
        GraphController(role="ffn", cache_size=0, backend=EagerRecordingBackend(), device="cpu")
    with pytest.raises(ValueError, match="increasing"):
        GraphController(role="ffn", cache_size=1, backend=EagerRecordingBackend(), device="cpu", capture_sizes=[4, 2])
    ctl = _controller()
    with pytest.raises(GraphBufferError, match="arena is on"):
        ctl.capture(key([1]), StaticArena("meta"), lambda: None)


# --- with the real schedule ----------------------------------------------------------

schedule_mod = pytest.importorskip("afd_ext.schedule")
topology_mod = pytest.importorskip("afd_ext.topology")


def _schedule(counts, A=2, F=1, pad=None, **cfg):
    from afd_ext.metadata import AFDControlPayload

    base = dict(num_layers=2, hidden_size=16, hidden_dtype=torch.bfloat16)
    base.update(cfg)
    config = schedule_mod.ScheduleConfig(pad_to=pad, **base)
    payload = AFDControlPayload(dp_metadata_list={s: list(c) for s, c in counts.items()})
    return schedule_mod.build_step_schedule(topology_mod.Topology(A, F), payload, config)


def test_key_from_schedule_uses_per_peer_rows():
    k44 = graphs.graph_key_from_schedule(_schedule({0: [4, 4]}))
    k71 = graphs.graph_key_from_schedule(_schedule({0: [7, 1]}))
    assert k44 != k71 and k44.counts(0) == (4, 4) and k44.topology == (2, 1, 1)
    # Under padding the key is the padded vector: any real counts up to it share the graph.
    p1 = graphs.graph_key_from_schedule(_schedule({0: [3, 0]}, pad={0: 4}))
    p2 = graphs.graph_key_from_schedule(_schedule({0: [1, 4]}, pad={0: 4}))
    assert p1 == p2 == k44
    kl = graphs.graph_key_from_schedule(
        _schedule({0: [4, 4]}, router_logits_width=8, send_token_ids=True)
    )
    assert {("a2f", "router_logits", (8,), "float32", None), ("a2f", "token_ids", (), "int32", None)} <= set(kl.parts)
    assert kl != k44


def test_a_declared_part_changes_the_key():
    from afd_ext import wire

    before = graphs.graph_key_from_schedule(_schedule({0: [4, 4]}))
    assert [p[:2] for p in before.parts] == [("a2f", "hidden"), ("f2a", "output")]
    wire.declare_part("topk_ids", dtype=torch.int32, cols=(3,))
    try:
        after = graphs.graph_key_from_schedule(_schedule({0: [4, 4]}))
    finally:
        wire.remove_part("topk_ids")
    assert after != before and ("a2f", "topk_ids", (3,), "int32", None) in after.parts
    assert after.differences(before) == [f"parts: {after.parts!r} != {before.parts!r}"]
    assert graphs.graph_key_from_schedule(_schedule({0: [4, 4]})) == before  # the part removed, the key back


def test_cold_edges_and_warmup_from_schedule():
    sched = _schedule({0: [2, 0], 1: [0, 0]}, A=2, F=1)
    assert graphs.cold_edges(sched, "ffn", 0) == [(1, 0)]
    assert graphs.cold_edges(sched, "attention", 0) == []
    ctl = _controller()
    ctl.note_eager_step(StepMode.WARMUP, sched, 0)
    assert not ctl.warmed_up
    warm = schedule_mod.build_step_schedule(
        topology_mod.Topology(1, 2), schedule_mod.warmup_payload(topology_mod.Topology(1, 2)),
        schedule_mod.ScheduleConfig(num_layers=1, hidden_size=4, hidden_dtype=torch.float32),
    )
    assert graphs.cold_edges(warm, "attention", 0) == []
    ctl.note_eager_step(StepMode.WARMUP, warm, 0)
    assert ctl.warmed_up


def test_reserve_buffers_at_captured_capacity():
    sched = _schedule({0: [3, 0], 1: [2, 2]}, pad={0: 4, 1: 2}, router_logits_width=8, send_token_ids=True)
    arena = StaticArena("cpu")

    def reserve_ffn():
        return {s: schedule_mod.stage_buffers(arena.buffer, sched.config, s, sched.ffn_rows(s, 0), ("output",),
                                              fan_in=True) for s in sched.stages}

    ffn = reserve_ffn()
    assert ffn[0]["hidden"].shape == (8, 16) and ffn[1]["output"].shape == (4, 16)
    assert ffn[0]["router_logits"].shape == (8, 8) and ffn[0]["token_ids"].dtype == torch.int32
    att = schedule_mod.stage_buffers(StaticArena("cpu").buffer, sched.config, 0, sched.attention_rows(0, 1), ("reply",))
    assert att["hidden"].shape == (4, 16) and att["reply"].shape == (4, 16)
    # Reserving again returns the very same tensors (the arena never reallocates).
    again = reserve_ffn()
    assert all(again[s][n] is ffn[s][n] for s in ffn for n in ffn[s])


# --- the GPU tier's scripts, run on CPU ------------------------------------------------
#
# tests/gpu/test_graphs_gpu.py drives both roles through scripted steps (warm-up,
# capture, replays with fresh inputs, eager steps of other sizes, refused replays).
# Here the same scripts run with every rank in a thread, queues standing in for
# NCCL and the recording backend standing in for CUDA graphs, so the protocol —
# decisions, keys, padding, buffers, what comes back — is checked in CI too.

import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402


def _gpu_module():
    path = pathlib.Path(__file__).parent / "gpu" / "test_graphs_gpu.py"
    spec = importlib.util.spec_from_file_location("_graphs_gpu_scripts", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class _QueueOps:
    """split_back / fan_in over in-process FIFO queues (one per communicator)."""

    def __init__(self, queues, corrupt=()):
        self.q = queues
        self.corrupt = set(corrupt)  # communicators whose messages arrive with their rows reversed

    def split_back(self, tensors, comms, peers, rows):
        off = 0
        for c, r in zip(comms, rows):
            if r:
                msg = tuple(x[off:off + r].clone() for x in tensors)
                if c in self.corrupt:
                    msg = tuple(x.flip(0) for x in msg)
                self.q[c].put(msg)
            off += r

    def fan_in(self, tensors, comms, peers, rows):
        off = 0
        for c, r in zip(comms, rows):
            if r:
                got = self.q[c].get(timeout=30)
                assert len(got) == len(tensors), "the wire parts differ between the roles"
                for dst, src in zip(tensors, got):
                    assert src.shape[0] == r and src.dtype == dst.dtype, (tuple(src.shape), r, src.dtype)
                    dst[off:off + r].copy_(src)
            off += r


def _run_gpu_script_on_cpu(mod, setup, script, corrupt_replies=False):
    pytest.importorskip("afd_ext.ops")
    topo = topology_mod.Topology(setup.A, setup.F)
    handles, queues = {}, {}
    for a, f in topo.edges():
        for d in ("a2f", "f2a"):
            handles[(a, f, d)] = len(handles)
            queues[handles[(a, f, d)]] = queue.Queue()

    class Ctx(mod._Ctx):
        def __init__(self, rank):  # no NCCL: queues and the recording backend
            corrupt = [h for (a, f, d), h in handles.items() if d == "f2a"] if corrupt_replies else ()
            self.ops, self.graphs, self.setup, self.topo = _QueueOps(queues, corrupt), graphs, setup, topo
            self.role, self.rr = ("ffn", rank) if rank < setup.F else ("attention", rank - setup.F)
            self.device, self.comms = torch.device("cpu"), handles
            self.ctl = GraphController(role=self.role, cache_size=8, backend=EagerRecordingBackend(),
                                       device="cpu", capture_sizes=mod.CAPTURE_SIZES)

    n = setup.A + setup.F
    reports, errors = [None] * n, []

    def go(rank):
        try:
            reports[rank] = mod.run_script(Ctx(rank), setup, script)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((rank, repr(e)))

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(r is not None for r in reports), "a rank did not finish"
    for r in reports:
        assert not r["failures"], r["failures"][:5]
    return reports


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,A,F,stages", [
    ("mismatch", 2, 1, 1), ("big_eager", 2, 1, 1), ("zero_peer", 2, 1, 2), ("sizes", 2, 1, 2),
])
def test_gpu_scripts_pass_on_cpu(script, A, F, stages):
    mod = _gpu_module()
    setup = mod.Setup(A, F, stages=stages)
    reports = _run_gpu_script_on_cpu(mod, setup, script)
    ffn = reports[0]
    expected_replays = {"mismatch": 3, "big_eager": 7, "zero_peer": 3, "sizes": 4 * mod.REPLAYS}[script]
    assert all(r["replays"] == expected_replays for r in reports)
    assert sum(ffn["entry_replays"].values()) == expected_replays
    if script == "mismatch":
        assert all(r["refused"] == 1 for r in reports)


def test_gpu_script_catches_a_wrong_reply():
    """The scripts can fail: an FFN that replies with the wrong rows is reported by the attention side."""
    mod = _gpu_module()
    with pytest.raises(AssertionError, match="max diff"):
        _run_gpu_script_on_cpu(mod, mod.Setup(2, 1), "mismatch", corrupt_replies=True)


# --- the demo's --graph mode, end to end on CPU --------------------------------------------


@pytest.mark.timeout(400)
def test_demo_graph_mode_on_cpu_matches_whole_model():
    """``afd-ext demo --graph`` over gloo: the graph protocol (pad, warm-up, capture, replay) on both roles.

    On CPU the recording backend re-runs the captured exchanges instead of a CUDA
    graph, so this checks the protocol and its bookkeeping; tests/gpu checks graphs.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("afd_ext.connector")
    from afd_ext.tools import demo

    plan = demo.build_plan(demo.parse_args([
        "--dims", "tiny", "--backend", "gloo", "--no-progress", "--topology", "2A1F",
        "--requests-per-rank", "2", "--max-new-tokens", "5", "--stages", "2", "--graph",
    ]))
    s = demo.run_demo(plan, timeout_s=300)
    assert s["self_check"]["ok"], "\n".join(s["self_check"]["failures"])
    assert s["graph"] is True
    modes = s["ffn_graph_modes"][0]
    # Every step fits the capture sizes here (two stages halve the prefill) and replays;
    # each new padded shape first gets one warm-up and one capture step, on both roles.
    assert modes["replay"] == s["steps"] and modes["eager"] == 0
    assert modes["capture"] == modes["warmup"] == 2  # the prefill's padded shape and the decode steps'
    # Padding rows travel and are served: more FFN rows than real tokens.
    layers = s["model"]["layers"]
    assert s["ffn_rows_served"][0] > layers * sum(sum(c) for c in s["step_counts"])


def test_replays_are_handed_to_the_transport():
    """Every replay goes to the transport's track_replay (the NCCL watchdog: tests/test_nccl_lifecycle.py
    shows a stuck one becoming the named error); a connector without a transport is left alone."""
    from afd_ext.connector import AFDConnector
    from afd_ext.transport.base import MessageTag

    seen = []

    class Tracking:
        def track_replay(self, what, tag):
            seen.append((what, tag))

    from afd_ext.connector.session import Session

    conn = object.__new__(AFDConnector)  # only the session the hook reads
    conn._s = Session("attention rank 0 (world rank 1)", "attention", False, None)
    conn._s.transport, conn._s.step_counter = Tracking(), 5
    conn.track_graph_replay("CUDA-graph replay of layer 2")
    assert seen == [("CUDA-graph replay of layer 2", MessageTag("graph replay", "a2f", 5, -1, -1))]
    conn._s.transport = None  # not initialised: nothing to follow
    conn.track_graph_replay("CUDA-graph replay of layer 3")
    assert len(seen) == 1
