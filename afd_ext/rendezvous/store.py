"""How AFD processes meet: the rendezvous store, unique-id exchange, handshake, abort.

One store per AFD world
-----------------------
FFN rank 0 (AFD world rank 0; the world is ordered FFN first: world rank =
role rank for an FFN rank, ``F + role_rank`` for an attention rank) hosts a
``torch.distributed.TCPStore`` at ``host:port``, exactly where the reference
plugin puts it; every other rank connects to it as a client. The server's
listening socket is bound to ``host`` itself (we create the socket and hand
its descriptor to the store), so nothing binds to loopback when ``host`` is a
routable address, and starting FFN rank 0 on a machine that does not own
``host`` is an immediate, explicit error instead of a silent hang elsewhere.

Generations
-----------
All keys of one meeting of the ranks live under ``<namespace>/g<generation>/``.
The store holds the current generation (key ``gen``, 1 when FFN rank 0 opened
it); :func:`connect` joins it unless it is over for the joining rank: its
handshake is done (every rank read every fingerprint), or an abort was posted
in it after this rank (any process of this world rank, ``join/<world rank>``)
had joined it; then it opens the next one (one ``compare_set``: every rank that
finds ``g`` over moves to ``g + 1``, never further). A rank arriving late in a
generation aborted before it joined (a refused duplicate or mismatched rank)
still reads that abort. So the ranks meet however often each re-initialises:
after a step abort every rank closes and re-initialises into the next, empty
key space; a restarted process of any role rank joins the generation its
surviving peers re-initialise into; a rank whose init timed out and is
retried joins the same, still open generation as before. Stale keys (unique ids, abort
flags, shared-memory names) of an earlier generation are never read again.

The TCPStore server lives in FFN rank 0 and is cached per process with its
clients, so it outlives a connector closed and re-initialised. A restarted FFN
rank 0 opens a new, empty store (generation 1 again, and a new random
``instance`` id in the job record, part of :attr:`AFDStore.generation_key`);
the survivors' cached clients find their connection lost at their next
:func:`connect`, reconnect and join it.

Waits
-----
Every wait here polls the store with a short back-off, has a deadline
(default :data:`DEFAULT_RENDEZVOUS_TIMEOUT_S`, generous because the two roles
reach the rendezvous before and after loading their weights respectively)
and, while waiting, looks at the generation's abort key: a rank that fails
mid-step posts the abort signal (:mod:`afd_ext.health.abort`), and every rank
blocked in a wait of this module raises :class:`StepAbortedError` naming who
aborted and why. A timeout is a :class:`RendezvousTimeoutError`
naming the ranks that did not arrive and what was awaited. No wait is silent:
:class:`WaitReport` logs one line when it starts and one every
:func:`wait_log_interval_s`, naming the ranks awaited, what and the time left.

A frozen store host
-------------------
A ``TCPStore`` client has no timeout against a server that is alive but
silent (FFN rank 0 stopped by SIGSTOP or a debugger, a partition): its round
trip blocks until the server answers. So no caller makes a round trip
itself: each rank's client has one thread that makes them (``_StoreRunner``)
and the caller waits for the answer with its own bound, the time left to its
deadline, and gets a :class:`StoreTimeoutError` past it. The abort signal
is read the same way but never raises for silence (:mod:`afd_ext.health.abort`).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..errors import AFDClosedError, AFDConfigError, AFDError, DuplicateRankError, HandshakeMismatchError, PeerClosedError
from ..errors import RendezvousError, RendezvousTimeoutError, StepAbortedError, StoreTimeoutError, StoreUnavailableError
from ..topology import rank_label
from ..health.abort import AbortSignal
from ..health.links import error_text
from ..health.process import start_time
from ..health.watchdog import CallThread

logger = logging.getLogger("afd_ext.rendezvous")  # the name users configure (docs/troubleshooting.md)

#: Default deadline, in seconds, for connecting to the store and for every
#: rendezvous wait. Generous because the attention side typically reaches the
#: rendezvous before loading weights and the FFN side after.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0

#: Longest sleep between two polls of the store while waiting, in seconds.
_MAX_POLL_S = 0.05
#: Shortest bound of one store round trip inside a wait (its last poll), in seconds.
_MIN_ROUND_TRIP_S = 0.5


def _left(deadline: float, floor: float = _MIN_ROUND_TRIP_S) -> float:
    """Seconds to ``deadline`` (``time.monotonic()``), at least ``floor``: the bound of one store round trip
    inside a wait (its last poll still gets a fair chance)."""
    return max(deadline - time.monotonic(), floor)


def wait_log_interval_s(timeout_s: float) -> float:
    """Seconds between two log lines of a rendezvous wait with deadline ``timeout_s``: a tenth of it,
    within 1..30 s (30 s at the default 600 s; 1 s for a test's short deadline)."""
    return min(30.0, max(1.0, float(timeout_s) / 10.0))


class WaitReport:
    """The log lines of one wait: the first when it starts (INFO), then one every
    :func:`wait_log_interval_s` (WARNING), each naming who is missing, what is awaited and the time left.

    Args:
        me: the waiting rank's label; what: what it waits for; deadline: ``time.monotonic()`` deadline.
    """

    def __init__(self, me: str, what: str, deadline: float):
        self.me = me
        self.what = what
        self.deadline = deadline
        self.t0 = time.monotonic()
        self.interval = wait_log_interval_s(deadline - self.t0)
        self._next = self.t0
        self.lines = 0

    def due(self) -> bool:
        """Whether a line is due now (the first call is: the wait just started)."""
        return time.monotonic() >= self._next

    def log(self, missing: str) -> None:
        """Log one line naming ``missing`` (the ranks or process awaited)."""
        now = time.monotonic()
        left = max(0.0, self.deadline - now)
        if self.lines == 0:
            logger.info("%s waits for %s from %s; gives up in %.0f s", self.me, self.what, missing, left)
        else:
            logger.warning("%s still waits for %s from %s after %.0f s; gives up in %.0f s (a slow model load "
                           "there is normal: raise init_timeout_s if it needs longer; a crashed or never started "
                           "process is not)", self.me, self.what, missing, now - self.t0, left)
        self.lines += 1
        self._next = now + self.interval

    def done(self) -> None:
        """The wait ended well: say so if it was reported as long (WARNING lines were logged)."""
        if self.lines > 1:
            logger.info("%s: %s arrived after %.0f s", self.me, self.what, time.monotonic() - self.t0)


def host_identity() -> str:
    """A string equal for two processes that share a kernel and mount, pid and network namespaces.

    Made of the host name, the kernel boot id and the inode numbers of this
    process's mount, pid and network namespaces: two processes with the same
    identity see the same ``/dev/shm``, each other's process ids and abstract
    UNIX sockets, which is what the shared-memory control channel needs.
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("no-boot-id")
    for ns in ("mnt", "pid", "net"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append(f"no-{ns}-ns")
    return "/".join(parts)


class _StoreRunner(CallThread):
    """The thread that makes one store client's round trips (``stuck_s``: how long the server has not answered)."""

    def __init__(self, name: str):
        super().__init__(name)
        #: the error that lost the connection (a TCPStore client never reconnects); later
        #: calls raise without a round trip (each failed one logs a C++ stack trace).
        self.lost: StoreUnavailableError | None = None


@dataclass
class AFDStore:
    """The store of one AFD world generation, plus who this rank is in it.

    Attributes:
        store: ``torch.distributed.PrefixStore`` scoped to this generation; hand
            it to ``torch.distributed`` process groups (e.g. a gloo transport)
            so they need no second port.
        base: the underlying ``TCPStore`` (shared by every generation).
        host, port: the rendezvous address (FFN rank 0's).
        world_rank, world_size: this rank and the AFD world size ``F + A``.
        num_ffn_ranks: ``F`` when known (used to name ranks in errors).
        generation: the generation joined (module doc), 1 on a new store.
        namespace: key namespace (one AFD instance).
        instance: the store's random id (FFN rank 0's record; new when FFN rank 0 restarted).
        stop: an event that ends every wait on this store (the connector's close() on another thread).
        timeout_s: default deadline of waits on this store, in seconds, and
            the default bound of one round trip.
    """

    store: Any
    base: Any
    host: str
    port: int
    world_rank: int
    world_size: int
    num_ffn_ranks: int | None
    generation: int
    namespace: str
    timeout_s: float
    _runner: _StoreRunner = field(repr=False)
    instance: str = ""
    stop: threading.Event | None = field(default=None, repr=False)
    _barrier_seq: dict[str, int] = field(default_factory=dict, repr=False)
    _abort: AbortSignal | None = field(default=None, repr=False)

    def label(self, world_rank: int | None = None) -> str:
        """Name of ``world_rank`` (default: this rank), e.g. ``"FFN rank 0 (world rank 0)"``."""
        if world_rank is not None and world_rank < 0:
            return "the creating rank"
        return rank_label(self.world_rank if world_rank is None else world_rank, self.num_ffn_ranks)

    @property
    def abort_signal(self) -> AbortSignal:
        """This generation's :class:`AbortSignal` (one per store: its read state is shared)."""
        if self._abort is None:
            self._abort = AbortSignal(self, _abort_error)
        return self._abort

    def call(self, fn: Callable[[], Any], what: str, timeout_s: float | None = None, *,
             cancel: bool = True) -> Any:
        """Run ``fn`` (store round trips) on this rank's store thread; wait at most ``timeout_s``.

        Args:
            fn: the round trips, e.g. ``lambda: store.store.check(keys)``.
            what: what it does, for errors (``"reading 'uid/a2f/0/0'"``).
            timeout_s: bound in seconds (None: :attr:`timeout_s`).
            cancel: drop ``fn`` if it has not started by then (else it still runs later).

        Raises:
            StoreTimeoutError: no answer within the bound (FFN rank 0 stopped, frozen, unreachable).
            StoreUnavailableError: the connection to the store was lost.
        """
        runner = self._runner
        if runner.lost is not None:
            raise self.lost_error(what, runner.lost)
        try:
            if runner.on_thread():
                return fn()
            bound = self.timeout_s if timeout_s is None else max(0.0, float(timeout_s))
            fut = runner.submit(fn)
            try:
                return fut.result(bound)
            except cf.TimeoutError:
                if cancel:
                    fut.cancel()
                raise self.silent_error(what, bound) from None
        except StoreTimeoutError:
            raise
        except RuntimeError as e:
            # A lost connection (a TCPStore client never reconnects): every later call fails at once. The
            # kept error is never raised: a raised one's traceback would keep the frames of the waits it
            # crossed alive, and with them the transfers of a dead generation (see Session.close).
            if isinstance(e, StoreUnavailableError):
                runner.lost = self.lost_error(what, e)
            elif type(e).__name__ in ("DistNetworkError", "DistStoreError", "DistError"):
                runner.lost = self.lost_error(what, RuntimeError(error_text(e)))
                raise self.lost_error(what, runner.lost) from None
            raise

    def lost_error(self, what: str, cause: BaseException) -> StoreUnavailableError:
        """The error of a round trip on a connection already lost (``cause``)."""
        detail = str(cause).rsplit("(", 1)[-1].rstrip(")") if "(" in str(cause) else str(cause)
        return StoreUnavailableError(
            f"{self.label()} lost the AFD rendezvous store at {self.host}:{self.port} while {what}: FFN rank 0 "
            f"(world rank 0), which hosts it, has exited or is unreachable ({detail})")

    def silent_error(self, what: str, waited_s: float) -> StoreTimeoutError:
        """The error of a round trip the store did not answer within ``waited_s`` seconds."""
        return StoreTimeoutError(
            f"{self.label()} got no answer from the AFD rendezvous store at {self.host}:{self.port} within "
            f"{waited_s:.1f} s while {what}: FFN rank 0 (world rank 0), which hosts it, is stopped or frozen "
            "(SIGSTOP, a debugger, an overloaded host) or the network to it is down. Check that process and "
            "its host; every rank must then close and re-initialise the connector.",
            missing=(0,), what=what)

    # Store operations, bounded, that turn a lost connection into StoreUnavailableError.
    def set(self, key: str, value: bytes | str, timeout_s: float | None = None) -> None:
        """``store.set`` in this generation's key space."""
        self.call(lambda: self.store.set(key, value), f"setting {key!r}", timeout_s)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """``store.get`` (blocks up to the store timeout if the key is missing; check first)."""
        return bytes(self.call(lambda: self.store.get(key), f"reading {key!r}", timeout_s))

    def check(self, keys: list[str], timeout_s: float | None = None) -> bool:
        """Whether every key exists (non-blocking; one store round trip)."""
        what = f"checking {keys[0]!r}" if keys else "checking keys"
        return bool(self.call(lambda: self.store.check(keys), what, timeout_s))

    @property
    def generation_key(self) -> str:
        """A string unique to this store instance and generation (for naming OS resources)."""
        return f"{self.namespace}-{self.port}-{self.instance}-g{self.generation}"


# TCPStore clients (with their round-trip thread) cached per process: the server
# lives in FFN rank 0 and must outlive a connector closed and re-initialised after an abort.
_STORES: dict[tuple, tuple[Any, _StoreRunner]] = {}
_STORES_LOCK = threading.Lock()


def forget_cached_stores() -> None:
    """Drop this process's cached TCPStore objects (tests; a server goes away with its object)."""
    with _STORES_LOCK:
        for _, runner in _STORES.values():
            runner.stop()
        _STORES.clear()


def _timedelta(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(timeout_s))


def process_group_error(exc: BaseException, *, me: str, label: Callable[[int], str], world_size: int,
                        timeout_s: float, what: str = "the gloo process group") -> Exception:
    """The named error for a ``torch.distributed`` process group that could not be built.

    Args:
        exc: what torch raised (``DistStoreError``, ``DistNetworkError``, ...).
        me: this rank's label; label: world rank -> label.
        world_size: ``F + A``; timeout_s: the build deadline, seconds.
        what: the group, for the message.

    Returns:
        :class:`RendezvousTimeoutError` naming the ranks whose addresses never
        arrived, or :class:`StoreUnavailableError`/:class:`RendezvousError`.
    """
    import re

    text = error_text(exc)
    name = type(exc).__name__
    if name == "DistStoreError" or "timeout" in text.lower() or "timed out" in text.lower():
        missing = sorted({int(r) for r in re.findall(r"gloo/+\d+/(\d+)", str(exc)) if int(r) < world_size})
        who = ", ".join(label(r) for r in missing) or "a rank"
        return RendezvousTimeoutError(
            f"{me} could not build {what} within {timeout_s:g} s: {who} did not join ({text}). Check that "
            "rank's log (it crashed, hangs, or loads its model slowly: raise init_timeout_s); every rank "
            "must initialise the connector.", missing=missing, what=what)
    if name == "DistNetworkError":
        return StoreUnavailableError(
            f"{me} could not build {what}: the network failed ({text}). FFN rank 0, which hosts the "
            "rendezvous store, may have exited, or a rank cannot reach another's address (set "
            "GLOO_SOCKET_IFNAME to an interface every rank can reach).")
    return RendezvousError(f"{me} could not build {what}: {text}")


def _listen_socket(host: str, port: int) -> int:
    """Bind a listening TCP socket to ``host:port`` and return its (detached) descriptor."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousError(
            f"cannot resolve AFD rendezvous host {host!r}: {e}; set host to an address of "
            "the machine that runs FFN rank 0"
        ) from None
    last: OSError | None = None
    for family, stype, proto, _, addr in infos:
        s = socket.socket(family, stype, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(1024)
        except OSError as e:
            s.close()
            last = e
            continue
        return s.detach()
    assert last is not None
    if last.errno == 99:  # EADDRNOTAVAIL
        hint = (f"{host!r} is not an address of this machine ({socket.gethostname()}); FFN rank 0 "
                "hosts the rendezvous store, so host must be FFN rank 0's address")
    elif last.errno == 98:  # EADDRINUSE
        hint = (f"port {port} is already in use on {host!r}; pick another port (another AFD "
                "job or a stale process may hold it)")
    else:
        hint = str(last)
    err = RendezvousError(f"FFN rank 0 cannot bind the AFD rendezvous store to {host}:{port}: {hint}")
    err.port_in_use = last.errno == 98  # connect() looks whether FFN rank 0 was started twice
    raise err


def _open_tcp_store(host: str, port: int, world_rank: int, timeout_s: float, deadline: float, me: str = "",
                    stop: threading.Event | None = None):
    import torch.distributed as dist

    if world_rank == 0:
        fd = _listen_socket(host, port)
        try:
            try:
                return dist.TCPStore(host, port, None, True, _timedelta(timeout_s),
                                     wait_for_workers=False, master_listen_fd=fd, use_libuv=True)
            except (RuntimeError, ValueError) as e:
                # Older libuv backends refuse an inherited listening socket; the classic one takes it.
                logger.debug("TCPStore(libuv) refused master_listen_fd (%s); using the classic backend", e)
                return dist.TCPStore(host, port, None, True, _timedelta(timeout_s),
                                     wait_for_workers=False, master_listen_fd=fd, use_libuv=False)
        except Exception:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    where = (f"world rank {world_rank} could not reach the AFD rendezvous store at {host}:{port} "
             f"(hosted by FFN rank 0 = world rank 0) within {timeout_s:g} s")
    # Our own connect loop: the store client's retries log C++ stack traces and overrun its
    # timeout by a whole extra attempt.
    report = WaitReport(me or f"world rank {world_rank}", f"the AFD rendezvous store at {host}:{port}",
                        deadline)
    last = _wait_listening(host, port, deadline, report, stop)
    if last is not None:
        raise RendezvousTimeoutError(
            f"{where}: {str(last).rstrip('.')}. Check that FFN rank 0 is running, that host/port are the same on every "
            "rank and that the port is reachable from this machine.",
            missing=(0,), what="rendezvous store") from None
    # The client's constructor has no timeout against a listener that never answers
    # (another program on the port, a stopped FFN rank 0): build it on a thread.
    builder = CallThread(f"afd-store-connect {host}:{port}")
    fut = builder.submit(lambda: dist.TCPStore(host, port, None, False, _timedelta(timeout_s),
                                                wait_for_workers=False))
    builder.stop()
    try:
        return fut.result(_left(deadline))
    except cf.TimeoutError:
        raise RendezvousTimeoutError(
            f"{where}: a process accepts connections on that port but does not answer as an AFD rendezvous "
            "store. Another program holds the port (choose another port on every rank), or FFN rank 0's "
            "process is stopped or frozen.",
            missing=(0,), what="rendezvous store") from None
    except Exception as e:  # noqa: BLE001 - any failure to build the client is named here
        raise RendezvousTimeoutError(
            f"{where}: {error_text(e)}. Check that FFN rank 0 is running and that host/port are "
            "the same on every rank.", missing=(0,), what="rendezvous store") from None


def _wait_listening(host: str, port: int, deadline: float, report: WaitReport,
                    stop: threading.Event | None = None) -> str | None:
    """Connect to ``host:port`` until something accepts or ``deadline`` passes; None or the last error.

    ``report`` logs the wait (FFN rank 0 not listening yet: it may still be loading its model, or restarting).
    ``stop`` set: raise :class:`AFDClosedError` (the connector's close() on another thread).
    """
    sleep = 0.01
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(left, 2.0))):
                report.done()
                return None
        except OSError as e:
            err = e.strerror or str(e)
        left = deadline - time.monotonic()
        if left <= 0:
            return err
        if stop is not None and stop.is_set():
            raise AFDClosedError(f"{report.me} stopped waiting for {report.what}: its connector was closed")
        if report.due():
            report.log(f"FFN rank 0 (world rank 0), which hosts it ({err})")
        time.sleep(min(sleep, left))
        sleep = min(2 * sleep, 0.25)


_TOKEN: dict[str, Any] = {}
_TOKEN_LOCK = threading.Lock()


def _process_token() -> dict[str, Any]:
    """Who this process is, for claims on a world rank: host identity, pid, start time, a nonce."""
    with _TOKEN_LOCK:  # ranks run as threads of one process (tests): one nonce, never two
        if not _TOKEN:
            _TOKEN.update(host=host_identity(), name=socket.gethostname(), pid=os.getpid(),
                          start=start_time(os.getpid()), nonce=uuid.uuid4().hex)
    return _TOKEN


def _generation_hint(store: AFDStore, missing: Iterable[int]) -> str:
    """Explain missing ranks that last joined another generation of this store, or ``""``.

    Ranks of one job meet in the store's current generation (module doc), so a
    missing rank seen at an older one stopped or crashed since, and one at a
    newer one sits in a job or a stale process that shares ``host:port``.
    """
    import torch.distributed as dist

    try:
        root = dist.PrefixStore(f"{store.namespace}/", store.base)
        notes = []
        for r in missing:
            g = int(store.call(lambda r=r: root.add(f"join/{r}", 0), "reading generations", _MIN_ROUND_TRIP_S))
            if g and g != store.generation:  # 0: never joined this store (not started, or crashed before)
                notes.append(f"{store.label(r)} last joined generation {g}")
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if not notes:
        return ""
    return (f" ({'; '.join(notes)}; this rank is at {store.generation} of the store at {store.host}:{store.port}). "
            "A rank at an older generation stopped or crashed after it: restart it. A second job, or a stale "
            "process of an earlier run, may be using that port: give each job its own port, or its own job id "
            "(connector_extra_config.job_id or AFD_JOB_ID; then a rank of another job is refused at once).")


def _abort_error(store: AFDStore, found: tuple[str, str], op: str, missing: Iterable[int] = ()) -> AFDError:
    """The error of a posted abort: :class:`DuplicateRankError` for a role rank started twice,
    :class:`PeerClosedError` for an orderly close, else :class:`StepAbortedError`. ``missing``: world
    ranks not arrived yet (named with a duplicate)."""
    rec = store.abort_signal.record
    if rec.get("kind") != "duplicate":
        return (PeerClosedError if rec.get("kind") == "closed" else StepAbortedError)(found[0], found[1], op=op)
    wr = int(rec.get("world_rank", -1))
    holder, claimant = str(rec.get("holder")), str(rec.get("claimant"))
    if rec.get("holder_nonce") == _process_token()["nonce"]:
        holder = f"this process, {holder},"
    absent = [r for r in missing if r != wr]
    hint = (f" {', '.join(store.label(r) for r in absent)} did not arrive: probably the process meant to be "
            f"{'that rank' if len(absent) == 1 else 'one of them'} was started as {store.label(wr)}.") if absent else ""
    return DuplicateRankError(
        f"{store.label()} stopped {op or 'waiting'}: {store.label(wr)} was started twice on the AFD rendezvous "
        f"store at {store.host}:{store.port}: {holder} holds it, {claimant} was refused.{hint} Give every "
        "process its own role rank and restart the job (every rank of it fails now instead of waiting out "
        "init_timeout_s).", world_rank=wr, holder=str(rec.get("holder")))


def wait_for_keys(
    store: AFDStore,
    keys: Mapping[str, int],
    timeout_s: float | None,
    what: str,
) -> None:
    """Wait until every key exists, with a deadline and abort detection.

    The deadline holds whatever the store does: a store that stops answering
    (FFN rank 0 frozen) is a :class:`StoreTimeoutError` at the deadline.

    Args:
        store: the generation's store.
        keys: key -> world rank expected to set it (named in the error).
        timeout_s: deadline in seconds (None: the store's default).
        what: what is awaited, for the error message.

    Raises:
        RendezvousTimeoutError: naming the ranks whose keys are missing and ``what``.
        StoreTimeoutError: the store did not answer before the deadline.
        StepAbortedError: an abort was posted while waiting.
    """
    timeout = store.timeout_s if timeout_s is None else float(timeout_s)
    deadline = time.monotonic() + timeout
    pending = dict(keys)
    report = WaitReport(store.label(), what, deadline)
    missing = lambda: sorted({r for k, r in pending.items()  # noqa: E731
                              if not store.check([k], timeout_s=_MIN_ROUND_TRIP_S)})
    sleep = 0.001
    while True:
        # One store round trip per poll (every rank polls FFN rank 0's store);
        # which keys are missing is worked out only for the reports and the error.
        if not pending or store.check(list(pending), timeout_s=_left(deadline)):
            report.done()
            return
        if store.stop is not None and store.stop.is_set():
            raise AFDClosedError(f"{store.label()} stopped waiting for {what}: its connector was closed "
                                 "(close() on this rank)")
        found = store.abort_signal.read()
        if found is not None:
            op = f"waiting for {what}"
            dup = store.abort_signal.record.get("kind") == "duplicate"
            raise _abort_error(store, found, op, missing() if dup else ())
        if time.monotonic() >= deadline:
            absent = missing()
            if not absent:
                return
            names = ", ".join(store.label(r) for r in absent)
            hint = _generation_hint(store, absent)
            raise RendezvousTimeoutError(
                f"{store.label()} timed out after {timeout:.0f} s waiting for {what} from {names}"
                + (hint or ". Those ranks did not arrive: check that they are running, use the same "
                   "host/port/num_attention_ranks/num_ffn_ranks, and raise the rendezvous timeout if their "
                   "model load is slower."),
                missing=absent, what=what,
            )
        if report.due():
            report.log(", ".join(store.label(r) for r in missing()) or "no rank any more")
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_POLL_S)


def exchange_unique_id(
    store: AFDStore,
    key: str,
    is_creator: bool,
    make_id: Callable[[], bytes],
    timeout_s: float | None = None,
    *,
    creator_rank: int | None = None,
) -> bytes:
    """Share an opaque id (e.g. a 128-byte NCCL unique id) through the store.

    The creator (for a communicator of edge ``(a, f)`` and one direction, the
    FFN end) calls ``make_id()`` and publishes the bytes under ``uid/<key>``;
    every other participant waits for them.

    Args:
        store: the generation's store.
        key: unique per communicator, e.g. ``"a2f/0/1"``.
        is_creator: whether this rank makes the id.
        make_id: called once on the creator, returns non-empty ``bytes``.
        timeout_s: deadline in seconds (None: the store's default).
        creator_rank: world rank of the creator, to name it in a timeout.

    Returns:
        The id bytes (identical on every participant).

    Raises:
        TypeError / AFDConfigError: ``make_id`` returned no bytes (not bytes / empty).
        RendezvousTimeoutError: the creator did not publish within the deadline.
        StepAbortedError: an abort was posted while waiting.
    """
    full = f"uid/{key}"
    if is_creator:
        uid = make_id()
        if not isinstance(uid, bytes):
            raise TypeError(f"make_id must return bytes, got {type(uid).__name__}")
        if not uid:
            raise AFDConfigError(f"make_id returned an empty id for {key!r}")
        store.set(full, uid)
        return uid
    who = -1 if creator_rank is None else creator_rank
    wait_for_keys(store, {full: who}, timeout_s, f"unique id {key!r}")
    return bytes(store.get(full, timeout_s=_MIN_ROUND_TRIP_S))


def _field_order(names: Iterable[str]) -> list[str]:
    # The format version first: a version mismatch explains every other difference.
    return sorted(names, key=lambda n: (n != "format_version", n))


def handshake(
    store: AFDStore,
    world_rank: int,
    world_size: int,
    fields: Mapping[str, Any],
    timeout_s: float | None = None,
) -> dict[int, dict[str, Any]]:
    """Publish this rank's fingerprint and check every peer's against it.

    Every rank calls it (collective; it doubles as a barrier). Typical fields:
    ``format_version``, ``num_attention_ranks``, ``num_ffn_ranks``,
    ``hidden_size``, wire dtypes, which optional tensors travel, maximum
    stages. Values must be JSON-serialisable (other objects are compared by
    ``str``).

    Args:
        store: the generation's store.
        world_rank: this rank (must equal ``store.world_rank``).
        world_size: ``F + A`` (must equal ``store.world_size``).
        fields: name -> value; every rank must publish equal values.
        timeout_s: deadline in seconds (None: the store's default).

    Returns:
        world rank -> that rank's fields (as decoded from JSON).

    Raises:
        AFDConfigError: ``world_rank``/``world_size`` are not the ones ``store`` was joined with.
        HandshakeMismatchError (a ValueError): the first differing field, naming the
            field, both values and both ranks (a field missing on one side counts).
        RendezvousTimeoutError: ranks that did not arrive.
        StepAbortedError: an abort was posted while waiting.
    """
    if world_rank != store.world_rank or world_size != store.world_size:
        raise AFDConfigError(
            f"handshake called as world rank {world_rank}/{world_size} on a store joined as "
            f"{store.world_rank}/{store.world_size}"
        )
    mine = json.loads(json.dumps(dict(fields), default=str, sort_keys=True))
    deadline = time.monotonic() + (store.timeout_s if timeout_s is None else float(timeout_s))
    store.set(f"handshake/{world_rank}", json.dumps(mine, sort_keys=True).encode("utf-8"), timeout_s=_left(deadline))
    wait_for_keys(store, {f"handshake/{r}": r for r in range(world_size)}, _left(deadline), "the AFD handshake")
    everyone: dict[int, dict[str, Any]] = {}
    for r in range(world_size):
        everyone[r] = json.loads(store.get(f"handshake/{r}", timeout_s=_left(deadline)).decode("utf-8"))
    # Everyone has read every fingerprint before anyone may raise and exit: FFN rank 0
    # hosts the store, and its exit would turn the peers' mismatch error into a lost store.
    barrier(store, world_rank, world_size, "handshake-read", timeout_s)
    missing = object()
    for r in range(world_size):
        if r == world_rank:
            continue
        theirs = everyone[r]
        for name in _field_order(set(mine) | set(theirs)):
            a, b = mine.get(name, missing), theirs.get(name, missing)
            if a != b:
                sa = "<missing>" if a is missing else repr(a)
                sb = "<missing>" if b is missing else repr(b)
                raise HandshakeMismatchError(
                    f"AFD handshake mismatch in field {name!r}: {store.label()} has {sa}, "
                    f"{store.label(r)} has {sb}. Every attention and FFN rank must be started "
                    "with the same AFD configuration (and the same afd_ext version).",
                    field=name, local_value=None if a is missing else a,
                    peer_value=None if b is missing else b, local_rank=world_rank, peer_rank=r,
                )
    return everyone


def barrier(
    store: AFDStore,
    world_rank: int,
    world_size: int,
    name: str,
    timeout_s: float | None = None,
    *,
    ranks: Iterable[int] | None = None,
) -> None:
    """Wait until every rank (or every rank in ``ranks``) reached the barrier ``name``.

    The same ``name`` may be used again; calls are matched by their order.
    World rank 0 (the store's host) returns only after every other member has
    left the barrier, so any rank may exit right after it.

    Args:
        store: the generation's store.
        world_rank: this rank; world_size: ``F + A``.
        name: barrier name, for keys and errors.
        timeout_s: deadline in seconds (None: the store's default).
        ranks: the participating world ranks (default all); must include ``world_rank``.

    Raises:
        AFDConfigError: ``world_rank`` is not among ``ranks``.
        RendezvousTimeoutError: naming the ranks that did not arrive.
        StepAbortedError: an abort was posted while waiting.
    """
    members = sorted(set(range(world_size) if ranks is None else ranks))
    if world_rank not in members:
        raise AFDConfigError(f"world rank {world_rank} is not among the barrier's ranks {members}")
    seq = store._barrier_seq.get(name, 0)
    store._barrier_seq[name] = seq + 1
    key = f"barrier/{name}/{seq}"
    store.set(f"{key}/{world_rank}", b"1", timeout_s=timeout_s)
    wait_for_keys(store, {f"{key}/{r}": r for r in members}, timeout_s, f"barrier {name!r}")
    # World rank 0 hosts the store and leaves last, so a rank that returns from a
    # barrier and exits never takes the store away from a peer still polling it.
    if world_rank != 0:
        store.set(f"{key}/left/{world_rank}", b"1", timeout_s=timeout_s)
    elif len(members) > 1:
        wait_for_keys(store, {f"{key}/left/{r}": r for r in members if r != 0}, timeout_s,
                      f"barrier {name!r} (peers leaving)")
