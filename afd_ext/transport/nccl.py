"""The NCCL transport: CUDA tensors over the compiled core's ops (``afd_ext.ops``).

Communicators: one per edge and direction, of size 2 (FFN end rank 0,
attention end rank 1), created from unique ids that the FFN end makes and
publishes through the rendezvous store (``uid/<direction>/<a>/<f>``). An FFN
rank publishes the unique ids of *all* its communicators before it
initialises any of them (so no attention rank waits for an id behind another
edge's initialisation); then every rank walks the global edge list in one
sorted order (by attention rank, then FFN rank, then ``a2f`` before ``f2a``)
and creates the communicators it is part of, so the blocking
``ncclCommInitRank`` calls cannot wait on each other in a cycle. Each
``ncclCommInitRank`` runs in a helper thread and is bounded by the init
deadline (one deadline for the whole transport): a peer that never arrives is
a :class:`~afd_ext.rendezvous.RendezvousTimeoutError` naming it and the
communicator, never a hang. Size-2 communicators also let several attention
processes share a GPU (NCCL refuses two ranks of one communicator on one device).

Teardown never waits unboundedly (see :meth:`NcclTransport.close`): after a
failure or with work still in flight the communicators are *aborted*, all of
them concurrently (one thread each), because the kernels of one NCCL group
over several communicators run one after the other on one stream: aborting
communicator X first may wait for X's internal streams, which wait for the
stuck kernel of communicator Y, which only ends once Y's abort flag is set.
``ncclCommDestroy`` (which waits for queued work) is only used after a clean
drain, and is itself bounded (the remaining communicators are aborted when it
overruns). A release that overruns its bound is logged with the communicator
it is stuck on, and the next :class:`NcclTransport` of this process waits for
it (bounded) and then refuses to start, naming it, instead of hanging inside
``ncclCommInitRank``; process exit waits for it too (bounded, ``health.watchdog.EXIT_WAIT_S``), since a
helper returning into a finalising interpreter aborts the process.

Every data call is one NCCL group over all peers (``ops.split_back`` /
``ops.fan_in``), issued on the stage's own CUDA stream after the caller's
current stream (an event), and a receive makes the caller's stream wait for
the stage stream again. So a stage's reply receive is never queued behind
the next stage's send, the ordering rules of :mod:`afd_ext.schedule` hold, and
the calls are capturable in a CUDA graph (the stage streams fork from and join
the capturing stream through events; :meth:`NcclTransport.prepare_stages`
creates them before any capture).

No hang: after each group an event is recorded on the stream and handed to the
:class:`~afd_ext.health.Watchdog` with a description (op, peers, layer,
stage, the exchange's tag); on expiry or an asynchronous communicator error
the watchdog posts the abort signal (bounded, *before* the communicators are aborted: aborting releases queued sends, so a peer that
receives one afterwards finds the abort already posted), aborts every
communicator of this transport, and the next call raises the named error.
Host waits (:meth:`NcclTransport.wait_event`: ``synchronize``, ``fan_in(wait=True)``
for strict headers, ``barrier``) are tracked like any operation, so the watchdog is the one clock:
the error names the *oldest* unfinished operation (its op, peers, layer and
stage), not the wait that noticed it; the host wait itself only has a backstop
deadline a little later. Which peer of a multi-peer group did not send is
decided from the peers' published progress (:mod:`afd_ext.health.stall`).

No fused send-and-receive op: the connector API is two calls
(``send_attn_output``, later ``recv_ffn_output``), so fusing would hold the
send back until the receive call and move the FFN side's start behind
whatever the caller runs in between; the compiled core's fused ``exchange``
op, used only by the bench, was removed.

Teardown keeps buffers alive that a stuck NCCL kernel may still write into
(``close(buffers)`` while an abort is still running): never handed to the next
generation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import fp8
from ..health import AbortSignal, StallReports, Watchdog, host_wait, join_all, spawn, still_running
from ..errors import AFDConfigError, AFDStateError
from .base import (
    AFDPeerError, AFDTimeoutError, MessageTag, PeerMap, PendingSend, StepProgress, Transport,
    TransportSetup
)
from .streams import StageStreams  # noqa: F401 - was defined here; still importable from this module

logger = logging.getLogger(__name__)

__all__ = ["NcclTransport", "CommErrors", "DIRECTIONS", "RELEASE_TIMEOUT_S", "WAIT_BACKSTOP_S", "pending_releases"]

DIRECTIONS = ("a2f", "f2a")

#: Bound of one teardown (drain, destroy or abort of this transport's communicators), seconds.
RELEASE_TIMEOUT_S = 15.0
#: A host wait on an event gives up this long after the deadline if the watchdog did not report first.
WAIT_BACKSTOP_S = 2.0
#: ``ncclInProgress``: an asynchronous communicator operation is still running (not an error).
NCCL_IN_PROGRESS = 7
NCCL_REMOTE_ERROR = 6
#: Seconds a communicator's ncclRemoteError waits for the watchdog to find the posted abort
#: (the root cause, naming the rank that failed) before it is reported itself.
REMOTE_GRACE_S = 1.0
_NCCL_ERRORS = {
    1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError",
}

# Buffers of a generation whose NCCL abort overran its bound (see NcclTransport.close); never freed.
_STUCK_BUFFERS: list[torch.Tensor] = []


def pending_releases() -> list[str]:
    """Descriptions of NCCL management calls (abort/destroy) still running in helper threads."""
    return [d for _, d in still_running() if d.startswith("nccl")]


def _wait_pending(timeout_s: float, owner: str) -> None:
    """Wait (bounded) for earlier overrunning NCCL management calls of this process.

    Raises:
        RuntimeError: some are still running after ``timeout_s``; names them.
    """
    deadline = time.monotonic() + timeout_s
    left = pending_releases()
    if left:
        logger.warning("%s: waiting up to %.0f s for earlier NCCL calls still running: %s",
                       owner, timeout_s, "; ".join(left))
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = pending_releases()
    if left:
        raise AFDStateError(
            f"AFD {owner}: earlier NCCL calls of this process are still running after {timeout_s:.0f} s: "
            f"{'; '.join(left)}. A new communicator would queue behind them on the GPU and hang; restart "
            "this process (its GPU work is stuck; see the stack dump / NCCL_DEBUG=INFO output).")


class CommErrors:
    """The NCCL transport's poll of its own state, run by the watchdog: a communicator's asynchronous error.

    Args:
        comms: callable returning ``[(handle, name)]`` of the live communicators.
        async_error: ``handle -> int`` (``ops.comm_async_error``).

    Called as ``poll(watchdog, now)``: the :class:`~afd_ext.errors.AFDPeerError` of the first
    communicator in error (naming the oldest in-flight operation), or None. A peer aborting its
    communicators after posting the step abort shows here first as ncclRemoteError: while the
    watchdog reads the abort signal, that error waits :data:`REMOTE_GRACE_S` for the posted root cause.
    """

    def __init__(self, comms: Callable[[], Sequence[tuple[int, str]]], async_error: Callable[[int], int]):
        self.comms = comms
        self.async_error = async_error
        self._remote_seen: float | None = None  # when a communicator first reported a remote error

    def __call__(self, wd: Watchdog, now: float) -> BaseException | None:
        for handle, desc in list(self.comms()):
            try:
                code = int(self.async_error(handle))
            except Exception as e:  # noqa: BLE001
                code, err = -1, str(e)
            else:
                err = _NCCL_ERRORS.get(code, f"NCCL error {code}")
            if code in (0, NCCL_IN_PROGRESS):
                continue
            if code == NCCL_REMOTE_ERROR and wd.posts_abort:
                if self._remote_seen is None:
                    self._remote_seen = now
                if now - self._remote_seen < REMOTE_GRACE_S:
                    continue
            last = wd.in_flight
            op0 = last[0] if last else None
            ctx = f"; in flight: {op0.describe()}" if op0 else ""
            return AFDPeerError(
                f"AFD {wd.owner}: communicator {desc} reported {err}{ctx}. The peer probably died "
                "or its network failed; close and re-initialise the connector.",
                op=op0.what if op0 else None, peer=desc, layer=op0.layer if op0 else None,
                stage=op0.stage if op0 else None)
        return None


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _release_comms(ops: Any, comms: dict, me: str, *, abort: bool, timeout_s: float,
                   ) -> list[tuple[threading.Thread, str]]:
    """Release ``comms`` ({(a, f, direction): handle}), bounded (never raises); ``me`` names this rank in logs.

    ``abort=True``: ``comm_abort`` of every communicator at once, one thread
    each (see the module doc for why not one after the other). Else
    ``comm_destroy`` one after the other in one thread; if that overruns
    ``timeout_s``, every communicator not yet destroyed is aborted (which
    ends whatever the destroy waits for).

    Returns:
        The helper threads (joined, each until the bound).
    """
    if not comms:
        return []
    desc = {k: f"{d} a{a}-f{f} (handle {h})" for k, h in comms.items() for (a, f, d) in [k]}

    def call(fn, h, name):
        def run():
            try:
                fn(h)
            except Exception as e:  # noqa: BLE001 - keep releasing the others
                logger.warning("%s: %s of NCCL communicator %s: %s", me, name, h, e)
        return run

    deadline = time.monotonic() + timeout_s
    if not abort:
        def destroy_all():
            for k, h in comms.items():
                call(ops.comm_destroy, h, "destroy")()
        what = f"ncclCommDestroy of {', '.join(desc.values())} on {me}"
        threads = [(spawn(destroy_all, what)[0], what)]
        left = join_all(threads, deadline)
        if not left:
            return threads
        logger.error("%s: destroying the NCCL communicators did not finish within %.0f s (queued work "
                     "that never completes?); aborting them", me, timeout_s)
        deadline = time.monotonic() + timeout_s
    threads = []
    for k, h in comms.items():
        what = f"ncclCommAbort of {desc[k]} on {me}"
        threads.append((spawn(call(ops.comm_abort, h, "abort"), what)[0], what))
    left = join_all(threads, deadline)
    if left:
        logger.error("%s: NCCL abort did not return within %.0f s: %s. The next connector "
                     "init of this process will wait for it and then refuse to start.",
                     me, timeout_s, "; ".join(left))
    return threads


def _create_comm(ops: Any, index: int, peers: PeerMap, uid_t: torch.Tensor, rank_in_comm: int, peer: int,
                 what: str, deadline: float, init_timeout_s: float, store: Any, rdzv: Any) -> int:
    """``ops.comm_create`` in a helper thread, bounded by ``deadline``, watching the abort signal.

    Raises:
        RendezvousTimeoutError: the peer did not join in time (the helper thread
            stays blocked in ``ncclCommInitRank``; a late success is aborted).
        StepAbortedError: another rank posted the abort signal meanwhile.
        RuntimeError: NCCL failed.
    """
    lock = threading.Lock()
    state: dict = {"cancelled": False, "handle": None}

    def create() -> int:
        h = ops.comm_create(uid_t, 2, rank_in_comm, index)
        with lock:
            orphan = state["cancelled"]
            state["handle"] = None if orphan else h
        if orphan:  # the waiter gave up: nobody owns it
            ops.comm_abort(h)
        return h

    # Not registered as pending: an abandoned init holds no GPU work of ours.
    t, box = spawn(create, f"ncclCommInitRank of {what} on {peers.me}", keep=False)
    next_abort = 0.0
    while True:
        t.join(0.005)
        if not t.is_alive():
            if "error" in box:
                raise box["error"]
            return int(box["result"])
        now = time.monotonic()
        try:
            if now >= next_abort:
                next_abort = now + 0.1
                rdzv.raise_if_aborted(store, op=f"creating {what}")
            if now >= deadline:
                peer_label = peers.peer_label(peer)
                raise rdzv.RendezvousTimeoutError(
                    f"{peers.me} timed out after {init_timeout_s:.0f} s (the init deadline) in "
                    f"ncclCommInitRank of {what} with {peer_label}: that rank did not join this "
                    "communicator. It is probably stuck earlier (a previous generation's teardown, "
                    "another communicator's init) or not running; its stack dump / log says where. "
                    "Every rank creates its communicators in the same order (by attention rank, FFN "
                    "rank, a2f before f2a).",
                    missing=(peers.peer_world_rank(peer),), what=what)
        except BaseException:
            with lock:
                state["cancelled"] = True
                h = state["handle"]
                state["handle"] = None
            if h is not None:
                ops.comm_abort(h)
            raise


class NcclTransport(Transport):
    """Moves row ranges of CUDA tensors over per-(edge, direction) NCCL communicators.

    Args:
        store: the generation's :class:`~afd_ext.rendezvous.AFDStore` (unique-id exchange,
            abort signal, progress reports).
        topology: the :class:`~afd_ext.topology.Topology`.
        peers: this rank's :class:`~afd_ext.transport.base.PeerMap`.
        device: this rank's CUDA device.
        timeout_s: deadline of an in-flight operation, seconds.
        init_timeout_s: one deadline for the whole setup (unique-id exchange and every
            ``ncclCommInitRank``), seconds.
        abort: the generation's :class:`~afd_ext.health.AbortSignal`, polled by the
            watchdog and posted on failure; or None (nothing polled or posted).
        progress: callable returning this rank's :class:`~afd_ext.transport.base.StepProgress`,
            for naming the stalled peer (:mod:`afd_ext.health.stall`); or None.
        publish_after_s: see :class:`~afd_ext.health.stall.StallReports` (default ``0.4 * timeout_s``).

    Raises:
        RendezvousTimeoutError: a peer did not publish its unique id, or did not join
            a communicator, within ``init_timeout_s`` (names the peer and the communicator).
        StepAbortedError: another rank's init failed meanwhile (it posted the abort signal).
        RuntimeError: NCCL failed to create a communicator (CPU-only build, version
            mismatch...); an earlier teardown of this process is still stuck in NCCL.
        On failure this rank posts the abort signal of the generation (so peers
        blocked with it fail fast) and aborts what it created.
    """

    kind = "nccl"
    fp8_hidden_align = 8
    device_type = "cuda"

    def __init__(self, store: Any, topology: Any, peers: PeerMap, device: torch.device, *,
                 timeout_s: float, init_timeout_s: float, abort: AbortSignal | None = None,
                 progress: Callable[[], StepProgress | None] | None = None, publish_after_s: float | None = None):
        device = torch.device(device)
        if device.type != "cuda":
            raise AFDConfigError(f"the NCCL transport needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(peers, device, timeout_s=timeout_s)
        from .. import ops
        from .. import rendezvous as rdzv

        self._ops = ops
        self._comms: dict[tuple[int, int, str], int] = {}  # (a, f, direction) -> handle
        self._event_pool: list[torch.cuda.Event] = []  # list append/pop are atomic in CPython
        self._comm_names: dict[int, str] = {}  # handle -> name, filled by _named_comms
        self._peer_rank = 1 if peers.role == "ffn" else 0  # the peer's rank in every size-2 communicator
        self._stages = StageStreams(device)
        self._aborted = False
        self._signal = abort
        self._store = store  # the rendezvous store (tests read the posted abort through it)
        stall = None
        if progress is not None and store is not None:
            stall = StallReports(store, peers, progress,
                                 0.4 * timeout_s if publish_after_s is None else publish_after_s)
        self.stall = stall
        self.watchdog = Watchdog(
            timeout_s, owner=peers.me, on_failure=self._on_watchdog_failure, post=self._post_abort,
            polls=[CommErrors(self._named_comms, ops.comm_async_error)],
            abort_check=None if abort is None else lambda: abort.check("in-flight work"),
            blame=None if stall is None else stall.blame, on_tick=None if stall is None else stall.tick,
            calls=None if abort is None else abort.calls)
        t0 = time.monotonic()
        self._init_comms(store, topology, init_timeout_s, rdzv)
        # This rank's peers (role ranks), for replays: derived once, not per replay.
        self._all_peers = sorted({f if peers.role == "attention" else a for (a, f, _d) in self._comms})
        logger.info("%s: %d NCCL communicators ready in %.2f s (generation %s)", peers.me, len(self._comms),
                    time.monotonic() - t0, getattr(store, "generation", "?"))
        self.watchdog.start()

    @classmethod
    def unavailable(cls) -> str | None:
        """``"afd_ext was built without CUDA"`` / ``"no GPU is visible"``, or None (both present)."""
        from .. import ops

        if not ops.is_cuda_built():
            return "afd_ext was built without CUDA"
        if torch.cuda.device_count() == 0:
            return "no GPU is visible"
        return None

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> "NcclTransport":
        if setup.device.index is not None:
            torch.cuda.set_device(setup.device)
        return cls(setup.store, setup.topology, setup.peers, setup.device, timeout_s=setup.timeout_s,
                   init_timeout_s=setup.init_timeout_s, abort=setup.abort, progress=setup.progress,
                   publish_after_s=setup.publish_after_s or None)

    def _init_comms(self, store: Any, topology: Any, init_timeout_s: float, rdzv: Any) -> None:
        """Create this rank's communicators under one deadline (see the module doc)."""
        ops, peers, device = self._ops, self.peers, self.device
        me_role, me = peers.role, peers.role_rank
        deadline = time.monotonic() + init_timeout_s
        gen = getattr(store, "generation", "?")
        mine = [(a, f, d) for a, f in topology.edges()
                if (me_role == "attention" and a == me) or (me_role == "ffn" and f == me)
                for d in DIRECTIONS]
        try:
            _wait_pending(max(1.0, min(init_timeout_s, RELEASE_TIMEOUT_S * 2)), peers.me)
            uids: dict[tuple[int, int, str], bytes] = {}
            if me_role == "ffn":
                # Publish every id first: no attention rank waits for its id behind
                # another edge's (blocking) initialisation.
                for a, f, d in mine:
                    uids[(a, f, d)] = rdzv.exchange_unique_id(
                        store, f"{d}/{a}/{f}", True, lambda: ops.nccl_unique_id().numpy().tobytes(),
                        init_timeout_s, creator_rank=f)
            for a, f, d in mine:
                peer = f if me_role == "attention" else a
                what = f"NCCL communicator {d} a{a}-f{f} (generation {gen})"
                if (a, f, d) not in uids:
                    left = max(0.001, deadline - time.monotonic())
                    uids[(a, f, d)] = rdzv.exchange_unique_id(
                        store, f"{d}/{a}/{f}", False, lambda: b"", left, creator_rank=f)
                uid_t = torch.frombuffer(bytearray(uids[(a, f, d)]), dtype=torch.uint8)
                rank_in_comm = 0 if me_role == "ffn" else 1
                logger.debug("%s: creating %s", peers.me, what)
                self._comms[(a, f, d)] = _create_comm(ops, device.index, peers, uid_t, rank_in_comm, peer, what,
                                                      deadline, init_timeout_s, store, rdzv)
        except BaseException as e:
            # Tell the peers (they may be blocked in ncclCommInitRank with us), then release.
            if store is not None and not isinstance(e, rdzv.StepAbortedError):
                try:
                    rdzv.post_abort(store, f"NCCL transport init failed on {peers.me}: "
                                    f"{str(e).splitlines()[0][:500] if str(e) else type(e).__name__}",
                                    by=peers.me)
                except Exception:  # noqa: BLE001 - best effort
                    pass
            self._release(abort=True, timeout_s=RELEASE_TIMEOUT_S)
            raise

    # -- helpers -------------------------------------------------------------------

    def _comm(self, peer: int, direction: str) -> int:
        if self.peers.role == "attention":
            a, f = self.peers.role_rank, peer
        else:
            a, f = peer, self.peers.role_rank
        try:
            return self._comms[(a, f, direction)]
        except KeyError:
            raise AFDConfigError(f"attention rank {a} and FFN rank {f} are not peers (no communicator)") from None

    def _named_comms(self) -> list[tuple[int, str]]:
        """The live communicators and their names, for the watchdog's polls (names formatted once)."""
        out = []
        for (a, f, d), h in list(self._comms.items()):
            name = self._comm_names.get(h)
            if name is None:
                name = self._comm_names[h] = f"{d} a{a}-f{f} (with {self._edge_peer_label(a, f)})"
            out.append((h, name))
        return out

    def _edge_peer_label(self, a: int, f: int) -> str:
        """The label of the other end of edge (attention rank ``a``, FFN rank ``f``)."""
        return self.peers.peer_label(f if self.peers.role == "attention" else a)

    def check_health(self, tag: MessageTag | None = None) -> None:
        self.watchdog.check()
        self._check_open(tag)

    def _track(self, what: str, live: Sequence[int], tag: MessageTag) -> None:
        """Follow the group just issued on the current stream (``live``: its peers' role ranks)."""
        if _capturing():
            return
        # Events are reused: the watchdog hands an event back once it saw it complete.
        try:
            ev = self._event_pool.pop()
        except IndexError:
            ev = torch.cuda.Event()
        ev.record()
        self.watchdog.track(ev.query, f"{tag.op}: {what}", peers=[self.peers.peer_label(p) for p in live],
                            layer=tag.layer, stage=tag.stage, where=tag.where(),
                            on_done=lambda: self._event_pool.append(ev), tag=tag,
                            peer_ranks=[self.peers.peer_world_rank(p) for p in live])

    def track_replay(self, what: str, tag: MessageTag) -> None:
        """Follow a CUDA-graph replay just launched on the current stream, like an eager group.

        A replayed graph holds this rank's NCCL sends and receives with every
        peer; an event recorded after it goes to the watchdog, so a peer that
        dies or stalls during a replay becomes the watchdog's named error (the
        communicators are aborted, which ends the graph's NCCL kernels) instead
        of a hang. No-op while a capture is running.
        """
        self._track(what, self._all_peers, tag)

    def wait_event(self, ev: torch.cuda.Event, what: str, names: Sequence[str], tag: MessageTag,
                   peer_ranks: Sequence[int] = ()) -> None:
        """Host wait for ``ev`` (recorded on the current stream) with the deadline.

        The wait is tracked by the watchdog like any operation, so when it
        cannot finish the error is the watchdog's: the oldest unfinished
        operation (which may be an exchange issued before this wait), named
        with its op, peers, layer and stage. The host loop itself gives up
        only :data:`WAIT_BACKSTOP_S` later (a dead watchdog thread), with the
        same kind of error.

        Raises:
            AFDTimeoutError / AFDPeerError / StepAbortedError: the watchdog's failure.
        """
        wd = self.watchdog
        exchange = tag.layer >= 0
        where = tag.where() if exchange else tag.step_text()
        wd.track(ev.query, f"{tag.op}: {what}", peers=names, layer=tag.layer if exchange else None,
                 stage=tag.stage if exchange else None, where=where, tag=tag, peer_ranks=peer_ranks)

        def done(slice_s: float) -> bool:
            end = time.monotonic() + slice_s
            while True:
                if ev.query():
                    wd.check()  # an abort ends the NCCL kernels too: their buffers hold no data then
                    return True
                wd.check()
                if time.monotonic() >= end:
                    return False
                time.sleep(min(0.0005, slice_s))

        peer = ", ".join(names)
        try:
            host_wait(done, timeout_s=self.timeout_s + WAIT_BACKSTOP_S,
                      describe=lambda: f"{tag.op}: {what} with {peer} at {where} on {self.peers.me}",
                      abort_check=wd.check, op=tag.op, peer=peer, layer=tag.layer, stage=tag.stage)
        except AFDTimeoutError:
            # The watchdog did not report in time (its thread is gone?): report what it would have.
            oldest = wd.oldest()
            if oldest is not None and wd.failure is None:
                wd.fail(wd.timeout_error(oldest, time.monotonic() - oldest.started))
            wd.check()
            raise

    # -- stage streams ---------------------------------------------------------------

    def prepare_stages(self, stages: Sequence[int]) -> None:
        self._stages.prepare(stages)

    def join(self) -> None:
        """Make the caller's current stream wait for every stage stream (no host wait)."""
        self._stages.join()

    # -- data --------------------------------------------------------------------

    def split_back(self, tensors, peers, rows, *, tag: MessageTag) -> PendingSend:
        self.check_health(tag)
        live = [p for p, r in zip(peers, rows) if r > 0]
        if not live:
            return PendingSend()
        comms = [self._comm(p, tag.direction) for p in peers]
        keep = None
        with self._stages.on(tag.stage):
            if self.fp8 and tag.direction == "a2f" and self.peers.role == "attention":
                # One quantize kernel writes the send buffers (stage-stream memory, kept until the reply).
                h = tensors[0]
                keep = [torch.empty(h.shape, dtype=torch.float8_e4m3fn, device=h.device),
                        torch.empty((h.shape[0], h.shape[1] // fp8.GROUP), dtype=torch.float32, device=h.device)]
                self._ops.fp8_quantize(h, keep[0], keep[1], self.fp8_ue8m0)
                tensors = keep + list(tensors[1:])
            self._ops.split_back(tensors, comms, [self._peer_rank] * len(peers), rows)
            self._track("send (split-back)", live, tag)
        return PendingSend(keep=keep)

    def fan_in(self, tensors, peers, rows, *, tag: MessageTag, wait: bool = False, dequant=None) -> None:
        self.check_health(tag)
        live = [p for p, r in zip(peers, rows) if r > 0]
        if not live:
            return
        comms = [self._comm(p, tag.direction) for p in peers]
        with self._stages.on(tag.stage):
            self._ops.fan_in(tensors, comms, [self._peer_rank] * len(peers), rows)
            if dequant is not None:  # the fan-in's bf16 output: one kernel after the receive, same stream
                self._ops.fp8_dequantize(tensors[0], tensors[1], dequant)
            if wait:
                ev = torch.cuda.Event()
                ev.record()
                self.wait_event(ev, "receive (fan-in)", [self.peers.peer_label(p) for p in live], tag,
                                [self.peers.peer_world_rank(p) for p in live])
            else:
                self._track("receive (fan-in)", live, tag)
        self._stages.join((tag.stage,))

    def synchronize(self, what: str, tag: MessageTag) -> None:
        """Join every stage stream into the current stream and wait for it on the host, bounded.

        The wait names the peers of every tracked operation; a stall or a peer
        failure becomes the watchdog's named error instead of a hang in
        ``torch.cuda.synchronize()``.
        """
        self.check_health(tag)
        self.join()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        names: list[str] = []
        ranks: list[int] = []
        for o in self.watchdog.in_flight:
            for name, r in zip(o.peers, o.peer_ranks):
                if r not in ranks:
                    names.append(name)
                    ranks.append(r)
        self.wait_event(ev, what, names or ["no peer (nothing in flight)"], tag, ranks)

    @contextlib.contextmanager
    def capture_guard(self) -> Iterator[None]:
        """Pause the watchdog's event polling: ``cudaEventQuery`` from its thread would invalidate a capture."""
        with self.watchdog.suspended():
            yield

    # -- lifecycle ------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until this rank's in-flight NCCL work completed (the connector's store barrier follows)."""
        self.synchronize("drain", MessageTag("barrier", "a2f", -1, -1, -1))

    def _release(self, *, abort: bool, timeout_s: float) -> list[tuple[threading.Thread, str]]:
        """Release every communicator of this transport, bounded (never raises); see :func:`_release_comms`."""
        comms, self._comms = dict(self._comms), {}
        return _release_comms(self._ops, comms, self.peers.me, abort=abort, timeout_s=timeout_s)

    def _on_watchdog_failure(self, exc: BaseException) -> None:
        self._aborted = True
        self._mark_closed(exc)
        self._release(abort=True, timeout_s=RELEASE_TIMEOUT_S)  # after the watchdog's abort post

    def _post_abort(self, exc: BaseException) -> None:
        if self._signal is not None:
            self._signal.post(exc)

    def abort(self, reason: str) -> None:
        """Abort every communicator now (concurrently, bounded); later calls raise. Idempotent."""
        self._aborted = True
        self._mark_closed(f"aborted: {reason}")
        self.watchdog.stop()
        self._release(abort=True, timeout_s=RELEASE_TIMEOUT_S)

    def close(self, buffers: Sequence[torch.Tensor] = ()) -> None:
        """Release the communicators, bounded in time in every state; never raises.

        Healthy (no failure, no abort): wait for the tracked in-flight operations
        to complete (bounded by ``min(timeout_s, RELEASE_TIMEOUT_S)``), then
        ``comm_destroy`` (bounded; overrun -> abort). After a failure, an abort,
        or with work still in flight: ``comm_abort`` of every communicator
        concurrently (bounded). Nothing here waits on a CUDA stream. When a
        release overran its bound, ``buffers`` (which the stuck kernels may
        still write into) are kept alive for the life of the process.
        """
        self._mark_closed("closed")
        drain_end = time.monotonic() + min(self.timeout_s, RELEASE_TIMEOUT_S)
        wd = self.watchdog
        while wd.in_flight and wd.failure is None and not self._aborted and time.monotonic() < drain_end:
            time.sleep(0.001)
        in_flight = wd.in_flight
        stuck = bool(in_flight) or wd.failure is not None or self._aborted
        if in_flight and wd.failure is None and not self._aborted:
            logger.warning("%s: closing with NCCL work still in flight (%s); aborting the communicators",
                           self.peers.me, in_flight[0].describe())
        wd.stop()
        t0 = time.monotonic()
        n = len(self._comms)
        self._release(abort=stuck, timeout_s=RELEASE_TIMEOUT_S)
        logger.info("%s: closed (%s of %d NCCL communicators) in %.2f s", self.peers.me,
                    "abort" if stuck else "destroy", n, time.monotonic() - t0)
        self._stages.clear()
        left = pending_releases()
        if left and buffers:
            _STUCK_BUFFERS.extend(buffers)
            logger.error("%s: keeping %d fan-in/reply buffers alive: NCCL teardown still running (%s)",
                         self.peers.me, len(buffers), "; ".join(left))
