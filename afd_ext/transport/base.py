"""The transport contract: move consecutive row ranges of wire tensors over edges.

A transport is what differs between data planes (NCCL, gloo, and any later
one such as a CUDA-IPC peer-memory plane); everything else (validation, the
step sequence, offsets, fan-in order, buffers, the control plane) lives once in
:mod:`afd_ext.connector`. The connector calls a transport only through the
methods declared on :class:`Transport`; a transport is built by name through
:func:`afd_ext.transport.create_transport` from one :class:`TransportSetup`.

Two calls carry all data traffic of a step, each on a list of tensors: the
wire parts in wire order (:mod:`afd_ext.wire` states them; a transport never
names one):

* :meth:`Transport.split_back` sends ``rows[i]`` consecutive rows of every
  tensor to ``peers[i]`` (attention -> its FFN peers, and the FFN side
  returning each attention peer its rows of the output).
* :meth:`Transport.fan_in` receives ``rows[i]`` rows from ``peers[i]`` into
  consecutive row ranges of caller-owned tensors.

Peers are role ranks of the *other* role; the transport maps them to world
ranks / communicators. Zero-row peers are skipped (both sides read the same
schedule, so both skip the same messages). Every message of one
(edge, direction) is matched in issue order.

Device transports (CUDA) issue a call ordered after the caller's current
stream and return at once; ``fan_in`` leaves the caller's current stream
ordered after the receive. The stages of a step may overlap: a transport may
run each stage on its own stream (:meth:`Transport.prepare_stages` creates
them outside any CUDA-graph capture).

Strict mode (headers on every message) is a wrapper, chosen at construction:
:class:`afd_ext.transport.strict.StrictTransport`.

Errors (all :class:`~afd_ext.errors.AFDError`; each names op, peer, layer and
stage when known):

* :class:`AFDTimeoutError` - an operation did not complete within the deadline.
* :class:`AFDPeerError` - the peer went away or the link reported an error.
* :class:`AFDProtocolError` - a strict-mode header did not match.
* :class:`AFDTransportClosedError` - the transport was closed or aborted.
* :class:`~afd_ext.errors.StepAbortedError` - another rank posted the abort signal.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

# defined once, in errors.py; re-exported for transports
from ..errors import (AFDConfigError, AFDPeerError, AFDProtocolError, AFDTimeoutError,  # noqa: F401
                      AFDTransportClosedError, AFDTransportError)
from ..topology import rank_label, step_words

__all__ = ["MessageTag", "AFDTransportError", "AFDTimeoutError", "AFDPeerError", "AFDProtocolError",
           "AFDTransportClosedError", "Transport", "TransportSetup", "StepProgress", "PeerMap", "PendingSend",
           "row_offsets"]


class MessageTag(NamedTuple):
    """What an exchange is, for headers, watchdog descriptions and errors.

    Attributes:
        op: the connector call, e.g. ``"send_attn_output"``, ``"recv_ffn_output"``.
        direction: ``"a2f"`` (attention -> FFN wire tensors) or ``"f2a"`` (FFN output back).
        step: this rank's step ordinal, warm-up steps included (diagnostics
            only; orders progress reports; not checked).
        layer: the layer exchange ordinal in the step, ``0..num_layers-1``, or -1 (no exchange).
        stage: the stage id, or -1.
        layer_idx: the runtime's layer index from the transfer context (may
            differ from ``layer`` when only some layers are remote), or -1.
        user_step: the step as the caller counts it (:func:`~afd_ext.topology.step_words`):
            ``N`` for the caller's N-th step since init (the connector's own
            warm-up steps do not count), ``0`` for a warm-up step, -1 when
            unknown (messages then show ``step``).
    """

    op: str
    direction: str
    step: int
    layer: int
    stage: int
    layer_idx: int = -1
    user_step: int = -1

    def step_text(self) -> str:
        """The step in words (:func:`~afd_ext.topology.step_words` of :attr:`user_step`, else of :attr:`step`)."""
        return step_words(self.user_step if self.user_step >= 0 else self.step)

    def where(self) -> str:
        """``"step 3, layer 2, stage 0"`` (plus the runtime layer index when it differs); ``"step 3"`` when no layer."""
        if self.layer < 0:
            return self.step_text()
        s = f"{self.step_text()}, layer {self.layer}"
        if self.layer_idx >= 0 and self.layer_idx != self.layer:
            s += f" (runtime layer_idx {self.layer_idx})"
        return s + f", stage {self.stage}"


def row_offsets(rows: Sequence[int]) -> list[int]:
    """First row of each consecutive range: ``[0, rows[0], rows[0] + rows[1], ...]`` (len == len(rows))."""
    out, off = [], 0
    for r in rows:
        out.append(off)
        off += int(r)
    return out


class PendingSend:
    """Sends of one exchange that may still be in flight.

    Keeps the sent tensors alive until :meth:`wait` returns (gloo sends from the
    caller's memory asynchronously; on a device transport the stream orders
    reuse). ``wait`` is idempotent.
    """

    __slots__ = ("_waiter", "_keep", "done")

    def __init__(self, waiter: Callable[[], None] | None = None, keep: Any = None):
        self._waiter = waiter
        self._keep = keep
        self.done = waiter is None

    def wait(self) -> None:
        """Block (with the transport's deadline and abort checks) until the sends completed."""
        if not self.done:
            waiter, self._waiter = self._waiter, None
            try:
                waiter()
            finally:
                self.done = True
                self._keep = None


@dataclass
class PeerMap:
    """How a transport names ranks: its role/role rank and the topology's sizes."""

    role: str
    role_rank: int
    num_attention_ranks: int
    num_ffn_ranks: int
    #: Per peer (a role rank of the other role): its world rank and its label, computed once here so that
    #: a data call indexes them (:meth:`peer_world_rank`, :meth:`peer_label` say the same).
    peer_world: tuple[int, ...] = field(init=False, repr=False, compare=False)
    peer_labels: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.num_attention_ranks if self.role == "ffn" else self.num_ffn_ranks
        self.peer_world = tuple(self.peer_world_rank(p) for p in range(n))
        self.peer_labels = tuple(self.label(w) for w in self.peer_world)

    @property
    def world_rank(self) -> int:
        return self.role_rank if self.role == "ffn" else self.num_ffn_ranks + self.role_rank

    def peer_world_rank(self, peer: int) -> int:
        """World rank of ``peer`` (a role rank of the other role)."""
        return self.num_ffn_ranks + peer if self.role == "ffn" else peer

    def label(self, world_rank: int) -> str:
        """``"attention rank 1 (world rank 3)"`` (:func:`afd_ext.topology.rank_label`)."""
        return rank_label(world_rank, self.num_ffn_ranks)

    @property
    def me(self) -> str:
        return self.label(self.world_rank)

    def peer_label(self, peer: int) -> str:
        return self.label(self.peer_world_rank(peer))


@dataclass(frozen=True)
class StepProgress:
    """This rank's position in its current step, as the connector's sequencer reports it.

    Read by a transport's stall diagnostics (which peer did not make the
    matching call) from another thread; a snapshot, never mutated.

    Attributes:
        step: the step ordinal (warm-up steps included: it orders reports);
            total: exchanges of the step.
        sent, received: exchanges sent / received so far (attention: sends and
            reply receives; FFN: fan-ins received and replies sent).
        complete: every exchange of the step is done on this rank.
        seq: the step's ``(layer, stage)`` exchange order.
        text: the progress in words (for messages).
        idle_s: seconds since the caller last entered the connector.
        user_step: the step as the caller counts it (:attr:`MessageTag.user_step`).
    """

    step: int
    total: int
    sent: int
    received: int
    complete: bool
    seq: tuple[tuple[int, int], ...]
    text: str
    idle_s: float
    user_step: int = -1


@dataclass
class TransportSetup:
    """Everything a transport may need at construction (one object for every kind).

    Attributes:
        store: the generation's :class:`~afd_ext.rendezvous.AFDStore`.
        topology: the :class:`~afd_ext.topology.Topology`.
        peers: this rank's :class:`PeerMap`.
        device: the device wire tensors live on.
        timeout_s: deadline of one in-flight operation or wait, seconds.
        init_timeout_s: deadline of the whole setup, seconds.
        abort: the generation's :class:`~afd_ext.health.AbortSignal`, or None.
        progress: callable returning this rank's :class:`StepProgress` (None
            outside a step), for stall diagnostics; or None.
        publish_after_s: a rank waiting (or idle mid-step) longer than this
            publishes its progress (transports that diagnose stalls through the
            store), seconds.
        schedule_config: the connector's :class:`~afd_ext.schedule.ScheduleConfig`
            (what travels: sizes buffers of transports that keep their own), or None.
        extra: the connector's :class:`~afd_ext.config.AfdExtConnectorConfig`
            (transport-specific settings, e.g. ``peer_max_tokens``), or None.
    """

    store: Any
    topology: Any
    peers: PeerMap
    device: torch.device
    timeout_s: float
    init_timeout_s: float
    abort: Any = None
    progress: Callable[[], StepProgress | None] | None = None
    publish_after_s: float = 0.0
    schedule_config: Any = None
    extra: Any = None


class Transport(abc.ABC):
    """Moves row ranges of wire tensors between this rank and its peers.

    A subclass sets :attr:`kind` and :attr:`device_type`, implements the
    abstract methods, and overrides the hooks whose default does not fit
    (each default is right for a host transport that completes receives
    before returning). Register it with :func:`afd_ext.transport.register_transport`.

    Attributes:
        kind: the registry name (``"nccl"``, ``"gloo"``, ...).
        device_type: ``"cuda"`` or ``"cpu"``: where wire tensors must live.
        device: the device every wire tensor must be on (``cuda:N`` / ``cpu``).
        peers: the :class:`PeerMap` naming ranks.
        timeout_s: the deadline of one operation, seconds.
    """

    kind: str = "?"
    device_type: str = "cpu"
    #: Attention -> FFN hidden states travel as FP8 (docs/fp8.md): set by :func:`afd_ext.transport.create_transport`
    #: from the setup's schedule config. The attention side's a2f ``split_back`` then quantizes its first
    #: (bf16) tensor into the first two parts (values, scales); the FFN side's ``fan_in`` receives the parts.
    fp8: bool = False
    #: With :attr:`fp8`: the scales are UE8M0 (``fp8_scale_format: "ue8m0"``, rounded up to powers of two).
    fp8_ue8m0: bool = False
    #: Byte alignment the transport's FP8 quantization needs of the bf16 hidden states' first row
    #: (1: none; the CUDA kernels read 8 bytes at a time), checked with the other input checks.
    fp8_hidden_align: int = 1

    def __init__(self, peers: PeerMap, device: torch.device, *, timeout_s: float):
        self.peers = peers
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self._closed: BaseException | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this transport cannot run on this machine, or None when it can (``transport: "auto"`` asks).

        The default (a host transport over CPU tensors) always runs.
        """
        return None

    @classmethod
    @abc.abstractmethod
    def from_setup(cls, setup: TransportSetup) -> "Transport":
        """Build the transport (collective over the AFD world; bounded by ``setup.init_timeout_s``).

        Raises:
            RendezvousTimeoutError: a peer did not arrive in time (named).
            StepAbortedError: another rank's init failed meanwhile.
            AFDError / RuntimeError: the link could not be built.
        """

    # -- checks ------------------------------------------------------------------

    def check_device(self, t: torch.Tensor, name: str) -> None:
        """Raise :class:`~afd_ext.errors.AFDConfigError` (a ``ValueError``) unless ``t`` is on this transport's device (before anything moves)."""
        if t.device != self.device:
            if t.device.type != self.device_type:
                raise AFDConfigError(
                    f"{name} is on {t.device} but the {self.kind} transport moves {self.device_type.upper()} "
                    f"tensors on {self.device}; move it with .to('{self.device}') or configure a transport "
                    f"for {t.device.type} tensors ('nccl': CUDA, 'gloo': CPU)")
            raise AFDConfigError(f"{name} must be on {self.device}, got {t.device}")

    def _check_open(self, tag: MessageTag | None = None) -> None:
        if self._closed is not None:
            where = f" ({tag.op} at {tag.where()})" if tag is not None else ""
            raise AFDTransportClosedError(
                f"the AFD {self.kind} transport of {self.peers.me} is closed{where}: {self._closed}. "
                "Close and re-initialise the connector (init_afd_connector) on every rank.",
                op=None if tag is None else tag.op,
                layer=None if tag is None else tag.layer, stage=None if tag is None else tag.stage,
            ) from None

    def _mark_closed(self, why: BaseException | str) -> None:
        """Make later calls raise (:meth:`_check_open`) with ``why``; an earlier reason (a failure) stands."""
        if self._closed is None:
            self._closed = why if isinstance(why, BaseException) else AFDTransportError(why)

    def check_health(self, tag: MessageTag | None = None) -> None:
        """Raise the pending failure, if any: closed/aborted, an asynchronous error, a posted abort.

        Called by the connector at the start of every call.
        """
        self._check_open(tag)

    # -- data --------------------------------------------------------------------

    @abc.abstractmethod
    def split_back(self, tensors: Sequence[torch.Tensor | None], peers: Sequence[int],
                   rows: Sequence[int], *, tag: MessageTag) -> PendingSend:
        """Send ``rows[i]`` consecutive rows of every tensor to ``peers[i]``.

        Args:
            tensors: the wire parts, a list in wire order (a2f: the attention caller's parts; f2a:
                ``[ffn_output]``); contiguous, on :attr:`device`, leading dim ``sum(rows)``. Not
                modified (device transports may declare them mutated for the compiler).
                With :attr:`fp8` an attention rank's first (bf16) tensor is quantized on the way.
            peers: role ranks of the other role, in range order.
            rows: rows per peer (>= 0; zero-row peers are skipped).
            tag: the exchange (``tag.stage`` picks the stage's stream, if any).

        Returns:
            A :class:`PendingSend`; the caller waits on it before the sent
            memory may be reused, once the exchange is known to be complete.

        Raises:
            AFDTransportError / StepAbortedError: see the module doc.
        """

    @abc.abstractmethod
    def fan_in(self, tensors: Sequence[torch.Tensor | None], peers: Sequence[int],
               rows: Sequence[int], *, tag: MessageTag, wait: bool = False,
               dequant: torch.Tensor | None = None) -> None:
        """Receive ``rows[i]`` rows from ``peers[i]`` into consecutive row ranges of every tensor.

        Host transports return when the data is in the tensors. Device
        transports issue the receive and order the caller's current stream
        after it; ``wait=True`` also waits for it on the host (bounded; used
        for strict-mode headers, which the host reads).

        Args:
            tensors: receive targets (mutated), a list in wire order (with :attr:`fp8`, an FFN
                rank's first two are the FP8 values and their scales).
            peers, rows, tag: as in :meth:`split_back`.
            wait: return only once the data is in the tensors.
            dequant: FP8 fan-in only: also write ``tensors[0]`` dequantized with ``tensors[1]``
                (bf16 ``[sum(rows), hidden]``) here, in the fan-in (docs/fp8.md).

        Raises:
            AFDTransportError / StepAbortedError: see the module doc.
        """

    # -- ordering and waiting (defaults: a host transport, receives complete on return) --

    def prepare_stages(self, stages: Sequence[int]) -> None:
        """Create what issuing on ``stages`` needs (streams, events); called outside any graph capture."""

    def begin_step(self, schedule: Any) -> None:
        """A step's schedule was applied (both sides apply the same one): prepare its stages.

        Called once per step, outside any graph capture, before its first
        exchange. A transport that routes steps by their schedule (the peer
        transport: beyond its capacity over NCCL) decides here.
        """
        self.prepare_stages(schedule.stages)

    def receive_buffers(self, schedule: Any, stage: int) -> dict[str, torch.Tensor] | None:
        """The FFN rank's fan-in buffers of ``stage`` when the transport receives into its own memory.

        Returns:
            :func:`~afd_ext.schedule.stage_buffers`' dict (the tensors the connector then
            passes to :meth:`fan_in`, which receives there without a copy), or
            None: the connector uses its own buffers.
        """
        return None

    def join(self) -> None:
        """Order the caller's current stream after every operation issued so far (no host wait)."""

    def synchronize(self, what: str, tag: MessageTag) -> None:
        """Wait on the host (bounded) until every operation this rank issued has completed.

        Raises:
            AFDTimeoutError / AFDPeerError / StepAbortedError: named after the
                oldest unfinished operation.
        """
        self._check_open(tag)  # a host transport's receives completed before they returned

    def track_replay(self, what: str, tag: MessageTag) -> None:
        """Follow a CUDA-graph replay just launched on the current stream like an eager operation.

        A stalled replay then becomes a named timeout at the deadline. No-op
        for transports that cannot be captured.
        """

    @contextlib.contextmanager
    def capture_guard(self) -> Iterator[None]:
        """Hold off anything that would break a CUDA-graph capture (e.g. event polls) while it runs."""
        yield

    # -- lifecycle -----------------------------------------------------------------

    @abc.abstractmethod
    def barrier(self) -> None:
        """Every rank of the AFD world reaches this point (bounded by the deadline)."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Stop all in-flight work now (callable from any thread); later calls raise. Idempotent."""

    @abc.abstractmethod
    def close(self, buffers: Sequence[torch.Tensor] = ()) -> None:
        """Release the links, bounded in time; never raises. Idempotent; safe after :meth:`abort`.

        Args:
            buffers: memory this transport's receives may still write into. A
                transport whose teardown could not finish keeps them alive for
                the life of the process (never handed to the next generation).
        """
