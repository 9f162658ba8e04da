"""The transport contract: move consecutive row ranges of wire tensors over edges.

A transport is what differs between the CUDA/NCCL path and the CPU/gloo path;
everything else (validation, the schedule, offsets, fan-in order, split-back,
buffers, the control plane) lives once in :mod:`afd_ext.connector`.

Two calls carry all data traffic of a step:

* :meth:`Transport.split_back` sends consecutive row ranges of one or more
  tensors, ``rows[i]`` rows to ``peers[i]`` in order (the attention side
  sending its rows to its FFN peers, and the FFN side returning each
  attention peer its rows of the output).
* :meth:`Transport.fan_in` receives ``rows[i]`` rows from ``peers[i]`` into
  consecutive row ranges of caller-owned tensors (the FFN side receiving every
  peer's rows into one concatenated tensor, and the attention side receiving
  its reply into ``ref_tensor``).

Peers are role ranks of the *other* role; the transport maps them to world
ranks / communicators. Zero-row peers are skipped (both sides read the same
schedule, so both skip the same messages).

Strict mode puts a header on every message: one ``int64[K, HEADER_WORDS]``
block per (peer, exchange), row ``k`` describing data message ``k`` (which
tensor, dtype, rows, columns, layer, stage, sender, receiver). The receiver
receives and checks the header block before it posts the data receives, so a
mis-ordered or mis-sized message is a :class:`AFDProtocolError` naming both
sides instead of silent corruption or a hang.

Errors raised by transports (all carry ``op``, ``peer``, ``layer``, ``stage``
when known, and name them in the message):

* :class:`AFDTimeoutError` - an operation did not complete within the deadline
  (the peer is alive but not making the matching call, or is stuck).
* :class:`AFDPeerError` - the peer went away (connection closed, process died)
  or the communicator reported an asynchronous error.
* :class:`AFDProtocolError` - a strict-mode header did not match.
* :class:`AFDTransportClosedError` - the transport was closed or aborted.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

__all__ = [
    "HEADER_WORDS",
    "HEADER_MAGIC",
    "HEADER_VERSION",
    "TENSOR_HIDDEN",
    "TENSOR_LOGITS",
    "TENSOR_IDS",
    "TENSOR_PACKED",
    "TENSOR_NAMES",
    "DTYPE_CODES",
    "MessageTag",
    "AFDTransportError",
    "AFDTimeoutError",
    "AFDPeerError",
    "AFDProtocolError",
    "AFDTransportClosedError",
    "Transport",
    "PendingSend",
    "row_offsets",
    "message_tensors",
    "encode_headers",
    "check_headers",
    "dtype_code",
]

#: int64 words per header row.
HEADER_WORDS = 16
#: ``b"AFDH"`` as an int.
HEADER_MAGIC = 0x41464448
#: Bump when the header layout changes.
HEADER_VERSION = 1

TENSOR_HIDDEN = 0
TENSOR_LOGITS = 1
TENSOR_IDS = 2
TENSOR_PACKED = 3
TENSOR_NAMES = {
    TENSOR_HIDDEN: "hidden_states",
    TENSOR_LOGITS: "router_logits",
    TENSOR_IDS: "token_ids",
    TENSOR_PACKED: "packed wire rows",
}

#: Stable wire codes of the dtypes that may travel (headers, handshakes).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.float64: 7,
}
for _name, _code in (("float8_e4m3fn", 8), ("float8_e5m2", 9)):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_DIRECTION_CODES = {"a2f": 0, "f2a": 1}
_CODE_DIRECTIONS = {v: k for k, v in _DIRECTION_CODES.items()}

# Header word positions.
_W_MAGIC, _W_VERSION, _W_DIRECTION, _W_SENDER, _W_RECEIVER, _W_STEP, _W_LAYER, _W_STAGE = range(8)
_W_TENSOR, _W_DTYPE, _W_ROWS, _W_COLS, _W_INDEX, _W_COUNT, _W_LAYER_IDX, _W_RESERVED = range(8, 16)


def dtype_code(dtype: torch.dtype) -> int:
    """The header/handshake code of ``dtype``.

    Raises:
        ValueError: the dtype cannot travel.
    """
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the AFD wire; known: {list(DTYPE_CODES)}") from None


def _dtype_name(code: int) -> str:
    d = _CODE_DTYPES.get(int(code))
    return str(d).replace("torch.", "") if d is not None else f"<dtype code {int(code)}>"


class MessageTag(NamedTuple):
    """What an exchange is, for headers, watchdog descriptions and errors.

    Attributes:
        op: the connector call, e.g. ``"send_attn_output"``, ``"recv_ffn_output"``.
        direction: ``"a2f"`` (attention -> FFN wire tensors) or ``"f2a"`` (FFN output back).
        step: this rank's step number (diagnostics only; not checked).
        layer: the layer exchange ordinal in the step, ``0..num_layers-1``.
        stage: the stage id.
        layer_idx: the runtime's layer index from the transfer context (may
            differ from ``layer`` when only some layers are remote), or -1.
    """

    op: str
    direction: str
    step: int
    layer: int
    stage: int
    layer_idx: int = -1

    def where(self) -> str:
        """``"step 3, layer 2, stage 0"`` (plus the runtime layer index when it differs); ``"step 3"`` when no layer."""
        if self.layer < 0:
            return f"step {self.step}"
        s = f"step {self.step}, layer {self.layer}"
        if self.layer_idx >= 0 and self.layer_idx != self.layer:
            s += f" (runtime layer_idx {self.layer_idx})"
        return s + f", stage {self.stage}"


from ..errors import (  # noqa: E402,F401  defined once, in errors.py
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
    AFDTransportClosedError,
    AFDTransportError,
)


def row_offsets(rows: Sequence[int]) -> list[int]:
    """First row of each consecutive range: ``[0, rows[0], rows[0] + rows[1], ...]`` (len == len(rows))."""
    out, off = [], 0
    for r in rows:
        out.append(off)
        off += int(r)
    return out


def message_tensors(tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, torch.Tensor]]:
    """The data messages of one exchange: ``[(tensor id, tensor), ...]`` for the non-``None`` tensors.

    ``tensors`` is ``(hidden_states, router_logits|None, token_ids|None)``, or
    ``(packed_wire,)`` for the packed format (tensor id :data:`TENSOR_PACKED`).
    """
    if len(tensors) == 1:
        return [(TENSOR_PACKED, tensors[0])]
    return [(tid, t) for tid, t in zip((TENSOR_HIDDEN, TENSOR_LOGITS, TENSOR_IDS), tensors) if t is not None]


def _cols(t: torch.Tensor) -> int:
    return int(t.shape[1]) if t.dim() >= 2 else 1


def encode_headers(tag: MessageTag, sender: int, receiver: int, rows: int,
                   messages: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The header block of one (peer, exchange): CPU ``int64[len(messages), HEADER_WORDS]``.

    Args:
        tag: the exchange.
        sender: world rank of the sender; receiver: world rank of the receiver.
        rows: rows of every message to this peer.
        messages: ``[(tensor id, full tensor), ...]`` (dtype and columns are read from them).
    """
    # Rows as Python lists, one tensor at the end: element-wise tensor writes
    # cost ~90 us per call for three messages (strict mode runs this per peer
    # and exchange on both sides).
    out = []
    for k, (tid, t) in enumerate(messages):
        row = [0] * HEADER_WORDS
        row[_W_MAGIC] = HEADER_MAGIC
        row[_W_VERSION] = HEADER_VERSION
        row[_W_DIRECTION] = _DIRECTION_CODES[tag.direction]
        row[_W_SENDER] = sender
        row[_W_RECEIVER] = receiver
        row[_W_STEP] = tag.step
        row[_W_LAYER] = tag.layer
        row[_W_STAGE] = tag.stage
        row[_W_TENSOR] = tid
        row[_W_DTYPE] = dtype_code(t.dtype)
        row[_W_ROWS] = rows
        row[_W_COLS] = _cols(t)
        row[_W_INDEX] = k
        row[_W_COUNT] = len(messages)
        row[_W_LAYER_IDX] = tag.layer_idx
        out.append(row)
    return torch.tensor(out, dtype=torch.int64).reshape(len(messages), HEADER_WORDS)


