"""Control channels: options, the channel contract, the receive loop and its liveness policy.

The design is described in :mod:`afd_ext.control` (package doc).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from afd_ext import rendezvous as rdzv
from afd_ext.health.process import start_time
from afd_ext.errors import (  # noqa: F401 - ControlChannelClosed, ControlProtocolError: re-exported by the package
    AFDConfigError,
    AFDClosedError,
    AFDStateError,
    ControlChannelClosed,
    ControlProtocolError,
    ControlRecvTimeout,
    PeerDeadError,
)
from .codec import DEFAULT_MAX_RANKS, DEFAULT_MAX_STAGES, _native, _payload_of, encode_control_binary

logger = logging.getLogger("afd_ext.control_plane")  # the name users configure (docs/troubleshooting.md)

#: How often a sender publishes its heartbeat, in seconds.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
#: Heartbeat age after which the receiver declares the sender dead, in seconds.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
#: How long after the last payload a waiting receiver keeps spinning before it sleeps, in seconds.
DEFAULT_IDLE_S = 10.0
#: Payload bytes per shared-memory slot; larger messages span several slots.
DEFAULT_SLOT_BYTES = 16384
#: Slots per shared-memory ring.
DEFAULT_NSLOTS = 8
#: Largest message a channel accepts, in bytes (bounded before allocation).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
#: Channel kinds accepted by :func:`open_control_channels`.
CHANNEL_KINDS = ("auto", "shm", "tcp")

# A waiting receiver runs its liveness and abort checks between native wait slices of this
# length times 1-2 (jittered: a fixed period would line up with a fixed step gap).
_SLICE_S = 0.1
_STORE_LOSS_GRACE_S = 1.0
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
            spinning (native code, GIL released, one core) before it sleeps
            (a futex or ``poll``, ~100 us slower to wake); 0 always sleeps.
            Default 10 s (``AFD_CONTROL_IDLE_S``).
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
        for name, low in (("slot_bytes", 64), ("nslots", 2), ("max_message_bytes", 1)):
            v = getattr(self, name)
            if not (type(v) is int and v >= low):
                raise AFDConfigError(f"{name} must be an int >= {low}, got {v!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "ChannelOptions":
        """Defaults, ``AFD_CONTROL_IDLE_S`` from the environment, then ``overrides`` (None ignored).

        The variables in ``afd_ext.envs.REMOVED_CONTROL`` are ignored with a ``DeprecationWarning``.
        """
        from afd_ext import envs

        for name in envs.REMOVED_CONTROL:
            if os.environ.get(name):
                warnings.warn(f"{name} is deprecated and ignored: the control plane's cache keepers it tuned "
                              "were removed (docs/configuration.md)", DeprecationWarning, stacklevel=2)
        kw: dict[str, Any] = {"idle_s": envs.get("AFD_CONTROL_IDLE_S")}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


class ControlChannel:
    """One direction of one (attention rank, FFN rank) control link.

    One thread sends (or receives) on an end at a time, as the control plane
    calls it; a sender's heartbeat thread shares the end (a tcp sender's frames
    take the end's send lock); :meth:`close` may come from any thread, and ends
    the calls in flight with :class:`AFDClosedError`. Subclasses: :class:`~afd_ext.control.shm.ShmControlChannel`,
    :class:`~afd_ext.control.tcp.TcpControlChannel`.

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
        self._max_bytes = options.max_message_bytes  # read per message: one attribute, not two
        self._idle_s = options.idle_s
        self._abort_check = abort_check
        self._closed = False
        self._closing = threading.Lock()  # held for good by the one close() that runs: an atomic check-and-set
        # One entry per call using this end's memory or socket (list ops are atomic); after close() the
        # last one out releases them, so no call ever meets a released buffer.
        self._users: list[str] = []
        self._store_lost_at: float | None = None
        self._last_msg = time.monotonic()  # receiver: it spins until idle_s after the last payload
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._C = _native()

    # -- the contract ------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Send one message (sender end only).

        Args:
            data: the message bytes (e.g. an encoded control payload), at most
                ``options.max_message_bytes``.

        Raises:
            AFDConfigError: message too large; AFDStateError: wrong end; AFDClosedError: this end is
            closed (also by another thread meanwhile); PeerDeadError: the receiver is gone;
            ControlChannelClosed: the receiver closed its end.
        """
        self._enter(True, _OP_SEND)
        try:
            if len(data) > self._max_bytes:
                raise AFDConfigError(f"control message of {len(data)} bytes exceeds max_message_bytes="
                                     f"{self._max_bytes}; raise it on both ends")
            self._send(data)
        finally:
            self._leave()

    def send_payload(self, payload: Any) -> None:
        """Send an :class:`~afd_ext.metadata.AFDControlPayload` in the binary layout (the per-step case
        encoded natively, straight into the slot or frame, by the kind's :meth:`_send_fast`).

        Raises: AFDConfigError for an invalid payload (nothing is sent); else as :meth:`send`.
        """
        self._enter(True, _OP_SEND)
        try:
            if not self._send_fast(payload):
                self.send(encode_control_binary(payload))  # a payload to convert, fragments, a full ring
        finally:
            self._leave()

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV, max_payload: int = 0) -> Any:
        """Receive the next message (receiver end only), in send order.

        Waits in native code with the GIL released, in slices of 0.1-0.2 s; between slices it
        checks the peer (closed, dead, heartbeat) and the store's step-abort signal. With
        ``max_payload`` the message is a control payload, decoded natively as it is taken.

        Args:
            timeout_s: give up after this many seconds while the peer is alive;
                None waits as long as the peer's heartbeat is fresh.
            op: the operation named in errors.
            max_payload: 0: return the bytes; else the largest control payload accepted, in
                bytes, and return it decoded.

        Returns:
            The message bytes, or a new :class:`~afd_ext.metadata.AFDControlPayload`.

        Raises:
            PeerDeadError: the sender died (process gone, connection reset, heartbeat older
                than ``heartbeat_timeout_s``).
            ControlChannelClosed: the sender closed the channel.
            ControlRecvTimeout: ``timeout_s`` passed.
            StepAbortedError: some rank posted the step-abort signal.
            ControlProtocolError: a frame from an unexpected sender, a corrupt frame or slot; a
                malformed payload, or one larger than ``max_payload``.
            AFDClosedError: this end is closed (also by another thread while it waits).
        """
        self._enter(False, op)
        try:
            now = time.monotonic()
            deadline = None if timeout_s is None else now + timeout_s
            while True:
                end = now + _SLICE_S * (1 + _jitter.random())
                if deadline is not None:
                    end = min(end, deadline)
                msg = self._take(op, int((self._last_msg + self._idle_s) * 1e9), int(end * 1e9), max_payload)
                if msg is not None:
                    self._last_msg = now  # the slice's start: no clock read once the payload is in
                    return _payload_of(msg) if max_payload else msg
                self._require(False, op)
                self._check_peer(op)
                if self._abort_check is not None:
                    self._poll_abort(op)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    within = "the timeout" if timeout_s is None else f"{timeout_s:g} s"
                    raise ControlRecvTimeout(
                        f"{op}: no control payload from {self.peer} within {within} (the peer is alive but idle)")
        finally:
            self._leave()

    def close(self) -> None:
        """Close this end (idempotent, from any thread) and tell the peer (a clean shutdown). Calls in
        flight on other threads end with :class:`AFDClosedError`; the last of them releases the memory
        or socket. A second close(), on any thread, returns at once."""
        if not self._closing.acquire(blocking=False):
            return
        self._users.append("close")  # _shutdown uses the memory / socket too
        self._closed = True
        try:
            self._hb_stop.set()
            self._shutdown()  # first: it ends a heartbeat frame blocked on a full socket
            if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
                self._hb_thread.join(timeout=5)
        finally:
            self._leave()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- what a kind provides ------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        raise NotImplementedError

    def _send_fast(self, payload: Any) -> bool:
        """Send a payload in one native call if the kind can as it is; False: nothing sent."""
        return False

    def _take(self, op: str, spin_until_ns: int, end_ns: int, limit: int) -> Any:
        """One wait slice: the next whole message (its bytes; with ``limit``, its decoded fields,
        :meth:`_decoded`), or None (nothing before ``end_ns``, or stopped)."""
        raise NotImplementedError

    def _check_peer(self, op: str) -> None:
        """Between slices: raise if the sender closed, died or went silent."""
        raise NotImplementedError

    def _beat(self) -> bool:
        """Publish one heartbeat; False once the channel is gone (ends the heartbeat thread)."""
        raise NotImplementedError

    def _shutdown(self) -> None:
        """close(): tell the peer (sender) and end this end's waits."""

    def _release(self) -> None:
        """close(), once no call uses them: free the memory / socket (idempotent)."""

    # -- shared helpers -----------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        """Sender: publish a heartbeat (:meth:`_beat`) every ``heartbeat_interval_s`` from a daemon thread."""
        def run() -> None:
            while not self._hb_stop.wait(self.options.heartbeat_interval_s):
                if not self._beat():
                    return

        self._hb_thread = threading.Thread(target=run, name=f"afd-ctrl-heartbeat-{self.peer_rank}", daemon=True)
        self._hb_thread.start()

    def _silent(self, op: str, last_s: float) -> None:
        """Raise PeerDeadError when the sender's last sign of life (monotonic s) is too old."""
        age = time.monotonic() - last_s
        if age > self.options.heartbeat_timeout_s:
            raise PeerDeadError(self.peer, op, f"no heartbeat for {age:.1f} s "
                                f"(heartbeat_timeout_s={self.options.heartbeat_timeout_s:g})")

    def _poll_abort(self, op: str) -> None:
        """Look at the store's abort signal; tolerate a lost store for a short grace.

        At a clean shutdown FFN rank 0 (the store's host) may exit a moment
        before this channel's sender closes; the grace lets the close (or the
        sender's death) be reported instead of the lost store.
        """
        try:
            self._abort_check(op)  # type: ignore[misc]
        except rdzv.StoreUnavailableError:
            now = time.monotonic()
            if self._store_lost_at is None:
                self._store_lost_at = now
                logger.warning("%s: rendezvous store lost while waiting on the control channel of %s", op, self.peer)
            if now - self._store_lost_at > _STORE_LOSS_GRACE_S:
                raise

    def _check_header(self, op: str, sender: int, total: int) -> None:
        """A received message's header: from the expected world rank, within ``max_message_bytes``."""
        if sender != self.peer_rank:
            raise ControlProtocolError(f"{op}: received AFD DP metadata from world rank {sender}, expected {self.peer}")
        if total > self._max_bytes:
            raise ControlProtocolError(
                f"{op}: {self.peer} announced a {total}-byte control message, above "
                f"max_message_bytes={self._max_bytes}")

    def _decoded(self, op: str, body: Any, n: int, limit: int) -> Any:
        """A whole message as :meth:`_take` returns it: ``body`` (``n`` bytes), or with ``limit`` its
        payload's fields, which a native take may have decoded already (a str: what is malformed)."""
        if not limit:
            return body
        if n > limit:
            raise ControlProtocolError(f"{op}: a {n}-byte control payload from {self.peer} "
                                       f"exceeds max_payload_bytes={limit}")
        if type(body) is bytes:
            body = self._C.ctrl_decode(body, DEFAULT_MAX_STAGES, DEFAULT_MAX_RANKS)
        if type(body) is str:
            raise ControlProtocolError(f"{op}: malformed control payload from {self.peer}: {body}")
        return body

    def _enter(self, sender: bool, op: str) -> None:
        """A call starts using this end (registered before the look at ``_closed``: a close() after it
        leaves the release to :meth:`_leave`); raises as :meth:`_require`."""
        self._users.append(op)
        if self._closed or self.is_sender != sender:
            self._leave()
            self._require(sender, op)

    def _leave(self) -> None:
        self._users.pop()
        if self._closed and not self._users:
            self._release()

    def _require(self, sender: bool, what: str) -> None:
        if self._closed:
            # a local close is a stop, named as the data calls name it (AFDClosedError), not misuse
            raise AFDClosedError(f"{what} on a closed {self.kind} control channel to {self.peer}")
        if self.is_sender != sender:
            end = "sending (attention)" if self.is_sender else "receiving (FFN)"
            raise AFDStateError(f"{what} called on the {end} end of the control channel to {self.peer}")
