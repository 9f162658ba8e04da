"""Stage streams: one CUDA stream per stage, forked from and joined into the caller's stream.

Shared by the transports that move CUDA tensors (:mod:`.nccl`, :mod:`.peer`):
the rule that a stage's reply is never queued behind the next stage's send is
one rule, kept here once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

__all__ = ["StageStreams"]


class StageStreams:
    """One CUDA stream per stage, forked from and joined into the caller's stream through events.

    So a stage's reply receive is never queued behind the next stage's send,
    and the calls are capturable (a capture supports event fork/join).
    Streams are created by :meth:`prepare` when a payload is applied, never
    inside a capture; re-recording an event does not affect earlier waits on it.
    :meth:`join` joins only the streams used since they were last joined: a
    stream whose last work was eager cannot be joined inside a capture (CUDA
    refuses the dependency: ``cudaErrorStreamCaptureIsolation``), and its work
    was already joined.

    Attributes:
        separate: True (default): each stage runs on its own stream. False: every
            stage runs on the caller's stream and :meth:`on` / :meth:`join` do
            nothing (the peer transport's one-stage steps: no extra events).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.separate = True
        self._streams: dict[int, Any] = {}
        self._events: dict[int, tuple[Any, Any]] = {}  # stage -> (fork, join)
        self._unjoined: set[int] = set()  # stages given work since their last join

    def prepare(self, stages: Sequence[int]) -> None:
        for s in stages:
            if s not in self._streams:
                self._streams[s] = torch.cuda.Stream(device=self.device)
                self._events[s] = (torch.cuda.Event(), torch.cuda.Event())

    @contextlib.contextmanager
    def on(self, stage: int) -> Iterator[None]:
        """Run the body on ``stage``'s stream, after the caller's current stream."""
        if not self.separate:
            yield
            return
        self.prepare((stage,))
        fork, _ = self._events[stage]
        fork.record(torch.cuda.current_stream(self.device))
        self._streams[stage].wait_event(fork)
        self._unjoined.add(stage)
        with torch.cuda.stream(self._streams[stage]):
            yield

    def join(self, stages: Sequence[int] | None = None) -> None:
        """Make the caller's current stream wait for ``stages``' streams (default: all) that have
        work since their last join."""
        if not self._unjoined:
            return
        cur = torch.cuda.current_stream(self.device)
        for s in list(self._unjoined) if stages is None else stages:
            if s in self._unjoined:
                self._unjoined.discard(s)
                _, join = self._events[s]
                join.record(self._streams[s])
                cur.wait_event(join)

    def clear(self) -> None:
        self._streams.clear()
        self._events.clear()
        self._unjoined.clear()
