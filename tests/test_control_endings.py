"""How a control channel's life ends (issue 41 items 1, 3, 4, 5; shm and tcp): nothing published is lost, a local close
ends every call on the closing rank promptly with a named error, a closed receiver is named at once, a sender
dead mid-message is named dead. Senders that must really exit run in their own process."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from interleave import interleave  # noqa: E402
from test_control_plane import ATTN, FAST, FFN, _message, _pair, _payload, _ring  # noqa: E402

from afd_ext import control as cp  # noqa: E402
from afd_ext.control import channel as cchannel  # noqa: E402
from afd_ext.control import shm as cshm  # noqa: E402
from afd_ext.errors import AFDClosedError, AFDError  # noqa: E402
from afd_ext.topology import Topology  # noqa: E402

pytestmark = pytest.mark.timeout(120)
SLOW_DEATH = dict(heartbeat_timeout_s=60.0)  # only a named end, never the heartbeat, can end these waits in time


def _sender(name: str, go: "mp.synchronize.Event", how: str, opts: dict) -> None:
    """A sending end in its own process: attach, wait for ``go``, then end as ``how`` says and exit."""
    tx = cp.ShmControlChannel.attach(name, local_rank=1, peer_rank=0, peer=FFN,
                                     options=cp.ChannelOptions(**opts), abort_check=None)
    assert go.wait(60)
    if how == "publish-close-exit":  # AttentionExchange.shutdown()'s order: the last payload, close, exit
        tx.send(_message(5, 40))
        tx.close()
    else:  # "die-mid-message": the ring fills in the middle of a message; the process is killed there
        tx.send(_message(6, 1000))


def _ring_with_sender(how: str, **opts):
    """(receiver end, the go event, the sender's process), the sender attached."""
    opts = {**FAST, **opts}
    rx = cp.ShmControlChannel.create(f"afd-test-{os.getpid()}", local_rank=0, peer_rank=1, peer=ATTN,
                                     options=cp.ChannelOptions(**opts), abort_check=None)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    proc = ctx.Process(target=_sender, args=(rx.name, go, how, opts), daemon=True)
    proc.start()
    try:
        rx.wait_attached(time.monotonic() + 60)
    except BaseException:
        proc.kill()
        rx.close()
        raise
    return rx, go, proc


def _u64(ch, off: int) -> int:
    return int.from_bytes(ch._mm[off:off + 8], "little")


def _exited(proc, go=None) -> int:
    if go is not None:
        go.set()
    proc.join(30)
    assert proc.exitcode is not None, "the sender process did not exit"
    return proc.exitcode


# ---------------------------------------------------------------- item 1: nothing published is lost


def test_a_payload_published_before_the_senders_close_and_exit_is_received_not_lost():
    """The sender publishes, closes in order and its process exits while the receiver is between two wait
    slices (held just before its peer check): the payload comes first, then ControlChannelClosed (was:
    PeerDeadError "its process exited", the payload lost)."""
    rx, go, proc = _ring_with_sender("publish-close-exit")
    try:
        got, _ = interleave(lambda: rx.recv(10.0), (cchannel.ControlChannel.recv, "self._check_peer(op)"),
                            lambda: _exited(proc, go), timeout_s=60, settle_s=60)
        assert proc.exitcode == 0
        assert got.error is None and got.value == _message(5, 40), got
        with pytest.raises(cp.ControlChannelClosed, match=re.escape(f"{ATTN} closed the control channel")):
            rx.recv(5.0)
    finally:
        proc.kill()
        rx.close()


def test_the_senders_state_and_write_count_are_read_in_one_ordered_native_call():
    """The receiver's peer check reads both ends' states and the unread count in one native call (the
    ordering rule of docs/internals.md), never as separate Python reads of the header words."""
    with _pair("shm") as (rx, tx):
        assert rx._C.ctrl_shm_ends(rx._mm) == (cshm._STATE_ATTACHED, 0, 0)
        tx.send(b"x")
        assert rx._C.ctrl_shm_ends(rx._mm) == (cshm._STATE_ATTACHED, 0, 1)
        tx.close()
        assert rx._C.ctrl_shm_ends(rx._mm) == (cshm._STATE_CLOSED, 0, 1)
        assert rx.recv(1.0) == b"x"
        rx.close()
    assert not hasattr(cshm, "_W_WRITE_COUNT") and not hasattr(cshm.ShmControlChannel, "_sender_done")


# ---------------------------------------------------------------- item 5: dead mid-message


def test_a_sender_killed_mid_message_is_a_dead_peer_not_a_protocol_error():
    """A 1000-byte message over a 2-slot ring of 64-byte slots: the sender's process is killed while it waits
    for room in the middle; the receiver takes what was published, then raises PeerDeadError naming the
    sender (was: ControlProtocolError "gave up mid-message", which posts the step abort)."""
    rx, go, proc = _ring_with_sender("die-mid-message", slot_bytes=64, nslots=2, **SLOW_DEATH)
    try:
        go.set()
        deadline = time.monotonic() + 30
        while _u64(rx, 144) - _u64(rx, 64) < 2:  # write count - read count: the ring is full, the sender waits
            assert time.monotonic() < deadline and proc.is_alive()
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert _exited(proc) == -signal.SIGKILL
        t0 = time.monotonic()
        with pytest.raises(cp.PeerDeadError, match=re.escape(f"peer {ATTN} is dead: its process exited")) as e:
            rx.recv(None)
        assert e.value.peer == ATTN and e.value.op == "recv_dp_metadata_list"
        assert time.monotonic() - t0 < 2.0
    finally:
        proc.kill()
        rx.close()


# ---------------------------------------------------------------- item 4: a closed receiver is named at once


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_sends_after_the_receivers_orderly_close_fail_at_once_naming_it(kind):
    """The FFN end closes in order (an unread payload in its socket: tcp resets the connection): the next send
    (every one after it too) is ControlChannelClosed naming the FFN rank, at once (was: shm, nslots sends into
    a ring nobody reads, then heartbeat_timeout_s and "dead"; tcp, one send into the socket, then PeerDeadError
    "connection lost")."""
    with _pair(kind, nslots=4, **SLOW_DEATH) as (rx, tx):
        tx.send_payload(_payload(0, 1))
        rx.close()
        plane = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "attention", 0, {0: tx})
        for send in [lambda: plane.send_dp_metadata_list(_payload(1, 1)), lambda: tx.send(b"x" * 500)] * 3:
            t0 = time.monotonic()
            with pytest.raises(cp.ControlChannelClosed, match=re.escape(f"send_dp_metadata_list: {FFN} closed")) as e:
                send()
            assert e.value.peer == FFN and time.monotonic() - t0 < 0.5


