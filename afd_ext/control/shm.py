"""The shared-memory ring channel (both ends on one host); layout in :mod:`afd_ext.control`."""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import socket
import struct
import threading
import time
import zlib
from typing import Any

from afd_ext import rendezvous as rdzv
from afd_ext.errors import ControlChannelClosed, ControlProtocolError, PeerDeadError
from afd_ext.rendezvous import AFDStore

from .channel import (
    MAX_NATIVE_WAIT_NS,
    _ABORT_EVERY_S,
    _CORRUPT_AFTER_S,
    _FALLBACK_SPIN_S,
    _LIVENESS_EVERY_S,
    _MAX_SLEEP_S,
    _MIN_SLEEP_S,
    _OP_RECV,
    _OP_SEND,
    ChannelOptions,
    ControlChannel,
    RingState,
    _native,
    _proc_start_time,
    logger,
)


# ---------------------------------------------------------------------------
# Shared-memory ring
# ---------------------------------------------------------------------------

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


def _bind_doorbell(addr: str) -> socket.socket | None:
    """Receiver's wake-up socket (abstract AF_UNIX datagram); None where unavailable."""
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
    return bell


def _drain(bell: socket.socket) -> None:
    try:
        while True:
            bell.recv(64)
    except (BlockingIOError, InterruptedError):
        pass


