"""Control plane: shm and tcp channels, routing, heartbeat, abort, torn-read safety."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_ext import control as cp
from afd_ext import rendezvous as rdzv
from afd_ext.control import shm as cshm
from afd_ext.errors import AFDConfigError, AFDStateError, ControlProtocolError
from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
from afd_ext.testing import find_free_port, run_workers
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
    plane = cp.ChannelControlPlane(applied.append, topo, role, role_rank, chans, store=store)
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
    plane = cp.ChannelControlPlane(lambda p: None, topo, role, role_rank, chans, store=store)
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
    plane = cp.ChannelControlPlane(lambda p: None, topo, role, 0, chans, store=store)
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
# In-process: the shm ring's protocol
# ---------------------------------------------------------------------------


def _ring(**opts):
    options = cp.ChannelOptions(**{**FAST, **opts})
    rx = cp.ShmControlChannel.create(f"afd-test-{os.getpid()}", local_rank=0, peer_rank=1,
                                     peer="attention rank 0 (world rank 1)", options=options)
    tx = cp.ShmControlChannel.attach(rx.name, local_rank=1, peer_rank=0,
                                     peer="FFN rank 0 (world rank 0)", options=options)
    rx.wait_attached(time.monotonic() + 5)
    return rx, tx


def test_ring_wraps_and_flow_control_blocks_only_when_full():
    rx, tx = _ring(slot_bytes=64, nslots=2)
    try:
        for i in range(50):
            tx.send(_message(i, 100))  # two fragments each: the ring is full after every send
            assert rx.recv(1.0) == _message(i, 100)
        assert not os.path.exists(f"/dev/shm/{rx.name}")
    finally:
        tx.close()
        rx.close()


def test_blocked_receiver_is_woken_by_the_doorbell(monkeypatch):
    # Long liveness/abort slices: only the doorbell can end the blocking wait early.
    monkeypatch.setattr(cshm, "_LIVENESS_EVERY_S", 20.0)
    monkeypatch.setattr(cshm, "_ABORT_EVERY_S", 20.0)
    rx, tx = _ring(idle_s=0.0, heartbeat_timeout_s=60.0)
    out: list[tuple[bytes, float]] = []
    try:
        def reader():
            data = rx.recv(30.0)
            out.append((data, time.monotonic()))

        t = threading.Thread(target=reader)
        t.start()
        deadline = time.monotonic() + 5
        while not rx._hdr[cshm._W_WAITING] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx._hdr[cshm._W_WAITING] == 1  # blocked, not spinning
        time.sleep(0.1)
        t_send = time.monotonic()
        tx.send(b"wake up")
        t.join(10)
        assert out and out[0][0] == b"wake up"
        assert out[0][1] - t_send < 5.0  # far below the 20 s slice
        assert rx._hdr[cshm._W_WAITING] == 0
    finally:
        tx.close()
        rx.close()


def test_torn_slot_is_never_returned():
    """A slot whose sequence number is published before its bytes are visible is retried, not returned."""
    rx, tx = _ring(slot_bytes=64, nslots=4)
    out: list[bytes] = []
    try:
        msg = b"x" * 40
        # Forge slot 0 as a weakly ordered CPU could show it: seq published, payload still stale.
        base = cring._HDR_BYTES
        good_crc = zlib.crc32(msg, zlib.crc32(cring._CRC_FIELDS.pack(2, len(msg), len(msg), 1)))
        cring._SLOT_FIELDS.pack_into(tx._mem.buf, base + 8, len(msg), len(msg), 1, good_crc)
        tx._mem.buf[base + cring._SLOT_HDR:base + cring._SLOT_HDR + len(msg)] = b"y" * len(msg)  # stale bytes
        tx._seq[0][0] = 2
        reader = threading.Thread(target=lambda: out.append(rx.recv(5.0)))
        reader.start()
        time.sleep(0.3)
        assert out == []  # CRC mismatch: the reader keeps retrying
        tx._mem.buf[base + cring._SLOT_HDR:base + cring._SLOT_HDR + len(msg)] = msg  # the bytes arrive
        reader.join(5)
        assert out == [msg]
        # An odd sequence number (write in progress) is not read either.
        tx._count = 1
        tx._seq[1][0] = 3
        reader = threading.Thread(target=lambda: out.append(rx.recv(5.0)))
        reader.start()
        time.sleep(0.2)
        assert len(out) == 1
        tx._seq[1][0] = 2  # undo, then send properly
        tx.send(b"second")
        reader.join(5)
        assert out == [msg, b"second"]
    finally:
        tx.close()
        rx.close()


def test_native_and_python_ring_paths_read_each_other():
    """The native publish/take (csrc/cpu/control_poll.cpp) and the Python path share one slot format and CRC."""
    assert cshm._native() is not None, "the compiled core lacks the native control path (rebuild afd_ext)"
    rx, tx = _ring(slot_bytes=64, nslots=2)
    try:
        for i in range(6):  # wraps the ring; alternates which side runs in Python
            tx._native = None if i % 2 else cshm._native()
            rx._native = cshm._native() if i % 2 else None
            msg = _message(i, 10 + 9 * i)
            tx.send(msg)
            assert rx.recv(1.0) == msg
            assert rx._hdr[cshm._W_READ_COUNT] == i + 1
        tx._native = rx._native = cshm._native()
        tx.send(b"z" * 100)  # two fragments: the native take hands the slot to the Python path
        assert rx.recv(1.0) == b"z" * 100
        # The native encoder and parser agree with the Python codec, both ways.
        from afd_ext import metadata as md

        for i, p in enumerate([_payload(3, 4), AFDControlPayload({0: [], 7: [2**31 - 1]}, is_profile=True),
                               _payload(5, 10)]):  # the last (112 B) spans two 64-byte slots: Python encodes it
            tx._native = cshm._native() if i % 2 == 0 else None
            rx._native = cshm._native()
            tx.send_parts(md.control_payload_parts(p))
            got = rx.recv_payload(1.0, "recv_dp_metadata_list", md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
            built = type(got) is not bytes
            q = got if built else md.decode_control_binary(got)
            assert q == p and built == (i < 2)
            if built:
                assert_built_as_decoded(got, md.encode_control_binary(p))
            tx._native, rx._native = cshm._native(), None
            tx.send_parts(md.control_payload_parts(p))
            assert rx.recv(1.0) == md.encode_control_binary(p)
    finally:
        tx.close()
        rx.close()


def test_frame_from_unexpected_sender_is_rejected():
    options = cp.ChannelOptions(**FAST)
    rx = cp.ShmControlChannel.create(f"afd-test-{os.getpid()}", local_rank=0, peer_rank=2,
                                     peer="attention rank 1 (world rank 2)", options=options)
    tx = cp.ShmControlChannel.attach(rx.name, local_rank=1, peer_rank=0, peer="FFN rank 0", options=options)
    try:
        rx.wait_attached(time.monotonic() + 5)
        tx.send(b"hello")
        with pytest.raises(cp.ControlProtocolError, match="from world rank 1, expected attention rank 1"):
            rx.recv(1.0)
    finally:
        tx.close()
        rx.close()


def test_oversized_message_and_wrong_end_are_rejected():
    rx, tx = _ring(max_message_bytes=100)
    try:
        with pytest.raises(ValueError, match="max_message_bytes=100"):
            tx.send(b"z" * 101)
        with pytest.raises(RuntimeError, match="sending"):
            tx.recv(0.1)
        with pytest.raises(RuntimeError, match="receiving"):
            rx.send(b"a")
        with pytest.raises(cp.ControlRecvTimeout):
            rx.recv(0.2)
    finally:
        tx.close()
        rx.close()
    with pytest.raises(RuntimeError, match="closed"):
        tx.send(b"a")
    tx.close()  # idempotent


def test_attach_to_missing_segment_suggests_tcp():
    with pytest.raises(rdzv.RendezvousError, match="control_channel to .tcp. on every rank"):
        cp.ShmControlChannel.attach("afd-test-does-not-exist", local_rank=1, peer_rank=0, peer="FFN rank 0",
                                    options=cp.ChannelOptions())


def test_channel_options_validation():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        cp.ChannelOptions(heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
    with pytest.raises(ValueError, match="nslots"):
        cp.ChannelOptions(nslots=1)


def test_control_plane_rejects_channels_that_do_not_match_the_topology():
    with pytest.raises(ValueError, match="control routing"):
        cp.ChannelControlPlane(lambda p: None, Topology(2, 1), "attention", 1, {0: object()})
    plane = cp.ChannelControlPlane(lambda p: None, Topology(2, 1), "attention", 1, {})
    assert not plane.is_sender
    plane.send_dp_metadata_list(_payload(0, 2))  # a no-op on a non-sender
    with pytest.raises(RuntimeError, match="FFN ranks only"):
        plane.recv_dp_metadata_list()


def test_one_control_plane_class_opens_closes_and_reopens():
    applied = []
    plane = cp.AFDControlPlane(applied.append, Topology(1, 1), "ffn", 0, label="FFN rank 0 (world rank 0)")
    assert cp.ChannelControlPlane is cp.AFDControlPlane and not plane.is_open
    with pytest.raises(AFDStateError, match=r"FFN rank 0 \(world rank 0\)\) is not initialized"):
        plane.recv_dp_metadata_list()
    plane.update_state_from_dp_metadata("p")  # local: no channel needed
    assert applied == ["p"]
    for step in range(2):  # close() then a new attach, as close() / init_afd_connector() do
        rx, tx = _ring()
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
# Waiting: native poll while active (GIL released), blocking once idle
# ---------------------------------------------------------------------------


def _recv_in_thread(rx, out):
    t = threading.Thread(target=lambda: out.append(rx.recv(30.0)))
    t.start()
    return t


def test_active_receiver_polls_without_the_gil_then_blocks_once_idle():
    import sys

    assert cshm._native() is not None, "the compiled core lacks the native poll (rebuild afd_ext)"
    rx, tx = _ring(idle_s=0.5, heartbeat_timeout_s=60.0)
    old = sys.getswitchinterval()
    out: list[bytes] = []
    try:
        tx.send(b"first")
        assert rx.recv(1.0) == b"first"  # the engine is active from here
        sys.setswitchinterval(2.0)  # a GIL-holding poll would keep this thread out for 2 s
        t = _recv_in_thread(rx, out)
        time.sleep(0.05)
        t0 = time.monotonic()
        for _ in range(5):
            time.sleep(0.01)  # each return needs the GIL back
        assert time.monotonic() - t0 < 0.5
        assert rx._hdr[cshm._W_WAITING] == 0  # polling, not blocked
        deadline = time.monotonic() + 5
        while not rx._hdr[cshm._W_WAITING] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx._hdr[cshm._W_WAITING] == 1  # idle for idle_s: blocked on the doorbell
        tx.send(b"second")
        t.join(5)
        assert out == [b"second"]
    finally:
        sys.setswitchinterval(old)
        tx.close()
        rx.close()


def test_idle_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("AFD_CONTROL_IDLE_S", "2.5")
    assert cp.ChannelOptions.from_env().idle_s == 2.5
    assert cp.ChannelOptions.from_env(idle_s=0.0).idle_s == 0.0
    monkeypatch.setenv("AFD_CONTROL_IDLE_S", "-1")
    with pytest.raises(ValueError, match="AFD_CONTROL_IDLE_S"):
        cp.ChannelOptions.from_env()
    with pytest.raises(ValueError, match="idle_s"):
        cp.ChannelOptions(idle_s=-0.1)


# ---------------------------------------------------------------------------
# Faults: a corrupt ring, a malformed payload
# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", [None, 0.3])
def test_corrupt_slot_is_a_named_error_within_its_bound(timeout_s):
    rx, tx = _ring(slot_bytes=64, nslots=4)
    try:
        base = cring._HDR_BYTES
        cring._SLOT_FIELDS.pack_into(tx._mem.buf, base + 8, 10, 10, 1, 12345)  # CRC that never matches
        tx._seq[0][0] = 2  # published
        t0 = time.monotonic()
        with pytest.raises(cp.ControlProtocolError, match="slot 0 from FFN|slot 0 from attention") as e:
            rx.recv(timeout_s)
        elapsed = time.monotonic() - t0
        assert "corrupt" in str(e.value)
        bound = cring._CORRUPT_AFTER_S if timeout_s is None else timeout_s
        assert bound * 0.9 <= elapsed < bound + 1.0
    finally:
        tx.close()
        rx.close()


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


# ---------------------------------------------------------------------------
# The measurement (afd_ext.bench.control)
# ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("distinct", [False, True])
def test_measure_control_plane_reports_percentiles(distinct):
    from afd_ext.bench.control import measure_control_plane

    assert cp.measure_control_plane is measure_control_plane  # the old name still resolves
    r = measure_control_plane("shm", 200, warmup=20, distinct=distinct)
    assert r["kind"] == "shm" and r["n"] == 200 and r["distinct"] is distinct
    assert 0 < r["min_us"] <= r["p50_us"] <= r["p90_us"] <= r["p99_us"] <= r["max_us"]
    assert r["payload_bytes"] == 8 + 2 * (12 + 4 * 8)  # binary: 2 stages of 8 counts
    ph = r["phases"]  # the native stamps split the total: publish, poll saw it, taken, built
    assert set(ph) == {"send", "wake", "take", "build", "call", "encode", "gil", "made"}, ph
    # call start <= entered <= published <= seen <= GIL back <= taken <= returned: each a part of the total
    assert all(0 <= v["p50_us"] <= v["p99_us"] <= r["max_us"] for v in ph.values()), ph
    assert ph["send"]["p50_us"] > 0 and ph["build"]["p50_us"] > 0, ph
    assert ph["call"]["p50_us"] <= ph["send"]["p50_us"] and ph["gil"]["p50_us"] <= ph["take"]["p50_us"], ph


@pytest.mark.timeout(180)
def test_control_table_has_each_gap_channel_and_the_reference():
    from afd_ext.bench.control import control_table, format_control_table

    rounds = []
    rows = control_table((1.0, 2.0), ("shm",), seconds_per_cell=0.2, rounds=2,
                         on_round=lambda i, s: rounds.append(i))
    assert [r["gap_ms"] for r in rows] == [1.0, 2.0] and rounds == [0, 1]
    shm, ref = rows[0]["shm"], rows[0]["reference"]
    # each round measures half the steps; the cell pools them
    assert shm["kind"] == "shm" and ref["kind"] == "gloo" and shm["n"] == 200 and ref["n"] == 100
    assert shm["rounds"] == 2 and len(shm["p50_rounds_us"]) == 2 and rows[1]["shm"]["n"] == 200
    assert min(shm["p50_rounds_us"]) <= shm["p50_us"] <= max(shm["p50_rounds_us"])
    assert shm["steal_pct"] is None or 0.0 <= shm["steal_pct"] <= 100.0
    assert 0 < shm["p50_us"] <= shm["p99_us"] and 0 < ref["p50_us"] <= ref["p99_us"]
    with pytest.raises(AFDConfigError, match="rounds"):
        control_table((1.0,), ("shm",), rounds=0)
    text = format_control_table(rows, ("shm",))
    assert "| 1 ms |" in text and "reference pattern" in text
    assert f"{shm['p50_us']:.1f} / {shm['p99_us']:.1f}" in text


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_warm_receiver_rehearses_the_last_payload_natively_and_still_takes_the_real_one(kind):
    from afd_ext import metadata as md

    assert cshm._native() is not None, "the compiled core lacks the native poll (rebuild afd_ext)"
    with pytest.raises(ValueError, match="warm_s"):
        cp.ChannelOptions(warm_s=-1.0)
    opts = {"warm_s": 0.001, "idle_s": 30.0, "heartbeat_timeout_s": 60.0}
    rx, tx = _ring(**opts) if kind == "shm" else _tcp_pair(**opts)
    lim = (md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
    warm = rx._state.warm
    assert warm.warm_ns == 1_000_000 and tx._state.warm.warm_ns == 0  # the receiving end only
    out: list = []
    try:
        with pytest.raises(cp.ControlRecvTimeout):  # nothing taken yet: nothing to rehearse
            rx.recv_payload(0.05, "recv", *lim)
        assert warm.rehearsals == 0 and warm.last_len == 0
        tx.send_payload(_plain_payload(0, 8))
        assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(0, 8)
        assert warm.last_len == len(md.encode_control_binary(_plain_payload(0, 8)))
        t = threading.Thread(target=lambda: out.append(rx.recv_payload(30.0, "recv", *lim)))
        t.start()
        time.sleep(0.2)
        assert warm.rehearsals >= 5  # about one per warm_s while it waits
        assert warm.sender == 1 and warm.sends >= warm.rehearsals - 1  # the attention end's send too
        if kind == "tcp":  # and its recv() path, over the private loopback pair
            assert rx._pair is not None and tx._state.warm_tx == -1
            assert rx._state.warm_rounds >= warm.rehearsals - 1 > 0
        if kind == "shm":
            assert rx._hdr[cshm._W_READ_COUNT] == 1  # a rehearsal consumes nothing
            assert tx._state.k == 1 and tx._hdr[cshm._W_READ_COUNT] == 1  # nor sends on the real ring
        warm.sender = 0
        sends = warm.sends
        time.sleep(0.05)
        assert warm.sends == sends  # off: the take's path alone
        tx.send_payload(_plain_payload(1, 8))
        t.join(5)
        assert out == [_plain_payload(1, 8)]
        done = warm.rehearsals
        tx.send(b"not a control payload")  # raw bytes: kept by nobody, not rehearsed
        assert rx.recv(1.0) == b"not a control payload"
        # shm: the copy buffer held them; tcp: they were read into the other half of the read
        # buffer, so the last payload is still the one rehearsed (heartbeat reads leave it too).
        assert warm.last_len == (0 if kind == "shm" else len(md.encode_control_binary(_plain_payload(1, 8))))
        with pytest.raises(cp.ControlRecvTimeout):
            rx.recv(0.05)  # a raw wait (max_stages -1) rehearses nothing
        assert warm.rehearsals == done
    finally:
        tx.close()
        rx.close()


def test_a_shm_senders_keeper_reads_while_it_sends_rests_when_idle_and_stops_at_close():
    from afd_ext import metadata as md

    with pytest.raises(AFDConfigError, match="keep_s"):
        cp.ChannelOptions(keep_s=-1.0)
    rx, tx = _ring(keep_s=0.001, idle_s=0.3, warm_s=0.0)
    lim = (md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
    native = tx._native
    try:
        assert rx._keeper is None and tx._keeper is not None  # the sending end only
        keeper = tx._keeper
        for i in range(20):
            tx.send_payload(_plain_payload(i, 8))
            assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(i, 8)  # the keeper only reads
            time.sleep(0.005)
        active = native.keeper_passes(keeper)
        if len(os.sched_getaffinity(0)) > 1:
            assert active >= 20  # about one per keep_s while it sends
        else:
            assert active == -1  # no CPU but the sender's: it did not start
        time.sleep(0.6)  # idle_s without a send: it rests
        rested = native.keeper_passes(keeper)
        time.sleep(0.2)
        assert native.keeper_passes(keeper) == rested
        tx.send_payload(_plain_payload(99, 8))  # a send wakes it within its 50 ms rest
        assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(99, 8)
        time.sleep(0.2)
        if active >= 0:
            assert native.keeper_passes(keeper) > rested
        tx.close()  # with the capsule still held here: the ring's memory is let go all the same
        assert tx._keeper is None
        assert native.keeper_stop(keeper) == native.keeper_passes(keeper)  # stopped, idempotent
        with pytest.raises(TypeError):
            native.keeper_passes(object())
        with pytest.raises(ValueError, match="period_ns"):
            native.keeper_start(tx._state_addr, None, 0, 0)
    finally:
        tx.close()
        rx.close()


def test_a_tcp_senders_proxy_sends_while_it_sends_rests_when_idle_and_stops_at_close():
    from afd_ext import metadata as md

    from unittest import mock

    # The default (None) runs it where the process may use PROXY_MIN_CPUS CPUs: never on a small CI box.
    auto = cp.ChannelOptions()
    assert auto.tcp_proxy is None and cp.ChannelOptions(tcp_proxy=True, keep_s=0.0).proxy_on() is False
    for n in (1, 2, cp.PROXY_MIN_CPUS - 1, cp.PROXY_MIN_CPUS, 64):
        with mock.patch("os.sched_getaffinity", return_value=set(range(n))):
            assert auto.proxy_on() is (n >= cp.PROXY_MIN_CPUS)
            assert cp.ChannelOptions(tcp_proxy=False).proxy_on() is False
            assert cp.ChannelOptions(tcp_proxy=True).proxy_on() is True
            assert cp.ChannelOptions(keep_cpus=(3,)).proxy_on() is True  # a CPU given for it: asked for
    # A container's CPU quota bounds it (a 2-CPU quota on a 64-CPU host: no spare core).
    with mock.patch("os.sched_getaffinity", return_value=set(range(64))):
        for quota, on in ((2.0, False), (3.5, False), (4.0, True), (None, True)):
            with mock.patch("afd_ext.control.channel._cgroup_cpu_quota", return_value=quota):
                assert auto.proxy_on() is on, quota
    from afd_ext.control.channel import _cgroup_cpu_quota

    q = _cgroup_cpu_quota()  # this machine's: unlimited or a positive number of CPUs
    assert q is None or q > 0
    with pytest.raises(AFDConfigError, match="tcp_proxy"):
        cp.ChannelOptions(tcp_proxy=1)
    rx, tx = _tcp_pair(keep_s=0.001, idle_s=0.3, warm_s=0.0)
    try:
        assert tx._keeper is None and tx._pair is None
    finally:
        tx.close()
        rx.close()
    rx, tx = _tcp_pair(keep_s=0.001, idle_s=0.3, warm_s=0.0, tcp_proxy=True)
    lim = (md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
    native = tx._native
    several = len(os.sched_getaffinity(0)) > 1
    try:
        assert rx._keeper is None and rx._pair is None and tx._keeper is not None  # the sending end only
        proxy = tx._keeper
        assert tx._state.proxy and native.tcp_proxy_served(proxy) == 0
        tx.send_payload(_plain_payload(0, 8))  # it starts resting: this one the caller sends, and wakes it
        assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(0, 8)
        assert native.tcp_proxy_served(proxy) == 0
        time.sleep(0.15)
        for i in range(1, 30):
            _front_send(tx, _plain_payload(i, 8))
            assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(i, 8)  # in order, whole
            time.sleep(0.002)
        served = native.tcp_proxy_served(proxy)
        if several:  # most (on a loaded host a frame not taken within 1 ms is the caller's)
            assert served > 0 and native.keeper_passes(proxy) >= 10  # a round about every keep_s
        else:
            assert served == 0 and native.keeper_passes(proxy) == -1  # no CPU but the sender's
        time.sleep(0.6)  # idle_s without a send: it rests, and the next send is the caller's
        tx.send_payload(_plain_payload(99, 8))
        assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(99, 8)
        assert native.tcp_proxy_served(proxy) == served
        tx.close()  # with the capsule still held here: stopped, the end's memory let go all the same
        assert tx._keeper is None and not tx._state.proxy
        assert all(sk.fileno() == -1 for sk in tx._pair)
        assert native.keeper_stop(proxy) == native.keeper_passes(proxy)  # stopped, idempotent
        tx._state.proxy = 12345
        native.keeper_stop(proxy)
        assert tx._state.proxy == 12345  # a second stop leaves the end alone (its memory may be gone)
        with pytest.raises(TypeError):
            native.tcp_proxy_served(object())
        with pytest.raises(ValueError, match="period_ns"):
            native.tcp_proxy_start(rx._state_addr, None, 0, 0, 0, 0)
    finally:
        tx.close()
        rx.close()


# A subprocess's two channel pairs, shm (tx -> rx) and tcp (ttx -> trx), with ChannelOptions({opts}).
_ENDS = (
    "import os, socket, time, torch\n"
    "from afd_ext import control as cp, metadata as md\n"
    "o = cp.ChannelOptions({opts})\n"
    "rx = cp.ShmControlChannel.create('afd-sub-%d' % os.getpid(), local_rank=0, peer_rank=1, peer='a', options=o)\n"
    "tx = cp.ShmControlChannel.attach(rx.name, local_rank=1, peer_rank=0, peer='f', options=o)\n"
    "ls = socket.create_server(('127.0.0.1', 0)); a = socket.create_connection(ls.getsockname())\n"
    "b, _ = ls.accept()\n"
    "ttx = cp.TcpControlChannel(a, is_sender=True, local_rank=1, peer_rank=0, peer='f', options=o, abort_check=None)\n"
    "trx = cp.TcpControlChannel(b, is_sender=False, local_rank=0, peer_rank=1, peer='a', options=o, abort_check=None)\n"
)


def test_a_keeper_does_not_start_without_a_cpu_other_than_the_senders():
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        + _ENDS.format(opts="keep_s=0.001, idle_s=1.0, tcp_proxy=True") +
        "time.sleep(0.1)\n"
        "print('passes', tx._native.keeper_passes(tx._keeper), tx._native.keeper_passes(ttx._keeper))\n"
        "for c in (tx, rx, ttx, trx): c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "passes -1 -1" in out.stdout


def _threads_pinned_to(cpus: set[int]) -> int:
    """Threads of this process whose allowed CPUs are exactly ``cpus``."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            n += os.sched_getaffinity(int(tid)) == cpus
        except OSError:
            pass  # gone meanwhile
    return n


