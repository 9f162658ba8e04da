"""The control plane per step: the reference's pattern against this package's channels.

Reference pattern (rebuilt, reference §2.10): the control-sending attention
rank encodes the payload, copies it to the GPU, and sends two blocking
``torch.distributed`` messages over an NCCL group (an int64 size tensor, then
the uint8 payload); the FFN rank receives the size, reads it with ``.item()``
(a device sync), allocates, receives the payload, copies it to the host and
decodes it. On the CPU/gloo path the same two messages go over gloo with CPU
tensors (the reference's CAMP2P flavour).

This package: :func:`measure_control_plane` (host-only channels, binary
payload, no device sync), run in its own two processes;
:func:`control_table` measures it at real step gaps (1, 5, 20, 50 ms) on the
shm and tcp channels beside the reference pattern over gloo at the same gaps
(``afd-ext bench --control-only``).

Both are timed end to end the same way: attention call start (before
encoding) to FFN receive return (after decoding), ``time.perf_counter_ns``
(CLOCK_MONOTONIC, shared by processes on one host), with the same payload
(8 attention ranks' counts, 2 stages).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

logger = logging.getLogger("afd_ext.bench")

__all__ = ["control_payload", "reference_control_plane", "ours_control_plane", "summarize_latencies",
           "measure_control_plane", "control_table", "format_control_table", "DEFAULT_GAPS_MS"]

#: Gaps between steps of the control-plane table, in ms (decode steps are 10-50 ms apart).
DEFAULT_GAPS_MS = (1.0, 5.0, 20.0, 50.0)

#: Payload shape used by both measurements (matches measure_control_plane's default).
PAYLOAD_ATTENTION_RANKS = 8
PAYLOAD_STAGES = 2
WARMUP = 20


def control_payload(num_attention_ranks: int = PAYLOAD_ATTENTION_RANKS, stages: int = PAYLOAD_STAGES) -> Any:
    """The DP-metadata payload both measurements send (same counts as ``measure_control_plane``)."""
    import torch

    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata

    return AFDControlPayload(dp_metadata_list={
        s: AFDDPMetadata(torch.tensor([(7 * i + 3) % 64 for i in range(num_attention_ranks)], dtype=torch.int32))
        for s in range(stages)
    })


def reference_control_plane(env: Any, iterations: int) -> dict:
    """Run the reference control-plane pattern in the benchmark's worker processes.

    Every rank calls it. Per step: a gloo barrier (untimed; the FFN rank is
    then waiting), the control-sending attention ranks send to their FFN
    ranks (topology routing), each FFN rank receives from its source.

    Args:
        env: the worker's environment (``afd_ext.bench.runner._Env``).
        iterations: measured steps (after 20 warm-up steps that also create
            the NCCL pair communicators).

    Returns:
        ``{"role", "role_rank", "send_ns": [...]}`` for an attention rank
        (per step, its call-start times) or ``{"role", "role_rank", "src",
        "recv_ns": [...]}`` for an FFN rank; the parent pairs them with
        :func:`summarize_latencies`.
    """
    import torch
    import torch.distributed as dist

    from afd_ext.metadata import decode_control_payload, encode_control_payload

    topo = env.topo
    cuda = env.cuda
    device = env.device
    group = env.nccl_group if cuda else None
    payload = control_payload()
    total = WARMUP + iterations
    if env.role == "attention":
        dests = [topo.world_rank("ffn", f) for f in topo.control_destinations(env.role_rank)]
        stamps = []
        for _ in range(total):
            env.barrier()
            t0 = time.perf_counter_ns()
            if dests:
                data = encode_control_payload(payload)
                obj = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
                size = torch.tensor([obj.numel()], dtype=torch.long, device=device)
                for d in dests:
                    dist.send(size, dst=d, group=group)
                    dist.send(obj, dst=d, group=group)
            stamps.append(t0)
        env.drain("reference control plane")
        return {"role": "attention", "role_rank": env.role_rank, "send_ns": stamps[WARMUP:]}
    src_a = topo.control_source(env.role_rank)
    src = topo.world_rank("attention", src_a)
    stamps = []
    for _ in range(total):
        env.barrier()
        size = torch.empty(1, dtype=torch.long, device=device)
        dist.recv(size, src=src, group=group)
        n = int(size.item())  # the reference's device sync
        obj = torch.empty(n, dtype=torch.uint8, device=device)
        dist.recv(obj, src=src, group=group)
        decode_control_payload(obj.cpu().numpy().tobytes())
        stamps.append(time.perf_counter_ns())
    return {"role": "ffn", "role_rank": env.role_rank, "src": src_a, "recv_ns": stamps[WARMUP:]}


def summarize_latencies(results: list[dict]) -> dict | None:
    """Pair the workers' reference control-plane stamps into latency statistics (µs).

    Returns:
        ``{"median", "p10", "p90", "mean", "min", "n"}`` over all FFN ranks'
        steps, or None when nothing was measured.
    """
    from afd_ext.bench.timing import summarize

    sends = {r["role_rank"]: r["send_ns"] for r in results if r and r.get("role") == "attention"}
    lat: list[float] = []
    for r in results:
        if not r or r.get("role") != "ffn":
            continue
        s = sends.get(r["src"])
        if not s:
            continue
        lat += [(b - a) / 1000.0 for a, b in zip(s, r["recv_ns"])]
    if not lat:
        return None
    return summarize(lat).to_dict()


def ours_control_plane(iterations: int, kind: str = "auto", timeout_s: float = 120.0) -> dict:
    """This package's control plane, via ``afd_ext.control_plane.measure_control_plane``.

    Returns:
        ``{"median", "p10", "p90", "mean", "min", "n", "kind", "payload_bytes", "p99"}``
        in µs, or ``{"error": "..."}`` when the measurement could not run.
    """
    try:
        r = measure_control_plane(kind, iterations, num_attention_ranks=PAYLOAD_ATTENTION_RANKS,
                                  stages=PAYLOAD_STAGES, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        logger.warning("this package's control-plane measurement failed: %s: %s", type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "median": r.get("p50_us"), "p10": None, "p90": r.get("p90_us"), "p99": r.get("p99_us"),
        "mean": r.get("mean_us"), "min": r.get("min_us"), "n": r.get("n"),
        "kind": r.get("kind"), "payload_bytes": r.get("payload_bytes"),
    }


# ---------------------------------------------------------------------------
# This package's control plane, and the reference pattern over gloo, at a step gap
# ---------------------------------------------------------------------------


def _pause(gap_s: float, spin: bool) -> None:
    """Wait ``gap_s`` between measured sends: spin like a busy attention rank, or sleep."""
    if not spin:
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def _step_payload(i: int, counts: list[int], stages: int) -> Any:
    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata

    return AFDControlPayload(dp_metadata_list={s: AFDDPMetadata([i + s] + counts[1:]) for s in range(stages)})


def _measure_worker(rank: int, nprocs: int, host: str, port: int, kind: str, iterations: int,
                    warmup: int, gap_s: float, num_attention_ranks: int, stages: int, raw: bool,
                    idle_s: float | None, distinct: bool, sender_spins: bool, reference: bool) -> dict:
    from afd_ext import control_plane as cpl
    from afd_ext import rendezvous as rdzv
    from afd_ext.metadata import encode_control_binary
    from afd_ext.topology import Topology

    topo = Topology(1, 1)
    role = "ffn" if rank == 0 else "attention"
    counts = [(7 * i + 3) % 64 for i in range(num_attention_ranks)]
    total = warmup + iterations
    stamps: list[int] = []
    if reference:
        return _reference_pair(rank, host, port, total, warmup, gap_s, counts, stages, distinct, sender_spins)
    store = rdzv.connect(host, port, rank, 2, 60.0, num_ffn_ranks=1)
    opts = cpl.ChannelOptions.from_env(idle_s=idle_s)
    plane = cpl.AFDControlPlane(lambda p: None, topo, role, 0)
    plane.open(store, kind, 60.0, options=opts)
    ch = next(iter(plane.channels.values()))
    rdzv.barrier(store, rank, 2, "measure-start", 60.0)
    try:
        if role == "attention":
            payload = _step_payload(0, counts, stages)
            data = encode_control_binary(payload)
            for i in range(total):
                if distinct:  # a new payload per step, built before the timed call, as a runner does
                    payload = _step_payload(i, counts, stages)
                    if raw:
                        data = encode_control_binary(payload)
                t0 = time.perf_counter_ns()
                if raw:
                    ch.send(data)
                else:
                    plane.send_dp_metadata_list(payload)
                stamps.append(t0)
                _pause(gap_s, sender_spins)
        else:
            for i in range(total):
                if raw:
                    ch.recv(60.0)
                else:
                    p = plane.recv_dp_metadata_list()
                stamps.append(time.perf_counter_ns())
                if distinct and not raw and p.dp_metadata_list[0].counts[0] != i:
                    raise RuntimeError(f"measurement: step {i} received the counts of step "
                                       f"{p.dp_metadata_list[0].counts[0]}")
        rdzv.barrier(store, rank, 2, "measure-end", 60.0)
    finally:
        plane.close()
    return {"kind": ch.kind, "stamps": stamps[warmup:]}


def _reference_pair(rank: int, host: str, port: int, total: int, warmup: int, gap_s: float,
                    counts: list[int], stages: int, distinct: bool, sender_spins: bool) -> dict:
    """The reference's two messages per step (int64 size, uint8 JSON) over gloo, CPU tensors."""
    import datetime

    import torch
    import torch.distributed as dist

    from afd_ext.metadata import decode_control_payload, encode_control_payload

    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    stamps: list[int] = []
    try:
        dist.barrier()
        payload = _step_payload(0, counts, stages)
        for i in range(total):
            if rank == 1:
                if distinct:
                    payload = _step_payload(i, counts, stages)
                t0 = time.perf_counter_ns()
                data = encode_control_payload(payload)
                obj = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                dist.send(torch.tensor([obj.numel()], dtype=torch.long), dst=0)
                dist.send(obj, dst=0)
                stamps.append(t0)
                _pause(gap_s, sender_spins)
            else:
                size = torch.empty(1, dtype=torch.long)
                dist.recv(size, src=1)
                obj = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(obj, src=1)
                decode_control_payload(obj.numpy().tobytes())
                stamps.append(time.perf_counter_ns())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"kind": "gloo", "stamps": stamps[warmup:]}