class ShmControlChannel(ControlChannel):
    """Shared-memory SPSC ring between two processes on one host (see the module doc).

    Build it with :meth:`create` (receiver / FFN end) and :meth:`attach`
    (sender / attention end), or through :func:`open_control_channels`.
    """

    kind = "shm"

    def __init__(self, shm, *, owner: bool, **kw):
        super().__init__(**kw)
        self._shm = shm
        self._owner = owner
        buf = shm.buf
        self._buf = buf
        self._hdr = buf[:_HDR_BYTES].cast("Q")
        ver_nslots = self._hdr[_W_VER_NSLOTS]
        self._nslots = ver_nslots >> 32
        self._slot_bytes = self._hdr[_W_SLOT_BYTES]
        self._stride = _slot_stride(self._slot_bytes)
        self._seq = [buf[_HDR_BYTES + i * self._stride:_HDR_BYTES + i * self._stride + 8].cast("Q")
                     for i in range(self._nslots)]
        # The native path's view of this end (the anchors pin the mapping and the copy buffer).
        self._native = _native()
        self._anchor: Any = ctypes.c_char.from_buffer(buf)
        self._out = bytearray(self._slot_bytes)
        self._out_anchor: Any = (ctypes.c_char * self._slot_bytes).from_buffer(self._out)
        self._state = RingState(hdr=ctypes.addressof(self._anchor), nslots=self._nslots, stride=self._stride,
                                slot_bytes=self._slot_bytes, out=ctypes.addressof(self._out_anchor), k=0,
                                local_rank=self.local_rank)
        self._state_ref = ctypes.byref(self._state)
        self._state_addr = ctypes.addressof(self._state)
        self._limits = (-1, 0)  # the native take's (max_stages, max_ranks); -1: raw bytes
        self._count = 0  # slots sent (sender) / consumed (receiver)
        self._peer_pid = 0
        self._peer_start = 0
        self._unlinked = False
        self._bell: socket.socket | None = None  # receiver: bound doorbell; sender: unbound
        self._bell_poll: Any = None
        self._bell_addr = "\0" + shm.name + "-bell"
        self._fence = threading.Lock()
        self._practice: tuple[Any, ...] | None = None  # warm_s: (buffer, anchor, state, address)

    # -- construction -----------------------------------------------------------

    @classmethod
    def create(cls, name_prefix: str, *, local_rank: int, peer_rank: int, peer: str,
               options: ChannelOptions, abort_check=None) -> "ShmControlChannel":
        """Create the ring (receiver end). The name is ``name_prefix`` + random hex."""
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
        ch = cls(shm, owner=True, is_sender=False, local_rank=local_rank, peer_rank=peer_rank,
                 peer=peer, options=options, abort_check=abort_check)
        ch._bell = _bind_doorbell(ch._bell_addr)
        if ch._bell is not None:
            # poll, not select: select fails for descriptors >= 1024 (large serving processes).
            ch._bell_poll = select.poll()
            ch._bell_poll.register(ch._bell, select.POLLIN)
        return ch

    @classmethod
    def attach(cls, name: str, *, local_rank: int, peer_rank: int, peer: str,
               options: ChannelOptions, abort_check=None) -> "ShmControlChannel":
        """Attach to a ring created by the receiver (sender end) and start the heartbeat.

        Raises:
            RuntimeError: the segment is missing (the two ends do not share
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
        ch = cls(shm, owner=False, is_sender=True, local_rank=local_rank, peer_rank=peer_rank,
                 peer=peer, options=options, abort_check=abort_check)
        ch._peer_pid = ch._hdr[_W_RECEIVER_PID]
        ch._peer_start = ch._hdr[_W_RECEIVER_START]
        try:
            ch._bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            ch._bell.setblocking(False)
        except OSError:  # pragma: no cover - no AF_UNIX: the receiver falls back to sleeping
            ch._bell = None
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
                self._shm.unlink()
            except FileNotFoundError:
                pass

    @property
    def name(self) -> str:
        """The segment's name (unlinked from ``/dev/shm`` once both ends attached)."""
        return self._shm.name

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
            k = self._count
            self._state.k = k
            r = nat.shm_publish(self._state_ref, data, n)
            if r < 0:  # ring full
                self._wait_space(k)
                r = nat.shm_publish(self._state_ref, data, n)
                if r < 0:
                    raise PeerDeadError(self.peer, _OP_SEND, "the control ring stayed full")
            self._count = k + 1
            if r:
                self._ring()
            return
        nfrag = max(1, -(-n // sb))
        mv = memoryview(data)
        hdr = self._hdr
        hdr[_W_HEARTBEAT] = time.monotonic_ns()
        for i in range(nfrag):
            k = self._count
            if k - hdr[_W_READ_COUNT] >= self._nslots:
                self._wait_space(k)
            frag = mv[i * sb:min(n, (i + 1) * sb)]
            fl = len(frag)
            slot = k % self._nslots
            base = _HDR_BYTES + slot * self._stride
            seq = self._seq[slot]
            seq[0] = 2 * k + 1
            crc = zlib.crc32(frag, zlib.crc32(_CRC_FIELDS.pack(2 * k + 2, n, fl, self.local_rank)))
            _SLOT_FIELDS.pack_into(self._buf, base + 8, n, fl, self.local_rank, crc)
            self._buf[base + _SLOT_HDR:base + _SLOT_HDR + fl] = frag
            seq[0] = 2 * k + 2  # publish
            self._count = k + 1
            # A full fence (the lock's atomic instruction) orders the publish before
            # the read of the receiver's waiting flag (store->load, Dekker style);
            # the receiver's side is ordered by its drain syscall.
            with self._fence:
                pass
            if hdr[_W_WAITING]:
                self._ring()

    def send_parts(self, parts: tuple[int, tuple]) -> None:
        # The native send writes one slot: only when a slot never exceeds the message bound.
        if self._native is None or self._slot_bytes > self.options.max_message_bytes:
            return super().send_parts(parts)
        self._require(True, "send")
        k = self._count
        self._state.k = k
        r = self._native.send(self._state_addr, *parts)
        if r == -1:  # ring full
            self._wait_space(k)
            r = self._native.send(self._state_addr, *parts)
        if r < 0:  # larger than a slot, or a value the Python encoder must name
            return super().send_parts(parts)
        self._count = k + 1
        if r:
            self._ring()

    def _ring(self) -> None:
        if self._bell is not None:
            try:
                self._bell.sendto(b"\x01", self._bell_addr)
            except OSError:  # full (a wake-up is pending anyway) or receiver gone
                pass

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

    def _take(self, k: int, max_ns: int) -> Any:
        """Native: wait up to ``max_ns`` for message ``k`` and take a whole single-slot message.
        Returns it (bytes, or parsed per ``self._limits``), -1 (not published yet) or -2 (read it in Python)."""
        self._state.k = k
        return self._native.take(self._state_addr, min(max_ns, MAX_NATIVE_WAIT_NS), *self._limits)

    def _taken(self, k: int) -> Any:
        r = self._take(k, 0)
        return None if type(r) is int else r

    def _wait_slot(self, k: int, timeout_s: float | None, op: str) -> Any:
        """Wait for message ``k``; returns it if the native path took it, else None (published: read it)."""
        slot = k % self._nslots
        seq = self._seq[slot]
        want = 2 * k + 2
        native = self._native
        if seq[0] == want:
            return None if native is None else self._taken(k)
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        next_live = now + _LIVENESS_EVERY_S
        next_abort = now + _ABORT_EVERY_S
        warm = self.options.warm_s if self._practice is not None else 0.0
        next_warm = now + warm if warm else float("inf")
        # While the engine is active keep polling (see the module doc), then block.
        poll_until = self._last_msg + self.options.idle_s
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
                    end = min(poll_until, next_live, next_abort, next_warm)
                    if deadline is not None:
                        end = min(end, deadline)
                    if native is not None:
                        r = self._take(k, int((end - now) * 1e9))
                        if type(r) is not int:
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
                        _drain(bell)  # a syscall: orders the waiting flag before the seq load
                    if seq[0] == want:
                        return None if native is None else self._taken(k)
                    if bell is not None:
                        wait = min(next_live, next_abort) - now
                        if deadline is not None:
                            wait = min(wait, deadline - now)
                        self._bell_poll.poll(max(0, int(wait * 1000) + 1))
                    else:
                        time.sleep(sleep)
                        sleep = min(2 * sleep, _MAX_SLEEP_S)
                if seq[0] == want:
                    return None if native is None else self._taken(k)
                now = time.monotonic()
                if now >= next_warm:
                    self._rehearse()
                    now = time.monotonic()
                    next_warm = now + warm
                if now >= next_live:
                    next_live = now + _LIVENESS_EVERY_S
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

    def _set_practice(self, parts: tuple) -> None:
        """warm_s: a private one-slot ring holding ``parts`` encoded, for :meth:`_rehearse`."""
        from afd_ext.metadata import encode_control_parts

        data = encode_control_parts(*parts)
        if len(data) > self._slot_bytes:
            return
        buf = bytearray(_HDR_BYTES + _slot_stride(self._slot_bytes))
        crc = zlib.crc32(data, zlib.crc32(_CRC_FIELDS.pack(2, len(data), len(data), self.peer_rank)))
        _SLOT_FIELDS.pack_into(buf, _HDR_BYTES + 8, len(data), len(data), self.peer_rank, crc)
        buf[_HDR_BYTES + _SLOT_HDR:_HDR_BYTES + _SLOT_HDR + len(data)] = data
        struct.pack_into("<Q", buf, _HDR_BYTES, 2)  # message 0, published
        anchor = (ctypes.c_char * len(buf)).from_buffer(buf)
        state = RingState(hdr=ctypes.addressof(anchor), nslots=1, stride=_slot_stride(self._slot_bytes),
                          slot_bytes=self._slot_bytes, out=ctypes.addressof(self._out_anchor), k=0,
                          local_rank=self.local_rank)
        self._practice = (buf, anchor, state, ctypes.addressof(state))

    def _rehearse(self) -> bool:
        """warm_s: take and build the practice payload (the receive path, on private memory).
        Returns whether it went the whole way (parsed and built)."""
        from afd_ext.metadata import control_payload_from_parts

        _, _, state, addr = self._practice  # type: ignore[misc]
        state.k = 0
        got = self._native.take(addr, 0, *self._limits)
        if type(got) is not tuple:
            return False
        control_payload_from_parts(*got[1:])
        return True

    def _read_slot(self, k: int, expect_total: int | None, op: str,
                   deadline: float | None = None) -> tuple[int, bytes]:
        """Copy slot ``k`` out, retrying torn reads; a slot inconsistent for
        ``_CORRUPT_AFTER_S`` (or past ``deadline``) is corrupt."""
        slot = k % self._nslots
        base = _HDR_BYTES + slot * self._stride
        seq = self._seq[slot]
        want = 2 * k + 2
        give_up = None
        while True:
            total, fl, sender, crc = _SLOT_FIELDS.unpack_from(self._buf, base + 8)
            if fl <= self._slot_bytes:
                frag = bytes(self._buf[base + _SLOT_HDR:base + _SLOT_HDR + fl])
                if seq[0] == want and zlib.crc32(
                        frag, zlib.crc32(_CRC_FIELDS.pack(want, total, fl, sender))) == crc:
                    break
            now = time.monotonic()
            if give_up is None:
                give_up = now + _CORRUPT_AFTER_S
                if deadline is not None:
                    give_up = min(give_up, max(deadline, now + 0.01))
            elif now >= give_up:
                raise ControlProtocolError(
                    f"{op}: control ring slot {slot} from {self.peer} stayed inconsistent (length "
                    f"{fl}, CRC mismatch) for {now - give_up + _CORRUPT_AFTER_S:.2f} s: the shared "
                    "memory is corrupt"
                )
            time.sleep(_MIN_SLEEP_S)
        self._check_header(op, sender, total)
        if expect_total is not None and total != expect_total:
            raise ControlProtocolError(f"{op}: control message fragments from {self.peer} disagree on the length")
        return total, frag

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        self._limits = (-1, 0)
        return self._recv(timeout_s, op)

    def recv_parts(self, timeout_s: float | None, op: str, max_stages: int, max_ranks: int) -> Any:
        self._limits = (max_stages, max_ranks)
        return self._recv(timeout_s, op)

    def _recv(self, timeout_s: float | None, op: str) -> Any:
        self._require(False, "recv")
        k = self._count
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        got = self._wait_slot(k, timeout_s, op)
        if got is not None:  # taken by the native path (read_count already advanced)
            self._count = k + 1
            self._last_msg = time.monotonic()
            if type(got) is tuple:  # parsed: (sender, flags, stages)
                self._check_header(op, got[0], 0)
                if self.options.warm_s and self._practice is None:
                    self._set_practice(got[1:])
                return got[1:]
            self._check_header(op, self._state.got_sender, len(got))
            return got
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
            self._wait_slot(k, None, op)  # the rest of a started message is already on its way
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
        for v in self._seq:
            v.release()
        self._anchor = self._out_anchor = None
        self._practice = None
        self._hdr.release()
        self._buf = None  # type: ignore[assignment]
        self._unlink()
        try:
            self._shm.close()
        except BufferError:  # pragma: no cover - a view still exported
            logger.warning("control ring %s still has exported views at close", self._shm.name)