# ---------------------------------------------------------------- item 3: a local close races a call


def test_a_plane_closed_between_its_open_check_and_its_channel_read_raises_the_closed_error():
    """recv_dp_metadata_list held just before it reads its channel while another thread closes the plane:
    AFDClosedError (was: AttributeError 'NoneType' object has no attribute 'recv')."""
    rx, tx = _ring(idle_s=0.0, **SLOW_DEATH)
    try:
        plane = cp.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn", 0, {0: rx})
        got, closed = interleave(plane.recv_dp_metadata_list,
                                 (cp.AFDControlPlane.recv_dp_metadata_list,
                                  ".recv(self.recv_timeout_s, _OP_RECV, self.max_payload_bytes)"), plane.close)
        assert closed.error is None
        assert isinstance(got.error, AFDClosedError) and "closed" in str(got.error), got
        assert got.ended_at - got.released_at < 0.5
    finally:
        tx.close()


def test_a_shm_sender_blocked_on_a_full_ring_ends_promptly_when_another_thread_closes_it():
    """The ring is full and the send waits for room; another thread closes the sending end: AFDClosedError at
    once (was: ValueError 'operation forbidden on released memoryview object', or a wait of
    heartbeat_timeout_s)."""
    with _pair("shm", slot_bytes=64, nslots=2, **SLOW_DEATH) as (rx, tx):
        tx.send(b"a")
        tx.send(b"b")
        got, closed = interleave(lambda: tx.send(b"c"), (cshm.ShmControlChannel._wait_space, "self._peer_gone()"),
                                 tx.close)
        assert closed.error is None
        assert isinstance(got.error, AFDClosedError) and "closed" in str(got.error), got
        assert got.ended_at - got.released_at < 0.5
        out: list = []  # and without a forced interleaving: the close ends a wait in progress
    with _pair("shm", slot_bytes=64, nslots=2, **SLOW_DEATH) as (rx, tx):
        tx.send(b"a")
        tx.send(b"b")
        t = threading.Thread(target=lambda: out.append(_outcome(lambda: tx.send(b"c"))))
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        tx.close()
        t.join(5)
        assert isinstance(out[0], AFDClosedError) and time.monotonic() - t0 < 0.5, out


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def _receiver(kind: str, conn, go: "mp.synchronize.Event", how: str) -> None:
    """An FFN (receiving) end in its own process: open, tell ``conn`` where, wait for ``go``; then close in order
    and exit ("close-exit"), or wait to be killed."""
    kw = dict(local_rank=0, peer_rank=1, peer=ATTN, options=cp.ChannelOptions(**{**FAST, **SLOW_DEATH}),
              abort_check=None)
    if kind == "shm":
        rx = cp.ShmControlChannel.create(f"afd-test-{os.getpid()}", **kw)
        conn.send(rx.name)
        rx.wait_attached(time.monotonic() + 60)
    else:
        ls = socket.create_server(("127.0.0.1", 0))
        conn.send(ls.getsockname()[:2])
        rx = cp.TcpControlChannel.accept(ls, time.monotonic() + 60, token=b"t", **kw)
    assert go.wait(60)
    if how == "close-exit":
        rx.close()
    else:
        time.sleep(60)


