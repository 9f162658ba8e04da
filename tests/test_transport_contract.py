"""The transport contract: one selection point, strictness as a wrapper over any transport, no probing."""

from __future__ import annotations

import pathlib
import re
from collections import deque

import pytest
import torch

from afd_ext.errors import AFDConfigError, AFDProtocolError
from afd_ext.transport import create_transport, register_transport, transport_class
from afd_ext.transport.base import MessageTag, PeerMap, PendingSend, Transport, TransportSetup, row_offsets
from afd_ext.transport.strict import StrictTransport


class _Wire:
    """Messages in flight between two in-process loopback transports, per (sender, receiver) pair."""

    def __init__(self):
        self.q: dict[tuple[int, int], deque] = {}


class LoopbackTransport(Transport):
    """A host transport in one process: what a third data plane must implement, and nothing more."""

    kind = "loopback"
    device_type = "cpu"

    def __init__(self, peers: PeerMap, wire: _Wire):
        super().__init__(peers, torch.device("cpu"), timeout_s=1.0)
        self.wire = wire

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> "LoopbackTransport":
        return cls(setup.peers, setup.store)

    def split_back(self, tensors, peers, rows, *, tag):
        self.check_health(tag)
        for p, off, r in zip(peers, row_offsets(rows), rows):
            if r:
                key = (self.peers.world_rank, self.peers.peer_world_rank(p))
                for t in tensors:
                    if t is not None:
                        self.wire.q.setdefault(key, deque()).append(t.narrow(0, off, r).clone())
        return PendingSend()

    def fan_in(self, tensors, peers, rows, *, tag, wait=False):
        self.check_health(tag)
        for p, off, r in zip(peers, row_offsets(rows), rows):
            if r:
                key = (self.peers.peer_world_rank(p), self.peers.world_rank)
                for t in tensors:
                    if t is not None:
                        t.narrow(0, off, r).copy_(self.wire.q[key].popleft())

    def barrier(self):
        pass

    def abort(self, reason):
        self._closed = RuntimeError(reason)

    def close(self, buffers=()):
        self._closed = RuntimeError("closed")


def _pair(strict: bool):
    register_transport("loopback", LoopbackTransport)
    wire = _Wire()
    out = []
    for role in ("ffn", "attention"):
        setup = TransportSetup(wire, None, PeerMap(role, 0, 1, 1), torch.device("cpu"), 1.0, 1.0)
        out.append(create_transport("loopback", setup, strict=strict))
    return out


def test_selection_is_by_name_and_unknown_names_are_config_errors():
    assert transport_class("gloo").device_type == "cpu" and transport_class("nccl").device_type == "cuda"
    with pytest.raises(AFDConfigError, match="unknown AFD transport 'nope'"):
        transport_class("nope")
    (plain, checked), _ = _pair(strict=False)
    assert isinstance(plain, LoopbackTransport) and checked is plain
    (plain, checked), _ = _pair(strict=True)
    assert isinstance(checked, StrictTransport) and checked.inner is plain and checked.kind == "loopback"


def test_a_registered_transport_can_be_named_in_the_config(monkeypatch):
    """register_transport is the whole job: the config accepts the name and the connector picks the class."""
    from afd_ext import config
    from afd_ext.config import AFDConfig
    from afd_ext.connector import AFDConnector

    monkeypatch.setattr(config, "TRANSPORTS", dict(config.TRANSPORTS))  # the registration ends with this test
    import afd_ext.transport as tp

    monkeypatch.setattr(tp, "_REGISTRY", config.TRANSPORTS)
    raw = {"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 1,
           "connector_extra_config": {"transport": "loopback2"}}
    with pytest.raises(AFDConfigError, match="transport must be one of"):
        AFDConfig.from_dict(raw)
    register_transport("loopback2", LoopbackTransport)
    conn = AFDConnector(0, 0, AFDConfig.from_dict(raw), 0, hidden_size=4, num_layers=1)
    assert conn.transport_kind == "loopback2" and conn.device == torch.device("cpu")
    assert transport_class("loopback2") is LoopbackTransport


