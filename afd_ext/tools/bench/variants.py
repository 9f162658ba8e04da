"""The transports under comparison, each as the same four half-steps on both roles.

Every variant moves one layer exchange's wire tensors for one :class:`Case`
between this process and its peers (the :class:`Link` list of this rank):

======================  ==========================================================
``ours_per_tensor``     this package: attention ``split_back`` of hidden, logits,
                        ids, then ``fan_in`` of the reply (the connector's calls);
                        FFN ``fan_in`` then ``split_back``. Three messages per
                        edge in one group.
``reference``           the reference connector's call pattern over the same NCCL
                        (our ``send``/``recv`` ops): one call per tensor per peer,
                        peers received one after another, fresh receive tensors
                        when not in graph mode (preallocated hidden/ids buffers
                        and fresh logits in graph mode), ``torch.cat`` of the
                        peers' tensors when several, row-slice sends back, the
                        reply received into the sent hidden tensor.
``raw``                 one flat uint8 message of the same (unpadded) bytes per
                        edge and direction: the floor NCCL can reach.
``peer``                the peer-memory plane (``docs/peer-memory.md``): attention
                        ``peer_put`` of hidden, logits and ids straight into the
                        FFN rank's fan-in region, then ``peer_wait`` copying the
                        reply into its tensor (one kernel each); FFN ``peer_wait``
                        (the fan-in is a view of its region) and ``peer_put`` of
                        the reply. CUDA IPC between the processes; GPUs only.
``connector``,          the connector's four data calls (``send_attn_output``,
``connector_peer``      ``recv_ffn_output``; ``recv_attn_output``, ``send_ffn_output``),
                        eager, over the run's transport (NCCL on GPUs, gloo on CPU)
                        or the peer-memory plane: the path vLLM's eager steps take.
                        Steps of :data:`CONNECTOR_LAYERS` exchanges, strict mode off;
                        a step's control-plane calls fall in its first iteration.
``ours_fp8``,           ``ours_per_tensor`` / ``peer`` with FP8 hidden states on the
``peer_fp8``            wire (docs/fp8.md): quantized in the send path (NCCL: one
                        kernel into the send buffers; peer: in the put), the FFN
                        rank's fan-in dequantized to bf16; the reply stays bf16;
                        scales as ``--fp8-scale-format`` (fp32 or ue8m0). Not in the
                        default list (``--variants``); ``--check`` compares values and
                        scales with the CPU rule (``afd_ext.fp8``) of the pattern.
======================  ==========================================================

On the CPU/gloo path ``ours_*`` use this package's gloo transport (always built
there), ``reference``/``raw`` use ``torch.distributed``.

Check mode (``--check``): the attention rank fills its wire tensors with a
per-rank byte pattern, the FFN rank snapshots what it received (verified
bit-exactly against the pattern of each peer's rows) and replies with the
received hidden-state bytes XOR ``0x55``; the attention rank verifies the
reply bit-exactly (FP8 variants: the CPU rule's bytes of the pattern, :meth:`Variant.as_received`, and
the reply of its bf16 form). :func:`pattern_bytes` is the shared pattern.

Host time per data call: ``connector``, ``connector_peer`` and the op variants
they are compared with (``ours_per_tensor``, ``peer``) record each call's host
µs under the connector's call names while the runner collects them
(:attr:`Variant.call_us`); on a blocking transport (gloo) a receive's time
includes the wait for the peer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partialmethod
from typing import Any, Callable

import torch
import torch.distributed as dist

from afd_ext import ops
from afd_ext.fp8 import GROUP as FP8_GROUP
from afd_ext.tools.bench.plan import Case
from afd_ext.topology import ATTENTION

#: The check-mode FFN replies with every received hidden byte XOR this.
XOR_BYTE = 0x55
#: Layer exchanges per step of the connector variants: one iteration in this many also runs the step's
#: control-plane calls (outside the per-call times; inside the round trip, where the median leaves it out).
CONNECTOR_LAYERS = 64


@dataclass
class Link:
    """One edge seen from this rank, for one case.

    Attributes:
        peer: the peer's role rank.
        peer_world: the peer's AFD world rank (torch.distributed rank).
        start: first row of the attention rank's rows that travel on this edge.
        count: rows on this edge.
        offset: row offset of these rows in this rank's tensors (attention:
            ``start``; FFN: position in the concatenated fan-in tensor).
        dst: row offset of these rows in the peer's tensors (the peer's ``offset``).
        comm: ``{"a2f": handle, "f2a": handle}``, our NCCL communicators (empty on the CPU path).
        nccl_peer: the peer's rank inside those 2-rank communicators.
    """

    peer: int
    peer_world: int
    start: int
    count: int
    offset: int
    dst: int
    comm: dict[str, int] = field(default_factory=dict)
    nccl_peer: int = 0


# ---------------------------------------------------------------------------
# Byte patterns and views (check mode)
# ---------------------------------------------------------------------------


def rows_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, first dim = rows) as a uint8 ``[rows, bytes_per_row]`` view."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


def pattern_bytes(rows: int, cols: int, seed: int, salt: int, device: torch.device) -> torch.Tensor:
    """Deterministic pseudo-random uint8 ``[rows, cols]`` pattern on ``device``.

    Both roles compute the same bytes from ``(seed, salt)``: the FFN rank
    regenerates an attention rank's pattern to verify what it received.
    """
    # int64 arithmetic that never overflows (rows * cols < 2**31), so CPU and CUDA agree.
    x = torch.arange(rows * cols, device=device, dtype=torch.int64)
    x = (x * 1103515245 + ((seed * 7919 + salt * 104729 + 12345) & 0x7FFFFFFF)) & 0x7FFFFFFF
    x = x ^ (x >> 13)
    x = (x * 40503) & 0xFFFFFFFF
    return ((x >> 11) & 255).to(torch.uint8).reshape(rows, cols)


class Variant:
    """Base class: buffers for one case, the four half-steps, check hooks.

    ``ctx`` is the runner's per-process context (role, device, ``links`` of the case, ``backend``, ``store``,
    ``topo``, ``graph_mode``, ...). Subclasses allocate in ``__init__`` and implement ``attn_send`` and
    ``attn_recv`` (or override ``attn_round``), ``ffn_recv`` and ``ffn_send``. The check reads
    ``inputs`` (attention: the wire tensors it fills), ``reply`` (attention: where the reply lands),
    ``received`` (FFN: what arrived) and ``out`` (FFN: the reply it sends); in a checked FFN round
    trip, ``snap`` keeps clones of what was received.
    """

    name = "base"
    graph_ok = True
    backends = ("nccl", "gloo")

    @classmethod
    def skip_reason(cls, case: Case, backend: str) -> str | None:
        """``None`` when this variant applies to ``case`` on ``backend``, else why it is skipped."""
        return None if backend in cls.backends else f"{cls.name} runs on {'/'.join(cls.backends)} only"

    def __init__(self, ctx: Any, case: Case):
        self.ctx, self.case, self.dev = ctx, case, ctx.device
        self.check = False
        self.live = [l for l in ctx.links if l.count > 0]
        # The ops' (comms, peers, rows) per direction.
        self.args = {d: ([l.comm.get(d, 0) for l in self.live], [l.nccl_peer for l in self.live],
                         [l.count for l in self.live]) for d in ("a2f", "f2a")}
        self.snap: list[torch.Tensor] | None = None
        #: ``{call name: [host µs]}`` while the runner collects per-call host times, else None.
        self.call_us: dict[str, list[float]] | None = None

    def _wire(self, rows: int) -> None:
        """The attention rank's wire tensors: ``h`` [rows, H] bf16, ``l`` [rows, E] fp32 and ``i`` [rows] int32
        (None without extras); ``inputs`` the present ones."""
        c = self.case
        self.h = self._bf16(rows)
        self.l = torch.zeros(rows, c.logits_width, dtype=torch.float32, device=self.dev) if c.extras else None
        self.i = torch.zeros(rows, dtype=torch.int32, device=self.dev) if c.extras else None
        self.inputs = [t for t in (self.h, self.l, self.i) if t is not None]

    def _bf16(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.case.hidden, dtype=torch.bfloat16, device=self.dev)

    def _p2p(self, send: bool, t: torch.Tensor, link: Link, direction: str) -> None:
        """One message on one edge: our ``send``/``recv`` op (NCCL) or ``torch.distributed``'s (gloo)."""
        if self.ctx.backend == "nccl":
            (ops.send if send else ops.recv)(t, link.comm[direction], link.nccl_peer)
        elif send:
            dist.send(t, dst=link.peer_world)
        else:
            dist.recv(t, src=link.peer_world)

    def _timed(self, call: str, fn: Callable, *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, its host µs recorded under ``call`` while the runner collects."""
        t0 = time.perf_counter_ns()
        out = fn(*args, **kw)
        if self.call_us is not None:
            self.call_us[call].append((time.perf_counter_ns() - t0) / 1e3)
        return out

    def a2f_row_bytes(self) -> int:
        """Bytes per token attention -> FFN on this variant's wire."""
        return self.case.a2f_row_bytes() - 2 * self.case.hidden + self.hidden_bytes_per_token()

    def hidden_bytes_per_token(self) -> int:
        """Hidden-state bytes per token attention -> FFN (bf16: 2 H)."""
        return 2 * self.case.hidden

    def attn_round(self) -> None:
        self.attn_send()
        self.attn_recv()

    def close(self) -> None:
        """Release anything beyond tensors (nothing by default)."""

    # -- check hooks -----------------------------------------------------------

    def input_cols(self) -> list[int]:
        """Bytes per row of each attention input, in ``inputs`` order."""
        c = self.case
        return [c.f2a_row_bytes(), 4 * c.logits_width, 4] if c.extras else [c.f2a_row_bytes()]

    def as_received(self, pats: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the FFN rank receives (uint8 rows per part) for attention inputs of bytes ``pats``."""
        return pats

    def delivered(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states the FFN rank replies with (XOR-ed) for attention hidden states ``h``."""
        return h

    def _check_hook(self) -> None:
        rec = self.received
        self.snap = [t.clone() for t in rec]
        torch.bitwise_xor(rows_bytes(rec[0])[:, :self.case.f2a_row_bytes()], XOR_BYTE, out=rows_bytes(self.out))

    def step(self) -> Callable[[], None]:
        """One round trip on this rank: attention sends and receives the reply; FFN receives and replies."""
        if self.ctx.role == ATTENTION:
            return self.attn_round
        chk = self.check

        def rt() -> None:
            self.ffn_recv()
            if chk:
                self._check_hook()
            self.ffn_send()
        return rt


# ---------------------------------------------------------------------------
# This package
# ---------------------------------------------------------------------------


class OursPerTensor(Variant):
    """This package's ops, one message per tensor per edge, all in one NCCL group.

    On the CPU path the same calls go through this package's gloo transport
    (``split_back`` / ``fan_in``; its ``PendingSend`` is waited before the
    buffers are reused).
    """

    name = "ours_per_tensor"

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        self._wire(ctx.rows)
        # Attention -> FFN: the wire parts in wire order (afd_ext.wire), for the ops and the gloo transport.
        self.wire = self.received = list(self.inputs)
        self.out = self.h
        if ctx.role == ATTENTION:
            self.reply = self._bf16(ctx.rows)
        self.tr = ctx.gloo_transport
        if self.tr is not None:
            from afd_ext.transport.base import MessageTag

            self.tags = {d: MessageTag("bench", d, 0, 0, 0) for d in ("a2f", "f2a")}
            self.peer_ids = [l.peer for l in self.live]

    def _send(self, tensors: list[torch.Tensor], d: str, wait: bool = False) -> Any:
        if self.tr is None:
            return ops.split_back(tensors, *self.args[d])
        pending = self.tr.split_back(tensors, self.peer_ids, self.args[d][2], tag=self.tags[d])
        return pending.wait() if wait else pending

    def _recv(self, tensors: list[torch.Tensor], d: str, pending: Any = None) -> None:
        if self.tr is None:
            return ops.fan_in(tensors, *self.args[d])
        self.tr.fan_in(tensors, self.peer_ids, self.args[d][2], tag=self.tags[d])
        if pending is not None:
            pending.wait()

    # Each call is timed under the connector call it stands for (gloo: the transport's calls the connector makes,
    # with the wait for the send that the connector's receive of the reply includes).
    def attn_round(self) -> None:
        pending = self._timed("send_attn_output", self._send, self.wire, "a2f")
        self._timed("recv_ffn_output", self._recv, [self.reply], "f2a", pending)

    def ffn_recv(self) -> None:
        self._timed("recv_attn_output", self._recv, self.wire, "a2f")

    def ffn_send(self) -> None:
        self._timed("send_ffn_output", self._send, [self.h], "f2a", True)


class _Fp8Wire:
    """FP8 hidden states on the wire: the byte accounting, random inputs (zeros would all take the zero-scale path),
    the check's expected bytes (the CPU rule of afd_ext.fp8)."""

    @property
    def ue8m0(self) -> bool:
        return self.ctx.fp8_scale_format == "ue8m0"

    def as_received(self, pats):
        from afd_ext import fp8

        h = pats[0].cpu().contiguous().view(torch.bfloat16)
        return [rows_bytes(t).to(pats[0].device) for t in fp8.quantize(h, ue8m0=self.ue8m0)] + pats[1:]

    def delivered(self, h):
        from afd_ext import fp8

        v, s = (t.to(h.device) for t in fp8.quantize(h.cpu(), ue8m0=self.ue8m0))
        out = torch.empty_like(h)
        ops.fp8_dequantize(v, s, out)  # the device's kernel: a NaN's bits are its own (docs/fp8.md)
        return out

    def _check_hook(self) -> None:
        self.snap = [t.clone() for t in self.received]  # values, scales, then the other parts
        out = rows_bytes(self.out)  # the dequantized hidden states
        torch.bitwise_xor(out, XOR_BYTE, out=out)

    @classmethod
    def skip_reason(cls, case: Case, backend: str) -> str | None:
        why = super().skip_reason(case, backend)  # type: ignore[misc]
        if why is None and case.hidden % FP8_GROUP:
            why = (f"{cls.name} needs a hidden size that is a multiple of {FP8_GROUP} "
                   f"(one FP8 scale per {FP8_GROUP} channels)")
        return why

    def hidden_bytes_per_token(self) -> int:
        from afd_ext.fp8 import wire_bytes_per_token

        return wire_bytes_per_token(self.case.hidden)

    def _fill(self) -> None:
        self.h.copy_(torch.randn(self.h.shape, generator=torch.Generator().manual_seed(1)).to(self.h.dtype))


class OursFp8(_Fp8Wire, OursPerTensor):
    """``ours_per_tensor`` with FP8 hidden states: quantize kernel into the send buffers, scales right after
    the values in the one group, the FFN's fan-in dequantized by one kernel (the NCCL transport's calls)."""

    name = "ours_fp8"

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        n = ctx.rows
        self._fill()
        self.v = torch.zeros(n, case.hidden, dtype=torch.float8_e4m3fn, device=self.dev)
        self.s = torch.zeros(n, case.hidden // FP8_GROUP, dtype=torch.float32, device=self.dev)
        self.wire[:1] = [self.v, self.s]  # values then their scales (wire order); ``received`` is this list

    def attn_round(self) -> None:
        ops.fp8_quantize(self.h, self.v, self.s, self.ue8m0)
        super().attn_round()

    def ffn_recv(self) -> None:
        super().ffn_recv()
        ops.fp8_dequantize(self.v, self.s, self.h)


class ConnectorCalls(Variant):
    """The connector's four data calls, eager (the path vLLM's eager steps take), beside the ops they issue.

    Each rank builds an :class:`~afd_ext.connector.AFDConnector` of the run's topology (strict mode off,
    its own rendezvous on a port FFN rank 0 picks) and walks steps of :data:`CONNECTOR_LAYERS` exchanges
    of stage 0: the attention rank applies and sends the step's payload before the first exchange, the
    FFN rank receives and applies it. :meth:`close` finishes the step untimed, so no rank aborts.
    """

    name = "connector"
    graph_ok = False
    transport: str | None = None  # None: the run's backend (nccl or gloo)
    _setups = 0  # one fresh port key per construction (every rank builds the same sequence)

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        from afd_ext.config import AFDConfig
        from afd_ext.connector import AFDConnector
        from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata
        from afd_ext.tools.testing import find_free_port

        ConnectorCalls._setups += 1
        key = f"afd-bench/connector-port/{ConnectorCalls._setups}"
        if ctx.rank == 0:  # world rank 0 (FFN rank 0) hosts the connector's store
            ctx.store.set(key, str(find_free_port()))
        topo, n, wait_s = ctx.topo, ctx.rows, ctx.cfg.peer_wait_s
        cfg = AFDConfig(role=ctx.role, host="127.0.0.1", port=int(ctx.store.get(key)),
                        num_attention_ranks=topo.num_attention_ranks, num_ffn_ranks=topo.num_ffn_ranks,
                        connector_extra_config={"transport": self.transport or ctx.backend, "strict": False,
                                                "step_timeout_s": wait_s, "init_timeout_s": wait_s})
        self.conn = AFDConnector(ctx.rank, ctx.device.index or 0, cfg, ctx.role_rank, hidden_size=case.hidden,
                                 num_layers=CONNECTOR_LAYERS, dtype=torch.bfloat16,
                                 router_logits_width=case.logits_width if case.extras else None,
                                 send_token_ids=case.extras, device=ctx.device)
        self.conn.init_afd_connector()
        self.payload = AFDControlPayload(dp_metadata_list={0: [case.tokens] * topo.num_attention_ranks})
        self.layer = 0
        if ctx.role == ATTENTION:
            self._wire(n)
            self.reply = self._bf16(n)
            self.contexts = [AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                layer_idx=k, stage_idx=0, seq_len=n)) for k in range(CONNECTOR_LAYERS)]
        else:
            self.out = self._bf16(n)

    @property
    def received(self) -> list[torch.Tensor]:
        g = self.got
        return [t for t in (g.hidden_states, g.router_logits, g.input_ids) if t is not None]

    def attn_round(self) -> None:
        c = self.conn
        if self.layer == 0:
            c.control_plane.update_state_from_dp_metadata(self.payload)
            c.control_plane.send_dp_metadata_list(self.payload)
        self._timed("send_attn_output", c.send_attn_output, self.h, self.contexts[self.layer], self.l, self.i)
        self._timed("recv_ffn_output", c.recv_ffn_output, self.reply, 0)
        self.layer = (self.layer + 1) % CONNECTOR_LAYERS

    def ffn_recv(self) -> None:
        c = self.conn
        if self.layer == 0:
            c.control_plane.update_state_from_dp_metadata(c.control_plane.recv_dp_metadata_list())
        self.got = self._timed("recv_attn_output", c.recv_attn_output, 0)

    def ffn_send(self) -> None:
        self._timed("send_ffn_output", self.conn.send_ffn_output, self.out, self.got.context)
        self.layer = (self.layer + 1) % CONNECTOR_LAYERS

    def close(self) -> None:
        self.check, self.call_us = False, None
        step = self.step()
        while self.layer:  # both roles stand at the same layer: finish the step together (an incomplete one aborts)
            step()
        self.conn.close()


class ConnectorPeer(ConnectorCalls):
    """``connector`` over the peer-memory plane (``transport: "peer"``), beside ``peer``; GPUs only."""

    name = "connector_peer"
    backends = ("nccl",)
    transport = "peer"


class PeerMemory(Variant):
    """The peer-memory plane: rows stored straight into the peer's memory, then a flag (no NCCL)."""

    name = "peer"
    backends = ("nccl",)
    fp8 = False
    _setups = 0  # one fresh store key space per construction (every rank builds the same sequence)

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        from afd_ext.schedule import ScheduleConfig
        from afd_ext.transport.peer.plane import WireSpec, open_plane

        PeerMemory._setups += 1
        spec = WireSpec.of(ScheduleConfig(1, case.hidden, torch.bfloat16, case.logits_width if case.extras else None,
                                          send_token_ids=case.extras, hidden_wire="fp8_e4m3" if self.fp8 else None,
                                          fp8_scale_format=ctx.fp8_scale_format))
        self.plane = open_plane(dist.PrefixStore(f"peer/{case.key()}/{PeerMemory._setups}/", ctx.store), ctx.topo,
                                ctx.role, ctx.role_rank, spec, max_tokens=case.tokens, num_stages=1,
                                device=ctx.device, timeout_s=ctx.cfg.peer_wait_s,
                                setup_timeout_s=ctx.cfg.peer_wait_s, generation=1)
        n = ctx.rows
        # Every topology peer, in the plane's peer order: rows, and where they land in the peer's tensors.
        self.rows, self.dst = [l.count for l in ctx.links], [l.dst for l in ctx.links]
        if ctx.role == ATTENTION:
            self._wire(n)
            self.reply = self._bf16(n)
        else:
            self.received = list(self.plane.views(0, n))
            self.out = self._bf16(n)

    def attn_send(self) -> None:
        self._timed("send_attn_output", self.plane.put, 0, self.inputs, self.rows, self.dst)

    def attn_recv(self) -> None:
        self._timed("recv_ffn_output", self.plane.wait, 0, self.ctx.rows, layer=0, out=self.reply)

    def ffn_recv(self) -> None:
        self._timed("recv_attn_output", self.plane.wait, 0, self.ctx.rows, layer=0,
                    out=self.out if self.fp8 else None)

    def ffn_send(self) -> None:
        self._timed("send_ffn_output", self.plane.put, 0, [self.out], self.rows, self.dst)

    def close(self) -> None:
        self.plane.close()


class PeerFp8(_Fp8Wire, PeerMemory):
    """``peer`` with FP8 hidden states: quantized inside the put, dequantized inside the FFN rank's wait."""

    name = "peer_fp8"
    fp8 = True

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        if ctx.role == ATTENTION:
            self._fill()


# ---------------------------------------------------------------------------
# The reference connector's call pattern
# ---------------------------------------------------------------------------


class Reference(Variant):
    """The reference P2P connector's call pattern over the same NCCL (our send/recv ops)."""

    name = "reference"

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        c = case
        if ctx.role == ATTENTION:
            self._wire(ctx.rows)
            self.reply = self.h  # the reference receives the FFN output into ref_tensor, the sent hidden states
            return
        # Per part: (cols, dtype, per-peer buffers preallocated outside capture for graph mode: hidden and ids;
        # the logits stay freshly allocated, as the reference's).
        self.parts = [((c.hidden,), torch.bfloat16, True)]
        if c.extras:
            self.parts += [((c.logits_width,), torch.float32, False), ((), torch.int32, True)]
        self.pre = [[torch.zeros(l.count, *cols, dtype=dt, device=self.dev) for l in self.live] if keep else None
                    for cols, dt, keep in self.parts]

    def attn_send(self) -> None:
        for l in self.live:
            for t in self.inputs:
                self._p2p(True, t[l.offset:l.offset + l.count], l, "a2f")

    def attn_recv(self) -> None:
        for l in self.live:
            self._p2p(False, self.h[l.offset:l.offset + l.count], l, "f2a")

    def ffn_recv(self) -> None:
        got: list[list[torch.Tensor]] = [[] for _ in self.parts]
        for k, l in enumerate(self.live):  # peers one after another, no group; fresh tensors unless in a graph
            for ts, pre, (cols, dt, _) in zip(got, self.pre, self.parts):
                t = pre[k] if pre and self.ctx.graph_mode else torch.empty(l.count, *cols, dtype=dt, device=self.dev)
                self._p2p(False, t, l, "a2f")
                ts.append(t)
        # No peer with rows (an FFN rank of A < F at few tokens): empty tensors.
        self.received = [torch.cat(ts, 0) if len(ts) > 1 else ts[0] if ts else
                         torch.zeros(0, *cols, dtype=dt, device=self.dev) for ts, (cols, dt, _) in zip(got, self.parts)]
        self.out = self.received[0]

    def ffn_send(self) -> None:
        one = len(self.live) == 1
        for l in self.live:
            self._p2p(True, self.out if one else self.out[l.offset:l.offset + l.count], l, "f2a")


# ---------------------------------------------------------------------------
# The floor: one raw message of the same bytes
# ---------------------------------------------------------------------------


class Raw(Variant):
    """One flat uint8 message per edge and direction, of the unpadded wire bytes."""

    name = "raw"

    def __init__(self, ctx: Any, case: Case):
        super().__init__(ctx, case)
        n = ctx.rows
        self.buf = {"a2f": torch.zeros(n, case.a2f_row_bytes(), dtype=torch.uint8, device=self.dev),
                    "f2a": torch.zeros(n, case.f2a_row_bytes(), dtype=torch.uint8, device=self.dev)}
        self.inputs = self.received = [self.buf["a2f"]]
        self.reply = self.out = self.buf["f2a"]
        # Several peers on NCCL: one group (fan_in/split_back on the flat bytes),
        # so the floor keeps every peer in flight at once.
        self.grouped = ctx.backend == "nccl" and len(self.live) > 1

    def _move(self, send: bool, d: str) -> None:
        buf = self.buf[d]
        if self.grouped:
            (ops.split_back if send else ops.fan_in)([buf], *self.args[d])
            return
        for l in self.live:
            self._p2p(send, buf[l.offset:l.offset + l.count], l, d)

    attn_send = partialmethod(_move, True, "a2f")
    attn_recv = partialmethod(_move, False, "f2a")
    ffn_recv = partialmethod(_move, False, "a2f")
    ffn_send = partialmethod(_move, True, "f2a")

    def input_cols(self) -> list[int]:
        return [self.case.a2f_row_bytes()]


VARIANTS: dict[str, type[Variant]] = {v.name: v for v in (OursPerTensor, Reference, Raw, PeerMemory, OursFp8, PeerFp8,
                                                          ConnectorCalls, ConnectorPeer)}