def _default_sender_wait() -> str:
    # On 2 cores a spinning sender starves the receiver it is measuring.
    return "spin" if (os.cpu_count() or 1) >= 4 else "sleep"


def measure_control_plane(
    kind: str = "auto",
    iterations: int = 2000,
    *,
    warmup: int = 200,
    gap_us: float = 200.0,
    num_attention_ranks: int = PAYLOAD_ATTENTION_RANKS,
    stages: int = PAYLOAD_STAGES,
    raw: bool = False,
    idle_s: float | None = None,
    timeout_s: float = 120.0,
    distinct: bool = False,
    sender_wait: str = "auto",
    reference: bool = False,
) -> dict[str, Any]:
    """Measure the control plane end to end in two processes on this host.

    An attention process calls ``send_dp_metadata_list`` every ``gap_us``; an
    FFN process loops on ``recv_dp_metadata_list``. Latency of message ``i`` is
    the FFN return time minus the attention call start, both
    ``time.perf_counter_ns`` (CLOCK_MONOTONIC, shared by processes on one host).

    Args:
        kind: ``"shm"``, ``"tcp"`` or ``"auto"`` (ignored with ``reference``).
        iterations: measured messages (after ``warmup``).
        warmup: discarded first messages.
        gap_us: pause between sends in µs (keep it above the latency so nothing queues).
        num_attention_ranks: length of the count vector in the payload (payload size).
        stages: stages in the payload.
        raw: measure the channel alone (pre-encoded bytes, no decode).
        idle_s: the receiver's idle threshold (None: ``AFD_CONTROL_IDLE_S`` / default).
        timeout_s: deadline for the whole measurement.
        distinct: send a new payload (new counts) every step, built before the timed call.
        sender_wait: ``"spin"`` (a busy attention rank), ``"sleep"``, or ``"auto"``
            (spin with at least 4 CPUs).
        reference: measure the reference's pattern instead (two gloo messages per
            step, JSON payload, the receiver reads the size with ``.item()``).

    Returns:
        ``{"kind", "n", "p50_us", "p90_us", "p99_us", "mean_us", "min_us", "max_us",
        "payload_bytes", "sender_wait", "raw", "distinct", "gap_us"}``.

    Raises:
        AFDConfigError: ``iterations < 1`` or an unknown ``sender_wait``.
    """
    from afd_ext.errors import AFDConfigError
    from afd_ext.metadata import encode_control_binary, encode_control_payload
    from afd_ext.testing import find_free_port, run_workers

    if iterations < 1:
        raise AFDConfigError(f"iterations must be >= 1, got {iterations}")
    if sender_wait not in ("auto", "spin", "sleep"):
        raise AFDConfigError(f"sender_wait must be 'auto', 'spin' or 'sleep', got {sender_wait!r}")
    if sender_wait == "auto":
        sender_wait = _default_sender_wait()
    host = "127.0.0.1"
    port = find_free_port(host)
    res = run_workers(_measure_worker, 2, (host, port, kind, iterations, warmup, gap_us * 1e-6,
                                           num_attention_ranks, stages, raw, idle_s, distinct,
                                           sender_wait == "spin", reference),
                      timeout_s=timeout_s)
    recv_ns, send_ns = res[0]["stamps"], res[1]["stamps"]
    lat = sorted((r - s) / 1000.0 for r, s in zip(recv_ns, send_ns))

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, max(0, math.ceil(p / 100.0 * len(lat)) - 1))]

    encode = encode_control_payload if reference else encode_control_binary
    size = len(encode(control_payload(num_attention_ranks, stages)))
    return {
        "kind": res[0]["kind"], "raw": raw, "distinct": distinct, "n": len(lat), "gap_us": gap_us,
        "p50_us": pct(50), "p90_us": pct(90), "p99_us": pct(99),
        "mean_us": sum(lat) / len(lat), "min_us": lat[0], "max_us": lat[-1],
        "payload_bytes": size, "sender_wait": sender_wait,
    }