def test_strict_wrapper_checks_headers_over_any_transport():
    (_, ffn), (_, att) = _pair(strict=True)
    h = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ids = torch.arange(3, dtype=torch.int32)
    att.split_back([h, ids], [0], [3], tag=MessageTag("send_attn_output", "a2f", 1, 0, 0)).wait()
    got_h, got_ids = torch.empty(3, 4), torch.empty(3, dtype=torch.int32)
    ffn.fan_in([got_h, got_ids], [0], [3], tag=MessageTag("recv_attn_output", "a2f", 1, 0, 0))
    assert torch.equal(got_h, h) and torch.equal(got_ids, ids)
    # the sender claims layer 1, the receiver expects layer 0: named, before the data is taken
    att.split_back([h, ids], [0], [3], tag=MessageTag("send_attn_output", "a2f", 2, 1, 0))
    with pytest.raises(AFDProtocolError, match="field 'layer' differs") as ei:
        ffn.fan_in([got_h, got_ids], [0], [3], tag=MessageTag("recv_attn_output", "a2f", 2, 0, 0))
    assert "attention rank 0 (world rank 1)" in str(ei.value) and "FFN rank 0 (world rank 0)" in str(ei.value)


def test_the_connector_never_probes_its_transport():
    """Every transport method the connector uses is declared on Transport (no getattr / hasattr)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "afd_ext" / "connector"
    src = "\n".join(p.read_text() for p in sorted(root.glob("*.py")))
    assert not re.search(r"\b(getattr|hasattr)\(", src)
    declared = {n for n in dir(Transport) if not n.startswith("__")}
    used = set(re.findall(r"\b(?:tr|transport|checked|self\.inner)\.(\w+)\(", src))
    used |= set(re.findall(r"\.data\(st\)\.(\w+)", src))
    assert used and used <= declared, sorted(used - declared)


def test_a_raw_link_error_a_transport_lets_through_reaches_the_caller_named():
    """The connector's last line for any transport: a raw ``torch.distributed`` error from a data call becomes
    AFDPeerError / AFDTimeoutError naming the op, the peer and the position (no raw error chained); the step
    is aborted. A RuntimeError that is not a link error (CUDA) is left as it is."""
    import torch.distributed as dist

    from afd_ext.connector.buffers import BufferPool
    from afd_ext.connector.session import Session
    from afd_ext.errors import AFDPeerError, AFDTimeoutError

    att = _pair(strict=False)[1][0]  # attention rank 0's plain transport
    s = Session(att.peers.me, "attention", False, BufferPool("attention", 0, torch.device("cpu")))
    s.transport = att
    tag = MessageTag("recv_ffn_output", "f2a", 3, 1, 0, user_step=2)

    def raising(exc):
        def fn(*args, **kwargs):
            raise exc
        return fn

    with pytest.raises(AFDPeerError, match="recv_ffn_output at step 2, layer 1, stage 0 with FFN rank 0") as ei:
        s.transport_call(raising(dist.DistNetworkError("Connection reset by peer")), (None,), [0], [1], tag=tag)
    e = ei.value
    assert (e.op, e.peer, e.layer, e.stage) == ("recv_ffn_output", "FFN rank 0 (world rank 0)", 1, 0)
    assert e.__suppress_context__ and e.__cause__ is None and s.broken is e
    with pytest.raises(AFDTimeoutError, match="DistStoreError: Socket Timeout"):
        s.transport_call(raising(dist.DistStoreError("Socket Timeout")), tag=tag)
    with pytest.raises(RuntimeError, match="CUDA error: out of memory") as ei:
        s.transport_call(raising(RuntimeError("CUDA error: out of memory")), tag=tag)
    assert type(ei.value) is RuntimeError
