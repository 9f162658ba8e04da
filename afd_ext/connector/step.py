"""One step's state on one rank: its sequencer, schedule, buffers and the exchanges still in flight."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..metadata import AFDTransferState
from ..schedule import StepSchedule
from ..transport.base import MessageTag, PendingSend
from .sequencer import StepSequencer

__all__ = ["AfdExtTransferState", "Step", "Exchange", "ReplySend"]


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
        return MessageTag(op, direction, self.seq.step, layer, stage, layer_idx)
