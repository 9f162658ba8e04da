"""The peer-memory plane: ranks on one node write rows straight into each other's GPU memory.

Each rank owns one *receive region* (``cudaMalloc``, outside torch's caching
allocator) and maps its peers' regions through CUDA IPC:

* an FFN rank's region is its **fan-in** buffer: per stage, the wire tensors
  of every attention peer, concatenated in fan-in order (so ``recv_attn_output``
  returns views of it, no copy);
* an attention rank's region is its **reply** buffer: per stage, its rows of
  the FFN output (split-back writes them there).

A write is one ``peer_put`` kernel (rows into the peer's region, then a flag
per peer, release at system scope); a read is one ``peer_wait`` kernel (every
peer's flag, acquire; optionally a copy out). Sequence numbers live on the
device, so CUDA graphs replay with no host work. Design, slot-reuse rule,
memory-ordering rule, deadlines and the memory formula: ``docs/peer-memory.md``.

:class:`PeerPlane` is one rank's plane (buffers, peers, data calls, failure
record); :func:`open_plane` sets one up collectively through the rendezvous
store and proves it works (every peer's region opens and a flag round trip
succeeds on every rank) or raises :class:`PeerMemoryUnavailableError` on every
rank together.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ... import ops
from ...errors import (
    AFDAbortedError, AFDConfigError, AFDError, AFDProtocolError, AFDStateError, AFDTimeoutError,
    PeerMemoryUnavailableError
)
from ...topology import ATTENTION, FFN, ROLES, Topology, rank_label
from ...wire import layout

logger = logging.getLogger(__name__)

__all__ = ["REGION_ALIGN", "FLAG_STRIDE", "OP_NAMES", "WireSpec", "RegionLayout", "PeerFailure", "failure_error",
           "PeerPlane", "open_plane"]

#: Byte alignment of every part (and of the flag area's end) in a region.
REGION_ALIGN = 256
#: Bytes between two flag words (one per (stage, peer); a cache line each).
FLAG_STRIDE = 64

# Op codes written into the plane's error record (peer_wait's `op`, peer_plane_abort's `op`).
OP_CLOSE = -1
OP_ABORT = 0
OP_RECV_ATTN = 1
OP_RECV_FFN = 2
OP_PROBE = 3
#: Op code -> the name errors carry.
OP_NAMES = {
    OP_CLOSE: "close",
    OP_ABORT: "abort",
    OP_RECV_ATTN: "recv_attn_output",
    OP_RECV_FFN: "recv_ffn_output",
    OP_PROBE: "peer-memory probe",
}


def _align(n: int, a: int = REGION_ALIGN) -> int:
    return (n + a - 1) // a * a


def _row_bytes(parts: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> tuple[int, ...]:
    return tuple(d.itemsize * math.prod(cols) for d, cols in parts)


@dataclass(frozen=True)
class WireSpec:
    """What travels, as the plane lays it out: ``(dtype, cols)`` of each part (``cols`` ``()``: one value per row).

    Build it from the connector's config with :meth:`of` (the one statement of the wire: :mod:`afd_ext.wire`).

    Attributes:
        fan_in: the parts an FFN rank's region holds, in wire order.
        send: the tensors an attention rank's put takes (with ``quantize_first`` its first
            stands for the first two fan-in parts).
        reply: the parts of the reply (the FFN output) an attention rank's region holds.
        quantize_first: FP8 on the wire (docs/fp8.md): the put quantizes the attention rank's
            first (bf16) tensor into the first two fan-in parts, values and scales.
        ue8m0: with ``quantize_first``, the scales are UE8M0 (powers of two).
    """

    fan_in: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    send: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    reply: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    quantize_first: bool = False
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if not self.fan_in or not self.reply or any(c < 1 for _, cols in self.fan_in + self.reply for c in cols):
            raise AFDConfigError(f"WireSpec: every part needs columns >= 1 and both directions a part, got "
                                 f"{self.fan_in} and {self.reply}")

    @classmethod
    def of(cls, cfg: Any) -> "WireSpec":
        """The spec of a :class:`~afd_ext.schedule.ScheduleConfig` (its :func:`afd_ext.wire.layout`)."""
        pairs = lambda ps: tuple((p.dtype, p.cols) for p in ps)  # noqa: E731
        return cls(pairs(cfg.wire_parts), pairs(cfg.caller_parts), pairs(layout(cfg, "f2a")),
                   cfg.hidden_wire is not None, cfg.hidden_wire is not None and cfg.fp8_scale_format == "ue8m0")

    def signature(self) -> str:
        """A string equal on two ranks exactly when their specs are equal (checked at set-up)."""
        return repr((self.fan_in, self.send, self.reply, self.quantize_first, self.ue8m0))


@dataclass(frozen=True)
class RegionLayout:
    """Byte layout of one rank's receive region.

    ``[flags][stage 0: part 0 | part 1 | ...][stage 1: ...]``: the flag area
    holds ``num_stages x num_peers`` 64-bit flag words ``FLAG_STRIDE`` bytes
    apart (flag of peer index ``i`` at stage ``s``); each part is
    ``capacity_rows`` dense rows of its row size, starting on a
    ``REGION_ALIGN`` boundary.

    Attributes:
        num_stages: stages (micro-batches) per step.
        num_peers: peers writing into this region (their flags).
        capacity_rows: rows per part and stage.
        row_bytes: bytes per row of each part.
    """

    num_stages: int
    num_peers: int
    capacity_rows: int
    row_bytes: tuple[int, ...]

    @classmethod
    def for_rank(cls, topology: Topology, role: str, role_rank: int, spec: WireSpec, *,
                 max_tokens: int, num_stages: int) -> "RegionLayout":
        """The region of ``(role, role_rank)``.

        An FFN rank's fan-in region holds ``len(ffn_peers) * max_tokens`` rows
        of every wire part per stage; an attention rank's reply region holds
        ``max_tokens`` rows of the FFN output per stage.

        Args:
            max_tokens: most tokens one attention rank sends in one stage of one step.
            num_stages: stages per step.

        Raises:
            AFDConfigError: ``max_tokens`` or ``num_stages`` < 1; ValueError: a bad role rank.
        """
        if max_tokens < 1 or num_stages < 1:
            raise AFDConfigError(f"max_tokens and num_stages must be >= 1, got {max_tokens} and {num_stages}")
        if role == FFN:
            n = len(topology.ffn_peers(role_rank))
            return cls(num_stages, n, n * max_tokens, _row_bytes(spec.fan_in))
        if role == ATTENTION:
            n = len(topology.attention_peers(role_rank))
            return cls(num_stages, n, max_tokens, _row_bytes(spec.reply))
        raise AFDConfigError(f"unknown AFD role {role!r}; expected one of {ROLES}")

    @property
    def flags_bytes(self) -> int:
        return _align(self.num_stages * self.num_peers * FLAG_STRIDE)

    def part_bytes(self, part: int) -> int:
        return _align(self.capacity_rows * self.row_bytes[part])

    @property
    def stage_bytes(self) -> int:
        return sum(self.part_bytes(k) for k in range(len(self.row_bytes)))

    @property
    def nbytes(self) -> int:
        """Total bytes of the region."""
        return self.flags_bytes + self.num_stages * self.stage_bytes

    def flag_offset(self, stage: int, peer_index: int) -> int:
        """Byte offset of the flag that peer ``peer_index`` (its index in this rank's peer list) sets at ``stage``."""
        return (stage * self.num_peers + peer_index) * FLAG_STRIDE

    def part_offset(self, stage: int, part: int) -> int:
        """Byte offset of row 0 of ``part`` at ``stage``."""
        return self.flags_bytes + stage * self.stage_bytes + sum(self.part_bytes(k) for k in range(part))


@dataclass(frozen=True)
class PeerFailure:
    """The plane's error record, decoded (see ``ops.peer_plane_error``)."""

    code: int
    op: int
    peer: int
    layer: int
    stage: int
    want: int
    seen: int
    waited_ns: int

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op, f"op {self.op}")


