"""The NCCL transport: CUDA tensors over the compiled core's ops (``afd_ext.ops``).

Communicators: one per edge and direction, of size 2 (FFN end rank 0,
attention end rank 1), created from unique ids that the FFN end makes and
publishes through the rendezvous store (``uid/<direction>/<a>/<f>``). Every
rank walks the global edge list in one sorted order (by attention rank, then
FFN rank, then ``a2f`` before ``f2a``) and creates the communicators it is
part of, so the blocking ``ncclCommInitRank`` calls cannot wait on each other
in a cycle. Size-2 communicators also let several attention processes share a
GPU (NCCL refuses two ranks of one communicator on one device).

Every data call is one NCCL group over all peers (``ops.split_back`` /
``ops.fan_in``), issued on the *current* CUDA stream. The connector makes its
per-stage stream current around each call, so the ordering rules of
:mod:`afd_ext.schedule` hold and the calls are capturable in a CUDA graph.

No hang: after each group an event is recorded on the stream and handed to the
:class:`~afd_ext.watchdog.Watchdog` with a description (op, peers, layer,
stage); on expiry or an asynchronous communicator error the watchdog aborts
every communicator of this transport and the next call raises the named error.

Strict mode: before each data group, one group carries the header blocks
(:mod:`afd_ext.transport.base`); the receiver waits for them on the host (a
bounded wait) and checks them before it issues the data receive. Strict mode
therefore synchronises per message and is skipped while a stream is being
captured (headers cannot be read inside a graph).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from ..watchdog import Watchdog, host_wait
from .base import (
    HEADER_WORDS,
    AFDTransportError,
    MessageTag,
    PeerMap,
    PendingSend,
    Transport,
    check_headers,
    encode_headers,
    message_tensors,
)

logger = logging.getLogger(__name__)

__all__ = ["NcclTransport", "DIRECTIONS"]

DIRECTIONS = ("a2f", "f2a")


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class NcclTransport(Transport):
    """Moves row ranges of CUDA tensors over per-(edge, direction) NCCL communicators.

    Args:
        store: the generation's :class:`~afd_ext.rendezvous.AFDStore` (unique-id exchange).
        topology: the :class:`~afd_ext.topology.Topology`.
        peers: this rank's :class:`~afd_ext.transport.base.PeerMap`.
        device: this rank's CUDA device.
        strict: strict-mode headers (forces a host wait per message).
        timeout_s: deadline of an in-flight operation, seconds.
        init_timeout_s: deadline of the unique-id exchange, seconds.
        abort_check: callable returning the posted abort text or None (polled by the watchdog).
        on_failure: extra callback run by the watchdog on failure (after the
            communicators were aborted), e.g. posting the rendezvous abort signal.
        abort_error: callable ``text -> exception`` for a posted abort.

    Raises:
        RendezvousTimeoutError: a peer did not publish its unique id in time.
        RuntimeError: NCCL failed to create a communicator (CPU-only build, version mismatch...).
    """

    kind = "nccl"

    def __init__(self, store: Any, topology: Any, peers: PeerMap, device: torch.device, *, strict: bool,
                 timeout_s: float, init_timeout_s: float,
                 abort_check: Callable[[], str | None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 abort_error: Callable[[str], BaseException] | None = None):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the NCCL transport needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(peers, device, strict=strict, timeout_s=timeout_s)
        from .. import ops
        from .. import rendezvous as rdzv

        self._ops = ops
        self._comms: dict[tuple[int, int, str], int] = {}  # (a, f, direction) -> handle
        self._event_pool: list[torch.cuda.Event] = []  # list append/pop are atomic in CPython
        self._aborted = False
        self._extra_on_failure = on_failure
        self.watchdog = Watchdog(
            timeout_s, owner=peers.me, on_failure=self._on_watchdog_failure,
            comms=lambda: [(h, f"{d} a{a}-f{f}") for (a, f, d), h in list(self._comms.items())],
            async_error=ops.comm_async_error, abort_check=abort_check, abort_error=abort_error,
        )
        me_role, me = peers.role, peers.role_rank
        try:
            for a, f in topology.edges():
                if not ((me_role == "attention" and a == me) or (me_role == "ffn" and f == me)):
                    continue
                for d in DIRECTIONS:
                    uid = rdzv.exchange_unique_id(
                        store, f"{d}/{a}/{f}", me_role == "ffn",
                        lambda: ops.nccl_unique_id().numpy().tobytes(),
                        init_timeout_s, creator_rank=f,
                    )
                    uid_t = torch.frombuffer(bytearray(uid), dtype=torch.uint8)
                    rank_in_comm = 0 if me_role == "ffn" else 1
                    self._comms[(a, f, d)] = ops.comm_create(uid_t, 2, rank_in_comm, device.index)
        except BaseException:
            self._abort_comms()
            raise
        self.watchdog.start()

    # -- helpers -------------------------------------------------------------------

    def _comm(self, peer: int, direction: str) -> int:
        if self.peers.role == "attention":
            a, f = self.peers.role_rank, peer
        else:
            a, f = peer, self.peers.role_rank
        try:
            return self._comms[(a, f, direction)]
        except KeyError:
            raise ValueError(f"attention rank {a} and FFN rank {f} are not peers (no communicator)") from None

    def _peer_index(self) -> int:
        return 1 if self.peers.role == "ffn" else 0

    def check_health(self, tag: MessageTag | None = None) -> None:
        self.watchdog.check()
        self._check_open(tag)

    def _track(self, what: str, names: Sequence[str], tag: MessageTag) -> None:
        if _capturing():
            return
        # Events are reused: the watchdog hands an event back once it saw it complete.
        try:
            ev = self._event_pool.pop()
        except IndexError:
            ev = torch.cuda.Event()
        ev.record()
        self.watchdog.track(ev.query, f"{tag.op}: {what}", peers=names, layer=tag.layer, stage=tag.stage,
                            where=tag.where(), on_done=lambda: self._event_pool.append(ev))

    def wait_event(self, ev: torch.cuda.Event, what: str, names: Sequence[str], tag: MessageTag) -> None:
        """Host wait for ``ev`` with the deadline; raises the watchdog's failure or a named timeout."""
        def done(slice_s: float) -> bool:
            end = time.monotonic() + slice_s
            while True:
                if ev.query():
                    return True
                self.watchdog.check()
                if time.monotonic() >= end:
                    return False
                time.sleep(min(0.0005, slice_s))

        peer = ", ".join(names)
        host_wait(done, timeout_s=self.timeout_s,
                  describe=lambda: f"{tag.op}: {what} with {peer} at {tag.where()} on {self.peers.me}",
                  abort_check=self.watchdog.check, op=tag.op, peer=peer, layer=tag.layer, stage=tag.stage)

    # -- data --------------------------------------------------------------------

    def split_back(self, tensors, peers, rows, *, tag: MessageTag) -> PendingSend:
        self.check_health(tag)
        msgs = message_tensors(tensors)
        live = [(p, r) for p, r in zip(peers, rows) if r > 0]
        if not live:
            return PendingSend()
        names = [self.peers.peer_label(p) for p, _ in live]
        comms = [self._comm(p, tag.direction) for p in peers]
        ranks = [self._peer_index()] * len(peers)
        keep: list[torch.Tensor] = []
        if self.strict and not _capturing():
            blocks = [encode_headers(tag, self.peers.world_rank, self.peers.peer_world_rank(p), r, msgs)
                      for p, r in live]
            hdr = torch.cat(blocks).to(self.device)
            keep.append(hdr)
            hcomms = [self._comm(p, tag.direction) for p, _ in live]
            self._ops.split_back(hdr, None, None, hcomms, [self._peer_index()] * len(live), [len(msgs)] * len(live))
        full = list(tensors) + [None] * (3 - len(tensors))
        self._ops.split_back(full[0], full[1], full[2], comms, ranks, list(rows))
        self._track("send (split-back)", names, tag)
        return PendingSend(None, keep)

    def fan_in(self, tensors, peers, rows, *, tag: MessageTag) -> None:
        self.check_health(tag)
        msgs = message_tensors(tensors)
        live = [(p, r) for p, r in zip(peers, rows) if r > 0]
        if not live:
            return
        names = [self.peers.peer_label(p) for p, _ in live]
        if self.strict and not _capturing():
            hcomms = [self._comm(p, tag.direction) for p, _ in live]
            hdr = torch.empty(len(live) * len(msgs), HEADER_WORDS, dtype=torch.int64, device=self.device)
            self._ops.fan_in(hdr, None, None, hcomms, [self._peer_index()] * len(live), [len(msgs)] * len(live))
            ev = torch.cuda.Event()
            ev.record()
            self.wait_event(ev, "header receive", names, tag)
            got = hdr.cpu()
            for i, (p, r) in enumerate(live):
                src = self.peers.peer_world_rank(p)
                want = encode_headers(tag, src, self.peers.world_rank, r, msgs)
                check_headers(got[i * len(msgs):(i + 1) * len(msgs)], want, tag=tag,
                              receiver_label=self.peers.me, sender_label=self.peers.label(src),
                              label=self.peers.label)
        comms = [self._comm(p, tag.direction) for p in peers]
        full = list(tensors) + [None] * (3 - len(tensors))
        self._ops.fan_in(full[0], full[1], full[2], comms, [self._peer_index()] * len(peers), list(rows))
        self._track("receive (fan-in)", names, tag)

    # -- lifecycle ------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until this rank's in-flight NCCL work completed (the connector's store barrier follows)."""
        self.check_health()
        ev = torch.cuda.Event()
        ev.record()
        self.wait_event(ev, "drain", ["every peer"], MessageTag("barrier", "a2f", -1, -1, -1))

    def _abort_comms(self) -> None:
        comms, self._comms = dict(self._comms), {}
        for h in comms.values():
            try:
                self._ops.comm_abort(h)
            except Exception as e:  # noqa: BLE001 - best effort, keep aborting the others
                logger.warning("aborting NCCL communicator %d: %s", h, e)

    def _on_watchdog_failure(self, exc: BaseException) -> None:
        self._aborted = True
        if self._closed is None:
            self._closed = exc
        self._abort_comms()
        if self._extra_on_failure is not None:
            self._extra_on_failure(exc)

    def abort(self, reason: str) -> None:
        self._aborted = True
        if self._closed is None:
            self._closed = AFDTransportError(f"aborted: {reason}")
        self.watchdog.stop()
        self._abort_comms()

    def close(self) -> None:
        if self._closed is None:
            self._closed = AFDTransportError("closed")
        stuck = bool(self.watchdog.in_flight) or self.watchdog.failure is not None or self._aborted
        self.watchdog.stop()
        if stuck:
            self._abort_comms()
            return
        comms, self._comms = dict(self._comms), {}
        for h in comms.values():
            try:
                self._ops.comm_destroy(h)
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("destroying NCCL communicator %d: %s", h, e)
