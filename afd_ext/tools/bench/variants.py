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
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from afd_ext.tools.bench.plan import Case
from afd_ext.fp8 import GROUP as FP8_GROUP
from afd_ext.topology import ATTENTION, FFN

__all__ = [
    "XOR_BYTE",
    "Link",
    "Ctx",
    "Variant",
    "VARIANTS",
    "CONNECTOR_LAYERS",
    "pattern_bytes",
    "rows_bytes",
]

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
        comm_a2f, comm_f2a: our NCCL communicator handles (0 on the CPU path).
        nccl_peer: the peer's rank inside those 2-rank communicators.
    """

    peer: int
    peer_world: int
    start: int
    count: int
    offset: int
    comm_a2f: int = 0
    comm_f2a: int = 0
    nccl_peer: int = 0

    def comm(self, direction: str) -> int:
        return self.comm_a2f if direction == "a2f" else self.comm_f2a


@dataclass
class Ctx:
    """This process's side of the benchmark for one case.

    Attributes:
        role: ``"attention"`` or ``"ffn"``.
        role_rank: this process's role rank.
        backend: ``"nccl"`` (CUDA tensors, our ops) or ``"gloo"`` (CPU tensors).
        device: where tensors live.
        links: edges of this rank, in fan-in order (FFN) or peer order (attention).
        gloo_transport: this package's gloo transport on the CPU path, None on the NCCL path.
        store, topology, timeout_s: the runner's TCPStore, topology and peer deadline (the peer plane's set-up).
        graph_mode: set by the runner while a variant is captured/replayed
            (the reference pattern then uses its preallocated receive buffers).
    """

    role: str
    role_rank: int
    backend: str
    device: torch.device
    links: list[Link]
    gloo_transport: Any
    store: Any
    topology: Any
    timeout_s: float
    graph_mode: bool = False
    fp8_scale_format: str = "fp32"

    @property
    def rows(self) -> int:
        """Rows of this rank's tensors: the attention rank's tokens, or the FFN rank's fan-in total."""
        if self.role == ATTENTION:
            return max((l.offset + l.count for l in self.links), default=0)
        return sum(l.count for l in self.links)

    @property
    def is_attention(self) -> bool:
        return self.role == ATTENTION


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


# ---------------------------------------------------------------------------
# Transport primitives shared by the variants
# ---------------------------------------------------------------------------


def _ops():
    from afd_ext import ops

    return ops


def p2p_send(ctx: Ctx, t: torch.Tensor, link: Link, direction: str) -> None:
    """One message on one edge: our ``send`` op (NCCL) or ``torch.distributed.send`` (gloo)."""
    if ctx.backend == "nccl":
        _ops().send(t, link.comm(direction), link.nccl_peer)
    else:
        import torch.distributed as dist

        dist.send(t, dst=link.peer_world)


def p2p_recv(ctx: Ctx, t: torch.Tensor, link: Link, direction: str) -> None:
    """Receive one message on one edge (see :func:`p2p_send`)."""
    if ctx.backend == "nccl":
        _ops().recv(t, link.comm(direction), link.nccl_peer)
    else:
        import torch.distributed as dist

        dist.recv(t, src=link.peer_world)