def failure_error(rec: PeerFailure, *, me: str, peer: Optional[str], generation: int) -> AFDError:
    """The package error for a plane's failure record.

    Args:
        rec: the decoded record.
        me: label of the rank whose plane failed.
        peer: label of the peer the record names (None if it names none).
        generation: the plane's generation.

    Returns:
        :class:`AFDTimeoutError` (deadline), :class:`AFDProtocolError` (a flag
        ahead of the expected sequence) or :class:`AFDAbortedError` (host
        abort), carrying ``op``, ``peer``, ``layer`` and ``stage``.
    """
    where = f"layer {rec.layer}, stage {rec.stage}" if rec.layer >= 0 else f"set-up, stage {rec.stage}"
    seen_gen, seen_seq = rec.seen >> 48, rec.seen & ((1 << 48) - 1)
    layer = rec.layer if rec.layer >= 0 else None
    if rec.code == ops.PEER_TIMEOUT:
        return AFDTimeoutError(
            f"AFD peer-memory plane of {me}: {rec.op_name} waited {rec.waited_ns / 1e9:.3f} s for {peer}'s flag "
            f"at {where} (wanted sequence {rec.want} of generation {generation}; the flag showed sequence "
            f"{seen_seq} of generation {seen_gen}): the peer is dead, stuck, or not making the matching call. "
            "Every wait of this plane now returns at once; close and re-initialise the connector on every rank.",
            op=rec.op_name, peer=peer, layer=layer, stage=rec.stage)
    if rec.code == ops.PEER_PROTOCOL:
        return AFDProtocolError(
            f"AFD peer-memory plane of {me}: {rec.op_name} at {where} found {peer}'s flag at sequence {seen_seq} "
            f"while waiting for {rec.want}: the two sides made different numbers of calls for this stage (same "
            "schedule and call order on both roles?). Close and re-initialise the connector on every rank.",
            op=rec.op_name, peer=peer, layer=layer, stage=rec.stage)
    return AFDAbortedError(
        f"AFD peer-memory plane of {me} was aborted from the host ({rec.op_name}); close and re-initialise the "
        "connector on every rank.", op=rec.op_name)


