"""The control plane: once per step, the DP metadata travels attention -> FFN on the host.

Per step, before the layer loop, every attention rank applies the control
payload locally (:meth:`AFDControlPlane.update_state_from_dp_metadata`, which
validates the whole step up front) and calls
:meth:`AFDControlPlane.send_dp_metadata_list` (a no-op on ranks that are not
control senders); every FFN rank blocks in
:meth:`AFDControlPlane.recv_dp_metadata_list`, which returns the decoded
:class:`~afd_ext.metadata.AFDControlPayload`. Who sends to whom comes from the
topology alone (:meth:`Topology.control_destinations` /
:meth:`Topology.control_source`): attention rank ``a < min(A, F)`` sends to FFN
ranks ``a, a + min(A, F), ...``; every FFN rank has exactly one source and
receives the whole per-rank count vector.

Channels: host memory only
--------------------------
Unlike the reference (two blocking NCCL messages per step and a ``.item()``
device sync on the FFN side), the payload never touches a GPU. Each
(source, FFN rank) pair has one :class:`ControlChannel`:

* ``shm`` (both ends on one host): a single-producer/single-consumer ring in
  POSIX shared-memory segment (``/dev/shm``). Layout, little-endian::

      header (256 B): magic u64 | version u32 | nslots u32 | slot_bytes u64 |
                      sender pid u64 | sender start time u64 | receiver pid u64 |
                      receiver start time u64 | ... ;
                      [64]  read_count u64   (receiver: slots consumed)
                      [128] heartbeat_ns u64 (sender: CLOCK_MONOTONIC) |
                            sender_state u64 (0 new, 1 attached, 2 closed)
      slot i (stride 64-byte aligned): seq u64 | total_len u64 | frag_len u32 |
                      sender u32 | crc u32 | pad u32 | payload[slot_bytes]

  Message ``k`` (counted in slots) uses slot ``k % nslots`` as a seqlock: the
  sender waits until ``k - read_count < nslots`` (flow control), stores
  ``seq = 2k+1``, writes the fields and the payload, then stores ``seq =
  2k+2``. The receiver waits for ``seq == 2k+2``, copies the fields and the
  payload, re-reads ``seq`` and checks a CRC-32 over fields and payload; any
  change or mismatch is a torn read and is retried, so a reader never returns
  half-written bytes even on a weakly ordered CPU (on x86-64 the store order
  alone suffices; the CRC is the safety net elsewhere); a published slot that
  stays inconsistent for ``_CORRUPT_AFTER_S`` is a corrupt ring
  (:class:`ControlProtocolError`). 8-byte fields are single aligned
  loads/stores (``memoryview.cast("Q")``). Messages larger than one slot are
  split over consecutive slots; the receiver bounds the total by
  ``max_message_bytes`` before allocating. The FFN end creates the segment under a fresh random name tied to
  the store's generation, the sender attaches, and as soon as both are
  attached the name is unlinked: nothing is left in ``/dev/shm`` even if a
  process is killed later, and a stale segment is never reused.

* ``tcp`` (across hosts): the FFN end listens on the address through which it
  reaches the rendezvous host (never a hard-coded loopback; override with
  ``AFD_CONTROL_ADDR``), publishes ``addr:port`` through the store; the
  sender connects (``TCP_NODELAY``) and introduces itself. Frames are
  ``magic u32 | type u32 | sender world rank u32 | length u64 | bytes``.

How a receiver waits: ready while serving, asleep when idle
------------------------------------------------------------
Waking a blocked thread costs ~110 µs on a server host (scheduler and
C-state exit), more than the whole rest of a step's control plane. So while
the engine is active (the last payload arrived less than ``idle_s`` ago,
default 10 s, ``AFD_CONTROL_IDLE_S``) a waiting FFN rank keeps polling, in
native code (``csrc/cpu/control_poll.cpp``, called through ``ctypes``, which
releases the GIL: the serving engine's other threads keep running). It polls
in slices of at most 50 ms and runs the liveness checks between slices. This
costs one core per FFN rank while serving, which a serving FFN process owns
anyway. Once idle for ``idle_s``, the receiver raises a ``waiting`` flag (shm)
and blocks (a doorbell: an abstract ``AF_UNIX`` datagram socket named after
the segment, which the sender rings after publishing when it sees the flag;
a lock's atomic instruction orders the publish before that read, the
receiver's drain syscall orders its side; tcp: ``poll`` on the socket), so an
idle FFN rank burns no CPU. ``idle_s = 0`` always blocks (few cores, many
ranks: CI). Without the native poll (a stale build) the receiver spins in
Python for at most ``_FALLBACK_SPIN_S`` before blocking.

``auto`` (the default) picks ``shm`` when both ends report the same
:func:`~afd_ext.rendezvous.host_identity` (host name, boot id, mount and pid
namespaces) through the store, else ``tcp``. Every frame carries the sender's
world rank and the receiver checks it is the one the topology names (the
reference checks its two messages came from the same rank).

Liveness: idle is not dead
--------------------------
An FFN rank waiting for the next step may wait indefinitely while the
attention side is idle. The sender therefore publishes a heartbeat from a
daemon thread every ``heartbeat_interval_s`` (a CLOCK_MONOTONIC timestamp in
the shared segment, or a small heartbeat frame over TCP). The receiver raises
:class:`PeerDeadError` naming the peer and ``recv_dp_metadata_list`` when the
heartbeat is older than ``heartbeat_timeout_s``, at once when the sender's
process is gone (same host: its pid and start time are checked) or its socket
closed without a goodbye, and :class:`~afd_ext.rendezvous.StepAbortedError`
when some rank posted the step-abort signal. A live idle peer is waited for
forever, or until the optional ``recv_timeout_s``. A sender that closes its
channel cleanly makes the receiver raise :class:`ControlChannelClosed`, so an
FFN serving loop can end.

The payload travels in the compact binary layout of
:func:`~afd_ext.metadata.encode_control_binary` (both ends are ``afd_ext``);
the JSON codec stays the reference-format API. A malformed payload, a corrupt
ring or a frame from the wrong rank posts the step-abort signal before it
raises :class:`ControlProtocolError`, so the attention ranks stop at once.

Measured cost: ``afd-ext bench --control-only`` (:mod:`afd_ext.bench.control`)
measures attention ``send_dp_metadata_list`` call start -> FFN
``recv_dp_metadata_list`` return at step gaps of 1-50 ms; see
docs/benchmarks.md.
"""

