"""This rank's per-stage buffers: one layout per role, from an eager pool or a CUDA-graph arena.

FFN ranks receive every peer's rows into one buffer per stage and tensor
(:func:`afd_ext.schedule.stage_buffers`: ``hidden``, ``router_logits``,
``token_ids``), sized from the schedule when a payload is applied, reused
across layers and grown only between steps (no ``torch.cat``). Attention ranks
send the caller's tensors and keep none. With a static arena set
(:meth:`BufferPool.use_arena`, :class:`afd_ext.graphs.StaticArena`) every
buffer comes from the arena at its captured address instead.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from ..schedule import StepSchedule, stage_buffers

__all__ = ["BufferPool"]


class BufferPool:
    """Per-stage buffers of one rank (see the module doc).

    Args:
        role: ``"attention"`` or ``"ffn"``; role_rank: this rank's index; device: where buffers live.
    """

    def __init__(self, role: str, role_rank: int, device: torch.device):
        self.role = role
        self.role_rank = role_rank
        self.device = device
        self._bufs: dict[Hashable, torch.Tensor] = {}
        self._arena: Any = None

    def use_arena(self, arena: Any) -> None:
        """Take every buffer from ``arena`` from now on, or from the eager pool again (None)."""
        self._arena = arena

    def _buffer(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._arena is not None:
            return self._arena.buffer(key, shape, dtype)
        rows, cols = shape[0], tuple(shape[1:])
        t = self._bufs.get(key)
        if t is None or t.shape[0] < rows or t.dtype != dtype or tuple(t.shape[1:]) != cols:
            t = torch.empty((max(rows, 1),) + cols, dtype=dtype, device=self.device)
            self._bufs[key] = t
        return t[:rows]

    def stage(self, sch: StepSchedule, stage: int) -> dict[str, torch.Tensor | None]:
        """This rank's buffers of ``stage`` in ``sch``: the FFN rank's fan-in targets, nothing on an attention rank."""
        if self.role != "ffn":
            return {}
        return stage_buffers(self._buffer, sch.config, stage, sch.ffn_rows(stage, self.role_rank), fan_in=True)

    def release(self) -> list[torch.Tensor]:
        """Forget every buffer (and the arena); returns the eager ones (a transport may have to keep them)."""
        old, self._bufs = list(self._bufs.values()), {}
        self._arena = None
        return old
