"""One step's state on one rank: its sequencer, schedule, buffers and the exchanges still in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AFDConfigError
from ..metadata import AFDTransferMetadata, AFDTransferState
from ..schedule import StepSchedule
from ..transport.base import MessageTag, PendingSend
from .sequencer import StepSequencer, stage_arg

__all__ = ["AfdExtTransferState", "Step", "Exchange", "ReplySend", "context_metadata", "check_routing_spec",
           "flag_arg"]

#: Bound of a context's ``layer_idx`` (it travels in int32/int64 header fields).
_MAX_INDEX = 2**31


def context_metadata(context: Any, op: str) -> AFDTransferMetadata:
    """``context.metadata`` (ours or the reference's class, read by its fields), checked, or :class:`AFDConfigError`.

    A ``None`` or foreign context must not become an ``AttributeError`` that
    skips the step's abandon/abort handling. ``layer_idx`` must be an int in
    ``[0, 2**31)`` (an integral float is taken) and ``seq_lens`` a list of ints
    >= 0; ``stage_idx`` is the sequencer's to check (:func:`~.sequencer.stage_arg`).
    Returns ``context.metadata`` itself when it is an :class:`AFDTransferMetadata`
    with plain-int fields, else an equal :class:`AFDTransferMetadata`.
    """
    try:
        md = context.metadata
    except AttributeError:  # None, or not a context at all
        md, what = None, ("None" if context is None else type(context).__name__)
    else:
        what = f"{type(context).__name__} whose metadata is None"
    if md is None:
        raise AFDConfigError(f"context must be an AFDTransferContext carrying AFDTransferMetadata, got {what}")
    if type(md) is AFDTransferMetadata and type(md.layer_idx) is int and 0 <= md.layer_idx < _MAX_INDEX and \
            type(md.seq_lens) is list and set(map(type, md.seq_lens)) <= {int} and min(md.seq_lens, default=0) >= 0:
        return md  # the hot path: as built by create_attention_metadata / recv_attn_output
    try:
        fields = (md.layer_idx, md.stage_idx, md.seq_lens)
    except AttributeError as e:
        raise AFDConfigError(f"context.metadata ({type(md).__name__}) lacks the transfer metadata fields "
                             f"layer_idx, stage_idx, seq_lens ({e})") from None
    layer_idx = stage_arg(fields[0], "context.metadata.layer_idx", "layer index")
    if not 0 <= layer_idx < _MAX_INDEX:
        raise AFDConfigError(f"context.metadata.layer_idx must be in [0, {_MAX_INDEX}), got {layer_idx}")
    if isinstance(fields[2], (str, bytes)) or not isinstance(fields[2], Sized):
        raise AFDConfigError(f"context.metadata.seq_lens must be a list of row counts (ints >= 0), got "
                             f"{type(fields[2]).__name__} {fields[2]!r}"[:200])
    try:
        return AFDTransferMetadata(layer_idx=layer_idx, stage_idx=fields[1], seq_lens=list(fields[2]))
    except AFDConfigError as e:
        raise AFDConfigError(f"context.metadata.{e}") from None


def check_routing_spec(spec: Any, width: int | None, dtype: torch.dtype) -> None:
    """Refuse a ``routing_spec`` (``recv_attn_output``'s; None passes) other than the configured router logits.

    Args:
        spec: what the caller passed: None or an ``AFDExpertRoutingSpec`` (or the reference's: any object
            with an int ``router_logits_width`` and a ``torch.dtype`` ``router_logits_dtype``).
        width, dtype: the configured router logits ``[n, width]`` of ``dtype``; ``width`` None: none travel.

    Raises:
        AFDConfigError: not a routing spec, given without router logits, or another width or dtype;
            the message says what to set on both roles.
    """
    if spec is None:
        return
    try:
        got = (spec.router_logits_width, spec.router_logits_dtype)
    except AttributeError:
        got = (None, None)
    if isinstance(got[0], bool) or not isinstance(got[0], int) or not isinstance(got[1], torch.dtype):
        raise AFDConfigError("routing_spec must be None or an AFDExpertRoutingSpec(router_logits_width: int, "
                             f"router_logits_dtype: torch.dtype), got {type(spec).__name__} {spec!r}"[:300])
    if width is None:
        raise AFDConfigError(
            f"routing_spec [{got[0]}] {got[1]} given, but the connector was initialised without router logits: "
            "pass router_logits_width (or routing_spec) at construction, or under vLLM set "
            "compute_gate_on_attention to true, on both roles")
    if got != (width, dtype):
        raise AFDConfigError(
            f"routing_spec is [{got[0]}] {got[1]}, but the connector's router logits are [{width}] {dtype}: "
            "construct both roles with this width and dtype (under vLLM afd_ext derives them from the model "
            "config: the expert count, and the dtype of vLLM's DeepSeek gate unless "
            f"connector_extra_config.router_logits_dtype is set, here to '{str(got[1]).removeprefix('torch.')}')")


def flag_arg(value: Any, name: str) -> bool:
    """``value`` as a bool flag: ``True``/``False`` (or the ints 1/0).

    Raises:
        AFDConfigError: anything else (None, a string, a tensor), naming ``name``.
    """
    if value is True or value is False:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise AFDConfigError(f"{name} must be a bool, got {type(value).__name__} {value!r}"[:200])


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
class Exchange:
    """An attention send whose reply has not been received yet (its tensors stay alive until then)."""

    layer: int
    stage: int
    tag: MessageTag
    pending: PendingSend
    keep: tuple


@dataclass
class ReplySend:
    """An FFN reply that may still be sending from the caller's output tensor."""

    pending: PendingSend
    output: torch.Tensor


@dataclass
class Step:
    """The current step: position (pure), schedule, whether headers travel, buffers, sends in flight.

    Attributes:
        seq: the :class:`~afd_ext.connector.sequencer.StepSequencer`.
        schedule: the step's :class:`~afd_ext.schedule.StepSchedule`.
        strict: strict-mode headers on this step (off for captured / replayed steps).
        bufs: per stage, this rank's buffers (taken when the payload is applied).
        wire: per stage, an FFN rank's fan-in targets in wire order (``bufs`` of ``schedule.config.wire_parts``).
        pending: per stage, attention sends awaiting their reply, oldest first.
    """

    seq: StepSequencer
    schedule: StepSchedule
    strict: bool
    bufs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    wire: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pending: dict[int, deque] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.seq.step

    def tag(self, op: str, direction: str, layer: int, stage: int, layer_idx: int = -1) -> MessageTag:
        return MessageTag(op, direction, self.seq.step, layer, stage, layer_idx, self.seq.user_step)
