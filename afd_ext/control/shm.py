"""The shared-memory ring channel (both ends on one host); layout in :mod:`afd_ext.control`.

The slots, the waits and the read and write counts are native (``csrc/cpu/control_poll.cpp``:
``_C.ctrl_shm_put`` / ``ctrl_shm_take`` / ``ctrl_shm_stop``; the header's layout is in
``csrc/cpu/control.h``); this module owns the segment, the header words below and the channel's policy.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any

from afd_ext import rendezvous as rdzv
from afd_ext.health.process import start_time
from afd_ext.errors import ControlChannelClosed, ControlProtocolError, PeerDeadError

from .codec import DEFAULT_MAX_RANKS, DEFAULT_MAX_STAGES, _native

from .channel import _OP_SEND, ControlChannel

_SHM_DIR = "/dev/shm"
_SHM_MAGIC = 0x4C525443_44464141  # b"AAFDCTRL" as little-endian u64
_SHM_VERSION = 4  # follows the header layout of csrc/cpu/control.h
# u64 word indices in the header
_W_MAGIC, _W_VER_NSLOTS, _W_SLOT_BYTES = 0, 1, 2
_W_SENDER_PID, _W_SENDER_START, _W_RECEIVER_PID, _W_RECEIVER_START = 3, 4, 5, 6
_W_READ_COUNT = 8  # byte 64: the receiver's cache line (its state next, native)
_W_HEARTBEAT, _W_SENDER_STATE = 16, 17  # byte 128: the sender's cache line (the write count next, native)
_STATE_NEW, _STATE_ATTACHED, _STATE_CLOSED = 0, 1, 2
_K_CORRUPT = -3  # a take's corrupt-slot return (csrc/cpu/control.h)


def _stride(C: Any, slot_bytes: int) -> int:
    return (C.CTRL_SLOT_HEADER + slot_bytes + 63) // 64 * 64


def _track(name: str, on: bool) -> None:
    """The creator registers the name with the resource tracker, which unlinks it if the creator
    dies before both ends attached (attaching ends do not register: the tracker would unlink)."""
    from multiprocessing import resource_tracker

    (resource_tracker.register if on else resource_tracker.unregister)("/" + name, "shared_memory")


class ShmControlChannel(ControlChannel):
    """Shared-memory SPSC ring between two processes on one host (see the package doc).

    Build it with :meth:`create` (receiver / FFN end) and :meth:`attach`
    (sender / attention end), or through :func:`open_control_channels`.
    """

    kind = "shm"

    def __init__(self, name: str, mm: mmap.mmap, *, owner: bool, **kw: Any):
        super().__init__(**kw)
        self.name = name  # the segment's name (unlinked from /dev/shm once both ends attached)
        self._mm = mm
        self._owner = owner
        self._hdr = memoryview(mm)[:self._C.CTRL_HEADER_BYTES].cast("Q")
        self._nslots = self._hdr[_W_VER_NSLOTS] >> 32
        self._slot_bytes = self._hdr[_W_SLOT_BYTES]
        self._stride = _stride(self._C, self._slot_bytes)
        self._peer_pid = self._peer_start = 0
        self._unlinked = not owner

    @classmethod
    def create(cls, name_prefix: str, **kw: Any) -> "ShmControlChannel":
        """Create the ring (receiver end), named ``name_prefix`` + random hex."""
        opts = kw["options"]
        C = _native()
        size = C.CTRL_HEADER_BYTES + opts.nslots * _stride(C, opts.slot_bytes)
        name = f"{name_prefix}-{secrets.token_hex(6)}"
        fd = os.open(f"{_SHM_DIR}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _track(name, True)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(f"{_SHM_DIR}/{name}")
            _track(name, False)
            raise
        finally:
            os.close(fd)
        hdr = memoryview(mm)[:C.CTRL_HEADER_BYTES].cast("Q")
        hdr[_W_VER_NSLOTS] = (opts.nslots << 32) | _SHM_VERSION
        hdr[_W_SLOT_BYTES] = opts.slot_bytes
        hdr[_W_RECEIVER_PID] = os.getpid()
        hdr[_W_RECEIVER_START] = start_time(os.getpid()) or 0
        hdr[_W_MAGIC] = _SHM_MAGIC  # last: the segment is initialised
        hdr.release()
        return cls(name, mm, owner=True, is_sender=False, **kw)

    @classmethod
    def attach(cls, name: str, **kw: Any) -> "ShmControlChannel":
        """Attach to a ring created by the receiver (sender end) and start the heartbeat.

        Raises:
            FileNotFoundError: no such segment (the caller names why).
            RendezvousError: the segment is not an AFD control ring of this version.
        """
        fd = os.open(f"{_SHM_DIR}/{name}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        hdr = memoryview(mm)[:_native().CTRL_HEADER_BYTES].cast("Q")
        ok = hdr[_W_MAGIC] == _SHM_MAGIC and (hdr[_W_VER_NSLOTS] & 0xFFFFFFFF) == _SHM_VERSION
        hdr.release()
        if not ok:
            mm.close()
            raise rdzv.RendezvousError(f"shared-memory segment {name!r} is not an AFD control ring v{_SHM_VERSION}")
        ch = cls(name, mm, owner=False, is_sender=True, **kw)
        ch._peer_pid, ch._peer_start = ch._hdr[_W_RECEIVER_PID], ch._hdr[_W_RECEIVER_START]
        ch._hdr[_W_SENDER_PID] = os.getpid()
        ch._hdr[_W_SENDER_START] = start_time(os.getpid()) or 0
        ch._hdr[_W_HEARTBEAT] = time.monotonic_ns()
        ch._hdr[_W_SENDER_STATE] = _STATE_ATTACHED
        ch._start_heartbeat()
        return ch

    def wait_attached(self, deadline: float, store: Any = None) -> None:
        """Receiver: wait until the sender attached, then unlink the name (nothing can leak)."""
        sleep = 0.001
        while self._hdr[_W_SENDER_STATE] == _STATE_NEW:
            if store is not None:
                rdzv.raise_if_aborted(store, op=f"waiting for {self.peer} to attach the control ring")
            if time.monotonic() > deadline:
                raise rdzv.RendezvousTimeoutError(f"{self.peer} did not attach the shared-memory control ring in time",
                                                  missing=(self.peer_rank,), what="control channel attach")
            time.sleep(sleep)
            sleep = min(2 * sleep, 0.05)
        self._peer_pid, self._peer_start = self._hdr[_W_SENDER_PID], self._hdr[_W_SENDER_START]
        self._unlink()

    def _unlink(self) -> None:
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(f"{_SHM_DIR}/{self.name}")
            except FileNotFoundError:
                pass
            _track(self.name, False)

    def _peer_gone(self) -> bool:
        if not self._peer_pid:
            return False
        start = start_time(int(self._peer_pid))
        return start is None or bool(self._peer_start and start != self._peer_start)

    def _beat(self) -> bool:
        try:
            self._hdr[_W_HEARTBEAT] = time.monotonic_ns()
        except (ValueError, TypeError):  # released during close
            return False
        return True

    def _send_fast(self, payload: Any) -> bool:
        return self._C.ctrl_shm_put(self._mm, self.local_rank, payload, self._max_bytes) is True  # one slot, room

    def _send(self, data: bytes) -> None:
        n, sb, put = len(data), self._slot_bytes, self._C.ctrl_shm_put
        mv = memoryview(data)
        for off in range(0, max(n, 1), sb):
            while not put(self._mm, self.local_rank, mv[off:off + sb], n):
                self._wait_space()

    def _wait_space(self) -> None:
        """Sender, nothing put: wait for room, at most ``heartbeat_timeout_s``; raise if the receiver closed."""
        deadline = time.monotonic() + self.options.heartbeat_timeout_s
        while True:
            self._require(True, _OP_SEND)  # closed by another thread: end the wait now
            _, receiver_state, unread = self._C.ctrl_shm_ends(self._mm)
            if receiver_state == _STATE_CLOSED:
                raise ControlChannelClosed(f"{_OP_SEND}: {self.peer} closed the control channel", op=_OP_SEND,
                                           peer=self.peer)
            if unread < self._nslots:
                return
            if self._peer_gone():
                raise PeerDeadError(self.peer, _OP_SEND, "its process exited (control ring full)")
            if time.monotonic() > deadline:
                raise PeerDeadError(self.peer, _OP_SEND, f"it consumed no control payload for "
                                    f"{self.options.heartbeat_timeout_s:.1f} s with {self._nslots} ring slots full")
            time.sleep(1e-4)

    def _take_one(self, op: str, end_ns: int, r: Any = None) -> tuple[int, int, Any] | None:
        """The next fragment, or None; ``r``: what a native take already returned."""
        if r is None:
            r = self._C.ctrl_shm_take(self._mm, 0, end_ns, -1, 0)
        if type(r) is int:
            if r == _K_CORRUPT:
                slot = self._hdr[_W_READ_COUNT] % self._nslots
                raise ControlProtocolError(f"{op}: control ring slot {slot} from {self.peer} "
                                           "stayed inconsistent (CRC mismatch) for 1 s: the shared memory is corrupt")
            return None
        return r

    def _take(self, op: str, spin_until_ns: int, end_ns: int, limit: int) -> Any:
        r = self._C.ctrl_shm_take(self._mm, spin_until_ns, end_ns, DEFAULT_MAX_STAGES if limit else -1,
                                  DEFAULT_MAX_RANKS)
        if type(r) is tuple and type(r[2]) is tuple and r[1] == self.peer_rank and r[0] <= limit:
            return r[2]  # the per-step case: a payload whole in its slot, decoded
        r = self._take_one(op, 0, r)  # raises if corrupt
        if r is None:
            return None
        total, sender, frag = r
        self._check_header(op, sender, total)
        if type(frag) is not bytes or len(frag) == total:
            return self._decoded(op, frag, total, limit)
        parts, have = [frag], len(frag)
        # The rest of a started message is on its way (the sender waits for space at most
        # heartbeat_timeout_s, then gives up mid-message): bounded, whatever the caller's timeout.
        give_up = time.monotonic() + self.options.heartbeat_timeout_s
        while have < total:
            nxt = self._take_one(op, int(min(give_up, time.monotonic() + 0.1) * 1e9))
            if nxt is None:
                self._require(False, op)
                self._check_peer(op)  # a sender that closed or died mid-message is named as such
                if time.monotonic() >= give_up:
                    raise ControlProtocolError(
                        f"{op}: a control message from {self.peer} stopped after {have} of {total} bytes "
                        "(its sender gave up mid-message)")
                continue
            if nxt[0] != total or nxt[1] != sender or have + len(nxt[2]) > total:
                raise ControlProtocolError(f"{op}: control message fragments from {self.peer} do not add up "
                                           f"(a fragment of {nxt[0]} bytes from world rank {nxt[1]} "
                                           f"after {have} of {total} bytes)")
            parts.append(nxt[2])
            have += len(nxt[2])
        return self._decoded(op, b"".join(parts), total, limit)

    def _check_peer(self, op: str) -> None:
        # The liveness look comes first: a sender that exited had put every slot before, so the
        # ends read after it count them (docs/internals.md, the ordering rule).
        gone = self._peer_gone()
        sender_state, _, unread = self._C.ctrl_shm_ends(self._mm)
        if unread:
            return  # published slots first: the next take has them, whatever the sender did since
        if sender_state == _STATE_CLOSED:
            raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel", op=op, peer=self.peer)
        if gone:
            raise PeerDeadError(self.peer, op, "its process exited")
        self._silent(op, self._hdr[_W_HEARTBEAT] * 1e-9)

    def _shutdown(self) -> None:
        self._C.ctrl_shm_stop(self._mm, self.is_sender)
        if self._owner:
            self._unlink()

    def _release(self) -> None:
        self._hdr.release()
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover - a native wait still holds it; the last holder frees it
            pass

