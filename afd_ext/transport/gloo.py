"""The gloo transport: CPU tensors over ``torch.distributed`` (what CI runs the protocol on).

One ``ProcessGroupGloo`` over the whole AFD world (FFN ranks first), built on
the rendezvous store of this generation (no second port). Messages of one
direction use one gloo tag (``a2f`` 1, ``f2a`` 2), so, like the NCCL
transport's one communicator per edge and direction, the messages of one
(edge, direction) are matched in issue order and the two directions never
interfere.

Sends are asynchronous (``isend``); the returned
:class:`~afd_ext.transport.base.PendingSend` keeps the sent memory alive and
is waited on by the connector once the exchange is known to be complete.
Receives block until the data is in the caller's tensors.

Bounded waits: a gloo wait that times out closes the pair it waits on, so
waits cannot be sliced with short gloo timeouts. Instead a daemon waiter
thread calls ``work.wait(deadline)`` while the calling thread polls its
completion in short slices and checks the rendezvous abort signal between
slices (:func:`afd_ext.watchdog.host_wait`). A gloo wait cannot be
interrupted, so :meth:`GlooTransport.close` joins the waiter (bounded by the
deadline): after an abort the peers tear down their pairs, which ends the
wait at once; a process that exited with a wait still blocked would abort in
gloo's destructors. A peer that dies surfaces at
once (gloo reports the closed connection) as an
:class:`~afd_ext.transport.base.AFDPeerError` naming the peer, the layer and
the stage; a peer that is alive but silent becomes an
:class:`~afd_ext.transport.base.AFDTimeoutError` at the deadline.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
from typing import Any, Callable, Sequence

import torch

from ..watchdog import CallThread, host_wait
from .base import (
    AFDPeerError,
    AFDTimeoutError,
    AFDTransportError,
    MessageTag,
    PeerMap,
    PendingSend,
    Transport,
    TransportSetup,
    row_offsets,
)
from ..errors import AFDConfigError
from .signal import AbortSignal
from ..rendezvous import error_text

logger = logging.getLogger(__name__)

__all__ = ["GlooTransport"]

_TAGS = {"a2f": 1, "f2a": 2}
# A waiter-thread wait gets this much longer than the caller's deadline, so the
# caller always reports the (named) timeout first.
_WAIT_MARGIN_S = 1.0


def _completed_ok(work: Any) -> bool:
    """Whether a gloo work finished successfully (False while pending or after an error)."""
    try:
        return bool(work.is_completed()) and bool(work.is_success())
    except Exception:  # noqa: BLE001 - treat an unanswerable work as not done
        return False


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor (gloo then needs no dtype support, e.g. for fp8)."""
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