def test_keep_cpus_pins_the_keeper_or_proxy_and_a_cpu_not_allowed_keeps_it_from_starting(monkeypatch):
    for bad in ([], (-1,), ("3",), 3, (1.5,)):
        with pytest.raises(AFDConfigError, match="keep_cpus"):
            cp.ChannelOptions(keep_cpus=bad)
    assert cp.ChannelOptions(keep_cpus=[4, 3, 3]).keep_cpus == (3, 4)
    monkeypatch.setenv("AFD_CONTROL_KEEP_CPUS", "3,4")
    assert cp.ChannelOptions.from_env().keep_cpus == (3, 4)
    monkeypatch.setenv("AFD_CONTROL_KEEP_CPUS", "x")
    with pytest.raises(AFDConfigError, match="CPU numbers"):
        cp.ChannelOptions.from_env()
    monkeypatch.delenv("AFD_CONTROL_KEEP_CPUS")
    assert cp.ChannelOptions.from_env().keep_cpus is None
    monkeypatch.setenv("AFD_CONTROL_TCP_PROXY", "1")
    assert cp.ChannelOptions.from_env().tcp_proxy is True
    monkeypatch.setenv("AFD_CONTROL_TCP_PROXY", "0")
    assert cp.ChannelOptions.from_env().tcp_proxy is False
    for auto in ("", "auto", " AUTO "):
        monkeypatch.setenv("AFD_CONTROL_TCP_PROXY", auto)
        assert cp.ChannelOptions.from_env().tcp_proxy is None
    monkeypatch.setenv("AFD_CONTROL_TCP_PROXY", "maybe")
    with pytest.raises(AFDConfigError, match="boolean"):
        cp.ChannelOptions.from_env()
    monkeypatch.delenv("AFD_CONTROL_TCP_PROXY")
    assert cp.ChannelOptions.from_env().tcp_proxy is None  # unset: auto
    allowed = os.sched_getaffinity(0)
    mine = max(allowed)
    for pair in (_ring, _tcp_pair):
        rx, tx = pair(keep_s=0.001, idle_s=0.3, warm_s=0.0, keep_cpus=(mine,), tcp_proxy=True)
        try:
            time.sleep(0.05)
            assert tx._native.keeper_passes(tx._keeper) >= 0
            if len(allowed) > 1:
                assert _threads_pinned_to({mine}) == 1  # the keeper (or proxy): this thread keeps its mask
        finally:
            tx.close()
            rx.close()
        rx, tx = pair(keep_s=0.001, idle_s=0.3, warm_s=0.0, keep_cpus=(1023,), tcp_proxy=True)  # no such CPU
        try:
            time.sleep(0.05)
            assert tx._native.keeper_passes(tx._keeper) == -1
            p = _plain_payload(1, 8)
            tx.send_payload(p)  # sent all the same
            assert rx.recv_payload(1.0, "recv", 64, 64, 1 << 20) == p
        finally:
            tx.close()
            rx.close()
    with pytest.raises(TypeError, match="cpus"):
        cshm._native().keeper_start(1, None, 1, 1, [0])


