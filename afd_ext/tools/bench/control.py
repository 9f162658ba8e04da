"""The control plane per step: the reference's pattern against this package's channels.

Reference pattern (rebuilt, reference §2.10): the control-sending attention
rank encodes the payload and sends two blocking ``torch.distributed``
messages (an int64 size tensor, then the uint8 payload); the FFN rank receives
the size, reads it, allocates, receives the payload and decodes it; here over
gloo with CPU tensors (the reference's CAMP2P flavour; its NCCL flavour adds a
device copy and an ``.item()`` sync on each end).

This package: :func:`measure_control_plane` (host-only channels, binary
payload, no device sync), run in its own two processes;
:func:`control_table` measures it at real step gaps (1, 5, 20, 50 ms) on the
shm and tcp channels beside the reference pattern over gloo at the same gaps,
in one run (``afd-ext bench --control-only``).

Both are timed end to end the same way: attention call start (before
encoding) to FFN receive return (after decoding), ``time.perf_counter_ns``
(CLOCK_MONOTONIC, shared by processes on one host), with the same payload
(8 attention ranks' counts, 2 stages, new counts every step).
"""


from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from afd_ext import control as cpl
from afd_ext import rendezvous as rdzv
from afd_ext.control.codec import decode_control_payload, encode_control_binary, encode_control_payload
from afd_ext.errors import AFDConfigError, AFDProtocolError
from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
from afd_ext.tools.bench.report import md_table
from afd_ext.tools.testing import find_free_port, run_workers
from afd_ext.topology import Topology

logger = logging.getLogger("afd_ext.tools.bench")

#: Gaps between steps of the control-plane table, in ms (decode steps are 10-50 ms apart).
DEFAULT_GAPS_MS = (1.0, 5.0, 20.0, 50.0)

#: The channel kinds of the table (the reference pattern is always beside them).
CONTROL_KINDS = ("shm", "tcp")

#: Payload shape used by both measurements (matches measure_control_plane's default).
PAYLOAD_ATTENTION_RANKS = 8
PAYLOAD_STAGES = 2


def _step_payload(i: int, counts: list[int], stages: int) -> Any:
    return AFDControlPayload({s: AFDDPMetadata([i] + counts[1:]) for s in range(stages)})


def pick_control_cpus() -> tuple[int, int] | None:
    """CPUs for the FFN receiver and the attention sender: two physical cores other than CPU 0's
    (device interrupts land there), so that two spinning processes do not share a core; None with
    fewer than 4 allowed CPUs or without two such cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 4:
        return None
    cores: dict[frozenset[int], int] = {}  # a physical core's hyperthreads -> its first allowed CPU
    try:
        for c in allowed:
            cores.setdefault(_siblings(c), c)
    except OSError:
        return None
    picked = [c for siblings, c in cores.items() if 0 not in siblings]
    return (picked[0], picked[1]) if len(picked) >= 2 else None


def _siblings(cpu: int) -> frozenset[int]:
    with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
        out: set[int] = set()
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return frozenset(out)


def _pause(gap_s: float, spin: bool) -> None:
    """Wait ``gap_s`` between sends: spin like a busy attention rank, or sleep (few cores)."""
    if not spin:
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


class _PlanePair:
    """This package's control plane between the two processes (``kind``: shm, tcp or auto)."""

    def __init__(self, rank: int, host: str, port: int, kind: str):
        self.rank = rank
        self.store = rdzv.connect(host, port, rank, 2, 60.0, num_ffn_ranks=1)
        self.plane = cpl.AFDControlPlane(lambda p: None, Topology(1, 1), "ffn" if rank == 0 else "attention", 0)
        self.plane.open(self.store, kind, 60.0)
        self.kind = next(iter(self.plane.channels.values())).kind
        self.send, self.recv, self.close = (self.plane.send_dp_metadata_list, self.plane.recv_dp_metadata_list,
                                            self.plane.close)

    def barrier(self, name: str) -> None:
        rdzv.barrier(self.store, self.rank, 2, name, 60.0)


class _ReferencePair:
    """The reference's two messages per step (int64 size, uint8 JSON) over gloo, CPU tensors."""

    kind = "gloo"

    def __init__(self, rank: int, host: str, port: int, kind: str):
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        self.close = dist.destroy_process_group

    def barrier(self, name: str) -> None:
        dist.barrier()

    def send(self, payload: Any) -> None:
        obj = torch.frombuffer(bytearray(encode_control_payload(payload)), dtype=torch.uint8)
        dist.send(torch.tensor([obj.numel()], dtype=torch.long), dst=0)
        dist.send(obj, dst=0)

    def recv(self) -> Any:
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, src=1)
        obj = torch.empty(int(size.item()), dtype=torch.uint8)  # the reference's sync point
        dist.recv(obj, src=1)
        return decode_control_payload(obj.numpy().tobytes())