from __future__ import annotations

import abc
import ctypes
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from afd_ext import rendezvous as rdzv
from afd_ext.rendezvous import AFDStore, StepAbortedError  # noqa: F401 - re-exported: recv raises it

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_IDLE_S",
    "CHANNEL_KINDS",
    "PeerDeadError",
    "StepAbortedError",
    "ControlChannelClosed",
    "ControlRecvTimeout",
    "ControlProtocolError",
    "ChannelOptions",
    "ControlChannel",
    "ShmControlChannel",
    "TcpControlChannel",
    "open_control_channels",
    "AFDControlPlane",
    "ChannelControlPlane",
]

#: How often a sender publishes its heartbeat, in seconds.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
#: Heartbeat age after which the receiver declares the sender dead, in seconds.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
#: How long after the last payload a waiting receiver keeps polling before it blocks, in seconds.
DEFAULT_IDLE_S = 10.0
#: Payload bytes per shared-memory slot; larger messages span several slots.
DEFAULT_SLOT_BYTES = 16384
#: Slots per shared-memory ring.
DEFAULT_NSLOTS = 8
#: Largest message a channel accepts, in bytes (bounded before allocation).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
#: Channel kinds accepted by :func:`open_control_channels`.
CHANNEL_KINDS = ("auto", "shm", "tcp")

# How often a waiting receiver looks at the heartbeat / peer process, and at the
# store's abort key (a store round trip), in seconds.
_LIVENESS_EVERY_S = 0.05
_ABORT_EVERY_S = 0.1
_MAX_SLEEP_S = 0.001
_STORE_LOSS_GRACE_S = 1.0
_MIN_SLEEP_S = 20e-6
# Without the native poll: the longest Python spin (it holds the GIL) before blocking.
_FALLBACK_SPIN_S = 0.002
# A writer fills a slot in microseconds; a published slot inconsistent for this long is corrupt.
_CORRUPT_AFTER_S = 1.0

_OP_RECV = "recv_dp_metadata_list"
_OP_SEND = "send_dp_metadata_list"


from .errors import (  # noqa: E402,F401
    AFDConfigError,
    AFDStateError,
    ControlChannelClosed,
    ControlProtocolError,
    ControlRecvTimeout,
    PeerDeadError,
)


@dataclass(frozen=True)
class ChannelOptions:
    """Tuning of the control channels (all times in seconds).

    Attributes:
        heartbeat_interval_s: how often the sender publishes a heartbeat.
        heartbeat_timeout_s: heartbeat age that makes the receiver raise
            :class:`PeerDeadError`; must exceed ``heartbeat_interval_s``.
        idle_s: how long after the last payload a waiting receiver keeps
            polling (native code, GIL released, one core) before it blocks;
            0 always blocks. Default 10 s (``AFD_CONTROL_IDLE_S``).
        slot_bytes: shm payload bytes per slot (>= 64).
        nslots: shm ring slots (>= 2).
        max_message_bytes: largest message accepted by a receiver.
    """

    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    idle_s: float = DEFAULT_IDLE_S
    slot_bytes: int = DEFAULT_SLOT_BYTES
    nslots: int = DEFAULT_NSLOTS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise AFDConfigError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s!r}")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise AFDConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s!r}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s!r})"
            )
        if not self.idle_s >= 0:
            raise AFDConfigError(f"idle_s must be >= 0 seconds, got {self.idle_s!r}")
        if not (isinstance(self.slot_bytes, int) and self.slot_bytes >= 64):
            raise AFDConfigError(f"slot_bytes must be an int >= 64, got {self.slot_bytes!r}")
        if not (isinstance(self.nslots, int) and self.nslots >= 2):
            raise AFDConfigError(f"nslots must be an int >= 2, got {self.nslots!r}")
        if not (isinstance(self.max_message_bytes, int) and self.max_message_bytes >= 1):
            raise AFDConfigError(f"max_message_bytes must be an int >= 1, got {self.max_message_bytes!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "ChannelOptions":
        """Defaults, ``AFD_CONTROL_IDLE_S`` from the environment, then ``overrides`` (None ignored).

        The connector passes ``heartbeat_interval_s``/``heartbeat_timeout_s`` from
        ``connector_extra_config``.
        """
        from afd_ext import envs

        kw: dict[str, Any] = {"idle_s": envs.get("AFD_CONTROL_IDLE_S")}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of ``pid``, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2:].split()
    if not rest or rest[0] in (b"Z", b"X", b"x"):
        return None
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


