"""The timing harness: warm-up, per-iteration timers, CUDA-graph capture and replay, statistics.

Method (``docs/benchmarks.md`` has the long form):
* **Eager**: the timed loop runs ``iters`` back-to-back iterations of a step
  function after ``warmup`` untimed ones. A timing event (a CUDA event on the
  current stream, or the host clock on CPU) is recorded before every iteration
  and after the last, so every iteration yields one sample: the time between
  the stream reaching the start of this iteration and the start of the next.
  On a launch-bound loop that includes the host's launch cost, on a
  device-bound loop it is the device time; both are what a layer loop pays.
* **CUDA graph**: ``graph_iters`` iterations are captured into one graph
  (after an eager warm-up of every edge, as NCCL requires), the
  graph is replayed ``warmup`` times untimed and then ``replays`` times with
  an event between replays; one sample is one replay's time divided by
  ``graph_iters``. p10/p90 are therefore over K-iteration means (narrower
  than per-iteration spread); the median is unaffected in practice.
* **Statistics**: median, p10, p90, mean, min and the sample count, in µs.

Every wait here has a deadline: :func:`wait_event` polls instead of blocking
in ``cudaEventSynchronize``, so a peer that never posts its half of an NCCL
exchange becomes a :class:`TimeoutError` naming the operation, not a hang.

The core engineer's GPU timing scripts reuse
:func:`time_eager`, :func:`capture_graph` and :func:`time_graph`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from afd_ext.errors import AFDConfigError, AFDTimeoutError

#: Deadline, in seconds, for the device to finish one timed block.
DEFAULT_WAIT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Stats:
    """Summary of timing samples, all in microseconds.

    Attributes:
        median, p10, p90, mean, min: statistics of the samples (µs).
        n: number of samples.
    """

    median: float
    p10: float
    p90: float
    mean: float
    min: float
    n: int


def summarize(samples_us: Sequence[float]) -> Stats:
    """Median, p10, p90, mean and min of timing samples in µs.

    Raises:
        AFDConfigError: no samples, or a sample that is not a finite number.
    """
    values = [float(v) for v in samples_us]
    if not values:
        raise AFDConfigError("cannot summarize an empty list of timing samples")
    if not all(math.isfinite(v) for v in values):
        raise AFDConfigError("timing samples must be finite numbers")

    p10, median, p90 = (float(x) for x in np.percentile(values, (10.0, 50.0, 90.0)))
    return Stats(median=median, p10=p10, p90=p90, mean=float(np.mean(values)), min=min(values), n=len(values))


def wait_event(event: Any, timeout_s: float, what: str, poll_s: float = 0.0005) -> None:
    """Wait until a CUDA event has completed, polling with a deadline.

    Args:
        event: a recorded ``torch.cuda.Event``.
        timeout_s: deadline in seconds.
        what: names the operation and the peer for the error message.
        poll_s: sleep between polls, seconds.

    Raises:
        AFDTimeoutError: the event did not complete within ``timeout_s`` (a peer
            most likely never posted its half of an NCCL call).
    """
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise AFDTimeoutError(
                f"{what}: the device did not finish within {timeout_s:.0f} s; "
                "the peer most likely never posted the matching NCCL call"
            )
        time.sleep(poll_s)


def drain_stream(timeout_s: float, what: str) -> None:
    """Wait, at most ``timeout_s`` (:func:`wait_event`), for everything queued on the current CUDA stream."""

    ev = torch.cuda.Event()
    ev.record()
    wait_event(ev, timeout_s, what)


def _timed_loop(run: Callable[[], Any], n: int, cuda: bool, timeout_s: float, what: str,
                divide_by: int = 1, timed: bool = True) -> list[float]:
    """Run ``run`` ``n`` times with a mark (CUDA event on the current stream, or the host clock) before
    each and after the last; the µs between consecutive marks, each divided by ``divide_by``.
    Untimed (``timed=False``): the same runs, one wait for the device at the end, ``[]``."""
    if not timed:
        for _ in range(n):
            run()
        if cuda:
            drain_stream(timeout_s, what)
        return []
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        for ev in events[:-1]:
            ev.record()
            run()
        events[-1].record()
        wait_event(events[-1], timeout_s, what)
        return [a.elapsed_time(b) * 1000.0 / divide_by for a, b in zip(events, events[1:])]
    marks = []
    for _ in range(n):
        marks.append(time.perf_counter_ns())
        run()
    marks.append(time.perf_counter_ns())
    return [(b - a) / 1000.0 / divide_by for a, b in zip(marks, marks[1:])]


def time_eager(step: Callable[[], Any], iters: int, warmup: int, *, cuda: bool,
               timeout_s: float = DEFAULT_WAIT_TIMEOUT_S, what: str = "eager loop",
               timed: bool = True) -> list[float]:
    """Run ``warmup`` untimed then ``iters`` timed iterations of ``step``; per-iteration µs.

    Args:
        step: one iteration (issues work on the current stream).
        iters: timed iterations, >= 1.
        warmup: untimed iterations first, >= 0.
        cuda: CUDA events (True) or the host clock (False).
        timeout_s: deadline for the device to finish the loop.
        what: names the loop in a timeout error.
        timed: False on the side that only keeps lockstep (runs the same
            number of iterations, records nothing, waits for completion).

    Returns:
        ``iters`` samples in µs (empty when ``timed`` is False).

    Raises:
        AFDConfigError: ``iters < 1`` or ``warmup < 0``.
        AFDTimeoutError: the device did not finish within ``timeout_s``.
    """
    if iters < 1 or warmup < 0:
        raise AFDConfigError(f"time_eager needs iters >= 1 and warmup >= 0, got {iters}, {warmup}")
    for _ in range(warmup):
        step()
    return _timed_loop(step, iters, cuda, timeout_s, what, timed=timed)


def capture_graph(step: Callable[[], Any], graph_iters: int) -> Any:
    """Capture ``graph_iters`` iterations of ``step`` into one ``torch.cuda.CUDAGraph``.

    Both processes of an exchange must capture their halves around the same
    time, after every edge has run once eagerly (NCCL sets up
    its connections on first use, which cannot happen inside a capture).
    Buffers the step uses must already be allocated; anything the step
    allocates comes from the graph's private pool and keeps its address.

    Args:
        step: one iteration, issuing work on the current stream.
        graph_iters: iterations per graph, >= 1.

    Returns:
        The captured graph; ``graph.replay()`` runs all iterations on the current stream.

    Raises:
        AFDConfigError: ``graph_iters < 1``.
    """

    if graph_iters < 1:
        raise AFDConfigError(f"graph_iters must be >= 1, got {graph_iters}")
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's proxy thread may touch CUDA while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(graph_iters):
            step()
    return graph


def time_graph(graph: Any, replays: int, warmup: int, graph_iters: int, *, timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
               what: str = "graph replay", timed: bool = True) -> list[float]:
    """Replay a captured graph; per-iteration µs (one sample per replay, divided by ``graph_iters``).

    Args:
        graph: a ``torch.cuda.CUDAGraph`` from :func:`capture_graph`.
        replays: timed replays, >= 1.
        warmup: untimed replays first.
        graph_iters: iterations captured in the graph.
        timeout_s: deadline for the device.
        what: names the loop in a timeout error.
        timed: False on the side that only keeps lockstep (replays, waits, returns ``[]``).

    Raises:
        AFDConfigError: ``replays < 1`` or ``warmup < 0``.
        AFDTimeoutError: the device did not finish within ``timeout_s``.
    """
    if replays < 1 or warmup < 0:
        raise AFDConfigError(f"time_graph needs replays >= 1 and warmup >= 0, got {replays}, {warmup}")
    for _ in range(warmup):
        graph.replay()
    return _timed_loop(graph.replay, replays, True, timeout_s, what, divide_by=graph_iters, timed=timed)
