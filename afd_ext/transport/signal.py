"""The generation's abort signal, as the data plane uses it: check it, probe it, post it.

One object per generation (built by the connector at init over the rendezvous
store, handed to the transport in its setup), so every reader turns a posted
abort or an unreachable store into the same named error.
"""

from __future__ import annotations

import logging

from .. import rendezvous as rdzv
from ..errors import AFDTransportError

logger = logging.getLogger(__name__)

__all__ = ["AbortSignal"]


class AbortSignal:
    """The step-abort key of one generation's store.

    Args:
        store: the generation's :class:`~afd_ext.rendezvous.AFDStore`.
        me: this rank's label (posts are signed with it).
    """

    def __init__(self, store: "rdzv.AFDStore", me: str):
        self.store = store
        self.me = me

    def check(self, op: str = "") -> None:
        """Raise if an abort was posted (one store round trip).

        Raises:
            StepAbortedError: naming the aborting rank, its reason and ``op``.
            AFDTransportError: the store (hosted by FFN rank 0) is unreachable.
        """
        store = self.store
        try:
            rdzv.raise_if_aborted(store, op=op)
        except rdzv.StepAbortedError:
            raise
        except Exception as e:  # noqa: BLE001 - the store lives in FFN rank 0
            raise AFDTransportError(
                f"AFD {self.me}: the rendezvous store at {store.host}:{store.port} (hosted by FFN rank 0) "
                f"is unreachable while {op or 'waiting'}: {e}. FFN rank 0 probably died.", op=op) from None

    def probe(self, op: str = "in-flight work") -> BaseException | None:
        """The error :meth:`check` would raise, or None (for polling threads)."""
        try:
            self.check(op)
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def post(self, exc: BaseException | str) -> None:
        """Post ``exc`` as the abort reason (first post wins; a posted abort itself is not re-posted)."""
        if isinstance(exc, rdzv.StepAbortedError):
            return
        rdzv.post_abort(self.store, str(exc).splitlines()[0][:2000] if str(exc) else type(exc).__name__,
                        by=self.me)