class GlooTransport(Transport):
    """Moves row ranges of CPU tensors between attention and FFN ranks over gloo.

    Args:
        store: a ``torch.distributed.Store`` shared by the AFD world (the
            generation's prefix store from :func:`afd_ext.rendezvous.connect`).
        peers: the :class:`~afd_ext.transport.base.PeerMap` of this rank.
        timeout_s: deadline of every wait inside a step, seconds (> 0).
        init_timeout_s: deadline for building the process group, seconds.
        abort: the generation's :class:`~afd_ext.transport.signal.AbortSignal`
            (checked between wait slices and by :meth:`check_health`), or None.

    Raises:
        RuntimeError: the process group could not be built (a rank did not join in time).
    """

    kind = "gloo"
    device_type = "cpu"

    def __init__(self, store: Any, peers: PeerMap, *, timeout_s: float, init_timeout_s: float,
                 abort: AbortSignal | None = None):
        super().__init__(peers, torch.device("cpu"), timeout_s=timeout_s)
        import torch.distributed as dist

        self._abort_check: Callable[[str], None] | None = None if abort is None else abort.check
        world = peers.num_attention_ranks + peers.num_ffn_ranks
        # The constructor connects the full mesh (collective), bounded by the store timeout.
        try:
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo/", store), peers.world_rank, world,
                datetime.timedelta(seconds=max(init_timeout_s, timeout_s)),
            )
        except RuntimeError as e:  # raw DistStoreError / DistNetworkError: name the ranks
            from ..rendezvous import process_group_error

            raise process_group_error(e, me=peers.me, label=peers.label, world_size=world,
                                      timeout_s=max(init_timeout_s, timeout_s)) from None
        self._waiter = CallThread(f"afd-gloo-wait {peers.me}")

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> "GlooTransport":
        if setup.device.type != "cpu":
            raise AFDConfigError(f"the gloo transport moves CPU tensors; device must be cpu, got {setup.device}")
        return cls(setup.store.store, setup.peers, timeout_s=setup.timeout_s,
                   init_timeout_s=setup.init_timeout_s, abort=setup.abort)

    def check_health(self, tag: MessageTag | None = None) -> None:
        """Raise if closed, or if another rank posted the abort signal (one store round trip)."""
        self._check_open(tag)
        if self._abort_check is not None:
            self._abort_check(tag.op if tag is not None else "")

    # -- waits -------------------------------------------------------------------

    def _wait(self, works: Sequence[Any], tag: MessageTag, what: str, peer: str,
              by_peer: Sequence[tuple[str, Sequence[Any]]] = ()) -> None:
        """Wait for gloo works with the deadline, the abort signal and named errors.

        ``by_peer`` (``[(peer label, its works)]``) lets a failure name the
        peer(s) whose messages did not complete ("waiting on attention rank 1
        (world rank 2)") instead of every peer of the exchange.
        """
        if not works:
            return
        waiter = self._waiter
        if waiter is None:
            self._check_open(tag)
        timeout = datetime.timedelta(seconds=self.timeout_s + _WAIT_MARGIN_S)

        def wait_all() -> None:
            for w in works:
                w.wait(timeout)

        fut = waiter.submit(wait_all)

        def done(slice_s: float) -> bool:
            try:
                fut.result(timeout=slice_s)
                return True
            except cf.TimeoutError:
                return False

        describe = lambda: f"{tag.op}: {what} with {peer} at {tag.where()} on {self.peers.me}"  # noqa: E731
        abort = None
        if self._abort_check is not None:
            abort = lambda: self._abort_check(f"{tag.op} ({what} with {peer} at {tag.where()})")  # noqa: E731
        def culprits() -> tuple[str, str]:
            """(text naming the peers whose works did not complete, their labels)."""
            stuck = [label for label, ws in by_peer if not all(_completed_ok(w) for w in ws)]
            if not stuck or len(by_peer) < 2:
                return "", peer
            done_ = [label for label, _ in by_peer if label not in stuck]
            text = "; ".join(f"waiting on {label}: its message of this exchange did not arrive" for label in stuck)
            if done_:
                text += f" ({', '.join(done_)}: complete)"
            return text + ".", ", ".join(stuck)

        try:
            host_wait(done, timeout_s=self.timeout_s, describe=describe, abort_check=abort,
                      op=tag.op, peer=peer, layer=tag.layer, stage=tag.stage)
        except AFDTimeoutError as e:
            text, who = culprits()
            if text:
                e = AFDTimeoutError(f"{e} {text}", op=tag.op, peer=who, layer=tag.layer, stage=tag.stage)
            self._closed = e
            raise e from None
        except AFDTransportError:
            raise
        except RuntimeError as e:
            text = error_text(e)  # no C++ frames, [file:line] tags or gloo banners in a peer error
            self._closed = e
            if self._abort_check is not None:
                # A rank that aborts the step also tears down its gloo pairs; report
                # the abort (the root cause), not the closed connection.
                self._abort_check(f"{tag.op} ({what} with {peer} at {tag.where()})")
            blame, who = culprits()
            blame = f" {blame}" if blame else ""
            if "Connection closed by peer" in text or "Connection reset" in text or "closed" in text.lower():
                raise AFDPeerError(
                    f"AFD {describe()} failed: the peer went away ({text}).{blame} It probably "
                    "crashed or was killed; check its log. Close and re-initialise the connector.",
                    op=tag.op, peer=who, layer=tag.layer, stage=tag.stage,
                ) from None
            raise AFDPeerError(
                f"AFD {describe()} failed: {text}.{blame}",
                op=tag.op, peer=who, layer=tag.layer, stage=tag.stage,
            ) from None

    # -- data --------------------------------------------------------------------

    def split_back(self, tensors, peers, rows, *, tag: MessageTag) -> PendingSend:
        self._check_open(tag)
        msgs = [t for t in tensors if t is not None]
        gtag = _TAGS[tag.direction]
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        names: list[str] = []
        by_peer: list[tuple[str, list[Any]]] = []
        try:
            for peer, off, r in zip(peers, row_offsets(rows), rows):
                if r == 0:
                    continue
                dst = self.peers.peer_world_rank(peer)
                names.append(self.peers.label(dst))
                mine: list[Any] = []
                by_peer.append((names[-1], mine))
                for t in msgs:
                    view = _bytes(t.narrow(0, off, r))
                    keep.append(view)
                    mine.append(self._pg.send([view], dst, gtag))
                works.extend(mine)
        except RuntimeError as e:
            self._closed = e
            raise AFDPeerError(f"AFD {tag.op}: send to {', '.join(names) or 'peers'} at {tag.where()} failed: "
                               f"{error_text(e)}",
                               op=tag.op, peer=", ".join(names) or None, layer=tag.layer, stage=tag.stage) from None
        if not works:
            return PendingSend()
        peer_text = ", ".join(names)
        return PendingSend(lambda: self._wait(works, tag, "send", peer_text, by_peer), keep)

    def fan_in(self, tensors, peers, rows, *, tag: MessageTag, wait: bool = False) -> None:
        """Receive (blocking, bounded): the data is in ``tensors`` on return, whatever ``wait`` says."""
        self._check_open(tag)
        msgs = [t for t in tensors if t is not None]
        gtag = _TAGS[tag.direction]
        live = [(p, off, r) for p, off, r in zip(peers, row_offsets(rows), rows) if r > 0]
        if not live:
            return
        names = [self.peers.peer_label(p) for p, _, _ in live]
        works = []
        by_peer = []
        try:
            for name, (p, off, r) in zip(names, live):
                src = self.peers.peer_world_rank(p)
                mine = [self._pg.recv([_bytes(t.narrow(0, off, r))], src, gtag) for t in msgs]
                by_peer.append((name, mine))
                works.extend(mine)
        except RuntimeError as e:  # posting a receive on a pair the peer already closed
            self._closed = e
            raise AFDPeerError(f"AFD {tag.op}: receive from {', '.join(names)} at {tag.where()} failed: "
                               f"{error_text(e)}", op=tag.op, peer=", ".join(names), layer=tag.layer,
                               stage=tag.stage) from None
        self._wait(works, tag, "receive", ", ".join(names), by_peer)

    # -- collective / lifecycle ----------------------------------------------------

    def barrier(self) -> None:
        self._check_open()
        tag = MessageTag("barrier", "a2f", -1, -1, -1)
        try:
            work = self._pg.barrier()
        except RuntimeError as e:
            self._closed = e
            raise AFDPeerError(f"AFD barrier on {self.peers.me} failed: {error_text(e)}", op="barrier") from None
        self._wait([work], tag, "barrier", "every rank")

    def abort(self, reason: str) -> None:
        if self._closed is None:
            self._closed = AFDTransportError(f"aborted: {reason}")
        try:
            self._pg.abort()
        except Exception:  # noqa: BLE001 - best effort
            pass

    def close(self, buffers=()) -> None:
        """Stop the waiter (bounded) and drop the process group; ``buffers`` need no retention (host waits end)."""
        if self._closed is None:
            self._closed = AFDTransportError("closed")
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.stop(self.timeout_s + _WAIT_MARGIN_S):
            logger.warning("%s: a gloo wait is still blocked at close; exiting now may abort the process",
                           self.peers.me)
        # Dropping the group object releases its sockets; a waiter stuck on an
        # aborted pair ends at its own (bounded) gloo timeout.
        self._pg = None
