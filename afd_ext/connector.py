"""The connector: the reference vLLM AFD plugin's contract over an NCCL or a gloo transport.

:class:`AFDConnector` is a drop-in for the reference's ``P2pNcclAFDConnector``
(same constructor shape, same four data calls, ``init_afd_connector``,
``close``, ``is_initialized``, ``control_plane``), registered as
``"AfdExtConnector"`` (and the reference's name) in :mod:`afd_ext.factory`.
The logic is written once; only the transport differs: CUDA tensors over the
compiled core's NCCL ops (:mod:`afd_ext.transport.nccl`) or CPU tensors over
gloo (:mod:`afd_ext.transport.gloo`, how CI runs the whole protocol).

Model facts
-----------
The connector needs the exchange's static facts, which both roles must agree
on (checked in the init handshake). They come as keyword arguments of the
constructor, or are read from ``vllm_config=`` when given:

==========================  =====================================================
``hidden_size``             hidden states width (``hf_text_config.hidden_size``)
``num_layers``              layer exchanges per stage per step (all layers, or
                            only the MoE layers when the gate runs on attention)
``dtype``                   wire dtype of hidden states (``model_config.dtype``),
                            default ``torch.bfloat16``
``router_logits_width``     router logits ``[n, width]`` travel a2f (gate on the
                            attention side), or ``None``; also ``routing_spec=``
``router_logits_dtype``     default ``torch.float32``
``send_token_ids``          ``[n]`` int32 token ids travel a2f
``tp_size``                 attention tensor-parallel size (DP x TP counts), default 1
``device``                  override of the device (default ``cuda:local_rank`` /
                            ``cpu`` for gloo)
``warmup_on_init``          run :meth:`AFDConnector.warmup` at the end of init (default True)
==========================  =====================================================

Everything else (transport, strict mode, wire format, timeouts, control
channel) comes from ``config.connector_extra_config`` (:class:`~afd_ext.config.AfdExtConnectorConfig`).

Per step (control plane, then the layer loop)
---------------------------------------------
Attention: ``control_plane.update_state_from_dp_metadata(p)`` (builds the
step's :func:`~afd_ext.schedule.build_step_schedule`, validates the whole
step, preallocates buffers) and ``control_plane.send_dp_metadata_list(p)``;
then per (layer, stage) ``send_attn_output`` and ``recv_ffn_output``. FFN:
``p = control_plane.recv_dp_metadata_list()``,
``control_plane.update_state_from_dp_metadata(p)``, then per (layer, stage)
``recv_attn_output`` and ``send_ffn_output``.

The exchange order is fixed by the schedule: layer-major, stage-minor
(``for layer in range(num_layers): for stage in sorted(stages)``). Every
attention-side call is checked against it: ``send_attn_output`` must be for
the next exchange's stage, ``recv_ffn_output(ubatch_idx=s)`` for the oldest
exchange whose reply is due, and it must be stage ``s``; the FFN side likewise.
``context.metadata.layer_idx`` is the runtime's layer index and is only
reported (it need not be ``0..num_layers-1``); the connector counts exchanges.

Issue order (cannot deadlock at any message size; see :mod:`afd_ext.schedule`)
-----------------------------------------------------------------------------
* One communicator per edge and direction (``a2f``, ``f2a``), so the messages
  of one direction never queue behind the other direction's, and both sides
  issue each communicator's operations in the same (layer-major, stage-minor) order.
* One CUDA stream per stage on each side. A call makes its stage stream wait
  for the caller's current stream (an event), issues its NCCL group there,
  and the receiving calls make the caller's stream wait for the stage stream
  again (``recv_ffn_output``, ``recv_attn_output``; the FFN side also joins
  every stage stream at the end of the step). So a stage's reply receive is
  never queued behind the next stage's send on the attention side (different
  streams) nor on the FFN side (issued before it, different communicator).
* In a CUDA-graph capture the stage streams fork from and join the capturing
  stream through events, which capture supports; nothing allocates inside
  the calls (buffers are allocated when the step's payload is applied, before
  any capture), and strict-mode headers are skipped for capturing/replaying
  steps (they need a host read).

Fan-in and split-back
---------------------
The FFN side receives every peer's rows straight into row ranges of one
buffer per stage (sized from the schedule when the payload is applied,
reused across layers, grown only between steps; no ``torch.cat``); the
returned ``AFDA2FTransferPayload`` tensors are views of that buffer, valid
until the next ``recv_attn_output`` of the same stage. ``send_ffn_output``
sends row-range views of the output, by the per-peer ``seq_lens`` recorded in
the context. The attention side's reply lands in ``ref_tensor``. Wire format
``per_tensor`` sends hidden states, router logits and token ids as separate
messages of one group; ``packed`` packs them into one uint8 row per token
(``ops.pack_rows``) and unpacks on receipt; the schedule picks it per stage.
Zero-row peers and stages are skipped identically on both sides; a zero-row
FFN exchange returns empty tensors and its (empty) reply sends nothing.

Errors and resynchronisation (what happens after a failure)
-----------------------------------------------------------
* Every input is checked before anything of that call is sent: shape against
  the schedule (and the context's ``total_tokens``), dtype against the
  configured wire dtypes, router logits / token ids present exactly when
  configured, token ids 1-D int32, contiguity, device (no CPU tensor on NCCL,
  no CUDA tensor on gloo), call order. A bad input raises ``ValueError``.
* A bad input at the **first exchange of a step** (this attention rank has
  sent nothing of the step yet): nothing is sent and the step is marked
  *abandoned*. The caller may retry the call with a corrected input (the
  step continues normally), or move on: the next
  ``update_state_from_dp_metadata`` (or an explicit :meth:`AFDConnector.abandon_step`)
  first *drains* the abandoned step - it sends zeros of the scheduled shapes
  for every remaining exchange and discards the replies - so the FFN ranks and
  the other attention ranks complete that step normally (their results are
  unaffected, since FFN compute is row-wise), and then starts the new step.
  The step counters stay in lockstep on every rank.
* A failure **in the middle of a step** (a bad input after this rank already
  sent part of the step, a peer death, a timeout, a strict-mode header
  mismatch, a call-order violation mid-step, a new payload applied before the
  step completed): the connector posts the rendezvous abort signal and aborts
  its communicators; every rank's pending or next call raises (naming who
  aborted and why); ``close()`` and ``init_afd_connector()`` on every rank
  then start a fresh generation.
* Nothing waits forever: NCCL work is followed by the
  :class:`~afd_ext.watchdog.Watchdog` against ``step_timeout_s``; gloo waits
  and strict header waits are bounded and check the abort signal.
* Which peer: a timeout names the operation, its layer and stage, and the
  peer(s) it is still waiting on ("waiting on attention rank 1 (world rank
  2): ..."). gloo knows it per peer. On NCCL a group over several peers
  completes as a whole, so every rank publishes its step progress (exchanges
  sent / received, and whether it is waiting on an operation or idle in its
  caller) to the rendezvous store, only once it has been waiting or idle
  mid-step for :attr:`AFDConnector.publish_after_s` (nothing on the healthy
  path); the rank whose operation expires reads its peers' reports: a peer
  that reported sending is cleared, one that reports being idle in its caller
  is named as stalled, one that reported nothing is named as probably dead.
* Outcome on the other ranks: the rank that detects the failure posts the abort
  signal before it aborts its communicators, so every other rank's pending or
  next call raises :class:`~afd_ext.rendezvous.StepAbortedError` carrying that
  message. An attention rank whose own exchanges of the step all completed
  (its FFN peer is alive; a sibling attention rank died) still ends the step
  with that error in :meth:`AFDConnector.synchronize` (which checks the abort
  signal after its wait): its last replies came from an FFN batch that missed
  the dead rank's rows, and the step is lost on every rank anyway. Without a
  ``synchronize`` it learns of the abort at its next call (NCCL is
  asynchronous: returned replies are only known good once ``synchronize``
  returned).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable, Iterator

import torch

from . import rendezvous as rdzv
from .config import AFDConfig
from .control_plane import AFDControlPlane
from .metadata import (
    AFDA2FTransferPayload,
    AFDControlPayload,
    AFDExpertRoutingSpec,
    AFDTransferContext,
    AFDTransferMetadata,
    AFDTransferState,
)
from .schedule import (
    PACKED,
    ScheduleConfig,
    StepSchedule,
    build_step_schedule,
    warmup_payload,
)
from .errors import AFDError
from .spec import as_dtype as _as_dtype
from .spec import dtype_name
from .topology import Topology
from .transport import create_transport
from .transport.base import (
    MessageTag,
    PeerMap,
    PendingSend,
    StepProgress,
    Transport,
    TransportSetup,
)
from .transport.signal import AbortSignal
from .transport.strict import HEADER_VERSION

logger = logging.getLogger(__name__)

__all__ = [
    "CONNECTOR_FORMAT_VERSION",
    "AFDConnector",
    "AfdExtTransferState",
    "ConnectorStateError",
]

#: Version of the data-plane protocol (exchange order, header layout, wire
#: formats); checked in the init handshake.
CONNECTOR_FORMAT_VERSION = 1

_MODEL_KWARGS = (
    "hidden_size", "num_layers", "dtype", "router_logits_width", "router_logits_dtype",
    "routing_spec", "send_token_ids", "tp_size", "device", "warmup_on_init", "vllm_config",
)


from .errors import ConnectorStateError  # noqa: E402,F401  defined once, in errors.py


@dataclass(slots=True)
class AfdExtTransferState(AFDTransferState):
    """Which exchange a context belongs to (carried from ``recv_attn_output`` to ``send_ffn_output``).

    Attributes:
        step: the connector's step number; layer: exchange ordinal in the step; stage: stage id.
    """

    step: int
    layer: int
    stage: int


@dataclass
class _Exchange:
    layer: int
    stage: int
    tag: MessageTag
    pending: PendingSend
    keep: tuple


@dataclass
class _ReplySend:
    pending: PendingSend
    output: torch.Tensor


@dataclass
class _Step:
    step: int
    schedule: StepSchedule
    seq: list[tuple[int, int]]
    strict: bool
    send_pos: int = 0
    recv_pos: int = 0
    abandoned: bool = False
    pending: dict[int, deque] = dataclasses.field(default_factory=dict)
    #: Per stage, this rank's buffers (fixed for the step; taken when the payload is applied).
    bufs: dict[int, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.seq)

    def where(self, pos: int) -> str:
        if pos >= len(self.seq):
            return f"step {self.step} (all {len(self.seq)} exchanges done)"
        layer, stage = self.seq[pos]
        return f"step {self.step}, layer {layer}, stage {stage}"


class _ConnectorControlPlane(AFDControlPlane):
    """The ``control_plane`` attribute: the reference's three methods over this connector.

    ``update_state_from_dp_metadata`` applies a payload to the connector (no
    network); ``send_dp_metadata_list`` / ``recv_dp_metadata_list`` go through
    the host-side channels of :mod:`afd_ext.control_plane` opened at init. The
    object stays the same across ``close()`` / ``init_afd_connector()``.
    """

    def __init__(self, connector: "AFDConnector"):
        self._connector = connector

    def update_state_from_dp_metadata(self, payload: AFDControlPayload) -> None:
        """Apply ``payload`` locally: validate the step, build its schedule, preallocate buffers.

        Attention ranks call it before ``send_dp_metadata_list`` every step;
        FFN ranks after ``recv_dp_metadata_list``. If the previous step was
        abandoned after a rejected first exchange, it is drained first (see
        the module doc).

        Raises:
            ValueError: invalid payload (stages, count vector lengths, ...); nothing moved.
            ConnectorStateError: not initialised, aborted, or the previous step is
                incomplete mid-way (the step is then aborted on every rank).
        """
        self._connector._apply_payload(payload)

    def send_dp_metadata_list(self, payload: AFDControlPayload) -> None:
        """Send ``payload`` to this attention rank's control destinations (no-op on non-senders).

        Raises:
            ConnectorStateError: not initialised.
            PeerDeadError: a destination FFN rank is gone.
        """
        self._connector._channels("send_dp_metadata_list").send_dp_metadata_list(payload)

    def recv_dp_metadata_list(self) -> AFDControlPayload:
        """FFN side: block until the next step's payload arrives (an idle live peer is waited for).

        Raises:
            ConnectorStateError: not initialised, or called on an attention rank.
            PeerDeadError / ControlChannelClosed / StepAbortedError: see
                :meth:`afd_ext.control_plane.ChannelControlPlane.recv_dp_metadata_list`.
        """
        return self._connector._channels("recv_dp_metadata_list").recv_dp_metadata_list()

    def close(self) -> None:
        """Close the connector's control channels (the connector's ``close`` does it too)."""
        cp = self._connector._cp
        if cp is not None:
            cp.close()


class AFDConnector:
    """The AFD connector (reference-compatible) over an NCCL or a gloo transport.

    Args:
        rank: the runtime's world rank (informational, as in the reference).
        local_rank: CUDA device index of this process (NCCL transport).
        config: the :class:`~afd_ext.config.AFDConfig` (role, host, port, A, F,
            ``connector_extra_config``).
        role_rank: this process's index inside its role (``0..A-1`` / ``0..F-1``).
        **kwargs: model facts, see the module doc (``hidden_size``, ``num_layers``,
            ``dtype``, ``router_logits_width``, ``router_logits_dtype``,
            ``routing_spec``, ``send_token_ids``, ``tp_size``, ``device``,
            ``warmup_on_init``, ``vllm_config``).

    Construction is device-light (no communication, no CUDA call).

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: a missing or invalid model fact, a role rank out of range.
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
        facts = self._model_facts(kwargs)
        self.topology = Topology(config.num_attention_ranks, config.num_ffn_ranks, facts["tp_size"])
        self.topology.check_role_rank(self.role, role_rank)
        self.attn_size = config.num_attention_ranks
        self.ffn_size = config.num_ffn_ranks
        self.world_rank = self.topology.world_rank(self.role, role_rank)
        self.world_size = self.topology.world_size
        self.hidden_size: int = facts["hidden_size"]
        self.num_layers: int = facts["num_layers"]
        self.dtype: torch.dtype = facts["dtype"]
        self.router_logits_width: int | None = facts["router_logits_width"]
        self.router_logits_dtype: torch.dtype = facts["router_logits_dtype"]
        self.send_token_ids: bool = facts["send_token_ids"]
        self.transport_kind = self.extra.transport
        self.warmup_on_init = bool(kwargs.get("warmup_on_init", True))
        dev = kwargs.get("device")
        if dev is not None:
            self.device = torch.device(dev)
        elif self.transport_kind == "gloo":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", int(local_rank))
        if self.transport_kind == "gloo" and self.device.type != "cpu":
            raise ValueError(f"the gloo transport moves CPU tensors; device must be cpu, got {self.device}")
        if self.transport_kind == "nccl" and self.device.type != "cuda":
            raise ValueError(f"the NCCL transport moves CUDA tensors; device must be cuda:N, got {self.device}")
        self.schedule_config = ScheduleConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            hidden_dtype=self.dtype,
            router_logits_width=self.router_logits_width,
            router_logits_dtype=self.router_logits_dtype,
            send_token_ids=self.send_token_ids,
            wire_format=self.extra.wire_format,
            clamp_idle_to_one=self.extra.clamp_idle_to_one,
            packed_max_bytes=self.extra.packed_max_bytes,
            max_stages=self.extra.max_stages,
        )
        self.peer_map = PeerMap(self.role, role_rank, self.attn_size, self.ffn_size)
        self.control_plane = _ConnectorControlPlane(self)
        self._initialized = False
        self._store: rdzv.AFDStore | None = None
        self._transport: Transport | None = None  # the plain transport
        self._checked: Transport | None = None  # the strict-mode view (the plain one when not strict)
        self._signal: AbortSignal | None = None
        self._cp: Any = None
        self._broken: BaseException | None = None
        self._step: _Step | None = None
        self._step_counter = 0
        self._bufs: dict[Hashable, torch.Tensor] = {}
        self._arena: Any = None
        self._reply_sends: dict[int, _ReplySend] = {}
        self._last_call = time.monotonic()

    # ------------------------------------------------------------------ facts

    def _model_facts(self, kw: dict[str, Any]) -> dict[str, Any]:
        vc = kw.get("vllm_config")
        derived: dict[str, Any] = {}
        if vc is not None:
            mc = getattr(vc, "model_config", None)
            hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
            if hf is not None:
                derived["hidden_size"] = getattr(hf, "hidden_size", None)
                derived["num_layers"] = getattr(hf, "num_hidden_layers", None)
            if mc is not None and getattr(mc, "dtype", None) is not None:
                derived["dtype"] = mc.dtype
            pc = getattr(vc, "parallel_config", None)
            if pc is not None and getattr(pc, "tensor_parallel_size", None):
                derived["tp_size"] = int(pc.tensor_parallel_size)
        get = lambda k, default=None: kw[k] if kw.get(k) is not None else derived.get(k, default)  # noqa: E731
        hidden = get("hidden_size")
        layers = get("num_layers")
        for name, v in (("hidden_size", hidden), ("num_layers", layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"AFDConnector needs {name} (an int >= 1) as a keyword argument or from vllm_config, got {v!r}"
                )
        dtype = _as_dtype(get("dtype", torch.bfloat16), "dtype")
        width = kw.get("router_logits_width")
        ldtype = kw.get("router_logits_dtype")
        spec = kw.get("routing_spec")
        if spec is not None:
            if not isinstance(spec, AFDExpertRoutingSpec):
                spec = AFDExpertRoutingSpec(*spec)
            if width is not None and width != spec.router_logits_width:
                raise ValueError(f"router_logits_width={width} disagrees with routing_spec {spec}")
            width = spec.router_logits_width
            ldtype = ldtype or spec.router_logits_dtype
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ValueError(f"router_logits_width must be None or an int >= 1, got {width!r}")
        ldtype = _as_dtype(ldtype or torch.float32, "router_logits_dtype")
        ids = kw.get("send_token_ids", False)
        if not isinstance(ids, bool):
            raise ValueError(f"send_token_ids must be a bool, got {ids!r}")
        tp = get("tp_size", 1)
        return dict(hidden_size=hidden, num_layers=layers, dtype=dtype, router_logits_width=width,
                    router_logits_dtype=ldtype, send_token_ids=ids, tp_size=tp)

    # ------------------------------------------------------------------ reference API

    @classmethod
    def parse_extra_config(cls, raw: Any):
        """The reference's hook: parse ``connector_extra_config`` (see :class:`~afd_ext.config.AfdExtConnectorConfig`).

        Raises:
            TypeError / ValueError: not a mapping, unknown field, bad value.
        """
        from .config import AfdExtConnectorConfig

        return AfdExtConnectorConfig.from_mapping(raw)

    @property
    def is_initialized(self) -> bool:
        """True between a successful :meth:`init_afd_connector` and :meth:`close`."""
        return self._initialized

    @property
    def data_timeout_s(self) -> float:
        """Deadline of one data-plane wait or in-flight operation on this rank, seconds.

        FFN ranks use ``step_timeout_s``; attention ranks ``step_timeout_s +
        min(5, step_timeout_s / 2)``. An FFN rank waits on the attention ranks
        themselves and every attention rank waits on an FFN rank, so when an
        attention rank goes silent the FFN rank expires first, names it, and
        posts the abort that the other attention ranks then report.
        """
        t = self.extra.step_timeout_s
        return t if self.role == "ffn" else t + min(5.0, t / 2)

    @property
    def publish_after_s(self) -> float:
        """Seconds of waiting (or idling mid-step) after which this rank publishes its progress (NCCL).

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
            "tp_size": self.topology.tp_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "hidden_dtype": dtype_name(self.dtype),
            "router_logits": None if self.router_logits_width is None
            else [self.router_logits_width, dtype_name(self.router_logits_dtype)],
            "token_ids": "int32" if self.send_token_ids else None,
            "wire_format": self.extra.wire_format,
            "packed_max_bytes": self.extra.packed_max_bytes,
            "clamp_idle_to_one": self.extra.clamp_idle_to_one,
            "strict": self.extra.strict,
            "transport": self.transport_kind,
            "max_stages": self.extra.max_stages,
            # Both roles' graph caches must evict the same graphs (same captures, same replays).
            "graph_cache_size": self.extra.graph_cache_size,
        }

    def init_afd_connector(self) -> None:
        """Meet every other rank and build the transport and control channels (collective; idempotent).

        Steps: join the rendezvous store hosted by FFN rank 0 at ``host:port``
        (a new generation after each ``close``), the handshake
        (:meth:`handshake_fields`), the transport (gloo process group, or one
        NCCL communicator per edge and direction from unique ids exchanged
        through the store), the control channels, then :meth:`warmup` unless
        ``warmup_on_init=False``.

        Raises:
            HandshakeMismatchError: a peer disagrees on a field (named, with both values).
            RendezvousTimeoutError / RendezvousError: a rank did not arrive, address problems.
            RuntimeError: NCCL failures.
            On any failure everything built so far is released; the call may be retried.
        """
        if self._initialized:
            return
        from . import control_plane as cpl

        extra = self.extra
        try:
            self._broken = None
            self._step = None
            self._step_counter = 0
            self._last_call = time.monotonic()
            store = rdzv.connect(self.config.host, self.config.port, self.world_rank, self.world_size,
                                 timeout_s=extra.init_timeout_s, num_ffn_ranks=self.ffn_size)
            self._store = store
            rdzv.handshake(store, self.world_rank, self.world_size, self.handshake_fields(), extra.init_timeout_s)
            self._signal = AbortSignal(store, self.peer_map.me)
            setup = TransportSetup(store, self.topology, self.peer_map, self.device, self.data_timeout_s,
                                   extra.init_timeout_s, abort=self._signal, progress=self._progress_snapshot,
                                   publish_after_s=self.publish_after_s)
            self._transport, self._checked = create_transport(self.transport_kind, setup, strict=extra.strict)
            channels = cpl.open_control_channels(
                store, self.topology, self.role, self.role_rank, extra.control_channel, extra.init_timeout_s,
                options=cpl.ChannelOptions.from_env(heartbeat_interval_s=extra.heartbeat_interval_s,
                                                    heartbeat_timeout_s=extra.heartbeat_timeout_s))
            self._cp = cpl.ChannelControlPlane(self._apply_payload, self.topology, self.role, self.role_rank,
                                               channels, store=store)
            self._initialized = True
            if self.warmup_on_init:
                self.warmup()
        except BaseException:
            self._teardown()
            raise

    def close(self) -> None:
        """Release everything (idempotent; safe after a partial init or an abort).

        Order: step state and graph/fan-in buffers first, then the control
        channels, then the communicators / process group. Leaves
        :attr:`is_initialized` False; :meth:`init_afd_connector` may be called again.
        """
        self._teardown()

    # ------------------------------------------------------------------ internals: lifecycle

    def _teardown(self) -> None:
        if self._initialized and self._broken is None and self._transport is not None:
            # Healthy close: the last replies may still be in flight (gloo sends
            # asynchronously); let the peers take them (bounded by the deadline).
            try:
                self._settle_reply_sends()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("%s: last replies not delivered at close: %s", self.peer_map.me, e)
        self._initialized = False
        self._step = None
        for rs in list(self._reply_sends.values()):
            rs.pending.done = True  # never wait on a broken transport
        self._reply_sends.clear()
        old_bufs, self._bufs = self._bufs, {}
        self._arena = None
        cp, self._cp = self._cp, None
        if cp is not None:
            try:
                cp.close()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("closing AFD control channels: %s", e)
        tr, self._transport, self._checked = self._transport, None, None
        if tr is not None:
            try:
                tr.close(buffers=list(old_bufs.values()))
            except Exception as e:  # noqa: BLE001
                logger.warning("closing AFD %s transport: %s", tr.kind, e)
        old_bufs.clear()
        self._store = None
        self._signal = None

    def _progress_snapshot(self) -> StepProgress | None:
        """This rank's step position for the transport's stall reports (read from its watchdog thread)."""
        st = self._step
        if st is None or not self._initialized:
            return None
        return StepProgress(st.step, st.total, st.send_pos, st.recv_pos, self._step_complete(st), tuple(st.seq),
                            self._progress(st), time.monotonic() - self._last_call)

    def _fail_step(self, exc: BaseException) -> None:
        """Abort the step on every rank: post the abort signal, abort our transport."""
        if self._broken is None:
            self._broken = exc
        if self._signal is not None:
            self._signal.post(exc)
        if self._transport is not None:
            try:
                self._transport.abort(str(exc).splitlines()[0][:200])
            except Exception as e:  # noqa: BLE001
                logger.warning("aborting AFD transport: %s", e)

    def _check_usable(self, op: str) -> Transport:
        self._last_call = time.monotonic()
        if not self._initialized or self._transport is None:
            raise ConnectorStateError(
                f"AFD connector ({self.peer_map.me}) is not initialized; call init_afd_connector() before {op}"
            )
        if self._broken is not None:
            raise ConnectorStateError(
                f"AFD connector ({self.peer_map.me}) is unusable after a failed step ({self._broken}); "
                f"call close() and init_afd_connector() on every rank before {op}"
            ) from self._broken
        tr = self._transport
        try:
            tr.check_health(MessageTag(op, "a2f", self._step_counter, -1, -1))
        except BaseException as e:
            self._fail_step(e)
            raise
        return tr

    def _check_role(self, role: str, op: str) -> None:
        if self.role != role:
            raise ConnectorStateError(f"{op} is an {role}-side call; this connector is {self.peer_map.me}")

    def _channels(self, op: str):
        if not self._initialized or self._cp is None:
            raise ConnectorStateError(
                f"AFD connector ({self.peer_map.me}) is not initialized; call init_afd_connector() before {op}"
            )
        return self._cp

    # ------------------------------------------------------------------ buffers

    def use_static_arena(self, arena: Any) -> None:
        """Take every buffer from ``arena`` (a :class:`afd_ext.graphs.StaticArena`) from now on, or stop (None).

        For CUDA-graph capture: apply the capture step's payload with the arena
        set, so its buffers are reserved at the captured sizes before capture;
        the arena never moves them (a missing one raises ``GraphBufferError``).
        """
        self._arena = arena

    def _buffer(self, key: Hashable, rows: int, cols: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = (rows,) + cols
        if self._arena is not None:
            return self._arena.buffer(key, shape, dtype)
        t = self._bufs.get(key)
        if t is None or t.shape[0] < rows or t.dtype != dtype or tuple(t.shape[1:]) != cols:
            t = torch.empty((max(rows, 1),) + cols, dtype=dtype, device=self.device)
            self._bufs[key] = t
        return t[:rows]

    def _stage_buffers(self, st: _Step, stage: int) -> dict[str, torch.Tensor]:
        """This rank's buffers of ``stage`` (allocated/grown when the payload is applied)."""
        sch, cfg = st.schedule, st.schedule.config
        out: dict[str, torch.Tensor] = {}
        packed = sch.wire_format(stage) == PACKED
        if self.role == "ffn":
            n = sch.ffn_rows(stage, self.role_rank)
            out["hidden"] = self._buffer(("fan_in_hidden", stage), n, (cfg.hidden_size,), cfg.hidden_dtype)
            if cfg.router_logits_width is not None:
                out["logits"] = self._buffer(("fan_in_logits", stage), n, (cfg.router_logits_width,),
                                             cfg.router_logits_dtype)
            if cfg.send_token_ids:
                out["ids"] = self._buffer(("fan_in_ids", stage), n, (), torch.int32)
        else:
            n = sch.attention_rows(stage, self.role_rank)
        if packed:
            out["wire"] = self._buffer(("wire", stage), n, (cfg.packed_row_bytes,), torch.uint8)
        return out

    # ------------------------------------------------------------------ step state

    def _apply_payload(self, payload: AFDControlPayload, *, pad_to: dict[int, int] | None = None) -> None:
        """Start a step: drain an abandoned one, build the schedule, allocate buffers and streams."""
        op = "update_state_from_dp_metadata"
        self._check_usable(op)
        prev = self._step
        if prev is not None and not self._step_complete(prev):
            if self._nothing_moved(prev) and not (prev.abandoned and self.role == "ffn"):
                if prev.abandoned:
                    self._drain(prev)
                else:
                    logger.debug("%s: step %d replaced before any exchange", self.peer_map.me, prev.step)
            else:
                exc = ConnectorStateError(
                    f"{op} on {self.peer_map.me}: the previous step {prev.step} is incomplete "
                    f"({self._progress(prev)}); every step must run all {prev.total} (layer, stage) exchanges. "
                    "The step was aborted on every rank; close() and init_afd_connector() to continue."
                )
                self._fail_step(exc)
                raise exc
        self._step = None
        self._settle_reply_sends()
        if not isinstance(payload, AFDControlPayload):
            raise ValueError(f"payload must be an AFDControlPayload, got {type(payload).__name__}")
        cfg = self.schedule_config if pad_to is None else dataclasses.replace(self.schedule_config, pad_to=pad_to)
        sch = build_step_schedule(self.topology, payload, cfg)
        self._start_step(sch, payload)

    def _start_step(self, sch: StepSchedule, payload: AFDControlPayload) -> _Step:
        self._step_counter += 1
        strict = self.extra.strict and not (payload.is_graph_capturing or payload.is_graph_replaying)
        seq = [(layer, s) for layer in range(sch.config.num_layers) for s in sch.stages]
        st = _Step(self._step_counter, sch, seq, strict, pending={s: deque() for s in sch.stages})
        for s in sch.stages:
            st.bufs[s] = self._stage_buffers(st, s)
        if self._transport is not None:
            self._transport.prepare_stages(sch.stages)
        self._step = st
        return st

    def _step_complete(self, st: _Step) -> bool:
        pos = st.recv_pos if self.role == "attention" else st.send_pos
        return pos >= st.total

    def _nothing_moved(self, st: _Step) -> bool:
        return (st.send_pos if self.role == "attention" else st.recv_pos) == 0

    def _progress(self, st: _Step) -> str:
        if self.role == "attention":
            return f"{st.send_pos} of {st.total} exchanges sent, {st.recv_pos} replies received"
        return f"{st.recv_pos} of {st.total} exchanges received, {st.send_pos} replies sent"

    def _require_step(self, op: str) -> _Step:
        st = self._step
        if st is None:
            raise ConnectorStateError(
                f"{op} on {self.peer_map.me}: no step is active; call "
                "control_plane.update_state_from_dp_metadata(payload) first (attention: every step before "
                "sending; FFN: after recv_dp_metadata_list)"
            )
        return st

    def _reject(self, st: _Step, exc: BaseException, *, moved: bool) -> BaseException:
        """A call failed its checks. Mid-step (``moved``): abort the step everywhere; else abandon it."""
        if moved:
            note = (f" The step was already under way on {self.peer_map.me} ({self._progress(st)}), so it was "
                    "aborted on every rank; close() and init_afd_connector() to continue.")
            exc = type(exc)(str(exc) + note) if isinstance(exc, (ValueError, ConnectorStateError)) else exc
            self._fail_step(exc)
        else:
            st.abandoned = True
        return exc

    def _settle_reply_sends(self) -> None:
        for s in list(self._reply_sends):
            self._wait_reply_send(s)

    def _wait_reply_send(self, stage: int, *, release: bool = True) -> None:
        rs = self._reply_sends.get(stage)
        if rs is None:
            return
        try:
            rs.pending.wait()
        except BaseException as e:
            self._fail_step(e)
            raise
        if release:
            del self._reply_sends[stage]

    def _data(self, st: _Step) -> Transport:
        """The transport of ``st``'s data calls: the strict-mode view unless the step is captured/replayed."""
        return self._checked if st.strict else self._transport

    def _tag(self, st: _Step, op: str, direction: str, layer: int, stage: int, layer_idx: int = -1) -> MessageTag:
        return MessageTag(op, direction, st.step, layer, stage, layer_idx)

    def _transport_call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (AFDError, RuntimeError) as e:  # every transport error (AFDPeerError is a ConnectionError)
            self._fail_step(e)
            raise

    # ------------------------------------------------------------------ attention side

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
            context: the transfer context; ``metadata.stage_idx`` is the stage,
                ``metadata.total_tokens`` must equal ``rows``.
            router_logits: ``[rows, router_logits_width]`` of the configured
                dtype, iff router logits were configured.
            input_ids: ``[rows]`` int32, iff ``send_token_ids`` was configured.
            **kwargs: ignored (reference extensions such as ``topk_ids``).

        Raises:
            ValueError: a bad input or call order (nothing of this call is sent;
                see the module doc for what happens to the step).
            ConnectorStateError: not initialised / aborted / no step applied.
            AFDTransportError, StepAbortedError: transport failure (the step is aborted everywhere).

        CUDA graphs: capturable (stage stream forked from the current stream;
        no allocation, no host sync outside strict mode).
        """
        op = "send_attn_output"
        self._check_role("attention", op)
        tr = self._check_usable(op)
        st = self._require_step(op)
        moved = st.send_pos > 0
        try:
            md = context.metadata
            stage = md.stage_idx
            if st.send_pos >= st.total:
                raise ConnectorStateError(
                    f"{op} on {self.peer_map.me}: all {st.total} exchanges of step {st.step} were already sent; "
                    "apply the next step's payload (update_state_from_dp_metadata) first")
            layer, want_stage = st.seq[st.send_pos]
            if stage != want_stage:
                raise ValueError(
                    f"{op} on {self.peer_map.me} for stage {stage}, but the next exchange of the step is "
                    f"layer {layer}, stage {want_stage} (exchanges run layer-major, stage-minor over stages "
                    f"{list(st.schedule.stages)})")
            if not isinstance(hidden_states, torch.Tensor):
                raise ValueError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
            if not md.validate_tensor_shape(tuple(hidden_states.shape)):
                raise ValueError(f"hidden_states shape {tuple(hidden_states.shape)!r} does not match AFD metadata "
                                 f"token count {md.total_tokens}")
            if router_logits is not None and (not isinstance(router_logits, torch.Tensor) or router_logits.dim() < 1
                                              or router_logits.shape[0] != hidden_states.shape[0]):
                raise ValueError("router_logits and hidden_states must have equal token counts")
            if input_ids is not None:
                if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or \
                        input_ids.shape[0] != hidden_states.shape[0]:
                    raise ValueError("input_ids must be one-dimensional and token-aligned with hidden_states")
                if input_ids.dtype != torch.int32:
                    raise ValueError(f"AFD input_ids must use torch.int32, got {input_ids.dtype}; "
                                     "cast with .to(torch.int32)")
            for name, t in (("hidden_states", hidden_states), ("router_logits", router_logits),
                            ("input_ids", input_ids)):
                if t is not None:
                    tr.check_device(t, name)
            st.schedule.check_attention_tensors(stage, self.role_rank, hidden_states, router_logits, input_ids,
                                                device=self.device)
        except (ValueError, ConnectorStateError) as e:
            raise self._reject(st, e, moved=moved) from None
        st.abandoned = False
        self._send_rows(st, tr, layer, stage, hidden_states, router_logits, input_ids, md.layer_idx, op)

    def _send_rows(self, st: _Step, tr: Transport, layer: int, stage: int, hidden, logits, ids,
                   layer_idx: int, op: str) -> None:
        sch = st.schedule
        plan = sch.attention_plan(stage, self.role_rank)
        tag = self._tag(st, op, "a2f", layer, stage, layer_idx)
        tr = self._data(st)
        if sch.wire_format(stage) == PACKED:
            wire = st.bufs[stage]["wire"]
            if plan.total:
                from . import ops

                ops.pack_rows(hidden, logits, ids, wire)
            tensors: tuple = (wire,)
        else:
            tensors = (hidden, logits, ids)
        pending = self._transport_call(tr.split_back, tensors, plan.peers, plan.rows, tag=tag)
        st.pending[stage].append(_Exchange(layer, stage, tag, pending, (hidden, logits, ids)))
        st.send_pos += 1

    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """Attention side: receive the FFN output of the oldest outstanding exchange into ``ref_tensor``.

        Args:
            ref_tensor: ``[rows, hidden_size]`` of the configured dtype,
                contiguous, on the transport's device (mutated: the reply lands
                in it). May be the ``hidden_states`` just sent (the reference's
                usage).
            ubatch_idx: the stage; must be the stage of the oldest exchange
                whose reply is due (replies come back layer-major, stage-minor).
            **kwargs: ignored.

        Returns:
            ``ref_tensor``. On NCCL the caller's current stream is made to wait
            for the reply, so any later work on it sees the data.

        Raises:
            ValueError / ConnectorStateError: bad ``ref_tensor`` or call order (nothing is received;
                mid-step this aborts the step on every rank).
            AFDTransportError, StepAbortedError: transport failure (the step is aborted everywhere).
        """
        op = "recv_ffn_output"
        self._check_role("attention", op)
        tr = self._check_usable(op)
        st = self._require_step(op)
        try:
            if st.recv_pos >= st.send_pos:
                raise ConnectorStateError(
                    f"{op}(ubatch_idx={ubatch_idx}) on {self.peer_map.me}: no exchange is awaiting its reply "
                    f"({self._progress(st)}); call send_attn_output first")
            layer, stage = st.seq[st.recv_pos]
            if ubatch_idx != stage:
                raise ValueError(
                    f"{op}(ubatch_idx={ubatch_idx}) on {self.peer_map.me}, but the reply due next is layer {layer}, "
                    f"stage {stage} (replies arrive in send order: layer-major, stage-minor)")
            if not isinstance(ref_tensor, torch.Tensor):
                raise ValueError(f"ref_tensor must be a torch.Tensor, got {type(ref_tensor).__name__}")
            tr.check_device(ref_tensor, "ref_tensor")
            st.schedule.check_attention_reply(stage, self.role_rank, ref_tensor, device=self.device)
        except (ValueError, ConnectorStateError) as e:
            raise self._reject(st, e, moved=st.send_pos > 0) from None
        ex: _Exchange = st.pending[stage][0]
        self._recv_reply(st, tr, ex, ref_tensor, op)
        return ref_tensor

    def _recv_reply(self, st: _Step, tr: Transport, ex: _Exchange, ref_tensor: torch.Tensor, op: str) -> None:
        plan = st.schedule.attention_plan(ex.stage, self.role_rank)
        tag = self._tag(st, op, "f2a", ex.layer, ex.stage, ex.tag.layer_idx)
        self._transport_call(self._data(st).fan_in, (ref_tensor, None, None), plan.peers, plan.rows, tag=tag)
        # The reply came back, so our sends of this exchange were received: safe to release.
        self._transport_call(ex.pending.wait)
        st.pending[ex.stage].popleft()
        st.recv_pos += 1

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
        st = self._step
        if st is None or self._step_complete(st) or self.role != "attention":
            return
        if not self._nothing_moved(st):
            raise ConnectorStateError(
                f"abandon_step on {self.peer_map.me}: step {st.step} already sent data ({self._progress(st)})")
        self._drain(st)

    def _drain(self, st: _Step) -> None:
        tr = self._check_usable("draining an abandoned step")
        logger.warning("%s: draining abandoned step %d (%d exchanges carry zeros)", self.peer_map.me, st.step,
                       st.total)
        cfg = st.schedule.config
        zeros: dict[int, tuple] = {}
        for s in st.schedule.stages:
            n = st.schedule.attention_rows(s, self.role_rank)
            zeros[s] = (
                torch.zeros(n, cfg.hidden_size, dtype=cfg.hidden_dtype, device=self.device),
                None if cfg.router_logits_width is None else
                torch.zeros(n, cfg.router_logits_width, dtype=cfg.router_logits_dtype, device=self.device),
                torch.zeros(n, dtype=torch.int32, device=self.device) if cfg.send_token_ids else None,
            )
        while st.send_pos < st.total:
            layer, stage = st.seq[st.send_pos]
            h, lg, ids = zeros[stage]
            self._send_rows(st, tr, layer, stage, h, lg, ids, -1, "abandon_step (drain)")
            ex = st.pending[stage][0]
            self._recv_reply(st, tr, ex, torch.empty_like(h), "abandon_step (drain)")
        st.abandoned = False

    # ------------------------------------------------------------------ FFN side

    def recv_attn_output(self, ubatch_idx: int = 0, routing_spec: AFDExpertRoutingSpec | None = None,
                         recv_input_ids: bool = False, **kwargs: Any) -> AFDA2FTransferPayload:
        """FFN side: fan-in every attention peer's rows of the next (layer, stage) into one tensor.

        Args:
            ubatch_idx: the stage; must be the next exchange's stage (layer-major, stage-minor).
            routing_spec: the model's router-logits receive contract; when
                given it must equal the configured width and dtype. Router
                logits travel iff they were configured at init (checked in the
                handshake), whether or not this is given.
            recv_input_ids: the model wants token ids; requires ``send_token_ids``
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
            ValueError / ConnectorStateError: call order or a spec that differs
                from the configuration (nothing received; mid-step this aborts
                the step on every rank).
            AFDTransportError, StepAbortedError: transport failure (a dead
                peer is named with the layer and stage).
        """
        op = "recv_attn_output"
        self._check_role("ffn", op)
        tr = self._check_usable(op)
        st = self._require_step(op)
        cfg = st.schedule.config
        try:
            if st.recv_pos >= st.total:
                raise ConnectorStateError(
                    f"{op} on {self.peer_map.me}: all {st.total} exchanges of step {st.step} were received; "
                    "receive and apply the next step's payload first")
            layer, stage = st.seq[st.recv_pos]
            if ubatch_idx != stage:
                raise ValueError(f"{op}(ubatch_idx={ubatch_idx}) on {self.peer_map.me}, but the next exchange is "
                                 f"layer {layer}, stage {stage} (layer-major, stage-minor)")
            if routing_spec is not None:
                if cfg.router_logits_width is None:
                    raise ValueError(f"{op}: routing_spec {routing_spec} given, but the connector was initialised "
                                     "without router logits; pass router_logits_width (or routing_spec) at "
                                     "construction on both roles")
                if (routing_spec.router_logits_width, routing_spec.router_logits_dtype) != \
                        (cfg.router_logits_width, cfg.router_logits_dtype):
                    raise ValueError(f"{op}: routing_spec {routing_spec} differs from the configured router logits "
                                     f"[{cfg.router_logits_width}] {cfg.router_logits_dtype}")
            if recv_input_ids and not cfg.send_token_ids:
                raise ValueError(f"{op}: recv_input_ids=True but the connector was initialised with "
                                 "send_token_ids=False; enable it on both roles")
        except (ValueError, ConnectorStateError) as e:
            raise self._reject(st, e, moved=st.recv_pos > 0) from None
        sch = st.schedule
        plan = sch.ffn_plan(stage, self.role_rank)
        bufs = st.bufs[stage]
        hidden, logits, ids = bufs["hidden"], bufs.get("logits"), bufs.get("ids")
        tag = self._tag(st, op, "a2f", layer, stage, layer)
        # The previous reply of this stage may still be sending from memory the
        # caller computed in place in this buffer (gloo); it completes as soon as
        # the peer posts its receive, which it does without waiting for us.
        self._wait_reply_send(stage, release=False)
        tr = self._data(st)
        if sch.wire_format(stage) == PACKED:
            wire = bufs["wire"]
            self._transport_call(tr.fan_in, (wire,), plan.peers, plan.rows, tag=tag)
            if plan.total:
                from . import ops

                ops.unpack_rows(wire, hidden, logits, ids)
        else:
            self._transport_call(tr.fan_in, (hidden, logits, ids), plan.peers, plan.rows, tag=tag)
        self._reply_sends.pop(stage, None)  # the previous reply's memory is free for the caller again
        st.recv_pos += 1
        meta = AFDTransferMetadata.create_ffn_metadata(layer_idx=layer, stage_idx=stage, seq_lens=list(plan.rows))
        ctx = AFDTransferContext(meta, AfdExtTransferState(st.step, layer, stage))
        return AFDA2FTransferPayload(hidden, ctx, logits, ids)

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
            ValueError / ConnectorStateError: bad output or context (nothing is
                sent; the attention peers already hold this exchange, so the
                step is aborted on every rank).
            AFDTransportError, StepAbortedError: transport failure.
        """
        op = "send_ffn_output"
        self._check_role("ffn", op)
        tr = self._check_usable(op)
        st = self._require_step(op)
        try:
            if st.send_pos >= st.recv_pos:
                raise ConnectorStateError(f"{op} on {self.peer_map.me}: no received exchange awaits its reply "
                                          f"({self._progress(st)}); call recv_attn_output first")
            layer, stage = st.seq[st.send_pos]
            state = context.states
            if isinstance(state, AfdExtTransferState):
                if (state.step, state.layer, state.stage) != (st.step, layer, stage):
                    raise ValueError(
                        f"{op} on {self.peer_map.me} with the context of step {state.step}, layer {state.layer}, "
                        f"stage {state.stage}, but the reply due next is step {st.step}, layer {layer}, stage "
                        f"{stage} (replies go in receive order)")
            elif context.metadata.stage_idx != stage:
                raise ValueError(f"{op} for stage {context.metadata.stage_idx}, but the reply due next is layer "
                                 f"{layer}, stage {stage}")
            if not isinstance(ffn_output, torch.Tensor):
                raise ValueError(f"ffn_output must be a torch.Tensor, got {type(ffn_output).__name__}")
            if not context.metadata.validate_tensor_shape(tuple(ffn_output.shape)):
                raise ValueError(f"ffn_output shape {tuple(ffn_output.shape)!r} does not match metadata "
                                 f"(total_tokens {context.metadata.total_tokens})")
            tr.check_device(ffn_output, "ffn_output")
            st.schedule.check_ffn_output(stage, self.role_rank, ffn_output, device=self.device)
        except (ValueError, ConnectorStateError) as e:
            raise self._reject(st, e, moved=True) from None
        plan = st.schedule.ffn_plan(stage, self.role_rank)
        tag = self._tag(st, op, "f2a", layer, stage, layer)
        pending = self._transport_call(self._data(st).split_back, (ffn_output, None, None), plan.peers, plan.rows,
                                       tag=tag)
        # Keep ffn_output alive until the stage stream is joined again (next
        # recv_attn_output of this stage, or the end of the step): the caching
        # allocator must not hand its memory to the caller's stream while the
        # stage stream still sends from it.
        self._reply_sends[stage] = _ReplySend(pending, ffn_output)
        st.send_pos += 1
        if st.send_pos >= st.total:
            tr.join()

    # ------------------------------------------------------------------ warm-up

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
            RuntimeError: the echoed rows differ from what was sent.
            AFDTransportError, StepAbortedError: transport failure.
        """
        op = "warmup"
        self._check_usable(op)
        if self._step is not None and not self._step_complete(self._step):
            raise ConnectorStateError(f"{op} on {self.peer_map.me}: step {self._step.step} is in progress")
        payload = warmup_payload(self.topology, num_stages)
        cfg = dataclasses.replace(self.schedule_config, num_layers=1)
        st = self._start_step(build_step_schedule(self.topology, payload, cfg), payload)
        hs = cfg.hidden_size
        try:
            if self.role == "attention":
                sent = {}
                for s in st.schedule.stages:
                    n = st.schedule.attention_rows(s, self.role_rank)
                    h = (torch.arange(n * hs, device=self.device) % 7 + 1 + self.role_rank).float().to(cfg.hidden_dtype)
                    h = h.reshape(n, hs)
                    lg = None if cfg.router_logits_width is None else torch.zeros(
                        n, cfg.router_logits_width, dtype=cfg.router_logits_dtype, device=self.device)
                    ids = torch.zeros(n, dtype=torch.int32, device=self.device) if cfg.send_token_ids else None
                    ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                        layer_idx=0, stage_idx=s, seq_len=n))
                    self.send_attn_output(h, ctx, router_logits=lg, input_ids=ids)
                    sent[s] = h
                outs = {s: self.recv_ffn_output(torch.empty_like(sent[s]), ubatch_idx=s) for s in st.schedule.stages}
                self.synchronize()  # bounded (NCCL): a dead peer is a named error, not a hang
                for s, out in outs.items():
                    if not torch.equal(out, sent[s]):
                        raise RuntimeError(f"{op} on {self.peer_map.me}: stage {s} echo differs from what was sent")
            else:
                for s in st.schedule.stages:
                    p = self.recv_attn_output(ubatch_idx=s)
                    self.send_ffn_output(p.hidden_states, p.context)
                self._settle_reply_sends()
                self.synchronize()
        finally:
            if self._step is st:
                self._step = None

    def synchronize(self) -> None:
        """Wait until every exchange this rank issued has completed (bounded), then return.

        NCCL: joins the stage streams into the current stream and waits for it
        on the host with the data deadline, so a stall or a peer failure
        becomes the watchdog's named error instead of a hang in
        ``torch.cuda.synchronize()``. gloo: receives are already complete.

        Then (NCCL) it checks the abort signal once (one store round trip): when
        another rank aborted the step, the replies just completed may come
        from an incomplete fan-in (see the module doc), so the step ends with
        the abort here too.

        Raises:
            AFDTransportError, StepAbortedError: the named failure (the step is aborted everywhere).
        """
        op = "synchronize"
        tr = self._check_usable(op)
        st = self._step
        where = self._progress(st) if st is not None else "no step"
        tag = MessageTag(op, "a2f", self._step_counter, -1, -1)
        self._transport_call(tr.synchronize, f"wait for every exchange issued ({where})", tag)
        sig = self._signal
        if sig is None:
            return
        try:
            sig.check(op)
        except rdzv.StepAbortedError as e:
            self._fail_step(e)
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
        if self._transport is not None:
            self._transport.track_replay(what, MessageTag("graph replay", "a2f", self._step_counter, -1, -1))

    @contextlib.contextmanager
    def watchdog_suspended(self) -> Iterator[None]:
        """Hold off the transport's background polls around a CUDA-graph capture.

        ``cudaEventQuery`` from the NCCL watchdog thread is not allowed while a
        stream captures in the global capture mode (it would invalidate the
        capture). Deadlines of work issued before keep running.
        """
        tr = self._transport
        if tr is None:
            yield
            return
        with tr.capture_guard():
            yield

    # ------------------------------------------------------------------ introspection

    @property
    def step_schedule(self) -> StepSchedule | None:
        """The schedule of the current step (None before the first payload)."""
        return None if self._step is None else self._step.schedule

    @property
    def transport(self) -> Transport | None:
        """The live transport (None when not initialised)."""
        return self._transport

    def __repr__(self) -> str:
        return (f"AFDConnector({self.peer_map.me}, A={self.attn_size}, F={self.ffn_size}, "
                f"transport={self.transport_kind}, initialized={self._initialized})")
