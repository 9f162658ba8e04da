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
(CLOCK_MONOTONIC, shared by processes on one host; bound to a local, so that
after a long gap the probe's own lookups stay out of the figure as far as
Python allows), with the same payload (8 attention ranks' counts, 2 stages).
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
           "measure_control_plane", "measure_control_gaps", "pick_control_cpus", "control_table",
           "format_control_table", "format_phases", "DEFAULT_GAPS_MS"]

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
# This package's control plane, and the reference pattern over gloo, at step gaps
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


def _cpu_topology() -> dict[int, tuple[int, int]]:
    """Allowed CPU -> (package, core) from sysfs; CPUs whose topology is unreadable are left out."""
    out = {}
    for c in sorted(os.sched_getaffinity(0)):
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as f:
                pkg = int(f.read())
            with open(base + "core_id") as f:
                core = int(f.read())
        except (OSError, ValueError):
            continue
        out[c] = (pkg, core)
    return out


def pick_control_cpus() -> tuple[int, ...] | None:
    """CPUs for the bench's FFN receiver and attention sender, on different physical cores, and
    one more for the attention process's other threads (its keeper, ``ChannelOptions.keep_s``).

    A serving deployment gives each rank its own core(s); two spinning
    processes on hyperthread siblings (or migrated by the scheduler) share one
    core's L1/L2 and execution units and measure that, not the control plane.
    Picks, in one package, the first cores that are not CPU 0's core
    (device interrupts and housekeeping land on CPU 0 by default).

    Returns:
        ``(ffn_cpu, attention_cpu, attention_helper_cpu)``, or the first two
        where there is no third such core (the keeper then does not start), or
        None with fewer than 4 allowed CPUs or without two distinct physical cores.
    """
    if len(os.sched_getaffinity(0)) < 4:
        return None
    topo = _cpu_topology()
    cpu0 = topo.get(0)
    by_pkg: dict[int, list[int]] = {}
    seen: set[tuple[int, int]] = set()
    for c, (pkg, core) in sorted(topo.items()):
        if (pkg, core) in seen or (pkg, core) == cpu0:
            continue
        seen.add((pkg, core))
        by_pkg.setdefault(pkg, []).append(c)
    for cpus in by_pkg.values():
        if len(cpus) >= 2:
            return tuple(cpus[:3])
    return None