def test_a_sender_on_its_proxys_cpu_sends_itself():
    from afd_ext import metadata as md

    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        rx, tx = _tcp_pair(keep_s=0.001, idle_s=30.0, warm_s=0.0, keep_cpus=(cpu,), tcp_proxy=True)
        lim = (md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
        try:
            tx.send_payload(_plain_payload(0, 8))  # wakes the proxy, on this CPU
            assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(0, 8)
            time.sleep(0.15)
            took = 0.0
            for i in range(1, 21):
                t0 = time.monotonic()
                tx.send_payload(_plain_payload(i, 8))
                took += time.monotonic() - t0
                assert rx.recv_payload(1.0, "recv", *lim) == _plain_payload(i, 8)
            # handed over, each would wait out the 1 ms bound: the proxy cannot run while the caller spins
            assert tx._native.tcp_proxy_served(tx._keeper) == 0 and took < 0.01, took
        finally:
            tx.close()
            rx.close()
    finally:
        os.sched_setaffinity(0, before)


def test_a_tcp_receivers_round_sends_at_most_its_zero_frame_after_a_large_payload():
    import socket

    from afd_ext import metadata as md

    rx, tx = _tcp_pair(warm_s=0.001, idle_s=30.0)
    lim = (md.DEFAULT_MAX_STAGES, 4096, 1 << 20)
    big = AFDControlPayload({0: AFDDPMetadata(list(range(3000)))})  # 12 KB: Python encodes, C builds
    a, b = socket.socketpair()
    try:
        tx.send_payload(big)
        assert rx.recv_payload(1.0, "recv", *lim) == big
        assert rx._state.warm.last_len > 4096
        rx._state.warm_tx = a.fileno()  # the rounds' frames come here instead
        rounds = rx._state.warm_rounds
        with pytest.raises(cp.ControlRecvTimeout):
            rx.recv_payload(0.05, "recv", *lim)
        n = rx._state.warm_rounds - rounds
        b.setblocking(False)
        got = b""
        with contextlib.suppress(BlockingIOError):
            while True:
                got += b.recv(1 << 20)
        assert n > 0 and got and set(got) == {0}  # the zero frame only, nothing read past it
        assert len(got) <= n * (20 + 2048)
    finally:
        rx._state.warm_tx = -1
        a.close()
        b.close()
        tx.close()
        rx.close()


def test_a_forked_child_lets_its_copies_of_the_keepers_go_and_sends_itself():
    # The child has the capsules but not the threads: they count as not running, its sends are its own,
    # and stopping one lets it go without a join.
    code = (
        _ENDS.format(opts="keep_s=0.001, idle_s=30.0, heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0, "
                          "tcp_proxy=True") +
        "p = md.AFDControlPayload({0: md.AFDDPMetadata([1, 2])})\n"
        "lim = (md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)\n"
        "ttx.send_payload(p); assert trx.recv_payload(1.0, 'recv', *lim) == p\n"
        "time.sleep(0.2)  # the proxy spins now\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    n = ttx._native\n"
        "    served = n.tcp_proxy_served(ttx._keeper)\n"
        "    ok = n.keeper_passes(ttx._keeper) == n.keeper_passes(tx._keeper) == -1  # not running here\n"
        "    ttx.send_payload(p)  # sent by the child itself\n"
        "    ok = ok and n.tcp_proxy_served(ttx._keeper) == served\n"
        "    ttx._native.keeper_stop(ttx._keeper); tx._native.keeper_stop(tx._keeper)\n"
        "    # its own proxy after that (a thread of the child's may reuse the parent's handle)\n"
        "    ls2 = socket.create_server(('127.0.0.1', 0)); a2 = socket.create_connection(ls2.getsockname())\n"
        "    b2, _ = ls2.accept()\n"
        "    t2 = cp.TcpControlChannel(a2, is_sender=True, local_rank=1, peer_rank=0, peer='f', options=o, abort_check=None)\n"
        "    r2 = cp.TcpControlChannel(b2, is_sender=False, local_rank=0, peer_rank=1, peer='a', options=o, abort_check=None)\n"
        "    t2.send_payload(p); ok = ok and r2.recv_payload(1.0, 'recv', *lim) == p\n"
        "    t2.close(); r2.close()\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert trx.recv_payload(5.0, 'recv', *lim) == p\n"
        "print('child', os.waitstatus_to_exitcode(status), ttx._native.keeper_passes(ttx._keeper) != -1)\n"
        "for c in (tx, rx, ttx, trx): c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"child 0 {len(os.sched_getaffinity(0)) > 1}" in out.stdout  # and the parent's proxy runs on


def test_warm_period_comes_from_the_environment(monkeypatch):
    assert cp.ChannelOptions().warm_s == 0.0005
    monkeypatch.setenv("AFD_CONTROL_WARM_S", "0")
    assert cp.ChannelOptions.from_env().warm_s == 0.0
    assert cp.ChannelOptions.from_env(warm_s=0.002).warm_s == 0.002


def test_rehearsing_receiver_leaves_the_gil_to_other_threads():
    import sys

    from afd_ext import metadata as md

    rx, tx = _ring(idle_s=30.0, warm_s=0.0005, heartbeat_timeout_s=60.0)
    parts = md.control_payload_parts(_payload(0, 8))
    old = sys.getswitchinterval()
    out: list = []
    try:
        tx.send_parts(parts)
        rx.recv_payload(1.0, "recv", md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
        sys.setswitchinterval(2.0)  # a receiver that kept the GIL would keep this thread out for 2 s
        t = threading.Thread(target=lambda: out.append(md.control_payload_parts(
            rx.recv_payload(30.0, "recv", md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20))))
        t.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        for _ in range(5):
            time.sleep(0.01)  # each return needs the GIL back
        assert time.monotonic() - t0 < 0.5
        tx.send_parts(parts)
        t.join(5)
        assert out == [parts]
    finally:
        sys.setswitchinterval(old)
        tx.close()
        rx.close()


def test_a_waiting_receivers_periodic_checks_are_jittered_so_they_never_line_up_with_the_step_gap():
    # A fixed 50 ms liveness check counted from each wait's start met a 50 ms step gap at every
    # step (GPU run 18: ~60 us on the p50); the checks' due times spread over period +- 50 %.
    from afd_ext.control.channel import _due_in

    due = [_due_in(0.05) for _ in range(400)]
    assert all(0.025 <= d < 0.075 for d in due)
    assert max(due) - min(due) > 0.04  # spread over most of the window, not one phase


def assert_built_as_decoded(got, data):
    """A payload the native take built is the object the Python decoder builds from ``data``:
    the same classes, stage order, flags and every AFDDPMetadata slot (unset ones None)."""
    from afd_ext import metadata as md

    want = md.decode_control_binary(data)
    assert type(got) is md.AFDControlPayload and type(got.dp_metadata_list) is dict
    assert list(got.dp_metadata_list) == list(want.dp_metadata_list)
    for name in md._FLAG_NAMES:
        assert getattr(got, name) is getattr(want, name)
    for s, w in want.dp_metadata_list.items():
        g = got.dp_metadata_list[s]
        assert type(g) is md.AFDDPMetadata and type(s) is int
        for slot in md.AFDDPMetadata.__slots__:
            assert getattr(g, slot) == getattr(w, slot) and type(getattr(g, slot)) is type(getattr(w, slot)), slot
        assert type(g._counts) is tuple and all(type(c) is int for c in g._counts)
        assert g.num_tokens_across_dp_cpu.tolist() == list(w.counts)  # the runners' view works


def _native_payloads():
    def md(counts, mx=None):
        return AFDDPMetadata(list(counts), mx)

    return [
        AFDControlPayload(dp_metadata_list={0: md([3, 5])}),
        AFDControlPayload(dp_metadata_list={1: md([0, 0, 0]), 0: md([7, 1, 2], 9)}, is_warmup=True),  # keys out of order
        AFDControlPayload(dp_metadata_list={s: md(range(s, s + 8)) for s in (5, 2, 9, 0)}, is_graph_replaying=True,
                          is_profile=True, is_graph_capturing=True),
        AFDControlPayload(dp_metadata_list={}),
        AFDControlPayload(dp_metadata_list={0: md([2**31 - 1])}),
    ]


def test_the_native_whole_payload_send_matches_the_checked_python_encoding():
    """ShmControlChannel.send_payload reads a plain payload's fields in one native call; the
    receiver must see exactly what control_payload_parts (the checked Python path) produces."""
    from afd_ext.control.channel import _native
    from afd_ext.metadata import control_payload_parts

    if _native() is None:
        pytest.fail("the compiled core has no native control path (rebuild afd_ext)")
    rx, tx = _ring()
    try:
        for p in _native_payloads():
            calls = []
            orig = tx._native.send_payload
            tx._native.send_payload = lambda *a: calls.append(orig(*a)) or calls[-1]
            try:
                tx.send_payload(p)
            finally:
                tx._native.send_payload = orig
            assert calls == [0], calls  # the native path took it (no fallback)
            got = rx.recv_payload(1.0, "recv_dp_metadata_list", 64, 4096, 1 << 20)
            assert control_payload_parts(got) == control_payload_parts(p)
    finally:
        tx.close()
        rx.close()


def test_payloads_the_native_send_does_not_take_go_the_checked_python_way():
    """Tensor-backed counts (read in place by the Python path), another payload class (the
    reference's), and a non-bool flag: the native call declines (-2, nothing written); the
    first two arrive intact, the bad flag is a named error and nothing is sent."""
    from afd_ext.errors import AFDConfigError
    from afd_ext.metadata import control_payload_parts

    class ReferencePayload:  # the reference plugin's field names, another class
        def __init__(self, dp):
            self.dp_metadata_list = dp
            self.is_graph_capturing = self.is_warmup = self.is_graph_replaying = self.is_profile = False

    rx, tx = _ring()
    try:
        t = torch.tensor([4, 0, 6], dtype=torch.int32)
        tensor_backed = AFDControlPayload(dp_metadata_list={0: AFDDPMetadata(t)})
        t[1] = 2  # in place, after construction: the Python path reads it
        for p, want in ((tensor_backed, (0, ((0, 6, (4, 2, 6)),))),
                        (ReferencePayload({1: AFDDPMetadata([1, 2])}), (0, ((1, 2, (1, 2)),)))):
            assert tx._native.send_payload(tx._state_addr, p) == -2
            tx.send_payload(p)
            got = rx.recv_payload(1.0, "recv_dp_metadata_list", 64, 4096, 1 << 20)
            assert control_payload_parts(got) == want == control_payload_parts(p)
        bad = AFDControlPayload(dp_metadata_list={0: AFDDPMetadata([1])})
        bad.is_warmup = 1
        sent = tx._count
        assert tx._native.send_payload(tx._state_addr, bad) == -2
        with pytest.raises(AFDConfigError, match="flags must be bools"):
            tx.send_payload(bad)
        assert tx._count == sent  # nothing was published
    finally:
        tx.close()
        rx.close()


def test_a_message_whose_sender_gave_up_mid_way_is_a_named_error_within_its_bound():
    """A three-slot message with no reader: the sender publishes two slots, waits for space and gives
    up (PeerDeadError); the receiver then reads the two and must not wait for the third forever (the
    sender is alive, its heartbeat fresh): a ControlProtocolError within heartbeat_timeout_s."""
    from afd_ext.errors import ControlProtocolError, PeerDeadError

    rx, tx = _ring(slot_bytes=64, nslots=2, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.1)
    try:
        with pytest.raises(PeerDeadError):
            tx.send_payload(AFDControlPayload(dp_metadata_list={0: AFDDPMetadata([1] * 40)}))
        t0 = time.monotonic()
        with pytest.raises(ControlProtocolError, match="stopped after 128 of"):
            rx.recv(None)
        assert time.monotonic() - t0 < 2.0
    finally:
        tx.close()
        rx.close()


def test_the_checks_jitter_leaves_the_users_random_sequence_alone():
    import random

    from afd_ext.control.channel import _due_in

    random.seed(1234)
    want = [random.random() for _ in range(3)]
    random.seed(1234)
    for _ in range(5):
        _due_in(0.05)
    assert [random.random() for _ in range(3)] == want


# ---------------------------------------------------------------------------
# The native per-step path: one call to send, the payload built by the take
# ---------------------------------------------------------------------------

_counts_st = st.lists(st.integers(0, 2**31 - 1), max_size=12)


@st.composite
def _payloads(draw):
    keys = draw(st.lists(st.integers(0, 2**32 - 1), max_size=6, unique=True))
    dp = {k: AFDDPMetadata(draw(_counts_st)) for k in keys}
    flags = {n: draw(st.booleans()) for n in ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile")}
    return AFDControlPayload(dp_metadata_list=dp, **flags)


@settings(max_examples=150, deadline=None)
@given(p=_payloads())
def test_the_native_take_builds_what_the_python_decoder_builds(p):
    """The one-call send and the native take (encode and build in C) against the Python codec."""
    from afd_ext import metadata as md

    data = md.encode_control_binary(p)
    nat = cshm._native()
    built = nat.parse(data, md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS)
    assert built is not None
    assert_built_as_decoded(built, data)
    rx, tx = _ring()
    try:
        _front_send(tx, p)
        got = rx.recv_payload(1.0, "recv_dp_metadata_list", md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
        assert_built_as_decoded(got, data)
    finally:
        tx.close()
        rx.close()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=80), seed=_payloads(), cut=st.integers(0, 200), flip=st.integers(0, 255))
def test_the_native_parser_refuses_what_the_python_decoder_refuses(data, seed, cut, flip):
    """Malformed bytes: the native builder declines (None) exactly where the decoder raises."""
    from afd_ext import metadata as md

    good = md.encode_control_binary(seed)
    for d in (data, good[:cut], good[:cut] + bytes([flip]) + good[cut + 1:], good + bytes([flip])):
        try:
            md.decode_control_binary(d, max_stages=4, max_ranks=8)
            ok = True
        except ValueError:
            ok = False
        built = cshm._native().parse(bytes(d), 4, 8)
        assert (built is not None) == ok, d
        if ok:
            assert_built_as_decoded(built, bytes(d))


def _front_send(tx, payload) -> None:
    """Send ``payload`` through the channel's per-step front; fail if it fell back to the checked path."""
    fell = []
    tx.send_front(None, fell.append)(payload)
    assert fell == []


def _plain_payload(step: int, A: int) -> AFDControlPayload:
    """As :func:`_payload`, the counts given as lists (what the one-call native send takes)."""
    p = _payload(step, A)
    return AFDControlPayload({s: AFDDPMetadata(list(md.counts)) for s, md in p.dp_metadata_list.items()},
                             is_warmup=p.is_warmup)


def _tcp_pair(**opts):
    import socket

    ls = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    o = cp.ChannelOptions(**{**FAST, "heartbeat_timeout_s": 60.0, "heartbeat_interval_s": 30.0, **opts})
    rx = cp.TcpControlChannel(b, is_sender=False, local_rank=0, peer_rank=1, peer="attention rank 0",
                              options=o, abort_check=None)
    tx = cp.TcpControlChannel(a, is_sender=True, local_rank=1, peer_rank=0, peer="FFN rank 0",
                              options=o, abort_check=None)
    a.settimeout(o.heartbeat_timeout_s)
    return rx, tx


def test_tcp_native_send_and_take_build_the_payload_past_heartbeats_and_a_partial_send():
    from afd_ext import metadata as md
    from afd_ext.control import tcp as ctcp

    lim = (md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, 1 << 20)
    rx, tx = _tcp_pair()
    try:
        fast = functools.partial(tx._native.tcp_send_payload, tx._state_addr)  # the front's one native send (0: sent)
        assert tx.send_front(None, print) is not None and rx.send_front(None, print) is None
        p = _plain_payload(3, 8)
        assert fast(p) == 0
        got = rx.recv_payload(1.0, "recv_dp_metadata_list", *lim)
        assert_built_as_decoded(got, md.encode_control_binary(p))
        # Heartbeat frames in front of the data frame, read together: skipped natively.
        tx._send_frame(ctcp._T_HEARTBEAT)
        tx._send_frame(ctcp._T_HEARTBEAT)
        assert fast(_plain_payload(4, 8)) == 0
        time.sleep(0.05)
        got = rx.recv_payload(1.0, "recv_dp_metadata_list", *lim)
        assert_built_as_decoded(got, md.encode_control_binary(_plain_payload(4, 8)))
        # A data frame followed by more bytes goes the Python way, intact, in order.
        assert fast(_plain_payload(5, 8)) == 0
        tx.send(b"raw")
        time.sleep(0.05)
        assert md.decode_control_binary(rx.recv_payload(1.0, "recv_dp_metadata_list", *lim)) == _plain_payload(5, 8)
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", *lim) == b"raw"
        # A frame the socket takes in part (its buffer full, the receiver not reading): the native
        # send waits for room (GIL released) and sends the rest before anything else goes out.
        big = AFDControlPayload({st: AFDDPMetadata(list(range(64))) for st in range(4)})
        sent, got = [0], []

        def drain():
            time.sleep(0.3)
            while len(got) < sent[0] or sent[0] == 0:
                got.append(rx.recv_payload(5.0, "recv_dp_metadata_list", *lim))

        th = threading.Thread(target=drain)
        th.start()
        while tx._state.send_rests == 0 and sent[0] < 100_000:
            assert fast(big) == 0
            sent[0] += 1
        tx.send(b"after")  # a frame from Python waits for the lock: after the whole frame
        th.join(10)
        assert tx._state.send_rests == 1 and len(got) == sent[0] > 1
        assert all((md.decode_control_binary(g) if type(g) is bytes else g) == big for g in got)
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", *lim) == b"after"
        # Without the compiled core's functions the checked Python path sends it.
        real, tx._native = tx._native, None
        tx.send_payload(_plain_payload(7, 8))
        tx._native = real
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", *lim) == _plain_payload(7, 8)
        # A closed end declines (nothing is sent, nothing is touched); the checked path names it.
        tx.close()
        assert fast(p) == -2
        with pytest.raises(AFDStateError, match="closed tcp control channel"):
            tx.send_payload(p)
    finally:
        tx.close()
        rx.close()


def test_the_shm_send_front_declines_once_closed_and_the_plane_stops_using_it():
    rx, tx = _ring()
    fell = []
    front = tx.send_front(None, fell.append)
    assert front is not None and rx.send_front(None, fell.append) is None
    plane = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, channels={0: tx})
    assert vars(plane)["send_dp_metadata_list"].channel is tx  # bound to the native front
    plane.send_dp_metadata_list(_plain_payload(0, 4))
    assert rx.recv_payload(1.0, "recv_dp_metadata_list", 64, 64, 1 << 20) == _plain_payload(0, 4)
    plane.close()  # closes tx: its native state is unmapped; the front must not touch it
    assert "send_dp_metadata_list" not in vars(plane)
    front(_plain_payload(1, 4))
    assert fell == [_plain_payload(1, 4)]  # declined: handed to the checked path, nothing written
    with pytest.raises(AFDStateError, match="not initialized"):
        plane.send_dp_metadata_list(_plain_payload(1, 4))
    rx.close()


def test_the_send_front_checks_first_and_hands_what_it_declines_to_the_checked_path():
    from afd_ext.errors import AFDProtocolError

    rx, tx = _ring()
    checked, fell = [], []

    def check(p):
        checked.append(p)
        if p.is_warmup:
            raise AFDProtocolError("not the payload applied")

    front = tx.send_front(check, fell.append)
    try:
        good = _plain_payload(2, 4)
        assert front(good) is None and checked == [good] and fell == []
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", 64, 64, 1 << 20) == good
        bad = AFDControlPayload({0: AFDDPMetadata([1, 2])}, is_warmup=True)
        with pytest.raises(AFDProtocolError, match="not the payload applied"):
            front(bad)
        assert fell == []  # the check's error is raised, nothing sent
        held = AFDControlPayload({0: AFDDPMetadata(torch.tensor([3, 4], dtype=torch.int32))})
        front(held)  # counts held as a tensor: not the plain case, the checked path's
        assert fell == [held]
        with pytest.raises(cp.ControlRecvTimeout):
            rx.recv_payload(0.05, "recv_dp_metadata_list", 64, 64, 1 << 20)
    finally:
        tx.close()
        rx.close()


def test_a_slot_larger_than_max_message_bytes_leaves_the_checks_to_python():
    # The native take refuses a message above max_message_bytes (-2) so the Python path names it.
    rx, tx = _ring(max_message_bytes=64)
    try:
        tx_opts = cp.ChannelOptions(**{**FAST, "max_message_bytes": 4096})
        tx.options = tx_opts
        tx.send(b"x" * 100)
        with pytest.raises(ControlProtocolError, match="above max_message_bytes=64"):
            rx.recv(1.0)
    finally:
        tx.close()
        rx.close()


def test_a_kept_one_call_send_keeps_its_channel_alive_and_declines_once_it_is_closed():
    """send_front() holds the channel (its native state and mapping): dropping every other reference
    must not leave the call writing through a freed RingState (review: a use-after-free)."""
    import gc
    import weakref

    rx, tx = _ring()
    fell = []
    fast = tx.send_front(None, fell.append)
    ref = weakref.ref(tx)
    del tx
    gc.collect()
    assert ref() is not None  # kept by the callable
    fast(_plain_payload(0, 4))
    assert fell == []
    assert rx.recv_payload(1.0, "recv_dp_metadata_list", 64, 64, 1 << 20) == _plain_payload(0, 4)
    ref().close()
    fast(_plain_payload(1, 4))
    assert fell == [_plain_payload(1, 4)]  # declined: nothing touched
    del fast, fell
    gc.collect()
    assert ref() is None
    rx.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_the_planes_max_payload_bytes_bounds_a_natively_built_payload(kind):
    rx, tx = _ring() if kind == "shm" else _tcp_pair()
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx}, max_payload_bytes=64)
    att = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, channels={0: tx})
    try:
        att.send_dp_metadata_list(AFDControlPayload({0: AFDDPMetadata([1, 2, 3])}))  # 32 bytes: fine
        assert ffn.recv_dp_metadata_list().dp_metadata_list[0].counts == (1, 2, 3)
        att.send_dp_metadata_list(AFDControlPayload({0: AFDDPMetadata(list(range(60)))}))  # 260 bytes
        with pytest.raises(ControlProtocolError, match="260 bytes exceed max_payload_bytes=64"):
            ffn.recv_dp_metadata_list()
    finally:
        att.close()
        ffn.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_receiver_closed_by_another_thread_while_it_waits_gets_a_named_error_at_once(kind):
    # One thread per end is the rule; breaking it must still end in a named error, not a raw
    # TypeError (shm) or a spin until the heartbeat timeout (tcp).
    opts = {"idle_s": 30.0, "heartbeat_timeout_s": 20.0, "heartbeat_interval_s": 1.0}
    rx, tx = _ring(**opts) if kind == "shm" else _tcp_pair(**opts)
    lim = (64, 64, 1 << 20)
    _front_send(tx, _plain_payload(0, 4))
    rx.recv_payload(1.0, "recv_dp_metadata_list", *lim)
    out = {}

    def wait():
        t0 = time.monotonic()
        try:
            rx.recv_payload(None, "recv_dp_metadata_list", *lim)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["e"] = e
        out["t"] = time.monotonic() - t0

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    rx.close()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(out.get("e"), AFDStateError) and "closed" in str(out["e"]), out
    assert time.monotonic() - t0 < 2.0, out
    tx.close()


