"""No hang: follow in-flight work against a deadline and turn a stall into a named error.

Two tools:

* :class:`Watchdog` - the health thread of a rank's device transports (one
  per rank: the peer-memory transport shares its NCCL fallback's). Every NCCL
  operation issued is recorded with a CUDA event (recorded on the stage stream
  right after the operation) and a description (op, peer, layer, stage). The
  thread polls the events, each transport's poll of its own state (NCCL: the
  communicators' asynchronous errors; peer memory: the plane's error record)
  and the rendezvous abort signal. When an operation is older than the
  deadline, a poll reports a failure, or another rank posted the abort signal,
  the watchdog records the failure, runs the ``on_failure`` hooks (post the
  abort signal, abort the communicators and the plane, which ends stuck
  kernels and spinning waits) and the next connector call raises the recorded
  error: :class:`~afd_ext.errors.AFDTimeoutError` naming the op, the peer, the
  layer and the stage, an :class:`~afd_ext.errors.AFDPeerError`, or the abort.

  Which peer: an NCCL group over several peers (a fan-in) completes as a
  whole, so its event cannot say whose rows are missing. Two hooks answer
  that without any cost on the healthy path: ``on_tick`` runs in the thread
  every ``abort_poll_s`` (the connector publishes this rank's step progress to
  the rendezvous store there, but only while it has been waiting or idle
  mid-step for a while), and ``blame(op)`` runs once when an operation
  expires (the connector reads the peers' published progress and names the
  peer(s) that did not send: a dead peer publishes nothing, a stalled one
  says it has been idle in its caller).

  The deadline never waits on the rendezvous store: ``abort_check``,
  ``on_tick`` and ``blame`` (store round trips) run on the thread that makes
  the store's round trips (the rank's store thread), the first two as a
  round every ``abort_poll_s`` whose answer the deadline thread picks up when
  it is there, ``blame`` waited for at most :data:`BLAME_WAIT_S`; so a frozen
  store host (FFN rank 0 stopped) cannot keep an expired operation from being
  recorded, and a rank has one health thread.
* :func:`host_wait` - a bounded host-side wait used by the gloo transport and
  by strict-mode header checks: it polls a completion test in short slices,
  checks the abort signal between slices, and raises a named
  :class:`~afd_ext.transport.base.AFDTimeoutError` at the deadline.
* :class:`CallThread` - a daemon thread that makes blocking calls with no
  timeout of their own (store round trips, gloo waits) so that the caller can
  wait for the answer with its own bound.

CUDA-graph note: ``cudaEventQuery`` is not allowed from any thread while a
stream is being captured in the (default) global capture mode, so wrap a
capture in :meth:`Watchdog.suspended`; operations issued during capture are
not tracked (they move no data until replay). To watch a replay, record an
event on the replay stream after ``graph.replay()`` and :meth:`Watchdog.track` it.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from ..errors import AFDConfigError, AFDError, AFDPeerError, AFDTimeoutError, AFDTransportError
from .abort import POST_ABORT_WAIT_S

logger = logging.getLogger(__name__)

#: How often the watchdog thread polls, in seconds.
DEFAULT_POLL_INTERVAL_S = 0.005
#: Longest an expiring operation waits for ``blame`` (store reads) before it is recorded without it, seconds.
BLAME_WAIT_S = 0.5


@dataclass(eq=False)  # compared by identity: two ops may describe the same exchange
class TrackedOp:
    """One in-flight operation.

    Attributes:
        done: callable returning True once the operation completed (e.g. ``event.query``).
        what: the operation, e.g. ``"recv_attn_output: fan-in receive"``.
        peers: labels of the peers involved.
        layer, stage: the exchange (layer ordinal, stage id); ``where`` the full position text.
        started: ``time.monotonic()`` when it was issued.
        on_done: called once the operation is seen complete (e.g. return its event to a pool).
        tag: the exchange's :class:`~afd_ext.transport.base.MessageTag` (op, direction, step,
            layer, stage), or None; used by ``blame``.
        peer_ranks: world ranks of ``peers`` (same order), for ``blame``.
    """

    done: Callable[[], bool]
    what: str
    peers: tuple[str, ...]
    layer: int | None
    stage: int | None
    where: str
    started: float = field(default_factory=time.monotonic)
    on_done: Callable[[], None] | None = None
    tag: Any = None
    peer_ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        peers = ", ".join(self.peers) if self.peers else "no peer"
        return f"{self.what} with {peers} at {self.where}"


class Watchdog:
    """Follows in-flight operations, the transports' own state and the abort signal.

    Args:
        deadline_s: an operation older than this is declared stuck, seconds (> 0).
        owner: label of this rank (for messages).
        on_failure: called once, from the watchdog thread, with the failure
            exception, after ``post``; it should abort the communicators (ending
            stuck kernels). Exceptions it raises are logged. More hooks: :meth:`watch`.
        post: posts the failure as the step abort (``AbortSignal.post``), first: aborting
            releases sends queued behind a stuck one, and a peer that receives one must find the
            abort posted. Run on the store thread, waited for at most ``POST_ABORT_WAIT_S``.
        polls: a transport's polls of its own state, ``poll(watchdog, now) -> exception | None``
            (run every ``poll_interval_s`` on the deadline thread; never wait). More: :meth:`watch`.
        abort_check: callable raising (``AbortSignal.check``) or returning the posted abort's error,
            else returning None; polled every ``abort_poll_s``.
        poll_interval_s: polling period of events and communicators, seconds.
        abort_poll_s: polling period of ``abort_check`` and ``on_tick``, seconds.
        blame: callable ``op -> (text, culprits) | None`` run when ``op``
            expires, for at most :data:`BLAME_WAIT_S`: ``text`` is appended to
            the timeout message (which peer did not send, what it reported),
            ``culprits`` (peer labels) become the error's ``peer``. Exceptions
            it raises are logged and ignored.
        on_tick: callable ``(now, oldest) -> None`` run every ``abort_poll_s``
            with ``time.monotonic()`` and the oldest in-flight
            :class:`TrackedOp` (or None); exceptions are logged and ignored.
        calls: the :class:`CallThread` that runs ``abort_check``, ``on_tick`` and ``blame`` (they may
            wait on the store): the store's own (``AbortSignal.calls``); default one of the watchdog's.

    The thread that checks deadlines never calls the store hooks. It starts
    with :meth:`start` and ends with :meth:`stop`.
    """

    def __init__(
        self,
        deadline_s: float,
        *,
        owner: str = "",
        on_failure: Callable[[BaseException], None] | None = None,
        post: Callable[[BaseException], None] | None = None,
        polls: Iterable[Callable[["Watchdog", float], BaseException | None]] = (),
        abort_check: Callable[[], BaseException | None] | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        abort_poll_s: float = 0.1,
        blame: Callable[[TrackedOp], tuple[str, Iterable[str]] | None] | None = None,
        on_tick: Callable[[float, TrackedOp | None], None] | None = None,
        calls: "CallThread | None" = None,
    ):
        if not deadline_s or deadline_s <= 0:
            raise AFDConfigError(f"deadline_s must be > 0 seconds, got {deadline_s!r}")
        self.deadline_s = float(deadline_s)
        self.owner = owner
        self._on_failure = [] if on_failure is None else [on_failure]
        self._polls = list(polls)
        self._post = post
        self._abort_check = abort_check
        self._poll = float(poll_interval_s)
        self._abort_poll = float(abort_poll_s)
        self._blame = blame
        self._on_tick = on_tick
        self._lock = threading.Lock()
        self._ops: list[TrackedOp] = []
        self._failure: BaseException | None = None
        self._suspended = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._own_calls = calls is None
        self._calls = calls or CallThread(f"afd-watchdog-store {owner}")

    # -- lifecycle -------------------------------------------------------------

    def watch(self, poll: Callable[["Watchdog", float], BaseException | None],
              on_failure: Callable[[BaseException], None]) -> None:
        """Add a transport's poll of its own state and its failure hook (run before the earlier hooks)."""
        self._polls.append(poll)
        self._on_failure.insert(0, on_failure)

    @property
    def posts_abort(self) -> bool:
        """Whether the abort signal is read (a remote error may then wait for the posted root cause)."""
        return self._abort_check is not None

    def start(self) -> None:
        """Start the polling thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"afd-watchdog {self.owner}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and forget tracked operations (idempotent).

        A store round in progress is not waited for: it may be blocked on a
        silent store (its thread is a daemon and ends after the round trip).
        """
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
        if self._own_calls:  # after the join: a round still running would restart a stopped CallThread
            self._calls.stop()
        with self._lock:
            self._ops.clear()

    # -- tracking ----------------------------------------------------------------

    def track(self, done: Callable[[], bool], what: str, *, peers: Iterable[str] = (),
              layer: int | None = None, stage: int | None = None, where: str = "",
              on_done: Callable[[], None] | None = None, tag: Any = None,
              peer_ranks: Iterable[int] = ()) -> TrackedOp:
        """Record an in-flight operation (e.g. ``done=event.query`` of an event recorded after it).

        ``on_done`` is called (from the watchdog thread) once the operation is
        seen complete, e.g. to return its event to a pool. ``tag`` and
        ``peer_ranks`` (world ranks of ``peers``) let ``blame`` find the peer
        that did not make the matching call. Returns the :class:`TrackedOp`.
        """
        op = TrackedOp(done, what, tuple(peers), layer, stage, where, on_done=on_done, tag=tag,
                       peer_ranks=tuple(peer_ranks))
        with self._lock:
            self._ops.append(op)
        return op

    @property
    def in_flight(self) -> list[TrackedOp]:
        """A snapshot of the tracked operations not yet seen complete."""
        with self._lock:
            return list(self._ops)

    @property
    def failure(self) -> BaseException | None:
        """The recorded failure, or None."""
        return self._failure

    def check(self) -> None:
        """Raise the recorded failure, if any (call at the start of every connector call)."""
        f = self._failure
        if f is not None:
            raise f

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` as the failure (first one wins) and run ``on_failure`` once."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
        logger.error("%s: %s", self.owner or "AFD watchdog", exc)
        if self._post is not None:
            try:
                self._calls.submit(lambda: self._post(exc)).result(POST_ABORT_WAIT_S)
            except cf.TimeoutError:
                logger.warning("%s: posting the abort signal takes over %.1f s (store host gone?); aborting "
                               "meanwhile", self.owner, POST_ABORT_WAIT_S)
            except Exception as e:  # noqa: BLE001 - the failure itself is what matters
                logger.warning("%s: posting the abort signal raised: %s", self.owner, e)
        for hook in list(self._on_failure):
            try:
                hook(exc)
            except Exception:  # noqa: BLE001 - the failure itself is what matters
                logger.exception("AFD watchdog on_failure callback raised")

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Pause event polling (around a CUDA-graph capture); deadlines keep running."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    # -- the thread ---------------------------------------------------------------

    def poll_once(self, now: float | None = None) -> None:
        """One polling round (the thread calls it; tests may call it directly)."""
        if self._failure is not None:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            suspended = self._suspended > 0
            ops = list(self._ops)
        if not suspended and ops:
            done = []
            for op in ops:
                try:
                    if op.done():
                        done.append(op)
                except Exception as e:  # noqa: BLE001 - a failed query is a failed op
                    self.fail(AFDPeerError(
                        f"AFD {self.owner}: {op.describe()} failed: {e}",
                        op=op.what, peer=", ".join(op.peers) or None, layer=op.layer, stage=op.stage))
                    return
            with self._lock:
                self._ops = [op for op in self._ops if op not in done]
            for op in done:
                if op.on_done is not None:
                    op.on_done()
            for op in ops:
                age = now - op.started
                if op not in done and age > self.deadline_s:
                    self.fail(self.timeout_error(op, age))
                    return
        for poll in list(self._polls):
            exc = poll(self, now)
            if exc is not None:
                self.fail(exc)
                return

    def timeout_error(self, op: TrackedOp, age: float) -> AFDTimeoutError:
        """The error of an expired ``op`` (in flight ``age`` seconds), with ``blame``'s verdict."""
        extra, culprits = "", ()
        if self._blame is not None:
            verdict = self._bounded_blame(op)
            if verdict:
                extra, culprits = verdict[0], tuple(verdict[1])
        peer = ", ".join(culprits) or ", ".join(op.peers) or None
        return AFDTimeoutError(
            f"AFD {self.owner}: {op.describe()} did not complete within the deadline of "
            f"{self.deadline_s:g} s (in flight {age:.1f} s): the peer is dead, stuck, or not making the "
            f"matching call.{' ' + extra if extra else ''} The communicators were aborted; close and "
            "re-initialise the connector on every rank. Raise step_timeout_s if the peer is only slow.",
            op=op.what, peer=peer, layer=op.layer, stage=op.stage)

    def oldest(self) -> TrackedOp | None:
        """The oldest tracked operation not yet seen complete, or None."""
        with self._lock:
            return min(self._ops, key=lambda o: o.started) if self._ops else None

    def _bounded_blame(self, op: TrackedOp) -> tuple[str, Iterable[str]] | None:
        """``blame(op)``, given at most :data:`BLAME_WAIT_S` (it reads the store, which may be silent)."""
        fut = self._calls.submit(lambda: self._blame(op))
        try:
            return fut.result(BLAME_WAIT_S)
        except cf.TimeoutError:
            return (f"(Which peer did not make its call is unknown: the rendezvous store did not answer "
                    f"within {BLAME_WAIT_S:g} s; FFN rank 0, which hosts it, may be stopped.)", ())
        except Exception:  # noqa: BLE001 - the timeout itself is what matters
            logger.exception("AFD watchdog blame callback raised")
            return None

    def _run(self) -> None:
        # Deadlines and the transports' polls here; the store hooks' rounds on the store's thread.
        hooks = self._abort_check is not None or self._on_tick is not None
        fut: cf.Future | None = None
        next_round = 0.0
        while not self._stop.wait(self._poll):
            try:
                self.poll_once()
                if hooks and self._failure is None:
                    if fut is not None and fut.done():
                        found, fut = fut.result(), None
                        if found is not None:
                            self.fail(found)
                    now = time.monotonic()
                    if fut is None and now >= next_round and self._failure is None:
                        next_round = now + self._abort_poll
                        fut = self._calls.submit(self._store_round)
            except Exception as e:  # noqa: BLE001 - never let the thread die silently
                if self._failure is None:
                    self.fail(AFDTransportError(f"AFD {self.owner}: watchdog check failed: {e}"))
            if self._failure is not None:
                return

    def _store_round(self) -> BaseException | None:
        """The store thread: ``on_tick``, then ``abort_check``'s answer (never raises)."""
        if self._on_tick is not None:
            try:
                self._on_tick(time.monotonic(), self.oldest())
            except Exception:  # noqa: BLE001 - diagnostics only
                logger.exception("AFD watchdog on_tick callback raised")
        if self._abort_check is None:
            return None
        try:
            return self._abort_check()
        except AFDError as e:  # the posted abort's error
            return e
        except Exception as e:  # noqa: BLE001 - an unreadable store is itself a failure
            return AFDTransportError(f"AFD {self.owner}: reading the abort signal failed: {e}")


def host_wait(
    done: Callable[[float], bool],
    *,
    timeout_s: float,
    describe: Callable[[], str],
    abort_check: Callable[[], None] | None = None,
    op: str | None = None,
    peer: str | None = None,
    layer: int | None = None,
    stage: int | None = None,
) -> None:
    """Wait for ``done`` with a deadline, checking the abort signal between slices.

    Args:
        done: ``done(slice_s) -> bool``: wait up to ``slice_s`` seconds (at most 0.05) and say
            whether the awaited thing completed (it may raise the awaited
            operation's own error, which propagates).
        timeout_s: the deadline, seconds.
        describe: returns the text naming the op, peer, layer and stage.
        abort_check: raises when the abort signal is posted (e.g.
            ``rendezvous.raise_if_aborted``); called between slices, at most
            every ~50 ms (the slice).
        op, peer, layer, stage: copied into the timeout error.

    Raises:
        AFDTimeoutError: the deadline passed.
        Whatever ``done`` or ``abort_check`` raise.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if done(max(0.0, min(0.05, left))):
            return
        if abort_check is not None:
            abort_check()
        if time.monotonic() >= deadline:
            raise AFDTimeoutError(
                f"AFD {describe()} did not complete within the deadline of {timeout_s:g} s: the peer is "
                "dead, stuck, or not making the matching call. Close and re-initialise the connector on "
                "every rank; raise step_timeout_s if the peer is only slow.",
                op=op, peer=peer, layer=layer, stage=stage,
            )


class CallThread:
    """A daemon thread that makes blocking calls, so a caller can stop waiting for one.

    A caller submits a call and waits for its future with its own bound; a
    call it gave up on is cancelled unless it already started. A daemon
    thread, unlike ``ThreadPoolExecutor``'s workers, never holds up the
    process's exit behind a call that blocks forever. The thread starts at the
    first :meth:`submit` (again after :meth:`stop`).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self._name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()  # the running thread's own (a new one per thread)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None
        self.keep: Any = None  # what a call still blocked at stop() needs alive; dropped when the thread ends

    def submit(self, fn: Callable[[], Any]) -> cf.Future:
        """Queue ``fn``; its future gets its result or exception."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._thread is None:
                # a fresh queue: a thread stopped while a call blocks still holds the old one, with its stop mark
                self._q = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._q,), name=self._name, daemon=True)
                self._thread.start()
            self._q.put((fut, fn))
        return fut

    def on_thread(self) -> bool:
        """Whether the caller is this thread (a call made from a submitted call must not queue behind itself)."""
        return threading.current_thread() is self._thread

    def stuck_s(self) -> float:
        """How long the call in progress has been running, in seconds (0 when idle)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def stop(self, join_timeout_s: float = 0.0) -> bool:
        """Let the thread end after the calls queued so far; wait up to ``join_timeout_s`` for it.

        Returns:
            Whether the thread has ended (or never started); False while a call still blocks.
        """
        with self._lock:
            t, self._thread = self._thread, None
            if t is not None:
                self._q.put(None)  # after the calls queued so far
        if t is None:
            return True
        if join_timeout_s > 0:
            t.join(join_timeout_s)
        return not t.is_alive()

    def _run(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                self.keep = None
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            self._busy_since = time.monotonic()
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                self._busy_since = None


# Calls that may outlive their caller's bound, on daemon threads (NCCL releases, gloo waits blocked at close):
# (thread, what, seconds process exit waits for it or None for EXIT_WAIT_S), until they end.
_LEFT: list[tuple[threading.Thread, str, Callable[[], float] | None]] = []
_LEFT_LOCK = threading.Lock()
#: How long process exit waits for calls still running on helper threads, seconds.
EXIT_WAIT_S = 15.0


def spawn(fn: Callable[[], Any], what: str, *, keep: bool = True) -> tuple[threading.Thread, dict]:
    """Run ``fn`` on a daemon thread of its own; ``keep``: listed (:func:`still_running`) until it ends.

    The returned ``box`` gets ``"result"`` or ``"error"``.
    """
    box: dict = {}

    def body() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the waiter
            box["error"] = e

    t = threading.Thread(target=body, name=f"afd {what}", daemon=True)
    if keep:
        leave(t, what)
    t.start()
    return t, box


def leave(thread: threading.Thread, what: str, exit_wait_s: Callable[[], float] | None = None) -> None:
    """List ``thread`` (a call its caller stopped waiting for) until it ends; process exit waits for it,
    at most ``exit_wait_s()`` seconds (default :data:`EXIT_WAIT_S`)."""
    with _LEFT_LOCK:
        _LEFT.append((thread, what, exit_wait_s))


def still_running() -> list[tuple[threading.Thread, str]]:
    """The listed calls still running (thread, what); drops the rest."""
    with _LEFT_LOCK:
        _LEFT[:] = [e for e in _LEFT if e[0].is_alive()]
        return [(t, d) for t, d, _ in _LEFT]


def join_all(threads: Iterable[tuple[threading.Thread, str]], deadline: float) -> list[str]:
    """Join every thread until ``deadline`` (monotonic); return the descriptions still running."""
    threads = list(threads)
    for t, _ in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [d for t, d in threads if t.is_alive()]


@atexit.register
def _join_at_exit() -> None:
    """Before the interpreter finalises, wait (bounded) for the listed calls still running.

    A helper returning from its torch op while the interpreter finalises is ended by CPython
    (``pthread_exit`` when it asks for the GIL back, Python 3.11 / 3.12) through torch's noexcept
    GIL guard, or meets c10's CUDA hooks already torn down: either way the process dies with
    SIGABRT (GPU run 35: a stalled peer's ``ncclCommAbort`` outlived the worker's ``return``; a gloo
    wait left blocked aborts in gloo's destructors). Past its bound the process leaves without
    finalising (``os._exit(1)``), the calls named in the log. An abandoned ``ncclCommInitRank``
    (not listed: it returns only if its peer joins late) is not waited for.
    """
    with _LEFT_LOCK:
        left = [e for e in _LEFT if e[0].is_alive()]
    if not left:
        return
    logger.warning("afd_ext: waiting up to %.0f s at exit for calls still running: %s",
                   EXIT_WAIT_S, "; ".join(d for _, d, _ in left))
    t0 = time.monotonic()
    for t, _, wait in left:
        t.join(max(0.0, t0 + (EXIT_WAIT_S if wait is None else max(wait(), 0.1)) - time.monotonic()))
    stuck = [d for t, d, _ in left if t.is_alive()]
    if not stuck:
        return
    logger.error("afd_ext: calls still running %.0f s after exit began: %s. Leaving without finalising "
                 "(exit status 1): their return into a finalising interpreter would abort the process.",
                 time.monotonic() - t0, "; ".join(stuck))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)
