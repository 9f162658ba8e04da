"""Control channels: options, the channel contract and its liveness policy, the native path.

The design is described in :mod:`afd_ext.control` (package doc).
"""

from __future__ import annotations

import abc
import ctypes
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from afd_ext import rendezvous as rdzv
from afd_ext.errors import (  # noqa: F401 - ControlChannelClosed, ControlProtocolError: re-exported by the package
    AFDConfigError,
    AFDStateError,
    ControlChannelClosed,
    ControlProtocolError,
    ControlRecvTimeout,
    PeerDeadError,
)


logger = logging.getLogger("afd_ext.control_plane")  # the name users configure (docs/troubleshooting.md)

#: How often a sender publishes its heartbeat, in seconds.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
#: Heartbeat age after which the receiver declares the sender dead, in seconds.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
#: How long after the last payload a waiting receiver keeps polling before it blocks, in seconds.
DEFAULT_IDLE_S = 10.0
#: How often a polling shm receiver rehearses its receive path, in seconds (0: never).
DEFAULT_WARM_S = 0.0005
#: How often a shm sender's keeper reads its send path while it sends, in seconds (0: no keeper).
DEFAULT_KEEP_S = 0.0005
#: ``ChannelOptions.tcp_proxy`` None (auto): the proxy runs where the process may use this many CPUs.
PROXY_MIN_CPUS = 4
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
# The plane's first native wait slice for a payload (ControlChannel.take_front); the checks above
# start after it, so a dead peer or an abort is noticed at most this much later.
_FIRST_SLICE_S = 0.1
_MAX_SLEEP_S = 0.001
_STORE_LOSS_GRACE_S = 1.0
_MIN_SLEEP_S = 20e-6
# Without the native poll: the longest Python spin (it holds the GIL) before blocking.
_FALLBACK_SPIN_S = 0.002
# A writer fills a slot in microseconds; a published slot inconsistent for this long is corrupt.
_CORRUPT_AFTER_S = 1.0


def _due_in(period_s: float) -> float:
    """When a waiting receiver's periodic check is next due, seconds from now: ``period_s`` ± 50 %.

    Jittered because a fixed period counted from the start of each wait lines up
    with a fixed step gap (a 50 ms gap met the 50 ms liveness check at every
    step: ~60 µs added to the p50 on the H200 host, GPU run 18).
    """
    return period_s * (0.5 + _jitter.random())


_jitter = random.Random()  # its own generator: a user's random.seed() sequence is left alone

