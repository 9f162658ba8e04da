"""The connector's ``control_plane`` attribute: the reference's three methods over the connector.

The host-side channels themselves are :mod:`afd_ext.control_plane`'s; this
class only routes the three calls (logic unchanged, moved out of the facade).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..control_plane import AFDControlPlane
from ..errors import AFDProtocolError
from ..metadata import AFDControlPayload

if TYPE_CHECKING:
    from . import AFDConnector

__all__ = ["_ConnectorControlPlane"]


class _ConnectorControlPlane(AFDControlPlane):
    """The ``control_plane`` attribute: the reference's three methods over this connector.

    ``update_state_from_dp_metadata`` applies a payload to the connector (no
    network); ``send_dp_metadata_list`` / ``recv_dp_metadata_list`` go through
    the host-side channels of :mod:`afd_ext.control_plane` opened at init. The
    object stays the same across ``close()`` / ``init_afd_connector()``.
    """

    def __init__(self, connector: "AFDConnector"):
        self._connector = connector

    def update_state_from_dp_metadata(self, payload: AFDControlPayload) -> None:
        """Apply ``payload`` locally: validate the step, build its schedule, preallocate buffers.

        Attention ranks call it before ``send_dp_metadata_list`` every step;
        FFN ranks after ``recv_dp_metadata_list``. If the previous step was
        abandoned after a rejected first exchange, it is drained first (see
        docs/internals.md, "Errors and resynchronisation").

        Raises:
            ValueError: invalid payload (stages, count vector lengths, ...); nothing moved.
            ConnectorStateError: not initialised, aborted, or the previous step is
                incomplete mid-way (the step is then aborted on every rank).
        """
        # Any object with the payload's fields (the reference plugin's own class included).
        self._connector._apply_payload(AFDControlPayload.from_fields(payload))

    def send_dp_metadata_list(self, payload: AFDControlPayload) -> None:
        """Send ``payload`` to this attention rank's control destinations (no-op on non-senders).

        Raises:
            ConnectorStateError: not initialised.
            AFDProtocolError: its row counts differ from the payload applied by
                :meth:`update_state_from_dp_metadata` for this step (nothing is sent;
                the step is aborted on every rank).
            PeerDeadError: a destination FFN rank is gone.
        """
        channels = self._connector._channels("send_dp_metadata_list")
        payload = AFDControlPayload.from_fields(payload)
        self._check_matches_applied(payload)
        channels.send_dp_metadata_list(payload)

    def _check_matches_applied(self, payload: AFDControlPayload) -> None:
        """The FFN ranks build their schedule from the payload sent; this rank uses the one applied.

        Row counts that differ would make the two sides post data messages of
        different sizes (gloo aborts the receiving process); without strict
        headers this is where the disagreement is seen. Posts the step abort so
        the FFN ranks waiting for the payload fail with the same message.
        """
        s = self._connector._s
        st = s.step
        if st is None or st.seq.moved:
            return  # no step applied yet, or an older one (the runtime's order is checked elsewhere)
        applied = {k: md.counts for k, md in st.schedule.payload.dp_metadata_list.items()}
        sent = {k: md.counts for k, md in payload.dp_metadata_list.items()}
        if applied == sent:
            return
        diff = [k for k in sorted(set(applied) | set(sent)) if applied.get(k) != sent.get(k)]
        k = diff[0]
        exc = AFDProtocolError(
            f"AFD send_dp_metadata_list on {s.me}: the payload sent disagrees with the one applied by "
            f"update_state_from_dp_metadata (step {st.seq.step}): stage {k} rows per attention rank "
            f"{list(sent[k]) if k in sent else 'absent'} sent, {list(applied[k]) if k in applied else 'absent'} "
            "applied. Both sides must compute the same schedule; apply and send the same payload. The step is "
            "aborted on every rank.", op="send_dp_metadata_list", stage=k)
        s.fail_step(exc)
        raise exc

    def recv_dp_metadata_list(self) -> AFDControlPayload:
        """FFN side: block until the next step's payload arrives (an idle live peer is waited for).

        Raises:
            ConnectorStateError: not initialised, or called on an attention rank.
            PeerDeadError / ControlChannelClosed / StepAbortedError: see
                :meth:`afd_ext.control_plane.ChannelControlPlane.recv_dp_metadata_list`.
        """
        return self._connector._channels("recv_dp_metadata_list").recv_dp_metadata_list()

    def close(self) -> None:
        """Close the connector's control channels (the connector's ``close`` does it too)."""
        cp = self._connector._cp
        if cp is not None:
            cp.close()