def test_the_ffn_planes_first_wait_slice_returns_a_payload_straight_from_the_native_take(monkeypatch):
    from afd_ext.control import channel as cch

    rx, tx = _ring(idle_s=30.0, heartbeat_timeout_s=60.0)
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx}, recv_timeout_s=5.0)
    att = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, channels={0: tx})
    checked = []
    orig = rx.recv_payload
    rx.recv_payload = lambda *a: checked.append(a[0]) or orig(*a)  # the channel's checked path
    try:
        assert vars(ffn)["recv_dp_metadata_list"].channel is rx  # bound to the native front

        def later(step, after):
            time.sleep(after)
            att.send_dp_metadata_list(_plain_payload(step, 4))

        threading.Thread(target=later, args=(0, 0.02)).start()
        assert ffn.recv_dp_metadata_list() == _plain_payload(0, 4) and checked == []  # within the slice
        monkeypatch.setattr(cch, "_FIRST_SLICE_S", 0.02)
        threading.Thread(target=later, args=(1, 0.2)).start()
        assert ffn.recv_dp_metadata_list() == _plain_payload(1, 4)  # after the slice: the checked path
        assert checked == [5.0]  # the step's timeout, counted from the start of the wait
    finally:
        att.close()
        ffn.close()
    assert "recv_dp_metadata_list" not in vars(ffn)