def _device_index(device) -> int:
    d = torch.device(device)
    if d.type != "cuda":
        raise AFDConfigError(f"the peer-memory plane needs a CUDA device, got {d}")
    return torch.cuda.current_device() if d.index is None else d.index


class PeerPlane:
    """One rank's peer-memory plane: its receive region, its peers' regions, device counters, failure record.

    Slots: ``stage`` counts this rank's puts of that stage,
    ``num_stages + stage`` its waits. Both ends of an edge advance their
    counters once per call, so they stay in lockstep as long as both sides
    make the same calls (the schedule guarantees it; zero-row calls count).

    Views returned by :meth:`wait` alias the region: the fan-in views of a
    stage stay valid until this FFN rank's next :meth:`put` of that stage has
    been consumed by its peers (their next put comes only after), i.e. until
    the next layer's exchange of the stage; the reply view of an attention
    rank until its own next put of that stage. Pass ``out`` to copy instead.

    Args:
        topology: the AFD topology (both roles build the same).
        role, role_rank: this rank.
        spec: what travels (the same on every rank).
        max_tokens: most tokens an attention rank sends in one stage of one step (the capacity).
        num_stages: stages per step.
        device: this rank's CUDA device.
        generation: ``1..65535``, the same on every rank (see :func:`open_plane`).
        timeout_s: deadline of every device-side wait, seconds.

    Raises:
        AFDConfigError: bad sizes; RuntimeError: the device memory cannot be allocated
            (CUDA error, out of memory, CPU-only build).
    """

    def __init__(self, topology: Topology, role: str, role_rank: int, spec: WireSpec, *, max_tokens: int,
                 num_stages: int, device, generation: int, timeout_s: float):
        topology.check_role_rank(role, role_rank)
        if not timeout_s or timeout_s <= 0:
            raise AFDConfigError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.topology = topology
        self.role = role
        self.role_rank = role_rank
        self.spec = spec
        self.max_tokens = int(max_tokens)
        self.num_stages = int(num_stages)
        self.device = torch.device("cuda", _device_index(device))
        self.generation = int(generation)
        self.timeout_ns = int(timeout_s * 1e9)
        self.other_role = ATTENTION if role == FFN else FFN
        self.peers: tuple[int, ...] = (topology.ffn_peers(role_rank) if role == FFN
                                       else topology.attention_peers(role_rank))
        if len(self.peers) > ops.PEER_MAX_PEERS:
            raise AFDConfigError(f"{len(self.peers)} peers exceed the plane's limit of {ops.PEER_MAX_PEERS}")
        self.layout = RegionLayout.for_rank(topology, role, role_rank, spec, max_tokens=max_tokens,
                                            num_stages=num_stages)
        # Where this rank writes: each peer's layout and this rank's index among that peer's peers.
        self.peer_layouts = [RegionLayout.for_rank(topology, self.other_role, p, spec, max_tokens=max_tokens,
                                                   num_stages=num_stages) for p in self.peers]
        self._my_index = [(topology.attention_peers(p) if role == FFN else topology.ffn_peers(p)).index(role_rank)
                          for p in self.peers]
        first = self.peer_layouts[0]
        if any(lay.row_bytes != first.row_bytes or lay.capacity_rows != first.capacity_rows
               for lay in self.peer_layouts):
            # One put writes the same part offsets into every peer: true for every topology
            # (an attention rank with several FFN peers has A < F: they all have one peer).
            raise AFDConfigError("peer regions of one rank differ in layout; unsupported topology")
        self._plane = 0
        self._region = 0
        self._peer_regions: dict[int, int] = {}
        self._closed = False
        self._plane = ops.peer_plane_create(self.device.index, self.generation, 2 * self.num_stages, len(self.peers))
        try:
            self._region = ops.peer_region_alloc(self._plane, self.layout.nbytes)
            self.ipc_handle: bytes = bytes(ops.peer_region_export(self._region).numpy().tobytes())
            # Full-capacity typed views of each (stage, part), made once; calls slice them.
            self._views = [[self._part_view(s, k) for k in range(len(self.layout.row_bytes))]
                           for s in range(self.num_stages)]
        except BaseException:
            self.close()
            raise
        self._wait_flags = [[self.layout.flag_offset(s, i) for i in range(len(self.peers))]
                            for s in range(self.num_stages)]
        self._put_flags = [[lay.flag_offset(s, j) for lay, j in zip(self.peer_layouts, self._my_index)]
                           for s in range(self.num_stages)]
        self._put_parts = [[first.part_offset(s, k) for k in range(len(first.row_bytes))]
                           for s in range(self.num_stages)]
        self._put_regions: list[int] = []
        self._zero_rows = [0] * len(self.peers)

    def _part_view(self, stage: int, part: int) -> Tensor:
        rb = self.layout.row_bytes[part]
        raw = ops.peer_region_view(self._region, self.layout.part_offset(stage, part), self.layout.capacity_rows * rb)
        dtype, cols = (self.spec.reply if self.role == ATTENTION else self.spec.fan_in)[part]
        return raw.view(dtype).view((self.layout.capacity_rows,) + cols)

    # -- set-up ----------------------------------------------------------------

    def label(self, role: str, role_rank: int) -> str:
        return rank_label(self.topology.world_rank(role, role_rank), self.topology.F)

    @property
    def me(self) -> str:
        return self.label(self.role, self.role_rank)

    def attach(self, peer: int, ipc_handle: bytes, nbytes: int) -> None:
        """Open peer ``peer``'s region (its role rank) from the handle and size it published.

        Raises:
            AFDProtocolError: the peer's region size differs from the one this
                rank computes (the two disagree on the spec, capacity or stages).
            RuntimeError: CUDA cannot open the handle here.
        """
        i = self.peers.index(peer)
        if nbytes != self.peer_layouts[i].nbytes:
            raise AFDProtocolError(
                f"{self.me}: {self.label(self.other_role, peer)} published a peer-memory region of {nbytes} bytes "
                f"but this rank expects {self.peer_layouts[i].nbytes}: the ranks disagree on the wire parts "
                "(sizes, dtypes), max tokens per step or stages", op="peer-memory set-up",
                peer=self.label(self.other_role, peer))
        if peer in self._peer_regions:
            ops.peer_region_close(self._peer_regions.pop(peer))
        self._peer_regions[peer] = ops.peer_region_open(self._plane, ipc_handle, nbytes)
        if len(self._peer_regions) == len(self.peers):
            self._put_regions = [self._peer_regions[p] for p in self.peers]

    @property
    def attached(self) -> bool:
        """True once every peer's region is open."""
        return len(self._put_regions) == len(self.peers)

    # -- data --------------------------------------------------------------------

    def put(self, stage: int, tensors: Sequence[Optional[Tensor]], rows: Sequence[int],
            dst_rows: Sequence[int]) -> None:
        """Write this rank's rows into its peers' regions at ``stage`` and publish the flags (one kernel).

        Args:
            stage: the stage.
            tensors: attention rank: the spec's ``send`` parts; FFN rank: its ``reply`` parts
                (``[ffn_output]``). A list in wire order, leading dim ``sum(rows)``, contiguous,
                on :attr:`device`.
            rows: rows for each peer (in :attr:`peers` order); zero moves no bytes.
            dst_rows: first row of each peer's range in that peer's part (the FFN
                rank's fan-in offset of this attention rank; the attention rank's
                row offset of this FFN rank's share).

        Raises:
            AFDConfigError: tensors do not match the spec, or the rows exceed the
                capacity (more than ``max_tokens`` rows of one attention rank in a
                stage, or a range past a peer's part), before anything moves.
            RuntimeError: a bad tensor (device, dtype, shape), before anything moves.
        """
        if not self._put_regions:
            raise AFDStateError(f"{self.me}: put before every peer's region was attached (use open_plane)",
                                op="peer_put")
        quant = self.spec.quantize_first and self.role == ATTENTION  # one tensor in, values + scales out
        nparts = len(self.peer_layouts[0].row_bytes) - quant
        if len(tensors) != nparts:
            raise AFDConfigError(f"{self.me}: put got {len(tensors)} tensors but the plane was set up for {nparts} "
                                 "(the wire parts, in order: afd_ext.wire)")
        self._check_capacity(rows, dst_rows)
        ops.peer_put(tensors, self._plane, stage, self._put_regions, rows, dst_rows, self._put_parts[stage],
                     self._put_flags[stage], quant, quant and self.spec.ue8m0)

    def _check_capacity(self, rows: Sequence[int], dst_rows: Sequence[int]) -> None:
        # The op only bounds a write by the peer region's end; a range past a part's capacity
        # would land in another attention rank's rows or another stage's slot.
        if self.role == ATTENTION and sum(rows) > self.max_tokens:
            raise AFDConfigError(
                f"{self.me}: put of {sum(rows)} rows exceeds the plane's capacity of {self.max_tokens} "
                "rows per attention rank and stage (peer_max_tokens); such a step must travel another way")
        for i, (n, d) in enumerate(zip(rows, dst_rows)):
            cap = self.peer_layouts[i].capacity_rows
            if d + n > cap:
                raise AFDConfigError(
                    f"{self.me}: put rows [{d}, {d + n}) for {self.label(self.other_role, self.peers[i])} "
                    f"end past its region's capacity of {cap} rows per stage")

    def views(self, stage: int, rows: int) -> tuple[Tensor, ...]:
        """This rank's region at ``stage``, first ``rows`` rows of each part (no wait)."""
        return tuple(v[:rows] for v in self._views[stage])

    def wait(self, stage: int, rows: int, *, layer: int, out: Optional[Tensor] = None,
             op: Optional[int] = None) -> tuple[Tensor, ...]:
        """Wait (on the current stream, no host block) for every peer's flag of ``stage``.

        Args:
            stage: the stage.
            rows: rows received in total (FFN: every peer's rows; attention: its own rows).
            layer: the layer exchange ordinal (recorded on failure).
            out: attention rank: copy the reply into it (``[rows, hidden]``, contiguous). FFN rank
                with FP8 hidden states: dequantize them into it (bf16), in the wait kernel.
            op: op code for the error record (default by role).

        Returns:
            FFN rank: views of the fan-in region's parts, in wire order; attention rank:
            ``(out,)`` or the reply parts' views.

        Raises:
            AFDConfigError: ``rows`` exceeds the region's capacity (before anything is launched).
        """
        if rows > self.layout.capacity_rows:
            raise AFDConfigError(f"{self.me}: wait for {rows} rows exceeds the region's capacity of "
                                 f"{self.layout.capacity_rows} rows per stage")
        vs = self.views(stage, rows)
        if op is None:
            op = OP_RECV_ATTN if self.role == FFN else OP_RECV_FFN
        fp8 = self.spec.quantize_first and self.role == FFN  # values and scales: out is their bf16
        ops.peer_wait(vs, out, self._plane, self.num_stages + stage, self._region, self._wait_flags[stage],
                      self.peers, op, layer, stage, self.timeout_ns, fp8 and out is not None)
        return (out,) if out is not None and not fp8 else vs

    # -- failure ---------------------------------------------------------------

    def record(self) -> Optional[PeerFailure]:
        """The decoded error record, or None while the plane is healthy (host memory only; any thread)."""
        if self._closed:
            return None
        words = ops.peer_plane_error(self._plane)
        return PeerFailure(*words) if words[0] != ops.PEER_OK else None

    def failure(self) -> Optional[AFDError]:
        """The named error for the recorded failure, or None (for a watchdog's poll)."""
        rec = self.record()
        return None if rec is None else self.error_for(rec)

    def raise_if_failed(self) -> None:
        """Raise :meth:`failure` if there is one."""
        err = self.failure()
        if err is not None:
            raise err

    def error_for(self, rec: PeerFailure) -> AFDError:
        """The package error for a decoded record (see :func:`failure_error`)."""
        peer = self.label(self.other_role, rec.peer) if rec.peer in self.peers else None
        return failure_error(rec, me=self.me, peer=peer, generation=self.generation)

    def abort(self) -> None:
        """Mark the plane failed from the host: spinning waits return, later calls move nothing. Never blocks."""
        if not self._closed and self._plane:
            ops.peer_plane_abort(self._plane, OP_ABORT)

    def close(self) -> None:
        """Abort, wait for the device, free everything (idempotent). Call outside graph capture."""
        if self._closed:
            return
        self._closed = True
        self._views = []
        if self._plane:
            ops.peer_plane_destroy(self._plane)  # aborts first: no wait of this plane outlives it
        for r in self._peer_regions.values():
            ops.peer_region_close(r)
        self._peer_regions.clear()
        self._put_regions = []
        if self._region:
            ops.peer_region_close(self._region)


