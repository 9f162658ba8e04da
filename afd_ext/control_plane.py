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
  alone suffices; the CRC is the safety net elsewhere). 8-byte fields are
  single aligned loads/stores (``memoryview.cast("Q")``). Messages larger
  than one slot are split over consecutive slots; the receiver bounds the
  total by ``max_message_bytes`` before allocating. The receiver spins for
  ``spin_s`` (default 2 ms, ``AFD_CONTROL_SPIN_US``); then it raises a
  ``waiting`` flag in the header and blocks on a doorbell (an abstract
  ``AF_UNIX`` datagram socket named after the segment), which the sender
  rings after publishing when it sees the flag (a lock's atomic instruction
  orders the publish before that read; the receiver's drain syscall orders
  its side), so an idle FFN rank burns no CPU and still wakes within tens of
  µs. The doorbell wait is sliced (50 ms) for the liveness checks. The FFN end creates the segment under a fresh random name tied to
  the store's generation, the sender attaches, and as soon as both are
  attached the name is unlinked: nothing is left in ``/dev/shm`` even if a
  process is killed later, and a stale segment is never reused.

* ``tcp`` (across hosts): the FFN end listens on the address through which it
  reaches the rendezvous host (never a hard-coded loopback; override with
  ``AFD_CONTROL_ADDR``), publishes ``addr:port`` through the store; the
  sender connects (``TCP_NODELAY``) and introduces itself. Frames are
  ``magic u32 | type u32 | sender world rank u32 | length u64 | bytes``.

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

