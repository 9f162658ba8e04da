"""NcclTransport setup and teardown on the CPU, against a fake NCCL (no GPU needed).

The fake's ``comm_create`` blocks until both ranks of a unique id joined (like
a blocking ``ncclCommInitRank``); its ``comm_abort`` can be made to wait for
another communicator's abort, which is what a real abort does when the kernels
of one NCCL group over several communicators share a stream (the GPU hang of
the mid-step-failure re-init test). Ranks are threads of this process sharing
one real rendezvous store.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd_ext import ops
from afd_ext.health import POST_ABORT_WAIT_S
from afd_ext import rendezvous as rdzv
from afd_ext.tools.testing import find_free_port
from afd_ext.topology import Topology
from afd_ext.transport import nccl as nccl_mod
from afd_ext.transport.base import AFDTransportClosedError, PeerMap
from afd_ext.transport.nccl import NcclTransport

pytestmark = pytest.mark.timeout(120)


class FakeNccl:
    """Communicator table + blocking init, recording every management call."""

    def __init__(self):
        self.cond = threading.Condition()
        self.joined: dict[bytes, set[int]] = {}
        self.next = 1
        self.owner: dict[int, bytes] = {}
        self.aborted: list[int] = []
        self.destroyed: list[int] = []
        self.abort_hooks: dict[int, callable] = {}
        self.stop = threading.Event()  # ends blocked inits at test teardown

    def nccl_unique_id(self, out=None):
        with self.cond:
            n = self.next
            self.next += 1
        return torch.tensor(list(n.to_bytes(8, "little")) * 16, dtype=torch.uint8)

    def comm_create(self, uid, size, rank, device):
        key = bytes(uid.numpy().tobytes())
        with self.cond:
            self.joined.setdefault(key, set()).add(rank)
            self.cond.notify_all()
            while len(self.joined[key]) < size:
                if self.stop.is_set():
                    raise RuntimeError("fake NCCL: test over")
                self.cond.wait(0.05)
            h = self.next
            self.next += 1
            self.owner[h] = key
            return h

    def comm_abort(self, h):
        hook = self.abort_hooks.get(h)
        if hook is not None:
            hook()
        with self.cond:
            self.aborted.append(h)

    def comm_destroy(self, h):
        with self.cond:
            self.destroyed.append(h)

    def comm_async_error(self, h):
        return 0


@pytest.fixture
def fake(monkeypatch):
    f = FakeNccl()
    for name in ("nccl_unique_id", "comm_create", "comm_abort", "comm_destroy", "comm_async_error"):
        monkeypatch.setattr(ops, name, getattr(f, name))
    yield f
    f.stop.set()
    rdzv.forget_cached_stores()  # the stores' servers live in this process


def _build(A: int, F: int, port: int, world_rank: int, *, init_timeout_s: float = 20.0, timeout_s: float = 5.0,
           **hooks):
    topo = Topology(A, F, 1)
    role = "ffn" if world_rank < F else "attention"
    rr = world_rank if role == "ffn" else world_rank - F
    store = rdzv.connect("127.0.0.1", port, world_rank, A + F, timeout_s=init_timeout_s, num_ffn_ranks=F)
    return NcclTransport(store, topo, PeerMap(role, rr, A, F), torch.device("cuda", 0),
                         timeout_s=timeout_s, init_timeout_s=init_timeout_s, **hooks)


def _build_all(A: int, F: int, ranks=None, **kw):
    """Build the transports of ``ranks`` (default all) in threads; returns {rank: transport or exception}."""
    port = find_free_port()
    out: dict[int, object] = {}

    def one(r):
        try:
            out[r] = _build(A, F, port, r, **kw)
        except BaseException as e:  # noqa: BLE001
            out[r] = e

    ths = [threading.Thread(target=one, args=(r,)) for r in (ranks if ranks is not None else range(A + F))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not any(t.is_alive() for t in ths), "transport init hung"
    return out


def test_init_pairs_every_edge_and_healthy_close_destroys(fake):
    out = _build_all(2, 2)
    assert all(isinstance(t, NcclTransport) for t in out.values()), out
    edges = Topology(2, 2, 1).edges()
    for t in out.values():
        # one communicator per (edge, direction) of this rank; both ends got the same one
        me = t.peers.role_rank
        mine = {(a, f, d) for a, f in edges for d in ("a2f", "f2a")
                if (a if t.peers.role == "attention" else f) == me}
        assert set(t._comms) == mine
        for (a, f, d), h in t._comms.items():
            other = out[2 + a] if t.peers.role == "ffn" else out[f]
            assert fake.owner[other._comms[(a, f, d)]] == fake.owner[h]
    handles = [h for t in out.values() for h in t._comms.values()]
    for t in out.values():
        t.close()
        t.close()  # idempotent
    assert sorted(fake.destroyed) == sorted(handles) and fake.aborted == []
    with pytest.raises(AFDTransportClosedError):
        out[0].check_health()


def test_abort_is_concurrent_so_a_cross_communicator_wait_cannot_deadlock(fake):
    """Aborting communicator X waits until communicator Y's abort started (shared stream): sequential
    aborts would wait for the 10 s safety; concurrent ones finish at once."""
    out = _build_all(2, 1)
    ffn = out[0]
    x, y = ffn._comms[(0, 0, "a2f")], ffn._comms[(1, 0, "a2f")]
    y_started = threading.Event()
    fake.abort_hooks[y] = y_started.set
    fake.abort_hooks[x] = lambda: y_started.wait(10.0)
    t0 = time.monotonic()
    ffn.abort("test")
    assert time.monotonic() - t0 < 5.0
    assert y_started.is_set() and x in fake.aborted and y in fake.aborted
    assert nccl_mod.pending_releases() == []
    for t in out.values():
        t.close()
    assert x not in fake.destroyed and y not in fake.destroyed


def test_close_with_stuck_work_aborts_within_its_bound(fake, monkeypatch):
    monkeypatch.setattr(nccl_mod, "RELEASE_TIMEOUT_S", 0.5)
    out = _build_all(1, 1)
    att = out[1]
    mine = sorted(att._comms.values())
    att.watchdog.track(lambda: False, "recv_ffn_output: fan-in receive", peers=["FFN rank 0"], layer=0, stage=0)
    t0 = time.monotonic()
    att.close()
    assert time.monotonic() - t0 < 3.0  # drain bound (0.5 s) + abort
    assert sorted(fake.aborted) == mine and fake.destroyed == []
    out[0].close()


def test_a_rank_that_never_joins_is_a_named_timeout_and_peers_hear_of_it(fake):
    """Attention rank 1 never starts: FFN rank 0 times out in the init of a2f a1-f0 naming it, posts the
    abort; attention rank 0 (whose communicators come first) initialises fine."""
    t0 = time.monotonic()
    out = _build_all(2, 1, ranks=[0, 1], init_timeout_s=2.0)
    assert time.monotonic() - t0 < 10.0
    err = out[0]
    assert isinstance(err, rdzv.RendezvousTimeoutError), err
    assert "attention rank 1" in str(err) and "a2f a1-f0" in str(err) and err.missing == (2,)
    assert isinstance(out[1], NcclTransport)
    # the FFN aborted what it had created (edge 0), and posted the abort for the peers
    assert len(fake.aborted) == 2
    store = out[1]._store
    assert "NCCL transport init failed on FFN rank 0" in (rdzv.check_abort(store) or "")
    out[1].close()


def test_an_overrunning_abort_is_named_and_blocks_the_next_init(fake, monkeypatch):
    monkeypatch.setattr(nccl_mod, "RELEASE_TIMEOUT_S", 0.3)
    out = _build_all(1, 1)
    release = threading.Event()
    h = out[0]._comms[(0, 0, "a2f")]
    fake.abort_hooks[h] = lambda: release.wait(20.0)
    out[0].abort("test")  # returns after its bound although one abort is still running
    left = nccl_mod.pending_releases()
    assert len(left) == 1 and "ncclCommAbort of a2f a0-f0" in left[0] and "FFN rank 0" in left[0]
    with pytest.raises(RuntimeError, match="still running"):
        _build(1, 1, find_free_port(), 0, init_timeout_s=0.2)
    release.set()
    deadline = time.monotonic() + 5
    while nccl_mod.pending_releases() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nccl_mod.pending_releases() == []
    out[1].close()


class _Signal:
    """Stands in for the transport's AbortSignal: ``post`` calls ``fn`` (the other methods are unused here)."""

    def __init__(self, fn):
        self.post = fn


