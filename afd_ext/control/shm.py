"""The shared-memory ring channel (both ends on one host); layout in :mod:`afd_ext.control`.

The ring's memory (segment, header words, slots, the seqlock publish and
copy) and the doorbell are :mod:`.ring`; this module is the channel over it:
its two ends, the waiting policy, liveness and the native path.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from afd_ext import rendezvous as rdzv
from afd_ext.errors import ControlChannelClosed, ControlProtocolError, PeerDeadError
from afd_ext.rendezvous import AFDStore

from .channel import (
    MAX_NATIVE_WAIT_NS,
    _ABORT_EVERY_S,
    _FALLBACK_SPIN_S,
    _LIVENESS_EVERY_S,
    _due_in,
    _ns,
    _MAX_SLEEP_S,
    _MIN_SLEEP_S,
    _OP_RECV,
    _OP_SEND,
    ChannelOptions,
    ControlChannel,
    ControlRecvTimeout,
    RingState,
    _native,
    _proc_start_time,
    logger,
)
from .ring import (
    _STATE_CLOSED,
    _STATE_NEW,
    _W_HEARTBEAT,
    _W_READ_COUNT,
    _W_RECEIVER_PID,
    _W_RECEIVER_START,
    _W_SENDER_PID,
    _W_SENDER_START,
    _W_SENDER_STATE,
    _W_WAITING,
    Doorbell,
    RingMemory,
)


class ShmControlChannel(ControlChannel):
    """Shared-memory SPSC ring between two processes on one host (see the module doc).

    Build it with :meth:`create` (receiver / FFN end) and :meth:`attach`
    (sender / attention end), or through :func:`open_control_channels`.
    """

    kind = "shm"

    def __init__(self, mem: RingMemory, *, owner: bool, **kw):
        super().__init__(**kw)
        self._mem = mem
        self._owner = owner
        # The hot paths' views of the ring, one attribute away.
        self._hdr = mem.hdr
        self._seq = mem.seq
        self._nslots = mem.nslots
        self._slot_bytes = mem.slot_bytes
        # The native path's view of this end (the anchors pin the mapping and the copy buffer).
        self._native = _native()
        self._anchor: Any = ctypes.c_char.from_buffer(mem.buf)
        self._out = bytearray(self._slot_bytes)
        self._out_anchor: Any = (ctypes.c_char * self._slot_bytes).from_buffer(self._out)
        self._state = RingState(hdr=ctypes.addressof(self._anchor), nslots=self._nslots, stride=mem.stride,
                                slot_bytes=self._slot_bytes, out=ctypes.addressof(self._out_anchor), k=0,
                                local_rank=self.local_rank, expect_sender=self.peer_rank, bell_fd=-1,
                                max_msg=self.options.max_message_bytes)
        self._state.warm.arm(self.is_sender, self.options)
        self._state_ref = ctypes.byref(self._state)
        self._state_addr = ctypes.addressof(self._state)
        self._keeper: Any = None  # a sender's keeper (ChannelOptions.keep_s), holding the ring's memory
        if self.is_sender and self.options.keep_s > 0 and self._native is not None:
            self._keeper = self._native.keeper_start(self._state_addr, (self._state, self._anchor),
                                                     _ns(self.options.keep_s), _ns(self.options.idle_s),
                                                     self.options.keep_cpus)
        self._peer_pid = 0
        self._peer_start = 0
        self._unlinked = False
        self._bell: Doorbell | None = None

    # -- construction -----------------------------------------------------------

    @classmethod
    def create(cls, name_prefix: str, *, local_rank: int, peer_rank: int, peer: str,
               options: ChannelOptions, abort_check=None) -> "ShmControlChannel":
        """Create the ring (receiver end). The name is ``name_prefix`` + random hex."""
        mem = RingMemory.create(name_prefix, options)
        ch = cls(mem, owner=True, is_sender=False, local_rank=local_rank, peer_rank=peer_rank,
                 peer=peer, options=options, abort_check=abort_check)
        ch._bell = Doorbell.bind(mem.segment.name)
        return ch

    @classmethod
    def attach(cls, name: str, *, local_rank: int, peer_rank: int, peer: str,
               options: ChannelOptions, abort_check=None) -> "ShmControlChannel":
        """Attach to a ring created by the receiver (sender end) and start the heartbeat.

        Raises:
            RuntimeError: the segment is missing (the two ends do not share
                ``/dev/shm``: use kind ``"tcp"``) or not an AFD control ring.
        """
        mem = RingMemory.attach(name, peer)
        ch = cls(mem, owner=False, is_sender=True, local_rank=local_rank, peer_rank=peer_rank,
                 peer=peer, options=options, abort_check=abort_check)
        ch._peer_pid = ch._hdr[_W_RECEIVER_PID]
        ch._peer_start = ch._hdr[_W_RECEIVER_START]
        ch._bell = Doorbell.for_sender(name)
        if ch._bell is not None:  # the native publish rings it
            ch._bell.fill_native(ch._state)
        ch._start_heartbeat()
        return ch

    def wait_attached(self, deadline: float, store: AFDStore | None = None) -> None:
        """Receiver: wait until the sender attached, then unlink the name (nothing can leak)."""
        sleep = 0.001
        while self._hdr[_W_SENDER_STATE] == _STATE_NEW:
            if store is not None:
                rdzv.raise_if_aborted(store, op=f"waiting for {self.peer} to attach the control ring")
            if time.monotonic() > deadline:
                raise rdzv.RendezvousTimeoutError(
                    f"{self.peer} did not attach the shared-memory control ring in time",
                    missing=(self.peer_rank,), what="control channel attach",
                )
            time.sleep(sleep)
            sleep = min(2 * sleep, 0.05)
        self._peer_pid = self._hdr[_W_SENDER_PID]
        self._peer_start = self._hdr[_W_SENDER_START]
        self._unlink()

    def _unlink(self) -> None:
        if self._owner and not self._unlinked:
            self._unlinked = True
            try:
                self._mem.segment.unlink()
            except FileNotFoundError:
                pass

    @property
    def _count(self) -> int:
        """Messages (slots) sent (sender) or consumed (receiver): the native state's one count."""
        return self._state.k

    @_count.setter
    def _count(self, k: int) -> None:
        self._state.k = k

    @property
    def name(self) -> str:
        """The segment's name (unlinked from ``/dev/shm`` once both ends attached)."""
        return self._mem.segment.name

    # -- heartbeat -----------------------------------------------------------------

    def _beat(self) -> bool:
        try:
            self._hdr[_W_HEARTBEAT] = time.monotonic_ns()
        except (ValueError, TypeError):  # released during close
            return False
        return True

    def _peer_gone(self) -> bool:
        if not self._peer_pid:
            return False
        start = _proc_start_time(int(self._peer_pid))
        return start is None or (self._peer_start and start != self._peer_start)

    # -- data path -------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self._require(True, "send")
        n = len(data)
        self._check_len(n)
        sb = self._slot_bytes
        nat = self._native
        if nat is not None and n <= sb and type(data) is bytes:
            r = nat.shm_publish(self._state_ref, data, n)  # advances the count, rings the doorbell
            if r == -1:  # ring full
                self._wait_space(self._count)
                r = nat.shm_publish(self._state_ref, data, n)
                if r == -1:
                    raise PeerDeadError(self.peer, _OP_SEND, "the control ring stayed full")
            return
        nfrag = max(1, -(-n // sb))
        mv = memoryview(data)
        hdr = self._hdr
        hdr[_W_HEARTBEAT] = time.monotonic_ns()
        for i in range(nfrag):
            k = self._count
            if k - hdr[_W_READ_COUNT] >= self._nslots:
                self._wait_space(k)
            self._mem.publish(k, mv[i * sb:min(n, (i + 1) * sb)], n, self.local_rank)
            self._count = k + 1
            # A full fence (the lock's atomic instruction) orders the publish before
            # the read of the receiver's waiting flag (store->load, Dekker style);
            # the receiver's side is ordered by its drain syscall.
            with self._fence_lock:
                pass
            if hdr[_W_WAITING]:
                self._ring()

    def send_parts(self, parts: tuple[int, tuple]) -> None:
        if not self._native_publish(self._native and self._native.send, *parts):
            super().send_parts(parts)

    def send_payload(self, payload: Any) -> None:
        # One native call reads, checks, encodes and publishes a plain payload; anything else
        # (or a payload that needs more than one slot) takes the checked Python path.
        if not self._native_publish(self._native and self._native.send_payload, payload):
            super().send_payload(payload)

    def _native_publish(self, publish: Any, *args: Any) -> bool:
        """Publish through a native send (``ctrl_send`` / ``ctrl_send_payload``: it advances the count
        and rings the doorbell); False: nothing was written, the caller takes the Python path (no
        native core, a message larger than a slot, or a value the Python encoder must name)."""
        # The native send writes one slot: only when a slot never exceeds the message bound.
        if not publish or self._slot_bytes > self.options.max_message_bytes:
            return False
        self._require(True, "send")
        r = publish(self._state_addr, *args)
        if r == -1:  # ring full
            self._wait_space(self._count)
            r = publish(self._state_addr, *args)
        return r == 0

    def _poll_until(self) -> float:
        # The last payload's time: a native take stamps it (CLOCK_MONOTONIC, as time.monotonic()).
        return max(self._last_msg, self._state.t_ns * 1e-9) + self.options.idle_s

    def take_front(self, max_stages: int, max_ranks: int, prepare: Any, fallback: Any) -> Any:
        if self._native is None or self.is_sender:
            return None
        # One native object per front (it holds this channel: the state and its mapping live as long).
        return self._native.take_front(self._state_addr, prepare, fallback, self, max_stages, max_ranks)

    def send_front(self, check: Any, fallback: Any) -> Any:
        if self._native is None or self._slot_bytes > self.options.max_message_bytes or not self.is_sender:
            return None
        # One C call per step; whatever needs send_payload's checks (ring full, closed, not plain) goes there.
        return self._native.send_front(self._state_addr, check, fallback, self)

    def _ring(self) -> None:
        if self._bell is not None:
            self._bell.ring()

    def _wait_space(self, k: int) -> None:
        deadline = time.monotonic() + self.options.heartbeat_timeout_s
        sleep = _MIN_SLEEP_S
        while k - self._hdr[_W_READ_COUNT] >= self._nslots:
            if self._peer_gone():
                raise PeerDeadError(self.peer, _OP_SEND, "its process exited (control ring full)")
            if time.monotonic() > deadline:
                raise PeerDeadError(
                    self.peer, _OP_SEND,
                    f"it consumed no control payload for {self.options.heartbeat_timeout_s:.1f} s "
                    f"with {self._nslots} ring slots full",
                )
            time.sleep(sleep)
            sleep = min(2 * sleep, _MAX_SLEEP_S)

    def _taken(self) -> Any:
        """Native: take the published next message if it is a whole single-slot message from the
        expected sender (it advances the count). Returns it (bytes, or built per ``self._limits``),
        or None: read it in Python, which names a problem."""
        r = self._native.take(self._state_addr, 0, *self._limits)
        return None if type(r) is int else r

    def _wait_slot(self, k: int, timeout_s: float | None, op: str, deadline: float | None = None) -> Any:
        """Wait for message ``k`` until ``deadline`` (default: ``timeout_s`` from now; monotonic s);
        returns it if the native path took it, else None (published: read it)."""
        slot = k % self._nslots
        seq = self._seq[slot]
        want = 2 * k + 2
        native = self._native
        if seq[0] == want:
            return None if native is None else self._taken()
        now = time.monotonic()
        if deadline is None and timeout_s is not None:
            deadline = now + timeout_s
        next_live = now + _due_in(_LIVENESS_EVERY_S)
        next_abort = now + _due_in(_ABORT_EVERY_S)
        # While the engine is active keep polling (see the module doc), then block.
        poll_until = self._poll_until()
        if native is None:
            poll_until = min(poll_until, now + _FALLBACK_SPIN_S)
        sleep = _MIN_SLEEP_S
        hb_timeout_ns = int(self.options.heartbeat_timeout_s * 1e9)
        bell = self._bell
        hdr = self._hdr
        waiting = False
        try:
            while True:
                if now < poll_until:
                    end = min(poll_until, next_live, next_abort)  # the native take rehearses meanwhile
                    if deadline is not None:
                        end = min(end, deadline)
                    if native is not None:
                        r = native.take(self._state_addr, min(int((end - now) * 1e9), MAX_NATIVE_WAIT_NS),
                                        *self._limits)
                        if type(r) is not int:  # the payload arrived: as little as possible from here on
                            return r
                        if r == -2:
                            return None
                    else:
                        while seq[0] != want and time.monotonic() < end:
                            pass
                else:
                    if not waiting:
                        hdr[_W_WAITING] = 1
                        waiting = True
                    if bell is not None:
                        bell.drain()  # a syscall: orders the waiting flag before the seq load
                    if seq[0] == want:
                        return None if native is None else self._taken()
                    if bell is not None:
                        wait = min(next_live, next_abort) - now
                        if deadline is not None:
                            wait = min(wait, deadline - now)
                        bell.wait(max(0, int(wait * 1000) + 1))
                    else:
                        time.sleep(sleep)
                        sleep = min(2 * sleep, _MAX_SLEEP_S)
                if seq[0] == want:
                    return None if native is None else self._taken()
                now = time.monotonic()
                if now >= next_live:
                    next_live = now + _due_in(_LIVENESS_EVERY_S)
                    if hdr[_W_SENDER_STATE] == _STATE_CLOSED:
                        raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel")
                    if self._peer_gone():
                        raise PeerDeadError(self.peer, op, "its process exited")
                    age = time.monotonic_ns() - hdr[_W_HEARTBEAT]
                    if age > hb_timeout_ns:
                        raise PeerDeadError(
                            self.peer, op,
                            f"no heartbeat for {age / 1e9:.1f} s (heartbeat_timeout_s="
                            f"{self.options.heartbeat_timeout_s:g}); the process is hung or stopped",
                        )
                next_abort = self._abort_or_timeout(op, now, next_abort, deadline, timeout_s)
        finally:
            if waiting:
                hdr[_W_WAITING] = 0

    def _read_slot(self, k: int, expect_total: int | None, op: str,
                   deadline: float | None = None) -> tuple[int, bytes]:
        """Copy slot ``k`` out (:meth:`RingMemory.copy_out`) and check its header and length."""
        total, sender, frag = self._mem.copy_out(k, op, self.peer, deadline)
        self._check_header(op, sender, total)
        if expect_total is not None and total != expect_total:
            raise ControlProtocolError(f"{op}: control message fragments from {self.peer} disagree on the length")
        return total, frag

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        self._set_limits(-1, 0, self.options.max_message_bytes)
        return self._recv(timeout_s, op)

    def recv_payload(self, timeout_s: float | None, op: str, max_stages: int, max_ranks: int,
                     max_bytes: int, started: float | None = None) -> Any:
        self._set_limits(max_stages, max_ranks, max_bytes)
        return self._recv(timeout_s, op, started)

    def _recv(self, timeout_s: float | None, op: str, started: float | None = None) -> Any:
        self._require(False, op)
        k = self._count
        deadline = None if timeout_s is None else (started or time.monotonic()) + timeout_s
        try:
            got = self._wait_slot(k, timeout_s, op, deadline)
        except ValueError:  # a released view: closed by another thread meanwhile
            self._require(False, op)
            raise
        if got is not None:  # taken by the native path (sender and length checked, count advanced, time stamped)
            return got
        self._require(False, op)  # closed by another thread meanwhile: named, not a torn read
        total, frag = self._read_slot(k, None, op, deadline)
        self._count = k + 1
        self._hdr[_W_READ_COUNT] = self._count
        self._last_msg = time.monotonic()
        if len(frag) == total:
            return frag
        out = bytearray(total)
        got = len(frag)
        out[:got] = frag
        while got < total:
            k = self._count
            # The rest of a started message is on its way (the sender waits for space at most
            # heartbeat_timeout_s, then gives up mid-message): bounded, whatever the caller's timeout.
            try:
                self._wait_slot(k, self.options.heartbeat_timeout_s, op)
            except ControlRecvTimeout:
                raise ControlProtocolError(
                    f"{op}: a control message from {self.peer} stopped after {got} of {total} bytes: no "
                    f"further fragment within heartbeat_timeout_s={self.options.heartbeat_timeout_s:g} s "
                    "(its sender gave up mid-message)") from None
            _, frag = self._read_slot(k, total, op)
            if got + len(frag) > total:
                raise ControlProtocolError(f"{op}: control message fragments from {self.peer} overflow the length")
            out[got:got + len(frag)] = frag
            got += len(frag)
            self._count = k + 1
            self._hdr[_W_READ_COUNT] = self._count
        return bytes(out)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._native.keeper_stop(self._keeper)  # joined: it reads the ring and its segment
            self._keeper = None
        # The native calls decline from now on; one in flight on another thread ends first.
        unmap = self._quiesce_native(lambda: setattr(self._state, "hdr", None))
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            if self.is_sender:
                self._hdr[_W_SENDER_STATE] = _STATE_CLOSED
                self._ring()
        except (ValueError, TypeError):
            pass
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        self._unlink()
        if not unmap:
            return
        self._anchor = self._out_anchor = None
        self._mem.release()
        try:
            self._mem.segment.close()
        except BufferError:  # pragma: no cover - a view still exported
            logger.warning("control ring %s still has exported views at close", self._mem.segment.name)
