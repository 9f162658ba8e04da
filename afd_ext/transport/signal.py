"""The generation's abort signal, as the data plane uses it: check it, probe it, post it.

One class, :class:`afd_ext.rendezvous.AbortSignal` (one object per generation's
store: ``store.abort_signal``), re-exported here where the transports import it.
Its reads wait for the store at most ``rendezvous.ABORT_READ_WAIT_S`` and its
posts at most ``rendezvous.POST_ABORT_WAIT_S``, so no deadline waits on a
frozen store host.
"""

from __future__ import annotations

from ..rendezvous import AbortSignal

__all__ = ["AbortSignal"]