class _NeverEvent:
    """Stands in for a CUDA event whose stream never gets there."""

    def query(self) -> bool:
        return False


def test_a_stuck_synchronize_names_the_oldest_exchange_not_layer_minus_one(fake):
    """The host wait of synchronize() starts a little after the fan-in it waits behind; the error must
    be the fan-in's (op, peers, layer, stage), whoever's clock runs out first (the GPU race)."""
    from afd_ext.transport.base import AFDTimeoutError, MessageTag

    out = _build_all(2, 1, timeout_s=0.4)
    ffn = out[0]
    posted = []
    ffn._signal = _Signal(posted.append)
    fan_in = MessageTag("recv_attn_output", "a2f", 3, 1, 0)
    ffn.watchdog.track(lambda: False, "recv_attn_output: receive (fan-in)",
                       peers=["attention rank 0 (world rank 1)", "attention rank 1 (world rank 2)"],
                       layer=1, stage=0, where=fan_in.where(), tag=fan_in, peer_ranks=[1, 2])
    t0 = time.monotonic()
    with pytest.raises(AFDTimeoutError) as ei:
        ffn.wait_event(_NeverEvent(), "wait for every exchange issued", ["attention rank 0 (world rank 1)"],
                       MessageTag("synchronize", "a2f", 3, -1, -1), [1])
    assert time.monotonic() - t0 < 0.4 + nccl_mod.WAIT_BACKSTOP_S
    err = ei.value
    assert (err.layer, err.stage) == (1, 0) and "recv_attn_output: receive (fan-in)" in str(err), err
    assert "layer -1" not in str(err) and "attention rank 1 (world rank 2)" in str(err)
    deadline = time.monotonic() + 5  # the watchdog thread posts it right after recording the failure
    while not posted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert posted == [err]  # the abort signal was posted with this error
    for t in out.values():
        t.close()


