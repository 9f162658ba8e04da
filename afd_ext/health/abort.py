"""The step-abort signal: one key per rendezvous generation, posted by the first rank that fails a step.

Every rank's waits read it (rendezvous waits, control receives, transport waits
and the watchdog's store thread) and raise the posted failure naming who
aborted and why. A ``TCPStore`` client has no timeout against a silent server
(FFN rank 0 stopped), so the signal never waits on the store: a read waits at
most :data:`ABORT_READ_WAIT_S` for the store thread's answer and, while an
earlier read is still unanswered, answers at once from what it last learned;
a post waits at most :data:`POST_ABORT_WAIT_S` and still lands if the store
host wakes. The store is :class:`afd_ext.rendezvous.AFDStore` (its ``call``,
``label``, ``store`` and round-trip thread ``_runner``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
from typing import Any, Callable, Mapping

from ..errors import StepAbortedError, StoreUnavailableError

logger = logging.getLogger("afd_ext.rendezvous")  # the name users configure (docs/troubleshooting.md)

__all__ = ["ABORT_READ_WAIT_S", "POST_ABORT_WAIT_S", "AbortSignal", "check_abort", "post_abort", "raise_if_aborted"]

#: Longest a read of the abort signal waits for the store's answer, in seconds;
#: past it the read answers from what it last learned (the store host is frozen).
ABORT_READ_WAIT_S = 0.1
#: Longest :func:`post_abort` waits for the store to take the abort, in seconds
#: (the post still lands if a frozen store host wakes up).
POST_ABORT_WAIT_S = 0.5


def _decode_abort(raw: bytes) -> tuple[str, str, dict[str, Any]]:
    """``(reason, by, record)`` of an abort value (``record``: the whole JSON object, ``{}`` if not JSON)."""
    try:
        d = json.loads(raw.decode("utf-8"))
        return str(d["reason"]), str(d["by"]), d
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace"), "an unknown rank", {}


class AbortSignal:
    """A generation's step-abort key, read so that a waiter never waits on the store.

    :meth:`read` asks the store (one round trip on the rank's store thread) and
    waits at most ``wait_s`` for the answer; while an earlier read is still
    unanswered (a frozen store host) it answers at once from what it last
    learned. An abort once seen is kept.

    Args:
        store: the generation's store.
        error: ``error(store, (reason, by), op, missing) -> exception`` of a posted abort
            (the rendezvous's: :class:`StepAbortedError`, ``PeerClosedError``, ``DuplicateRankError``).
        me: this rank's label (default ``store.label()``).
    """

    def __init__(self, store: Any, error: Callable[..., BaseException], me: str | None = None):
        self._store = store
        self._error = error
        self.me = store.label() if me is None else me
        self._lost_logged = False
        self._lock = threading.Lock()
        self._queued: cf.Future | None = None
        self._posted: tuple[str, str] | None = None
        #: The posted abort's whole record (``kind: "duplicate"``: a role rank started twice, see ``connect``).
        self.record: dict[str, Any] = {}

    def read(self, wait_s: float = ABORT_READ_WAIT_S) -> tuple[str, str] | None:
        """``(reason, by)`` of the posted abort, or None (none posted, or the store is silent).

        Raises:
            StoreUnavailableError: the connection to the store was lost (FFN rank 0 exited).
        """
        if self._posted is not None:
            return self._posted
        runner = self._store._runner
        if runner.on_thread() or runner.lost is not None:
            return self._fetch()
        if runner.stuck_s() > wait_s:
            return self._posted  # an earlier round trip is unanswered: queue no more behind it
        with self._lock:
            fut = self._queued
            if fut is None or fut.running() or fut.done():
                fut = self._queued = runner.submit(self._fetch)
        try:
            return fut.result(wait_s)
        except cf.TimeoutError:
            return self._posted

    @property
    def calls(self) -> Any:
        """The :class:`~afd_ext.health.CallThread` that makes the store's round trips (the watchdog's store hooks run there)."""
        return self._store._runner

    def error(self, found: tuple[str, str], op: str = "", missing: Any = ()) -> BaseException:
        """The error of the posted abort ``found`` (``(reason, by)``) met while ``op``; ``missing``: ranks
        not arrived yet (named with a duplicate rank)."""
        return self._error(self._store, found, op, missing)

    def check(self, op: str = "") -> None:
        """Raise if an abort was posted (waits for the store at most :data:`ABORT_READ_WAIT_S`).

        A lost store (FFN rank 0, its host, exited) reads as "no abort": when
        A = F, FFN rank 0 finishing normally takes the store with it while other
        edges are still mid-step and healthy. A peer that really died is still
        found by the transport itself (its connection closes, or its deadline passes).

        Raises:
            StepAbortedError: naming the aborting rank, its reason and ``op``.
        """
        try:
            found = self.read()
        except StoreUnavailableError as e:
            e.__traceback__ = None  # a read's future keeps e: its frames would pin a dead generation's transfers
            if not self._lost_logged:
                self._lost_logged = True
                logger.info("AFD %s: the rendezvous store (FFN rank 0) is gone while %s (%s); no abort can be "
                            "posted or read any more, the transport's own deadlines and peer checks remain",
                            self.me, op or "waiting", e)
            return
        if found is not None:
            raise self.error(found, op)

    def post(self, exc: BaseException | str, kind: str | None = None) -> None:
        """Post ``exc`` as the abort reason (first post wins; a posted abort itself is not re-posted).

        ``kind``: ``"closed"`` for an orderly close (peers raise ``PeerClosedError``).
        Waits for the store at most :data:`POST_ABORT_WAIT_S` (see :func:`post_abort`).
        """
        if isinstance(exc, StepAbortedError):
            return
        post_abort(self._store, str(exc).splitlines()[0][:2000] if str(exc) else type(exc).__name__, by=self.me,
                   kind=kind)

    def learn(self, reason: str, by: str, record: Mapping[str, Any] | None = None) -> None:
        """Record an abort this rank posted or read elsewhere."""
        if self._posted is None:
            self._posted = (reason, by)
            self.record = dict(record or {})

    def _fetch(self) -> tuple[str, str] | None:
        st = self._store
        raw = st.call(lambda: bytes(st.store.get("abort")) if st.store.check(["abort"]) else None,
                      "reading the abort signal")
        if raw is not None:
            self.learn(*_decode_abort(raw))
        return self._posted


def check_abort(store: Any) -> str | None:
    """Return the posted abort (``"<reason> (by <who>)"``) of ``store``'s generation, or None.

    Waits for the store at most :data:`ABORT_READ_WAIT_S` (see :class:`AbortSignal`):
    a silent store reads as "no abort", so a caller's own deadline still holds.

    Raises:
        StoreUnavailableError: the connection to the store was lost.
    """
    found = store.abort_signal.read()
    return None if found is None else f"{found[0]} (by {found[1]})"


def raise_if_aborted(store: Any, op: str = "") -> None:
    """Raise the posted abort's error (:class:`StepAbortedError`...) if one was posted in this generation.

    Waits for the store at most :data:`ABORT_READ_WAIT_S` (see :func:`check_abort`).

    Raises:
        StepAbortedError: naming the aborting rank, its reason and ``op``.
        StoreUnavailableError: the connection to the store was lost.
    """
    sig = store.abort_signal
    found = sig.read()
    if found is not None:
        raise sig.error(found, op)


def post_abort(store: Any, reason: str, by: str | None = None, kind: str | None = None) -> bool:
    """Post the step-abort signal for this generation (the first post wins).

    Every rank waiting in the rendezvous, or polling :func:`check_abort` (the
    control plane's receive does), raises :class:`StepAbortedError`. Waits for
    the store at most :data:`POST_ABORT_WAIT_S`; a post a frozen store did not
    take in time still lands if it wakes up.

    Args:
        store: the generation's store.
        reason: what went wrong, e.g. ``"send_attn_output layer 3 stage 0: peer FFN rank 1 dead"``.
        by: who aborts; default this rank's label.
        kind: ``"closed"``: ``by`` closed in order (waiters raise ``PeerClosedError``).

    Returns:
        True if this call posted the abort, False if one was already posted or
        the store did not take it.
    """
    by = by or store.label()
    value = json.dumps({"reason": str(reason), "by": by, **({"kind": kind} if kind else {})}).encode("utf-8")
    runner = store._runner
    if not runner.on_thread() and runner.stuck_s() > ABORT_READ_WAIT_S:
        # The store is silent already: queue the post (it lands if the host wakes), wait for nothing.
        runner.submit(lambda: store.store.compare_set("abort", "", value))
        logger.warning("%s: the AFD abort (%s) is queued: the rendezvous store at %s:%d does not answer "
                       "(FFN rank 0 stopped or unreachable)", store.label(), reason, store.host, store.port)
        return False
    try:
        prev = bytes(store.call(lambda: store.store.compare_set("abort", "", value), "posting the abort",
                                POST_ABORT_WAIT_S, cancel=False))
    except Exception as e:  # noqa: BLE001 - the store may be gone with a dead FFN rank 0
        logger.warning("could not post AFD abort (%s): %s", reason, e)
        return False
    store.abort_signal.learn(*_decode_abort(bytes(prev)))
    return bytes(prev) == value