def _iterations_for(gap_ms: float, seconds: float) -> int:
    return int(min(2000, max(200, seconds * 1000.0 / gap_ms)))


def control_table(
    gaps_ms: tuple[float, ...] = DEFAULT_GAPS_MS,
    kinds: tuple[str, ...] = ("shm", "tcp"),
    *,
    seconds_per_cell: float = 12.0,
    reference: bool = True,
    idle_s: float | None = None,
    sender_wait: str = "auto",
    progress: Any = None,
) -> list[dict]:
    """The control-plane table: end to end, new counts every step, per (gap, channel), plus the reference.

    Each cell runs ``seconds_per_cell`` of steps (200-2000 steps); the
    reference pattern (gloo) gets a third of that. With the defaults the table
    takes about 2.5 minutes.

    Returns:
        One row per gap: ``{"gap_ms", "<kind>": result, ..., "reference": result | None}``,
        results as :func:`measure_control_plane` returns them (or ``{"error": ...}``).
    """
    rows = []
    for gap in gaps_ms:
        row: dict[str, Any] = {"gap_ms": gap}
        cells = [(k, False) for k in kinds] + ([("reference", True)] if reference else [])
        for name, ref in cells:
            it = _iterations_for(gap, seconds_per_cell / (3 if ref else 1))
            try:
                row[name] = measure_control_plane(
                    "auto" if ref else name, it, warmup=min(100, it // 5), gap_us=gap * 1000.0,
                    distinct=True, idle_s=idle_s, sender_wait=sender_wait, reference=ref,
                    timeout_s=60.0 + 3 * it * gap / 1000.0)
            except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
                logger.warning("control-plane measurement %s at %g ms failed: %s", name, gap, e)
                row[name] = {"error": f"{type(e).__name__}: {e}"}
            if progress is not None:
                progress(name, gap, row[name])
        rows.append(row)
    return rows


def format_control_table(rows: list[dict], kinds: tuple[str, ...] = ("shm", "tcp")) -> str:
    """Markdown: one line per gap, p50 / p99 in µs per channel and for the reference pattern."""
    cols = list(kinds) + (["reference"] if any("reference" in r for r in rows) else [])
    names = {"reference": "reference pattern (gloo), p50 / p99"}
    head = "| gap between steps | " + " | ".join(names.get(c, f"{c}, p50 / p99") for c in cols) + " |"
    out = [head, "|" + " --- |" * (len(cols) + 1)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if not v:
                cells.append("-")
            elif "error" in v:
                cells.append("failed")
            else:
                cells.append(f"{v['p50_us']:.1f} / {v['p99_us']:.1f} µs (n={v['n']})")
        out.append(f"| {r['gap_ms']:g} ms | " + " | ".join(cells) + " |")
    return "\n".join(out)


def control_main(gaps_ms: tuple[float, ...] = DEFAULT_GAPS_MS, kinds: tuple[str, ...] = ("shm", "tcp"),
                 *, seconds_per_cell: float = 12.0, reference: bool = True, out: str | None = None,
                 sender_wait: str = "auto") -> int:
    """``afd-ext bench --control-only``: measure and print the control-plane table (and save JSON)."""
    sw = _default_sender_wait() if sender_wait == "auto" else sender_wait
    print(f"control plane, end to end (attention send_dp_metadata_list call -> FFN recv_dp_metadata_list "
          f"return), new counts every step, payload {PAYLOAD_ATTENTION_RANKS} attention ranks x "
          f"{PAYLOAD_STAGES} stages; {os.cpu_count()} CPUs, attention end {sw}s between steps", flush=True)

    def progress(name: str, gap: float, r: dict) -> None:
        if "error" in r:
            print(f"  {name:9s} gap {gap:g} ms: FAILED {r['error']}", flush=True)
        else:
            print(f"  {name:9s} gap {gap:g} ms: p50 {r['p50_us']:.1f} µs, p99 {r['p99_us']:.1f} µs "
                  f"(n={r['n']}, {r['payload_bytes']} B)", flush=True)

    rows = control_table(gaps_ms, kinds, seconds_per_cell=seconds_per_cell, reference=reference,
                         sender_wait=sender_wait, progress=progress)
    print(format_control_table(rows, kinds), flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "control_plane.json")
        with open(path, "w") as f:
            json.dump({"rows": rows, "cpus": os.cpu_count(), "sender_wait": sw}, f, indent=1)
        print(f"wrote {path}", flush=True)
    failed = any("error" in (r.get(k) or {}) for r in rows for k in kinds)
    return 1 if failed else 0
