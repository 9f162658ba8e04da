"""One step's state on one rank: its sequencer, schedule, buffers and the exchanges still in flight."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AFDConfigError
from ..metadata import AFDTransferMetadata, AFDTransferState
from ..schedule import StepSchedule
from ..transport.base import MessageTag, PendingSend
from .sequencer import StepSequencer

__all__ = ["AfdExtTransferState", "Step", "Exchange", "ReplySend", "context_metadata", "canonical_strides"]


def context_metadata(context: Any, op: str) -> AFDTransferMetadata:
    """``context.metadata`` (ours or the reference's class), or :class:`AFDConfigError` (a ValueError).

    A ``None`` or foreign context must not become an ``AttributeError`` that
    skips the step's abandon/abort handling.
    """
    try:
        md = context.metadata
    except AttributeError:  # None, or not a context at all
        md, what = None, ("None" if context is None else type(context).__name__)
    else:
        what = f"{type(context).__name__} whose metadata is None"
    if md is None:  # the reference's own metadata class is read by its fields, like ours
        raise AFDConfigError(f"{op}: context must be an AFDTransferContext carrying AFDTransferMetadata, got {what}")
    return md


def canonical_strides(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with the row-major strides of its shape (a view of the same memory; no copy).

    torch calls a tensor contiguous when only its size-1 dimensions have odd
    strides (``ids2d[:, 0]`` of a one-token ``[1, 2]`` tensor has stride 2);
    the wire views it as bytes, which needs the last stride to be 1. For such a
    tensor the strides of size-1 dimensions address nothing, so restriding is exact.
    """
    if t is None or not t.is_contiguous():
        return t
    want, acc = [], 1
    for n in reversed(t.shape):
        want.append(acc)
        acc *= max(int(n), 1)
    want.reverse()
    return t if tuple(t.stride()) == tuple(want) else t.as_strided(t.shape, want)


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
        pending: per stage, attention sends awaiting their reply, oldest first.
    """

    seq: StepSequencer
    schedule: StepSchedule
    strict: bool
    bufs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    pending: dict[int, deque] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.seq.step

    def tag(self, op: str, direction: str, layer: int, stage: int, layer_idx: int = -1) -> MessageTag:
        return MessageTag(op, direction, self.seq.step, layer, stage, layer_idx, self.seq.user_step)