Measured cost
-------------
:func:`measure_control_plane` measures attention ``send_dp_metadata_list``
call start -> FFN ``recv_dp_metadata_list`` return (encode, channel, decode)
in two processes on one host; see docs/configuration.md for the numbers.
"""

from __future__ import annotations

import abc
import json
import logging
import math
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
    "DEFAULT_SPIN_S",
    "CHANNEL_KINDS",
    "PeerDeadError",
    "StepAbortedError",
    "ControlChannelClosed",
    "ControlRecvTimeout",
    "ChannelOptions",
    "ControlChannel",
    "ShmControlChannel",
    "TcpControlChannel",
    "open_control_channels",
    "AFDControlPlane",
    "ChannelControlPlane",
    "measure_control_plane",
]

#: How often a sender publishes its heartbeat, in seconds.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
#: Heartbeat age after which the receiver declares the sender dead, in seconds.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
#: How long a receiver busy-polls before it starts sleeping, in seconds.
DEFAULT_SPIN_S = 0.002
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

_OP_RECV = "recv_dp_metadata_list"
_OP_SEND = "send_dp_metadata_list"


from .errors import ControlChannelClosed, ControlRecvTimeout, PeerDeadError  # noqa: E402,F401


@dataclass(frozen=True)
class ChannelOptions:
    """Tuning of the control channels (all times in seconds).

    Attributes:
        heartbeat_interval_s: how often the sender publishes a heartbeat.
        heartbeat_timeout_s: heartbeat age that makes the receiver raise
            :class:`PeerDeadError`; must exceed ``heartbeat_interval_s``.
        spin_s: receiver busy-poll time before sleeping (shm, and tcp before
            blocking); 0 disables spinning.
        slot_bytes: shm payload bytes per slot (>= 64).
        nslots: shm ring slots (>= 2).
        max_message_bytes: largest message accepted by a receiver.
    """

    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    spin_s: float = DEFAULT_SPIN_S
    slot_bytes: int = DEFAULT_SLOT_BYTES
    nslots: int = DEFAULT_NSLOTS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s!r}")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s!r}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s!r})"
            )
        if self.spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, got {self.spin_s!r}")
        if not (isinstance(self.slot_bytes, int) and self.slot_bytes >= 64):
            raise ValueError(f"slot_bytes must be an int >= 64, got {self.slot_bytes!r}")
        if not (isinstance(self.nslots, int) and self.nslots >= 2):
            raise ValueError(f"nslots must be an int >= 2, got {self.nslots!r}")
        if not (isinstance(self.max_message_bytes, int) and self.max_message_bytes >= 1):
            raise ValueError(f"max_message_bytes must be an int >= 1, got {self.max_message_bytes!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "ChannelOptions":
        """Defaults, ``AFD_CONTROL_SPIN_US`` from the environment, then ``overrides`` (None ignored).

        The connector passes ``heartbeat_interval_s``/``heartbeat_timeout_s`` from
        ``connector_extra_config``.
        """
        from afd_ext import envs

        kw: dict[str, Any] = {"spin_s": float(envs.get("AFD_CONTROL_SPIN_US")) * 1e-6}
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

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """Send one message (sender end only).

        Args:
            data: the message bytes (e.g. an encoded control payload), at most
                ``options.max_message_bytes``.

        Raises:
            ValueError: message too large; RuntimeError: wrong end or closed channel;
            PeerDeadError: the receiver is gone.
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
            RuntimeError: a frame from an unexpected sender.
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
            raise ValueError(
                f"control message of {n} bytes exceeds max_message_bytes="
                f"{self.options.max_message_bytes}; raise it on both ends"
            )

    def _check_header(self, op: str, sender: int, total: int) -> None:
        """A received message's header: from the expected world rank, within ``max_message_bytes``."""
        if sender != self.peer_rank:
            raise RuntimeError(
                f"{op}: received AFD DP metadata from world rank {sender}, expected {self.peer}"
            )
        if total > self.options.max_message_bytes:
            raise ValueError(
                f"{op}: {self.peer} announced a {total}-byte control message, above "
                f"max_message_bytes={self.options.max_message_bytes}"
            )

    def _require(self, sender: bool, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on a closed {self.kind} control channel to {self.peer}")
        if self.is_sender != sender:
            end = "sending (attention)" if self.is_sender else "receiving (FFN)"
            raise RuntimeError(f"{what} called on the {end} end of the control channel to {self.peer}")


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
            raise RuntimeError(f"could not create a shared-memory segment named {name_prefix}-*")
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
            raise RuntimeError(
                f"shared-memory control segment {name!r} of {peer} not found: the two ranks do "
                "not share /dev/shm (different hosts or containers); set the control channel "
                "kind to 'tcp' (AFD_CONTROL_CHANNEL=tcp)"
            ) from None
        hdr = shm.buf[:_HDR_BYTES].cast("Q")
        ok = False
        try:
            if hdr[_W_MAGIC] != _SHM_MAGIC or (hdr[_W_VER_NSLOTS] & 0xFFFFFFFF) != _SHM_VERSION:
                raise RuntimeError(f"shared-memory segment {name!r} is not an AFD control ring v{_SHM_VERSION}")
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

    def _wait_slot(self, k: int, timeout_s: float | None, op: str) -> None:
        seq = self._seq[k % self._nslots]
        want = 2 * k + 2
        if seq[0] == want:
            return
        now = time.monotonic()
        spin_until = now + self.options.spin_s
        deadline = None if timeout_s is None else now + timeout_s
        next_live = now + _LIVENESS_EVERY_S
        next_abort = now + _ABORT_EVERY_S
        while seq[0] != want and time.monotonic() < spin_until:
            pass
        if seq[0] == want:
            return
        sleep = _MIN_SLEEP_S
        hb_timeout_ns = int(self.options.heartbeat_timeout_s * 1e9)
        bell = self._bell
        hdr = self._hdr
        hdr[_W_WAITING] = 1
        try:
            while True:
                if bell is not None:
                    _drain(bell)  # a syscall: orders the waiting flag before the seq load
                if seq[0] == want:
                    return
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
                if bell is not None:
                    wait = min(next_live, next_abort) - now
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    self._bell_poll.poll(max(0, int(wait * 1000) + 1))
                else:
                    time.sleep(sleep)
                    sleep = min(2 * sleep, _MAX_SLEEP_S)
        finally:
            hdr[_W_WAITING] = 0

    def _read_slot(self, k: int, expect_total: int | None, op: str) -> tuple[int, memoryview | bytes]:
        slot = k % self._nslots
        base = _HDR_BYTES + slot * self._stride
        seq = self._seq[slot]
        want = 2 * k + 2
        for attempt in range(1_000_000):
            total, fl, sender, crc = _SLOT_FIELDS.unpack_from(self._buf, base + 8)
            if fl <= self._slot_bytes:
                frag = bytes(self._buf[base + _SLOT_HDR:base + _SLOT_HDR + fl])
                ok = (seq[0] == want and zlib.crc32(
                    frag, zlib.crc32(_CRC_FIELDS.pack(want, total, fl, sender))) == crc)
                if ok:
                    break
            if attempt > 1000:
                time.sleep(_MIN_SLEEP_S)
        else:  # pragma: no cover - would mean a broken writer
            raise RuntimeError(f"{op}: control ring slot {slot} from {self.peer} never became consistent")
        self._check_header(op, sender, total)
        if expect_total is not None and total != expect_total:
            raise RuntimeError(f"{op}: control message fragments from {self.peer} disagree on the length")
        return total, frag

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        self._require(False, "recv")
        k = self._count
        self._wait_slot(k, timeout_s, op)
        total, frag = self._read_slot(k, None, op)
        self._count = k + 1
        self._hdr[_W_READ_COUNT] = self._count
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
                raise RuntimeError(f"{op}: control message fragments from {self.peer} overflow the length")
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
        next_abort = time.monotonic() + _ABORT_EVERY_S
        spin_until = time.monotonic() + self.options.spin_s
        while len(self._rbuf) < need:
            now = time.monotonic()
            if now < spin_until:
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
                self._last_seen = time.monotonic()
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
                raise RuntimeError(f"{op}: corrupt control frame from {self.peer} (bad magic {magic:#x})")
            self._check_header(op, sender, n)
            end = _TCP_HDR.size + n
            self._fill(end, None, op)  # the rest of a started frame is already on its way
            body = bytes(self._rbuf[_TCP_HDR.size:end])
            del self._rbuf[:end]
            if typ == _T_DATA:
                return body
            if typ == _T_CLOSE:
                raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel")
            if typ != _T_HEARTBEAT:
                raise RuntimeError(f"{op}: unexpected control frame type {typ} from {self.peer}")

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
        raise ValueError(f"role must be 'attention' or 'ffn', got {role!r}")
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
        raise ValueError(f"control channel kind must be one of {CHANNEL_KINDS}, got {kind!r}")
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
                    raise ValueError(msg)
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


class AFDControlPlane(abc.ABC):
    """The reference's DP-metadata control plane contract."""

    @abc.abstractmethod
    def update_state_from_dp_metadata(self, payload: Any) -> None:
        """Apply ``payload`` locally (no network): store the step's DP metadata and flags,
        derive the step's schedule, validate it. Attention: before every send; FFN: after
        each receive (by the runner)."""

    @abc.abstractmethod
    def send_dp_metadata_list(self, payload: Any) -> None:
        """Attention -> FFN, once per step. A no-op on ranks that are not control senders."""

    @abc.abstractmethod
    def recv_dp_metadata_list(self) -> Any:
        """FFN side: block until the next step's payload arrives and return it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release channels (idempotent)."""


class ChannelControlPlane(AFDControlPlane):
    """Control plane over :class:`ControlChannel` objects (host memory only, no device sync).

    Args:
        connector_state_callback: ``callback(payload)`` applying a payload to the
            connector (called by :meth:`update_state_from_dp_metadata`).
        topology: the :class:`~afd_ext.topology.Topology`.
        role: ``"attention"`` or ``"ffn"``; role_rank: this rank inside its role.
        channels: from :func:`open_control_channels` (peer role rank -> channel).
        store: the generation's store, to watch the step-abort signal while receiving.
        recv_timeout_s: optional step timeout for :meth:`recv_dp_metadata_list`
            (None: wait as long as the sender's heartbeat is fresh).
        max_payload_bytes: bound passed to the decoder.

    Raises:
        ValueError: channels do not match the topology's control routing.
    """

    def __init__(
        self,
        connector_state_callback: Callable[[Any], None],
        topology: Any,
        role: str,
        role_rank: int,
        channels: Mapping[int, ControlChannel],
        *,
        store: AFDStore | None = None,
        recv_timeout_s: float | None = None,
        max_payload_bytes: int | None = None,
    ):
        self._callback = connector_state_callback
        self.topology = topology
        self.role = _normalise_role(role)
        self.role_rank = role_rank
        self.channels = dict(channels)
        self.store = store
        self.recv_timeout_s = recv_timeout_s
        from afd_ext import metadata as md

        self._md = md
        self.max_payload_bytes = max_payload_bytes or md.DEFAULT_MAX_CONTROL_BYTES
        if self.role == "attention":
            self.destinations = tuple(topology.control_destinations(role_rank))
            self.source = None
            expected = set(self.destinations)
        else:
            self.destinations = ()
            self.source = topology.control_source(role_rank)
            expected = {self.source}
        if set(self.channels) != expected:
            raise ValueError(
                f"{self.role} rank {role_rank}: control channels to {sorted(self.channels)} do not match "
                f"the topology's control routing {sorted(expected)}; build them with open_control_channels"
            )

    @property
    def is_sender(self) -> bool:
        """Whether this rank sends control payloads (attention rank ``< min(A, F)``)."""
        return bool(self.destinations)

    def update_state_from_dp_metadata(self, payload: Any) -> None:
        """Apply ``payload`` to the connector through the callback (no network).

        Raises:
            whatever the callback raises for an invalid step (e.g. ``ValueError``).
        """
        self._callback(payload)

    def send_dp_metadata_list(self, payload: Any) -> None:
        """Encode ``payload`` and send it to every control destination (no-op elsewhere).

        Args:
            payload: an :class:`~afd_ext.metadata.AFDControlPayload`.

        Raises:
            ValueError: not a control payload, or larger than the channel's limit.
            PeerDeadError: a destination FFN rank is gone.
        """
        if not self.destinations:
            return
        data = self._md.encode_control_payload(payload)
        for f in self.destinations:
            self.channels[f].send(data)

    def recv_dp_metadata_list(self) -> Any:
        """Block until the next step's payload arrives; return it decoded.

        Returns:
            The :class:`~afd_ext.metadata.AFDControlPayload` (counts as CPU int32 tensors).

        Raises:
            RuntimeError: called on an attention rank.
            PeerDeadError: the source attention rank died (its heartbeat stopped).
            ControlChannelClosed: the source closed its channel (clean shutdown).
            ControlRecvTimeout: ``recv_timeout_s`` passed.
            StepAbortedError: some rank posted the step-abort signal.
            ValueError: the payload is malformed (names the source).
        """
        if self.role != "ffn":
            raise RuntimeError("recv_dp_metadata_list is called on FFN ranks only")
        ch = self.channels[self.source]
        data = ch.recv(self.recv_timeout_s, op=_OP_RECV)
        try:
            return self._md.decode_control_payload(data, max_bytes=self.max_payload_bytes)
        except ValueError as e:
            raise ValueError(f"{_OP_RECV}: malformed control payload from {ch.peer}: {e}") from None

    def close(self) -> None:
        """Close every channel (idempotent; the sender's close tells its FFN ranks)."""
        for ch in self.channels.values():
            try:
                ch.close()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("closing control channel to %s: %s", ch.peer, e)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def _pause(gap_s: float, spin: bool) -> None:
    """Wait ``gap_s`` between measured sends: spin like a busy attention rank, or sleep."""
    if not spin:
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def _measure_worker(rank: int, nprocs: int, host: str, port: int, kind: str, iterations: int,
                    warmup: int, gap_s: float, num_attention_ranks: int, stages: int, raw: bool,
                    spin_s: float, distinct: bool = False, sender_spins: bool = False) -> dict:
    import torch

    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
    from afd_ext.topology import Topology

    topo = Topology(1, 1)
    role = "ffn" if rank == 0 else "attention"
    store = rdzv.connect(host, port, rank, 2, 60.0, num_ffn_ranks=1)
    channels = open_control_channels(store, topo, role, 0, kind, 60.0,
                                     options=ChannelOptions(spin_s=spin_s))
    cp = ChannelControlPlane(lambda p: None, topo, role, 0, channels, store=store)
    used = next(iter(channels.values())).kind
    rdzv.barrier(store, rank, 2, "measure-start", 60.0)
    total = warmup + iterations
    stamps: list[int] = []
    try:
        if role == "attention":
            from afd_ext.metadata import encode_control_payload

            counts = [(7 * i + 3) % 64 for i in range(num_attention_ranks)]
            payload = AFDControlPayload(
                dp_metadata_list={s: AFDDPMetadata(torch.tensor(counts, dtype=torch.int32))
                                  for s in range(stages)})
            data = encode_control_payload(payload)
            ch = channels[0]
            for i in range(total):
                if distinct:  # a new payload per step, as a serving loop builds it (before the call)
                    payload = AFDControlPayload(dp_metadata_list={
                        s: AFDDPMetadata([i + s] + counts[1:]) for s in range(stages)})
                    if raw:
                        data = encode_control_payload(payload)
                t0 = time.perf_counter_ns()
                if raw:
                    ch.send(data)
                else:
                    cp.send_dp_metadata_list(payload)
                stamps.append(t0)
                _pause(gap_s, sender_spins)
            rdzv.barrier(store, rank, 2, "measure-end", 60.0)
        else:
            ch = channels[0]
            for i in range(total):
                if raw:
                    ch.recv(30.0)
                else:
                    p = cp.recv_dp_metadata_list()
                stamps.append(time.perf_counter_ns())
                if distinct and not raw and p.dp_metadata_list[0].counts[0] != i:
                    raise RuntimeError(f"measurement: step {i} received the counts of step "
                                       f"{p.dp_metadata_list[0].counts[0]}")
            rdzv.barrier(store, rank, 2, "measure-end", 60.0)
    finally:
        cp.close()
    return {"kind": used, "stamps": stamps[warmup:]}


def measure_control_plane(
    kind: str = "auto",
    iterations: int = 2000,
    *,
    warmup: int = 200,
    gap_us: float = 200.0,
    num_attention_ranks: int = 8,
    stages: int = 2,
    raw: bool = False,
    spin_s: float = DEFAULT_SPIN_S,
    timeout_s: float = 120.0,
    distinct: bool = False,
    sender_wait: str = "auto",
) -> dict[str, Any]:
    """Measure the control plane end to end in two processes on this host.

    An attention process calls ``send_dp_metadata_list`` every ``gap_us``; an
    FFN process loops on ``recv_dp_metadata_list``. Latency of message ``i`` is
    the FFN return time minus the attention call start, both
    ``time.perf_counter_ns`` (CLOCK_MONOTONIC, shared by processes on one host).

    Args:
        kind: ``"shm"``, ``"tcp"`` or ``"auto"``.
        iterations: measured messages (after ``warmup``).
        warmup: discarded first messages.
        gap_us: pause between sends in µs (keep it above the latency so nothing queues).
        num_attention_ranks: length of the count vector in the payload (payload size).
        stages: stages in the payload.
        raw: measure the channel alone (pre-encoded bytes, no decode) instead of the
            control-plane calls.
        spin_s: receiver busy-poll window (a gap longer than it measures the sleeping path).
        timeout_s: deadline for the whole measurement.
        distinct: send a new payload (new counts) every step, built before the timed
            call, so no encode/decode cache can hit; False repeats one payload (a
            steady decode batch).
        sender_wait: how the attention process spends ``gap_us``: ``"spin"`` (busy,
            as an attention rank computing its layers is: its core stays awake),
            ``"sleep"`` (its core may drop into a C-state and wake slowly, which the
            next send then pays), or ``"auto"``: spin when the host has at least 4
            CPUs, sleep otherwise (on 2 cores a spinning sender starves the receiver
            it is measuring).

    Returns:
        ``{"kind", "n", "p50_us", "p90_us", "p99_us", "mean_us", "min_us", "max_us",
        "payload_bytes", "sender_wait"}``.

    Raises:
        ValueError: ``iterations < 1`` or an unknown ``sender_wait``.
    """
    from afd_ext.testing import find_free_port, run_workers

    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if sender_wait not in ("auto", "spin", "sleep"):
        raise ValueError(f"sender_wait must be 'auto', 'spin' or 'sleep', got {sender_wait!r}")
    if sender_wait == "auto":
        sender_wait = "spin" if (os.cpu_count() or 1) >= 4 else "sleep"
    host = "127.0.0.1"
    port = find_free_port(host)
    res = run_workers(_measure_worker, 2, (host, port, kind, iterations, warmup, gap_us * 1e-6,
                                           num_attention_ranks, stages, raw, spin_s, distinct,
                                           sender_wait == "spin"),
                      timeout_s=timeout_s)
    recv_ns, send_ns = res[0]["stamps"], res[1]["stamps"]
    lat = sorted((r - s) / 1000.0 for r, s in zip(recv_ns, send_ns))

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, max(0, math.ceil(p / 100.0 * len(lat)) - 1))]

    import torch

    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata, encode_control_payload

    size = len(encode_control_payload(AFDControlPayload(dp_metadata_list={
        s: AFDDPMetadata(torch.tensor([(7 * i + 3) % 64 for i in range(num_attention_ranks)],
                                      dtype=torch.int32)) for s in range(stages)})))
    return {
        "kind": res[0]["kind"], "raw": raw, "distinct": distinct, "n": len(lat),
        "p50_us": pct(50), "p90_us": pct(90), "p99_us": pct(99),
        "mean_us": sum(lat) / len(lat), "min_us": lat[0], "max_us": lat[-1],
        "payload_bytes": size, "sender_wait": sender_wait,
    }


