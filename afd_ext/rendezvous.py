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
All keys live under ``<namespace>/g<generation>/``. The generation is the
number of times this rank has joined this store (``<namespace>/join/<world
rank>`` is incremented on every :func:`connect`), so after a step abort every
rank that closes and re-initialises its connector lands in the next, empty
key space without any coordination; stale keys (unique ids, abort flags,
shared-memory names) of an earlier generation are never read again. The
TCPStore itself is cached per process and reused across generations, because
the server lives in FFN rank 0 and its clients must outlive one connector.

Waits
-----
Every wait here polls the store with a short back-off, has a deadline
(default :data:`DEFAULT_RENDEZVOUS_TIMEOUT_S`, generous because the two roles
reach the rendezvous before and after loading their weights respectively)
and, while waiting, looks at the generation's abort key: a rank that fails
mid-step calls :func:`post_abort`, and every rank blocked in a wait of this
module, or polling :func:`check_abort`, raises :class:`StepAbortedError`
naming who aborted and why. A timeout is a :class:`RendezvousTimeoutError`
naming the ranks that did not arrive and what was awaited.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

logger = logging.getLogger(__name__)

#: Default deadline, in seconds, for connecting to the store and for every
#: rendezvous wait. Generous because the attention side typically reaches the
#: rendezvous before loading weights and the FFN side after.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0

#: Longest sleep between two polls of the store while waiting, in seconds.
_MAX_POLL_S = 0.05

__all__ = [
    "DEFAULT_RENDEZVOUS_TIMEOUT_S",
    "AFDStore",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StoreUnavailableError",
    "HandshakeMismatchError",
    "StepAbortedError",
    "rank_label",
    "connect",
    "exchange_unique_id",
    "handshake",
    "barrier",
    "post_abort",
    "check_abort",
    "raise_if_aborted",
    "wait_for_keys",
    "host_identity",
    "forget_cached_stores",
]


from .errors import (  # noqa: E402  defined once, in errors.py
    HandshakeMismatchError,
    RendezvousError,
    RendezvousTimeoutError,
    StepAbortedError,
    StoreUnavailableError,
)