@pytest.mark.parametrize("kind,how", [("shm", "close-exit"), ("tcp", "close-exit"), ("tcp", "killed")])
def test_a_sender_is_told_its_receivers_process_closed_in_order_or_died(kind, how):
    """The FFN process closes its end in order and exits (or is killed, tcp): every send after it raises at once
    ControlChannelClosed naming the FFN rank (a death: PeerDeadError), not heartbeat_timeout_s later (was, tcp:
    the first send succeeded into the socket, the next raised PeerDeadError "connection lost")."""
    ctx = mp.get_context("spawn")
    go, (here, there) = ctx.Event(), ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(kind, there, go, how), daemon=True)
    proc.start()
    try:
        while not here.poll(0.1):
            assert proc.is_alive(), proc.exitcode  # the receiver failed to open its end
        where, opts = here.recv(), cp.ChannelOptions(**{**FAST, **SLOW_DEATH})
        kw = dict(local_rank=1, peer_rank=0, peer=FFN, options=opts, abort_check=None)
        tx = (cp.ShmControlChannel.attach(where, **kw) if kind == "shm"
              else cp.TcpControlChannel.connect(where, time.monotonic() + 60, b"t", **kw))
        tx.send(_message(1, 40))
        if how == "killed":  # killed as it waits for go: setting go then would wait for the dead waiter
            os.kill(proc.pid, signal.SIGKILL)
        _exited(proc, go if how == "close-exit" else None)
        want = cp.ControlChannelClosed if how == "close-exit" else cp.PeerDeadError
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(want, match=re.escape(f"send_dp_metadata_list: {FFN} closed" if how == "close-exit"
                                                     else f"peer {FFN} is dead")) as e:
                tx.send(_message(2, 40))
            assert e.value.peer == FFN and time.monotonic() - t0 < 0.5
        tx.close()
    finally:
        proc.kill()


# ---------------------------------------------------------------- a local close: bounded, once


@pytest.mark.parametrize("blocked", ["send", "heartbeat"])
def test_a_tcp_close_from_another_thread_ends_a_send_blocked_on_a_full_socket_at_once(blocked):
    """The receiver reads nothing; a 32 MiB send (or, the socket filled, a heartbeat frame) waits for socket
    space, holding the send lock; another thread closes the sending end: close() returns within a second, the
    send ends with AFDClosedError (was: close waited heartbeat_timeout_s for the send lock, or 5 s for the
    heartbeat thread)."""
    with _pair("tcp", heartbeat_timeout_s=10.0, max_message_bytes=64 << 20) as (rx, tx):
        out: list = []
        t = threading.Thread(target=lambda: out.append(_outcome(lambda: tx.send(b"x" * (32 << 20)))))
        if blocked == "send":
            t.start()
        else:  # raw frames (the receiver reads none) until the heartbeat thread's frame waits for space
            tx._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            deadline = time.monotonic() + 20
            while not tx._lock.locked():
                assert time.monotonic() < deadline, "the socket did not fill"
                while tx._C.ctrl_tcp_send(tx._fd, 2, 1, b"x" * 65536, 1 << 20) is True:
                    pass
                time.sleep(0.05)
        time.sleep(0.5)
        assert tx._lock.locked(), out  # the send or the heartbeat is blocked: the socket is full
        t0 = time.monotonic()
        tx.close()
        closed_in = time.monotonic() - t0
        assert closed_in < 1.0, closed_in
        if blocked == "send":
            t.join(5)
            assert not t.is_alive() and type(out[0]) is AFDClosedError and "closed" in str(out[0]), out
        assert not tx._hb_thread.is_alive()


@pytest.mark.parametrize("end", ["receiver", "sender"])
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_two_threads_closing_one_end_close_it_once_without_an_error(kind, end):
    """One close() held just after its look at the closed flag while another thread closes the end: both return,
    no error (was, shm: TypeError from the second close stopping a ring the first had released)."""
    with _pair(kind, **SLOW_DEATH) as (rx, tx):
        ch = rx if end == "receiver" else tx
        first, second = interleave(ch.close, (cchannel.ControlChannel.close, 'self._users.append("close")'), ch.close)
        assert first.error is None and second.error is None, (first, second)
        assert ch.closed and not ch._users