class Variant:
    """Base class: buffers for one case, the four half-steps, check hooks.

    Subclasses allocate in ``__init__`` and implement ``attn_send`` and
    ``attn_recv`` (or override ``attn_round``), ``ffn_recv`` and ``ffn_send``;
    the check accessors ``attn_inputs``, ``attn_reply``, ``ffn_received``,
    ``ffn_out`` default to ``(h, l, i)`` wire tensors and an attention ``reply``.
    In a checked FFN round trip, ``snap`` keeps clones of what was received.
    """

    name = "base"
    graph_ok = True
    checkable = True
    backends = ("nccl", "gloo")

    @classmethod
    def skip_reason(cls, case: Case, backend: str) -> str | None:
        """``None`` when this variant applies to ``case`` on ``backend``, else why it is skipped."""
        return None if backend in cls.backends else f"{cls.name} runs on {'/'.join(cls.backends)} only"

    def __init__(self, ctx: Ctx, case: Case):
        self.ctx = ctx
        self.case = case
        self.check = False
        self.dev = ctx.device
        self.live = [l for l in ctx.links if l.count > 0]
        self.snap: list[torch.Tensor] | None = None
        #: ``{call name: [host µs]}`` while the runner collects per-call host times, else None.
        self.call_us: defaultdict[str, list[float]] | None = None

    # -- helpers ---------------------------------------------------------------

    def _wire(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        c = self.case
        h = torch.zeros(rows, c.hidden, dtype=torch.bfloat16, device=self.dev)
        l = torch.zeros(rows, c.logits_width, dtype=torch.float32, device=self.dev) if c.extras else None
        i = torch.zeros(rows, dtype=torch.int32, device=self.dev) if c.extras else None
        return h, l, i

    def a2f_row_bytes(self) -> int:
        """Bytes per token attention -> FFN on this variant's wire."""
        return self.case.a2f_row_bytes()

    def hidden_bytes_per_token(self) -> int:
        """Hidden-state bytes per token attention -> FFN (bf16: 2 H)."""
        return 2 * self.case.hidden

    def _lists(self, direction: str) -> tuple[list[int], list[int], list[int]]:
        comms = [l.comm(direction) for l in self.live]
        return comms, [l.nccl_peer for l in self.live], [l.count for l in self.live]

    def attn_round(self) -> None:
        self.attn_send()
        self.attn_recv()

    def _took(self, call: str, t0: int) -> int:
        """Record ``call``'s host µs since ``t0`` (``perf_counter_ns``) while the runner collects; returns now."""
        t1 = time.perf_counter_ns()
        if self.call_us is not None:
            self.call_us[call].append((t1 - t0) / 1e3)
        return t1

    def close(self) -> None:
        """Release anything beyond tensors (nothing by default)."""

    # -- check hooks -----------------------------------------------------------

    def attn_inputs(self) -> list[torch.Tensor]:
        return [t for t in (self.h, self.l, self.i) if t is not None]

    def attn_reply(self) -> torch.Tensor:
        return self.reply

    def ffn_received(self) -> list[torch.Tensor]:
        return self.attn_inputs()

    def ffn_out(self) -> torch.Tensor:
        return self.h

    def input_cols(self) -> list[int]:
        """Bytes per row of each attention input, in :meth:`attn_inputs` order."""
        c = self.case
        cols = [c.f2a_row_bytes()]
        if c.extras:
            cols += [4 * c.logits_width, 4]
        return cols

    def as_received(self, pats: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the FFN rank receives (uint8 rows per part) for attention inputs of bytes ``pats``."""
        return pats

    def delivered(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states the FFN rank replies with (XOR-ed) for attention hidden states ``h``."""
        return h

    def _check_hook(self) -> None:
        rec = self.ffn_received()
        self.snap = [t.clone() for t in rec]
        torch.bitwise_xor(rows_bytes(rec[0])[:, :self.case.f2a_row_bytes()], XOR_BYTE, out=rows_bytes(self.ffn_out()))

    # -- steps -------------------------------------------------------------------

    def step(self) -> Callable[[], None]:
        """One round trip on this rank: attention sends and receives the reply; FFN receives and replies."""
        if self.ctx.is_attention:
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

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        n = ctx.rows
        self.h, self.l, self.i = self._wire(n)
        if ctx.is_attention:
            self.reply = torch.zeros(n, case.hidden, dtype=torch.bfloat16, device=self.dev)
        self.a2f = self._lists("a2f")
        self.f2a = self._lists("f2a")
        # Attention -> FFN: the wire parts in wire order (afd_ext.wire), for the ops and the gloo transport.
        self.wire = [t for t in (self.h, self.l, self.i) if t is not None]
        self.tr = ctx.gloo_transport
        if self.tr is not None:
            from afd_ext.transport.base import MessageTag

            self.tags = {d: MessageTag("bench", d, 0, 0, 0) for d in ("a2f", "f2a")}
            self.peer_ids = [l.peer for l in self.live]

    # Each call is timed under the connector call it stands for (gloo: the transport's calls the connector makes,
    # with the wait for the send that the connector's receive of the reply includes).
    def attn_round(self) -> None:
        t = time.perf_counter_ns()
        if self.tr is not None:
            pending = self.tr.split_back(self.wire, self.peer_ids, self.a2f[2], tag=self.tags["a2f"])
            t = self._took("send_attn_output", t)
            self.tr.fan_in([self.reply], self.peer_ids, self.a2f[2], tag=self.tags["f2a"])
            pending.wait()
            self._took("recv_ffn_output", t)
            return
        sc, peers, rows = self.a2f
        _ops().split_back(self.wire, sc, peers, rows)  # the connector's two calls
        t = self._took("send_attn_output", t)
        _ops().fan_in([self.reply], self.f2a[0], peers, rows)
        self._took("recv_ffn_output", t)

    def ffn_recv(self) -> None:
        t = time.perf_counter_ns()
        if self.tr is not None:
            self.tr.fan_in(self.wire, self.peer_ids, self.a2f[2], tag=self.tags["a2f"])
        else:
            _ops().fan_in(self.wire, *self.a2f)
        self._took("recv_attn_output", t)

    def ffn_send(self) -> None:
        t = time.perf_counter_ns()
        if self.tr is not None:
            self.tr.split_back([self.h], self.peer_ids, self.a2f[2], tag=self.tags["f2a"]).wait()
        else:
            _ops().split_back([self.h], *self.f2a)
        self._took("send_ffn_output", t)


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
        _ops().fp8_dequantize(v, s, out)  # the device's kernel: a NaN's bits are its own (docs/fp8.md)
        return out

    def _check_hook(self) -> None:
        self.snap = [t.clone() for t in self.ffn_received()]  # values, scales, then the other parts
        out = rows_bytes(self.ffn_out())  # the dequantized hidden states
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

    def a2f_row_bytes(self) -> int:
        return self.case.a2f_row_bytes() - 2 * self.case.hidden + self.hidden_bytes_per_token()

    def _fill(self) -> None:
        self.h.copy_(torch.randn(self.h.shape, generator=torch.Generator().manual_seed(1)).to(self.h.dtype))


class OursFp8(_Fp8Wire, OursPerTensor):
    """``ours_per_tensor`` with FP8 hidden states: quantize kernel into the send buffers, scales right after
    the values in the one group, the FFN's fan-in dequantized by one kernel (the NCCL transport's calls)."""

    name = "ours_fp8"

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        n = ctx.rows
        self._fill()
        self.v = torch.zeros(n, case.hidden, dtype=torch.float8_e4m3fn, device=self.dev)
        self.s = torch.zeros(n, case.hidden // FP8_GROUP, dtype=torch.float32, device=self.dev)
        self.wire = [self.v, self.s] + self.wire[1:]  # values then their scales (wire order)

    def attn_round(self) -> None:
        _ops().fp8_quantize(self.h, self.v, self.s, self.ue8m0)
        super().attn_round()

    def ffn_recv(self) -> None:
        super().ffn_recv()
        _ops().fp8_dequantize(self.v, self.s, self.h)

    def ffn_received(self):
        return self.wire


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

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        from afd_ext.config import AFDConfig
        from afd_ext.connector import AFDConnector
        from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata
        from afd_ext.tools.testing import find_free_port

        ConnectorCalls._setups += 1
        key = f"afd-bench/connector-port/{ConnectorCalls._setups}"
        if ctx.role == FFN and ctx.role_rank == 0:  # world rank 0 hosts the connector's store
            ctx.store.set(key, str(find_free_port()))
        topo, n = ctx.topology, ctx.rows
        cfg = AFDConfig(role=ctx.role, host="127.0.0.1", port=int(ctx.store.get(key)),
                        num_attention_ranks=topo.num_attention_ranks, num_ffn_ranks=topo.num_ffn_ranks,
                        connector_extra_config={"transport": self.transport or ctx.backend, "strict": False,
                                                "step_timeout_s": ctx.timeout_s, "init_timeout_s": ctx.timeout_s})
        self.conn = AFDConnector(topo.world_rank(ctx.role, ctx.role_rank), ctx.device.index or 0, cfg,
                                 ctx.role_rank, hidden_size=case.hidden, num_layers=CONNECTOR_LAYERS,
                                 dtype=torch.bfloat16, router_logits_width=case.logits_width if case.extras else None,
                                 send_token_ids=case.extras, device=ctx.device)
        self.conn.init_afd_connector()
        self.payload = AFDControlPayload(dp_metadata_list={0: [case.tokens] * topo.num_attention_ranks})
        self.layer = 0
        if ctx.is_attention:
            self.h, self.l, self.i = self._wire(n)
            self.reply = torch.zeros(n, case.hidden, dtype=torch.bfloat16, device=self.dev)
            self.contexts = [AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                layer_idx=k, stage_idx=0, seq_len=n)) for k in range(CONNECTOR_LAYERS)]
        else:
            self.out = torch.zeros(n, case.hidden, dtype=torch.bfloat16, device=self.dev)
            self.got = None

    def attn_round(self) -> None:
        c = self.conn
        if self.layer == 0:
            c.control_plane.update_state_from_dp_metadata(self.payload)
            c.control_plane.send_dp_metadata_list(self.payload)
        t = time.perf_counter_ns()
        c.send_attn_output(self.h, self.contexts[self.layer], self.l, self.i)
        t = self._took("send_attn_output", t)
        c.recv_ffn_output(self.reply, 0)
        self._took("recv_ffn_output", t)
        self.layer = (self.layer + 1) % CONNECTOR_LAYERS

    def ffn_recv(self) -> None:
        c = self.conn
        if self.layer == 0:
            c.control_plane.update_state_from_dp_metadata(c.control_plane.recv_dp_metadata_list())
        t = time.perf_counter_ns()
        self.got = c.recv_attn_output(0)
        self._took("recv_attn_output", t)

    def ffn_send(self) -> None:
        t = time.perf_counter_ns()
        self.conn.send_ffn_output(self.out, self.got.context)
        self._took("send_ffn_output", t)
        self.layer = (self.layer + 1) % CONNECTOR_LAYERS

    def close(self) -> None:
        self.check, self.call_us = False, None
        step = self.step()
        while self.layer:  # both roles stand at the same layer: finish the step together (an incomplete one aborts)
            step()
        self.conn.close()

    def ffn_received(self) -> list[torch.Tensor]:
        g = self.got
        return [t for t in (g.hidden_states, g.router_logits, g.input_ids) if t is not None]

    def ffn_out(self) -> torch.Tensor:
        return self.out


class ConnectorPeer(ConnectorCalls):
    """``connector`` over the peer-memory plane (``transport: "peer"``), beside ``peer``; GPUs only."""

    name = "connector_peer"
    backends = ("nccl",)
    transport = "peer"


# ---------------------------------------------------------------------------
# The reference connector's call pattern
# ---------------------------------------------------------------------------


class PeerMemory(Variant):
    """The peer-memory plane: rows stored straight into the peer's memory, then a flag (no NCCL)."""

    name = "peer"
    backends = ("nccl",)
    fp8 = False
    _setups = 0  # one fresh store key space per construction (every rank builds the same sequence)

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        import torch.distributed as dist

        from afd_ext.schedule import ScheduleConfig
        from afd_ext.transport.peer.plane import WireSpec, open_plane

        topo = ctx.topology
        PeerMemory._setups += 1
        spec = WireSpec.of(ScheduleConfig(1, case.hidden, torch.bfloat16, case.logits_width if case.extras else None,
                                          send_token_ids=case.extras, hidden_wire="fp8_e4m3" if self.fp8 else None,
                                          fp8_scale_format=ctx.fp8_scale_format))
        self.plane = open_plane(dist.PrefixStore(f"peer/{case.key()}/{PeerMemory._setups}/", ctx.store), topo,
                                ctx.role, ctx.role_rank, spec, max_tokens=case.tokens, num_stages=1,
                                device=ctx.device, timeout_s=ctx.timeout_s, setup_timeout_s=ctx.timeout_s,
                                generation=1)
        n = ctx.rows
        self.rows = [l.count for l in ctx.links]  # every topology peer, in the plane's peer order
        if ctx.is_attention:
            self.h, self.l, self.i = self._wire(n)
            self.reply = torch.zeros(n, case.hidden, dtype=torch.bfloat16, device=self.dev)
            me = ctx.role_rank
            self.dst = []  # this rank's offset in each FFN peer's fan-in
            for l in ctx.links:
                off = 0
                for a in topo.ffn_peers(l.peer):
                    if a == me:
                        break
                    off += next(c for f, _, c in topo.split_rows(a, case.tokens) if f == l.peer)
                self.dst.append(off)
        else:
            self.dst = [l.start for l in ctx.links]  # the start of this rank's share in each peer's rows
            self.rec = list(self.plane.views(0, n))
            self.out = torch.zeros(n, case.hidden, dtype=torch.bfloat16, device=self.dev)

    def attn_send(self) -> None:
        t = time.perf_counter_ns()
        self.plane.put(0, [t for t in (self.h, self.l, self.i) if t is not None], self.rows, self.dst)
        self._took("send_attn_output", t)

    def attn_recv(self) -> None:
        t = time.perf_counter_ns()
        self.plane.wait(0, self.ctx.rows, layer=0, out=self.reply)
        self._took("recv_ffn_output", t)

    def ffn_recv(self) -> None:
        t = time.perf_counter_ns()
        self.plane.wait(0, self.ctx.rows, layer=0, out=self.out if self.fp8 else None)
        self._took("recv_attn_output", t)

    def ffn_send(self) -> None:
        t = time.perf_counter_ns()
        self.plane.put(0, [self.out], self.rows, self.dst)
        self._took("send_ffn_output", t)

    def close(self) -> None:
        self.plane.close()

    def ffn_received(self):
        return self.rec

    def ffn_out(self):
        return self.out


class PeerFp8(_Fp8Wire, PeerMemory):
    """``peer`` with FP8 hidden states: quantized inside the put, dequantized inside the FFN rank's wait."""

    name = "peer_fp8"
    fp8 = True

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        if ctx.is_attention:
            self._fill()


class Reference(Variant):
    """The reference P2P connector's call pattern over the same NCCL (our send/recv ops)."""

    name = "reference"

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        n = ctx.rows
        c = case
        if ctx.is_attention:
            self.h, self.l, self.i = self._wire(n)
        else:
            # Graph mode: the reference preallocates per-peer hidden and id
            # buffers outside capture (logits stay freshly allocated).
            self.hp = [torch.zeros(l.count, c.hidden, dtype=torch.bfloat16, device=self.dev) for l in self.live]
            self.ip = [torch.zeros(l.count, dtype=torch.int32, device=self.dev) for l in self.live] if c.extras else None
            self.static_out = torch.zeros(n, c.hidden, dtype=torch.bfloat16, device=self.dev)
            self._rec: list[torch.Tensor] = []
            self._out = self.static_out

    def attn_send(self) -> None:
        ctx = self.ctx
        for l in self.live:
            s, e = l.offset, l.offset + l.count
            p2p_send(ctx, self.h[s:e], l, "a2f")
            if self.case.extras:
                p2p_send(ctx, self.l[s:e], l, "a2f")
                p2p_send(ctx, self.i[s:e], l, "a2f")

    def attn_recv(self) -> None:
        # The reference receives the FFN output into ref_tensor, the sent hidden states.
        for l in self.live:
            p2p_recv(self.ctx, self.h[l.offset:l.offset + l.count], l, "f2a")

    def ffn_recv(self) -> None:
        ctx, c = self.ctx, self.case
        if not self.live:  # an FFN rank with no rows this step (A < F, few tokens)
            self._rec = [self.static_out]
            if c.extras:
                self._rec += [torch.zeros(0, c.logits_width, dtype=torch.float32, device=self.dev),
                              torch.zeros(0, dtype=torch.int32, device=self.dev)]
            self._out = self.static_out
            return
        hs, ls, ids = [], [], []
        for k, l in enumerate(self.live):  # peers one after another, no group
            hb = self.hp[k] if ctx.graph_mode else torch.empty(l.count, c.hidden, dtype=torch.bfloat16,
                                                               device=self.dev)
            p2p_recv(ctx, hb, l, "a2f")
            hs.append(hb)
            if c.extras:
                lb = torch.empty(l.count, c.logits_width, dtype=torch.float32, device=self.dev)
                p2p_recv(ctx, lb, l, "a2f")
                ls.append(lb)
                ib = self.ip[k] if ctx.graph_mode else torch.empty(l.count, dtype=torch.int32, device=self.dev)
                p2p_recv(ctx, ib, l, "a2f")
                ids.append(ib)
        rec = [torch.cat(hs, 0) if len(hs) > 1 else hs[0]]
        if c.extras:
            rec.append(torch.cat(ls, 0) if len(ls) > 1 else ls[0])
            rec.append(torch.cat(ids, 0) if len(ids) > 1 else ids[0])
        self._rec = rec
        self._out = rec[0]

    def ffn_send(self) -> None:
        out = self._out
        if len(self.live) == 1:
            p2p_send(self.ctx, out, self.live[0], "f2a")
            return
        for l in self.live:
            p2p_send(self.ctx, out[l.offset:l.offset + l.count], l, "f2a")

    def attn_reply(self):
        return self.h

    def ffn_received(self):
        return self._rec

    def ffn_out(self):
        return self._out


# ---------------------------------------------------------------------------
# The floor: one raw message of the same bytes
# ---------------------------------------------------------------------------


class Raw(Variant):
    """One flat uint8 message per edge and direction, of the unpadded wire bytes."""

    name = "raw"

    def __init__(self, ctx: Ctx, case: Case):
        super().__init__(ctx, case)
        n = ctx.rows
        self.a2f_buf = torch.zeros(n, case.a2f_row_bytes(), dtype=torch.uint8, device=self.dev)
        self.f2a_buf = torch.zeros(n, case.f2a_row_bytes(), dtype=torch.uint8, device=self.dev)
        self.a2f = self._lists("a2f")
        self.f2a = self._lists("f2a")
        # Several peers on NCCL: one group (fan_in/split_back on the flat bytes),
        # so the floor keeps every peer in flight at once.
        self.grouped = ctx.backend == "nccl" and len(self.live) > 1

    def _send_rows(self, buf: torch.Tensor, direction: str) -> None:
        if self.grouped:
            _ops().split_back([buf], *(self.a2f if direction == "a2f" else self.f2a))
            return
        for l in self.live:
            p2p_send(self.ctx, buf[l.offset:l.offset + l.count], l, direction)

    def _recv_rows(self, buf: torch.Tensor, direction: str) -> None:
        if self.grouped:
            _ops().fan_in([buf], *(self.a2f if direction == "a2f" else self.f2a))
            return
        for l in self.live:
            p2p_recv(self.ctx, buf[l.offset:l.offset + l.count], l, direction)

    def attn_send(self) -> None:
        self._send_rows(self.a2f_buf, "a2f")

    def attn_recv(self) -> None:
        self._recv_rows(self.f2a_buf, "f2a")

    def ffn_recv(self) -> None:
        self._recv_rows(self.a2f_buf, "a2f")

    def ffn_send(self) -> None:
        self._send_rows(self.f2a_buf, "f2a")

    def attn_inputs(self):
        return [self.a2f_buf]

    def attn_reply(self):
        return self.f2a_buf

    def ffn_received(self):
        return [self.a2f_buf]

    def ffn_out(self):
        return self.f2a_buf

    def input_cols(self):
        return [self.case.a2f_row_bytes()]


VARIANTS: dict[str, type[Variant]] = {
    "ours_per_tensor": OursPerTensor,
    "reference": Reference,
    "raw": Raw,
    "peer": PeerMemory,
    "ours_fp8": OursFp8,
    "peer_fp8": PeerFp8,
    "connector": ConnectorCalls,
    "connector_peer": ConnectorPeer,
}
