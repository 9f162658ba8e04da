"""The one schedule: a pure function of (topology, control payload, config).

:func:`build_step_schedule` says, for every (layer, stage, edge, direction) of
a step, how many rows travel and whether the message is skipped (zero rows).
Both roles call it with the same inputs and get the same
answer; neither decides from its own tensors. It validates the whole step up
front (stages, count vector lengths, negative counts, padding), so a bad
payload fails before the first byte of the step moves.

Terms: direction ``"a2f"`` carries the wire parts (declared once, in
:mod:`afd_ext.wire`) from an attention rank to an FFN rank; ``"f2a"`` carries
the FFN output back. Each part is its own message, in wire order.

NCCL issue order (the connector and transports follow it; it cannot deadlock
at any message size):

A large NCCL send blocks its stream until the peer posts the matching
receive, and NCCL serialises all operations of one communicator in issue
order. So:

1. Communicators: one per direction for each edge set (``a2f`` and ``f2a``;
   per edge or per FFN subgroup, as the reference). A direction's messages
   never share a communicator with the other direction's.
2. Both roles issue a step's exchanges layer-major, stage-minor
   (``for layer: for stage in schedule.stages``), so on every communicator
   the matching operations are issued in the same order on both sides.
3. Attention rank, per (layer, stage), on that stage's stream: first one
   NCCL group sending the rows to all of its FFN peers on the ``a2f``
   communicators (``split_back``), then, as a separate call, one group
   receiving the reply from the same peers on the ``f2a`` communicators
   (``fan_in`` into the caller's tensor). With several stages in flight,
   stage ``s+1``'s send is issued on stage ``s+1``'s stream, never behind
   stage ``s``'s reply receive; cross-stage dependencies are CUDA events.
4. FFN rank, per (layer, stage): one group receiving every peer's rows on
   the ``a2f`` communicators (``fan_in``, peers in fan-in order, into
   consecutive row ranges), the FFN compute, then one group sending each peer
   its rows on the ``f2a`` communicators (``split_back``). One stream is
   enough; per-stage streams with events also work.
5. Zero-row messages are left out of the groups on both sides identically,
   since both take their row counts from the same schedule (the connector
   reads :meth:`StepSchedule.attention_plan` / :meth:`StepSchedule.ffn_plan`;
   a zero-row peer is skipped by the transport).

Why no deadlock: every FFN operation, in issue order, waits only for an
attention operation that sits at the head of an attention stream whose
earlier operations (the same stage's earlier layers, or this stage's send)
have already been matched; a stage's reply receive never queues behind the
next stage's send on either side, because those are on different streams
(attention) or issued after the reply (FFN), and on different communicators.

Graph padding (``ScheduleConfig.pad_to``): every attention rank sends
``pad_to[stage]`` rows for that stage whatever its real count; the real rows
come first and the padded rows after them are carried through the FFN and
dropped by the attention caller. ``valid_rows`` in the plans says how many
rows of each range are real. :func:`afd_ext.graphs.graph_key_from_schedule` identifies the captured graph
by the full per-stage, per-rank wire row vector (never a total), the wire
dtypes and which optional tensors travel.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from .errors import AFDConfigError
from .metadata import AFDControlPayload
from .topology import Topology
from .spec import HIDDEN_DTYPES as _HIDDEN_DTYPES  # the one dtype table
from .wire import WirePart, declared_args, layout

A2F = "a2f"
F2A = "f2a"
DIRECTIONS = (A2F, F2A)


def _pos_int(v: Any, name: str, *, allow_zero: bool = False) -> int:
    lo = 0 if allow_zero else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise AFDConfigError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


@dataclass(frozen=True)
class ScheduleConfig:
    """Static facts of the exchange that both roles must agree on.

    Args:
        num_layers: exchanges per stage per step (layers that go to the FFN side), >= 1.
        hidden_size: hidden states width, >= 1.
        hidden_dtype: wire dtype of hidden states (bf16, fp16, fp32, fp8).
        router_logits_width: router logits width when they travel (gate on
            the attention side), else ``None``.
        router_logits_dtype: floating dtype of router logits.
        send_token_ids: whether ``[rows]`` int32 token ids travel.
        clamp_idle_to_one: reference compatibility: a zero count becomes 1
            (the runtime runs a one-token dummy batch on idle ranks).
        pad_to: ``{stage: rows}``: every attention rank sends this many rows
            for the stage (CUDA graph capture size), or ``None``.
        max_stages: largest accepted number of stages per step, or ``None``.
        hidden_wire: ``None`` (hidden states travel as ``hidden_dtype``) or ``"fp8_e4m3"``
            (attention -> FFN as FP8 values + scales, :mod:`afd_ext.fp8`; the reply stays ``hidden_dtype``).
        fp8_delivery: an FFN rank's fan-in with FP8 on the wire: ``"dequant"`` (bf16 ``hidden``,
            dequantized in the fan-in) or ``"fp8"`` (``hidden_fp8`` and ``hidden_scales``).
        fp8_scale_format: the FP8 scales: ``"fp32"`` (``amax / 448``) or ``"ue8m0"`` (rounded up to a power of two).

    Raises:
        AFDConfigError: a field out of range or of the wrong type.
    """

    num_layers: int
    hidden_size: int
    hidden_dtype: torch.dtype
    router_logits_width: int | None = None
    router_logits_dtype: torch.dtype = torch.float32
    send_token_ids: bool = False
    clamp_idle_to_one: bool = False
    pad_to: Mapping[int, int] | None = field(default=None, hash=False)  # a dict: compared, not hashed
    max_stages: int | None = None
    hidden_wire: str | None = None
    fp8_delivery: str = "dequant"
    fp8_scale_format: str = "fp32"

    def __post_init__(self) -> None:
        _pos_int(self.num_layers, "num_layers")
        _pos_int(self.hidden_size, "hidden_size")
        if self.hidden_dtype not in _HIDDEN_DTYPES:
            raise AFDConfigError(
                f"hidden_dtype must be one of {[str(d) for d in _HIDDEN_DTYPES]}, got {self.hidden_dtype!r}"
            )
        if self.router_logits_width is not None:
            _pos_int(self.router_logits_width, "router_logits_width")
        if not isinstance(self.router_logits_dtype, torch.dtype) or not self.router_logits_dtype.is_floating_point:
            raise AFDConfigError(f"router_logits_dtype must be a floating torch.dtype, got {self.router_logits_dtype!r}")
        for name in ("send_token_ids", "clamp_idle_to_one"):
            if not isinstance(getattr(self, name), bool):
                raise AFDConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_stages is not None:
            _pos_int(self.max_stages, "max_stages")
        if self.pad_to is not None:
            if not isinstance(self.pad_to, Mapping):
                raise AFDConfigError(f"pad_to must be a dict stage -> rows or None, got {type(self.pad_to).__name__}")
            pad = {}
            for s, p in self.pad_to.items():
                _pos_int(s, "pad_to stage", allow_zero=True)
                _pos_int(p, f"pad_to[{s}]", allow_zero=True)
                pad[s] = p
            object.__setattr__(self, "pad_to", dict(sorted(pad.items())))
        from .fp8 import HIDDEN_WIRE_DTYPES, SCALE_FORMATS, check_hidden

        if self.fp8_scale_format not in SCALE_FORMATS:
            raise AFDConfigError(f"fp8_scale_format must be one of {list(SCALE_FORMATS)}, got {self.fp8_scale_format!r}")
        if self.hidden_wire is not None:
            if self.hidden_wire not in HIDDEN_WIRE_DTYPES:
                raise AFDConfigError(f"hidden_wire must be None or one of {list(HIDDEN_WIRE_DTYPES)}, "
                                     f"got {self.hidden_wire!r}")
            check_hidden(self.hidden_size, self.hidden_dtype)

    @functools.cached_property
    def wire_parts(self) -> tuple[WirePart, ...]:
        """The wire layout (:func:`afd_ext.wire.layout`): the parts of an a2f message, in the order they travel."""
        return layout(self)

    @functools.cached_property
    def caller_parts(self) -> tuple[WirePart, ...]:
        """The a2f parts as the attention caller passes them (FP8 not applied: :func:`afd_ext.wire.layout`)."""
        return layout(self, caller=True)

    @functools.cached_property
    def without_fp8(self) -> "ScheduleConfig":
        """This config with the hidden states travelling in their own dtype."""
        return replace(self, hidden_wire=None)

    @functools.cached_property
    def absent_args(self) -> tuple[str, ...]:
        """Connector arguments of declared a2f parts that do not travel under this config (must be None)."""
        given = {p.arg for p in self.caller_parts}
        return tuple(a for a in declared_args() if a not in given)


def stage_buffers(alloc: Callable[[tuple[str, int], tuple[int, ...], torch.dtype], Any], config: ScheduleConfig,
                  stage: int, rows: int, extra: Sequence[str] = (), *, fan_in: bool = False) -> dict[str, Any]:
    """The one stage layout: a rank's buffers of one stage, for every transport and both roles.

    Args:
        alloc: ``alloc(key, shape, dtype)`` returns one buffer; ``key`` is ``(name, stage)``, the one
            arena key (an eager pool, a CUDA-graph arena, a transport's own memory, zeros).
        config: what travels (:attr:`ScheduleConfig.wire_parts`).
        stage: the stage id; rows: the stage's rows on this rank.
        extra: names of further ``[rows, hidden_size]`` buffers of the hidden dtype, e.g. ``"output"``
            (an FFN rank's split-back source) or ``"reply"`` (where an attention rank's reply lands).
        fan_in: an FFN rank's fan-in buffers (what arrives: :attr:`ScheduleConfig.wire_parts`) rather
            than what the attention caller passes (:attr:`ScheduleConfig.caller_parts`). They differ
            only with FP8 on the wire: then ``hidden_fp8`` and ``hidden_scales`` arrive, and
            ``"dequant"`` delivery adds ``hidden`` (bf16) after them.

    Returns:
        ``{part name: buffer}`` in wire order, then ``extra``'s; a part that does not travel is absent.
    """
    parts = config.wire_parts if fan_in else config.caller_parts
    out = {p.name: alloc((p.name, stage), (rows,) + p.cols, p.dtype) for p in parts}
    if fan_in and config.hidden_wire is not None and config.fp8_delivery != "fp8":
        out["hidden"] = alloc(("hidden", stage), (rows, config.hidden_size), config.hidden_dtype)
    for name in extra:
        out[name] = alloc((name, stage), (rows, config.hidden_size), config.hidden_dtype)
    return out


def schedule_config(spec: Any, extra: Any) -> ScheduleConfig:
    """The :class:`ScheduleConfig` of an :class:`~afd_ext.spec.ExchangeSpec` under ``extra`` (an ``AfdExtConnectorConfig``)."""
    return ScheduleConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, hidden_dtype=spec.dtype,
        router_logits_width=spec.router_logits_width, router_logits_dtype=spec.router_logits_dtype,
        send_token_ids=spec.send_token_ids, clamp_idle_to_one=extra.clamp_idle_to_one, max_stages=extra.max_stages,
        hidden_wire=getattr(extra, "hidden_wire_dtype", None), fp8_delivery=getattr(extra, "fp8_delivery", "dequant"),
        fp8_scale_format=getattr(extra, "fp8_scale_format", "fp32"))


class FanInPlan(NamedTuple):
    """An FFN rank's view of one stage.

    Attributes:
        peers: attention role ranks in fan-in order.
        rows: rows from each peer (wire rows; padded under ``pad_to``).
        offsets: first row of each peer in the concatenated tensor.
        total: rows of the concatenated tensor (``sum(rows)``).
        valid_rows: real (unpadded) rows at the start of each peer's range.
    """

    peers: tuple[int, ...]
    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    valid_rows: tuple[int, ...]


class SendPlan(NamedTuple):
    """An attention rank's view of one stage.

    Attributes:
        peers: FFN role ranks, ascending.
        rows: rows to each FFN peer (contiguous ranges of this rank's tensor).
        offsets: first row of each range in this rank's tensor.
        total: this rank's wire rows (``sum(rows)``).
        valid_rows: real (unpadded) rows at the start of each range.
    """

    peers: tuple[int, ...]
    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    valid_rows: tuple[int, ...]


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


@dataclass(slots=True, eq=False, repr=False)
class StepSchedule:
    """The rows of every message of one step. Build with :func:`build_step_schedule`.

    Attributes:
        topology: the :class:`~afd_ext.topology.Topology`.
        config: the :class:`ScheduleConfig`.
        payload: the step's :class:`~afd_ext.metadata.AFDControlPayload`.
        stages: sorted stage ids.
    """

    topology: Topology
    config: ScheduleConfig
    payload: AFDControlPayload
    stages: tuple[int, ...]
    _counts: dict[int, tuple[int, ...]]  # real counts per stage
    _rows: dict[int, tuple[int, ...]]  # wire rows per stage (padded under pad_to)
    _ffn_plans: dict[tuple[int, int], FanInPlan] = field(default_factory=dict)
    _attn_plans: dict[tuple[int, int], SendPlan] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"StepSchedule(A={self.topology.num_attention_ranks}, F={self.topology.num_ffn_ranks}, "
                f"rows={self._rows})")

    # -- lookups ---------------------------------------------------------------

    def _stage(self, stage: int) -> None:
        if stage not in self._rows:
            raise AFDConfigError(f"stage {stage!r} is not in this step; stages are {list(self.stages)}")

    def counts(self, stage: int) -> tuple[int, ...]:
        """Real token counts of every attention rank for ``stage`` (expanded, clamped if configured)."""
        self._stage(stage)
        return self._counts[stage]

    def rows_vector(self, stage: int) -> tuple[int, ...]:
        """Wire rows of every attention rank for ``stage`` (padded under ``pad_to``)."""
        self._stage(stage)
        return self._rows[stage]

    def real_rows(self, stage: int, a: int) -> int:
        """Real (unpadded) rows of attention rank ``a`` in ``stage``."""
        self._stage(stage)
        self.topology.check_role_rank("attention", a)
        return self._counts[stage][a]

    def attention_rows(self, stage: int, a: int) -> int:
        """Wire rows of attention rank ``a`` in ``stage``: the leading dim of its tensors."""
        self._stage(stage)
        self.topology.check_role_rank("attention", a)
        return self._rows[stage][a]

    def attention_plan(self, stage: int, a: int) -> SendPlan:
        """How attention rank ``a``'s rows in ``stage`` go over its FFN peers."""
        key = (stage, a)
        plan = self._attn_plans.get(key)
        if plan is None:
            n = self.attention_rows(stage, a)
            real = self._counts[stage][a]
            split = self.topology.split_rows(a, n)
            plan = SendPlan(
                peers=tuple(f for f, _, _ in split),
                rows=tuple(c for _, _, c in split),
                offsets=tuple(s for _, s, _ in split),
                total=n,
                valid_rows=tuple(max(0, min(c, real - s)) for _, s, c in split),
            )
            self._attn_plans[key] = plan
        return plan

    def edge_rows(self, stage: int, a: int, f: int) -> int:
        """Rows on edge (attention rank ``a``, FFN rank ``f``) in ``stage`` (same both directions;
        0: the message is skipped on both sides)."""
        return self._edge(stage, a, f)[0]

    def _edge(self, stage: int, a: int, f: int) -> tuple[int, int]:
        plan = self.attention_plan(stage, a)
        for peer, r, v in zip(plan.peers, plan.rows, plan.valid_rows):
            if peer == f:
                return r, v
        self.topology.check_role_rank("ffn", f)
        raise AFDConfigError(
            f"attention rank {a} and FFN rank {f} are not peers; attention rank {a} "
            f"exchanges with FFN ranks {list(plan.peers)}"
        )

    def ffn_plan(self, stage: int, f: int) -> FanInPlan:
        """FFN rank ``f``'s fan-in for ``stage``: peers in order, rows and offsets."""
        key = (stage, f)
        plan = self._ffn_plans.get(key)
        if plan is None:
            self._stage(stage)
            peers = self.topology.ffn_peers(f)
            rows, valid, offsets = [], [], []
            off = 0
            for a in peers:
                r, v = self._edge(stage, a, f)
                rows.append(r)
                valid.append(v)
                offsets.append(off)
                off += r
            plan = FanInPlan(peers, tuple(rows), tuple(offsets), off, tuple(valid))
            self._ffn_plans[key] = plan
        return plan

    def ffn_rows(self, stage: int, f: int) -> int:
        """Rows of FFN rank ``f``'s concatenated tensor in ``stage``."""
        return self.ffn_plan(stage, f).total

    # -- input checks ------------------------------------------------------------

    def _check(self, name: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype, who: str,
               device: torch.device | str | None, check_device: Callable[[Any, str], None] | None) -> None:
        """Raise the error for tensor ``t`` that failed the check (``check_device``: the transport's, for the device)."""
        if check_device is not None and isinstance(t, torch.Tensor) and t.device != device:
            check_device(t, name)
        if not isinstance(t, torch.Tensor):
            raise AFDConfigError(f"{name} must be a torch.Tensor {_fmt_shape(shape)} {dtype} for {who}, "
                             f"got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise AFDConfigError(f"{name} must have shape {_fmt_shape(shape)} for {who} (from the step's "
                             f"control payload), got {_fmt_shape(t.shape)}")
        if t.dtype != dtype:
            raise AFDConfigError(f"{name} must be {dtype} for {who}, got {t.dtype}; cast with .to({dtype})")
        if device is not None and t.device != torch.device(device):
            raise AFDConfigError(f"{name} must be on {torch.device(device)} for {who}, got {t.device}")
        if not t.is_contiguous():
            raise AFDConfigError(f"{name} must be contiguous for {who}; call .contiguous()")

    def check_attention_tensors(self, stage: int, a: int, hidden_states: Any, router_logits: Any = None,
                                token_ids: Any = None, *, device: torch.device | str | None = None,
                                hidden_align: int = 1, check_device: Callable[[Any, str], None] | None = None,
                                rows: int | None = None, **parts: Any) -> list[torch.Tensor]:
        """Check attention rank ``a``'s tensors for ``stage`` before anything is sent; return them in wire order.

        The one check of rows, dtypes, devices and layout of the attention side's wire tensors.

        Args:
            stage: stage id.
            a: attention role rank.
            hidden_states, router_logits, token_ids, **parts: the connector's arguments (``token_ids``
                is ``input_ids``; ``parts`` by the keyword a declared part names, others ignored).
                Each part of :attr:`ScheduleConfig.caller_parts` must be given as ``[rows, *cols]``
                of its dtype, contiguous (``hidden_states``: ``[attention_rows(stage, a),
                hidden_size]`` of ``hidden_dtype``); a declared part that does not travel must be None.
            device: when given, every tensor must be on it.
            hidden_align: with FP8 on the wire, the byte alignment ``hidden_states`` must have
                (the transport's ``fp8_hidden_align``: 8 for the CUDA kernels, 1 for gloo).
            check_device: ``check_device(tensor, name)`` raises the transport's error for a tensor
                off ``device`` (default: this check's own message).
            rows: ``attention_plan(stage, a).total`` when the caller has the plan at hand.

        Returns:
            The tensors of :attr:`ScheduleConfig.caller_parts`, in that order.

        Raises:
            AFDConfigError: naming the tensor, what was expected and what to do.
        """
        if rows is None:
            rows = self.attention_plan(stage, a).total
        cfg = self.config
        args = {"hidden_states": hidden_states, "router_logits": router_logits, "input_ids": token_ids, **parts}
        out = []
        for p in cfg.caller_parts:
            t = args.get(p.arg)
            shape = (rows,) + p.cols
            if not (type(t) is torch.Tensor and t.shape == shape and t.dtype == p.dtype  # the hot path: no call
                    and (device is None or t.device == device) and t.is_contiguous()):
                self._refuse(p, t, shape, f"attention rank {a}, stage {stage}", device, check_device)
            out.append(t)
        for arg in cfg.absent_args:
            if args.get(arg) is not None:
                raise AFDConfigError(f"{arg} given for attention rank {a}, stage {stage} but the connector is "
                                     "configured without them (that part does not travel under its "
                                     "configuration); configure them on both roles")
        if cfg.hidden_wire is not None and rows and hidden_states.data_ptr() % hidden_align:
            raise AFDConfigError(f"hidden_states must be {hidden_align}-byte aligned for attention rank {a}, stage "
                                 f"{stage} with FP8 on the wire (the FP8 kernels read {hidden_align} bytes at a "
                                 f"time), got address {hidden_states.data_ptr():#x}; pass hidden_states.clone()")
        return out

    def _refuse(self, p: WirePart, t: Any, shape: tuple[int, ...], who: str, device: Any,
                check_device: Callable[[Any, str], None] | None) -> None:
        """Raise the error for part ``p``'s tensor ``t`` that failed the check (named after its argument)."""
        label = p.arg if p.arg.startswith(p.name) else p.name
        if t is None:
            raise AFDConfigError(f"{label}{'' if label == p.arg else f' ({p.arg})'} missing for {who}: the "
                                 f"connector is configured to send {_fmt_shape(shape)} {p.dtype} {p.name}")
        self._check(label, t, shape, p.dtype, who, device, check_device)

    def check_attention_reply(self, stage: int, a: int, ref_tensor: Any, *,
                              device: torch.device | str | None = None,
                              check_device: Callable[[Any, str], None] | None = None, rows: int | None = None) -> None:
        """Check the tensor the reply lands in: ``[attention_rows, hidden_size]`` ``hidden_dtype`` (on ``device``).

        ``check_device`` and ``rows`` as in :meth:`check_attention_tensors`.

        Raises:
            AFDConfigError: naming ``ref_tensor`` and what was expected.
        """
        shape = (self.attention_plan(stage, a).total if rows is None else rows, self.config.hidden_size)
        t = ref_tensor
        if not (type(t) is torch.Tensor and t.shape == shape and t.dtype == self.config.hidden_dtype  # no call
                and (device is None or t.device == device) and t.is_contiguous()):
            self._check("ref_tensor", t, shape, self.config.hidden_dtype, f"attention rank {a}, stage {stage}", device,
                        check_device)

    def check_ffn_output(self, stage: int, f: int, ffn_output: Any, *,
                         device: torch.device | str | None = None,
                         check_device: Callable[[Any, str], None] | None = None, rows: int | None = None) -> None:
        """Check FFN rank ``f``'s output: ``[ffn_rows(stage, f), hidden_size]`` ``hidden_dtype`` (on ``device``).

        ``check_device`` and ``rows`` (``ffn_plan(stage, f).total``) as in :meth:`check_attention_tensors`.

        Raises:
            AFDConfigError: naming ``ffn_output`` and what was expected.
        """
        shape = (self.ffn_plan(stage, f).total if rows is None else rows, self.config.hidden_size)
        t = ffn_output
        if not (type(t) is torch.Tensor and t.shape == shape and t.dtype == self.config.hidden_dtype  # no call
                and (device is None or t.device == device) and t.is_contiguous()):
            self._check("ffn_output", t, shape, self.config.hidden_dtype, f"FFN rank {f}, stage {stage}", device,
                        check_device)


def _stage_counts(topology: Topology, payload: AFDControlPayload, stage: int, clamp_idle_to_one: bool
                  ) -> tuple[int, ...]:
    """Stage ``stage``'s counts, one per attention rank (:meth:`Topology.expand_counts`); errors name the stage."""
    try:
        return topology.expand_counts(payload.dp_metadata_list[stage].counts, clamp_idle_to_one=clamp_idle_to_one)
    except ValueError as e:
        raise AFDConfigError(f"stage {stage}: {e}") from None


def build_step_schedule(
    topology: Topology, payload: AFDControlPayload, config: ScheduleConfig
) -> StepSchedule:
    """Derive every message of one step from (topology, payload, config).

    Args:
        topology: the A/F topology.
        payload: the step's control payload; each stage's count vector has
            ``A`` entries or one per DP rank (expanded over TP, see
            :meth:`Topology.expand_counts`).
        config: the static exchange facts.

    Returns:
        The :class:`StepSchedule` (plans are computed lazily and cached).

    Raises:
        AFDConfigError: wrong argument types, more stages than ``max_stages``, a
            count vector of the wrong length, a negative count, ``pad_to``
            not covering exactly the step's stages, or a padded size smaller
            than a rank's count. The message names the stage and the rank.
    """
    if not isinstance(topology, Topology):
        raise AFDConfigError(f"topology must be a Topology, got {type(topology).__name__}")
    if not isinstance(payload, AFDControlPayload):
        raise AFDConfigError(f"payload must be an AFDControlPayload, got {type(payload).__name__}")
    if not isinstance(config, ScheduleConfig):
        raise AFDConfigError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    stages = tuple(sorted(payload.dp_metadata_list))
    if config.max_stages is not None and len(stages) > config.max_stages:
        raise AFDConfigError(f"step has {len(stages)} stages {list(stages)}, more than max_stages={config.max_stages}")
    counts = {s: _stage_counts(topology, payload, s, config.clamp_idle_to_one) for s in stages}
    if config.pad_to is None:
        rows = counts
    else:
        if set(config.pad_to) != set(stages):
            raise AFDConfigError(f"pad_to covers stages {sorted(config.pad_to)} but the step has stages {list(stages)}")
        rows = {}
        for s in stages:
            p = config.pad_to[s]
            for a, n in enumerate(counts[s]):
                if n > p:
                    raise AFDConfigError(
                        f"stage {s}: attention rank {a} has {n} tokens, more than the padded size "
                        f"pad_to[{s}]={p}; pick a larger capture size or run the step eagerly"
                    )
            rows[s] = (p,) * topology.num_attention_ranks
    return StepSchedule(topology, config, payload, stages, counts, rows)


# vLLM's default cudagraph capture sizes: 1, 2, 4, then every 8 up to 512.
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4) + tuple(range(8, 513, 8))


def check_capture_sizes(capture_sizes: Sequence[int]) -> tuple[int, ...]:
    """``capture_sizes`` as a tuple, checked: non-empty, ints >= 1, strictly increasing.

    Raises:
        AFDConfigError: any of those does not hold.
    """
    sizes = tuple(capture_sizes)
    if not sizes:
        raise AFDConfigError("capture_sizes is empty; give at least one size, e.g. [1, 2, 4, 8]")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise AFDConfigError(f"capture sizes must be ints >= 1, got {list(sizes)}")
    if list(sizes) != sorted(set(sizes)):
        raise AFDConfigError(f"capture sizes must be strictly increasing, got {list(sizes)}")
    return sizes


def capture_size_for(count: int, capture_sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES) -> int | None:
    """Smallest capture size >= ``max(count, 1)``, or None when ``count`` exceeds the largest.

    Args:
        count: the largest per-peer row count of a stage (>= 0).
        capture_sizes: strictly increasing positive sizes.

    Raises:
        AFDConfigError: ``count`` < 0 or a malformed size list.
    """
    sizes = check_capture_sizes(capture_sizes)
    if count < 0:
        raise AFDConfigError(f"count must be >= 0, got {count}")
    i = bisect.bisect_left(sizes, max(count, 1))
    return sizes[i] if i < len(sizes) else None


def pad_sizes(
    topology: Topology,
    payload: AFDControlPayload,
    capture_sizes: Sequence[int],
    *,
    clamp_idle_to_one: bool = False,
) -> dict[int, int] | None:
    """Pick ``pad_to`` for a step: per stage, :func:`capture_size_for` of the largest rank's count.

    Both roles can call it with the same payload and capture sizes.

    Returns:
        ``{stage: size}``, or ``None`` when some stage exceeds the largest
        capture size (run the step eagerly) or there are no capture sizes.

    Raises:
        AFDConfigError: a capture size is not an int >= 1, or the payload is invalid.
    """
    if not capture_sizes:
        return None
    sizes = check_capture_sizes(sorted(set(capture_sizes)))
    out = {}
    for s in sorted(payload.dp_metadata_list):
        fit = capture_size_for(max(_stage_counts(topology, payload, s, clamp_idle_to_one)), sizes)
        if fit is None:
            return None
        out[s] = fit
    return out


def warmup_payload(topology: Topology, num_stages: int = 1, *, is_warmup: bool = True) -> AFDControlPayload:
    """A payload whose step carries at least one row over every edge and direction.

    Used before any capture so NCCL's lazily built connections exist. Each
    attention rank sends as many rows as it has FFN peers (one per edge).
    """
    _pos_int(num_stages, "num_stages")
    per_rank = [len(topology.attention_peers(a)) for a in range(topology.num_attention_ranks)]
    return AFDControlPayload(dp_metadata_list={s: list(per_rank) for s in range(num_stages)}, is_warmup=is_warmup)