class _DoneEvent:
    """Stands in for a CUDA event already complete (here: because an abort ended the NCCL kernels)."""

    def query(self) -> bool:
        return True


def test_a_wait_ended_by_an_abort_raises_the_recorded_failure(fake):
    """Aborting the communicators ends their kernels, so the event of a receive completes with nothing
    received: the wait must raise the watchdog's failure, not return (a strict-mode header fan-in then
    read an unfilled buffer and reported a header mismatch instead of the step abort; GPU run 71)."""
    from afd_ext.transport.base import AFDTimeoutError, MessageTag

    out = _build_all(1, 1)
    ffn = out[0]
    ffn._signal = _Signal(lambda exc: None)
    failure = AFDTimeoutError("attention rank 0 (world rank 1) stalled")
    ffn.watchdog.fail(failure)
    with pytest.raises(AFDTimeoutError) as ei:
        ffn.wait_event(_DoneEvent(), "receive (fan-in)", ["attention rank 0 (world rank 1)"],
                       MessageTag("recv_attn_output", "a2f", 3, 1, 0), [1])
    assert ei.value is failure
    for t in out.values():
        t.close()


def test_watchdog_failure_posts_the_abort_before_aborting_the_communicators(fake):
    """Aborting releases the sends queued behind a stuck fan-in; a peer receiving one must already
    find the abort posted (its synchronize() then ends the step with the error)."""
    from afd_ext.transport.base import AFDTimeoutError

    out = _build_all(1, 1)
    ffn = out[0]
    order = []
    ffn._signal = _Signal(lambda exc: order.append("post"))
    for h in ffn._comms.values():
        fake.abort_hooks[h] = lambda: order.append("abort")
    ffn.watchdog.fail(AFDTimeoutError("fan-in stuck"))
    assert order and order[0] == "post" and order.count("abort") == 2, order
    # a post that hangs (store host gone) delays the aborts by POST_ABORT_WAIT_S at most
    att = out[1]
    release = threading.Event()
    att._signal = _Signal(lambda exc: release.wait(10))
    t0 = time.monotonic()
    att.watchdog.fail(AFDTimeoutError("reply stuck"))
    assert time.monotonic() - t0 < POST_ABORT_WAIT_S + 2.0
    assert all(h in fake.aborted for h in (att._comms or {}).values()) and len(fake.aborted) == 4
    release.set()
    for t in out.values():
        t.close()


