"""Every exception class ``afd_ext`` raises on purpose, importable from one place.

They live beside the code that raises them; this module only re-exports
them, so ``except afd_ext.errors.AFDTimeoutError`` works without knowing
which layer raised it. What each one means and what to do:
``docs/troubleshooting.md``. Importing this module imports torch (the
transport layer needs it).
"""

from __future__ import annotations

from .connector import ConnectorStateError
from .control_plane import ControlChannelClosed, ControlRecvTimeout, PeerDeadError
from .rendezvous import (
    HandshakeMismatchError,
    RendezvousError,
    RendezvousTimeoutError,
    StepAbortedError,
    StoreUnavailableError,
)
from .transport.base import (
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
    AFDTransportClosedError,
    AFDTransportError,
)

#: Every exception class imported above (built, not listed twice).
__all__ = sorted(n for n, o in list(globals().items())
                 if isinstance(o, type) and issubclass(o, Exception) and not n.startswith("_"))
