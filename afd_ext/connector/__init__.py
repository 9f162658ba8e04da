"""The connector: the reference vLLM AFD plugin's contract over any registered transport.

:class:`AFDConnector` is a drop-in for the reference's ``P2pNcclAFDConnector``
(same constructor shape, same four data calls, ``init_afd_connector``,
``close``, ``is_initialized``, ``control_plane``), registered as
``"AfdExtConnector"`` (and the reference's name) in :mod:`afd_ext.factory`.
It is a facade: the attention side (:mod:`.attention`) and the FFN side
(:mod:`.ffn`) hold the data paths, the pure :mod:`.sequencer` the step order,
:mod:`.buffers` the per-stage buffers, and the transport
(:mod:`afd_ext.transport`, chosen by name) everything link-specific. The
protocol, its ordering rules and what happens after a failure are described
once, in ``docs/internals.md`` ("connector/").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch

from .. import rendezvous as rdzv
from .. import wire
from ..config import AFDConfig
from ..control import AFDControlPlane
from ..errors import AFDConfigError, ConnectorStateError
from ..metadata import AFDA2FTransferPayload, AFDControlPayload, AFDExpertRoutingSpec, AFDTransferContext
from ..schedule import StepSchedule, build_step_schedule, schedule_config, warmup_payload
from ..spec import SPEC_KWARGS, ExchangeSpec
from ..topology import Topology
from ..transport import select_transport, transport_class
from ..transport.base import PeerMap, Transport
from ..transport.strict import HEADER_VERSION
from .attention import AttentionSide
from .buffers import BufferPool
from .ffn import FFNSide
from .session import Session
from .step import AfdExtTransferState

logger = logging.getLogger(__name__)

__all__ = [
    "CONNECTOR_FORMAT_VERSION",
    "AFDConnector",
    "AfdExtTransferState",
    "ConnectorStateError",
]

#: Version of the data-plane protocol (exchange order, header layout, wire
#: formats); checked in the init handshake.
CONNECTOR_FORMAT_VERSION = 3  # 2: the packed wire format is gone; 3: the data ops take the wire parts as a list

_MODEL_KWARGS = SPEC_KWARGS + ("device", "warmup_on_init")


def _pick_device(kind: str, local_rank: int, override: Any) -> torch.device:
    """``override``, else ``cpu`` / ``<type>:local_rank`` for transport ``kind``; checked against the transport.

    Raises:
        AFDConfigError: the device type is not the one the transport moves.
    """
    if kind == "auto":  # the device decides: gloo for CPU tensors, a CUDA transport otherwise
        device_type = (torch.device(override).type if override is not None
                       else "cuda" if torch.cuda.is_available() else "cpu")
    else:
        device_type = transport_class(kind).device_type
    if override is not None:
        device = torch.device(override)
    else:
        device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, int(local_rank))
    if device.type != device_type:
        raise AFDConfigError(f"the {kind} transport moves {device_type.upper()} tensors; device must be "
                             f"{device_type}{':N' if device_type != 'cpu' else ''}, got {device}")
    return device


class AFDConnector:
    """The AFD connector (reference-compatible) over an NCCL, a gloo or any registered transport.

    Args:
        rank: the runtime's world rank (informational, as in the reference).
        local_rank: CUDA device index of this process (CUDA transports).
        config: the :class:`~afd_ext.config.AFDConfig` (role, host, port, A, F,
            ``connector_extra_config``).
        role_rank: this process's index inside its role (``0..A-1`` / ``0..F-1``).
        **kwargs: model facts (:class:`~afd_ext.spec.ExchangeSpec`: ``hidden_size``,
            ``num_layers``, ``dtype``, ``router_logits_width``, ``router_logits_dtype``,
            ``routing_spec``, ``send_token_ids``, ``tp_size``, ``vllm_config``), plus
            ``device`` (override) and ``warmup_on_init`` (default True).

    The transport is :func:`afd_ext.transport.select_transport` of
    ``connector_extra_config.transport`` (default ``"auto"``) and ``device``:
    CPU tensors or no usable GPU give gloo, CUDA tensors or a visible GPU
    with a CUDA build give NCCL. Construction is device-light (no
    communication; only ``"auto"`` without ``device`` counts the visible GPUs).

    Raises:
        TypeError: an unknown keyword argument.
        AFDConfigError: a missing or invalid model fact, a role rank out of range.
    """

    #: The reference's class attributes (``control_plane`` non-None: FFN steps are payload-driven).
    attn_size: int = 0
    ffn_size: int = 0

    def __init__(self, rank: int, local_rank: int, config: AFDConfig, role_rank: int, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(_MODEL_KWARGS))
        if unknown:
            raise TypeError(f"AFDConnector got unknown keyword argument(s) {unknown}; known: {list(_MODEL_KWARGS)}")
        if not isinstance(config, AFDConfig):
            raise TypeError(f"config must be an afd_ext.config.AFDConfig, got {type(config).__name__}")
        self.rank = rank
        self.local_rank = local_rank
        self.config = config
        self.afd_config = config
        self.role = config.role
        self.role_rank = role_rank
        self.extra = config.extra_config()
        self.spec = ExchangeSpec.from_kwargs(kwargs, role=config.role,
                                             compute_gate_on_attention=config.compute_gate_on_attention)
        self.topology = Topology(config.num_attention_ranks, config.num_ffn_ranks, self.spec.tp_size)
        self.topology.check_role_rank(self.role, role_rank)
        self.attn_size = config.num_attention_ranks
        self.ffn_size = config.num_ffn_ranks
        self.world_rank = self.topology.world_rank(self.role, role_rank)
        self.world_size = self.topology.world_size
        # The one selection rule (explicit name, else the tensors' device, else the machine), logged once.
        self.transport_kind = select_transport(self.extra.transport, kwargs.get("device")).name
        self.warmup_on_init = bool(kwargs.get("warmup_on_init", True))
        self.device = _pick_device(self.transport_kind, local_rank, kwargs.get("device"))
        self.schedule_config = schedule_config(self.spec, self.extra)
        self.peer_map = PeerMap(self.role, role_rank, self.attn_size, self.ffn_size)
        self._buffers = BufferPool(self.role, role_rank, self.device)
        self._s = Session(self.peer_map.me, self.role, self.extra.strict, self._buffers)
        # Kept across close() / init_afd_connector(): init opens its channels, close closes them.
        self.control_plane = AFDControlPlane(self._apply_payload, self.topology, self.role, role_rank,
                                             label=self.peer_map.me, check_send=self._s.check_sent)
        self._attention = AttentionSide(self._s, role_rank, self.device) if self.role == "attention" else None
        self._ffn = FFNSide(self._s, role_rank, self.device) if self.role == "ffn" else None

    # ------------------------------------------------------------------ facts

    hidden_size = property(lambda self: self.spec.hidden_size, doc="Hidden states width.")
    num_layers = property(lambda self: self.spec.num_layers, doc="Layer exchanges per stage per step.")
    dtype = property(lambda self: self.spec.dtype, doc="Wire dtype of the hidden states.")
    router_logits_width = property(lambda self: self.spec.router_logits_width, doc="Router logits width or None.")
    router_logits_dtype = property(lambda self: self.spec.router_logits_dtype, doc="Router logits dtype.")
    send_token_ids = property(lambda self: self.spec.send_token_ids, doc="Token ids travel a2f.")

    @classmethod
    def parse_extra_config(cls, raw: Any):
        """The reference's hook: parse ``connector_extra_config`` (see :class:`~afd_ext.config.AfdExtConnectorConfig`).

        Raises:
            TypeError / ValueError: not a mapping, unknown field, bad value.
        """
        from ..config import AfdExtConnectorConfig

        return AfdExtConnectorConfig.from_mapping(raw)

    @property
    def is_initialized(self) -> bool:
        """True between a successful :meth:`init_afd_connector` and :meth:`close`."""
        return self._s.initialized

    @property
    def links_id(self) -> int:
        """Which links this connector runs on: its count of successful inits (0 before the first).

        Every ``init_afd_connector`` after a ``close`` builds new communicators and peer buffers,
        so a CUDA graph captured under another value must not be replayed (:meth:`afd_ext.graphs.GraphController.follow`).
        """
        return self._s.opens

    @property
    def data_timeout_s(self) -> float:
        """Deadline of one data-plane wait or in-flight operation on this rank, seconds.

        FFN ranks use ``step_timeout_s``; attention ranks ``step_timeout_s +
        min(5, step_timeout_s / 2)``, so when an attention rank goes silent the
        FFN rank expires first, names it, and posts the abort the others report.
        """
        t = self.extra.step_timeout_s
        return t if self.role == "ffn" else t + min(5.0, t / 2)

    @property
    def publish_after_s(self) -> float:
        """Seconds of waiting (or idling mid-step) after which this rank publishes its progress.

        ``0.4 * data_timeout_s``: below every rank's deadline, so a peer's
        report is there when an operation waiting on it expires.
        """
        return 0.4 * self.data_timeout_s

    def handshake_fields(self) -> dict[str, Any]:
        """What every rank must agree on at init (checked field by field, both values named on mismatch)."""
        return {
            "format_version": CONNECTOR_FORMAT_VERSION,
            "header_version": HEADER_VERSION,
            "num_attention_ranks": self.attn_size,
            "num_ffn_ranks": self.ffn_size,
            **self.spec.handshake_fields(),
            "clamp_idle_to_one": self.extra.clamp_idle_to_one,
            "strict": self.extra.strict,
            "hidden_wire_dtype": self.extra.hidden_wire_dtype,
            "fp8_scale_format": self.extra.fp8_scale_format,
            # The wire parts both ways (afd_ext.wire), so a part declared on one role only is refused.
            "wire": wire.handshake_field(self.schedule_config),
            "transport": self.extra.transport,
            "max_stages": self.extra.max_stages,
            # Both roles' graph caches must evict the same graphs (same captures, same replays).
            "graph_cache_size": self.extra.graph_cache_size,
        }

    # ------------------------------------------------------------------ lifecycle

    def init_afd_connector(self) -> None:
        """Meet every other rank and build the transport and control channels (collective; idempotent).

        Steps: join the rendezvous store hosted by FFN rank 0 at ``host:port``
        (the store's current generation, or the next when it is over: docs/internals.md), the handshake
        (:meth:`handshake_fields`), the transport
        (:func:`afd_ext.transport.create_transport`), the control channels,
        then :meth:`warmup` unless ``warmup_on_init=False``.

        Re-initialising is also how a rank meets a restarted peer (docs/internals.md, "Restarting one
        role"): after a failed step or a peer's goodbye, ``close()`` then ``init_afd_connector()``
        waits up to ``init_timeout_s`` for the restarted process, naming it at WARNING every interval;
        a ``close()`` on another thread ends that wait at once (:class:`~afd_ext.errors.AFDClosedError`).

        Raises:
            HandshakeMismatchError: a peer disagrees on a field (named, with both values).
            RendezvousTimeoutError / RendezvousError: a rank did not arrive, address problems.
            AFDClosedError: ``close()`` was called on another thread meanwhile.
            RuntimeError: NCCL failures.
            On any failure everything built so far is released; the call may be retried.
        """
        if self._s.initialized:
            return
        try:
            self._s.open(self, self.control_plane)
            if self.warmup_on_init:
                self.warmup()
        except BaseException:
            self._teardown()
            raise

    def close(self) -> None:
        """Release everything (idempotent; safe after a partial init or an abort).

        Order: step state and buffers first, then the control channels, then
        the transport. A step still incomplete is ended on every rank first:
        the peers' calls raise :class:`~afd_ext.errors.PeerClosedError` naming
        this rank (a close, not a failure), and a call of this rank still in
        flight on another thread raises :class:`~afd_ext.errors.AFDClosedError`.
        After an abort it does not wait for the peers' teardown. Leaves
        :attr:`is_initialized` False; :meth:`init_afd_connector` may be called again.
        """
        self._teardown()

    def _teardown(self) -> None:
        self._s.close(self.control_plane, self._ffn)

    # ------------------------------------------------------------------ plumbing

    def _side(self, role: str, op: str) -> Any:
        side = self._attention if role == "attention" else self._ffn
        if side is None:
            raise ConnectorStateError(f"{op} is an {role}-side call; this connector is {self.peer_map.me}")
        return side

    # ------------------------------------------------------------------ steps

    def use_static_arena(self, arena: Any) -> None:
        """Take every buffer from ``arena`` (a :class:`afd_ext.graphs.StaticArena`) from now on, or stop (None).

        For CUDA-graph capture: apply the capture step's payload with the arena
        set, so its buffers are reserved at the captured sizes before capture;
        the arena never moves them (a missing one raises ``GraphBufferError``).
        """
        self._buffers.use_arena(arena)

    def _apply_payload(self, payload: Any) -> None:
        """``control_plane.update_state_from_dp_metadata``: validate, drain an abandoned step, build, allocate.

        ``payload``: an ``AFDControlPayload`` or any object with its fields (the reference's class).
        Raises ValueError (invalid payload; nothing moved) or ConnectorStateError (not usable, or the
        previous step is incomplete mid-way: then aborted on every rank); docs/internals.md, "Errors".
        """
        payload = AFDControlPayload.from_fields(payload)
        self._s.next_step(payload, lambda p: build_step_schedule(self.topology, p, self.schedule_config),
                          drain=None if self._attention is None else self._attention.drain,
                          settle=None if self._ffn is None else self._ffn.settle)

    # ------------------------------------------------------------------ the reference's data calls

    def send_attn_output(self, hidden_states: torch.Tensor, context: AFDTransferContext,
                         router_logits: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                         **kwargs: Any) -> None:
        """Attention side: send this rank's rows of one (layer, stage) to its FFN peer(s).

        Args:
            hidden_states: ``[rows, hidden_size]`` of the configured dtype,
                contiguous, on the transport's device; ``rows`` is this rank's
                count for the stage in the step's payload (0 allowed). Not
                modified; must stay unchanged until ``recv_ffn_output`` of this
                exchange (the reply may land in it).
            context: the transfer context; ``metadata.stage_idx`` is the stage (an int;
                an integral float such as ``0.0`` is taken), ``metadata.layer_idx``
                an int in ``[0, 2**31)``, ``metadata.total_tokens`` must equal ``rows``.
            router_logits: ``[rows, router_logits_width]`` of the configured
                dtype, iff router logits were configured.
            input_ids: ``[rows]`` int32, iff ``send_token_ids`` was configured.
            **kwargs: the keyword of a part declared with :func:`afd_ext.wire.declare_part` carries
                that part (``[rows, *cols]`` of its dtype); any other is ignored (reference extensions).

        Raises:
            AFDConfigError: a bad input or stage, naming the call,
                the step, the layer and the stage; raised on this rank only before
                anything of the call is sent: repeat the call corrected (or, at the
                step's first exchange, apply the next payload: docs/internals.md).
            ConnectorStateError: not initialised / aborted / no step applied / nothing due, or the
                reply of this stage's previous layer was not received yet (one exchange per stage in
                flight; on this rank only, nothing sent: call ``recv_ffn_output`` first).
            AFDTransportError, StepAbortedError: transport failure (the step is aborted everywhere).

        CUDA graphs: capturable (stage stream forked from the current stream;
        no allocation, no host sync outside strict mode).
        """
        (self._attention or self._side("attention", "send_attn_output")).send_attn_output(
            hidden_states, context, router_logits, input_ids, **kwargs)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """Attention side: receive the FFN output of the oldest outstanding exchange into ``ref_tensor``.

        Args:
            ref_tensor: ``[rows, hidden_size]`` of the configured dtype,
                contiguous, on the transport's device (mutated: the reply lands
                in it). May be the ``hidden_states`` just sent (the reference's
                usage).
            ubatch_idx: the stage, an int (an integral float such as ``0.0`` is
                taken; ``None``, strings and bools are not); must be the stage of the
                oldest exchange whose reply is due (replies come back layer-major, stage-minor).
            **kwargs: ignored.

        Returns:
            ``ref_tensor``. On NCCL the caller's current stream is made to wait
            for the reply, so any later work on it sees the data.

        Raises:
            AFDConfigError / ConnectorStateError: bad ``ref_tensor``,
                ``ubatch_idx`` or call order, named with the step, layer and stage; raised
                on this rank only, nothing received: repeat the call corrected.
            AFDTransportError, StepAbortedError: transport failure (the step is aborted everywhere).
        """
        side = self._attention or self._side("attention", "recv_ffn_output")  # a call only on the wrong role
        return side.recv_ffn_output(ref_tensor, ubatch_idx)

    def abandon_step(self) -> None:
        """Attention side: finish the current step without data after a rejected first exchange.

        Sends zeros of the scheduled shapes for every remaining exchange and
        discards the replies, so the FFN ranks and the other attention ranks
        complete the step. ``update_state_from_dp_metadata`` does this by
        itself when a new step starts; call it directly to free the peers
        earlier. A no-op when the step is complete or was not abandoned.

        Raises:
            ConnectorStateError: the step has already sent data (it cannot be
                abandoned; abort instead), or the connector is unusable.
        """
        if self._attention is not None:
            self._attention.abandon_step()

    def recv_attn_output(self, ubatch_idx: int = 0, routing_spec: AFDExpertRoutingSpec | None = None,
                         recv_input_ids: bool = False, **kwargs: Any) -> AFDA2FTransferPayload:
        """FFN side: fan-in every attention peer's rows of the next (layer, stage) into one tensor.

        Args:
            ubatch_idx: the stage, an int (an integral float such as ``0.0`` is taken;
                ``None``, strings and bools are not); must be the next exchange's stage
                (layer-major, stage-minor).
            routing_spec: None or an ``AFDExpertRoutingSpec`` (the reference's class
                too: an int ``router_logits_width``, a ``torch.dtype`` ``router_logits_dtype``); when
                given it must equal the configured width and dtype. Router
                logits travel iff they were configured at init (checked in the
                handshake), whether or not this is given.
            recv_input_ids: a bool: the model wants token ids; requires ``send_token_ids``
                at init. Configured token ids are returned either way.
            **kwargs: ignored.

        Returns:
            ``AFDA2FTransferPayload``: ``hidden_states`` ``[total, hidden_size]``
            (every peer's rows, in fan-in order), ``router_logits`` ``[total,
            width]`` or None, ``input_ids`` ``[total]`` int32 or None, and a
            context whose ``metadata.seq_lens`` are the per-peer rows (zeros
            included) and ``metadata.layer_idx`` the exchange ordinal. The
            tensors are views of the connector's per-stage buffer, valid until
            the next ``recv_attn_output`` of this stage.

        Raises:
            AFDConfigError / ConnectorStateError: a ``ubatch_idx``, ``routing_spec`` or
                ``recv_input_ids`` of a wrong type or value, a wrong call order or a spec
                that differs from the configuration, named with the argument, the step,
                layer and stage, or the reply of this stage's previous layer not sent yet (one
                exchange per stage in flight); raised on this rank only, nothing received.
            AFDTransportError, StepAbortedError: transport failure (a dead
                peer is named with the layer and stage).
        """
        side = self._ffn or self._side("ffn", "recv_attn_output")
        return side.recv_attn_output(ubatch_idx, routing_spec, recv_input_ids)

    def send_ffn_output(self, ffn_output: torch.Tensor, context: AFDTransferContext, **kwargs: Any) -> None:
        """FFN side: return each attention peer its rows of ``ffn_output`` (split-back).

        Args:
            ffn_output: ``[total, hidden_size]`` of the configured dtype,
                contiguous, on the transport's device; ``total`` is the fan-in's
                row count. Row ranges are sent as views (no copy); do not
                overwrite it before the next ``recv_attn_output`` of this stage.
            context: the context returned by the matching ``recv_attn_output``.
            **kwargs: ignored (e.g. ``ubatch_idx``).

        Raises:
            AFDConfigError / ConnectorStateError: bad output
                (shape, rows, dtype, device, layout) or context, named with the step,
                layer and stage; raised on this rank only, nothing sent: repeat the
                call with the right tensor and the step completes on every rank.
            AFDTransportError, StepAbortedError: transport failure.
        """
        (self._ffn or self._side("ffn", "send_ffn_output")).send_ffn_output(ffn_output, context)

    # ------------------------------------------------------------------ warm-up, synchronize, graphs

    def warmup(self, num_stages: int = 1) -> None:
        """Send real traffic over every edge and direction (collective: every rank calls it).

        One internal step of one layer: each attention rank sends one row per
        FFN peer per stage (:func:`afd_ext.schedule.warmup_payload`) and the FFN
        ranks reply with what they received. NCCL builds its connections lazily
        on first use, which must not happen inside a CUDA-graph capture, so run
        this before the first capture (``init_afd_connector`` runs it unless
        ``warmup_on_init=False``). No control-plane traffic.

        Raises:
            ConnectorStateError: a step is in progress, or not initialised.
            AFDProtocolError: the echoed rows differ from what was sent.
            AFDTransportError, StepAbortedError: transport failure.
        """
        op = "warmup"
        s = self._s
        s.check_usable(op)
        if s.step is not None and not s.step.seq.complete:
            raise ConnectorStateError(f"{op} on {self.peer_map.me}: {s.step.seq.label} is in progress")
        payload = warmup_payload(self.topology, num_stages)
        cfg = dataclasses.replace(self.schedule_config, num_layers=1)
        st = s.start_step(build_step_schedule(self.topology, payload, cfg), payload, warmup=True)
        try:
            (self._attention or self._ffn).warmup(st, op, self.synchronize)
        finally:
            if s.step is st:
                s.step = None

    def synchronize(self) -> None:
        """Wait until every exchange this rank issued has completed (bounded), then return.

        NCCL: joins the stage streams into the current stream and waits for it
        on the host with the data deadline, so a stall or a peer failure
        becomes the watchdog's named error instead of a hang in
        ``torch.cuda.synchronize()``. gloo: receives are already complete.

        Then (NCCL) it checks the abort signal once (one store round trip): when
        another rank aborted the step, the replies just completed may come
        from an incomplete fan-in (docs/internals.md), so the step ends with
        the abort here too.

        Raises:
            AFDTransportError, StepAbortedError: the named failure (the step is aborted everywhere).
        """
        op = "synchronize"
        s = self._s
        tr = s.check_usable(op)
        where = s.step.seq.progress() if s.step is not None else "no step"
        s.transport_call(tr.synchronize, f"wait for every exchange issued ({where})", s.tag(op))
        if s.signal is None:
            return
        try:
            s.signal.check(op)
        except rdzv.StepAbortedError as e:
            s.fail_step(e)
            raise
        except Exception as e:  # noqa: BLE001
            # The store is gone (FFN rank 0 exited after its last step, or died): nothing
            # to learn here; a real failure reaches this rank through its transport.
            logger.debug("%s: synchronize could not read the abort signal: %s", self.peer_map.me, e)

    def track_graph_replay(self, what: str) -> None:
        """Let the transport follow a CUDA-graph replay just launched on the current stream.

        Called by :mod:`afd_ext.graphs` after every replay, so replays are under
        the same ``step_timeout_s`` deadline as eager exchanges: a dead or
        stalled peer becomes an error naming this rank's peers and ``what``
        (e.g. ``"CUDA-graph replay of layer 3"``), raised by the next connector
        call or :meth:`synchronize`. No-op when not initialised.
        """
        if self._s.transport is not None:
            self._s.transport.track_replay(what, self._s.tag("graph replay"))

    @contextlib.contextmanager
    def watchdog_suspended(self) -> Iterator[None]:
        """Hold off the transport's background polls around a CUDA-graph capture.

        ``cudaEventQuery`` from the NCCL watchdog thread is not allowed while a
        stream captures in the global capture mode (it would invalidate the
        capture). Deadlines of work issued before keep running.
        """
        tr = self._s.transport
        if tr is None:
            yield
            return
        with tr.capture_guard():
            yield

    # ------------------------------------------------------------------ introspection

    @property
    def step_schedule(self) -> StepSchedule | None:
        """The schedule of the current step (None before the first payload)."""
        return None if self._s.step is None else self._s.step.schedule

    @property
    def transport(self) -> Transport | None:
        """The live transport (None when not initialised)."""
        return self._s.transport

    def __repr__(self) -> str:
        return (f"AFDConnector({self.peer_map.me}, A={self.attn_size}, F={self.ffn_size}, "
                f"transport={self.transport_kind}, initialized={self._s.initialized})")
