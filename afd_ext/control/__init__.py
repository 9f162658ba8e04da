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
                      [192] waiting u64 (receiver: blocked on the doorbell)
      slot i (stride 64-byte aligned): seq u64 | total_len u64 | frag_len u32 |
                      sender u32 | crc u32 | pad u32 | payload[slot_bytes]

  Message ``k`` (counted in slots) uses slot ``k % nslots`` as a seqlock: the
  sender waits until ``k - read_count < nslots`` (flow control), stores
  ``seq = 2k+1``, writes the fields and the payload, then stores ``seq =
  2k+2``. The receiver waits for ``seq == 2k+2``, copies the fields and the
  payload, re-reads ``seq`` and checks a CRC-32 (zlib's) over fields and payload; any
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
native code with the GIL released (``csrc/cpu/control_poll.cpp``:
``_C.ctrl_take`` for shm, ``_C.ctrl_tcp_take`` for tcp): the serving engine's
other threads keep running. It polls in slices of at most 75 ms and runs the
liveness checks between slices (due every 25-75 ms, jittered so that they
never line up with a fixed step gap). The FFN plane's
``recv_dp_metadata_list`` is the channel's native front
(:meth:`ControlChannel.take_front`, bound on the plane instance at open): the
first slice for a payload (up to ``_FIRST_SLICE_S``, 0.1 s) is one C call
entered from the caller's own frame, so a payload that arrives within it goes
from C straight back to the caller, with no Python frame to unwind; the
checked path, with the checks, carries on after it.

One native call per step on each end: a step after a 20-50 ms gap runs on cold
caches, so the per-step path touches as little memory as it can. The sender's
``send_dp_metadata_list`` is, with one shm destination, the channel's native
front (:meth:`ControlChannel.send_front`, bound on the plane instance: a
``_C.SendFront`` object, one native callable holding the ring and the
callbacks, runs the connector's check, reads the payload's slots in
place, encodes, publishes and rings the doorbell; tcp: a ``_C.TcpSendFront``,
which encodes one frame and sends it under the end's send lock, in one
``send()``, the proxy's when it runs); anything else takes the checked
Python path, which names a bad value. The receiver's take copies and checks the message (sender rank, length,
CRC) and builds the :class:`~afd_ext.metadata.AFDControlPayload` itself, as
the Python decoder would, before Python sees it (tcp: a read holding exactly
one data frame, after any heartbeat frames; anything else is framed in
Python; heartbeat frames read alone are consumed in C and the wait goes on). While polling, the native wait rehearses that path on the last
payload it took (kept in the end's buffer) every ``warm_s`` (0.5 ms), and the
attention end's send of it on a private scratch ring (the two processes share
the compiled core's code pages), so that both stay in cache (tcp: also a frame
over a private loopback pair, the kernel's receive path being what goes cold);
a shm sender's process runs a keeper thread (``keep_s``, no GIL, another CPU)
that reads its send path's lines while it sends, and a tcp sender runs a send
proxy there (``tcp_proxy``; by default where ``keep_cpus`` is given or the process
may use at least four CPUs: one spinning core while it sends) that sends each
frame from its warm CPU; between those slices it also runs the signal handlers, so
Ctrl-C ends a waiting receive within ``warm_s`` (with ``warm_s = 0``: at the
end of its slice, at most 0.1 s). A tcp
receiver keeps delayed ACKs (``TCP_QUICKACK`` off at every slice of a wait) so that
its read does not send an ACK on the critical path. This
costs one core per FFN rank while serving, which a serving FFN process owns
anyway. Once idle for ``idle_s``, the receiver raises a ``waiting`` flag (shm)
and blocks (a doorbell: an abstract ``AF_UNIX`` datagram socket named after
the segment, which the sender rings after publishing when it sees the flag;
a full fence orders the publish before that read, the receiver's drain
syscall orders its side; tcp: ``poll`` on the socket), so an
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

from afd_ext.rendezvous import StepAbortedError  # noqa: F401 - re-exported: recv raises it

from .channel import (
    CHANNEL_KINDS,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_IDLE_S,
    PROXY_MIN_CPUS,
    ChannelOptions,
    ControlChannel,
    ControlChannelClosed,
    ControlProtocolError,
    ControlRecvTimeout,
    PeerDeadError,
)
from .plane import AFDControlPlane, ChannelControlPlane, open_control_channels
from .shm import ShmControlChannel
from .tcp import TcpControlChannel

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_IDLE_S",
    "PROXY_MIN_CPUS",
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