class _Native:
    """The compiled core's control-plane functions (``csrc/cpu/control_poll.cpp``).

    Called through ``ctypes.CDLL``, which releases the GIL for each call.
    """

    def __init__(self, lib: Any):
        c = ctypes
        self.spin_u64 = lib.afd_ctrl_spin_u64
        self.spin_u64.argtypes = [c.c_void_p, c.c_uint64, c.c_int64]
        self.spin_u64.restype = c.c_int
        self.spin_fd = lib.afd_ctrl_spin_fd
        self.spin_fd.argtypes = [c.c_int, c.c_int64]
        self.spin_fd.restype = c.c_int
        self.shm_publish = lib.afd_ctrl_shm_publish
        self.shm_publish.argtypes = [c.c_void_p, c.c_void_p, c.c_uint64, c.c_uint64, c.c_char_p, c.c_uint32,
                                     c.c_uint32]
        self.shm_publish.restype = c.c_int
        self.shm_take = lib.afd_ctrl_shm_take
        self.shm_take.argtypes = [c.c_void_p, c.c_void_p, c.c_uint64, c.c_uint64, c.c_void_p, c.c_uint64,
                                  c.c_int64, c.c_void_p]
        self.shm_take.restype = c.c_int64


_native_lib: _Native | None | bool = False  # False: not looked up yet


def _native() -> _Native | None:
    """The native control-plane functions, or None (a stale build without them)."""
    global _native_lib
    if _native_lib is False:
        try:
            import torch  # noqa: F401 - loads the libraries the compiled core links against

            from afd_ext import _C

            _native_lib = _Native(ctypes.CDLL(_C.__file__))
        except (ImportError, OSError, AttributeError) as e:
            logger.warning("afd_ext control plane: no native poll in the compiled core (%s); a waiting "
                           "FFN rank blocks after %.0f ms and wakes slower (rebuild afd_ext)",
                           e, _FALLBACK_SPIN_S * 1e3)
            _native_lib = None
    return _native_lib  # type: ignore[return-value]