def _host_facts() -> dict[str, Any]:
    """What decides the control plane's latency on a host besides the code (printed with the table)."""
    facts: dict[str, Any] = {"cpus": os.cpu_count()}
    for key, path in (("clocksource", "/sys/devices/system/clocksource/clocksource0/current_clocksource"),
                      ("governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
                      ("cpuidle", "/sys/devices/system/cpu/cpuidle/current_driver")):
        try:
            with open(path) as f:
                facts[key] = f.read().strip()
        except OSError:
            facts[key] = None
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(1 << 16)
        model = [ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")]
        flags = [ln for ln in info.splitlines() if ln.startswith("flags")]
        facts["cpu_model"] = model[0] if model else None
        facts["virtualized"] = bool(flags) and " hypervisor" in flags[0]
    except OSError:
        pass
    return facts


def _measure_worker(rank: int, nprocs: int, host: str, port: int, kind: str, schedule: list,
                    num_attention_ranks: int, stages: int, raw: bool, idle_s: float | None,
                    distinct: bool, sender_spins: bool, reference: bool, cpus: tuple[int, ...] | None,
                    warm_s: float | None = None) -> list:
    """One end of the measurement; rank 0 is the FFN receiver, rank 1 the attention sender.

    Runs every ``(gap_s, iterations, warmup)`` of ``schedule`` in turn (a store
    barrier between them) and returns, per entry, the stamps (ns, CLOCK_MONOTONIC):
    attention ``{"t0": call start, "pub": native publish (shm), "ret": call return}``,
    FFN ``{"seen": native poll saw it (shm), "taken": channel returned it, "ret": plane returned}``.
    """
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[rank]})
    from afd_ext import control_plane as cpl
    from afd_ext import rendezvous as rdzv
    from afd_ext.errors import AFDProtocolError
    from afd_ext.metadata import encode_control_binary
    from afd_ext.topology import Topology

    counts = [(7 * i + 3) % 64 for i in range(num_attention_ranks)]
    if reference:
        return _reference_pair(rank, host, port, schedule, counts, stages, distinct, sender_spins)
    topo = Topology(1, 1)
    role = "ffn" if rank == 0 else "attention"
    store = rdzv.connect(host, port, rank, 2, 60.0, num_ffn_ranks=1)
    helper = (cpus[2],) if cpus is not None and rank == 1 and len(cpus) > 2 else None
    opts = cpl.ChannelOptions.from_env(idle_s=idle_s, warm_s=warm_s, keep_cpus=helper)  # the keeper / proxy
    plane = cpl.AFDControlPlane(lambda p: None, topo, role, 0)
    plane.open(store, kind, 60.0, options=opts)
    ch = next(iter(plane.channels.values()))
    state = ch._state if ch.kind == "shm" else None  # the native stamps (RingState)
    if state is not None:
        state.stamps = 1  # also t_mark (native send entered / GIL back after the take), t_built
    clock = time.perf_counter_ns  # a local: the probe itself touches as little as it can after a gap
    out = []
    step = 0
    try:
        for n, (gap_s, iterations, warmup) in enumerate(schedule):
            rdzv.barrier(store, rank, 2, f"measure-start-{n}", 60.0)
            total = warmup + iterations
            a: list[int] = []
            b: list[int] = []
            c: list[int] = []
            m: list[int] = []
            if role == "attention":
                payload = _step_payload(0, counts, stages)
                data = encode_control_binary(payload)
                for i in range(total):
                    if distinct:  # a new payload per step, built before the timed call, as a runner does
                        payload = _step_payload(step + i, counts, stages)
                        if raw:
                            data = encode_control_binary(payload)
                    t0 = clock()
                    if raw:
                        ch.send(data)
                    else:
                        plane.send_dp_metadata_list(payload)
                    t1 = clock()
                    a.append(t0)
                    b.append(state.t_ns if state is not None else 0)
                    m.append(state.t_mark if state is not None else 0)
                    c.append(t1)
                    _pause(gap_s, sender_spins)
                res = {"t0": a[warmup:], "pub": b[warmup:], "ret": c[warmup:], "mark": m[warmup:]}
            else:
                taken: list[int] = []
                wrapped = not raw and state is None
                if wrapped:
                    # tcp: stamp where the channel's checked path hands over (one extra Python
                    # call, ~0.1 us, inside the total); shm stamps natively (RingState.t_built).
                    orig = ch.recv_payload

                    def recv_payload(*args: Any) -> Any:
                        r = orig(*args)
                        taken.append(time.perf_counter_ns())  # not `clock`: that would make it a cell
                        return r

                    ch.recv_payload = recv_payload  # type: ignore[method-assign]
                for i in range(total):
                    if raw:
                        ch.recv(60.0)
                        taken.append(clock())
                    else:
                        p = plane.recv_dp_metadata_list()
                    t = clock()
                    if not raw and state is not None:  # 0: not built natively this step (no stamp)
                        taken.append(state.t_built if state.t_built >= state.t_ns else 0)
                    a.append(state.t_ns if state is not None else 0)
                    m.append(state.t_mark if state is not None else 0)
                    c.append(t)
                    if distinct and not raw and p.dp_metadata_list[0].counts[0] != step + i:
                        raise AFDProtocolError(f"measurement: step {step + i} received the counts of step "
                                           f"{p.dp_metadata_list[0].counts[0]}")
                if wrapped:
                    del ch.recv_payload
                res = {"seen": a[warmup:], "taken": taken[warmup:], "ret": c[warmup:], "mark": m[warmup:]}
            step += total
            out.append(res)
        rdzv.barrier(store, rank, 2, "measure-end", 60.0)
    finally:
        plane.close()
    return [dict(r, kind=ch.kind) for r in out]


