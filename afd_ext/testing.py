"""Multi-process harness shared by the tests, the demo and the benchmarks.

``run_workers`` starts one process per rank with the ``spawn`` start method,
waits for all of them against one deadline, and always tears every process
down in ``finally``: a hang becomes a ``TimeoutError`` that names the ranks
still running, a crash becomes a ``WorkerError`` carrying the worker's
traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Mapping, Sequence


class WorkerError(RuntimeError):
    """A worker raised; ``rank`` is the failing worker, the message holds its traceback."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"worker rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _entry(fn, rank, nprocs, args, env, q):
    os.environ.update(env or {})
    try:
        result = fn(rank, nprocs, *args)
        q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        q.put((rank, False, traceback.format_exc()))
        _flush(q)
        raise SystemExit(1)
    _flush(q)


def _flush(q) -> None:
    # Queue.put hands the item to a feeder thread: wait until it is written, so a
    # crash later in interpreter teardown cannot swallow an already-made report.
    q.close()
    q.join_thread()


def run_workers(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    per_rank_env: Sequence[Mapping[str, str]] | None = None,
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` spawned processes.

    Args:
        fn: a picklable (module-level) function. Its return value must be picklable.
        nprocs: number of processes, >= 1.
        args: extra positional arguments, picklable.
        timeout_s: deadline for all workers together, in seconds.
        env: environment variables set in every worker before ``fn`` runs.
        per_rank_env: optional list (length ``nprocs``) of extra variables per rank,
            e.g. ``CUDA_VISIBLE_DEVICES`` to bind a worker to one GPU before its
            first CUDA call.

    Returns:
        The workers' return values, indexed by rank.

    Raises:
        WorkerError: the first worker that raised (others are killed).
        TimeoutError: the deadline passed; the message names the ranks still running.
        RuntimeError: a worker died without reporting (e.g. a segfault), named by rank
            and exit code.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if per_rank_env is not None and len(per_rank_env) != nprocs:
        raise ValueError(f"per_rank_env has {len(per_rank_env)} entries, expected {nprocs}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    results: dict[int, Any] = {}
    try:
        for rank in range(nprocs):
            wenv = dict(env or {})
            if per_rank_env is not None:
                wenv.update(per_rank_env[rank])
            p = ctx.Process(target=_entry, args=(fn, rank, nprocs, tuple(args), wenv, q), daemon=True)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        while len(results) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                alive = [r for r in range(nprocs) if r not in results]
                raise TimeoutError(f"workers {alive} of {nprocs} still running after {timeout_s:.0f} s")
            try:
                rank, ok, payload = q.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive() and p.exitcode not in (None, 0):
                        # Give a late queue message a moment to arrive.
                        try:
                            rank, ok, payload = q.get(timeout=1.0)
                        except queue_mod.Empty:
                            raise RuntimeError(
                                f"worker rank {r} died with exit code {p.exitcode} without reporting"
                            ) from None
                        break
                else:
                    continue
            if not ok:
                raise WorkerError(rank, payload)
            results[rank] = payload
        return [results[r] for r in range(nprocs)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()
