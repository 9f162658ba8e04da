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
slices (:func:`afd_ext.health.host_wait`). A gloo wait cannot be
interrupted: :meth:`GlooTransport.close` joins the waiter when healthy
(bounded by the deadline) and, after an abort, leaves a wait still blocked
to end on its own thread (when the peer drops its end, or at gloo's own
timeout), so close never waits on a peer; the process's exit joins such a
thread (bounded), since exiting with a gloo wait blocked aborts the process
in gloo's destructors. A peer that dies surfaces at
once (gloo reports the closed connection) as an
:class:`~afd_ext.transport.base.AFDPeerError` naming the peer, the layer and
the stage; a peer that is alive but silent becomes an
:class:`~afd_ext.transport.base.AFDTimeoutError` at the deadline.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import time
from typing import Any, Callable, Sequence

import torch

from ..health import AbortSignal, CallThread, host_wait, leave
from .base import (
    AFDPeerError, AFDProtocolError, AFDTimeoutError, AFDTransportError, MessageTag, PeerMap, PendingSend, Transport,
    TransportSetup, row_offsets
)
from .. import fp8
from ..errors import AFDConfigError
from ..rendezvous import error_text

logger = logging.getLogger(__name__)

__all__ = ["GlooTransport"]

_TAGS = {"a2f": 1, "f2a": 2}
# One message per edge and step on its own tag: the attention rank's rows of the edge, per stage (see
# _rows_words). gloo aborts the process that receives a message larger than the receive it posted, so
# the FFN rank compares the two schedules' rows before it posts any data receive of the step.
_ROWS_TAG = 3
_ROWS_STAGES = 16  # stages listed in the message; more are covered by its checksum
# A waiter-thread wait gets this much longer than the caller's deadline, so the
# caller always reports the (named) timeout first.
_WAIT_MARGIN_S = 1.0
# After an abort, close() gives a blocked wait this long to end (the peer already
# closed) before leaving it to finish on its own thread.
_ABORTED_JOIN_S = 0.2


class _Waiter(CallThread):
    """The gloo wait thread: a wait still blocked when it stops holds the process's exit, bounded.

    Args:
        name: the thread's name; bound_s: the longest one submitted wait can block
            (gloo's own timeout), seconds.
    """

    def __init__(self, name: str, bound_s: float):
        super().__init__(name)
        self.bound_s = float(bound_s)

    def stop(self, join_timeout_s: float = 0.0) -> bool:
        """Stop the thread; wait up to ``join_timeout_s`` for a wait in progress to end.

        Returns False if the thread is still blocked in gloo; it then ends by
        itself within :attr:`bound_s`, and the process's exit waits until it has
        (:func:`afd_ext.health.leave`; an exit with a gloo wait blocked aborts the
        process in gloo's destructors).
        """
        t = self._thread
        if super().stop(join_timeout_s):
            return True
        leave(t, f"a gloo wait ({self._name})", lambda: self.bound_s + 1.0 - self.stuck_s())
        return False


def _completed_ok(work: Any) -> bool:
    """Whether a gloo work finished successfully (False while pending or after an error)."""
    try:
        return bool(work.is_completed()) and bool(work.is_success())
    except Exception:  # noqa: BLE001 - treat an unanswerable work as not done
        return False


def _rows_words(schedule: Any, a: int, f: int) -> list[int]:
    """Edge ``(a, f)``'s rows in every stage of ``schedule``, as the int64 words of one rows message.

    ``[number of stages, crc32 of all (stage, rows) pairs, stage, rows, stage, rows, ...]``, padded with
    -1 to a fixed length, so both sides post the same size whatever they disagree on.
    """
    import zlib

    pairs = [(int(s), int(schedule.edge_rows(s, a, f))) for s in schedule.stages]
    words = [len(pairs), zlib.crc32(repr(pairs).encode())]
    for s, r in pairs[:_ROWS_STAGES]:
        words += [s, r]
    return words + [-1] * (2 + 2 * _ROWS_STAGES - len(words))