def test_a_stuck_graph_replay_is_the_watchdogs_named_error(fake, monkeypatch):
    """A CUDA-graph replay holds NCCL work with every peer; tracked like an eager group, a peer
    that never answers during a replay becomes a named timeout (and the abort), not a hang."""
    from afd_ext.transport.base import AFDTimeoutError, MessageTag

    class StuckEvent(_NeverEvent):
        def record(self, *a, **k):
            pass

    monkeypatch.setattr(torch.cuda, "Event", StuckEvent)
    monkeypatch.setattr(nccl_mod, "_capturing", lambda: False)
    out = _build_all(2, 1, timeout_s=0.4)
    ffn = out[0]
    posted = []
    ffn._signal = _Signal(posted.append)
    ffn.track_replay("CUDA-graph replay of step 7 (4 layers)", MessageTag("graph replay", "a2f", 7, -1, -1))
    deadline = time.monotonic() + 5
    while ffn.watchdog.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(AFDTimeoutError) as ei:
        ffn.check_health()
    msg = str(ei.value)
    assert "graph replay: CUDA-graph replay of step 7" in msg, msg
    assert "attention rank 0 (world rank 1)" in msg and "attention rank 1 (world rank 2)" in msg, msg
    assert "layer -1" not in msg and "step 7" in msg, msg
    # The signal and the communicator aborts follow the failure on the watchdog's thread: wait for both.
    while not (posted and all(h in fake.aborted for h in ffn._comms.values())) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert posted and posted[0] is ffn.watchdog.failure
    assert all(h in fake.aborted for h in ffn._comms.values())
    for t in out.values():
        t.close()