def _measure_worker(rank: int, nprocs: int, host: str, port: int, kind: str, schedule: list, stages: int,
                    spin: bool, cpus: tuple[int, int] | None) -> list:
    """One end: rank 0 the FFN receiver, rank 1 the attention sender. Per ``(gap_s, iterations,
    warmup)`` of ``schedule``: the sender's call-start stamps or the receiver's return stamps (ns)."""
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[rank]})
    counts = [(7 * i + 3) % 64 for i in range(PAYLOAD_ATTENTION_RANKS)]
    clock = time.perf_counter_ns
    pair = (_ReferencePair if kind == "reference" else _PlanePair)(rank, host, port, kind)
    out, step = [], 0
    try:
        for n, (gap_s, iterations, warmup) in enumerate(schedule):
            pair.barrier(f"measure-start-{n}")
            stamps = []
            for i in range(step, step + warmup + iterations):
                if rank == 1:
                    payload = _step_payload(i, counts, stages)  # new counts, built before the timed call
                    stamps.append(clock())
                    pair.send(payload)
                    _pause(gap_s, spin)
                else:
                    p = pair.recv()
                    stamps.append(clock())
                    if p.dp_metadata_list[0].counts[0] != i:
                        raise AFDProtocolError(f"measurement: step {i} received the counts of step "
                                               f"{p.dp_metadata_list[0].counts[0]}")
            step += warmup + iterations
            out.append({"kind": pair.kind, "stamps": stamps[warmup:]})
        pair.barrier("measure-end")
    finally:
        pair.close()
    return out


def _measure(kind: str, schedule: list[tuple[float, int, int]], stages: int, timeout_s: float | None
             ) -> list[dict[str, Any]]:
    """Run ``schedule`` (``(gap_us, iterations, warmup)`` entries) in one pair of processes;
    one result per entry (see :func:`measure_control_plane`)."""
    if not schedule or any(int(it) < 1 for _, it, _ in schedule):
        raise AFDConfigError(f"every schedule entry needs iterations >= 1, got {schedule!r}")
    # gloo's I/O threads would share the one pinned CPU: the reference runs where the scheduler puts it.
    cpus = pick_control_cpus() if kind != "reference" else None
    spin = (os.cpu_count() or 1) >= 4  # on 2 cores a spinning sender starves the receiver it measures
    sched = [(g * 1e-6, int(it), int(w)) for g, it, w in schedule]
    if timeout_s is None:
        timeout_s = 60.0 + 3 * sum((it + w) * g for g, it, w in sched)
    host = "127.0.0.1"
    res = run_workers(_measure_worker, 2, (host, find_free_port(host), kind, sched, stages, spin, cpus),
                      timeout_s=timeout_s)
    encode = encode_control_payload if kind == "reference" else encode_control_binary
    size = len(encode(_step_payload(0, [0] * PAYLOAD_ATTENTION_RANKS, stages)))
    out = []
    for (gap_us, _, _), ffn, attn in zip(schedule, res[0], res[1]):
        lat = [(b - a) / 1000.0 for a, b in zip(attn["stamps"], ffn["stamps"])]
        p50, p90, p99 = (float(x) for x in np.percentile(lat, (50, 90, 99), method="inverted_cdf"))  # nearest rank
        out.append({"kind": ffn["kind"], "n": len(lat), "p50_us": p50, "p90_us": p90, "p99_us": p99,
                    "mean_us": sum(lat) / len(lat), "min_us": min(lat), "max_us": max(lat), "payload_bytes": size,
                    "gap_us": gap_us, "sender_wait": "spin" if spin else "sleep", "cpus": list(cpus) if cpus else None})
    return out