def test_the_first_wait_slice_is_skipped_once_idle_and_counts_against_the_step_timeout():
    rx, tx = _ring(idle_s=0.05, heartbeat_timeout_s=60.0)
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx}, recv_timeout_s=0.3)
    orig, calls = rx.first_slice_ns, []  # the front's prepare asks the channel for its slice

    def counted(*a):
        calls.append(orig(*a))
        return calls[-1]

    rx.first_slice_ns = counted
    try:
        t0 = time.monotonic()
        with pytest.raises(cp.ControlRecvTimeout, match="0.3 s"):
            ffn.recv_dp_metadata_list()
        assert 0.29 < time.monotonic() - t0 < 0.5  # not the slice plus the timeout
        assert len(calls) == 1 and 0 < calls[0] <= 0.05e9  # polled only until idle_s after the last payload
        time.sleep(0.06)
        with pytest.raises(cp.ControlRecvTimeout):
            ffn.recv_dp_metadata_list()
        assert calls[1:] == [0]  # idle: no native slice, the checked path blocks
        tx.send_payload(_plain_payload(0, 4))
        assert ffn.recv_dp_metadata_list() == _plain_payload(0, 4)
    finally:
        tx.close()
        ffn.close()


def test_the_take_front_returns_a_built_payload_and_hands_everything_else_to_its_fallback():
    from afd_ext.errors import AFDProtocolError

    rx, tx = _ring(idle_s=30.0, heartbeat_timeout_s=60.0)
    ns, fell = [0], []
    front = rx.take_front(64, 64, lambda: ns[0], lambda taken: fell.append(taken) or "checked")
    try:
        assert front() == "checked" and fell == [None]  # no slice: nothing taken, straight to the fallback
        ns[0] = int(0.02e9)
        t0 = time.monotonic()
        assert front() == "checked" and fell[1:] == [-1]  # nothing came within the slice
        assert 0.015 < time.monotonic() - t0 < 1.0
        tx.send_payload(_plain_payload(1, 4))
        assert front() == _plain_payload(1, 4) and len(fell) == 2  # built and returned from C
        tx.send(b"AFDb\x01\x00\x01\x00garbage")
        assert front() == "checked" and fell[2:] == [b"AFDb\x01\x00\x01\x00garbage"]  # consumed, for the decoder

        def refuse():
            raise AFDProtocolError("prepare refused")

        with pytest.raises(AFDProtocolError, match="prepare refused"):
            rx.take_front(64, 64, refuse, fell.append)()
        assert len(fell) == 3
        tx.send_payload(_plain_payload(2, 4))
        assert front() == _plain_payload(2, 4)  # the next step still works
    finally:
        tx.close()
        rx.close()


