"""The peer-memory plane and transport, in one home (docs/peer-memory.md).

* :mod:`.plane`: :class:`PeerPlane` (one rank's receive region, its peers'
  regions, device counters, failure record) and :func:`open_plane` (collective
  set-up and proof through the rendezvous store);
* :mod:`.transport`: :class:`PeerTransport`, the plane behind the transport
  contract (``connector_extra_config.transport: "peer"``).

Importing this package imports torch and the compiled ops' wrappers.
"""

from __future__ import annotations

from . import plane
from .plane import *  # noqa: F401,F403
from .transport import POLL_S, WAIT_BACKSTOP_S, PeerTransport

__all__ = [*plane.__all__, "PeerTransport", "POLL_S", "WAIT_BACKSTOP_S"]
