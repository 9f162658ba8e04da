"""Multi-process harness shared by the tests, the demo and the benchmarks.

``run_workers`` starts one process per rank with the ``spawn`` start method,
waits for all of them against one deadline, and always tears every process
down in ``finally``: a hang becomes a ``TimeoutError`` that names the ranks
still running, a crash becomes a ``WorkerError`` carrying the worker's
traceback.

``place_processes`` is the one place that decides which GPU each process of a
multi-process GPU test, of ``afd-ext demo --backend nccl`` and of
``afd-ext bench`` uses (see :class:`GpuPlacement`). Its shared-GPU
arrangement (every process on GPU 0, NCCL over sockets) is a test and demo
arrangement only: nothing in the connector or the launcher applies it to a
user's NCCL run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from afd_ext import envs
from afd_ext.errors import FOLLOW_ON_ERRORS, AFDPeerError


class WorkerError(RuntimeError):
    """A worker raised; ``rank`` is the failing worker, the message holds its traceback."""

    def __init__(self, rank: int, tb: str, follow_on: bool = False):
        super().__init__(f"worker rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb
        #: the error only reports another rank's failure (:data:`afd_ext.errors.FOLLOW_ON_ERRORS`)
        self.follow_on = follow_on

    def exception_line(self) -> tuple[str, str] | None:
        """The worker's exception as ``(class name, first line of its message)``, or None if unreadable.

        The traceback text ends with the exception: the lines after the last frame (``  File ...``
        and its indented source lines); the class name is unqualified.
        """
        lines = self.traceback.rstrip("\n").splitlines()
        frames = [i for i, ln in enumerate(lines) if ln.startswith('  File "')]
        i = frames[-1] + 1 if frames else 0
        while i < len(lines) and lines[i].startswith("    "):
            i += 1
        if i >= len(lines):
            return None
        cls, _, msg = lines[i].partition(": ")
        return cls.rsplit(".", 1)[-1], msg


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    Picked at random below the kernel's ephemeral range where it can: a port
    from ``bind(0)`` comes from that range, and between this call and the
    store's bind it can be taken as the local port of any outgoing connection
    (NCCL and gloo open many), which showed as ``EADDRINUSE`` when several
    test groups ran at once (docs/gpu-test-results.md, run 14).
    """
    import random

    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low > 11000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: Set to 1 to force the shared-GPU arrangement (every process on GPU 0, NCCL
#: over sockets) on a machine with several GPUs, e.g. to rehearse a one-GPU run.
SHARE_GPU_ENV = "AFD_TEST_SHARE_GPU"

#: NCCL_HOSTID of process ``i`` in the shared arrangement: NCCL refuses two ranks
#: of one communicator on one GPU of one host ("Duplicate GPU detected"); a
#: different host id per process makes each look like its own host, so NCCL
#: connects them through its socket transport (correct, ~4.5 ms per round trip).
NCCL_HOSTID_PREFIX = "afdhost"


@dataclass(frozen=True)
class GpuPlacement:
    """Which GPU each process uses (AFD world order: FFN ranks first, then attention ranks).

    Arrangements:
        ``own-gpu``: one process per GPU (attention ranks on the first GPUs, FFN
            ranks on the next). Timings are meaningful.
        ``split-roles``: fewer GPUs than processes but at least two: FFN ranks on
            the last GPU(s), attention ranks share the others, so every
            attention-FFN edge still crosses GPUs (NVLink); processes of one role
            are time-sliced, so timings are not meaningful.
        ``shared-gpu``: every process on one GPU (a one-GPU machine, or forced
            with ``AFD_TEST_SHARE_GPU=1``). Each process gets its own
            ``NCCL_HOSTID`` so NCCL accepts two ranks on one GPU and connects them
            through sockets. Correctness only.

    Attributes:
        num_attention_ranks, num_ffn_ranks: ``A`` and ``F``.
        gpus: ``CUDA_VISIBLE_DEVICES`` label per world rank (length ``A + F``).
        arrangement: ``"own-gpu"``, ``"split-roles"`` or ``"shared-gpu"`` (``"cpu"``, no GPU, for the bench's
            gloo path).
        nccl_hostids: ``NCCL_HOSTID`` per world rank, or ``()`` when NCCL needs none.
    """

    num_attention_ranks: int
    num_ffn_ranks: int
    gpus: tuple[str, ...]
    arrangement: str
    nccl_hostids: tuple[str, ...] = ()

    @property
    def shared(self) -> bool:
        """True when some GPU runs more than one process (the driver time-slices them)."""
        return len(set(self.gpus)) < len(self.gpus)

    @property
    def timings_meaningful(self) -> bool:
        """Latencies mean something only with one process per GPU."""
        return not self.shared

    def env(self) -> list[dict[str, str]]:
        """Per world rank: ``CUDA_VISIBLE_DEVICES`` (and ``NCCL_HOSTID`` when shared), for ``run_workers``."""
        out = [{"CUDA_VISIBLE_DEVICES": g} for g in self.gpus]
        for e, h in zip(out, self.nccl_hostids):
            e["NCCL_HOSTID"] = h
        return out

    def describe(self) -> str:
        """E.g. ``shared-gpu 2A1F: ffn0->GPU0 attn0->GPU0 attn1->GPU0 (NCCL over sockets: NCCL_HOSTID per process)``."""
        f = self.num_ffn_ranks
        if not self.gpus:
            return f"{self.num_attention_ranks}A{f}F on CPU (gloo)"
        parts = [f"ffn{i}->GPU{self.gpus[i]}" for i in range(f)]
        parts += [f"attn{i}->GPU{g}" for i, g in enumerate(self.gpus[f:])]
        text = f"{self.arrangement} {self.num_attention_ranks}A{f}F: " + " ".join(parts)
        if self.nccl_hostids:
            text += " (NCCL over sockets: NCCL_HOSTID per process; correctness only)"
        elif self.shared:
            text += " (GPUs shared by processes of one role: correctness only)"
        return text


def visible_gpu_labels(num_gpus: int) -> list[str]:
    """Labels of the first ``num_gpus`` visible GPUs as a child's ``CUDA_VISIBLE_DEVICES`` names them.

    Raises:
        ValueError: ``CUDA_VISIBLE_DEVICES`` names fewer GPUs than ``num_gpus``.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    labels = [x.strip() for x in env.split(",") if x.strip()] or [str(i) for i in range(num_gpus)]
    if len(labels) < num_gpus:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={env!r} names {len(labels)} GPUs but {num_gpus} are visible; "
                         "set it to a plain comma list of the GPUs to use")
    return labels[:num_gpus]


def visible_gpu_count() -> int:
    """CUDA devices visible to this process (0 without a CUDA torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_processes(num_attention_ranks: int, num_ffn_ranks: int, num_gpus: int | None = None, *,
                    gpu_map: Sequence[int] | None = None, share: bool | None = None) -> GpuPlacement:
    """Decide the GPU of every process of a multi-process GPU test, the demo or the benchmark.

    Args:
        num_attention_ranks, num_ffn_ranks: ``A``, ``F`` >= 1.
        num_gpus: GPUs visible to this process; None counts them
            (:func:`visible_gpu_count`).
        gpu_map: optional explicit GPU index per process, attention ranks first
            then FFN ranks (indices into the visible GPUs). When it puts an
            attention rank and an FFN rank on one GPU, every process gets its
            own ``NCCL_HOSTID`` (arrangement ``shared-gpu``).
        share: True forces the ``shared-gpu`` arrangement on several GPUs; None
            reads ``AFD_TEST_SHARE_GPU`` (1, true, yes, on). One visible GPU is always shared.

    Returns:
        The placement; ``placement.env()`` is ``run_workers``' ``per_rank_env``.

    Raises:
        ValueError: no GPU visible, a bad size, ``AFD_TEST_SHARE_GPU`` not a boolean, or a
            ``gpu_map`` of the wrong length or with an index not below ``num_gpus``.
    """
    A, F = num_attention_ranks, num_ffn_ranks
    if A < 1 or F < 1:
        raise ValueError(f"need at least one attention and one FFN rank, got A={A}, F={F}")
    n = visible_gpu_count() if num_gpus is None else int(num_gpus)
    if n < 1:
        raise ValueError("no CUDA GPU is visible: a GPU placement needs at least one")
    labels = visible_gpu_labels(n)
    if share is None:
        share = envs.get(SHARE_GPU_ENV) and not gpu_map
    if gpu_map:
        if len(gpu_map) != A + F:
            raise ValueError(f"--gpu-map needs {A + F} entries (attention ranks then FFN ranks), got {len(gpu_map)}")
        bad = [g for g in gpu_map if not 0 <= g < n]
        if bad:
            raise ValueError(f"--gpu-map entries must be in [0, {n}), got {bad}")
        attn, ffn = list(gpu_map[:A]), list(gpu_map[A:])
        same_gpu_edge = bool(set(attn) & set(ffn))
        arrangement = "shared-gpu" if same_gpu_edge else ("own-gpu" if len(set(gpu_map)) == A + F else "split-roles")
    elif share or n == 1:
        attn, ffn, arrangement = [0] * A, [0] * F, "shared-gpu"
    elif A + F <= n:
        attn, ffn, arrangement = list(range(A)), list(range(A, A + F)), "own-gpu"
    else:
        n_ffn_gpus = min(F, n - 1)
        ffn = [n - n_ffn_gpus + (i % n_ffn_gpus) for i in range(F)]
        attn = [i % (n - n_ffn_gpus) for i in range(A)]
        arrangement = "split-roles"
    world = ffn + attn  # AFD world order: FFN ranks first
    hostids = tuple(f"{NCCL_HOSTID_PREFIX}{r}" for r in range(A + F)) if arrangement == "shared-gpu" else ()
    return GpuPlacement(A, F, tuple(labels[g] for g in world), arrangement, hostids)


@contextlib.contextmanager
def patched_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block; restore exactly those keys afterwards.

    Unlike ``mock.patch.dict(os.environ, ...)``, which clears the whole environment and writes it
    back on exit, no other variable is touched, so another thread's ``getenv`` never sees it empty.
    """
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _entry(fn, rank, nprocs, args, q):
    # Ctrl-C reaches every process of the terminal; the parent stops the workers itself
    # (run_workers' finally), so a worker's own KeyboardInterrupt would only add a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = fn(rank, nprocs, *args)
        q.put((rank, True, result))
    except BaseException as e:  # noqa: BLE001 - forwarded to the parent verbatim
        q.put((rank, False, (traceback.format_exc(), isinstance(e, FOLLOW_ON_ERRORS))))
        _flush(q)
        raise SystemExit(1)
    _flush(q)


def _flush(q) -> None:
    # Queue.put hands the item to a feeder thread: wait until it is written, so a
    # crash later in interpreter teardown cannot swallow an already-made report.
    q.close()
    q.join_thread()


#: A failing rank closes its connector before its own report reaches the queue, so its peers' follow-on
#: errors (:data:`afd_ext.errors.FOLLOW_ON_ERRORS`) can arrive first, or it dies without a report: run_workers
#: then waits up to ROOT_CAUSE_WAIT_S for the report or the exit of the rank that caused them.
ROOT_CAUSE_WAIT_S = 5.0


def _died(rank: int, exitcode: int) -> AFDPeerError:
    """The error for a worker that ended without a report: killed by a signal (named) or exited."""
    sig = next((s.name for s in signal.Signals if s == -exitcode), f"signal {-exitcode}")
    how = f"was killed by {sig}" if exitcode < 0 else f"exited with code {exitcode}"
    err = AFDPeerError(f"worker rank {rank} {how} without reporting", op="run_workers", peer=f"worker rank {rank}")
    err.rank = rank  # type: ignore[attr-defined]
    return err


def _root_cause(first: WorkerError, q: Any, procs: Sequence[Any], results: dict[int, Any]) -> BaseException:
    """``first``, or what caused it: another worker's error that is not a follow-on, or a worker that died
    without a report, seen within ROOT_CAUSE_WAIT_S."""
    if not first.follow_on:
        return first
    end = time.monotonic() + ROOT_CAUSE_WAIT_S
    pending = {r for r in range(len(procs)) if r not in results and r != first.rank}
    while pending and (left := end - time.monotonic()) > 0:
        dead = [r for r in sorted(pending) if not procs[r].is_alive()]  # before the read: their reports are in
        try:
            rank, ok, payload = q.get(timeout=min(left, 0.1))
        except queue_mod.Empty:
            for r in dead:
                if procs[r].exitcode != 0:
                    return _died(r, procs[r].exitcode)
            pending -= set(dead)
            continue
        pending.discard(rank)
        if not ok and not (err := WorkerError(rank, *payload)).follow_on:
            return err
    return first


def run_workers(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
                env: Mapping[str, str] | None = None,
                per_rank_env: Sequence[Mapping[str, str]] | None = None) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` spawned processes.

    Args:
        fn: a picklable (module-level) function. Its return value must be picklable.
        nprocs: number of processes, >= 1.
        args: extra positional arguments, picklable.
        timeout_s: deadline for all workers together, in seconds.
        env: environment variables set in every worker before ``fn`` runs.
        per_rank_env: optional list (length ``nprocs``) of extra variables per rank,
            e.g. :meth:`GpuPlacement.env` (``CUDA_VISIBLE_DEVICES``, ``NCCL_HOSTID``).
            Both ``env`` and ``per_rank_env`` are in the worker's environment from
            its interpreter's start, before it imports anything, so CUDA and NCCL
            read them whatever the worker's modules do at import.

    Returns:
        The workers' return values, indexed by rank.

    Raises:
        WorkerError: the first worker that raised (others are killed); when that error only reports
            another rank's failure (:data:`afd_ext.errors.FOLLOW_ON_ERRORS`), the cause seen within
            :data:`ROOT_CAUSE_WAIT_S` instead (another worker's error, or the AFDPeerError below).
        TimeoutError: the deadline passed; the message names the ranks still running (also in
            its ``ranks`` attribute).
        afd_ext.errors.AFDPeerError: a worker died without reporting (a signal, ``os._exit``, a segfault),
            named by rank (its ``rank`` attribute) and by the signal that killed it or its exit code.
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
            wenv = {**(env or {}), **(per_rank_env[rank] if per_rank_env is not None else {})}
            p = ctx.Process(target=_entry, args=(fn, rank, nprocs, tuple(args), q), daemon=True)
            with patched_env(wenv):  # spawn copies os.environ into the child at start()
                p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        while len(results) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                alive = [r for r in range(nprocs) if r not in results]
                err = TimeoutError(f"workers {alive} of {nprocs} still running after {timeout_s:.0f} s")
                err.ranks = alive  # the callers that know the roles name them (afd_ext.tools.demo)
                raise err
            dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive() and p.exitcode != 0]
            try:  # a worker dead before this read has its report (if any) in the queue already
                rank, ok, payload = q.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                if dead:
                    raise _died(dead[0], procs[dead[0]].exitcode) from None
                continue
            if not ok:
                raise _root_cause(WorkerError(rank, *payload), q, procs, results)
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


def distinct_gpus_missing(n: int, why: str) -> str | None:
    """Why a test needing ``n`` distinct GPUs cannot run here (None: it can)."""
    have = visible_gpu_count()
    if envs.get(SHARE_GPU_ENV):
        return f"needs {n} distinct GPUs ({why}); AFD_TEST_SHARE_GPU=1 puts every process on GPU 0"
    if have < n:
        return f"needs {n} distinct GPUs ({why}); {have} visible, so its processes would share GPU 0"
    return None