def test_the_front_objects_refuse_bad_arguments_before_anything_moves_and_free_their_cycles():
    """The fronts are one native object each (SendFront / TakeFront): a wrong call is a TypeError with
    nothing sent or consumed, the next call works, and a plane holding its fronts (which hold its
    bound methods) is freed by the collector."""
    import gc
    import weakref

    from afd_ext.control.channel import _native

    nat = _native()
    rx, tx = _ring(idle_s=30.0, heartbeat_timeout_s=60.0)
    try:
        with pytest.raises(TypeError, match=r"SendFront\(ring_address, check, fallback, owner\)"):
            nat.send_front(tx._state_addr, None, print)
        with pytest.raises(ValueError, match="SendFront"):
            nat.send_front(0, None, print, tx)  # no ring
        with pytest.raises(TypeError, match="TakeFront"):
            nat.take_front(rx._state_addr, print, print, rx, 64)
        fell = []
        send = tx.send_front(None, fell.append)
        take = rx.take_front(64, 64, lambda: int(1e9), fell.append)
        assert type(send).__name__ == "SendFront" and send.channel is tx and take.channel is rx
        with pytest.raises(AttributeError):
            send.channel = rx  # read-only
        with pytest.raises(TypeError, match=r"send_front\(payload\)"):
            send()
        with pytest.raises(TypeError, match=r"send_front\(payload\)"):
            send(_plain_payload(0, 4), payload=1)
        with pytest.raises(TypeError, match="no arguments"):
            take(1)
        assert fell == []  # nothing sent, nothing taken
        send(_plain_payload(3, 4))
        assert take() == _plain_payload(3, 4) and fell == []  # the next step works

        # Each cycle runs through one slot only: a slot the collector does not visit leaves it alive.
        held = []  # check -> held -> plane: a cycle through the front's check
        sender = cp.AFDControlPlane(lambda p: held, Topology(1, 1), "attention", 0, channels={0: tx})
        held.append(sender)
        assert type(vars(sender)["send_dp_metadata_list"]).__name__ == "SendFront"
        ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx})
        assert type(vars(ffn)["recv_dp_metadata_list"]).__name__ == "TakeFront"  # -> ffn via prepare, fallback
        refs = [weakref.ref(sender), weakref.ref(ffn)]
        del sender, ffn, held
        gc.collect()
        assert [r() for r in refs] == [None, None]  # plane -> front -> plane: cycles the collector frees
    finally:
        tx.close()
        rx.close()


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_signal_ends_a_long_native_wait_at_once_and_the_next_take_works(kind):
    # The native wait runs the signal handlers between its rehearsal slices (as time.sleep does):
    # Ctrl-C must not wait for a slice of up to 0.1 s (or a caller's longer one) to end.
    rx, tx = _ring(idle_s=30.0, heartbeat_timeout_s=60.0) if kind == "shm" else _tcp_pair(idle_s=30.0)
    lim = (64, 64, 1 << 20)
    old = signal.getsignal(signal.SIGUSR1)

    def handler(signum, frame):
        raise _Interrupted

    signal.signal(signal.SIGUSR1, handler)
    try:
        tx.send_payload(_plain_payload(0, 4))
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", *lim) == _plain_payload(0, 4)  # kept: rehearsed
        if kind == "shm":
            wait = rx.take_front(64, 64, lambda: int(5e9), lambda taken: pytest.fail(f"fell back: {taken!r}"))
        else:
            def wait():
                return rx._native.tcp_take(rx._state_addr, int(5e9), 64, 64)
        sent = []
        threading.Timer(0.2, lambda: sent.append(time.monotonic()) or os.kill(os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(_Interrupted):
            wait()
        assert time.monotonic() - sent[0] < 0.5  # not the 5 s slice
        tx.send_payload(_plain_payload(1, 4))  # nothing was consumed: the next step still works
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", *lim) == _plain_payload(1, 4)
    finally:
        signal.signal(signal.SIGUSR1, old)
        tx.close()
        rx.close()


def test_reattaching_an_open_plane_drops_the_previous_channels_fronts():
    # review: a front left bound to the old ring received (or sent) on the old channel
    rx1, tx1 = _ring(idle_s=30.0, heartbeat_timeout_s=60.0)
    rx2, tx2 = _tcp_pair(idle_s=30.0)
    rxa, txa = _ring()
    rxb, txb = _ring(slot_bytes=1024, max_message_bytes=512)  # no send front: a slot exceeds the bound
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx1})
    att = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, channels={0: txa})
    try:
        ffn.attach({0: rx2})
        assert vars(ffn)["recv_dp_metadata_list"].channel is rx2  # the new channel's front, not the old ring's
        tx1.send_payload(_plain_payload(11, 4))  # the old ring, still open
        tx2.send_payload(_plain_payload(22, 4))
        assert ffn.recv_dp_metadata_list() == _plain_payload(22, 4)
        att.attach({0: txb})
        assert "send_dp_metadata_list" not in vars(att)
        att.send_dp_metadata_list(_plain_payload(3, 4))
        assert rxb.recv_payload(1.0, "recv_dp_metadata_list", 64, 64, 1 << 20) == _plain_payload(3, 4)
    finally:
        for c in (rx1, tx1, rx2, tx2, rxa, txa, rxb, txb):
            c.close()


