"""The control plane per step: the reference's pattern against this package's channels.

Reference pattern (rebuilt, reference §2.10): the control-sending attention
rank encodes the payload, copies it to the GPU, and sends two blocking
``torch.distributed`` messages over an NCCL group (an int64 size tensor, then
the uint8 payload); the FFN rank receives the size, reads it with ``.item()``
(a device sync), allocates, receives the payload, copies it to the host and
decodes it. On the CPU/gloo path the same two messages go over gloo with CPU
tensors (the reference's CAMP2P flavour).

This package: :func:`afd_ext.control_plane.measure_control_plane` (host-only
channels, no device sync), run in its own two processes.

Both are timed end to end the same way: attention call start (before
encoding) to FFN receive return (after decoding), ``time.perf_counter_ns``
(CLOCK_MONOTONIC, shared by processes on one host), with the same payload
(8 attention ranks' counts, 2 stages).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("afd_ext.bench")

__all__ = ["control_payload", "reference_control_plane", "ours_control_plane", "summarize_latencies"]

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
        from afd_ext.control_plane import measure_control_plane

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
