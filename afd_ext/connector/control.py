"""The connector's ``control_plane`` attribute: the reference's three methods over the connector.

The host-side channels themselves are :mod:`afd_ext.control_plane`'s; this
class only routes the three calls (logic unchanged, moved out of the facade).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..control_plane import AFDControlPlane
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
            PeerDeadError: a destination FFN rank is gone.
        """
        channels = self._connector._channels("send_dp_metadata_list")
        channels.send_dp_metadata_list(AFDControlPayload.from_fields(payload))

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