def test_a_subclass_or_a_patch_of_the_per_step_calls_stays_in_use():
    from unittest import mock

    class Counting(cp.AFDControlPlane):
        sent = 0

        def send_dp_metadata_list(self, payload):
            Counting.sent += 1
            super().send_dp_metadata_list(payload)

    rx, tx = _ring()
    try:
        sub = Counting(lambda p: None, Topology(1, 1), "attention", 0, channels={0: tx})
        sub.send_dp_metadata_list(_plain_payload(0, 4))
        assert Counting.sent == 1 and "send_dp_metadata_list" not in vars(sub)
        assert rx.recv_payload(1.0, "recv_dp_metadata_list", 64, 64, 1 << 20) == _plain_payload(0, 4)
        with mock.patch.object(cp.AFDControlPlane, "send_dp_metadata_list") as m:
            att = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, channels={0: tx})
            att.send_dp_metadata_list(_plain_payload(1, 4))
            assert m.called
    finally:
        tx.close()
        rx.close()


def test_the_tcp_fronts_return_a_payload_from_c_consume_heartbeats_and_fall_back_in_order():
    from afd_ext.control import tcp as ctcp

    op, lim = "recv_dp_metadata_list", (64, 64, 1 << 20)
    rx, tx = _tcp_pair(idle_s=30.0)
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx})
    att = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, channels={0: tx})
    fell: list = []

    def checked(taken):  # the caller's checked path, recorded
        fell.append(taken)
        return rx.recv_payload(1.0, op, *lim)

    try:
        take, send = vars(ffn)["recv_dp_metadata_list"], vars(att)["send_dp_metadata_list"]
        assert type(take).__name__ == "TcpTakeFront" and take.channel is rx
        assert type(send).__name__ == "TcpSendFront" and send.channel is tx
        send(_plain_payload(0, 4))  # the plane's fronts: sent and taken in C
        assert take() == _plain_payload(0, 4)
        front = rx.take_front(64, 64, lambda: int(2e9), checked)
        # Heartbeat frames alone during the wait are consumed in C (liveness stamped); the wait goes on.
        seen = rx._state.t_ns
        threading.Timer(0.05, lambda: (tx._send_frame(ctcp._T_HEARTBEAT), time.sleep(0.05),
                                       tx.send_payload(_plain_payload(1, 4)))).start()
        assert front() == _plain_payload(1, 4) and fell == [] and rx._state.t_ns > seen
        assert rx._state.msg_ns >= rx._state.t_ns > seen  # the idle clock: the payload's
        # A read that is not one payload (a raw frame, then a payload): kept for the framing, in order;
        # the next front call takes no native slice while the rest is buffered (it would wait 2 s).
        tx.send(b"raw")
        tx.send_payload(_plain_payload(2, 4))
        time.sleep(0.05)
        assert front() == b"raw" and fell == [None] and rx._state.pending == 1
        t0 = time.monotonic()
        from afd_ext import metadata as md  # the Python framing hands bytes on: the plane decodes them

        assert md.decode_control_binary(front()) == _plain_payload(2, 4)
        assert fell == [None, None] and rx._state.pending == 0
        assert time.monotonic() - t0 < 1.0
        # Nothing within the slice: the checked path gets the int and waits on.
        short = rx.take_front(64, 64, lambda: int(1e6), checked)
        threading.Timer(0.1, lambda: tx.send_payload(_plain_payload(3, 4))).start()
        assert short() == _plain_payload(3, 4) and fell[-1] == -1
        # A send the native path declines (another payload class) goes to the fallback, in order.
        class Other(AFDControlPayload):
            pass

        declined: list = []
        tx.send_front(None, declined.append)(Other({0: AFDDPMetadata([1, 2, 3, 4])}))
        assert len(declined) == 1 and type(declined[0]) is Other
        # What the check raises propagates, nothing sent.
        def refuse(payload):
            raise AFDConfigError("refused")

        with pytest.raises(AFDConfigError, match="refused"):
            tx.send_front(refuse, declined.append)(_plain_payload(4, 4))
        send(_plain_payload(5, 4))
        assert take() == _plain_payload(5, 4) and len(declined) == 1
    finally:
        tx.close()
        ffn.close()