def rank_label(world_rank: int, num_ffn_ranks: int | None = None) -> str:
    """Human-readable name of an AFD world rank, e.g. ``"attention rank 1 (world rank 3)"``.

    Args:
        world_rank: rank in the AFD world (FFN ranks first).
        num_ffn_ranks: ``F``; when unknown only the world rank is named.
    """
    if num_ffn_ranks is None:
        return f"world rank {world_rank}"
    if world_rank < num_ffn_ranks:
        return f"FFN rank {world_rank} (world rank {world_rank})"
    return f"attention rank {world_rank - num_ffn_ranks} (world rank {world_rank})"


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
        generation: 1 for the first :func:`connect` of this rank, then 2, ...
        namespace: key namespace (one AFD instance).
        timeout_s: default deadline of waits on this store, in seconds.
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
    _barrier_seq: dict[str, int] = field(default_factory=dict, repr=False)

    def label(self, world_rank: int | None = None) -> str:
        """Name of ``world_rank`` (default: this rank), e.g. ``"FFN rank 0 (world rank 0)"``."""
        if world_rank is not None and world_rank < 0:
            return "the creating rank"
        return rank_label(self.world_rank if world_rank is None else world_rank, self.num_ffn_ranks)

    # Store operations that turn a lost connection into StoreUnavailableError.
    def set(self, key: str, value: bytes | str) -> None:
        """``store.set`` in this generation's key space."""
        with _guard(self, f"setting {key!r}"):
            self.store.set(key, value)

    def get(self, key: str) -> bytes:
        """``store.get`` (blocks up to the store timeout if the key is missing; check first)."""
        with _guard(self, f"reading {key!r}"):
            return bytes(self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (non-blocking; one store round trip)."""
        with _guard(self, f"checking {keys[0]!r}" if keys else "checking keys"):
            return bool(self.store.check(keys))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """``store.compare_set``: set ``key`` to ``desired`` if it equals ``expected`` (``""``: absent)."""
        with _guard(self, f"updating {key!r}"):
            return bytes(self.store.compare_set(key, expected, desired))

    @property
    def generation_key(self) -> str:
        """A string unique to this store instance and generation (for naming OS resources)."""
        return f"{self.namespace}-{self.port}-g{self.generation}"


# TCPStore objects cached per process: the server lives in FFN rank 0 and must
# outlive a connector that is closed and re-initialised after an abort.
_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()


def forget_cached_stores() -> None:
    """Drop this process's cached TCPStore objects (tests; a server goes away with its object)."""
    with _STORES_LOCK:
        _STORES.clear()


def _timedelta(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(timeout_s))


class _guard:
    """Turn a lost store connection into :class:`StoreUnavailableError` naming FFN rank 0."""

    def __init__(self, store: "AFDStore", what: str):
        self.store = store
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if ev is None or not isinstance(ev, RuntimeError) or isinstance(ev, (StepAbortedError, RendezvousError)):
            return False
        name = type(ev).__name__
        if name in ("DistNetworkError", "DistStoreError", "DistError"):
            raise StoreUnavailableError(
                f"{self.store.label()} lost the AFD rendezvous store at {self.store.host}:"
                f"{self.store.port} while {self.what}: FFN rank 0 (world rank 0), which hosts it, "
                f"has exited or is unreachable ({str(ev).splitlines()[0] if str(ev) else name})"
            ) from None
        return False


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
    raise RendezvousError(f"FFN rank 0 cannot bind the AFD rendezvous store to {host}:{port}: {hint}")


def _open_tcp_store(host: str, port: int, world_rank: int, timeout_s: float):
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
    try:
        return dist.TCPStore(host, port, None, False, _timedelta(timeout_s), wait_for_workers=False)
    except Exception as e:  # DistNetworkError / DistStoreError
        raise RendezvousTimeoutError(
            f"world rank {world_rank} could not reach the AFD rendezvous store at {host}:{port} "
            f"(hosted by FFN rank 0 = world rank 0) within {timeout_s:.0f} s: {str(e).splitlines()[0].rstrip('.')}. "
            "Check that FFN rank 0 is running, that host/port are the same on every rank and "
            "that the port is reachable from this machine.",
            missing=(0,), what="rendezvous store",
        ) from None


def _store_alive(store) -> bool:
    try:
        store.check(["__afd_ping__"])
        return True
    except Exception:  # noqa: BLE001 - any failure means the cached client is unusable
        return False


def connect(
    host: str,
    port: int,
    world_rank: int,
    world_size: int,
    timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    *,
    num_ffn_ranks: int | None = None,
    namespace: str = "afd",
) -> AFDStore:
    """Join the AFD rendezvous store at ``host:port`` and open the next generation.

    World rank 0 (FFN rank 0) hosts the ``TCPStore`` server, bound to ``host``;
    every other rank connects, retrying until ``timeout_s`` (so the ranks may
    start in any order). A second call in the same process reuses the cached
    store and returns the next generation's key space (see the module doc).

    Args:
        host: address of FFN rank 0 (a name or an IPv4/IPv6 address).
        port: TCP port, 1..65535.
        world_rank: this rank in the AFD world (FFN first), ``0 <= world_rank < world_size``.
        world_size: ``F + A``.
        timeout_s: deadline in seconds for connecting, and the default for later waits.
        num_ffn_ranks: ``F``, used to name ranks in errors (optional).
        namespace: key namespace; two AFD instances sharing one store use different names.

    Returns:
        An :class:`AFDStore` for this rank's new generation.

    Raises:
        ValueError: bad rank/size/port/timeout.
        RendezvousError: world rank 0 cannot bind ``host:port`` (not a local address,
            port in use).
        RendezvousTimeoutError: the store was not reachable within ``timeout_s``.
    """
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string (FFN rank 0's address), got {host!r}")
    if not (isinstance(port, int) and 0 < port < 65536):
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    if not (isinstance(world_size, int) and world_size >= 2):
        raise ValueError(f"world_size must be an int >= 2 (F + A), got {world_size!r}")
    if not (isinstance(world_rank, int) and 0 <= world_rank < world_size):
        raise ValueError(f"world_rank must be in 0..{world_size - 1}, got {world_rank!r}")
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if num_ffn_ranks is not None and not (1 <= num_ffn_ranks < world_size):
        raise ValueError(f"num_ffn_ranks must be in 1..{world_size - 1}, got {num_ffn_ranks!r}")
    import torch.distributed as dist

    key = (host, port, world_rank)
    with _STORES_LOCK:
        base = _STORES.get(key)
        if base is not None and not _store_alive(base):
            logger.warning("cached AFD rendezvous store %s:%d is unusable; reconnecting", host, port)
            base = None
            del _STORES[key]
        if base is None:
            base = _open_tcp_store(host, port, world_rank, timeout_s)
            _STORES[key] = base
    base.set_timeout(_timedelta(timeout_s))
    root = dist.PrefixStore(f"{namespace}/", base)
    generation = int(root.add(f"join/{world_rank}", 1))
    store = dist.PrefixStore(f"g{generation}/", root)
    afd_store = AFDStore(store=store, base=base, host=host, port=port, world_rank=world_rank,
                         world_size=world_size, num_ffn_ranks=num_ffn_ranks, generation=generation,
                         namespace=namespace, timeout_s=float(timeout_s))
    logger.debug("%s joined AFD rendezvous %s:%d generation %d", afd_store.label(), host, port, generation)
    return afd_store


def _generation_hint(store: AFDStore, missing: Iterable[int]) -> str:
    """Explain a missing rank that sits in another generation (re-initialised a different number of times)."""
    import torch.distributed as dist

    try:
        root = dist.PrefixStore(f"{store.namespace}/", store.base)
        notes = []
        for r in missing:
            g = int(root.add(f"join/{r}", 0))
            if g != store.generation:
                notes.append(f"{store.label(r)} is at generation {g}")
        if notes:
            return (f" ({'; '.join(notes)}, this rank at {store.generation}: every rank must "
                    "re-initialise the connector the same number of times)")
    except Exception:  # noqa: BLE001 - only a hint
        pass
    return ""


def check_abort(store: AFDStore) -> str | None:
    """Return the posted abort (``"<reason> (by <who>)"``) of this generation, or None.

    One store round trip (tens of µs); poll it every few milliseconds at most.
    """
    if not store.check(["abort"]):
        return None
    reason, by = _read_abort(store)
    return f"{reason} (by {by})"


def _read_abort(store: AFDStore) -> tuple[str, str]:
    raw = store.get("abort")
    try:
        d = json.loads(raw.decode("utf-8"))
        return str(d["reason"]), str(d["by"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace"), "an unknown rank"


def raise_if_aborted(store: AFDStore, op: str = "") -> None:
    """Raise :class:`StepAbortedError` if an abort was posted in this generation.

    Raises:
        StepAbortedError: naming the aborting rank, its reason and ``op``.
    """
    if store.check(["abort"]):
        reason, by = _read_abort(store)
        raise StepAbortedError(reason, by, op=op)


def post_abort(store: AFDStore, reason: str, by: str | None = None) -> bool:
    """Post the step-abort signal for this generation (the first post wins).

    Every rank waiting in this module, or polling :func:`check_abort` (the
    control plane's receive does), raises :class:`StepAbortedError`.

    Args:
        store: the generation's store.
        reason: what went wrong, e.g. ``"send_attn_output layer 3 stage 0: peer FFN rank 1 dead"``.
        by: who aborts; default this rank's label.

    Returns:
        True if this call posted the abort, False if one was already posted.
    """
    value = json.dumps({"reason": str(reason), "by": by or store.label()}).encode("utf-8")
    try:
        prev = store.compare_set("abort", "", value)
    except Exception as e:  # noqa: BLE001 - the store may be gone with a dead FFN rank 0
        logger.warning("could not post AFD abort (%s): %s", reason, e)
        return False
    return bytes(prev) == value


def wait_for_keys(
    store: AFDStore,
    keys: Mapping[str, int],
    timeout_s: float | None,
    what: str,
) -> None:
    """Wait until every key exists, with a deadline and abort detection.

    Args:
        store: the generation's store.
        keys: key -> world rank expected to set it (named in the error).
        timeout_s: deadline in seconds (None: the store's default).
        what: what is awaited, for the error message.

    Raises:
        RendezvousTimeoutError: naming the ranks whose keys are missing and ``what``.
        StepAbortedError: an abort was posted while waiting.
    """
    timeout = store.timeout_s if timeout_s is None else float(timeout_s)
    deadline = time.monotonic() + timeout
    pending = dict(keys)
    sleep = 0.001
    while True:
        # One store round trip per poll (every rank polls FFN rank 0's store);
        # which keys are missing is worked out only for the error.
        if not pending or store.check(list(pending)):
            return
        raise_if_aborted(store, op=f"waiting for {what}")
        if time.monotonic() >= deadline:
            pending = {k: r for k, r in pending.items() if not store.check([k])}
            if not pending:
                return
            missing = sorted(set(pending.values()))
            names = ", ".join(store.label(r) for r in missing)
            raise RendezvousTimeoutError(
                f"{store.label()} timed out after {timeout:.0f} s waiting for {what} from {names}"
                f"{_generation_hint(store, missing)}. Those ranks did not arrive: check that they "
                "are running, use the same host/port/num_attention_ranks/num_ffn_ranks, and raise "
                "the rendezvous timeout if their model load is slower.",
                missing=missing, what=what,
            )
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
        TypeError/ValueError: ``make_id`` returned no bytes.
        RendezvousTimeoutError: the creator did not publish within the deadline.
        StepAbortedError: an abort was posted while waiting.
    """
    full = f"uid/{key}"
    if is_creator:
        uid = make_id()
        if isinstance(uid, (bytearray, memoryview)):
            uid = bytes(uid)
        if not isinstance(uid, bytes):
            raise TypeError(f"make_id must return bytes, got {type(uid).__name__}")
        if not uid:
            raise ValueError(f"make_id returned an empty id for {key!r}")
        store.set(full, uid)
        return uid
    who = -1 if creator_rank is None else creator_rank
    wait_for_keys(store, {full: who}, timeout_s, f"unique id {key!r}")
    return bytes(store.get(full))


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
        HandshakeMismatchError (a ValueError): the first differing field, naming the
            field, both values and both ranks (a field missing on one side counts).
        RendezvousTimeoutError: ranks that did not arrive.
        StepAbortedError: an abort was posted while waiting.
    """
    if world_rank != store.world_rank or world_size != store.world_size:
        raise ValueError(
            f"handshake called as world rank {world_rank}/{world_size} on a store joined as "
            f"{store.world_rank}/{store.world_size}"
        )
    mine = json.loads(json.dumps(dict(fields), default=str, sort_keys=True))
    store.set(f"handshake/{world_rank}", json.dumps(mine, sort_keys=True).encode("utf-8"))
    wait_for_keys(store, {f"handshake/{r}": r for r in range(world_size)}, timeout_s, "the AFD handshake")
    everyone: dict[int, dict[str, Any]] = {}
    for r in range(world_size):
        everyone[r] = json.loads(store.get(f"handshake/{r}").decode("utf-8"))
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
        RendezvousTimeoutError: naming the ranks that did not arrive.
        StepAbortedError: an abort was posted while waiting.
    """
    members = sorted(set(range(world_size) if ranks is None else ranks))
    if world_rank not in members:
        raise ValueError(f"world rank {world_rank} is not among the barrier's ranks {members}")
    seq = store._barrier_seq.get(name, 0)
    store._barrier_seq[name] = seq + 1
    key = f"barrier/{name}/{seq}"
    store.set(f"{key}/{world_rank}", b"1")
    wait_for_keys(store, {f"{key}/{r}": r for r in members}, timeout_s, f"barrier {name!r}")
    # World rank 0 hosts the store and leaves last, so a rank that returns from a
    # barrier and exits never takes the store away from a peer still polling it.
    if world_rank != 0:
        store.set(f"{key}/left/{world_rank}", b"1")
    elif len(members) > 1:
        wait_for_keys(store, {f"{key}/left/{r}": r for r in members if r != 0}, timeout_s,
                      f"barrier {name!r} (peers leaving)")
