"""What one connector holds between ``init_afd_connector`` and ``close``, and how a failure ends a step.

The facade (:class:`afd_ext.connector.AFDConnector`) builds the session's
links at init; the two sides (:mod:`.attention`, :mod:`.ffn`) go through it for
every call: is the connector usable, which step is current, which transport
carries this step's data, and what a rejected call or a transport error does
to the step: a rejected call is an error on its rank only (the corrected call
proceeds); a transport error, a new payload over an incomplete step, or a
close mid-step aborts the step on every rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ..errors import (AFDClosedError, AFDConfigError, AFDError, AFDProtocolError, AFDStateError,
                      ConnectorStateError)
from ..health import AbortSignal, link_error as _raw_error
from ..metadata import AFDControlPayload
from ..schedule import StepSchedule
from ..transport.base import MessageTag, StepProgress, Transport
from .buffers import BufferPool
from .sequencer import StepSequencer, exchange_order
from .step import Step

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["Session", "RoleSide"]


def _release_links(exc: BaseException | None) -> None:
    """Drop the tracebacks of the failure ``exc`` (its cause/context chain included).

    Their frames hold the failed generation's transfers (gloo works keep the group's
    connections open); freed, the connections close, so a peer blocked on this rank fails at
    once with a peer error instead of waiting out its deadline: what ends the step there when
    the store died with FFN rank 0 and no abort can be posted. The exceptions and texts stay.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