_OP_RECV = "recv_dp_metadata_list"
_OP_SEND = "send_dp_metadata_list"



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
        warm_s: receiver, while polling: every ``warm_s`` the native wait
            builds the last payload it took again (shm: after a CRC over it),
            sends it as the attention end does on a private scratch ring, and
            drops it (1-3 µs holding the GIL), so that a payload after a long
            gap finds both ends' code in cache; tcp also sends a frame of the
            last one's size over a private loopback pair and reads it (its
            recv() path, GIL released); 0: off.
            Default 0.5 ms (``AFD_CONTROL_WARM_S``; docs/configuration.md,
            "Control-plane cost per step", has the measurements).
        keep_s: sender, while it sends (a send less than ``idle_s`` ago): a
            native thread of its process, on any allowed CPU but the one of
            the thread that opened the channel, holding no GIL. shm: the
            keeper, which every ``keep_s`` reads every cache line of the send
            path's code and the ring, so that they stay in the shared
            last-level cache while the sending thread runs its model. tcp,
            with ``tcp_proxy``: the proxy, which spins, sends each frame
            from its CPU, and every ``keep_s`` runs a round on a private
            loopback pair so that the kernel's TCP path stays warm there.
            0: neither. Default 0.5 ms (``AFD_CONTROL_KEEP_S``).
        tcp_proxy: tcp sender: run the proxy (above): True, False, or None
            (the default: on when ``keep_cpus`` names its CPUs or the
            opening thread may run on at least :data:`PROXY_MIN_CPUS` CPUs, so
            never on a small CI box; :meth:`proxy_on`). It costs
            one core per attention rank while it sends (it rests ``idle_s``
            after the last send); on the H200 host it took the tcp step at a
            50 ms gap from 27.8 to 15.8 µs p50 (``AFD_CONTROL_TCP_PROXY``;
            docs/configuration.md).
        keep_cpus: the CPUs that thread runs on (CPU numbers below 1024, as
            ``os.sched_setaffinity`` takes; the kernel keeps those of them the
            process's cpuset allows, and with none the thread does not start,
            the sends going on without it); None: any the opening thread may
            use but the one it runs on at the open (``AFD_CONTROL_KEEP_CPUS``,
            e.g. ``"3"`` or ``"3,4"``). A tcp sender whose thread runs on the
            proxy's CPU sends itself (the proxy could not run meanwhile).
    """

    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    idle_s: float = DEFAULT_IDLE_S
    slot_bytes: int = DEFAULT_SLOT_BYTES
    nslots: int = DEFAULT_NSLOTS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    warm_s: float = DEFAULT_WARM_S
    keep_s: float = DEFAULT_KEEP_S
    keep_cpus: tuple[int, ...] | None = None
    tcp_proxy: bool | None = None

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
        if not self.warm_s >= 0:
            raise AFDConfigError(f"warm_s must be >= 0 seconds, got {self.warm_s!r}")
        if not self.keep_s >= 0:
            raise AFDConfigError(f"keep_s must be >= 0 seconds, got {self.keep_s!r}")
        if self.keep_cpus is not None:
            cpus = tuple(self.keep_cpus) if isinstance(self.keep_cpus, (tuple, list, set, frozenset)) else ()
            if not cpus or not all(type(c) is int and 0 <= c < 1024 for c in cpus):
                raise AFDConfigError(f"keep_cpus must be CPU numbers (ints in [0, 1024)) or None, got {self.keep_cpus!r}")
            object.__setattr__(self, "keep_cpus", tuple(sorted(set(cpus))))
        if self.tcp_proxy is not None and type(self.tcp_proxy) is not bool:
            raise AFDConfigError(f"tcp_proxy must be True, False or None (auto), got {self.tcp_proxy!r}")
        if not (isinstance(self.max_message_bytes, int) and self.max_message_bytes >= 1):
            raise AFDConfigError(f"max_message_bytes must be an int >= 1, got {self.max_message_bytes!r}")

    def proxy_on(self) -> bool:
        """Whether a tcp sender runs its send proxy: ``tcp_proxy``; with None, when ``keep_cpus`` names
        its CPUs or the calling thread may run on at least :data:`PROXY_MIN_CPUS` CPUs, its
        container's CPU quota (cgroup v2 ``cpu.max``) included (a thread pinned to fewer has no
        core to give it); never with ``keep_s`` 0."""
        if self.keep_s <= 0:
            return False
        if self.tcp_proxy is not None:
            return self.tcp_proxy
        if self.keep_cpus is not None:
            return True
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            return False
        quota = _cgroup_cpu_quota()  # a container's CPU quota bounds what its threads may use
        return min(n, quota if quota is not None else n) >= PROXY_MIN_CPUS

    @classmethod
    def from_env(cls, **overrides: Any) -> "ChannelOptions":
        """Defaults, ``AFD_CONTROL_IDLE_S`` / ``_WARM_S`` / ``_KEEP_S`` / ``_KEEP_CPUS`` / ``_TCP_PROXY`` from the environment,
        then ``overrides`` (None ignored).

        The connector passes ``heartbeat_interval_s``/``heartbeat_timeout_s`` from
        ``connector_extra_config``.
        """
        from afd_ext import envs

        kw: dict[str, Any] = {"idle_s": envs.get("AFD_CONTROL_IDLE_S"), "warm_s": envs.get("AFD_CONTROL_WARM_S"),
                              "keep_s": envs.get("AFD_CONTROL_KEEP_S"), "keep_cpus": envs.get("AFD_CONTROL_KEEP_CPUS"),
                              "tcp_proxy": envs.get("AFD_CONTROL_TCP_PROXY")}
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


class WarmState(ctypes.Structure):
    """A waiting receiver's rehearsal as the native code sees it (``struct afd_ctrl_warm``): between
    slices of its wait the native take builds the last message it took again, every ``warm_ns``
    (``ChannelOptions.warm_s``; 0: never), and with ``sender`` set also sends that payload as the
    attention end does (encode, CRC, publish) on a scratch ring private to the process, then drops
    it, so that a payload after a long gap finds both ends' code in cache (on one host the two
    processes share the compiled core's code pages, and the cores share the last-level cache).
    ``last``/``last_len`` (the message kept in the end's buffer) are the take's."""

    _fields_ = [
        ("warm_ns", ctypes.c_int64),
        ("last", ctypes.c_void_p),
        ("last_len", ctypes.c_uint64),  # 0: nothing kept
        ("rehearsals", ctypes.c_uint64),  # rehearsals done
        ("sender", ctypes.c_uint32),  # nonzero: rehearse the attention end's send too
        ("pad_", ctypes.c_uint32),
        ("sends", ctypes.c_uint64),  # sender rehearsals that encoded and published
    ]

    def arm(self, is_sender: bool, options: "ChannelOptions") -> None:
        """Set this end's rehearsal from ``options.warm_s`` (a sender's end never waits: none)."""
        self.warm_ns = 0 if is_sender else int(options.warm_s * 1e9)
        self.sender = 1 if self.warm_ns else 0


class RingState(ctypes.Structure):
    """One end of one shared-memory ring as the native code sees it (``struct afd_ctrl_ring``).

    ``k`` is the end's one message count (the native calls advance it); ``hdr`` is null once
    the channel is closed (every native call then declines)."""

    _fields_ = [
        ("hdr", ctypes.c_void_p),
        ("nslots", ctypes.c_uint64),
        ("stride", ctypes.c_uint64),
        ("slot_bytes", ctypes.c_uint64),
        ("out", ctypes.c_void_p),
        ("k", ctypes.c_uint64),
        ("local_rank", ctypes.c_uint32),
        ("pad0_", ctypes.c_uint32),
        # CLOCK_MONOTONIC ns: sender, when the last publish began; receiver, when the poll saw
        # the last message taken (afd_ext.bench.control reports the phases from it)
        ("t_ns", ctypes.c_int64),
        ("expect_sender", ctypes.c_uint32),  # receiver: the sender's world rank
        ("bell_fd", ctypes.c_int32),  # sender: the doorbell socket, -1 none
        ("max_msg", ctypes.c_uint64),  # receiver: the largest message it takes natively
        ("bell_len", ctypes.c_uint32),
        ("stamps", ctypes.c_uint32),  # nonzero: also stamp t_mark (the bench's finer phases)
        ("bell_addr", ctypes.c_uint8 * 112),  # sender: the doorbell's sockaddr_un
        # with stamps, CLOCK_MONOTONIC ns: sender, native send entered; receiver, GIL back after a take
        ("t_mark", ctypes.c_int64),
        ("busy", ctypes.c_uint32),  # native calls in flight on this end (close() waits for 0)
        ("pad_", ctypes.c_uint32),
        ("warm", WarmState),  # receiver: the rehearsal
        ("t_built", ctypes.c_int64),  # with stamps, receiver: when the last payload taken was built
    ]


class _Native:
    """The compiled core's control-plane functions (``csrc/cpu/control_poll.cpp``).

    CPython functions of ``_C`` (no ctypes conversions on the per-message path),
    taking the address of a :class:`RingState` (shm) or ``TcpState`` (tcp) and
    plain ints; the waits release the GIL. The takes return a received payload
    already built (the :class:`~afd_ext.metadata.AFDControlPayload` the caller
    hands on); the sends read it from its fields.
    """

    def __init__(self, lib: Any, module: Any):
        # (ring address, max_ns, max_stages, max_ranks) -> -1 not yet, -2 slow path, the built payload,
        # or bytes (max_stages < 0, or a message that is not a well-formed payload)
        self.take = module.ctrl_take
        # TakeFront(ring address, prepare, fallback, owner, max_stages, max_ranks)() -> the payload
        # built within the slice of prepare() ns, else fallback(what the slice took, or None)
        self.take_front = module.TakeFront
        # (ring address, flags, stages) -> 0 sent (doorbell rung), -1 ring full, -2 encode it in Python
        self.send = module.ctrl_send
        # (ring address, payload) -> as send; the payload read straight from its fields (few cache lines
        # touched: a send after a long gap is cold), -2 for anything but a plain AFDControlPayload
        self.send_payload = module.ctrl_send_payload
        # SendFront(ring address, check, fallback, owner)(payload) -> None after check(payload) and
        # the native send, else fallback(payload)'s result
        self.send_front = module.SendFront
        # (ring address, hold, period_ns, idle_ns, cpus | None) -> a shm sender's keeper (a capsule; freed: stopped);
        # keeper_passes(keeper) -> passes (-1: not running here: no CPU for it, or a forked child's copy);
        # keeper_stop(keeper) -> passes
        self.keeper_start = module.ctrl_keeper_start
        self.keeper_passes = module.ctrl_keeper_passes
        self.keeper_stop = module.ctrl_keeper_stop
        # (tcp state address, hold, period_ns, idle_ns, warm_tx, warm_rx, cpus | None) -> a tcp sender's proxy (a
        # keeper capsule: keeper_passes / keeper_stop); tcp_proxy_served(proxy) -> frames it sent
        self.tcp_proxy_start = module.ctrl_tcp_proxy_start
        self.tcp_proxy_served = module.ctrl_tcp_proxy_served
        # (data, max_stages, max_ranks) -> the payload built as the takes build it, or None
        self.parse = module.ctrl_parse
        # (tcp state address, payload) -> 0 sent, -2 send it in Python, -3 the proxy stalled, -4 blocked
        # (the send lock or buffer space), -5 the connection failed part-way through the frame
        self.tcp_send_payload = module.ctrl_tcp_send_payload
        # (tcp state address, max_ns) -> whether the end's send lock was taken; tcp_unlock(address)
        self.tcp_lock = module.ctrl_tcp_lock
        self.tcp_unlock = module.ctrl_tcp_unlock
        # (tcp state address, max_ns, max_stages, max_ranks) -> -2 closed, -1 nothing, the built payload,
        # or bytes read (OSError: the poll or read failed)
        self.tcp_take = module.ctrl_tcp_take
        # TcpSendFront / TcpTakeFront: as SendFront / TakeFront on a tcp end (the owner names failures)
        self.tcp_send_front = module.TcpSendFront
        self.tcp_take_front = module.TcpTakeFront
        from afd_ext.metadata import AFDControlPayload, AFDDPMetadata

        module.ctrl_bind_types(AFDControlPayload, AFDDPMetadata, AFDDPMetadata._NONE_WHEN_TRUSTED)
        self.shm_publish = lib.afd_ctrl_shm_publish  # (ring, bytes, n) -> 0 sent, -1 full, -2 closed
        self.shm_publish.restype = ctypes.c_int


def _cgroup_cpu_quota() -> float | None:
    """This process's cgroup (v2) CPU quota in CPUs (``cpu.max``: quota / period), None when unlimited
    or unreadable (cgroup v1, not Linux)."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::")), None)
        if path is None:
            return None
        with open(f"/sys/fs/cgroup{path.rstrip('/')}/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _ns(seconds: float) -> int:
    """Seconds as the native threads' int64 ns (an infinite idle_s: the largest)."""
    return int(min(seconds * 1e9, 2**62))


#: Longest single native wait, in ns (the C side takes an int).
MAX_NATIVE_WAIT_NS = 2**31 - 1


_native_lib: _Native | None | bool = False  # False: not looked up yet


def _native() -> _Native | None:
    """The native control-plane functions, or None (a stale build without them)."""
    global _native_lib
    if _native_lib is False:
        try:
            import torch  # noqa: F401 - loads the libraries the compiled core links against

            from afd_ext import _C

            _native_lib = _Native(ctypes.CDLL(_C.__file__), _C)
        except (ImportError, OSError, AttributeError) as e:
            logger.warning("afd_ext control plane: no native poll in the compiled core (%s); a waiting "
                           "FFN rank blocks after %.0f ms and wakes slower (rebuild afd_ext)",
                           e, _FALLBACK_SPIN_S * 1e3)
            _native_lib = None
    return _native_lib  # type: ignore[return-value]


class ControlChannel(abc.ABC):
    """One direction of one (attention rank, FFN rank) control link.

    One thread sends (or receives) on an end at a time, as the control plane
    calls it; the ends are not locked for that (a tcp sender's frames take the
    end's send lock, in C, so the heartbeat thread's never split one).

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
        # The native view of this end (RingState / TcpState; None without one) and, receiving,
        # the native take's bounds: (max_stages, max_ranks), -1 stages for raw bytes; max bytes.
        self._state: Any = None
        self._limits = (-1, 0)
        self._state_cap = -1
        self._fence_lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

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

    def send_parts(self, parts: tuple[int, tuple]) -> None:
        """Send a control payload given as :func:`afd_ext.metadata.control_payload_parts` output.

        Raises: as :meth:`send`.
        """
        from afd_ext.metadata import encode_control_parts

        self.send(encode_control_parts(*parts))

    def send_payload(self, payload: Any) -> None:
        """Send an :class:`~afd_ext.metadata.AFDControlPayload` (checked; encoded in the binary layout).

        Raises: AFDConfigError for an invalid payload (nothing is sent); else as :meth:`send`.
        """
        from afd_ext.metadata import control_payload_parts

        self.send_parts(control_payload_parts(payload))

    def recv_payload(self, timeout_s: float | None, op: str, max_stages: int, max_ranks: int,
                     max_bytes: int, started: float | None = None) -> Any:
        """Receive the next message as :meth:`recv`; a channel with a native decoder returns an
        encoded control payload of at most ``max_bytes`` already built, as an
        :class:`~afd_ext.metadata.AFDControlPayload` (bounded by ``max_stages`` / ``max_ranks``),
        and anything else as bytes (the caller decodes and bounds them). ``timeout_s`` counts
        from ``started`` (``time.monotonic()``; default: now). Raises as :meth:`recv`."""
        if timeout_s is not None and started is not None:
            timeout_s = max(0.0, timeout_s - (time.monotonic() - started))
        return self.recv(timeout_s, op)

    def _set_limits(self, max_stages: int, max_ranks: int, max_bytes: int) -> None:
        """The native take's bounds for the next receive (max_stages -1: raw bytes wanted)."""
        self._limits = (max_stages, max_ranks)
        cap = min(self.options.max_message_bytes, max_bytes)
        if self._state is not None and cap != self._state_cap:
            self._state.max_msg = self._state_cap = cap

    def take_front(self, max_stages: int, max_ranks: int, prepare: Callable[[], int],
                   fallback: Callable[[Any], Any]) -> Callable[[], Any] | None:
        """Receiver: a per-step receive whose first wait slice is one native call, for a caller to
        bind as its own receive, so that a payload arriving within the slice goes from C straight
        back to that caller's caller (no Python frame to unwind after it arrived).

        ``front()`` calls ``prepare()`` for the slice's length in ns (0: none; the caller's
        :meth:`first_slice_ns`), waits up to that long (GIL released, rehearsing) and returns the
        payload built, bounded by ``max_stages`` / ``max_ranks`` as :meth:`recv_payload`; anything
        else goes to ``fallback(taken)``, whose result it returns: ``taken`` is None (no slice), an
        int (nothing came) or bytes (a message it took, consumed, but could not build: the caller's
        decoder must name the problem). The fallback is the caller's checked path (it waits on,
        checks and names errors). None: no such front (no native core, or a sending end).

        The front (shm: a ``_C.TakeFront``; tcp: a ``_C.TcpTakeFront``, which keeps the bytes of a
        read that is not one payload for the channel's framing and hands the fallback None; one
        native object holding the end, the callbacks and this channel as ``.channel``) takes no arguments: any raises ``TypeError``, nothing taken.
        What ``prepare`` raises propagates, nothing taken; it must return an int (anything else
        raises ``TypeError``, one beyond a C ``long`` ``OverflowError``; a slice is capped at
        :data:`MAX_NATIVE_WAIT_NS`)."""
        return None

    def first_slice_ns(self, timeout_s: float | None, max_stages: int, max_ranks: int, max_bytes: int) -> int:
        """The first slice of a payload's wait (:meth:`take_front`'s ``prepare``): apply the bounds
        (``max_bytes`` included) and return how long to wait in it, in ns from now: at most
        ``timeout_s`` and ``_FIRST_SLICE_S`` (the liveness and abort checks start after it), 0 when
        this end has gone idle (``idle_s`` after the last payload; the checked path then blocks)."""
        self._set_limits(max_stages, max_ranks, max_bytes)  # a raw recv() in between widened them
        left = min(self._poll_until() - time.monotonic(), _FIRST_SLICE_S)
        if timeout_s is not None:
            left = min(left, timeout_s)
        return int(left * 1e9) if left > 0 else 0

    def _poll_until(self) -> float:
        """Receiver: until when (monotonic s) a waiting end keeps polling: ``idle_s`` after the last payload."""
        return self._last_msg + self.options.idle_s

    def send_front(self, check: Callable[[Any], Any] | None,
                   fallback: Callable[[Any], Any]) -> Callable[[Any], Any] | None:
        """Sender: a per-step send for a caller to bind as its own send (one native call).

        ``front(payload)`` calls ``check(payload)`` (unless None; what it raises propagates, nothing
        is sent), then sends a plain :class:`~afd_ext.metadata.AFDControlPayload` natively and
        returns None; whatever the native send declines (ring full, closed, another payload class,
        a value out of range) goes to ``fallback(payload)``, the caller's checked path (which waits
        for space and names errors), and its result is returned. None: no such front.

        The front is a ``_C.SendFront`` (shm) or ``_C.TcpSendFront`` (tcp: a frame the socket takes
        in part is finished natively; a failure there raises ``PeerDeadError``, a stalled proxy
        ``AFDStateError``), one native object holding the end, the callbacks and this channel as
        ``.channel``: one object to touch on the way into C after a long gap. A call with other than
        one positional argument raises ``TypeError``, nothing sent."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release the channel (idempotent). On the sender, tell the receiver (clean shutdown)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def _start_heartbeat(self) -> None:
        """Sender: publish a heartbeat (:meth:`_beat`) every ``heartbeat_interval_s`` from a daemon thread."""
        def run() -> None:
            interval = self.options.heartbeat_interval_s
            while not self._hb_stop.wait(interval):
                if not self._beat():
                    return

        self._hb_thread = threading.Thread(target=run, name=f"afd-ctrl-heartbeat-{self.peer_rank}", daemon=True)
        self._hb_thread.start()

    def _beat(self) -> bool:
        """Publish one heartbeat; False once the channel is gone (ends the heartbeat thread)."""
        raise NotImplementedError

    def _abort_or_timeout(self, op: str, now: float, next_abort: float, deadline: float | None,
                          timeout_s: float | None) -> float:
        """A waiting receiver, between two waits: poll the abort signal when due, give up past ``deadline``.

        Returns:
            When the abort signal is due next (monotonic seconds).

        Raises:
            ControlRecvTimeout: ``now`` is past ``deadline`` (the message names ``timeout_s`` when given).
            StepAbortedError: some rank posted the step-abort signal.
        """
        if self._abort_check is not None and now >= next_abort:
            next_abort = now + _due_in(_ABORT_EVERY_S)
            self._poll_abort(op)
        if deadline is not None and now >= deadline:
            within = "the timeout" if timeout_s is None else f"{timeout_s:g} s"
            raise ControlRecvTimeout(
                f"{op}: no control payload from {self.peer} within {within} (the peer is alive but idle)")
        return next_abort

    def _quiesce_native(self, clear: Callable[[], None]) -> bool:
        """close(): ``clear()`` marks this end closed for the native calls, then wait (up to 5 s) until
        none is in flight on another thread, so that the memory or socket they use can go. Returns
        False when one is still in flight (the caller then leaves the resource alone: a leak, not a
        crash)."""
        clear()
        with self._fence_lock:  # a full fence: the mark before the count's read (InFlight's other half)
            pass
        deadline = time.monotonic() + 5.0
        while self._state.busy:
            if time.monotonic() > deadline:
                logger.warning("control channel to %s: a native call still in flight at close; its "
                               "memory is left in place", self.peer)
                return False
            time.sleep(_MIN_SLEEP_S)
        return True

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