def _describe_header(row: Sequence[int], label) -> str:
    tid = int(row[_W_TENSOR])
    return (
        f"{_CODE_DIRECTIONS.get(int(row[_W_DIRECTION]), '?')} {TENSOR_NAMES.get(tid, f'tensor {tid}')} "
        f"[{int(row[_W_ROWS])}, {int(row[_W_COLS])}] {_dtype_name(row[_W_DTYPE])}, "
        f"step {int(row[_W_STEP])}, layer {int(row[_W_LAYER])}, stage {int(row[_W_STAGE])}, "
        f"message {int(row[_W_INDEX])} of {int(row[_W_COUNT])}, from {label(int(row[_W_SENDER]))} "
        f"to {label(int(row[_W_RECEIVER]))}"
    )


#: Header words compared on receipt, with their names (every word but the step).
_CHECKED_WORDS = {
    _W_MAGIC: "magic", _W_VERSION: "header version", _W_DIRECTION: "direction", _W_SENDER: "sender",
    _W_RECEIVER: "receiver", _W_LAYER: "layer", _W_STAGE: "stage", _W_TENSOR: "tensor",
    _W_DTYPE: "dtype", _W_ROWS: "rows", _W_COLS: "columns", _W_INDEX: "message index",
    _W_COUNT: "message count",
}