def test_the_watchdog_records_a_timeout_while_the_store_host_is_frozen(fake):
    """FFN rank 0 stopped (SIGSTOP): every store round trip of the transport's abort signal, progress
    report and blame blocks; the expired operation must still be recorded at its deadline."""
    import os
    import sys

    from afd_ext.transport.base import AFDTimeoutError, MessageTag, StepProgress

    sys.path.insert(0, os.path.dirname(__file__))
    from fault_helpers import StoreHost

    host = StoreHost(find_free_port())
    try:
        frozen = rdzv.connect("127.0.0.1", host.port, 1, 2, 30.0, num_ffn_ranks=1)
        seq = ((0, 0),)
        progress = lambda: StepProgress(2, 1, 1, 0, False, seq, "sent 1 of 1, received 0 of 1", 0.0)  # noqa: E731
        deadline = 1.0
        out = _build_all(1, 1, timeout_s=deadline, abort=frozen.abort_signal, progress=progress,
                         publish_after_s=0.05)
        att = out[1]
        att.stall.store = frozen  # progress reports and blame go to the frozen host too
        host.freeze()
        time.sleep(0.3)  # the hooks are now blocked on the silent store
        tag = MessageTag("recv_ffn_output", "f2a", 2, 0, 0)
        t0 = time.monotonic()
        att.watchdog.track(lambda: False, "recv_ffn_output: receive", peers=["FFN rank 0 (world rank 0)"],
                           layer=0, stage=0, where=tag.where(), tag=tag, peer_ranks=[0])
        while att.watchdog.failure is None and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        took = time.monotonic() - t0
        err = att.watchdog.failure
        assert isinstance(err, AFDTimeoutError), err
        assert took < deadline + max(1.0, 0.1 * deadline), took
        assert "FFN rank 0 (world rank 0)" in str(err) and "did not answer" in str(err), err
        # the communicators are aborted right after the (bounded) abort post to the frozen store
        t1 = time.monotonic()
        while not all(h in fake.aborted for h in att._comms.values()) and time.monotonic() - t1 < 3.0:
            time.sleep(0.01)
        assert all(h in fake.aborted for h in att._comms.values())
        print(f"\n[item 1] NCCL watchdog, store host frozen: timeout recorded {took:.2f} s after issue "
              f"(deadline {deadline:g} s)")
        for t in out.values():
            t.close()
    finally:
        host.close()


_EXIT_SCRIPT = r"""
import sys, time
from afd_ext.health import watchdog
watchdog.EXIT_WAIT_S = float(sys.argv[2])
marker, hold_s = sys.argv[1], float(sys.argv[3])

def release():  # stands in for an ncclCommAbort whose peer stalled: a native call with the GIL released
    time.sleep(hold_s)
    open(marker, "w").write("released")

watchdog.spawn(release, "ncclCommAbort of a2f a0-f0 (handle 7) on FFN rank 0")
print("worker done", flush=True)  # the worker returns at once; the release is still running
"""


@pytest.mark.parametrize("case", ["finishes", "overruns"])
def test_process_exit_waits_for_a_running_release_within_its_bound(tmp_path, case):
    """GPU run 35: a stalled peer's abort, on a helper thread, returned into a finalising interpreter
    and the process died with SIGABRT. Exit now joins the releases first (bounded); past the bound it
    leaves without finalising, exit status 1, naming the call."""
    import subprocess
    import sys

    marker = tmp_path / "released"
    wait_s, hold_s = (10.0, 0.5) if case == "finishes" else (0.5, 30.0)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(marker), str(wait_s), str(hold_s)],
                       capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert "worker done" in r.stdout, r
    if case == "finishes":
        assert r.returncode == 0, r
        assert marker.read_text() == "released"  # the exit waited for it
    else:
        assert r.returncode == 1, r
        assert not marker.exists()
        assert took < 20, took  # the bound, not the 30 s release
        assert "ncclCommAbort of a2f a0-f0 (handle 7) on FFN rank 0" in r.stderr, r.stderr
        assert "Leaving without finalising" in r.stderr, r.stderr


def test_a_call_thread_stopped_while_a_call_blocks_serves_the_next_call_on_a_new_thread():
    # a watchdog round or a store client restarts its CallThread after stop(); the new thread must not inherit
    # the old queue's stop mark (it would exit, and every later call would wait behind the blocked one)
    from afd_ext.health.watchdog import CallThread

    calls = CallThread("afd-test-calls")
    release = threading.Event()
    blocked = calls.submit(release.wait)
    deadline = time.monotonic() + 5
    while calls.stuck_s() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not calls.stop(0.05)  # the call still blocks
    try:
        assert calls.submit(lambda: 42).result(timeout=5) == 42
        assert calls.submit(lambda: 43).result(timeout=5) == 43
    finally:
        release.set()
    assert blocked.result(timeout=5) is True
    assert calls.stop(5)