# ------------------------------------------------------------------ collective set-up

def _wait_keys(store, keys: dict[str, int], timeout_s: Optional[float], what: str, topology: Topology) -> None:
    """Wait for every key: the rendezvous helper on an AFDStore, else a bounded poll of ``store.check``."""
    from ... import rendezvous as rdzv

    if isinstance(store, rdzv.AFDStore):
        rdzv.wait_for_keys(store, keys, timeout_s, what)
        return
    deadline = time.monotonic() + (rdzv.DEFAULT_RENDEZVOUS_TIMEOUT_S if timeout_s is None else timeout_s)
    while not store.check(list(keys)):
        if time.monotonic() >= deadline:
            missing = sorted({r for k, r in keys.items() if not store.check([k])})
            raise rdzv.RendezvousTimeoutError(
                f"timed out waiting for {what} from {', '.join(rdzv.rank_label(r, topology.F) for r in missing)}",
                missing=missing, what=what)
        time.sleep(0.002)


def _verdicts(store, world_rank: int, topology: Topology, name: str, mine: dict, timeout_s: Optional[float],
              what: str) -> dict[int, dict]:
    """Publish this rank's JSON verdict ``name`` and read every world rank's.

    Raises:
        PeerMemoryUnavailableError: a rank's verdict is not ok (``what`` failed there; every rank raises it).
    """
    from ...rendezvous import rank_label

    store.set(f"peer/{name}/{world_rank}", json.dumps(mine).encode())
    keys = {f"peer/{name}/{w}": w for w in range(topology.world_size)}
    _wait_keys(store, keys, timeout_s, f"peer-memory {name}", topology)
    verdicts = {w: json.loads(bytes(store.get(k)).decode()) for k, w in keys.items()}
    bad = {rank_label(w, topology.F): v.get("why", "?") for w, v in sorted(verdicts.items()) if not v.get("ok")}
    if bad:
        raise PeerMemoryUnavailableError(
            f"the peer-memory plane is unavailable ({what}): "
            + "; ".join(f"{who}: {why}" for who, why in bad.items()), reasons=bad)
    return verdicts