def check_headers(received: torch.Tensor, expected: torch.Tensor, *, tag: MessageTag,
                  receiver_label: str, sender_label: str, label) -> None:
    """Compare a received header block with the one the receiver expects.

    Every word except the step number (diagnostic only) must match.

    Args:
        received, expected: CPU ``int64[K, HEADER_WORDS]``.
        tag: the receiver's view of the exchange.
        receiver_label, sender_label: names of the two sides.
        label: callable world rank -> name, for the decoded headers.

    Raises:
        AFDProtocolError: naming the first differing field, both sides, what
            the receiver expected and what the sender sent.
    """
    got = received.tolist()
    want = expected.tolist()
    for k in range(len(want)):
        g, w = got[k], want[k]
        for word, name in _CHECKED_WORDS.items():
            if g[word] != w[word]:
                if word == _W_MAGIC or word == _W_VERSION:
                    sent = f"a block that is not an afd_ext header (word {word} = {g[word]:#x})"
                else:
                    sent = _describe_header(g, label)
                raise AFDProtocolError(
                    f"AFD strict-mode header mismatch in {tag.op} at {tag.where()}: field {name!r} differs. "
                    f"Receiver {receiver_label} expected {_describe_header(w, label)}; sender {sender_label} "
                    f"sent {sent}. The two sides disagree on the step's schedule or call order (same "
                    "control payload, same layer/stage call sequence, same wire config on both roles?).",
                    op=tag.op, peer=sender_label, layer=tag.layer, stage=tag.stage,
                )


class PendingSend:
    """Sends of one exchange that may still be in flight.

    Keeps the sent tensors alive until :meth:`wait` returns (the gloo transport
    sends from the caller's memory asynchronously; on NCCL the stage stream
    orders reuse). ``wait`` is idempotent.
    """

    __slots__ = ("_waiter", "_keep", "done")

    def __init__(self, waiter=None, keep: Any = None):
        self._waiter = waiter
        self._keep = keep
        self.done = waiter is None

    def wait(self) -> None:
        """Block (with the transport's deadline and abort checks) until the sends completed."""
        if not self.done:
            waiter, self._waiter = self._waiter, None
            try:
                waiter()
            finally:
                self.done = True
                self._keep = None


@dataclass
class PeerMap:
    """How a transport names ranks: its role/role rank and the topology's sizes."""

    role: str
    role_rank: int
    num_attention_ranks: int
    num_ffn_ranks: int

    @property
    def world_rank(self) -> int:
        return self.role_rank if self.role == "ffn" else self.num_ffn_ranks + self.role_rank

    def peer_world_rank(self, peer: int) -> int:
        """World rank of ``peer`` (a role rank of the other role)."""
        return self.num_ffn_ranks + peer if self.role == "ffn" else peer

    def label(self, world_rank: int) -> str:
        F = self.num_ffn_ranks
        if world_rank < F:
            return f"FFN rank {world_rank} (world rank {world_rank})"
        return f"attention rank {world_rank - F} (world rank {world_rank})"

    @property
    def me(self) -> str:
        return self.label(self.world_rank)

    def peer_label(self, peer: int) -> str:
        return self.label(self.peer_world_rank(peer))


