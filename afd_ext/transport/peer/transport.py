"""The peer-memory transport: CUDA tensors written straight into the peer's memory on one node.

A :class:`~afd_ext.transport.peer.plane.PeerPlane` per rank (docs/peer-memory.md): the
attention side's ``split_back`` is one ``peer_put`` kernel writing its rows
into each FFN peer's fan-in region at its fan-in offset; the FFN side's
``fan_in`` is one ``peer_wait`` kernel, and when the connector's buffers are
the plane's own views (:meth:`PeerTransport.receive_buffers`) no byte is
copied; the FFN side's ``split_back`` is one ``peer_put`` into each attention
peer's reply region; the attention side's ``fan_in`` waits for the reply and
copies it into ``ref_tensor`` in the same kernel.

Routing per step (:meth:`PeerTransport.begin_step`, from the schedule both
sides share): a step whose stages or rows exceed the plane's capacity goes over the NCCL transport built beside the
plane (when ``fallback`` is on), so both sides always pick the same data plane.

Streams: a one-stage step runs on the caller's stream (no extra events); a
step of several stages runs each stage on its own stream forked from and
joined into the caller's, so a stage's wait never holds back another stage's
put (the FFN side may take stage 1's fan-in before it replies to stage 0).

No hang: every device wait has the plane's deadline; the rank's watchdog
(:class:`afd_ext.health.Watchdog`, the NCCL fallback's when there is one)
polls the plane's host-mapped error record and the generation's abort signal
and turns a failure into the named error the next call raises, posting the
abort for the other ranks; a failure or a posted abort ends this rank's
spinning waits at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, Optional, Sequence

import torch

from ...errors import AFDConfigError, AFDTimeoutError
from ...health import Watchdog
from ...schedule import stage_buffers
from .. import nccl
from ..base import MessageTag, PendingSend, Transport, TransportSetup
from ..streams import StageStreams
from ..strict import HEADER_WORDS
from .plane import PeerPlane, WireSpec, open_plane

#: Planes not freed at close because an NCCL teardown still ran (freeing would wait for it without bound).
_KEPT_PLANES: list[PeerPlane] = []

logger = logging.getLogger(__name__)

__all__ = ["PeerTransport", "POLL_S", "WAIT_BACKSTOP_S"]

#: How often a watchdog of its own (no NCCL fallback) reads the plane's error record, seconds.
POLL_S = 0.002
#: A host wait gives up this long after the deadline if the device did not report first.
WAIT_BACKSTOP_S = 2.0


class PeerTransport(Transport):
    """Moves row ranges of CUDA tensors through peer memory (CUDA IPC), NCCL for steps beyond capacity.

    Built by :meth:`from_setup` (collective; raises
    :class:`~afd_ext.errors.PeerMemoryUnavailableError` on every rank when any
    rank cannot open a peer's region or complete the flag round trip).

    Attributes:
        plane: this rank's :class:`~afd_ext.transport.peer.plane.PeerPlane`.
        fallback: the NCCL transport for steps beyond the plane's capacity, or None.
        step_kind: ``"peer"`` or ``"nccl"``: the data plane of the current step.
    """

    kind = "peer"
    fp8_hidden_align = 8
    device_type = "cuda"

    @classmethod
    def unavailable(cls) -> str | None:
        """NCCL's answer: the plane's flag probe and its fallback need a CUDA build and a visible GPU."""
        return nccl.NcclTransport.unavailable()

    def __init__(self, setup: TransportSetup, plane: PeerPlane, fallback: Optional[Transport] = None):
        super().__init__(setup.peers, plane.device, timeout_s=setup.timeout_s)
        self.plane = plane
        self.fallback = fallback
        self.step_kind = "peer"
        self._signal = setup.abort
        self._schedule: Any = None
        self._stages = StageStreams(self.device)
        self._stages.separate = False  # until a step of several stages is prepared
        self._dequant: dict[int, torch.Tensor] = {}  # stage -> the FP8 fan-in's bf16 output (capacity rows)
        # One health thread per rank: the fallback's watchdog also polls the plane, else one of our own.
        self.watchdog = fallback.watchdog if fallback is not None else Watchdog(
            setup.timeout_s, owner=self.peers.me, poll_interval_s=POLL_S,
            post=None if self._signal is None else self._signal.post,
            abort_check=None if self._signal is None else lambda: self._signal.check("peer-memory exchange"),
            calls=None if self._signal is None else self._signal.calls)
        # On a failure (posted first), every spinning wait of this rank returns at once.
        self.watchdog.watch(lambda wd, now: self.plane.failure(), lambda exc: self.plane.abort())
        self.watchdog.start()

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> "PeerTransport":
        """Open the plane (collective, proven by a flag round trip) and, with ``peer_fallback``, the NCCL links.

        Settings come from ``setup.extra`` (``peer_max_tokens``, ``peer_stages``,
        ``peer_fallback``); what travels from ``setup.schedule_config``.

        Raises:
            PeerMemoryUnavailableError: on every rank, when any rank cannot open a
                peer's memory or complete the round trip (``auto`` then uses NCCL).
            AFDConfigError: the setup lacks the schedule config.
        """
        cfg, extra = setup.schedule_config, setup.extra
        if cfg is None:
            raise AFDConfigError("the peer transport needs the connector's schedule config in its setup")
        max_tokens = int(getattr(extra, "peer_max_tokens", 8192))
        stages = int(getattr(extra, "peer_stages", 2))
        with_fallback = bool(getattr(extra, "peer_fallback", True))
        spec = WireSpec.of(cfg)
        # No CUDA call before the collective set-up: a rank without a usable GPU must still
        # publish its verdict there, or its peers would wait for it until the init deadline.
        device = setup.device if setup.device.index is not None else torch.device("cuda", 0)
        # setup.timeout_s is already longer on attention ranks (the connector's data_timeout_s),
        # so the FFN rank, which sees which attention peer did not send, expires first.
        plane = open_plane(setup.store, setup.topology, setup.peers.role, setup.peers.role_rank, spec,
                           max_tokens=max_tokens, num_stages=stages, device=device, timeout_s=setup.timeout_s,
                           setup_timeout_s=setup.init_timeout_s)
        fallback = None
        try:
            if with_fallback:
                fallback = nccl.NcclTransport.from_setup(setup)
        except BaseException:
            plane.close()
            raise
        logger.info("%s: peer-memory plane ready (%d stages x %d tokens per attention rank, %.1f MB here)%s",
                    setup.peers.me, stages, max_tokens, plane.layout.nbytes / 1e6,
                    ", NCCL for larger steps" if fallback is not None else "")
        return cls(setup, plane, fallback)

    # -- failure ---------------------------------------------------------------

    def check_health(self, tag: MessageTag | None = None) -> None:
        # The watchdog reads the error record every POLL_S: no op call on the hot path.
        self.watchdog.check()
        self._check_open(tag)
        if self.fallback is not None:
            self.fallback.check_health(tag)

    # -- routing and streams ------------------------------------------------------------

    def fits(self, schedule: Any) -> bool:
        """Whether every exchange of ``schedule`` fits the plane (stages, rows)."""
        plane = self.plane
        return all(0 <= s < plane.num_stages and max(schedule.rows_vector(s), default=0) <= plane.max_tokens
                   for s in schedule.stages)

    def begin_step(self, schedule: Any) -> None:
        """Pick this step's data plane from the schedule (both sides pick the same) and its streams."""
        self._schedule = schedule
        use_plane = self.fits(schedule)
        if not use_plane and self.fallback is None:
            raise AFDConfigError(
                f"{self.peers.me}: a step with {len(schedule.stages)} stage(s) does not fit the peer-memory plane "
                f"({self.plane.num_stages} stages, {self.plane.max_tokens} tokens per attention rank) "
                "and the NCCL fallback is off; raise peer_max_tokens / max_stages or enable peer_fallback")
        self.step_kind = "peer" if use_plane else "nccl"
        if use_plane:
            self.prepare_stages(schedule.stages)
        if self.fallback is not None:  # NCCL steps, and strict-mode headers of plane steps
            self.fallback.begin_step(schedule)

    def prepare_stages(self, stages: Sequence[int]) -> None:
        # A one-stage step stays on the caller's stream: no fork/join events to pay for.
        self._stages.separate = len(stages) > 1
        if self._stages.separate:
            self._stages.prepare(stages)

    def join(self) -> None:
        if self.fallback is not None:
            self.fallback.join()
        self._stages.join()

    # -- data --------------------------------------------------------------------------

    def _targets(self, stage: int, peers: Sequence[int], rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """Rows and destination rows of a put to every plane peer (zero for peers the call omits)."""
        plane, sch, me = self.plane, self._schedule, self.peers.role_rank
        given = dict(zip(peers, rows))
        out_rows, dst = [], []
        for p in plane.peers:
            out_rows.append(int(given.get(p, 0)))
            if plane.role == "attention":  # my offset in FFN rank p's fan-in
                fp = sch.ffn_plan(stage, p)
                dst.append(fp.offsets[fp.peers.index(me)])
            else:  # the start of my share in attention rank p's rows
                ap = sch.attention_plan(stage, p)
                dst.append(ap.offsets[ap.peers.index(me)])
        return out_rows, dst

    def _nccl_for(self, tensors) -> bool:
        """Whether this call goes over the NCCL fallback: a step beyond capacity, or a strict-mode header block."""
        if self.step_kind == "nccl":
            return True
        t = tensors[0]
        if len(tensors) == 1 and t.dtype == torch.int64 and t.dim() == 2 and t.shape[1] == HEADER_WORDS:
            if self.fallback is None:
                raise AFDConfigError("strict mode over the peer transport sends its headers over NCCL: enable "
                                     "peer_fallback, or turn strict off")
            return True
        return False

    def split_back(self, tensors, peers, rows, *, tag: MessageTag) -> PendingSend:
        if self._nccl_for(tensors):
            return self.fallback.split_back(tensors, peers, rows, tag=tag)
        self.check_health(tag)
        out_rows, dst = self._targets(tag.stage, peers, rows)
        with self._stages.on(tag.stage):
            self.plane.put(tag.stage, tensors, out_rows, dst)
        return PendingSend()

    def receive_buffers(self, schedule: Any, stage: int) -> Optional[dict[str, torch.Tensor]]:
        """The FFN rank's fan-in buffers of ``stage``: views of the plane's region (zero copy), or None."""
        if self.plane.role != "ffn" or not self.fits(schedule):
            return None
        n = schedule.ffn_plan(stage, self.peers.role_rank).total
        views = dict(zip([p.name for p in schedule.config.wire_parts], self.plane.views(stage, n)))

        def alloc(key, shape, dtype):  # the plane's parts; an FP8 fan-in's bf16 output is ours
            if key[0] in views:
                return views[key[0]]
            if stage not in self._dequant:
                self._dequant[stage] = torch.empty((self.plane.layout.capacity_rows,) + tuple(shape[1:]),
                                                   dtype=dtype, device=self.device)
            return self._dequant[stage][:shape[0]]

        return stage_buffers(alloc, schedule.config, stage, n, fan_in=True)

    def fan_in(self, tensors, peers, rows, *, tag: MessageTag, wait: bool = False, dequant=None) -> None:
        if self._nccl_for(tensors):
            return self.fallback.fan_in(tensors, peers, rows, tag=tag, wait=wait, dequant=dequant)
        self.check_health(tag)
        n = int(sum(rows))
        plane = self.plane
        with self._stages.on(tag.stage):
            if plane.role == "attention":
                plane.wait(tag.stage, n, layer=tag.layer, out=tensors[0])
            else:
                views = plane.wait(tag.stage, n, layer=tag.layer, out=dequant)  # FP8: dequantized in the wait
                for t, v in zip(tensors, views):
                    if t.data_ptr() != v.data_ptr():
                        t.copy_(v)  # the caller's own buffers: one copy (receive_buffers avoids it)
        self._stages.join((tag.stage,))
        if wait:
            self.synchronize("receive (fan-in)", tag)

    # -- waiting -----------------------------------------------------------------------

    def synchronize(self, what: str, tag: MessageTag) -> None:
        """Join the stage streams and wait on the host, bounded by the device deadlines (plus a backstop)."""
        self.check_health(tag)
        self.join()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        end = time.monotonic() + self.plane.timeout_ns / 1e9 + WAIT_BACKSTOP_S
        while not ev.query():
            self.check_health(tag)  # the watchdog polls the plane's error record
            if time.monotonic() >= end:
                peers = ", ".join(self.peers.peer_label(p) for p in self.plane.peers)
                err = AFDTimeoutError(
                    f"AFD {self.peers.me}: {tag.op}: {what} did not complete within {self.timeout_s:g} s at "
                    f"{tag.where()} (peers {peers}) and the device reported no deadline: the GPU is stuck "
                    "behind other work", op=tag.op, peer=peers, layer=tag.layer if tag.layer >= 0 else None,
                    stage=tag.stage if tag.stage >= 0 else None)
                self.watchdog.fail(err)
                raise err
            time.sleep(0.0002)
        # The device writes its error record before the wait kernel returns: read it once the work
        # is done, not only while waiting (the watch thread may not have polled yet).
        err = self.plane.failure()
        if err is not None:
            self.watchdog.fail(err)
        self.check_health(tag)

    def track_replay(self, what: str, tag: MessageTag) -> None:
        # Device-side deadlines cover the plane inside a replay; the watchdog reports them.
        if self.step_kind == "nccl":
            self.fallback.track_replay(what, tag)

    @contextlib.contextmanager
    def capture_guard(self) -> Iterator[None]:
        # The plane's poll reads host memory only (no CUDA call), so it may run during a capture.
        with self.fallback.capture_guard() if self.fallback is not None else contextlib.nullcontext():
            yield

    # -- lifecycle -----------------------------------------------------------------------

    def barrier(self) -> None:
        self.synchronize("drain", MessageTag("barrier", "a2f", -1, -1, -1))
        if self.fallback is not None:
            self.fallback.barrier()

    def abort(self, reason: str) -> None:
        self._mark_closed(f"aborted: {reason}")
        self.plane.abort()
        if self.fallback is not None:
            self.fallback.abort(reason)

    def close(self, buffers: Sequence[torch.Tensor] = ()) -> None:
        self._mark_closed("closed")
        if self.fallback is None:
            self.watchdog.stop(1.0)
        else:
            try:
                self.fallback.close(buffers)  # first: its kernels must not hold the device sync below
            except Exception as e:  # noqa: BLE001 - close never raises
                logger.warning("%s: closing the NCCL fallback: %s", self.peers.me, e)
        left = nccl.pending_releases() if self.fallback is not None else []
        if left:  # its cudaFree waits for the whole device, where an overrunning NCCL abort still runs
            self.plane.abort()
            _KEPT_PLANES.append(self.plane)
            logger.error("%s: keeping the peer-memory plane for the process's life: NCCL teardown still running "
                         "(%s)", self.peers.me, "; ".join(left))
        else:
            try:
                self.plane.close()  # aborts first: every wait returns, then the device sync is short
            except Exception as e:  # noqa: BLE001
                logger.warning("%s: closing the peer-memory plane: %s", self.peers.me, e)
        self._stages.clear()