def _main(argv: list[str] | None = None) -> int:
    """``python -m afd_ext.control_plane``: print :func:`measure_control_plane` results as JSON lines."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m afd_ext.control_plane",
                                description="Measure the AFD control plane end to end on this host.")
    p.add_argument("--kinds", default="shm,tcp", help="comma-separated channel kinds (default shm,tcp)")
    p.add_argument("--iterations", type=int, default=3000)
    p.add_argument("--gaps-us", default="200,5000",
                   help="pauses between sends, µs: below the spin window measures the spinning receiver, "
                        "above it the blocked one (default 200,5000)")
    p.add_argument("--num-attention-ranks", type=int, default=8, help="count-vector length (payload size)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--payloads", default="same,distinct",
                   help="'same' repeats one payload (steady batch), 'distinct' sends new counts every step "
                        "(no cache hit); comma-separated (default both)")
    p.add_argument("--no-raw", action="store_true", help="skip the channel-only measurement")
    p.add_argument("--sender-wait", choices=("auto", "spin", "sleep"), default="auto",
                   help="how the attention process waits between sends: spin (a busy attention rank), "
                        "sleep, or auto (spin with >= 4 CPUs)")
    args = p.parse_args(argv)
    for kind in args.kinds.split(","):
        for gap in (float(g) for g in args.gaps_us.split(",")):
            for which in args.payloads.split(","):
                if which not in ("same", "distinct"):
                    p.error(f"--payloads: expected same and/or distinct, got {which!r}")
                for raw in (False,) if args.no_raw else (True, False):
                    it = args.iterations if gap <= 1000 else max(50, args.iterations // 10)
                    r = measure_control_plane(kind, it, warmup=min(200, it // 5), gap_us=gap, raw=raw,
                                              num_attention_ranks=args.num_attention_ranks, stages=args.stages,
                                              distinct=which == "distinct", sender_wait=args.sender_wait)
                    r["gap_us"] = gap
                    r["what"] = "channel only" if raw else "send_dp_metadata_list -> recv_dp_metadata_list"
                    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}),
                          flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