def measure_control_plane(kind: str = "auto", iterations: int = 2000, *, warmup: int = 200, gap_us: float = 200.0,
                          stages: int = PAYLOAD_STAGES, timeout_s: float | None = 120.0) -> dict[str, Any]:
    """Measure the control plane end to end in two processes on this host.

    An attention process calls ``send_dp_metadata_list`` every ``gap_us`` (new counts every
    step); an FFN process loops on ``recv_dp_metadata_list`` and checks each step's counts.
    Latency of step ``i``: FFN return minus attention call start (``time.perf_counter_ns``).
    The two processes are pinned to CPUs of two physical cores where the host has them
    (:func:`pick_control_cpus`; not the reference, whose gloo threads would share the CPU).

    Args:
        kind: ``"shm"``, ``"tcp"``, ``"auto"``, or ``"reference"`` (the reference's two gloo
            messages per step, JSON payload, the size read with ``.item()``).
        iterations: measured steps (after ``warmup``); gap_us: pause between sends, µs.
        stages: stages in the payload (8 attention ranks' counts each).
        timeout_s: deadline for the whole measurement (None: from the steps' gaps).

    Returns:
        ``{"kind", "n", "p50_us", "p90_us", "p99_us", "mean_us", "min_us", "max_us",
        "payload_bytes", "gap_us", "sender_wait", "cpus"}``.

    Raises:
        AFDConfigError: ``iterations < 1``.
    """
    return _measure(kind, [(gap_us, iterations, warmup)], stages, timeout_s)[0]
def control_table(gaps_ms: tuple[float, ...] = DEFAULT_GAPS_MS, kinds: tuple[str, ...] = CONTROL_KINDS, *,
                  seconds_per_cell: float = 5.0) -> list[dict]:
    """The control-plane table: per gap, each channel's and the reference pattern's result.

    Each column runs in one pair of processes over every gap, ``seconds_per_cell`` of steps per
    cell (200-2000 steps; the reference a third); a line per cell is printed as it is measured.

    Returns:
        One row per gap: ``{"gap_ms", "<kind>": result, "reference": result}``, results as
        :func:`measure_control_plane` returns them, or ``{"error": ...}``.
    """
    rows: list[dict[str, Any]] = [{"gap_ms": g} for g in gaps_ms]
    for name in [*kinds, "reference"]:
        share = 3 if name == "reference" else 1
        sched = []
        for g in gaps_ms:
            it = max(100, min(2000, int(seconds_per_cell / share / (g * 1e-3))))
            sched.append((g * 1000.0, it, max(5, min(50, it // 10))))
        try:
            results = _measure(name, sched, PAYLOAD_STAGES, None)
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            logger.warning("control-plane measurement %s failed: %s", name, e)
            results = [{"error": f"{type(e).__name__}: {e}"}] * len(gaps_ms)
        for row, r in zip(rows, results):
            row[name] = r
            print(f"  {name:9s} gap {row['gap_ms']:g} ms: " + (f"FAILED {r['error']}" if "error" in r else
                  f"p50 {r['p50_us']:.1f} µs, p99 {r['p99_us']:.1f} µs (n={r['n']}, {r['payload_bytes']} B)"),
                  flush=True)
    return rows


def format_control_table(rows: list[dict], kinds: tuple[str, ...] = CONTROL_KINDS) -> str:
    """Markdown: one line per gap, p50 / p99 in µs per channel and for the reference pattern."""
    def cell(r: dict | None) -> str:
        if not r:
            return "-"
        return "failed" if "error" in r else f"{r['p50_us']:.1f} / {r['p99_us']:.1f} µs (n={r['n']})"

    head = ["gap between steps", *(f"{c}, p50 / p99" for c in kinds), "reference pattern (gloo), p50 / p99"]
    return "\n".join(md_table(head, [[f"{r['gap_ms']:g} ms", *(cell(r.get(c)) for c in (*kinds, "reference"))]
                                     for r in rows]))


def control_main(gaps_ms: tuple[float, ...] = DEFAULT_GAPS_MS, out: str | None = None) -> int:
    """``afd-ext bench --control-only``: measure and print the control-plane table (and save JSON).

    Returns 0, or 1 when a channel's measurement failed.
    """
    cpus = pick_control_cpus()
    print(f"control plane, end to end (attention send_dp_metadata_list call -> FFN recv_dp_metadata_list "
          f"return), new counts every step, payload {PAYLOAD_ATTENTION_RANKS} attention ranks x {PAYLOAD_STAGES} "
          f"stages; {os.cpu_count()} CPUs, " + (f"FFN on CPU {cpus[0]}, attention on CPU {cpus[1]}" if cpus
                                               else "not pinned"), flush=True)
    t = time.monotonic()
    rows = control_table(gaps_ms)
    print(format_control_table(rows), flush=True)
    print(f"control plane measured in {time.monotonic() - t:.0f} s", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "control_plane.json")
        with open(path, "w") as f:
            json.dump({"rows": rows, "cpus": list(cpus) if cpus else None}, f, indent=1)
        print(f"wrote {path}", flush=True)
    return 1 if any("error" in (r.get(k) or {}) for r in rows for k in CONTROL_KINDS) else 0
