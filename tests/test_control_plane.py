"""Control plane: shm and tcp channels, routing, heartbeat, abort, torn-read safety."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import socket
import sys
import threading
import time
from unittest import mock

import pytest
import torch

from afd_ext import control as cp
from afd_ext import rendezvous as rdzv
from afd_ext.control import channel as cchannel
from afd_ext.control import shm as cshm
from afd_ext.errors import AFDClosedError, AFDConfigError, AFDStateError, ControlProtocolError
from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
from afd_ext.tools.testing import find_free_port, run_workers
from afd_ext.topology import Topology

HOST = "127.0.0.1"
FAST = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, idle_s=0.002)


def _message(i: int, size: int) -> bytes:
    """Self-checking message number ``i`` of ``size`` bytes."""
    body = (f"{i}:".encode() * (size // 3 + 1))[:size]
    return body


# ---------------------------------------------------------------------------
# Many processes over a real store
# ---------------------------------------------------------------------------


def _roundtrip_worker(rank, nprocs, port, kind, sizes, opts):
    world = nprocs
    store = rdzv.connect(HOST, port, rank, world, 30.0, num_ffn_ranks=1)
    topo = Topology(1, 1)
    role = "ffn" if rank == 0 else "attention"
    chans = cp.open_control_channels(store, topo, role, 0, kind, 30.0, options=cp.ChannelOptions(**opts))
    ch = chans[0]
    try:
        if role == "attention":
            for i, n in enumerate(sizes):
                ch.send(_message(i, n))
            rdzv.barrier(store, rank, world, "received", 30.0)
            return {"kind": ch.kind}
        got = []
        for i, n in enumerate(sizes):
            data = ch.recv(30.0)
            got.append(data == _message(i, n))
        rdzv.barrier(store, rank, world, "received", 30.0)
        return {"kind": ch.kind, "ok": got, "shm_left": _shm_names()}
    finally:
        ch.close()


def _shm_names() -> list[str]:
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"afd-{os.getpid()}-")]
    except OSError:
        return []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_channel_roundtrip_in_order_with_large_payloads(kind):
    # Small slots and ring so that fragments and ring wrap-around are exercised.
    sizes = [0, 1, 300, 1024, 1025, 5000] + [100 + 37 * i for i in range(200)] + [3 << 20]
    opts = dict(slot_bytes=1024, nslots=4, max_message_bytes=4 << 20)
    res = run_workers(_roundtrip_worker, 2, (find_free_port(HOST), kind, sizes, opts), timeout_s=90)
    assert res[0]["kind"] == kind == res[1]["kind"]
    assert res[0]["ok"] == [True] * len(sizes)
    assert res[0]["shm_left"] == []  # the ring's name is unlinked as soon as both ends attached


def _payload(step: int, A: int, stages: int = 2) -> AFDControlPayload:
    return AFDControlPayload(
        dp_metadata_list={
            s: AFDDPMetadata(torch.tensor([(step * 7 + a * 3 + s) % 5 for a in range(A)], dtype=torch.int32))
            for s in range(stages)
        },
        is_warmup=(step == 0),
    )


def _plane_worker(rank, nprocs, port, A, F, kind, steps):
    topo = Topology(A, F)
    role, role_rank = topo.role_of(rank)
    store = rdzv.connect(HOST, port, rank, topo.world_size, 30.0, num_ffn_ranks=F)
    chans = cp.open_control_channels(store, topo, role, role_rank, kind, 30.0)
    applied = []
    plane = cp.AFDControlPlane(applied.append, topo, role, role_rank, chans, store=store)
    got = []
    try:
        for step in range(steps):
            if role == "attention":
                p = _payload(step, A)
                plane.update_state_from_dp_metadata(p)
                plane.send_dp_metadata_list(p)
            else:
                p = plane.recv_dp_metadata_list()
                got.append(({s: m.num_tokens_across_dp_cpu.tolist() for s, m in p.dp_metadata_list.items()},
                            p.is_warmup))
        rdzv.barrier(store, rank, topo.world_size, "done", 30.0)
    finally:
        plane.close()
    return {"role": role, "role_rank": role_rank, "got": got, "applied": len(applied),
            "sender": plane.is_sender, "kinds": sorted({c.kind for c in chans.values()})}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("A,F,kind", [(3, 2, "tcp"), (1, 2, "auto")])
def test_control_plane_routing_and_payloads(A, F, kind):
    steps = 5
    res = run_workers(_plane_worker, A + F, (find_free_port(HOST), A, F, kind, steps), timeout_s=90)
    topo = Topology(A, F)
    for r in res:
        if r["role"] == "ffn":
            want = []
            for step in range(steps):
                p = _payload(step, A)
                want.append(({s: m.num_tokens_across_dp_cpu.tolist() for s, m in p.dp_metadata_list.items()},
                             step == 0))
            assert r["got"] == want
            assert r["kinds"] == [kind if kind != "auto" else "shm"]
        else:
            assert r["applied"] == steps
            assert r["sender"] == bool(topo.control_destinations(r["role_rank"]))


def _kind_mismatch_worker(rank, nprocs, port):
    store = rdzv.connect(HOST, port, rank, 2, 30.0, num_ffn_ranks=1)
    role = "ffn" if rank == 0 else "attention"
    try:
        cp.open_control_channels(store, Topology(1, 1), role, 0, "tcp" if rank == 0 else "shm", 20.0)
    except Exception as e:  # noqa: BLE001 - classified by the test
        out = (type(e).__name__, str(e))
    else:
        out = ("no error", "")
    # Leave through plain polling: waits of this aborted generation raise.
    store.set(f"left/{rank}", b"1")
    while rank == 0 and not store.check(["left/1"]):
        time.sleep(0.01)
    return out


@pytest.mark.timeout(90)
def test_channel_kind_mismatch_is_named_on_both_ends():
    t0 = time.monotonic()
    res = run_workers(_kind_mismatch_worker, 2, (find_free_port(HOST),), timeout_s=60)
    assert time.monotonic() - t0 < 45  # not the 20 s init deadline twice over
    assert res[1][0] == "AFDConfigError" and "opened a 'tcp' channel" in res[1][1] and "expects 'shm'" in res[1][1]
    assert res[0][0] == "StepAbortedError" and "control channel kind mismatch" in res[0][1]


def _store_host_exits_first_worker(rank, nprocs, port):
    topo = Topology(1, 2)  # attention rank 0 sends to FFN ranks 0 and 1
    role, role_rank = topo.role_of(rank)
    store = rdzv.connect(HOST, port, rank, 3, 30.0, num_ffn_ranks=2)
    chans = cp.open_control_channels(store, topo, role, role_rank, "shm", 30.0,
                                     options=cp.ChannelOptions(**FAST))
    plane = cp.AFDControlPlane(lambda p: None, topo, role, role_rank, chans, store=store)
    rdzv.barrier(store, rank, 3, "ready", 30.0)
    if role == "attention":
        plane.send_dp_metadata_list(_payload(0, 1))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until FFN rank 0 (the store's host) has exited
            try:
                store.check(["x"])
            except rdzv.StoreUnavailableError:
                break
            time.sleep(0.02)
        time.sleep(0.3)  # FFN rank 1 has seen the lost store by now (it polls every 0.1 s)
        plane.close()
        return "closed"
    plane.recv_dp_metadata_list()
    if role_rank == 0:
        return "exiting"  # takes the store with it
    try:
        plane.recv_dp_metadata_list()
        return "no error"
    except Exception as e:  # noqa: BLE001 - classified by the test
        return type(e).__name__


@pytest.mark.timeout(90)
def test_clean_shutdown_after_the_store_host_exits_is_a_close_not_a_lost_store():
    res = run_workers(_store_host_exits_first_worker, 3, (find_free_port(HOST),), timeout_s=60)
    assert res == ["exiting", "ControlChannelClosed", "closed"]


# ---------------------------------------------------------------------------
# Liveness: dead, hung, idle, aborted, closed
# ---------------------------------------------------------------------------


def _handoff(store, mine: str, theirs: str) -> None:
    """Set ``mine`` and wait for ``theirs`` by plain polling (works in an aborted generation)."""
    store.set(mine, b"1")
    deadline = time.monotonic() + 30
    while not store.check([theirs]):
        assert time.monotonic() < deadline, f"peer never set {theirs}"
        time.sleep(0.01)


def _liveness_worker(rank, port, kind, scenario):
    store = rdzv.connect(HOST, port, rank, 2, 30.0, num_ffn_ranks=1)
    topo = Topology(1, 1)
    role = "ffn" if rank == 0 else "attention"
    chans = cp.open_control_channels(store, topo, role, 0, kind, 30.0, options=cp.ChannelOptions(**FAST))
    plane = cp.AFDControlPlane(lambda p: None, topo, role, 0, chans, store=store)
    if role == "attention":
        store.set("pid/1", str(os.getpid()))
        plane.send_dp_metadata_list(_payload(0, 1))
        if scenario == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        elif scenario == "hung":
            os.kill(os.getpid(), signal.SIGSTOP)  # the FFN rank sends SIGCONT once it noticed
        elif scenario == "lifecycle":
            time.sleep(3 * FAST["heartbeat_timeout_s"])  # idle without a payload, but alive
            plane.send_dp_metadata_list(_payload(1, 1))
            _handoff(store, "attn/sent", "ffn/timed_out")
            plane.close()  # clean shutdown
        elif scenario == "abort":
            time.sleep(0.5)
            rdzv.post_abort(store, "layer 2 stage 1: FFN output has the wrong shape")
        _handoff(store, "attn/done", "ffn/done")
        plane.close()
        return "ok"

    def attempt() -> dict:
        t0 = time.monotonic()
        try:
            p = plane.recv_dp_metadata_list()
            out = {"error": None, "counts": p.dp_metadata_list[0].num_tokens_across_dp_cpu.tolist()}
        except Exception as e:  # noqa: BLE001 - classified by the test
            out = {"error": type(e).__name__, "msg": str(e), "peer": getattr(e, "peer", None),
                   "op": getattr(e, "op", None)}
        out["elapsed"] = time.monotonic() - t0
        return out

    first = plane.recv_dp_metadata_list()
    assert first.is_warmup
    out = attempt()
    if scenario == "hung":
        os.kill(int(store.get("pid/1")), signal.SIGCONT)
    if scenario == "lifecycle":
        plane.recv_timeout_s = 0.5
        out = {"idle": out, "timeout": attempt()}
        plane.recv_timeout_s = None
        _handoff(store, "ffn/timed_out", "attn/sent")
        out["closed"] = attempt()
    if scenario != "killed":
        _handoff(store, "ffn/done", "attn/done")
    plane.close()
    return out


def _liveness_entry(rank, port, kind, scenario, q):
    try:
        res = _liveness_worker(rank, port, kind, scenario)
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        res = {"error": "worker failed", "msg": traceback.format_exc()}
    q.put((rank, res))


def _run_pair(kind: str, scenario: str) -> dict:
    """Run an FFN rank and an attention rank that may die on purpose; return the FFN rank's result."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port(HOST)
    procs = [ctx.Process(target=_liveness_entry, args=(r, port, kind, scenario, q), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                rank, result = q.get(timeout=0.5)
            except queue.Empty:
                if not procs[0].is_alive():
                    raise RuntimeError(f"FFN worker died with exit code {procs[0].exitcode}") from None
                continue
            if rank == 0:
                return result
            assert result == "ok", result
        raise TimeoutError("FFN worker did not report within 60 s")
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_killed_sender_becomes_peer_dead_error(kind):
    res = _run_pair(kind, "killed")
    assert res["error"] == "PeerDeadError", res
    assert res["peer"] == "attention rank 0 (world rank 1)"
    assert res["op"] == "recv_dp_metadata_list"
    assert "recv_dp_metadata_list: peer attention rank 0 (world rank 1) is dead" in res["msg"]
    assert res["elapsed"] < FAST["heartbeat_timeout_s"] + 1.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_hung_sender_is_dead_after_heartbeat_timeout(kind):
    res = _run_pair(kind, "hung")
    assert res["error"] == "PeerDeadError", res
    assert "no heartbeat" in res["msg"]
    assert FAST["heartbeat_timeout_s"] * 0.9 <= res["elapsed"] < FAST["heartbeat_timeout_s"] + 2.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_idle_peer_is_waited_for_then_timeout_then_clean_close(kind):
    res = _run_pair(kind, "lifecycle")
    idle, timeout, closed = res["idle"], res["timeout"], res["closed"]
    # Idle for three heartbeat timeouts, but alive: no error, the payload arrives.
    assert idle["error"] is None, idle
    assert idle["counts"] == _payload(1, 1).dp_metadata_list[0].num_tokens_across_dp_cpu.tolist()
    assert idle["elapsed"] > 2 * FAST["heartbeat_timeout_s"]
    # The optional step timeout.
    assert timeout["error"] == "ControlRecvTimeout", timeout
    assert 0.45 <= timeout["elapsed"] < 3
    # The sender's close ends the FFN loop.
    assert closed["error"] == "ControlChannelClosed", closed


@pytest.mark.timeout(90)
def test_abort_signal_ends_the_ffn_wait():
    res = _run_pair("shm", "abort")
    assert res["error"] == "StepAbortedError", res
    assert "attention rank 0 (world rank 1)" in res["msg"] and "wrong shape" in res["msg"]
    assert res["elapsed"] < 3.0


# ---------------------------------------------------------------------------
# In-process: both ends of one channel
# ---------------------------------------------------------------------------

FFN, ATTN = "FFN rank 0 (world rank 0)", "attention rank 0 (world rank 1)"


def _ring(**opts):
    options = cp.ChannelOptions(**{**FAST, **opts})
    rx = cp.ShmControlChannel.create(f"afd-test-{os.getpid()}", local_rank=0, peer_rank=1, peer=ATTN,
                                     options=options, abort_check=None)
    tx = cp.ShmControlChannel.attach(rx.name, local_rank=1, peer_rank=0, peer=FFN, options=options,
                                     abort_check=None)
    rx.wait_attached(time.monotonic() + 5)
    return rx, tx


def _tcp(**opts):
    options = cp.ChannelOptions(**{**FAST, **opts})
    ls = socket.create_server(("127.0.0.1", 0))
    got = {}
    deadline = time.monotonic() + 10
    t = threading.Thread(target=lambda: got.setdefault("tx", cp.TcpControlChannel.connect(
        ls.getsockname()[:2], deadline, b"token", local_rank=1, peer_rank=0, peer=FFN, options=options,
        abort_check=None)))
    t.start()
    rx = cp.TcpControlChannel.accept(ls, deadline, token=b"token", local_rank=0, peer_rank=1, peer=ATTN,
                                     options=options, abort_check=None)
    t.join(10)
    ls.close()
    return rx, got["tx"]


PAIRS = {"shm": _ring, "tcp": _tcp}


@contextlib.contextmanager
def _pair(kind, **opts):
    rx, tx = PAIRS[kind](**opts)
    try:
        yield rx, tx
    finally:
        tx.close()
        rx.close()


def _recv_in_thread(rx, out, timeout_s=30.0):
    def run():
        try:
            out.append(rx.recv(timeout_s))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("first_take", ["slice", "stopped"])
def test_a_message_sent_just_before_close_is_received_not_lost(first_take):
    """The sender publishes its last message and closes while the receiver is between two looks at
    its slot (the take's slice just ended, or it saw the stop word before the slot): the message
    comes first, then ControlChannelClosed (found in the demo under load: the FFN rank lost the
    attention rank's shutdown payload and failed with ControlChannelClosed)."""
    with _pair("shm") as (rx, tx):
        tx.send(_message(7, 40))
        tx.close()
        native, calls = rx._C, []

        class FirstTakeMisses:  # the native take of the slice that ended before the publish
            def __getattr__(self, name):
                return getattr(native, name)

            def ctrl_shm_take(self, *a):
                calls.append(a)
                return (-1 if first_take == "slice" else -2) if len(calls) == 1 else native.ctrl_shm_take(*a)

        rx._C = FirstTakeMisses()
        assert rx.recv(5.0) == _message(7, 40)
        with pytest.raises(cp.ControlChannelClosed):
            rx.recv(5.0)


def test_a_close_seen_between_slices_does_not_lose_the_message_published_before_it():
    """The slice ends with nothing (the sender still attached), then the sender publishes and closes
    before the receiver's between-slice peer check: the message still comes first."""
    with _pair("shm") as (rx, tx):
        take = rx._take

        def slice_then_publish_and_close(*a):
            got = take(*a)
            if tx._closed is False:
                tx.send(_message(8, 40))
                tx.close()
            return got

        rx._take = slice_then_publish_and_close
        assert rx.recv(5.0) == _message(8, 40)
        with pytest.raises(cp.ControlChannelClosed):
            rx.recv(5.0)


def test_ring_wraps_and_flow_control_blocks_only_when_full():
    with _pair("shm", slot_bytes=64, nslots=2) as (rx, tx):
        for i in range(50):
            tx.send(_message(i, 100))  # two fragments each: the ring is full after every send
            assert rx.recv(1.0) == _message(i, 100)
        assert not os.path.exists(f"/dev/shm/{rx.name}")


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_sleeping_receiver_is_woken_by_the_send_not_its_slice(kind, monkeypatch):
    monkeypatch.setattr(cchannel, "_SLICE_S", 20.0)  # only the doorbell / poll can end the wait early
    with _pair(kind, idle_s=0.0, heartbeat_timeout_s=60.0) as (rx, tx):
        out: list = []
        t = _recv_in_thread(rx, out)
        time.sleep(0.2)
        assert out == []
        t0 = time.monotonic()
        tx.send(b"wake up")
        t.join(10)
        assert out == [b"wake up"] and time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_waiting_receiver_leaves_the_gil_to_other_threads_spinning_or_sleeping(kind):
    for idle_s in (60.0, 0.0):  # spinning, then sleeping
        with _pair(kind, idle_s=idle_s, heartbeat_timeout_s=60.0) as (rx, tx):
            old = sys.getswitchinterval()
            out: list = []
            try:
                sys.setswitchinterval(2.0)  # a wait holding the GIL would keep this thread out for 2 s
                t = _recv_in_thread(rx, out)
                time.sleep(0.05)
                t0 = time.monotonic()
                for _ in range(5):
                    time.sleep(0.01)  # each return needs the GIL back
                assert time.monotonic() - t0 < 0.5
            finally:
                sys.setswitchinterval(old)
            tx.send(b"done")
            t.join(5)
            assert out == [b"done"]


def test_a_torn_slot_is_retried_and_one_that_stays_inconsistent_is_a_named_error():
    from afd_ext import _C

    payload = _C.CTRL_HEADER_BYTES + _C.CTRL_SLOT_HEADER  # slot 0's first payload byte
    with _pair("shm", slot_bytes=64, nslots=4) as (rx, tx):
        tx.send(b"x" * 40)
        rx._mm[payload] ^= 0xFF  # published, but the bytes are not the ones written (a torn read)
        out: list = []
        t = _recv_in_thread(rx, out, 5.0)
        time.sleep(0.3)
        assert out == []  # CRC mismatch: retried, never returned
        rx._mm[payload] ^= 0xFF
        t.join(5)
        assert out == [b"x" * 40]
        tx.send(b"y" * 40)
        rx._mm[payload + tx._stride] ^= 0x01  # slot 1, for good
        t0 = time.monotonic()
        with pytest.raises(cp.ControlProtocolError, match=f"slot 1 from {re.escape(ATTN)} stayed inconsistent") as e:
            rx.recv(None)
        assert "corrupt" in str(e.value) and 0.9 <= time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_message_from_an_unexpected_sender_is_rejected(kind):
    with _pair(kind) as (rx, tx):
        tx.local_rank = 3
        tx.send(b"hello")
        with pytest.raises(cp.ControlProtocolError, match=f"from world rank 3, expected {re.escape(ATTN)}"):
            rx.recv(1.0)


def test_fragments_that_do_not_add_up_or_stop_half_way_are_named_errors():
    with _pair("shm", slot_bytes=64, nslots=4) as (rx, tx):
        put = functools.partial(tx._C.ctrl_shm_put, tx._mm, 1)  # (data, total) from world rank 1
        put(b"a" * 64, 100)
        put(b"b" * 36, 200)  # the second fragment names another total
        with pytest.raises(cp.ControlProtocolError, match="fragments from .* do not add up.*after 64 of 100 bytes"):
            rx.recv(1.0)
    with _pair("shm", slot_bytes=64, nslots=4) as (rx, tx):
        tx._C.ctrl_shm_put(tx._mm, 1, b"a" * 64, 100)  # the rest never comes
        t0 = time.monotonic()
        with pytest.raises(cp.ControlProtocolError, match="stopped after 64 of 100 bytes"):
            rx.recv(None)
        assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"] + 1.0


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_oversized_message_and_wrong_end_are_rejected(kind):
    with _pair(kind, max_message_bytes=100) as (rx, tx):
        with pytest.raises(ValueError, match="max_message_bytes=100"):
            tx.send(b"z" * 101)
        with pytest.raises(RuntimeError, match="sending"):
            tx.recv(0.1)
        with pytest.raises(RuntimeError, match="receiving"):
            rx.send(b"a")
        with pytest.raises(cp.ControlRecvTimeout):
            rx.recv(0.2)
    with pytest.raises(RuntimeError, match="closed"):
        tx.send(b"a")
    tx.close()  # idempotent


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_receiver_closed_by_another_thread_while_it_waits_gets_a_named_error_at_once(kind):
    for idle_s in (60.0, 0.0):
        with _pair(kind, idle_s=idle_s, heartbeat_timeout_s=60.0) as (rx, tx):
            out: list = []
            t = _recv_in_thread(rx, out)
            time.sleep(0.1)
            t0 = time.monotonic()
            rx.close()
            t.join(5)
            assert time.monotonic() - t0 < 0.5
            assert isinstance(out[0], AFDClosedError) and "closed" in str(out[0]), out


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_signal_ends_a_sleeping_wait_at_once_and_the_next_receive_works(kind):
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        with _pair(kind, idle_s=0.0, heartbeat_timeout_s=60.0) as (rx, tx):
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            t0 = time.monotonic()
            with pytest.raises(Interrupted):
                rx.recv(None)
            assert time.monotonic() - t0 < 0.5
            tx.send(b"next")
            assert rx.recv(1.0) == b"next"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_tcp_frame_left_part_sent_breaks_the_stream_and_a_heartbeat_skips_a_busy_lock():
    with _pair("tcp") as (rx, tx):
        with tx._lock:
            assert tx._beat() is True  # skipped (the lock is busy), not blocked, not an error
        with mock.patch.object(tx._C, "ctrl_tcp_send", side_effect=BrokenPipeError(32, "Broken pipe")):
            with pytest.raises(cp.PeerDeadError, match="connection lost"):
                tx.send(b"x")
        with pytest.raises(cp.PeerDeadError, match="left part-sent"):
            tx.send(b"y")


@pytest.mark.parametrize("first_write", ["part", "would block"])
def test_a_tcp_frame_the_first_write_leaves_unsent_is_finished_whole(first_write):
    with _pair("tcp") as (rx, tx):
        real = tx._C.ctrl_tcp_send

        def short(fd, typ, sender, data, max_bytes):  # the native send, as if the socket took 3 bytes (or none)
            a, b = socket.socketpair()
            with a, b:
                real(a.fileno(), typ, sender, data, max_bytes)
                frame = b.recv(1 << 16)
            n = 3 if first_write == "part" else 0
            os.write(fd, frame[:n])
            return frame[n:]

        with mock.patch.object(tx._C, "ctrl_tcp_send", side_effect=short):
            tx.send(b"hello")
        tx.send(b"again")
        assert rx.recv(5.0) == b"hello" and rx.recv(5.0) == b"again"


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_payload_over_max_message_bytes_is_refused_before_it_moves_and_the_next_one_goes(kind):
    with _pair(kind, max_message_bytes=100) as (rx, tx):
        with pytest.raises(AFDConfigError, match="272 bytes exceeds max_message_bytes=100"):
            tx.send_payload(_payload(0, 30))  # 8 + 2 * (12 + 4 * 30) bytes
        tx.send_payload(_payload(1, 8))  # 96 bytes
        assert rx.recv(2.0, max_payload=100) == _payload(1, 8)


def test_the_planes_max_payload_bytes_bounds_a_payload():
    with _pair("shm") as (rx, tx):
        plane = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, {0: rx}, max_payload_bytes=50)
        tx.send_payload(_payload(0, 8))
        with pytest.raises(cp.ControlProtocolError, match="exceeds max_payload_bytes=50"):
            plane.recv_dp_metadata_list()


def test_the_waits_jitter_leaves_the_users_random_sequence_alone():
    import random

    with _pair("shm") as (rx, _):
        random.seed(7)
        want = random.random()
        random.seed(7)
        with pytest.raises(cp.ControlRecvTimeout):
            rx.recv(0.05)
        assert random.random() == want


def test_channel_options_validation():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        cp.ChannelOptions(heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
    with pytest.raises(ValueError, match="nslots"):
        cp.ChannelOptions(nslots=1)


def test_idle_threshold_comes_from_the_environment_and_removed_variables_only_warn(monkeypatch):
    monkeypatch.setenv("AFD_CONTROL_IDLE_S", "2.5")
    assert cp.ChannelOptions.from_env().idle_s == 2.5
    assert cp.ChannelOptions.from_env(idle_s=0.0).idle_s == 0.0
    monkeypatch.setenv("AFD_CONTROL_IDLE_S", "-1")
    with pytest.raises(ValueError, match="AFD_CONTROL_IDLE_S"):
        cp.ChannelOptions.from_env()
    with pytest.raises(ValueError, match="idle_s"):
        cp.ChannelOptions(idle_s=-0.1)
    monkeypatch.delenv("AFD_CONTROL_IDLE_S")
    monkeypatch.setenv("AFD_CONTROL_WARM_S", "0.001")
    with pytest.warns(DeprecationWarning, match="AFD_CONTROL_WARM_S is deprecated and ignored"):
        assert cp.ChannelOptions.from_env() == cp.ChannelOptions()


def test_control_plane_rejects_channels_that_do_not_match_the_topology():
    with pytest.raises(ValueError, match="control routing"):
        cp.AFDControlPlane(lambda p: None, Topology(2, 1), "attention", 1, {0: object()})
    plane = cp.AFDControlPlane(lambda p: None, Topology(2, 1), "attention", 1, {})
    assert not plane.is_sender
    plane.send_dp_metadata_list(_payload(0, 2))  # a no-op on a non-sender
    with pytest.raises(RuntimeError, match="FFN ranks only"):
        plane.recv_dp_metadata_list()


def test_one_control_plane_class_opens_closes_and_reopens():
    applied = []
    plane = cp.AFDControlPlane(applied.append, Topology(1, 1), "ffn", 0, label="FFN rank 0 (world rank 0)")
    assert not plane.is_open
    with pytest.raises(AFDStateError, match=r"FFN rank 0 \(world rank 0\)\) is not initialized"):
        plane.recv_dp_metadata_list()
    plane.update_state_from_dp_metadata("p")  # local: no channel needed
    assert applied == ["p"]
    for step, kind in enumerate(("shm", "tcp")):  # close() then a new attach, as close() / init_afd_connector() do
        rx, tx = PAIRS[kind]()
        sender = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, {0: tx})
        plane.attach({0: rx})
        assert plane.is_open
        sender.send_dp_metadata_list(_payload(step, 3))
        got = plane.recv_dp_metadata_list()
        assert got == _payload(step, 3) and isinstance(got.dp_metadata_list[0], AFDDPMetadata)
        assert got.dp_metadata_list[1].num_tokens_across_dp_cpu.dtype == torch.int32
        sender.close()
        plane.close()
        assert not plane.is_open and not sender.is_open
    with pytest.raises(AFDStateError, match="not initialized"):
        sender.send_dp_metadata_list(_payload(0, 3))


# ---------------------------------------------------------------------------
# Faults across processes: a malformed payload; an FFN rank gone during init (#34 item 2)
# ---------------------------------------------------------------------------


def _malformed_worker(rank, nprocs, port, kind):
    topo = Topology(1, 1)
    role = "ffn" if rank == 0 else "attention"
    store = rdzv.connect(HOST, port, rank, 2, 30.0, num_ffn_ranks=1)
    plane = cp.AFDControlPlane(lambda p: None, topo, role, 0)
    plane.open(store, kind, 30.0, options=cp.ChannelOptions(**FAST))
    t0 = time.monotonic()
    try:
        if role == "attention":
            plane.channels[0].send(b"AFDb\x01\x00\x01\x00garbage")  # a truncated stage header
            while time.monotonic() - t0 < 10:  # as an attention rank waiting on its first exchange
                rdzv.raise_if_aborted(store, op="recv_ffn_output")
                time.sleep(0.01)
            return {"error": None, "elapsed": time.monotonic() - t0}
        plane.recv_dp_metadata_list()
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - classified by the test
        return {"error": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    finally:
        plane.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_malformed_payload_aborts_the_step_on_every_rank(kind):
    ffn, attn = run_workers(_malformed_worker, 2, (find_free_port(HOST), kind), timeout_s=60)
    assert ffn["error"] == "ControlProtocolError", ffn
    assert "malformed control payload from attention rank 0 (world rank 1)" in ffn["msg"]
    assert attn["error"] == "StepAbortedError", attn
    assert "malformed control payload" in attn["msg"] and attn["elapsed"] < 2.0


def _ffn_fails_in_init(port, how):
    """FFN rank 1: creates its control segment and publishes it, then fails before the sender attaches."""
    store = rdzv.connect(HOST, port, 1, 3, 30.0, num_ffn_ranks=2)
    if how == "elsewhere":  # as on another host (or container): its /dev/shm is not the attention rank's
        rdzv.host_identity = lambda: "another host"

    def fail(self, deadline, store=None):
        if how == "abort":
            rdzv.post_abort(store, "FFN rank 1 failed to load its weights")
        raise RuntimeError("init failed")

    cshm.ShmControlChannel.wait_attached = fail
    with contextlib.suppress(RuntimeError):  # the open closes the channel: the segment is unlinked
        cp.open_control_channels(store, Topology(1, 2), "ffn", 1, "shm", 30.0, options=cp.ChannelOptions(**FAST))
    store.set("ffn1/failed", b"1")
    if how == "exit":
        os._exit(0)
    while not store.check(["attn/done"]):
        time.sleep(0.01)


def _wait_key(store, key):
    deadline = time.monotonic() + 30
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.01)


def _ffn_gone_worker(rank, nprocs, port, how):
    import json

    from afd_ext.health.process import start_time as _proc_start_time

    if rank == 1:
        if how != "exit":
            return _ffn_fails_in_init(port, how)
        pid = os.fork()  # a process of its own, to exit
        if pid == 0:
            try:
                _ffn_fails_in_init(port, how)
            finally:
                os._exit(0)
        return os.waitpid(pid, 0)[1]
    topo = Topology(1, 2)
    store = rdzv.connect(HOST, port, rank, 3, 30.0, num_ffn_ranks=2)
    opts = cp.ChannelOptions(**FAST)
    if rank == 0:  # FFN rank 0, the store's host: its own channel opens (or sees the abort)
        with contextlib.suppress(Exception):
            for ch in cp.open_control_channels(store, topo, "ffn", 0, "shm", 30.0, options=opts).values():
                ch.close()
        _wait_key(store, "attn/done")
        return None
    _wait_key(store, "ffn1/failed")  # attention rank 0 (world rank 2) opens after FFN rank 1 failed
    if how == "exit":  # and its process is gone
        pid = json.loads(store.get("ctrl/0/1/shm"))["pid"]
        deadline = time.monotonic() + 10
        while _proc_start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    t0 = time.monotonic()
    try:
        cp.open_control_channels(store, topo, "attention", 0, "shm", 30.0, options=opts)
        out = {"error": None}
    except Exception as e:  # noqa: BLE001 - classified by the test
        out = {"error": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    store.set("attn/done", b"1")
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["exit", "abort", "elsewhere"])
def test_an_ffn_rank_gone_during_init_is_not_reported_as_a_missing_dev_shm(how):
    """#34 item 2: the FFN rank failed after creating its control segment: named as such (its exit
    or its abort record), and only a segment that was never visible advises the tcp channel."""
    res = run_workers(_ffn_gone_worker, 3, (find_free_port(HOST), how), timeout_s=60)
    attn = res[2]
    if how == "elsewhere":
        assert attn["error"] == "RendezvousError", attn
        assert "do not share /dev/shm" in attn["msg"] and "control_channel to 'tcp'" in attn["msg"]
        return
    assert "/dev/shm" not in attn["msg"] and "'tcp'" not in attn["msg"], attn
    assert attn["elapsed"] < 2.0, attn
    if how == "exit":
        assert attn["error"] == "PeerDeadError", attn
        assert "peer FFN rank 1 (world rank 1) is dead" in attn["msg"]
        assert "exited or aborted during init" in attn["msg"] and "pid " in attn["msg"]
    else:
        assert attn["error"] == "StepAbortedError", attn
        assert "FFN rank 1 failed to load its weights" in attn["msg"]


# ---------------------------------------------------------------------------
# The measurement (afd_ext.tools.bench.control)
# ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_measure_control_plane_reports_percentiles():
    from afd_ext.tools.bench.control import measure_control_plane

    r = measure_control_plane("shm", 200, warmup=20)  # the receiver checks every step's counts
    assert r["kind"] == "shm" and r["n"] == 200
    assert 0 < r["min_us"] <= r["p50_us"] <= r["p90_us"] <= r["p99_us"] <= r["max_us"]
    assert r["payload_bytes"] == 8 + 2 * (12 + 4 * 8)  # binary: 2 stages of 8 counts


@pytest.mark.timeout(180)
def test_control_table_has_each_gap_channel_and_the_reference():
    from afd_ext.tools.bench.control import control_table, format_control_table

    rows = control_table((1.0, 2.0), ("shm", "tcp"), seconds_per_cell=0.2)
    assert [r["gap_ms"] for r in rows] == [1.0, 2.0]
    shm, tcp, ref = rows[0]["shm"], rows[0]["tcp"], rows[0]["reference"]
    assert shm["kind"] == "shm" and tcp["kind"] == "tcp" and ref["kind"] == "gloo"
    assert shm["n"] == 200 and ref["n"] == 100 and rows[1]["shm"]["n"] == 100
    assert 0 < shm["p50_us"] <= shm["p99_us"] and 0 < ref["p50_us"] <= ref["p99_us"]
    text = format_control_table(rows, ("shm", "tcp"))
    assert "| 1 ms |" in text and "reference pattern" in text
    assert f"{shm['p50_us']:.1f} / {shm['p99_us']:.1f}" in text


def test_a_reset_tcp_connection_is_a_named_peer_death_at_once():
    import struct

    with _pair("tcp", heartbeat_timeout_s=60.0) as (rx, tx):
        tx._hb_stop.set()
        tx._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tx._sock.close()  # an RST, no goodbye: the sender's process died
        t0 = time.monotonic()
        with pytest.raises(cp.PeerDeadError, match=f"peer {re.escape(ATTN)} is dead: (connection lost|its connection closed)"):
            rx.recv(None)
        assert time.monotonic() - t0 < 0.5