class ControlChannel(abc.ABC):
    """One direction of one (attention rank, FFN rank) control link.

    Attributes:
        kind: ``"shm"`` or ``"tcp"``.
        is_sender: True on the attention (sending) end.
        peer_rank: world rank of the other end; ``peer``: its label.
    """

    kind: str = ""

    def __init__(self, *, is_sender: bool, local_rank: int, peer_rank: int, peer: str,
                 options: ChannelOptions, abort_check: Callable[[str], None] | None):
        self.is_sender = is_sender
        self.local_rank = local_rank
        self.peer_rank = peer_rank
        self.peer = peer
        self.options = options
        self._abort_check = abort_check
        self._closed = False
        self._store_lost_at: float | None = None
        # Receiver: when the last payload arrived; polling continues until idle_s after it.
        self._last_msg = time.monotonic()

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """Send one message (sender end only).

        Args:
            data: the message bytes (e.g. an encoded control payload), at most
                ``options.max_message_bytes``.

        Raises:
            AFDConfigError: message too large; AFDStateError: wrong end or closed
            channel; PeerDeadError: the receiver is gone.
        """

    @abc.abstractmethod
    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        """Receive the next message (receiver end only), in send order.

        Args:
            timeout_s: give up after this many seconds while the peer is alive;
                None waits as long as the peer's heartbeat is fresh.
            op: the operation named in errors.

        Returns:
            The message bytes.

        Raises:
            PeerDeadError: the sender died (process gone, socket reset, heartbeat older
                than ``heartbeat_timeout_s``).
            ControlChannelClosed: the sender closed the channel.
            ControlRecvTimeout: ``timeout_s`` passed.
            StepAbortedError: some rank posted the step-abort signal.
            ControlProtocolError: a frame from an unexpected sender, a corrupt frame or slot.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the channel (idempotent). On the sender, tell the receiver (clean shutdown)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def _poll_abort(self, op: str) -> None:
        """Look at the store's abort signal; tolerate a lost store for a short grace.

        At a clean shutdown FFN rank 0 (the store's host) may exit a moment
        before this channel's sender closes; the grace lets the close (or the
        sender's death) be reported instead of the lost store.
        """
        try:
            self._abort_check(op)
        except rdzv.StoreUnavailableError:
            now = time.monotonic()
            if self._store_lost_at is None:
                self._store_lost_at = now
                logger.warning("%s: rendezvous store lost while waiting on the control channel of %s",
                               op, self.peer)
            if now - self._store_lost_at > _STORE_LOSS_GRACE_S:
                raise

    def _check_len(self, n: int) -> None:
        if n > self.options.max_message_bytes:
            raise AFDConfigError(
                f"control message of {n} bytes exceeds max_message_bytes="
                f"{self.options.max_message_bytes}; raise it on both ends"
            )

    def _check_header(self, op: str, sender: int, total: int) -> None:
        """A received message's header: from the expected world rank, within ``max_message_bytes``."""
        if sender != self.peer_rank:
            raise ControlProtocolError(
                f"{op}: received AFD DP metadata from world rank {sender}, expected {self.peer}"
            )
        if total > self.options.max_message_bytes:
            raise ControlProtocolError(
                f"{op}: {self.peer} announced a {total}-byte control message, above "
                f"max_message_bytes={self.options.max_message_bytes}"
            )

    def _require(self, sender: bool, what: str) -> None:
        if self._closed:
            raise AFDStateError(f"{what} on a closed {self.kind} control channel to {self.peer}")
        if self.is_sender != sender:
            end = "sending (attention)" if self.is_sender else "receiving (FFN)"
            raise AFDStateError(f"{what} called on the {end} end of the control channel to {self.peer}")


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
        # Addresses for the native path (the anchors pin the mapping and the output buffer).
        self._native = _native()
        self._anchor: Any = ctypes.c_char.from_buffer(buf)
        self._base = ctypes.addressof(self._anchor)
        self._slot_addr = [self._base + _HDR_BYTES + i * self._stride for i in range(self._nslots)]
        self._out = bytearray(self._slot_bytes)
        self._out_anchor: Any = (ctypes.c_char * self._slot_bytes).from_buffer(self._out)
        self._out_addr = ctypes.addressof(self._out_anchor)
        self._sender_out = ctypes.c_uint32()
        self._sender_addr = ctypes.addressof(self._sender_out)
        self._count = 0  # slots sent (sender) / consumed (receiver)
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._peer_pid = 0
        self._peer_start = 0
        self._unlinked = False
        self._bell: socket.socket | None = None  # receiver: bound doorbell; sender: unbound
        self._bell_poll: Any = None
        self._bell_addr = "\0" + shm.name + "-bell"
        self._fence = threading.Lock()

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

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            interval = self.options.heartbeat_interval_s
            while not self._hb_stop.wait(interval):
                try:
                    self._hdr[_W_HEARTBEAT] = time.monotonic_ns()
                except (ValueError, TypeError):  # released during close
                    return

        self._hb_thread = threading.Thread(target=beat, name=f"afd-ctrl-heartbeat-{self.peer_rank}",
                                           daemon=True)
        self._hb_thread.start()

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
            slot = self._slot_addr[k % self._nslots]
            r = nat.shm_publish(self._base, slot, k, self._nslots, data, n, self.local_rank)
            if r < 0:  # ring full
                self._wait_space(k)
                r = nat.shm_publish(self._base, slot, k, self._nslots, data, n, self.local_rank)
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

    def _take(self, k: int, max_ns: int) -> int:
        """Native: wait up to ``max_ns`` for message ``k`` and take a whole single-slot message into
        ``self._out``. Returns its length, -1 (not published yet) or -2 (read it in Python)."""
        return self._native.shm_take(self._base, self._slot_addr[k % self._nslots], k, self._slot_bytes,
                                     self._out_addr, self._slot_bytes, max_ns, self._sender_addr)

    def _wait_slot(self, k: int, timeout_s: float | None, op: str) -> int:
        """Wait for message ``k``; returns its length if the native path took it, else -1 (published)."""
        slot = k % self._nslots
        seq = self._seq[slot]
        want = 2 * k + 2
        native = self._native
        if seq[0] == want:
            return -1 if native is None else self._take(k, 0)
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        next_live = now + _LIVENESS_EVERY_S
        next_abort = now + _ABORT_EVERY_S
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
                    end = min(poll_until, next_live, next_abort)
                    if deadline is not None:
                        end = min(end, deadline)
                    if native is not None:
                        n = self._take(k, int((end - now) * 1e9))
                        if n != -1:
                            return n
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
                        return -1 if native is None else self._take(k, 0)
                    if bell is not None:
                        wait = min(next_live, next_abort) - now
                        if deadline is not None:
                            wait = min(wait, deadline - now)
                        self._bell_poll.poll(max(0, int(wait * 1000) + 1))
                    else:
                        time.sleep(sleep)
                        sleep = min(2 * sleep, _MAX_SLEEP_S)
                if seq[0] == want:
                    return -1 if native is None else self._take(k, 0)
                now = time.monotonic()
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
                if self._abort_check is not None and now >= next_abort:
                    next_abort = now + _ABORT_EVERY_S
                    self._poll_abort(op)
                if deadline is not None and now >= deadline:
                    raise ControlRecvTimeout(
                        f"{op}: no control payload from {self.peer} within {timeout_s:g} s "
                        "(the peer is alive but idle)"
                    )
        finally:
            if waiting:
                hdr[_W_WAITING] = 0

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
        self._require(False, "recv")
        k = self._count
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        n = self._wait_slot(k, timeout_s, op)
        if n >= 0:  # taken by the native path (read_count already advanced)
            self._count = k + 1
            self._last_msg = time.monotonic()
            self._check_header(op, self._sender_out.value, n)
            return bytes(self._out[:n])
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
        self._hdr.release()
        self._buf = None  # type: ignore[assignment]
        self._unlink()
        try:
            self._shm.close()
        except BufferError:  # pragma: no cover - a view still exported
            logger.warning("control ring %s still has exported views at close", self._shm.name)


# ---------------------------------------------------------------------------
# TCP
# ---------------------------------------------------------------------------

_TCP_MAGIC = 0xAFDC7C01
_TCP_HDR = struct.Struct("<IIIQ")  # magic, type, sender world rank, length
_T_HELLO, _T_DATA, _T_HEARTBEAT, _T_CLOSE = 1, 2, 3, 4


def _advertise_address(store: AFDStore) -> str:
    """The local address peers should connect to: the one routing to the rendezvous host."""
    from afd_ext import envs

    override = envs.get("AFD_CONTROL_ADDR")
    if override:
        return override
    try:
        infos = socket.getaddrinfo(store.host, store.port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return socket.gethostbyname(socket.gethostname())
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)  # no packet is sent; the kernel picks the route and source address
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class TcpControlChannel(ControlChannel):
    """Length-prefixed frames over one TCP connection (``TCP_NODELAY``), heartbeat frames from the sender."""

    kind = "tcp"

    def __init__(self, sock: socket.socket, **kw):
        super().__init__(**kw)
        self._sock = sock
        self._lock = threading.Lock()
        self._rbuf = bytearray()
        self._last_seen = time.monotonic()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._token = b""
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def listen(store: AFDStore) -> socket.socket:
        """Receiver: a listening socket on the advertised address, port chosen by the kernel."""
        addr = _advertise_address(store)
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
        family, stype, proto, _, sa = infos[0]
        ls = socket.socket(family, stype, proto)
        ls.bind(sa)
        ls.listen(16)
        return ls

    @classmethod
    def accept(cls, ls: socket.socket, deadline: float, *, local_rank: int, peer_rank: int, peer: str,
               options: ChannelOptions, abort_check=None, store: AFDStore | None = None,
               token: bytes | None = None) -> "TcpControlChannel":
        """Receiver: accept the sender's connection; a hello from another rank, or with a token
        other than ``token`` (a stale sender of an earlier generation), is refused and waited past."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise rdzv.RendezvousTimeoutError(
                    f"{peer} did not connect its TCP control channel in time",
                    missing=(peer_rank,), what="control channel connect",
                )
            r, _, _ = select.select([ls], [], [], min(left, 0.1))
            if store is not None:
                rdzv.raise_if_aborted(store, op=f"waiting for {peer} to connect the control channel")
            if not r:
                continue
            conn, _ = ls.accept()
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                hdr = _recv_exact(conn, _TCP_HDR.size)
                magic, typ, sender, n = _TCP_HDR.unpack(hdr)
                body = _recv_exact(conn, n) if magic == _TCP_MAGIC and typ == _T_HELLO and n < 256 else b""
            except (OSError, ConnectionError):
                conn.close()
                continue
            if magic != _TCP_MAGIC or typ != _T_HELLO or sender != peer_rank or (
                    token is not None and body != token):
                logger.warning("control channel: refused a connection (world rank %d, expected %s)",
                               sender, peer)
                conn.close()
                continue
            conn.setblocking(True)
            conn.settimeout(None)
            ch = cls(conn, is_sender=False, local_rank=local_rank, peer_rank=peer_rank, peer=peer,
                     options=options, abort_check=abort_check)
            ch._token = body
            return ch

    @classmethod
    def connect(cls, addr: tuple[str, int], deadline: float, token: bytes, *, local_rank: int,
                peer_rank: int, peer: str, options: ChannelOptions, abort_check=None) -> "TcpControlChannel":
        """Sender: connect to the receiver, introduce itself, start the heartbeat."""
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection(addr, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                last = e
                time.sleep(0.05)
        else:
            raise rdzv.RendezvousTimeoutError(
                f"could not connect the TCP control channel to {peer} at {addr[0]}:{addr[1]}: {last}",
                missing=(peer_rank,), what="control channel connect",
            )
        ch = cls(sock, is_sender=True, local_rank=local_rank, peer_rank=peer_rank, peer=peer,
                 options=options, abort_check=abort_check)
        # Sends time out so a receiver that stopped reading cannot block the sender forever.
        sock.settimeout(options.heartbeat_timeout_s)
        ch._send_frame(_T_HELLO, token)
        ch._start_heartbeat()
        return ch

    def _send_frame(self, typ: int, data: bytes | memoryview = b"") -> None:
        frame = _TCP_HDR.pack(_TCP_MAGIC, typ, self.local_rank, len(data))
        with self._lock:
            if len(data) <= 65536:
                self._sock.sendall(frame + bytes(data))
            else:
                self._sock.sendall(frame)
                self._sock.sendall(data)

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._hb_stop.wait(self.options.heartbeat_interval_s):
                try:
                    self._send_frame(_T_HEARTBEAT)
                except OSError:
                    return

        self._hb_thread = threading.Thread(target=beat, name=f"afd-ctrl-heartbeat-{self.peer_rank}",
                                           daemon=True)
        self._hb_thread.start()

    def send(self, data: bytes) -> None:
        self._require(True, "send")
        self._check_len(len(data))
        try:
            self._send_frame(_T_DATA, data)
        except socket.timeout:
            raise PeerDeadError(
                self.peer, _OP_SEND,
                f"it read nothing for {self.options.heartbeat_timeout_s:g} s (TCP send buffer full)",
            ) from None
        except OSError as e:
            raise PeerDeadError(self.peer, _OP_SEND, f"connection lost ({e})") from None

    def _fill(self, need: int, deadline: float | None, op: str) -> None:
        """Read from the socket until ``need`` bytes are buffered, watching liveness."""
        sock = self._sock
        poller = self._poller
        hb = self.options.heartbeat_timeout_s
        now = time.monotonic()
        next_abort = now + _ABORT_EVERY_S
        native = _native()
        # While the engine is active keep polling (see the module doc), then block in poll().
        poll_until = self._last_msg + self.options.idle_s
        if native is None:
            poll_until = min(poll_until, now + _FALLBACK_SPIN_S)
        spin_fd = native.spin_fd if native is not None else None
        while len(self._rbuf) < need:
            if now < poll_until:
                if spin_fd is not None:
                    end = min(poll_until, next_abort)
                    if deadline is not None:
                        end = min(end, deadline)
                    spin_fd(sock.fileno(), int((end - now) * 1e9))
                wait_ms = 0
            else:
                wait_ms = int(1000 * min(_ABORT_EVERY_S, max(0.0, self._last_seen + hb - now) + 0.001))
                if deadline is not None:
                    wait_ms = min(wait_ms, max(0, int(1000 * (deadline - now)) + 1))
            events = poller.poll(wait_ms)
            if events:
                try:
                    chunk = sock.recv(max(65536, need - len(self._rbuf)))
                except (ConnectionResetError, OSError) as e:
                    raise PeerDeadError(self.peer, op, f"connection lost ({e})") from None
                if not chunk:
                    raise PeerDeadError(self.peer, op, "its connection closed without a goodbye (process exited)")
                self._rbuf += chunk
                now = self._last_seen = time.monotonic()
                continue
            now = time.monotonic()
            if now - self._last_seen > hb:
                raise PeerDeadError(
                    self.peer, op,
                    f"no heartbeat for {now - self._last_seen:.1f} s (heartbeat_timeout_s={hb:g}); "
                    "the process or its host is hung or unreachable",
                )
            if self._abort_check is not None and now >= next_abort:
                next_abort = now + _ABORT_EVERY_S
                self._poll_abort(op)
            if deadline is not None and now >= deadline:
                raise ControlRecvTimeout(
                    f"{op}: no control payload from {self.peer} within the timeout (the peer is alive but idle)"
                )

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        self._require(False, "recv")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._fill(_TCP_HDR.size, deadline, op)
            magic, typ, sender, n = _TCP_HDR.unpack_from(self._rbuf, 0)
            if magic != _TCP_MAGIC:
                raise ControlProtocolError(f"{op}: corrupt control frame from {self.peer} (bad magic {magic:#x})")
            self._check_header(op, sender, n)
            end = _TCP_HDR.size + n
            self._fill(end, None, op)  # the rest of a started frame is already on its way
            body = bytes(self._rbuf[_TCP_HDR.size:end])
            del self._rbuf[:end]
            if typ == _T_DATA:
                self._last_msg = time.monotonic()
                return body
            if typ == _T_CLOSE:
                raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel")
            if typ != _T_HEARTBEAT:
                raise ControlProtocolError(f"{op}: unexpected control frame type {typ} from {self.peer}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        if self.is_sender:
            try:
                self._send_frame(_T_CLOSE)
            except OSError:
                pass
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            self._sock.close()
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


# ---------------------------------------------------------------------------
# Opening the channels of one rank
# ---------------------------------------------------------------------------


def _normalise_role(role: Any) -> str:
    r = getattr(role, "value", role)
    r = str(r).lower()
    if r not in ("attention", "ffn"):
        raise AFDConfigError(f"role must be 'attention' or 'ffn', got {role!r}")
    return r


def _store_abort_check(store: AFDStore | None) -> Callable[[str], None] | None:
    if store is None:
        return None
    return lambda op: rdzv.raise_if_aborted(store, op=op)


def open_control_channels(
    store: AFDStore,
    topology: Any,
    role: str,
    role_rank: int,
    kind: str = "auto",
    timeout_s: float | None = None,
    *,
    options: ChannelOptions | None = None,
) -> dict[int, ControlChannel]:
    """Open this rank's control channels (collective over the control senders and FFN ranks).

    Attention rank ``a`` gets one sending channel per FFN rank in
    ``topology.control_destinations(a)`` (none when it is not a sender); FFN
    rank ``f`` gets one receiving channel from ``topology.control_source(f)``.
    Ranks without channels return at once.

    Args:
        store: this generation's store (:func:`afd_ext.rendezvous.connect`).
        topology: an :class:`afd_ext.topology.Topology`.
        role: ``"attention"`` or ``"ffn"``.
        role_rank: this rank inside its role.
        kind: ``"auto"`` (shm when both ends share a host, else tcp), ``"shm"`` or ``"tcp"``.
        timeout_s: deadline for the whole setup in seconds (None: the store's default).
        options: channel tuning (default :meth:`ChannelOptions.from_env`).

    Returns:
        peer role rank (FFN rank for a sender, attention rank for a receiver) -> channel.

    Raises:
        ValueError: unknown ``kind`` or role.
        RendezvousTimeoutError: a peer did not show up in time (named).
        RuntimeError: ``shm`` forced across hosts.
        StepAbortedError: an abort was posted meanwhile.
    """
    if kind not in CHANNEL_KINDS:
        raise AFDConfigError(f"control channel kind must be one of {CHANNEL_KINDS}, got {kind!r}")
    role = _normalise_role(role)
    opts = options or ChannelOptions.from_env()
    timeout = store.timeout_s if timeout_s is None else float(timeout_s)
    deadline = time.monotonic() + timeout
    F = topology.num_ffn_ranks
    me = topology.world_rank(role, role_rank)
    abort_check = _store_abort_check(store)
    if role == "attention":
        pairs = [(role_rank, f) for f in topology.control_destinations(role_rank)]
    else:
        pairs = [(topology.control_source(role_rank), role_rank)]
    if not pairs:
        return {}
    mine = rdzv.host_identity()
    store.set(f"ctrl/host/{me}", mine.encode("utf-8"))

    def pair_kind(a: int, f: int) -> str:
        if kind != "auto":
            return kind
        other = F + a if role == "ffn" else f
        rdzv.wait_for_keys(store, {f"ctrl/host/{other}": other}, deadline - time.monotonic(),
                           "the control channel host identity")
        theirs = store.get(f"ctrl/host/{other}").decode("utf-8")
        return "shm" if theirs == mine else "tcp"

    channels: dict[int, ControlChannel] = {}
    try:
        if role == "ffn":
            (a, f), = pairs
            peer_rank = F + a
            peer = store.label(peer_rank) if store.num_ffn_ranks else rdzv.rank_label(peer_rank, F)
            k = pair_kind(a, f)
            base = f"ctrl/{a}/{f}"
            store.set(f"{base}/kind", k.encode("utf-8"))
            if k == "shm":
                prefix = f"afd-{os.getpid()}-{store.generation_key}-{a}-{f}"
                ch = ShmControlChannel.create(prefix, local_rank=me, peer_rank=peer_rank, peer=peer,
                                              options=opts, abort_check=abort_check)
                try:
                    store.set(f"{base}/shm", ch.name.encode("utf-8"))
                    ch.wait_attached(deadline, store)
                except BaseException:
                    ch.close()
                    raise
                channels[a] = ch
            else:
                ls = TcpControlChannel.listen(store)
                try:
                    host, port = ls.getsockname()[:2]
                    token = secrets.token_bytes(16)
                    store.set(f"{base}/tcp", json.dumps(
                        {"host": host, "port": port, "token": token.hex()}).encode("utf-8"))
                    channels[a] = TcpControlChannel.accept(
                        ls, deadline, local_rank=me, peer_rank=peer_rank, peer=peer,
                        options=opts, abort_check=abort_check, store=store, token=token)
                finally:
                    ls.close()
        else:
            for a, f in pairs:
                peer_rank = f
                peer = rdzv.rank_label(peer_rank, F)
                k = pair_kind(a, f)
                base = f"ctrl/{a}/{f}"
                rdzv.wait_for_keys(store, {f"{base}/kind": peer_rank}, deadline - time.monotonic(),
                                   f"the control channel of {peer}")
                theirs = store.get(f"{base}/kind").decode("utf-8")
                if theirs != k:
                    msg = (f"control channel kind mismatch: {peer} opened a {theirs!r} channel, "
                           f"{store.label()} expects {k!r}; set connector_extra_config.control_channel "
                           "to the same value on every rank (or 'auto')")
                    rdzv.post_abort(store, msg)  # the FFN end stops waiting for us at once
                    raise AFDConfigError(msg)
                rdzv.wait_for_keys(store, {f"{base}/{k}": peer_rank}, deadline - time.monotonic(),
                                   f"the {k} control channel of {peer}")
                info = store.get(f"{base}/{k}").decode("utf-8")
                if k == "shm":
                    channels[f] = ShmControlChannel.attach(info, local_rank=me, peer_rank=peer_rank, peer=peer,
                                                           options=opts, abort_check=abort_check)
                else:
                    d = json.loads(info)
                    channels[f] = TcpControlChannel.connect(
                        (d["host"], int(d["port"])), deadline, bytes.fromhex(d["token"]),
                        local_rank=me, peer_rank=peer_rank, peer=peer, options=opts, abort_check=abort_check)
    except BaseException:
        for ch in channels.values():
            ch.close()
        raise
    return channels


# ---------------------------------------------------------------------------
# Control plane
# ---------------------------------------------------------------------------


class AFDControlPlane:
    """The reference's DP-metadata control plane (``connector.control_plane``) over host channels.

    One object per connector, built device-light at construction and kept
    across ``close()`` / ``init_afd_connector()``: :meth:`open` opens this
    rank's channels (collective, at init), :meth:`close` releases them (the
    object can be opened again). No device synchronisation anywhere.

    Args:
        apply_payload: ``apply_payload(payload)`` applies a payload to the
            connector (validates the step, builds its schedule); called by
            :meth:`update_state_from_dp_metadata`.
        topology: the :class:`~afd_ext.topology.Topology` (control routing).
        role: ``"attention"`` or ``"ffn"``; role_rank: this rank inside its role.
        channels: already opened channels (peer role rank -> channel, from
            :func:`open_control_channels`); None: call :meth:`open` later.
        store: the generation's store: its step-abort signal ends a waiting
            receive, and this rank posts it when a payload is malformed.
        recv_timeout_s: optional step timeout of :meth:`recv_dp_metadata_list`
            (None: wait as long as the sender's heartbeat is fresh).
        max_payload_bytes: bound on an incoming payload, in bytes.
        label: this rank's label in errors (default ``"<role> rank <role_rank>"``).

    Raises:
        AFDConfigError: unknown role, or ``channels`` do not match the topology's
            control routing.
    """

    def __init__(
        self,
        apply_payload: Callable[[Any], None],
        topology: Any,
        role: str,
        role_rank: int,
        channels: Mapping[int, ControlChannel] | None = None,
        *,
        store: AFDStore | None = None,
        recv_timeout_s: float | None = None,
        max_payload_bytes: int | None = None,
        label: str | None = None,
    ):
        from afd_ext import metadata as md

        self._md = md
        self._apply = apply_payload
        self.topology = topology
        self.role = _normalise_role(role)
        self.role_rank = role_rank
        self.label = label or f"{self.role} rank {role_rank}"
        self.recv_timeout_s = recv_timeout_s
        self.max_payload_bytes = max_payload_bytes or md.DEFAULT_MAX_CONTROL_BYTES
        if self.role == "attention":
            self.destinations: tuple[int, ...] = tuple(topology.control_destinations(role_rank))
            self.source: int | None = None
        else:
            self.destinations = ()
            self.source = topology.control_source(role_rank)
        self.channels: dict[int, ControlChannel] = {}
        self.store: AFDStore | None = None
        self._open = False
        if channels is not None:
            self.attach(channels, store=store)

    # -- lifecycle ----------------------------------------------------------------

    def open(self, store: AFDStore, kind: str = "auto", timeout_s: float | None = None, *,
             options: ChannelOptions | None = None) -> None:
        """Open this rank's control channels (collective over the control senders and FFN ranks).

        Args:
            store: this generation's store.
            kind: ``"auto"``, ``"shm"`` or ``"tcp"`` (see :func:`open_control_channels`).
            timeout_s: setup deadline in seconds (None: the store's default).
            options: channel tuning (default :meth:`ChannelOptions.from_env`).

        Raises:
            AFDStateError: already open.
            Whatever :func:`open_control_channels` raises (nothing is left open then).
        """
        if self._open:
            raise AFDStateError(f"the control plane of {self.label} is already open; close() it first")
        self.attach(open_control_channels(store, self.topology, self.role, self.role_rank, kind, timeout_s,
                                          options=options), store=store)

    def attach(self, channels: Mapping[int, ControlChannel], *, store: AFDStore | None = None) -> None:
        """Use already opened ``channels`` (peer role rank -> channel) and ``store``.

        Raises:
            AFDConfigError: the channels do not match the topology's control routing.
        """
        expected = set(self.destinations) if self.role == "attention" else {self.source}
        if set(channels) != expected:
            raise AFDConfigError(
                f"{self.label}: control channels to {sorted(channels)} do not match the topology's "
                f"control routing {sorted(expected)}; build them with open_control_channels"
            )
        self.channels = dict(channels)
        self.store = store
        self._open = True

    @property
    def is_open(self) -> bool:
        """Whether the channels are open (between :meth:`open` and :meth:`close`)."""
        return self._open

    @property
    def is_sender(self) -> bool:
        """Whether this rank sends control payloads (attention rank ``< min(A, F)``)."""
        return bool(self.destinations)

    def close(self) -> None:
        """Close every channel (idempotent; a sender's close tells its FFN ranks). :meth:`open` may follow."""
        channels, self.channels = self.channels, {}
        self._open = False
        self.store = None
        for ch in channels.values():
            try:
                ch.close()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("closing control channel to %s: %s", ch.peer, e)

    def _require_open(self, op: str) -> None:
        if not self._open:
            raise AFDStateError(
                f"AFD connector ({self.label}) is not initialized; call init_afd_connector() before {op}"
            )

    # -- the reference's three calls ------------------------------------------------

    def update_state_from_dp_metadata(self, payload: Any) -> None:
        """Apply ``payload`` locally (no network): validate the step, build its schedule.

        Attention ranks call it before :meth:`send_dp_metadata_list` every step;
        FFN ranks after :meth:`recv_dp_metadata_list`.

        Raises:
            Whatever ``apply_payload`` raises for an invalid step or a wrong state.
        """
        self._apply(payload)

    def send_dp_metadata_list(self, payload: Any) -> None:
        """Send ``payload`` to this attention rank's control destinations (a no-op on non-senders).

        Args:
            payload: an :class:`~afd_ext.metadata.AFDControlPayload`.

        Raises:
            AFDStateError: not open (connector not initialised).
            ValueError: not a valid control payload; AFDConfigError: larger than the channel's limit.
            PeerDeadError: a destination FFN rank is gone.
        """
        if not self._open:
            self._require_open("send_dp_metadata_list")
        if not self.destinations:
            return
        data = self._md.encode_control_binary(payload)
        for f in self.destinations:
            self.channels[f].send(data)

    def recv_dp_metadata_list(self) -> Any:
        """FFN side: block until the next step's payload arrives; return it decoded.

        Returns:
            A new :class:`~afd_ext.metadata.AFDControlPayload` (the counts are CPU
            int32 tensors on access, as the reference's runners read them).

        Raises:
            AFDStateError: called on an attention rank, or not open.
            PeerDeadError: the source attention rank died (its heartbeat stopped).
            ControlChannelClosed: the source closed its channel (clean shutdown).
            ControlRecvTimeout: ``recv_timeout_s`` passed.
            StepAbortedError: some rank posted the step-abort signal.
            ControlProtocolError: a malformed payload or frame (names the source);
                the step-abort signal is posted first, so every rank stops at once.
        """
        if self.role != "ffn":
            raise AFDStateError(f"recv_dp_metadata_list is called on FFN ranks only; this is {self.label}")
        if not self._open:
            self._require_open(_OP_RECV)
        ch = self.channels[self.source]  # type: ignore[index]
        try:
            data = ch.recv(self.recv_timeout_s, op=_OP_RECV)
            try:
                if len(data) > self.max_payload_bytes:
                    raise ValueError(f"{len(data)} bytes exceed max_payload_bytes={self.max_payload_bytes}")
                return self._md.decode_control_binary(data)
            except ValueError as e:
                raise ControlProtocolError(f"{_OP_RECV}: malformed control payload from {ch.peer}: {e}") from None
        except ControlProtocolError as e:
            if self.store is not None:
                rdzv.post_abort(self.store, str(e))
            raise


#: The name of the channel-based implementation before it became the one class.
ChannelControlPlane = AFDControlPlane


def __getattr__(name: str) -> Any:
    # The measurement moved to the bench (afd_ext.bench.control); the old name still resolves.
    if name == "measure_control_plane":
        from afd_ext.bench.control import measure_control_plane

        return measure_control_plane
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