def _reference_pair(rank: int, host: str, port: int, schedule: list, counts: list[int], stages: int,
                    distinct: bool, sender_spins: bool) -> list:
    """The reference's two messages per step (int64 size, uint8 JSON) over gloo, CPU tensors."""
    import datetime

    import torch
    import torch.distributed as dist

    from afd_ext.metadata import decode_control_payload, encode_control_payload

    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    clock = time.perf_counter_ns  # the same probe as this package's pair
    out = []
    try:
        payload = _step_payload(0, counts, stages)
        for gap_s, iterations, warmup in schedule:
            dist.barrier()
            stamps: list[int] = []
            for i in range(warmup + iterations):
                if rank == 1:
                    if distinct:
                        payload = _step_payload(i, counts, stages)
                    t0 = clock()
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
                    stamps.append(clock())
            out.append({"kind": "gloo", ("t0" if rank == 1 else "ret"): stamps[warmup:]})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


def _default_sender_wait() -> str:
    # On 2 cores a spinning sender starves the receiver it is measuring.
    return "spin" if (os.cpu_count() or 1) >= 4 else "sleep"


def _pct(lat: list[float], p: float) -> float:
    return lat[min(len(lat) - 1, max(0, math.ceil(p / 100.0 * len(lat)) - 1))]