def test_a_tcp_close_during_a_partly_sent_frame_lets_it_finish_before_the_goodbye():
    # review (helper 11): close() cut a frame the native send was finishing; the goodbye then
    # followed half a frame and the FFN read a broken stream instead of a clean close.
    import socket

    rx, tx = _tcp_pair()
    rx._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    tx._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    p = AFDControlPayload({st: AFDDPMetadata([(a * 3 + st) % 5 for a in range(64)]) for st in range(4)})
    errs: list = []

    def sender():
        try:
            for _ in range(100_000):
                tx.send_payload(p)
        except Exception as e:  # noqa: BLE001 - the close's error, checked below
            errs.append(e)

    ts = threading.Thread(target=sender)
    ts.start()
    try:
        deadline = time.monotonic() + 10
        while not (tx._state.send_rests and tx._state.send_lock) and time.monotonic() < deadline:
            time.sleep(0.001)  # until a native rest waits for room
        assert tx._state.send_rests and tx._state.send_lock
        tc = threading.Thread(target=tx.close)
        tc.start()
        time.sleep(0.2)
        n = 0
        with pytest.raises(cp.ControlChannelClosed):
            while True:
                got = rx.recv_payload(5.0, "recv_dp_metadata_list", 64, 64, 1 << 20)
                assert (md_decode(got) if type(got) is bytes else got) == p
                n += 1
        tc.join(10)
        ts.join(10)
        assert n > 0 and not tc.is_alive() and not ts.is_alive()
        assert len(errs) == 1 and isinstance(errs[0], AFDStateError), errs  # the sender: "closed", named
    finally:
        tx.close()
        rx.close()


def md_decode(data: bytes):
    from afd_ext import metadata as md

    return md.decode_control_binary(data)


def test_a_tcp_heartbeat_skips_a_beat_while_a_long_send_holds_the_lock_and_an_idle_wait_blocks():
    # review (helper 11): a lock held past heartbeat_timeout_s ended the heartbeat thread for good
    # (the FFN then declared a live sender dead); an idle receiver's blocking wait woke every 1 ms
    # once heartbeats were read natively (its clock ignored TcpState.t_ns).
    rx, tx = _tcp_pair(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5, idle_s=0.0)
    tx._start_heartbeat()

    class Count:
        def __init__(self, poller):
            self.poller, self.n = poller, 0

        def poll(self, ms):
            self.n += 1
            return self.poller.poll(ms)

    try:
        assert tx._native.tcp_lock(tx._state_addr, 0)
        time.sleep(0.8)  # as a long send would
        tx._native.tcp_unlock(tx._state_addr)
        time.sleep(0.2)
        assert tx._hb_thread.is_alive()
        rx._poller = Count(rx._poller)
        with pytest.raises(cp.ControlRecvTimeout):  # alive and idle, not dead
            rx.recv(1.5)
        assert rx._poller.n < 100, rx._poller.n  # blocks between heartbeats (1 ms wakes: ~1500)
    finally:
        tx.close()
        rx.close()


def test_a_tcp_frame_left_part_sent_breaks_the_stream_and_nothing_more_goes_out():
    from afd_ext.errors import PeerDeadError

    rx, tx = _tcp_pair()
    try:
        with pytest.raises(PeerDeadError, match="TCP send buffer full"):
            tx._send_failed(-4)  # the native send left a frame part-sent
        assert tx._broken and tx._state.fd == -1  # the native sends decline from now on
        assert tx._native.tcp_send_payload(tx._state_addr, _plain_payload(0, 4)) == -2
        with pytest.raises(PeerDeadError, match="left part-sent"):
            tx.send_payload(_plain_payload(0, 4))
        assert tx._beat() is False  # the heartbeat thread ends
    finally:
        tx.close()
        rx.close()


def test_the_tcp_fronts_name_a_reset_connection_and_a_closed_end():
    import socket
    import struct

    from afd_ext.errors import PeerDeadError

    rx, tx = _tcp_pair(idle_s=30.0)
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx})
    try:
        # The sender's socket reset (SO_LINGER 0): the front's read fails, named with the peer.
        tx._hb_stop.set()
        tx._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        os.close(tx._sock.detach())
        with pytest.raises(PeerDeadError, match="attention rank 0.*(connection lost|closed without)"):
            ffn.recv_dp_metadata_list()
        # The failure codes of a native send, named (never the raw code).
        tx2_rx, tx2 = _tcp_pair()
        try:
            with pytest.raises(PeerDeadError, match="FFN rank 0.*TCP send buffer full"):
                tx2._send_failed(-4)
            tx2._state.send_err = 104
            with pytest.raises(PeerDeadError, match="FFN rank 0.*connection lost"):
                tx2._send_failed(-5)
            with pytest.raises(AFDStateError, match="send proxy"):
                tx2._send_failed(-3)
            tx2.close()
            with pytest.raises(AFDStateError, match="closed tcp control channel"):
                tx2._send_failed(-4)
        finally:
            tx2.close()
            tx2_rx.close()
        # A closed end: the front declines, the checked path names it.
        ffn.close()
        with pytest.raises(AFDStateError):
            ffn.recv_dp_metadata_list()
    finally:
        ffn.close()
        rx.close()
        tx._closed = True  # its socket is gone: nothing to close


@given(st.binary(max_size=2100), st.integers(0, 2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_the_native_crc32_is_zlibs(data, value):
    # The native sends and takes fold whole 16-byte blocks with carry-less multiplies where the CPU
    # has them, the rest through a table; the Python ring paths use zlib: the two must agree.
    import zlib

    from afd_ext import _C

    assert _C.ctrl_crc32(data, value) == zlib.crc32(data, value)


def test_a_message_the_first_slice_cannot_build_is_named_by_the_decoder_not_returned():
    # The first slice takes (consumes) whatever is published; bytes it could not build must still
    # meet the decoder's checks: a malformed payload, one above max_stages, one above max_payload_bytes.
    from afd_ext import metadata as md

    rx, tx = _ring(idle_s=30.0, heartbeat_timeout_s=60.0)  # an active receiver: the first slice runs
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx}, max_payload_bytes=1100)
    try:
        tx.send(b"AFDb\x01\x00\x01\x00garbage")
        with pytest.raises(ControlProtocolError, match="malformed control payload from attention rank 0"):
            ffn.recv_dp_metadata_list()
        many = AFDControlPayload({s: AFDDPMetadata([1]) for s in range(md.DEFAULT_MAX_STAGES + 1)})
        tx.send(md.encode_control_binary(many))
        with pytest.raises(ControlProtocolError, match="65 stages exceed max_stages=64"):
            ffn.recv_dp_metadata_list()
        tx.send(b"raw")
        assert rx.recv(1.0) == b"raw"  # a raw receive widens the native bounds to max_message_bytes ...
        tx.send_payload(AFDControlPayload({0: AFDDPMetadata(list(range(300)))}))  # 1220 bytes
        with pytest.raises(ControlProtocolError, match="1220 bytes exceed max_payload_bytes=1100"):
            ffn.recv_dp_metadata_list()  # ... and the first slice applies the plane's again
        tx.send_payload(_plain_payload(0, 4))
        assert ffn.recv_dp_metadata_list() == _plain_payload(0, 4)  # the next step still works
    finally:
        tx.close()
        ffn.close()


def test_a_channel_closed_during_the_first_slice_names_the_planes_op():
    rx, tx = _ring(idle_s=30.0, heartbeat_timeout_s=60.0)
    ffn = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, channels={0: rx})
    out = {}

    def wait():
        try:
            ffn.recv_dp_metadata_list()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["e"] = e

    try:
        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.03)  # inside the first slice
        rx.close()
        t.join(5)
        assert isinstance(out.get("e"), AFDStateError), out
        assert str(out["e"]).startswith("recv_dp_metadata_list on a closed shm control channel"), out
    finally:
        tx.close()
        ffn.close()
