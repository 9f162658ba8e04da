"""Strict mode: a header block before every message, checked before the data receive is posted.

:class:`StrictTransport` wraps any :class:`~afd_ext.transport.base.Transport`
(chosen at construction: the connector builds one when ``strict`` is
configured and uses it for eager steps). Before each data call it moves one
``int64[K, HEADER_WORDS]`` block per (peer, exchange) over the same transport,
row ``k`` describing data message ``k`` (its part index, dtype, rows, columns,
layer, stage, sender, receiver). The receiver waits for the headers on the
host (bounded: ``fan_in(wait=True)``) and checks them before it posts the data
receive, so a mis-ordered or mis-sized message is an
:class:`~afd_ext.errors.AFDProtocolError` naming both sides instead of silent
corruption or a hang. Headers cannot be read inside a CUDA-graph capture, so a
capturing stream passes straight to the wrapped transport.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..spec import dtype_code, dtype_from_code
from ..topology import step_words
from .base import AFDProtocolError, MessageTag, PendingSend, Transport, TransportSetup

__all__ = ["HEADER_WORDS", "HEADER_MAGIC", "HEADER_VERSION", "StrictTransport", "encode_headers", "check_headers"]

#: int64 words per header row.
HEADER_WORDS = 16
#: ``b"AFDH"`` as an int.
HEADER_MAGIC = 0x41464448
#: Bump when the header layout changes (checked in the init handshake). 2: the tensor word is the
#: part's index in the exchange's list (wire order), not a fixed id per kind of tensor.
HEADER_VERSION = 2

_DIRECTION_CODES = {"a2f": 0, "f2a": 1}
_CODE_DIRECTIONS = {v: k for k, v in _DIRECTION_CODES.items()}

# Header word positions.
_W_MAGIC, _W_VERSION, _W_DIRECTION, _W_SENDER, _W_RECEIVER, _W_STEP, _W_LAYER, _W_STAGE = range(8)
_W_TENSOR, _W_DTYPE, _W_ROWS, _W_COLS, _W_INDEX, _W_COUNT, _W_LAYER_IDX, _W_RESERVED = range(8, 16)


def _cols(t: torch.Tensor) -> int:
    return int(t.shape[1]) if t.dim() >= 2 else 1


def encode_headers(tag: MessageTag, sender: int, receiver: int, rows: int,
                   messages: Sequence[torch.Tensor]) -> torch.Tensor:
    """The header block of one (peer, exchange): CPU ``int64[len(messages), HEADER_WORDS]``.

    Args:
        tag: the exchange.
        sender: world rank of the sender; receiver: world rank of the receiver.
        rows: rows of every message to this peer.
        messages: the exchange's tensors, in wire order (dtype and columns are read from them).
    """
    # Python lists, one tensor at the end: element-wise tensor writes cost ~90 us per call.
    step = tag.user_step if tag.user_step >= 0 else tag.step  # as messages name it
    out = []
    for k, t in enumerate(messages):
        word = {_W_MAGIC: HEADER_MAGIC, _W_VERSION: HEADER_VERSION, _W_DIRECTION: _DIRECTION_CODES[tag.direction],
                _W_SENDER: sender, _W_RECEIVER: receiver, _W_STEP: step, _W_LAYER: tag.layer, _W_STAGE: tag.stage,
                _W_TENSOR: k, _W_DTYPE: dtype_code(t.dtype), _W_ROWS: rows, _W_COLS: _cols(t), _W_INDEX: k,
                _W_COUNT: len(messages), _W_LAYER_IDX: tag.layer_idx}
        out.append([word.get(i, 0) for i in range(HEADER_WORDS)])
    return torch.tensor(out, dtype=torch.int64).reshape(len(messages), HEADER_WORDS)


def _describe_header(row: Sequence[int], label) -> str:
    return (
        f"{_CODE_DIRECTIONS.get(int(row[_W_DIRECTION]), '?')} part {int(row[_W_TENSOR])} "
        f"[{int(row[_W_ROWS])}, {int(row[_W_COLS])}] {dtype_from_code(row[_W_DTYPE])}, "
        f"{step_words(int(row[_W_STEP]))}, layer {int(row[_W_LAYER])}, stage {int(row[_W_STAGE])}, "
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


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class StrictTransport(Transport):
    """Any transport, with a checked header block before every message (see the module doc).

    Args:
        inner: the transport that moves headers and data.

    Every method but the two data calls is the inner transport's.
    """

    def __init__(self, inner: Transport):
        super().__init__(inner.peers, inner.device, timeout_s=inner.timeout_s)
        self.inner = inner
        self.kind = inner.kind
        self.device_type = inner.device_type

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> "StrictTransport":
        raise TypeError("StrictTransport wraps a built transport: StrictTransport(inner)")

    # -- data ------------------------------------------------------------------------

    def split_back(self, tensors, peers, rows, *, tag: MessageTag) -> PendingSend:
        live = [(p, r) for p, r in zip(peers, rows) if r > 0]
        if not live or _capturing(self.device):
            return self.inner.split_back(tensors, peers, rows, tag=tag)
        self.inner.check_health(tag)
        pm = self.peers
        hdr = torch.cat([encode_headers(tag, pm.world_rank, pm.peer_world_rank(p), r, tensors) for p, r in live])
        hdr = hdr.to(self.device)
        head = self.inner.split_back([hdr], [p for p, _ in live], [len(tensors)] * len(live), tag=tag)
        data = self.inner.split_back(tensors, peers, rows, tag=tag)

        def both() -> None:
            head.wait()
            data.wait()

        return PendingSend(both, hdr)

    def fan_in(self, tensors, peers, rows, *, tag: MessageTag, wait: bool = False) -> None:
        live = [(p, r) for p, r in zip(peers, rows) if r > 0]
        if live and not _capturing(self.device):
            self.inner.check_health(tag)
            k = len(tensors)
            hdr = torch.empty(len(live) * k, HEADER_WORDS, dtype=torch.int64, device=self.device)
            self.inner.fan_in([hdr], [p for p, _ in live], [k] * len(live), tag=tag, wait=True)
            got = hdr.cpu()
            pm = self.peers
            for i, (p, r) in enumerate(live):
                src = pm.peer_world_rank(p)
                check_headers(got[i * k:(i + 1) * k], encode_headers(tag, src, pm.world_rank, r, tensors), tag=tag,
                              receiver_label=pm.me, sender_label=pm.label(src), label=pm.label)
        self.inner.fan_in(tensors, peers, rows, tag=tag, wait=wait)

    # -- the rest is the inner transport's ----------------------------------------------

    def check_health(self, tag: MessageTag | None = None) -> None:
        self.inner.check_health(tag)

    def prepare_stages(self, stages: Sequence[int]) -> None:
        self.inner.prepare_stages(stages)

    def begin_step(self, schedule: Any) -> None:
        self.inner.begin_step(schedule)

    def receive_buffers(self, schedule: Any, stage: int) -> dict[str, torch.Tensor] | None:
        return self.inner.receive_buffers(schedule, stage)

    def join(self) -> None:
        self.inner.join()

    def synchronize(self, what: str, tag: MessageTag) -> None:
        self.inner.synchronize(what, tag)

    def track_replay(self, what: str, tag: MessageTag) -> None:
        self.inner.track_replay(what, tag)

    @contextlib.contextmanager
    def capture_guard(self) -> Iterator[None]:
        with self.inner.capture_guard():
            yield

    def barrier(self) -> None:
        self.inner.barrier()

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self, buffers: Sequence[torch.Tensor] = ()) -> None:
        self.inner.close(buffers)