def _rows_text(words: Sequence[int]) -> str:
    """``"stage 0: 3 rows, stage 1: 0 rows"`` from a rows message."""
    n = int(words[0])
    pairs = [f"stage {int(words[2 + 2 * i])}: {int(words[3 + 2 * i])} rows" for i in range(min(n, _ROWS_STAGES))]
    if n > _ROWS_STAGES:
        pairs.append(f"... ({n} stages)")
    return ", ".join(pairs) if pairs else "no stages"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor (gloo then needs no dtype support, e.g. for fp8)."""
    if t.dim() == 0:
        t = t.reshape(1)
    elif t.stride(-1) != 1:  # torch calls [n, 1] with an odd last stride contiguous; a byte view needs 1
        t = t.as_strided(t.shape, t.stride()[:-1] + (1,))
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


class GlooTransport(Transport):
    """Moves row ranges of CPU tensors between attention and FFN ranks over gloo.

    Args:
        store: a ``torch.distributed.Store`` shared by the AFD world (the
            generation's prefix store from :func:`afd_ext.rendezvous.connect`).
        peers: the :class:`~afd_ext.transport.base.PeerMap` of this rank.
        timeout_s: deadline of every wait inside a step, seconds (> 0).
        init_timeout_s: deadline for building the process group, seconds.
        abort: the generation's :class:`~afd_ext.health.AbortSignal`
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
        self._waiter = _Waiter(f"afd-gloo-wait {peers.me}", self.timeout_s + _WAIT_MARGIN_S)
        self._wait_timeout = datetime.timedelta(seconds=self.timeout_s + _WAIT_MARGIN_S)  # of one gloo wait
        self._rows_step: Any = None  # this step's schedule until its rows messages went out / were checked

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
        if all(_completed_ok(w) for w in works):  # done already (a send whose reply came back): no waiter
            return
        waiter = self._waiter
        if waiter is None:
            self._check_open(tag)
        timeout = self._wait_timeout

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
                # the abort (the root cause), not the closed connection, and without
                # gloo's raw error chained to it as its context.
                try:
                    self._abort_check(f"{tag.op} ({what} with {peer} at {tag.where()})")
                except AFDTransportError as aborted:
                    raise aborted from None
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

    # -- the step's rows, agreed before its first data message ------------------------

    def _link_failed(self, e: RuntimeError, tag: MessageTag, what: str, names: Sequence[str]) -> AFDPeerError:
        """Close this transport on ``e`` (posting a send or receive failed) and return the error naming the peers."""
        self._closed = e
        who = ", ".join(names) or None
        return AFDPeerError(f"AFD {tag.op}: {what} {who or 'peers'} at {tag.where()} failed: {error_text(e)}",
                            op=tag.op, peer=who, layer=tag.layer, stage=tag.stage)

    def begin_step(self, schedule: Any) -> None:
        """Remember the step's schedule: its first a2f exchange carries (attention) or checks (FFN) the rows."""
        super().begin_step(schedule)
        self._rows_step = schedule if getattr(schedule, "topology", None) is not None else None

    def _send_rows(self, tag: MessageTag) -> tuple[list[Any], list[tuple[str, list[Any]]], list[torch.Tensor]]:
        """Attention rank: post this step's rows message to every FFN peer (raises RuntimeError like a send)."""
        sch, self._rows_step = self._rows_step, None
        a = self.peers.role_rank
        works: list[Any] = []
        by_peer: list[tuple[str, list[Any]]] = []
        keep: list[torch.Tensor] = []
        for f in sch.topology.attention_peers(a):
            t = torch.tensor(_rows_words(sch, a, f), dtype=torch.int64)
            keep.append(t)
            w = self._pg.send([t], self.peers.peer_world_rank(f), _ROWS_TAG)
            works.append(w)
            by_peer.append((self.peers.peer_label(f), [w]))
        return works, by_peer, keep

    def _check_rows(self, tag: MessageTag) -> None:
        """FFN rank: receive every attention peer's rows message of this step and compare it with ours.

        Raises:
            AFDProtocolError: a peer's rows differ (its schedule and ours disagree); nothing of
                the step's data has been received (the connector aborts the step on every rank).
            AFDPeerError / AFDTimeoutError / StepAbortedError: as a receive.
        """
        sch, self._rows_step = self._rows_step, None
        f = self.peers.role_rank
        peers = sch.topology.ffn_peers(f)
        names = [self.peers.peer_label(a) for a in peers]
        got = torch.empty(len(peers), 2 + 2 * _ROWS_STAGES, dtype=torch.int64)
        try:
            works = [self._pg.recv([got[i]], self.peers.peer_world_rank(a), _ROWS_TAG) for i, a in enumerate(peers)]
        except RuntimeError as e:
            raise self._link_failed(e, tag, "receive of the step's rows from", names) from None
        self._wait(works, tag, "receive (the step's rows)", ", ".join(names), [(n, [w]) for n, w in zip(names, works)])
        bad = []
        for i, a in enumerate(peers):
            want = _rows_words(sch, a, f)
            if got[i].tolist() != want:
                bad.append((names[i], _rows_text(got[i].tolist()), _rows_text(want)))
        if bad:
            detail = "; ".join(f"{name} sends {theirs} on its edge with this rank, this rank's schedule expects "
                               f"{ours}" for name, theirs, ours in bad)
            raise AFDProtocolError(
                f"AFD {tag.op} on {self.peers.me} at {tag.step_text()}: the ranks disagree on the step's row "
                f"counts: {detail}. They applied different control payloads: every attention rank must apply "
                "(update_state_from_dp_metadata) the payload the control senders send to the FFN ranks. Nothing "
                "of the step's data was received; the step is aborted on every rank.",
                op=tag.op, peer=", ".join(b[0] for b in bad), layer=tag.layer, stage=tag.stage)

    # -- data --------------------------------------------------------------------

    def split_back(self, tensors, peers, rows, *, tag: MessageTag) -> PendingSend:
        if self._closed is not None:  # check_health ran at the call's start; a close since then
            self._check_open(tag)
        if self.fp8 and tag.direction == "a2f" and self.peers.role == "attention":
            tensors = list(fp8.quantize(tensors[0], ue8m0=self.fp8_ue8m0)) + list(tensors[1:])  # the rule, on CPU; gloo moves the bytes
        gtag = _TAGS[tag.direction]
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        names: list[str] = []
        by_peer: list[tuple[str, list[Any]]] = []
        try:
            if self._rows_step is not None and tag.direction == "a2f" and self.peers.role == "attention":
                rw, rb, rk = self._send_rows(tag)
                works.extend(rw)
                by_peer.extend(rb)
                keep.extend(rk)
            for peer, off, r in zip(peers, row_offsets(rows), rows):
                if r == 0:
                    continue
                dst = self.peers.peer_world[peer]
                names.append(self.peers.peer_labels[peer])
                mine = next((ws for label, ws in by_peer if label == names[-1]), None)
                if mine is None:
                    mine = []
                    by_peer.append((names[-1], mine))
                for t in tensors:
                    view = _bytes(t.narrow(0, off, r))
                    keep.append(view)
                    w = self._pg.send([view], dst, gtag)
                    mine.append(w)
                    works.append(w)
        except RuntimeError as e:
            raise self._link_failed(e, tag, "send to", names) from None
        if not works:
            return PendingSend()
        peer_text = ", ".join(label for label, _ in by_peer)
        return PendingSend(lambda: self._wait(works, tag, "send", peer_text, by_peer), keep)

    def fan_in(self, tensors, peers, rows, *, tag: MessageTag, wait: bool = False, dequant=None) -> None:
        """Receive (blocking, bounded): the data is in ``tensors`` on return, whatever ``wait`` says."""
        self._fan_in(tensors, peers, rows, tag)
        if dequant is not None:
            fp8.dequantize(tensors[0], tensors[1], dequant)

    def _fan_in(self, tensors, peers, rows, tag: MessageTag) -> None:
        if self._closed is not None:  # check_health ran at the call's start; a close since then
            self._check_open(tag)
        if self._rows_step is not None and tag.direction == "a2f" and self.peers.role == "ffn":
            self._check_rows(tag)
        gtag = _TAGS[tag.direction]
        live = [(p, off, r) for p, off, r in zip(peers, row_offsets(rows), rows) if r > 0]
        if not live:
            return
        names = [self.peers.peer_labels[p] for p, _, _ in live]
        works = []
        by_peer = []
        try:
            for name, (p, off, r) in zip(names, live):
                src = self.peers.peer_world[p]
                mine = [self._pg.recv([_bytes(t.narrow(0, off, r))], src, gtag) for t in tensors]
                by_peer.append((name, mine))
                works.extend(mine)
        except RuntimeError as e:  # posting a receive on a pair the peer already closed
            raise self._link_failed(e, tag, "receive from", names) from None
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
        self._mark_closed(f"aborted: {reason}")
        try:
            self._pg.abort()
        except Exception:  # noqa: BLE001 - best effort
            pass

    def close(self, buffers=()) -> None:
        """Stop the waiter and drop the process group, promptly after an abort; never raises.

        A healthy close joins the waiter (bounded by the deadline; its waits end
        by themselves). After an abort a wait may stay blocked until the peer
        drops its end or gloo's own timeout (the deadline + 1 s) passes, and no
        local call ends it (``ProcessGroupGloo.abort``/``shutdown`` do not): the
        waiter is then left to finish on its own, holding the group (and the
        receive's tensor) until it does, so close returns at once instead of
        waiting for the peer's teardown; the process's exit waits for it
        (bounded), because exiting with a gloo wait blocked aborts the process.
        ``buffers`` need no retention: a blocked receive's work holds its own tensor.
        """
        aborted = self._closed is not None
        self._mark_closed("closed")
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.keep = self._pg  # a wait left blocked keeps its group (dropped when the thread ends)
        if waiter is not None and not waiter.stop(_ABORTED_JOIN_S if aborted else self.timeout_s + _WAIT_MARGIN_S):
            log = logger.info if aborted else logger.warning
            log("%s: a gloo wait is still blocked at close%s; it ends when the peer closes its end or within "
                "%.0f s", self.peers.me, " after an abort" if aborted else "", self.timeout_s + _WAIT_MARGIN_S)
        self._pg = None