def _probe(plane: PeerPlane, timeout_ns: int) -> None:
    """One zero-row flag round trip per stage on a side stream, then wait for it (bounded by ``timeout_ns``)."""
    saved = plane.timeout_ns
    plane.timeout_ns = timeout_ns
    try:
        stream = torch.cuda.Stream(plane.device)
        spec = plane.spec
        empty = lambda parts: [torch.empty((0,) + cols, dtype=d, device=plane.device) for d, cols in parts]  # noqa: E731
        wire, reply = empty(spec.send), empty(spec.reply)
        none = plane._zero_rows
        stream.wait_stream(torch.cuda.current_stream(plane.device))
        with torch.cuda.stream(stream):
            for s in range(plane.num_stages):
                if plane.role == ATTENTION:
                    plane.put(s, wire, none, none)
                    plane.wait(s, 0, layer=-1, op=OP_PROBE)
                else:
                    plane.wait(s, 0, layer=-1, op=OP_PROBE)
                    plane.put(s, reply, none, none)
        stream.synchronize()  # bounded: every wait above has the probe deadline
    finally:
        plane.timeout_ns = saved


def open_plane(store, topology: Topology, role: str, role_rank: int, spec: WireSpec, *, max_tokens: int,
               num_stages: int, device, timeout_s: float, probe_timeout_s: float = 10.0,
               setup_timeout_s: Optional[float] = None, generation: Optional[int] = None) -> PeerPlane:
    """Set up this rank's plane with every rank of the AFD world, and prove it works.

    Collective over all ``A + F`` ranks (every rank calls it with the same
    arguments except its own role/rank/device). Steps, each ending in a
    verdict every rank publishes and reads back through the store:

    1. allocate this rank's region and publish its CUDA IPC handle and size;
    2. open every peer's region (``opened``);
    3. one zero-row flag round trip per stage with every peer, bounded by
       ``probe_timeout_s`` on the device clock (``probe``).

    Host names are never consulted: a region that opens and a flag that comes
    back are the proof.

    Args:
        store: the generation's :class:`~afd_ext.rendezvous.AFDStore`, or any
            ``torch.distributed.Store`` whose keys are fresh for this set-up
            (e.g. a ``PrefixStore``; then pass ``generation``).
        topology, role, role_rank, spec, max_tokens, num_stages, device, timeout_s: as :class:`PeerPlane`.
        probe_timeout_s: deadline of the probe's device-side waits, seconds.
        setup_timeout_s: deadline of each store wait (default: the store's).
        generation: the flags' generation, ``1..65535`` (default: from the AFDStore's generation).

    Returns:
        A ready :class:`PeerPlane` whose stage counters have advanced by one (the probe).

    Raises:
        PeerMemoryUnavailableError: on every rank, when any rank failed a step (reasons by rank).
        RendezvousTimeoutError: a rank did not publish a verdict (it died or is not running this).
    """
    if generation is None:
        generation = (int(store.generation) - 1) % ops.PEER_MAX_GENERATION + 1
    world_rank = topology.world_rank(role, role_rank)
    plane: Optional[PeerPlane] = None
    try:
        try:
            plane = PeerPlane(topology, role, role_rank, spec, max_tokens=max_tokens, num_stages=num_stages,
                              device=device, generation=generation, timeout_s=timeout_s)
            mine = {"ok": True, "handle": plane.ipc_handle.hex(), "nbytes": plane.layout.nbytes,
                    "spec": spec.signature()}
        except (RuntimeError, AFDError) as e:
            mine = {"ok": False, "why": f"region not allocated: {e}".splitlines()[0]}
        regions = _verdicts(store, world_rank, topology, "region", mine, setup_timeout_s, "allocating the regions")
        opened = {"ok": True}
        try:
            for p in plane.peers:
                v = regions[topology.world_rank(plane.other_role, p)]
                if v["spec"] != spec.signature():
                    raise AFDProtocolError(f"{plane.label(plane.other_role, p)} moves {v['spec']} but this rank "
                                           f"moves {spec.signature()}")
                plane.attach(p, bytes.fromhex(v["handle"]), int(v["nbytes"]))
        except (RuntimeError, AFDError) as e:
            opened = {"ok": False, "why": f"peer region not opened: {e}".splitlines()[0]}
        _verdicts(store, world_rank, topology, "opened", opened, setup_timeout_s, "opening the regions")
        probed = {"ok": True}
        try:
            _probe(plane, int(probe_timeout_s * 1e9))
            err = plane.failure()
            if err is not None:
                raise err
        except (RuntimeError, AFDError) as e:
            probed = {"ok": False, "why": f"flag round trip failed: {e}".splitlines()[0]}
        _verdicts(store, world_rank, topology, "probe", probed, setup_timeout_s, "flag round trip")
        return plane
    except BaseException:
        if plane is not None:
            plane.close()
        raise