def _phases(ffn: dict, attn: dict) -> dict[str, dict[str, float]]:
    """Per-phase p50 / p99 (µs) of one cell: where the end-to-end time goes.

    ``send``: attention call start -> message published (shm: the native
    publish's stamp; tcp: the call's return); ``wake``: published -> the FFN's
    native poll saw it (shm: cache-line transfer, or the receiver arriving late);
    ``take``: seen -> the channel returned it to Python (copy, CRC, parse, GIL
    re-acquired, payload built; tcp: published -> returned, the socket path); ``build``:
    from there (shm: the native stamp after the payload was built; tcp: the channel's
    return) -> ``recv_dp_metadata_list`` returned. shm also splits ``send`` into ``call``
    (Python until the native send is entered) and ``encode`` (until the publish began),
    and ``take`` into ``gil`` (copy, check, GIL back) and ``made`` (the payload built).
    """
    t0, ret = attn["t0"], ffn["ret"]
    pub = attn.get("pub") or []
    seen = ffn.get("seen") or []
    taken = ffn.get("taken") or []
    if not all(taken):  # a step without its stamp: no split at that point
        taken = []
    shm = bool(pub) and all(pub) and bool(seen) and all(seen)
    if not shm:
        pub = attn.get("ret") or []
    spans: dict[str, list[tuple[int, int]]] = {}
    if pub:
        spans["send"] = list(zip(t0, pub))
    if shm:
        spans["wake"] = list(zip(pub, seen))
        spans["take"] = list(zip(seen, taken)) if taken else list(zip(seen, ret))
    elif pub and taken:
        spans["take"] = list(zip(pub, taken))
    if taken:
        spans["build"] = list(zip(taken, ret))
    amark, fmark = attn.get("mark") or [], ffn.get("mark") or []
    if shm and amark and all(amark):
        spans["call"], spans["encode"] = list(zip(t0, amark)), list(zip(amark, pub))
    if shm and fmark and all(fmark) and taken:
        spans["gil"], spans["made"] = list(zip(seen, fmark)), list(zip(fmark, taken))
    out = {}
    for name, pairs in spans.items():
        lat = sorted((b - a) / 1000.0 for a, b in pairs)
        if lat:
            out[name] = {"p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99)}
    return out


def _latencies(ffn: dict, attn: dict) -> list[float]:
    return sorted((r - s) / 1000.0 for r, s in zip(ffn["ret"], attn["t0"]))


def _pooled(runs: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """One cell's stamps from several rounds (process pairs), as if measured in one."""
    ffn: dict[str, Any] = {"kind": runs[0][0]["kind"]}
    attn: dict[str, Any] = {}
    for f, a in runs:
        for src, dst in ((f, ffn), (a, attn)):
            for k, v in src.items():
                if isinstance(v, list):
                    dst.setdefault(k, []).extend(v)
    return ffn, attn


def _summarise(ffn: dict, attn: dict, gap_us: float, raw: bool, distinct: bool, sender_wait: str,
               size: int, cpus: tuple[int, ...] | None) -> dict[str, Any]:
    lat = _latencies(ffn, attn)
    return {
        "kind": ffn["kind"], "raw": raw, "distinct": distinct, "n": len(lat), "gap_us": gap_us,
        "p50_us": _pct(lat, 50), "p90_us": _pct(lat, 90), "p99_us": _pct(lat, 99),
        "mean_us": sum(lat) / len(lat), "min_us": lat[0], "max_us": lat[-1],
        "payload_bytes": size, "sender_wait": sender_wait, "cpus": list(cpus) if cpus else None,
        "phases": _phases(ffn, attn),
    }


def measure_control_gaps(
    kind: str,
    schedule: list[tuple[float, int, int]],
    *,
    num_attention_ranks: int = PAYLOAD_ATTENTION_RANKS,
    stages: int = PAYLOAD_STAGES,
    raw: bool = False,
    idle_s: float | None = None,
    timeout_s: float | None = None,
    distinct: bool = False,
    sender_wait: str = "auto",
    reference: bool = False,
    pin: bool | None = None,
    warm_s: float | None = None,
) -> list[dict[str, Any]]:
    """:func:`measure_control_plane` at several gaps with one pair of processes (one start-up).

    Args:
        schedule: ``(gap_us, iterations, warmup)`` per measurement, run in order.
        pin: pin the FFN and attention processes to CPUs of two different physical
            cores (:func:`pick_control_cpus`); None: when the host has one to spare
            (never the reference's: gloo's threads would share the one CPU).
        timeout_s: deadline for the whole run (None: 60 s plus three times the steps' gaps).
        warm_s: the receiver's ``ChannelOptions.warm_s`` (None: ``AFD_CONTROL_WARM_S`` / default; 0: off).
        Others: as :func:`measure_control_plane`.

    Returns:
        One :func:`measure_control_plane` result per schedule entry, with ``"phases"``
        and ``"cpus"`` (the pinned ``[ffn, attention(, its helper threads)]`` CPUs, or None).

    Raises:
        AFDConfigError: an entry with ``iterations < 1`` or an unknown ``sender_wait``.
    """
    pairs, size, sender_wait, cpus = _gap_stamps(
        kind, schedule, num_attention_ranks=num_attention_ranks, stages=stages, raw=raw, idle_s=idle_s,
        timeout_s=timeout_s, distinct=distinct, sender_wait=sender_wait, reference=reference, pin=pin,
        warm_s=warm_s)
    return [_summarise(f, a, g, raw, distinct, sender_wait, size, cpus) for (g, _, _), (f, a) in zip(schedule, pairs)]


def _gap_stamps(kind: str, schedule: list[tuple[float, int, int]], *, num_attention_ranks: int, stages: int,
                raw: bool, idle_s: float | None, timeout_s: float | None, distinct: bool, sender_wait: str,
                reference: bool, pin: bool | None, warm_s: float | None,
                ) -> tuple[list[tuple[dict, dict]], int, str, tuple[int, int] | None]:
    """:func:`measure_control_gaps`' measurement: per schedule entry the ``(ffn, attention)`` stamps
    (see :func:`_measure_worker`); the payload's bytes, the sender's wait and the CPUs pinned."""
    from afd_ext.errors import AFDConfigError
    from afd_ext.metadata import encode_control_binary, encode_control_payload
    from afd_ext.testing import find_free_port, run_workers

    if not schedule or any(int(it) < 1 for _, it, _ in schedule):
        raise AFDConfigError(f"every schedule entry needs iterations >= 1, got {schedule!r}")
    if sender_wait not in ("auto", "spin", "sleep"):
        raise AFDConfigError(f"sender_wait must be 'auto', 'spin' or 'sleep', got {sender_wait!r}")
    if sender_wait == "auto":
        sender_wait = _default_sender_wait()
    # The reference is left where the scheduler puts it: gloo's I/O threads would share the one pinned CPU.
    cpus = pick_control_cpus() if pin is not False and not reference else None
    sched = [(g * 1e-6, int(it), int(w)) for g, it, w in schedule]
    if timeout_s is None:
        timeout_s = 60.0 + 3 * sum((it + w) * g for g, it, w in sched)
    host = "127.0.0.1"
    port = find_free_port(host)
    res = run_workers(_measure_worker, 2, (host, port, kind, sched, num_attention_ranks, stages, raw, idle_s,
                                           distinct, sender_wait == "spin", reference, cpus, warm_s),
                      timeout_s=timeout_s)
    encode = encode_control_payload if reference else encode_control_binary
    size = len(encode(control_payload(num_attention_ranks, stages)))
    return list(zip(res[0], res[1])), size, sender_wait, cpus


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
    pin: bool | None = None,
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
        pin: see :func:`measure_control_gaps`.

    Returns:
        ``{"kind", "n", "p50_us", "p90_us", "p99_us", "mean_us", "min_us", "max_us",
        "payload_bytes", "sender_wait", "raw", "distinct", "gap_us", "cpus", "phases"}``;
        ``phases``: name -> ``{"p50_us", "p99_us"}`` (see ``_phases``).

    Raises:
        AFDConfigError: ``iterations < 1`` or an unknown ``sender_wait``.
    """
    from afd_ext.errors import AFDConfigError

    if iterations < 1:
        raise AFDConfigError(f"iterations must be >= 1, got {iterations}")
    return measure_control_gaps(kind, [(gap_us, iterations, warmup)], num_attention_ranks=num_attention_ranks,
                                stages=stages, raw=raw, idle_s=idle_s, timeout_s=timeout_s, distinct=distinct,
                                sender_wait=sender_wait, reference=reference, pin=pin)[0]


def _iterations_for(gap_ms: float, seconds: float, floor: int = 200) -> int:
    return int(min(2000, max(floor, seconds * 1000.0 / gap_ms)))


def _cpu_ticks() -> dict[str, tuple[int, int]]:
    """``/proc/stat``: per CPU line (``"cpu"``, ``"cpu3"`` ...) its (steal, total) ticks; {} elsewhere."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for ln in f:
                if not ln.startswith("cpu"):
                    break
                name, *vals = ln.split()
                ticks = [int(v) for v in vals[:8]]  # user nice system idle iowait irq softirq steal
                out[name] = (ticks[7] if len(ticks) > 7 else 0, sum(ticks))
    except (OSError, ValueError):
        return {}
    return out


def _steal_pct(before: dict, after: dict, cpus: tuple[int, ...] | None) -> float | None:
    """The hypervisor's steal time between two :func:`_cpu_ticks`, % of the CPUs' time (the pinned
    two, else all); None where the kernel does not count it."""
    names = [f"cpu{c}" for c in cpus] if cpus else ["cpu"]
    if not all(n in before and n in after for n in names):
        return None
    steal = sum(after[n][0] - before[n][0] for n in names)
    total = sum(after[n][1] - before[n][1] for n in names)
    return 100.0 * steal / total if total > 0 else None


def control_table(
    gaps_ms: tuple[float, ...] = DEFAULT_GAPS_MS,
    kinds: tuple[str, ...] = ("shm", "tcp"),
    *,
    seconds_per_cell: float = 5.0,
    rounds: int = 3,
    reference: bool = True,
    idle_s: float | None = None,
    sender_wait: str = "auto",
    pin: bool | None = None,
    progress: Any = None,
    on_round: Any = None,
) -> list[dict]:
    """The control-plane table: end to end, new counts every step, per (gap, channel), plus the reference.

    A kind ``"<channel>+cold"`` measures the channel without the receiver's
    rehearsal (``warm_s=0``). Each cell runs ``seconds_per_cell`` of steps (200-2000 steps);
    the reference pattern (gloo) and the experiments get a third of that
    (100-2000 steps). The steps are split over ``rounds`` rounds; a round runs every
    column once, each column as one pair of processes over every gap, the columns and
    the gaps in an order rotated from round to round, so that what the host does
    meanwhile (a virtual machine's neighbours) falls on every cell alike. A cell's
    rounds are pooled. ``progress(name, gap_ms, result)`` is called per cell at the
    end, ``on_round(i, seconds)`` after each round.

    Returns:
        One row per gap: ``{"gap_ms", "<kind>": result, ..., "reference": result | None}``,
        results as :func:`measure_control_plane` returns them plus ``"rounds"``,
        ``"p50_rounds_us"`` (each round's p50) and ``"steal_pct"`` (the hypervisor's steal
        time on the two measured CPUs during the column's runs, all its gaps, averaged over
        the rounds: one figure per column; None where not counted), or ``{"error": ...}``.

    Raises:
        AFDConfigError: ``rounds < 1``.
    """
    from afd_ext.errors import AFDConfigError

    if rounds < 1:
        raise AFDConfigError(f"rounds must be >= 1, got {rounds}")
    cells = [(k, False) for k in kinds] + ([("reference", True)] if reference else [])
    runs: dict[tuple[str, float], list[tuple[dict, dict]]] = {}
    meta: dict[str, tuple[int, str, Any]] = {}
    steal: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    for rnd in range(rounds):
        t = time.monotonic()
        order = cells[rnd % len(cells):] + cells[:rnd % len(cells)]
        gaps = list(gaps_ms[rnd % len(gaps_ms):] + gaps_ms[:rnd % len(gaps_ms)])
        for name, ref in order:
            if name in errors:
                continue
            kind, _, variant = name.partition("+")  # "shm+cold": without the receiver's rehearsal
            sched = []
            for gap in gaps:
                short = ref or bool(variant)  # the reference and the experiments: a third of the steps
                it = _iterations_for(gap, seconds_per_cell / (3 if short else 1), 100 if short else 200)
                it = -(-it // rounds)
                sched.append((gap * 1000.0, it, max(5, min(50, it // 10))))
            before = _cpu_ticks()
            try:
                pairs, size, sw, cpus = _gap_stamps(
                    "auto" if ref else kind, sched, num_attention_ranks=PAYLOAD_ATTENTION_RANKS,
                    stages=PAYLOAD_STAGES, raw=False, idle_s=idle_s, timeout_s=None, distinct=True,
                    sender_wait=sender_wait, reference=ref, pin=pin, warm_s=0.0 if variant == "cold" else None)
            except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
                logger.warning("control-plane measurement %s failed: %s", name, e)
                errors[name] = f"{type(e).__name__}: {e}"
                continue
            meta[name] = (size, sw, cpus)
            pct = _steal_pct(before, _cpu_ticks(), cpus)
            if pct is not None:
                steal.setdefault(name, []).append(pct)
            for gap, pair in zip(gaps, pairs):
                runs.setdefault((name, gap), []).append(pair)
        if on_round is not None:
            on_round(rnd, time.monotonic() - t)
    rows: list[dict[str, Any]] = []
    for gap in gaps_ms:
        row: dict[str, Any] = {"gap_ms": gap}
        for name, _ in cells:
            if name in errors:
                r: dict[str, Any] = {"error": errors[name]}
            else:
                size, sw, cpus = meta[name]
                parts = runs[(name, gap)]
                r = _summarise(*_pooled(parts), gap * 1000.0, False, True, sw, size, cpus)
                r["rounds"] = len(parts)
                r["p50_rounds_us"] = [_pct(_latencies(f, a), 50) for f, a in parts]
                r["steal_pct"] = sum(steal[name]) / len(steal[name]) if steal.get(name) else None
            row[name] = r
            if progress is not None:
                progress(name, gap, r)
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


def format_phases(r: dict) -> str:
    """One line: each phase's p50 / p99 in µs (``send wake take build``; see ``_phases``)."""
    ph = r.get("phases") or {}
    return ", ".join(f"{k} {v['p50_us']:.1f}/{v['p99_us']:.1f}" for k, v in ph.items())


def control_main(gaps_ms: tuple[float, ...] = DEFAULT_GAPS_MS,
                 kinds: tuple[str, ...] = ("shm", "tcp", "shm+cold", "tcp+cold"),
                 *, seconds_per_cell: float = 5.0, rounds: int = 3, reference: bool = True,
                 out: str | None = None, sender_wait: str = "auto", pin: bool | None = None) -> int:
    """``afd-ext bench --control-only``: measure and print the control-plane table (and save JSON)."""
    sw = _default_sender_wait() if sender_wait == "auto" else sender_wait
    cpus = pick_control_cpus() if pin is not False else None
    facts = _host_facts()
    print(f"control plane, end to end (attention send_dp_metadata_list call -> FFN recv_dp_metadata_list "
          f"return), new counts every step, payload {PAYLOAD_ATTENTION_RANKS} attention ranks x "
          f"{PAYLOAD_STAGES} stages; attention end {sw}s between steps; "
          + (f"FFN pinned to CPU {cpus[0]}, attention to CPU {cpus[1]}"
             + (f" (its other threads: CPU {cpus[2]})" if len(cpus) > 2 else "") if cpus else "not pinned"), flush=True)
    print("host: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
    print("phases (p50/p99 us): send = call -> publish began (call = until native, encode), wake = -> FFN poll "
          "saw it, take = seen -> payload built (gil = copy, check, GIL back; made = payload built; tcp: "
          "channel returned), build = -> recv_dp_metadata_list returned", flush=True)

    def progress(name: str, gap: float, r: dict) -> None:
        if "error" in r:
            print(f"  {name:9s} gap {gap:g} ms: FAILED {r['error']}", flush=True)
        else:
            spread = r.get("p50_rounds_us") or []
            steal = r.get("steal_pct")
            print(f"  {name:9s} gap {gap:g} ms: p50 {r['p50_us']:.1f} µs, p99 {r['p99_us']:.1f} µs "
                  f"(n={r['n']}, {r['payload_bytes']} B"
                  + (f"; rounds' p50 {min(spread):.1f}-{max(spread):.1f}" if spread else "")
                  + (f"; steal {steal:.2f} %" if steal is not None else "")
                  + f"); {format_phases(r)}", flush=True)

    def on_round(i: int, seconds: float) -> None:
        print(f"  round {i + 1}/{rounds} measured in {seconds:.0f} s", flush=True)

    t = time.monotonic()
    rows = control_table(gaps_ms, kinds, seconds_per_cell=seconds_per_cell, rounds=rounds, reference=reference,
                         sender_wait=sender_wait, pin=pin, progress=progress, on_round=on_round)
    print(format_control_table(rows, kinds), flush=True)
    print(f"control plane measured in {time.monotonic() - t:.0f} s", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "control_plane.json")
        with open(path, "w") as f:
            json.dump({"rows": rows, "host": facts, "sender_wait": sw, "cpus": list(cpus) if cpus else None},
                      f, indent=1)
        print(f"wrote {path}", flush=True)
    failed = any("error" in (r.get(k) or {}) for r in rows for k in kinds if "+" not in k)
    return 1 if failed else 0
