"""Joining the AFD rendezvous store: :func:`connect`, the job's identity and one process per world rank.

FFN rank 0 writes the job's identity (``job_id``, see
:func:`afd_ext.config.resolve_job_id`) and world shape into the store when
it opens it; a rank of another job is refused (:class:`JobMismatchError`), a
rank of this job started with another ``num_attention_ranks`` or
``num_ffn_ranks`` gets a :class:`HandshakeMismatchError` at once (and aborts
the waiting ranks' handshake). Each world rank is claimed by one process: a
second live process claiming it on the same host is refused
(:class:`DuplicateRankError`) and posts that as the abort of the generation
still in its handshake: a launcher that gave two processes one role rank left
another rank missing, so every waiting rank of the job raises
:class:`DuplicateRankError` too, naming both processes, instead of waiting
out its deadline. A claim whose process is gone is taken over.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Mapping

from ..errors import AFDConfigError, DuplicateRankError, HandshakeMismatchError, JobMismatchError, RendezvousError
from ..errors import RendezvousTimeoutError, StoreTimeoutError
from ..health.process import start_time
from ..topology import rank_label
from .store import (_MAX_POLL_S, _MIN_ROUND_TRIP_S, _STORES, _STORES_LOCK, DEFAULT_RENDEZVOUS_TIMEOUT_S,
                    AFDStore, WaitReport, _left, _open_tcp_store, _process_token, _StoreRunner,
                    _timedelta, host_identity)

logger = logging.getLogger("afd_ext.rendezvous")  # the name users configure (docs/troubleshooting.md)

#: Longest FFN rank 0 looks, when its port is in use, whether this job's live FFN rank 0 holds it, in seconds.
_PROBE_S = 10.0
_KEY_LOCKS: dict[tuple, threading.Lock] = {}


def _holder_alive(holder: Mapping[str, Any]) -> bool | None:
    """Whether the process of a claim runs: True/False on this host, None (unknown) elsewhere."""
    if holder.get("host") != host_identity():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    start = start_time(pid)
    return start is not None and start == holder.get("start")


def _store_alive(st: "AFDStore", bound: float) -> bool:
    """Whether a cached client still reaches its store (False: connection lost, reconnect)."""
    try:
        st.call(lambda: st.base.check(["__afd_ping__"]), "checking the cached store", bound)
        return True
    except StoreTimeoutError:
        raise
    except Exception:  # noqa: BLE001 - any other failure means the cached client is unusable
        return False


def _world_record(job_id: str, world_size: int, num_ffn_ranks: int | None) -> dict[str, Any]:
    return {"job_id": job_id, "world_size": world_size, "num_ffn_ranks": num_ffn_ranks}


def _check_world(st: "AFDStore", root: Any, mine: dict[str, Any], job_source: str, deadline: float) -> str:
    """Compare this rank's job and world shape with the store's (written by FFN rank 0); return the store's
    instance id (a random id FFN rank 0 writes with the record: a restarted FFN rank 0 has a new one)."""
    enc = json.dumps(dict(mine, instance=uuid.uuid4().hex[:12]) if st.world_rank == 0 else mine, sort_keys=True)
    if st.world_rank == 0:
        # FFN rank 0 opened the store: its view is the job's (a re-join reads it back).
        raw = st.call(lambda: root.compare_set("world", "", enc), "recording the job", _left(deadline))
    else:
        sleep = 0.001
        report = WaitReport(st.label(), f"the job record in the AFD rendezvous store at {st.host}:{st.port}",
                            deadline)
        while not st.call(lambda: root.check(["world"]), "reading the job", _left(deadline)):
            if report.due():
                report.log("FFN rank 0 (world rank 0), which opened the store")
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"{st.label()} reached a store at {st.host}:{st.port} that FFN rank 0 never set up "
                    "within the deadline: another program's store holds the port, or FFN rank 0 hangs "
                    "right after opening it.", missing=(0,), what="the job record")
            time.sleep(sleep)
            sleep = min(2 * sleep, _MAX_POLL_S)
        raw = st.call(lambda: root.get("world"), "reading the job", _left(deadline))
    theirs = json.loads(bytes(raw).decode("utf-8"))
    if theirs.get("job_id") != mine["job_id"]:
        raise JobMismatchError(
            f"{st.label()} (job {mine['job_id'] or '<none>'}, from {job_source}) reached the AFD rendezvous "
            f"store at {st.host}:{st.port} of another job ({theirs.get('job_id') or '<none>'}): refused, the "
            "running job is untouched. Start this job on another port, or, if both are the same job, give "
            "every rank the same job id (connector_extra_config.job_id or AFD_JOB_ID; torchrun's run id "
            "differs between separate torchrun launches).",
            job_id=mine["job_id"], store_job_id=str(theirs.get("job_id")))
    diff = _shape_difference(mine, theirs)
    if diff is None:
        return str(theirs.get("instance", ""))
    name, a, b = diff
    msg = (f"AFD handshake mismatch in field {name!r}: {st.label()} has {a!r}, FFN rank 0 (world rank 0) "
           f"opened the store at {st.host}:{st.port} with {b!r}. Every attention and FFN rank must be "
           "started with the same num_attention_ranks and num_ffn_ranks.")
    # stop the ranks waiting in FFN rank 0's current handshake, unless that job already runs
    _abort_waiting_init(st, root, {"reason": msg, "by": st.label()}, int(theirs.get("world_size") or 0), deadline)
    raise HandshakeMismatchError(msg, field=name, local_value=a, peer_value=b,
                                 local_rank=st.world_rank, peer_rank=0)


def _shape_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    f1, f2 = mine.get("num_ffn_ranks"), theirs.get("num_ffn_ranks")
    if f1 is not None and f2 is not None:
        if f1 != f2:
            return "num_ffn_ranks", f1, f2
        a1, a2 = mine["world_size"] - f1, theirs["world_size"] - f2
        return ("num_attention_ranks", a1, a2) if a1 != a2 else None
    if mine["world_size"] != theirs.get("world_size"):
        return "num_attention_ranks + num_ffn_ranks", mine["world_size"], theirs.get("world_size")
    return None


def _abort_waiting_init(st: "AFDStore", root: Any, record: Mapping[str, Any], world_size: int,
                        deadline: float) -> None:
    """Post ``record`` as the abort of the store's current generation, unless it is past its handshake.

    The ranks waiting at init are in the current generation; one past its
    handshake is a running job, which is not disturbed. Each round trip
    may take until this rank's init ``deadline`` (at least 2 s): the waiting
    ranks learn of the refusal only from this post, and a store thread starved
    on a loaded host must not drop it (they would wait out their init timeout).
    """
    import torch.distributed as dist

    value = json.dumps(dict(record))
    bound = lambda: _left(deadline, 2.0)  # noqa: E731
    try:
        g = int(st.call(lambda: root.compare_set("gen", "", "1"), "reading generations", bound()))
        done = [f"barrier/handshake-read/0/{r}" for r in range(world_size)]
        gen = dist.PrefixStore(f"g{g}/", root)
        if not (done and st.call(lambda: gen.check(done), "reading the handshake", bound())):
            st.call(lambda: gen.compare_set("abort", "", value), "posting the abort", bound())
    except Exception as e:  # noqa: BLE001 - the refusal itself stands; the others then wait out their deadline
        logger.warning("%s: could not stop the job's ranks waiting at init (%s); they wait out their "
                       "init_timeout_s", st.label(), e)


def _refuse_duplicate(st: "AFDStore", root: Any, holder: Mapping[str, Any], deadline: float) -> DuplicateRankError:
    """This process claims a world rank a live process (``holder``) holds: stop the job's ranks waiting at init
    (they wait for the rank the launcher meant this process to be), naming both processes; the error to raise."""
    who = f"pid {holder.get('pid')} on {holder.get('name', 'another host')}"
    me = _process_token()
    mine = f"pid {me['pid']} on {me['name']}"
    _abort_waiting_init(st, root, {
        "kind": "duplicate", "world_rank": st.world_rank, "holder": who, "claimant": mine,
        "holder_nonce": holder.get("nonce"), "by": f"a second process started as {st.label()} ({mine})",
        "reason": f"{st.label()} was started twice: {who} holds it, {mine} was refused"},
        st.world_size, deadline)
    return DuplicateRankError(
        f"{st.label()} is already held by another running process ({who}) on the AFD rendezvous "
        f"store at {st.host}:{st.port}; this process ({mine}) is refused: two processes were started "
        "with the same role rank. Give every process its own role rank (or stop the other one); the "
        "job's ranks waiting at init are stopped with this error too.",
        world_rank=st.world_rank, holder=who)


def _second_store_host(host: str, port: int, world_size: int, num_ffn_ranks: int | None, namespace: str,
                       job: str, err: RendezvousError, deadline: float) -> DuplicateRankError | RendezvousError:
    """FFN rank 0 found ``host:port`` in use: a :class:`DuplicateRankError` (the job's waiting ranks stopped) when
    this job's store is there with a live FFN rank 0 on this host (FFN rank 0 started twice), else ``err``.
    Looks for at most ``_PROBE_S`` seconds (within ``deadline``)."""
    import torch.distributed as dist

    bound = max(_MIN_ROUND_TRIP_S, min(_PROBE_S, deadline - time.monotonic()))
    end = time.monotonic() + bound
    runner = _StoreRunner(f"afd-store {host}:{port} probe")
    try:
        base = _open_tcp_store(host, port, 1, bound, end)
        root = dist.PrefixStore(f"{namespace}/", base)
        st = AFDStore(store=root, base=base, host=host, port=port, world_rank=0, world_size=world_size,
                      num_ffn_ranks=num_ffn_ranks, generation=0, namespace=namespace, timeout_s=bound, _runner=runner)
        # the other FFN rank 0 may have bound the port a moment ago: let it record the job and claim its rank
        while not st.call(lambda: root.check(["world", "owner/0"]), "reading the job"):
            if time.monotonic() > end:
                return err
            time.sleep(0.05)
        world = json.loads(bytes(st.call(lambda: root.get("world"), "reading the job")).decode("utf-8"))
        holder = json.loads(bytes(st.call(lambda: root.get("owner/0"), "reading FFN rank 0's claim")).decode("utf-8"))
        if world.get("job_id") != job or _shape_difference(_world_record(job, world_size, num_ffn_ranks), world) \
                or not _holder_alive(holder):
            return err
        return _refuse_duplicate(st, root, holder, end)
    except Exception as e:  # noqa: BLE001 - not a store of this job: the bind error stands
        logger.debug("%s:%d is in use and is not this job's live store (%s)", host, port, e)
        return err
    finally:
        runner.stop()


def _claim_rank(st: "AFDStore", root: Any, deadline: float) -> None:
    """Claim this world rank for this process; refuse a second live process claiming it."""
    me = _process_token()
    enc = json.dumps(me, sort_keys=True)
    key = f"owner/{st.world_rank}"
    prev = bytes(st.call(lambda: root.compare_set(key, "", enc), "claiming this rank", _left(deadline)))
    for _ in range(3):
        try:
            holder = json.loads(prev.decode("utf-8"))
        except ValueError:
            holder = {}
        if holder.get("nonce") == me["nonce"]:
            return
        who = f"pid {holder.get('pid')} on {holder.get('name', 'another host')}"
        alive = _holder_alive(holder)
        if alive:
            raise _refuse_duplicate(st, root, holder, deadline)
        if alive is None:
            logger.warning("%s: taking over this rank from %s (another host; assumed gone). If that process "
                           "still runs, two processes were started with the same role rank.", st.label(), who)
        got = bytes(st.call(lambda: root.compare_set(key, prev, enc), "claiming this rank", _left(deadline)))
        if got == enc.encode("utf-8"):
            return
        prev = got
    raise DuplicateRankError(f"{st.label()} is being claimed by several processes at once on the AFD "
                             f"rendezvous store at {st.host}:{st.port}: two processes were started with the "
                             "same role rank.", world_rank=st.world_rank, holder="several processes")


def connect(
    host: str,
    port: int,
    world_rank: int,
    world_size: int,
    timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    *,
    num_ffn_ranks: int | None = None,
    namespace: str = "afd",
    job_id: str | None = None,
    stop: threading.Event | None = None,
) -> AFDStore:
    """Join the AFD rendezvous store at ``host:port`` and open the next generation.

    World rank 0 (FFN rank 0) hosts the ``TCPStore`` server, bound to ``host``;
    every other rank connects, retrying until ``timeout_s`` (so the ranks may
    start in any order). A second call in the same process reuses the cached
    store; the generation joined is the store's current one, or the next when
    that one is over (see the module doc of :mod:`.store`).

    Args:
        host: address of FFN rank 0 (a name or an IPv4/IPv6 address).
        port: TCP port, 1..65535.
        world_rank: this rank in the AFD world (FFN first), ``0 <= world_rank < world_size``.
        world_size: ``F + A``.
        timeout_s: deadline in seconds for connecting, and the default for later waits.
        num_ffn_ranks: ``F``, used to name ranks in errors and checked against FFN rank 0's (optional).
        namespace: key namespace; two AFD instances sharing one store use different names.
        job_id: this job's identity (None: :func:`afd_ext.config.resolve_job_id`).
        stop: when set (the connector's ``close()`` on another thread), every wait on this store raises
            :class:`AFDClosedError` within one poll.

    Returns:
        An :class:`AFDStore` for this rank's new generation.

    Raises:
        AFDConfigError: bad rank/size/port/timeout.
        RendezvousError: world rank 0 cannot bind ``host:port`` (not a local address,
            port in use).
        RendezvousTimeoutError: the store was not reachable within ``timeout_s``, or
            what listens on the port does not answer as a store.
        JobMismatchError: the store belongs to another job.
        HandshakeMismatchError: FFN rank 0 has another ``num_attention_ranks``/``num_ffn_ranks``.
        DuplicateRankError: another live process holds this world rank.
        StoreTimeoutError: the store stopped answering (FFN rank 0 frozen).
    """
    if not isinstance(host, str) or not host:
        raise AFDConfigError(f"host must be a non-empty string (FFN rank 0's address), got {host!r}")
    if not (isinstance(port, int) and 0 < port < 65536):
        raise AFDConfigError(f"port must be an int in 1..65535, got {port!r}")
    if not (isinstance(world_size, int) and world_size >= 2):
        raise AFDConfigError(f"world_size must be an int >= 2 (F + A), got {world_size!r}")
    if not (isinstance(world_rank, int) and 0 <= world_rank < world_size):
        raise AFDConfigError(f"world_rank must be in 0..{world_size - 1}, got {world_rank!r}")
    if not timeout_s or timeout_s <= 0:
        raise AFDConfigError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if num_ffn_ranks is not None and not (1 <= num_ffn_ranks < world_size):
        raise AFDConfigError(f"num_ffn_ranks must be in 1..{world_size - 1}, got {num_ffn_ranks!r}")
    import torch.distributed as dist

    from ..config import resolve_job_id

    job, job_source = resolve_job_id(job_id)
    deadline = time.monotonic() + float(timeout_s)

    def handle(base: Any, runner: _StoreRunner | None, store: Any = None) -> AFDStore:
        return AFDStore(store=store, base=base, host=host, port=port, world_rank=world_rank,
                        world_size=world_size, num_ffn_ranks=num_ffn_ranks, generation=0,
                        namespace=namespace, timeout_s=float(timeout_s), _runner=runner)

    key = (host, port, world_rank)
    with _STORES_LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:  # per rank: ranks that are threads of one process connect concurrently
        entry = _STORES.get(key)
        if entry is not None and not _store_alive(handle(*entry), _left(deadline)):
            logger.warning("cached AFD rendezvous store %s:%d is unusable; reconnecting", host, port)
            entry[1].stop()
            entry = None
            with _STORES_LOCK:
                _STORES.pop(key, None)
        if entry is None:
            try:
                base = _open_tcp_store(host, port, world_rank, timeout_s, deadline,
                                       rank_label(world_rank, num_ffn_ranks), stop)
            except RendezvousError as e:
                if world_rank == 0 and getattr(e, "port_in_use", False):
                    raise _second_store_host(host, port, world_size, num_ffn_ranks, namespace, job, e,
                                             deadline) from None
                raise
            entry = (base, _StoreRunner(f"afd-store {host}:{port} w{world_rank}"))
            with _STORES_LOCK:
                _STORES[key] = entry
    base, runner = entry
    base.set_timeout(_timedelta(timeout_s))
    root = dist.PrefixStore(f"{namespace}/", base)
    st = handle(base, runner, root)
    st.stop = stop
    st.instance = _check_world(st, root, _world_record(job, world_size, num_ffn_ranks), job_source, deadline)
    _claim_rank(st, root, deadline)
    st.generation = _open_generation(st, root, deadline)
    st.store = dist.PrefixStore(f"g{st.generation}/", root)
    logger.debug("%s joined AFD rendezvous %s:%d generation %d", st.label(), host, port, st.generation)
    return st


def _open_generation(st: "AFDStore", root: Any, deadline: float) -> int:
    """The generation this rank joins: the store's current one (key ``gen``), unless it is over for this rank
    (its handshake done, or an abort posted after this rank joined it), then the next one, opened by the
    first rank that finds it over (module doc of :mod:`.store`)."""
    import torch.distributed as dist

    done = [f"barrier/handshake-read/0/{r}" for r in range(st.world_size)]
    call = lambda fn: st.call(fn, "opening a generation", _left(deadline))  # noqa: E731
    g = int(call(lambda: root.compare_set("gen", "", "1")))
    last = int(call(lambda: root.add(f"join/{st.world_rank}", 0)))  # this rank's last generation, any process
    while True:
        gen = dist.PrefixStore(f"g{g}/", root)
        if not call(lambda: gen.check(done) or (last >= g and gen.check(["abort"]))):
            call(lambda: root.set(f"join/{st.world_rank}", str(g)))  # for the timeout's hint
            return g
        g = int(call(lambda g=g: root.compare_set("gen", str(g), str(g + 1))))