class Transport(abc.ABC):
    """Moves row ranges of wire tensors between this rank and its peers.

    Attributes:
        kind: ``"nccl"`` or ``"gloo"``.
        device: the device every wire tensor must be on (``cuda:N`` / ``cpu``).
        strict: strict-mode headers on every message.
        peers: the :class:`PeerMap` naming ranks.
    """

    kind: str = "?"

    def __init__(self, peers: PeerMap, device: torch.device, *, strict: bool, timeout_s: float):
        self.peers = peers
        self.device = torch.device(device)
        self.strict = bool(strict)
        self.timeout_s = float(timeout_s)
        self._closed: BaseException | None = None

    # -- checks ------------------------------------------------------------------

    def check_device(self, t: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` unless ``t`` is on this transport's device (before anything moves)."""
        if t.device != self.device:
            if self.kind == "nccl" and t.device.type == "cpu":
                raise ValueError(
                    f"{name} is a CPU tensor but the NCCL transport moves CUDA tensors on {self.device}; "
                    f"move it with .to('{self.device}') (or configure transport='gloo' for CPU tensors)"
                )
            if self.kind == "gloo" and t.device.type != "cpu":
                raise ValueError(
                    f"{name} is on {t.device} but the gloo transport moves CPU tensors; use "
                    "transport='nccl' for CUDA tensors, or move it with .cpu()"
                )
            raise ValueError(f"{name} must be on {self.device}, got {t.device}")

    def _check_open(self, tag: MessageTag | None = None) -> None:
        if self._closed is not None:
            where = f" ({tag.op} at {tag.where()})" if tag is not None else ""
            raise AFDTransportClosedError(
                f"the AFD {self.kind} transport of {self.peers.me} is closed{where}: {self._closed}. "
                "Close and re-initialise the connector (init_afd_connector) on every rank.",
                op=None if tag is None else tag.op,
                layer=None if tag is None else tag.layer, stage=None if tag is None else tag.stage,
            ) from None

    # -- data --------------------------------------------------------------------

    @abc.abstractmethod
    def split_back(self, tensors: Sequence[torch.Tensor | None], peers: Sequence[int],
                   rows: Sequence[int], *, tag: MessageTag) -> PendingSend:
        """Send ``rows[i]`` consecutive rows of every tensor to ``peers[i]``.

        Args:
            tensors: ``(hidden_states, router_logits|None, token_ids|None)`` or
                ``(packed_wire,)``; contiguous, on :attr:`device`, leading dim
                ``sum(rows)``. Not modified (NCCL declares them mutated for the compiler).
            peers: role ranks of the other role, in range order.
            rows: rows per peer (>= 0; zero-row peers are skipped).
            tag: the exchange.

        Returns:
            A :class:`PendingSend`; the connector waits on it before the sent
            memory may be reused (gloo) and drops it after the stage stream was
            joined (NCCL: already ordered on the stream).

        Raises:
            AFDTransportError: see the module doc.
        """

    @abc.abstractmethod
    def fan_in(self, tensors: Sequence[torch.Tensor | None], peers: Sequence[int],
               rows: Sequence[int], *, tag: MessageTag) -> None:
        """Receive ``rows[i]`` rows from ``peers[i]`` into consecutive row ranges of every tensor.

        gloo: returns when the data is in the tensors. NCCL: the receive is
        issued on the current CUDA stream (the connector's stage stream); it is
        complete when that stream reaches it, and the watchdog follows it.

        Args:
            tensors: receive targets (mutated), like :meth:`split_back`'s.
            peers, rows, tag: as in :meth:`split_back`.

        Raises:
            AFDTransportError: see the module doc.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Every rank of the AFD world reaches this point (bounded by the deadline)."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Stop all in-flight work now (called from any thread); later calls raise. Idempotent."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release communicators / process groups. Idempotent; safe after :meth:`abort`."""

    def check_health(self, tag: MessageTag | None = None) -> None:
        """Raise the pending asynchronous failure, if any (watchdog expiry, async error)."""
        self._check_open(tag)
