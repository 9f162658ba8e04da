"""This rank's per-stage buffers: one layout per role, from an eager pool or a CUDA-graph arena.

FFN ranks receive every peer's rows into one buffer per stage and tensor
(``hidden``, ``logits``, ``ids``), sized from the schedule when a payload is
applied, reused across layers and grown only between steps (no ``torch.cat``).
Both roles keep a ``wire`` buffer per stage when the stage travels packed
(one uint8 row per token). With a static arena set
(:meth:`BufferPool.use_arena`, :class:`afd_ext.graphs.StaticArena`) every
buffer comes from the arena at its captured address instead.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from ..schedule import PACKED, StepSchedule
from ..spec import TOKEN_IDS_DTYPE

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

    def _buffer(self, key: Hashable, rows: int, cols: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = (rows,) + cols
        if self._arena is not None:
            return self._arena.buffer(key, shape, dtype)
        t = self._bufs.get(key)
        if t is None or t.shape[0] < rows or t.dtype != dtype or tuple(t.shape[1:]) != cols:
            t = torch.empty((max(rows, 1),) + cols, dtype=dtype, device=self.device)
            self._bufs[key] = t
        return t[:rows]

    def stage(self, sch: StepSchedule, stage: int) -> dict[str, torch.Tensor]:
        """This rank's buffers of ``stage`` in ``sch``: ``hidden``/``logits``/``ids`` (FFN), ``wire`` (packed)."""
        cfg = sch.config
        out: dict[str, torch.Tensor] = {}
        if self.role == "ffn":
            n = sch.ffn_rows(stage, self.role_rank)
            out["hidden"] = self._buffer(("fan_in_hidden", stage), n, (cfg.hidden_size,), cfg.hidden_dtype)
            if cfg.router_logits_width is not None:
                out["logits"] = self._buffer(("fan_in_logits", stage), n, (cfg.router_logits_width,),
                                             cfg.router_logits_dtype)
            if cfg.send_token_ids:
                out["ids"] = self._buffer(("fan_in_ids", stage), n, (), TOKEN_IDS_DTYPE)
        else:
            n = sch.attention_rows(stage, self.role_rank)
        if sch.wire_format(stage) == PACKED:
            out["wire"] = self._buffer(("wire", stage), n, (cfg.packed_row_bytes,), torch.uint8)
        return out

    def release(self) -> list[torch.Tensor]:
        """Forget every buffer (and the arena); returns the eager ones (a transport may have to keep them)."""
        old, self._bufs = list(self._bufs.values()), {}
        self._arena = None
        return old
