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

* ``shm`` (both ends on one host): a single-producer/single-consumer ring in a
  POSIX shared-memory segment (``/dev/shm``). Layout, little-endian::

      header (256 B): magic u64 | version u32 | nslots u32 | slot_bytes u64 |
                      sender pid u64 | sender start time u64 | receiver pid u64 |
                      receiver start time u64 | ... ;
                      [64]  read_count u64   (receiver: slots consumed) |
                            receiver_state u64 (0 open, 2 closed)
                      [128] heartbeat_ns u64 (sender: CLOCK_MONOTONIC) |
                            sender_state u64 (0 new, 1 attached, 2 closed) |
                            write_count u64 (sender: slots published)
                      [192] the native side's: waiting u32 | doorbell u32 | stop u32
      slot i (stride 64-byte aligned): seq u64 | total_len u64 | frag_len u32 |
                      sender u32 | crc u32 | pad u32 | payload[slot_bytes]

  Message ``k`` (counted in slots) uses slot ``k % nslots`` as a seqlock, in
  native code (``csrc/cpu/control_poll.cpp``, which reads the geometry from the
  header and keeps both counts there): the sender puts only while
  ``write_count - read_count < nslots`` (flow control), stores ``seq = 2k+1``, writes the
  fields and the payload and a CRC-32 over them, then stores ``seq = 2k+2``
  (release). The receiver waits for ``seq == 2k+2`` (acquire), copies, re-reads
  ``seq`` and checks the CRC: a torn read is retried, and a published slot that
  stays inconsistent for a second is a corrupt ring (:class:`ControlProtocolError`).
  Messages larger than one slot are split over consecutive slots; the receiver
  checks every fragment's total, sender and length (the fragment check) and
  bounds the total by ``max_message_bytes``. The FFN end creates the segment
  under a fresh random name tied to the store's generation, the sender
  attaches, and as soon as both are attached the name is unlinked: nothing is
  left in ``/dev/shm`` even if a process is killed later, and a stale segment
  is never reused.

* ``tcp`` (across hosts): the FFN end listens on the address through which it
  reaches the rendezvous host (never a hard-coded loopback; override with
  ``AFD_CONTROL_ADDR``), publishes ``addr:port`` through the store; the
  sender connects (``TCP_NODELAY``) and introduces itself. Frames are
  ``magic u32 | type u32 | sender world rank u32 | length u64 | bytes``, built
  and split in native code (``_C.ctrl_tcp_send`` / ``_C.ctrl_tcp_take``).

How a receiver waits: spinning while serving, asleep when idle
-------------------------------------------------------------
Waking a blocked thread costs ~110 us on a server host (scheduler and
C-state exit), more than the whole rest of a step's control plane. So while
the engine is active (the last payload arrived less than ``idle_s`` ago,
default 10 s, ``AFD_CONTROL_IDLE_S``) a waiting FFN rank spins, in native code
with the GIL released (``_C.ctrl_shm_take`` on the slot's sequence word;
``_C.ctrl_tcp_take``, a non-blocking ``recv`` and the frame split in C): the serving engine's other
threads keep running. Once idle it sleeps: shm raises a waiting flag and
sleeps on a futex in the segment (the doorbell, which the sender rings after
publishing when it sees the flag, a full fence between the two), tcp sleeps
in ``poll``; an idle FFN rank burns no CPU. ``idle_s = 0`` always sleeps (few
cores, many ranks: CI).

One native call per step on each end: the attention rank's
``send_dp_metadata_list`` calls ``_C.ctrl_shm_put`` (or ``ctrl_tcp_send``) per
destination, which encodes the payload straight into the ring slot (or the
frame) and publishes it; the FFN rank's wait, ``_C.ctrl_shm_take`` (or
``ctrl_tcp_take``), returns the payload already decoded, as tuples and ints that
a few lines of Python (``codec._payload_of``) wrap into the payload objects.
The codec exists once, in C++ (``csrc/control_bindings.cpp`` reads and builds the
Python objects, ``csrc/cpu/control_poll.cpp`` checks the untrusted bytes,
bounding every length before it reads); :func:`~afd_ext.control.codec.encode_control_binary`
and :func:`~afd_ext.control.codec.decode_control_binary` call it. A payload the
native encoder does not take as it is (another class, values to convert) is
converted in Python first, and a message over several slots is joined, then
decoded, in Python. It waits in slices of 0.1-0.2 s (jittered, so that they never line up with a
fixed step gap) and runs the liveness and abort checks between slices; a
signal (Ctrl-C) that interrupts a sleep ends the wait at once, one that comes
while it spins at the end of the slice.

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
FFN serving loop can end; a receiver that closes its end cleanly makes the
sender's next send raise it, naming the FFN rank. Nothing published before a
close or an exit is lost (the ordering rule: docs/internals.md, "How a channel ends").

The payload travels in the compact binary layout of
:func:`~afd_ext.control.codec.encode_control_binary` (both ends are ``afd_ext``);
the JSON codec stays the reference-format API. A malformed payload, a corrupt
ring or a frame from the wrong rank posts the step-abort signal before it
raises :class:`ControlProtocolError`, so the attention ranks stop at once.

Measured cost: ``afd-ext bench --control-only`` (:mod:`afd_ext.tools.bench.control`)
measures attention ``send_dp_metadata_list`` call start -> FFN
``recv_dp_metadata_list`` return at step gaps of 1-50 ms; see
docs/benchmarks.md.
"""
from __future__ import annotations

from afd_ext.rendezvous import StepAbortedError  # noqa: F401 - re-exported: recv raises it

from .channel import (
    CHANNEL_KINDS, DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_IDLE_S, ChannelOptions,
    ControlChannel, ControlChannelClosed, ControlProtocolError, ControlRecvTimeout, PeerDeadError
)
from .plane import AFDControlPlane, open_control_channels
from .shm import ShmControlChannel
from .tcp import TcpControlChannel

__all__ = ["DEFAULT_HEARTBEAT_INTERVAL_S", "DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_IDLE_S", "CHANNEL_KINDS",
           "PeerDeadError", "StepAbortedError", "ControlChannelClosed", "ControlRecvTimeout", "ControlProtocolError",
           "ChannelOptions", "ControlChannel", "ShmControlChannel", "TcpControlChannel", "open_control_channels",
           "AFDControlPlane"]
