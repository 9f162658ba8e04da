"""The shared-memory ring's memory: the segment, its layout, the seqlock publish and copy, the doorbell.

The layout and the seqlock protocol are described in :mod:`afd_ext.control`.
What a channel does over this memory (its two ends, waiting, liveness, the
native path) is :class:`~afd_ext.control.shm.ShmControlChannel`.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import socket
import struct
import time
import zlib
from typing import Any

from afd_ext import rendezvous as rdzv
from afd_ext.errors import ControlProtocolError

from .channel import _CORRUPT_AFTER_S, _MIN_SLEEP_S, ChannelOptions, _proc_start_time

_SHM_MAGIC = 0x4C525443_44464141  # b"AAFDCTRL" as little-endian u64
_SHM_VERSION = 1
_HDR_BYTES = 256
# u64 word indices in the header
_W_MAGIC, _W_VER_NSLOTS, _W_SLOT_BYTES = 0, 1, 2
_W_SENDER_PID, _W_SENDER_START, _W_RECEIVER_PID, _W_RECEIVER_START = 3, 4, 5, 6
_W_READ_COUNT = 8  # byte 64: own cache line
_W_HEARTBEAT, _W_SENDER_STATE = 16, 17  # byte 128: own cache line
_W_WAITING = 24  # byte 192: receiver blocked on the doorbell (1) or spinning/busy (0)
_SLOT_HDR = 32
_SLOT_FIELDS = struct.Struct("<QIII")  # total_len, frag_len, sender, crc (at slot offset 8)
_CRC_FIELDS = struct.Struct("<QQII")  # seq, total_len, frag_len, sender
_STATE_NEW, _STATE_ATTACHED, _STATE_CLOSED = 0, 1, 2


def _slot_stride(slot_bytes: int) -> int:
    return (_SLOT_HDR + slot_bytes + 63) // 64 * 64


class _ShmSegment:
    """A POSIX shared-memory segment (``/dev/shm``) mapped into this process.

    ``multiprocessing.shared_memory.SharedMemory`` registers every attach with
    the resource tracker on Python < 3.13, which makes a tracker shared by
    spawned processes unlink or complain about segments it does not own. Here
    only the creator registers the name (the tracker then unlinks it if the
    creator dies before both ends attached) and unregisters it when it unlinks.
    """

    def __init__(self, name: str, create: bool, size: int = 0):
        import mmap

        import _posixshmem

        self.name = name
        self._path = "/" + name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(self._path, flags, mode=0o600)
        self._created = create
        self._tracked = False
        try:
            if create:
                os.ftruncate(fd, size)
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                _posixshmem.shm_unlink(self._path)
            raise
        os.close(fd)
        if create:
            from multiprocessing import resource_tracker

            resource_tracker.register(self._path, "shared_memory")
            self._tracked = True
        self.buf = memoryview(self._mmap)

    def unlink(self) -> None:
        import _posixshmem

        try:
            _posixshmem.shm_unlink(self._path)
        except FileNotFoundError:
            pass
        if self._tracked:
            from multiprocessing import resource_tracker

            self._tracked = False
            resource_tracker.unregister(self._path, "shared_memory")

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class RingMemory:
    """One mapped ring: its header words and slots, the seqlock publish and the torn-read-safe copy.

    Build it with :meth:`create` (receiver end) or :meth:`attach` (sender end).

    Attributes:
        segment: the mapped :class:`_ShmSegment`.
        buf: the whole mapping; hdr: its header as u64 words (``_W_*`` indices).
        nslots, slot_bytes, stride: the geometry the creator wrote in the header.
        seq: per slot, a one-word u64 view of its sequence number.
    """

    def __init__(self, segment: _ShmSegment):
        self.segment = segment
        buf = segment.buf
        self.buf = buf
        self.hdr = buf[:_HDR_BYTES].cast("Q")
        self.nslots = self.hdr[_W_VER_NSLOTS] >> 32
        self.slot_bytes = self.hdr[_W_SLOT_BYTES]
        self.stride = _slot_stride(self.slot_bytes)
        self.seq = [buf[_HDR_BYTES + i * self.stride:_HDR_BYTES + i * self.stride + 8].cast("Q")
                    for i in range(self.nslots)]

    @classmethod
    def create(cls, name_prefix: str, options: ChannelOptions) -> "RingMemory":
        """Create and initialise a ring (receiver end), named ``name_prefix`` + random hex."""
        size = _HDR_BYTES + options.nslots * _slot_stride(options.slot_bytes)
        for _ in range(16):
            name = f"{name_prefix}-{secrets.token_hex(6)}"
            try:
                shm = _ShmSegment(name, create=True, size=size)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 16 random collisions
            raise rdzv.RendezvousError(f"could not create a shared-memory segment named {name_prefix}-*")
        hdr = shm.buf[:_HDR_BYTES].cast("Q")
        hdr[_W_VER_NSLOTS] = (options.nslots << 32) | _SHM_VERSION
        hdr[_W_SLOT_BYTES] = options.slot_bytes
        hdr[_W_RECEIVER_PID] = os.getpid()
        hdr[_W_RECEIVER_START] = _proc_start_time(os.getpid()) or 0
        hdr[_W_MAGIC] = _SHM_MAGIC  # last: the segment is initialised
        hdr.release()
        return cls(shm)

    @classmethod
    def attach(cls, name: str, peer: str) -> "RingMemory":
        """Attach to the ring ``name`` that ``peer`` created (sender end) and mark it attached.

        Raises:
            RendezvousError: the segment is missing (the two ends do not share
                ``/dev/shm``: use kind ``"tcp"``) or not an AFD control ring.
        """
        try:
            shm = _ShmSegment(name, create=False)
        except FileNotFoundError:
            raise rdzv.RendezvousError(
                f"shared-memory control segment {name!r} of {peer} not found: the two ranks do "
                "not share /dev/shm (different hosts or containers); set "
                "connector_extra_config.control_channel to 'tcp' on every rank"
            ) from None
        hdr = shm.buf[:_HDR_BYTES].cast("Q")
        ok = False
        try:
            if hdr[_W_MAGIC] != _SHM_MAGIC or (hdr[_W_VER_NSLOTS] & 0xFFFFFFFF) != _SHM_VERSION:
                raise rdzv.RendezvousError(
                    f"shared-memory segment {name!r} is not an AFD control ring v{_SHM_VERSION}")
            hdr[_W_SENDER_PID] = os.getpid()
            hdr[_W_SENDER_START] = _proc_start_time(os.getpid()) or 0
            hdr[_W_HEARTBEAT] = time.monotonic_ns()
            hdr[_W_SENDER_STATE] = _STATE_ATTACHED
            ok = True
        finally:
            hdr.release()
            if not ok:
                shm.close()
        return cls(shm)

    def publish(self, k: int, frag: memoryview, total: int, sender: int) -> None:
        """Write ``frag`` (a fragment of a ``total``-byte message from world rank ``sender``) as message ``k``.

        The slot is a seqlock: odd while written, ``2k+2`` once the fields and bytes are in.
        """
        fl = len(frag)
        slot = k % self.nslots
        base = _HDR_BYTES + slot * self.stride
        seq = self.seq[slot]
        seq[0] = 2 * k + 1
        crc = zlib.crc32(frag, zlib.crc32(_CRC_FIELDS.pack(2 * k + 2, total, fl, sender)))
        _SLOT_FIELDS.pack_into(self.buf, base + 8, total, fl, sender, crc)
        self.buf[base + _SLOT_HDR:base + _SLOT_HDR + fl] = frag
        seq[0] = 2 * k + 2  # publish

    def copy_out(self, k: int, op: str, peer: str, deadline: float | None = None) -> tuple[int, int, bytes]:
        """``(total, sender, fragment)`` of published message ``k``, retrying torn reads.

        Raises:
            ControlProtocolError: the slot stayed inconsistent for ``_CORRUPT_AFTER_S``
                (or past ``deadline``): the shared memory is corrupt.
        """
        slot = k % self.nslots
        base = _HDR_BYTES + slot * self.stride
        seq = self.seq[slot]
        want = 2 * k + 2
        give_up = None
        while True:
            total, fl, sender, crc = _SLOT_FIELDS.unpack_from(self.buf, base + 8)
            if fl <= self.slot_bytes:
                frag = bytes(self.buf[base + _SLOT_HDR:base + _SLOT_HDR + fl])
                if seq[0] == want and zlib.crc32(
                        frag, zlib.crc32(_CRC_FIELDS.pack(want, total, fl, sender))) == crc:
                    return total, sender, frag
            now = time.monotonic()
            if give_up is None:
                give_up = now + _CORRUPT_AFTER_S
                if deadline is not None:
                    give_up = min(give_up, max(deadline, now + 0.01))
            elif now >= give_up:
                raise ControlProtocolError(
                    f"{op}: control ring slot {slot} from {peer} stayed inconsistent (length "
                    f"{fl}, CRC mismatch) for {now - give_up + _CORRUPT_AFTER_S:.2f} s: the shared "
                    "memory is corrupt"
                )
            time.sleep(_MIN_SLEEP_S)

    def release(self) -> None:
        """Drop this object's views of the mapping (before :meth:`_ShmSegment.close`)."""
        for v in self.seq:
            v.release()
        self.hdr.release()
        self.buf = None  # type: ignore[assignment]