class Session:
    """One connector's live state: links, the current step, and the failure rules.

    Args:
        me: this rank's label; role: ``"attention"`` / ``"ffn"``.
        strict: strict-mode headers configured (eager steps then use the checked transport).
        buffers: this rank's :class:`~afd_ext.connector.buffers.BufferPool`.
    """

    def __init__(self, me: str, role: str, strict: bool, buffers: BufferPool):
        self.me = me
        self.role = role
        self.strict = strict
        self.buffers = buffers
        self.initialized = False
        self.store: Any = None
        self.signal: AbortSignal | None = None
        self.transport: Transport | None = None  # the plain transport
        self.checked: Transport | None = None  # its strict-mode view (itself when not strict)
        self.broken: BaseException | None = None
        self.closing = False  # a local close() began: a call it ends raises AFDClosedError, not a failure
        self.step: Step | None = None
        self.step_counter = 0  # every step of this generation, warm-ups included: orders progress reports
        self._tags: dict[str, MessageTag] = {}  # the health checks' tags of this step, by op
        self.user_steps = 0  # the steps the caller applied: what messages count ("step 1" is the first)
        self.user_step = -1  # the last started step as the caller counts it (0: a warm-up), -1: none yet
        self.last_call = time.monotonic()
        self.stop = threading.Event()  # set by close(): ends an init_afd_connector() waiting on another thread
        self.opens = 0  # successful inits: graphs captured under another count used other links

    def reset(self) -> None:
        """Forget the previous generation's failure and step (a new init)."""
        self.broken = None
        self.closing = False
        self.step = None
        self.step_counter = 0
        self._tags = {}
        self.user_steps = 0
        self.user_step = -1
        self.last_call = time.monotonic()

    def close(self, control: Any, replies: Any) -> None:
        """Release everything, bounded, never raising: replies in flight, step, buffers, ``control``, the transport.

        Args:
            control: the control plane (its channels are closed after the step state, before the transport), or None.
            replies: the FFN side (its replies in flight are delivered when healthy, else dropped), or None.
        """
        self.stop.set()
        self.closing = True
        st = self.step
        if self.initialized and self.broken is None and st is not None and not st.seq.complete:
            # The peers may be blocked in this step's exchanges (a rejected call is no longer an
            # abort): tell them now, naming this rank, instead of leaving them to their deadline.
            self._abort_on_close(st)
        if replies is not None:
            if self.initialized and self.broken is None and self.transport is not None:
                # Healthy close: the last replies may still be in flight (gloo sends
                # asynchronously); let the peers take them (bounded by the deadline).
                try:
                    replies.settle()
                except Exception as e:  # noqa: BLE001 - close must not raise
                    logger.warning("%s: last replies not delivered at close: %s", self.me, e)
            replies.forget()
        self.initialized = False
        self.step = None
        old_bufs = self.buffers.release()
        if control is not None:
            try:
                control.close()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("closing AFD control channels: %s", e)
        tr, self.transport, self.checked = self.transport, None, None
        if tr is not None:
            try:
                tr.close(buffers=old_bufs)
            except Exception as e:  # noqa: BLE001
                logger.warning("closing AFD %s transport: %s", tr.kind, e)
        _release_links(self.broken)
        self.store = None
        self.signal = None

    def _abort_on_close(self, st: Step) -> None:
        """End the incomplete step ``st`` on every rank: this rank is closing (peers get :class:`PeerClosedError`)."""
        after = f"; its last rejected call: {st.seq.rejected}" if st.seq.rejected else ""
        exc = ConnectorStateError(f"{self.me} closed its connector (an orderly close(), not a failure) with "
                                  f"{st.seq.label} incomplete ({st.seq.progress()}){after}")
        logger.info("%s: closing mid-step; ending %s on every rank", self.me, st.seq.label)
        self.fail_step(exc, kind="closed")

    def open(self, conn: Any, control: Any) -> None:
        """Build this generation's links for connector ``conn`` (collective): store, handshake, transport, channels.

        Args:
            conn: the connector (its config, topology, handshake fields, deadlines).
            control: its :class:`~afd_ext.control.AFDControlPlane`, opened here over this generation's store.

        Raises:
            What :meth:`AFDConnector.init_afd_connector` documents; the caller closes on failure.
        """
        from .. import rendezvous as rdzv
        from ..control import ChannelOptions
        from ..transport import create_transport
        from ..transport.base import TransportSetup

        extra = conn.extra
        self.reset()
        self.stop.clear()
        store = rdzv.connect(conn.config.host, conn.config.port, conn.world_rank, conn.world_size,
                             timeout_s=extra.init_timeout_s, num_ffn_ranks=conn.ffn_size,
                             job_id=extra.job_id, stop=self.stop)
        self.store = store
        rdzv.handshake(store, conn.world_rank, conn.world_size, conn.handshake_fields(), extra.init_timeout_s)
        self.signal = store.abort_signal  # shared with the rendezvous waits: one bounded reader per store
        self.signal.me = self.me
        setup = TransportSetup(store, conn.topology, conn.peer_map, conn.device, conn.data_timeout_s,
                               extra.init_timeout_s, abort=self.signal, progress=self.progress,
                               publish_after_s=conn.publish_after_s, schedule_config=conn.schedule_config,
                               extra=extra)
        # The configured name (``auto`` is resolved here, every generation); the kind that runs is reported.
        self.transport, self.checked = create_transport(extra.transport, setup, strict=extra.strict)
        conn.transport_kind = self.transport.kind
        control.open(store, extra.control_channel, extra.init_timeout_s,
                     options=ChannelOptions.from_env(heartbeat_interval_s=extra.heartbeat_interval_s,
                                                     heartbeat_timeout_s=extra.heartbeat_timeout_s))
        if self.stop.is_set():  # close() on another thread while a step of init could not see it
            raise self.closed_error("init_afd_connector")
        self.opens += 1
        self.initialized = True

    # -- usability ---------------------------------------------------------------------

    def tag(self, op: str) -> MessageTag:
        """A tag for a call that is not one exchange (health checks, synchronize, replays)."""
        return MessageTag(op, "a2f", self.step_counter, -1, -1, user_step=self.user_step)

    def check_usable(self, op: str) -> Transport:
        """The plain transport, after checking the connector is initialised, unbroken and healthy.

        Raises:
            AFDClosedError: this rank's close() has begun (on another thread).
            ConnectorStateError: not initialised, or broken by an earlier failure.
            The transport's pending failure (the step is then aborted everywhere).
        """
        self.last_call = time.monotonic()
        tr = self.transport  # read once: a close() on another thread sets it to None
        if not self.initialized or tr is None:
            raise ConnectorStateError(
                f"AFD connector ({self.me}) is not initialized; call init_afd_connector() before {op}")
        if self.closing:  # a close() in progress on another thread
            raise self.closed_error(op)
        if self.broken is not None:
            cause = str(self.broken).rstrip().rstrip(".")
            # The failure's own message may already say how to recover; say it once.
            again = "" if "init_afd_connector" in cause else \
                f"; call close() and init_afd_connector() on every rank before {op}"
            raise ConnectorStateError(
                f"AFD connector ({self.me}) is unusable after a failed step ({cause}){again}") from self.broken
        tag = self._tags.get(op)  # the step knows it: built once per step and op
        if tag is None:
            tag = self._tags[op] = self.tag(op)
        try:
            tr.check_health(tag)
        except BaseException as e:  # a failed health check is a link failure: the step ends everywhere
            self.transport_failed(e, tag)
        return tr

    def require_step(self, op: str) -> Step:
        st = self.step
        if st is None:
            raise ConnectorStateError(
                f"{op} on {self.me}: no step is active; call "
                "control_plane.update_state_from_dp_metadata(payload) first (attention: every step before "
                "sending; FFN: after recv_dp_metadata_list)")
        return st

    def data(self, st: Step) -> Transport:
        """The transport of ``st``'s data calls: the strict-mode view unless the step is captured/replayed.

        Raises:
            AFDClosedError: a close() on another thread took the transport since :meth:`check_usable`.
        """
        tr = self.checked if st.strict else self.transport
        if tr is None:
            raise self.closed_error("a data call")
        return tr

    def closed_error(self, op: str) -> AFDClosedError:
        """The error of a call that this rank's own close() ended (a stop, not a failure)."""
        return AFDClosedError(f"{self.me}: {op} ended because this connector was closed (close() on this rank)")

    # -- failures ------------------------------------------------------------------------

    def fail_step(self, exc: BaseException, kind: str | None = None) -> None:
        """Abort the step on every rank: post the abort signal (``kind``: see ``AbortSignal.post``), abort our transport."""
        if self.broken is None:
            self.broken = exc
        if self.signal is not None:
            self.signal.post(exc, kind)
        if self.transport is not None:
            try:
                self.transport.abort(str(exc).splitlines()[0][:200])
            except Exception as e:  # noqa: BLE001
                logger.warning("aborting AFD transport: %s", e)

    def transport_call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` under :meth:`transport_failed` (for calls off the data path).

        Raises:
            The transport's :class:`~afd_ext.errors.AFDError`; a raw link error a transport
            let through (``DistNetworkError``, gloo's "Connection closed by peer") becomes
            :class:`~afd_ext.errors.AFDPeerError` / ``AFDTimeoutError`` naming the op, the
            peers and the step (:func:`_raw_error`); another ``RuntimeError`` propagates.
        """
        try:
            return fn(*args, **kwargs)
        except (AFDError, RuntimeError) as e:
            self.transport_failed(e, kwargs.get("tag"), args[1] if len(args) > 1 else None)

    def transport_failed(self, e: BaseException, tag: MessageTag | None, peers: Any = None) -> None:
        """The step-failure rule for an error a transport call raised; call it in the ``except`` clause (it raises).

        The data calls call the transport directly (``try: tr.split_back(...)``, ``except (AFDError,
        RuntimeError) as e: session.transport_failed(e, tag, peers)``).

        Raises:
            :class:`~afd_ext.errors.AFDClosedError` when this rank's own close() ended the call; else
            ``e`` after aborting the step everywhere, a raw link error as :func:`_raw_error` names it.
        """
        if self.closing:  # this rank's own close() ended the call: a stop, not a failure
            raise self.closed_error("the call") from e
        if isinstance(e, AFDError):  # every transport error (AFDPeerError is a ConnectionError)
            self.fail_step(e)
            raise e
        exc = _raw_error(e, self.transport, tag, peers)
        self.fail_step(exc or e)
        if exc is None:
            raise e
        raise exc from None

    def reject(self, st: Step, exc: BaseException, op: str, *, stage: int | None = None) -> AFDError:
        """A call failed its checks before anything of it moved: a named error on this rank only.

        Nothing is aborted and the step's position does not change, so the same
        call with correct arguments proceeds (the peers wait for it, bounded by
        their deadline). A step left incomplete is aborted on every rank only
        when this rank moves on (a new payload) or closes. At the first exchange
        (nothing of the step moved on this rank) the step is marked abandoned: an
        attention rank then drains it with zeros at the next payload.

        Args:
            st: the current step; exc: what the checks raised (``ValueError``, ``AFDStateError``).
            op: the data call; stage: the ``ubatch_idx`` / context stage the caller gave, if known.

        Returns:
            :class:`~afd_ext.errors.AFDStateError` (nothing due) or
            :class:`~afd_ext.errors.AFDConfigError` (a ``ValueError``: bad input or stage),
            naming the call, this rank, the step, the layer and the stage.
        """
        seq = st.seq
        due = seq.due(op)
        layer = None if due is None else due[0]
        where = seq.label if due is None else f"{seq.label}, layer {due[0]}, stage {due[1]}"
        text = str(exc)
        if not text.startswith(op):  # the order checks name the call and the step themselves
            text = f"{op} on {self.me} at {where}: {text}"
        text = text.rstrip().rstrip(".") + "."
        if seq.complete:
            text += f" The step is complete ({seq.progress()}); apply the next step's payload first."
        elif not seq.moved:
            seq.abandoned = True
            if self.role == "attention":
                text += (" Nothing was sent: repeat the call with correct arguments, or apply the next step's "
                         "payload (this step is then drained with zeros).")
            else:
                text += (" Nothing was received: repeat the call with correct arguments (applying the next payload "
                         "instead aborts this step on every rank).")
        else:
            text += (f" Nothing of this call moved and the step is unchanged ({seq.progress()}): repeat the call "
                     "with correct arguments; the peers wait for it up to their step_timeout_s.")
        seq.rejected = text.splitlines()[0][:300]
        cls = AFDStateError if isinstance(exc, AFDStateError) else AFDConfigError
        if type(stage) is not int:  # the caller's stage was not a stage id (None, a string): name the due one
            stage = None
        return cls(text, op=op, layer=layer, stage=due[1] if stage is None and due is not None else stage)

    def check_sent(self, payload: Any) -> None:
        """The FFN ranks build their schedule from the payload sent; this rank uses the one applied.

        Row counts that differ would make the two sides post data messages of
        different sizes (gloo aborts the receiving process); without strict
        headers this is where the disagreement is seen. Posts the step abort so
        the FFN ranks waiting for the payload fail with the same message.

        Args:
            payload: what is about to be sent (an :class:`AFDControlPayload` or any
                object with its fields, read by :meth:`AFDControlPayload.from_fields`).

        Raises:
            AFDConfigError: ``payload`` lacks the payload's fields (from_fields).
            AFDProtocolError: the counts differ (nothing is sent; the step is aborted on every rank).
        """
        st = self.step
        if st is None or payload is st.schedule.payload or st.seq.moved:
            return  # no step applied yet, the payload applied (the usual case: first, no property), or an older step
        payload = AFDControlPayload.from_fields(payload)
        applied = {k: md.counts for k, md in st.schedule.payload.dp_metadata_list.items()}
        sent = {k: md.counts for k, md in payload.dp_metadata_list.items()}
        # Only stages the sent payload carries: a graph replay's payload may leave counts out
        # (the FFN replays its captured graph), which is not a disagreement.
        diff = [k for k in sorted(sent) if applied.get(k) != sent[k]]
        if not diff:
            return
        k = diff[0]
        exc = AFDProtocolError(
            f"AFD send_dp_metadata_list on {self.me}: the payload sent disagrees with the one applied by "
            f"update_state_from_dp_metadata (step {st.seq.step}): stage {k} rows per attention rank "
            f"{list(sent[k]) if k in sent else 'absent'} sent, {list(applied[k]) if k in applied else 'absent'} "
            "applied. Both sides must compute the same schedule; apply and send the same payload. The step is "
            "aborted on every rank.", op="send_dp_metadata_list", stage=k)
        self.fail_step(exc)
        raise exc

    # -- steps ---------------------------------------------------------------------------

    def next_step(self, payload: AFDControlPayload, schedule: Callable[[AFDControlPayload], StepSchedule], *,
                  drain: Callable[[Step], None] | None, settle: Callable[[], None] | None) -> Step:
        """Apply a step's payload: end the previous step (drain an abandoned one), then start this one.

        Args:
            payload: the step's control payload.
            schedule: builds the step's schedule from the payload.
            drain: the attention side's drain of an abandoned step (None on FFN ranks).
            settle: the FFN side's wait for its replies in flight (None on attention ranks).

        Raises:
            AFDConfigError: the schedule rejects ``payload`` (nothing moved for this step).
            ConnectorStateError: not usable, or the previous step is incomplete mid-way (then
                aborted on every rank).
        """
        op = "update_state_from_dp_metadata"
        self.check_usable(op)
        prev = self.step
        if prev is not None:
            what = prev.seq.on_new_payload()
            if what == "drain":
                drain(prev)
            elif what == "drop":
                logger.debug("%s: %s replaced before any exchange", self.me, prev.seq.label)
            elif what == "abort":
                after = f" It was left after a rejected call: {prev.seq.rejected}" if prev.seq.rejected else ""
                exc = ConnectorStateError(
                    f"{op} on {self.me}: the previous {prev.seq.label} is incomplete ({prev.seq.progress()}); "
                    f"every step must run all {prev.seq.total} (layer, stage) exchanges.{after} The step was "
                    "aborted on every rank; close() and init_afd_connector() to continue.")
                self.fail_step(exc)
                raise exc
        self.step = None
        if settle is not None:
            settle()
        return self.start_step(schedule(payload), payload)

    def start_step(self, sch: StepSchedule, payload: AFDControlPayload, *, warmup: bool = False) -> Step:
        """Make ``sch`` the current step: its sequencer, buffers and the transport's stage resources.

        ``warmup``: the connector's own warm-up step (:meth:`AFDConnector.warmup`); it is named
        ``"warm-up step"`` in messages and does not count: the caller's first step is ``"step 1"``.
        """
        self.step_counter += 1
        if not warmup:
            self.user_steps += 1
        self.user_step = 0 if warmup else self.user_steps
        self._tags = {}
        strict = self.strict and not (payload.is_graph_capturing or payload.is_graph_replaying)
        seq = StepSequencer(self.step_counter, self.role, exchange_order(sch.config.num_layers, sch.stages), self.me,
                            self.user_step)
        st = Step(seq, sch, strict, pending={s: deque() for s in sch.stages})
        for s in sch.stages:
            own = self.transport.receive_buffers(sch, s) if self.transport is not None else None
            st.bufs[s] = own if own is not None else self.buffers.stage(sch, s)
            st.wire[s] = [st.bufs[s][p.name] for p in sch.config.wire_parts] if st.bufs[s] else []
        if self.transport is not None:
            self.transport.begin_step(sch)
        self.step = st
        return st

    def progress(self) -> StepProgress | None:
        """This rank's step position for the transport's stall reports (read from its watchdog thread)."""
        st = self.step
        if st is None or not self.initialized:
            return None
        q = st.seq
        return StepProgress(q.step, q.total, q.sent, q.received, q.complete, q.seq, q.progress(),
                            time.monotonic() - self.last_call, q.user_step)


class RoleSide:
    """What both role sides (:class:`~.attention.AttentionSide`, :class:`~.ffn.FFNSide`) hold and offer.

    Args:
        session: the connector's :class:`Session` (step, transport, failure rules).
        role_rank: this rank's index; device: where its tensors live.
    """

    def __init__(self, session: Session, role_rank: int, device: torch.device):
        self.s = session
        self.role_rank = role_rank
        self.device = device

    def warmup(self, st: Step, op: str, synchronize: Callable[[], None]) -> None:
        """One warm-up round of this side (see ``AFDConnector.warmup``)."""
        raise NotImplementedError