class Doorbell:
    """The receiver's wake-up: an abstract ``AF_UNIX`` datagram socket named after the segment.

    The receiver binds it (:meth:`bind`) and blocks on it when idle; the sender
    (:meth:`for_sender`) rings it after publishing when the receiver's waiting flag is up.
    """

    def __init__(self, sock: socket.socket, addr: str, poller: "select.poll | None" = None):
        self._sock = sock
        self._addr = addr
        self._poller = poller

    @staticmethod
    def address(segment_name: str) -> str:
        return "\0" + segment_name + "-bell"

    @classmethod
    def bind(cls, segment_name: str) -> "Doorbell | None":
        """Receiver: the bound doorbell of ``segment_name``; None where unavailable (it then sleeps)."""
        addr = cls.address(segment_name)
        try:
            bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            return None
        try:
            bell.bind(addr)
        except OSError:  # pragma: no cover - no abstract namespace
            bell.close()
            return None
        bell.setblocking(False)
        # poll, not select: select fails for descriptors >= 1024 (large serving processes).
        poller = select.poll()
        poller.register(bell, select.POLLIN)
        return cls(bell, addr, poller)

    @classmethod
    def for_sender(cls, segment_name: str) -> "Doorbell | None":
        """Sender: an unbound socket that rings ``segment_name``'s doorbell; None where unavailable."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
        except OSError:  # pragma: no cover - no AF_UNIX: the receiver falls back to sleeping
            return None
        return cls(sock, cls.address(segment_name))

    def fill_native(self, state: Any) -> None:
        """Sender: give the native publish (``RingState``) this doorbell's socket and address; an
        address longer than a ``sockaddr_un`` leaves it without (no receiver could bind it either)."""
        path = self._addr.encode("utf-8")
        if len(path) > 108:
            return
        raw = struct.pack("<H", socket.AF_UNIX) + path
        ctypes.memmove(state.bell_addr, raw, len(raw))
        state.bell_len = len(raw)
        state.bell_fd = self._sock.fileno()

    def ring(self) -> None:
        try:
            self._sock.sendto(b"\x01", self._addr)
        except OSError:  # full (a wake-up is pending anyway) or receiver gone
            pass

    def drain(self) -> None:
        try:
            while True:
                self._sock.recv(64)
        except (BlockingIOError, InterruptedError):
            pass

    def wait(self, timeout_ms: int) -> None:
        """Receiver: block until rung or ``timeout_ms`` passed."""
        self._poller.poll(timeout_ms)  # type: ignore[union-attr]

    def close(self) -> None:
        self._sock.close()
