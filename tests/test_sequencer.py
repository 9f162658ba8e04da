"""The step machine alone: no torch, no transport (afd_ext.connector.sequencer)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from afd_ext.connector.sequencer import StepSequencer, exchange_order
from afd_ext.errors import AFDStateError


def test_the_sequencer_imports_neither_torch_nor_a_transport():
    src = pathlib.Path(__import__("afd_ext.connector.sequencer", fromlist=["x"]).__file__).read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    assert not any("torch" in n or "transport" in n for n in names), names


def test_exchange_order_is_layer_major_stage_minor():
    assert exchange_order(2, (0, 3)) == ((0, 0), (0, 3), (1, 0), (1, 3))
    assert exchange_order(1, (5,)) == ((0, 5),)
    assert exchange_order(3, ()) == ()


def _att(layers=2, stages=(0, 1)):
    return StepSequencer(4, "attention", exchange_order(layers, stages), "attention rank 0 (world rank 1)")


def _ffn(layers=2, stages=(0, 1)):
    return StepSequencer(4, "ffn", exchange_order(layers, stages), "FFN rank 0 (world rank 0)")


def test_attention_sends_in_order_and_replies_follow_sends():
    q = _att()
    assert (q.total, q.stages, q.complete, q.moved) == (4, (0, 1), False, False)
    with pytest.raises(AFDStateError, match="no exchange of step 4 is awaiting its reply"):
        q.next_reply(0, "recv_ffn_output")
    with pytest.raises(ValueError, match=r"next exchange of the step \(step 4\) is layer 0, stage 0"):
        q.next_send(1, "send_attn_output")
    assert q.next_send(0, "send_attn_output") == (0, 0)
    q.sent += 1
    assert q.moved and q.next_send(1, "send_attn_output") == (0, 1)
    q.sent += 1
    with pytest.raises(ValueError, match="reply due next is step 4, layer 0, stage 0"):
        q.next_reply(1, "recv_ffn_output")
    assert q.next_reply(0, "recv_ffn_output") == (0, 0)
    q.received += 1
    assert q.progress() == "2 of 4 exchanges sent, 1 replies received"
    q.sent, q.received = 4, 4
    assert q.complete
    with pytest.raises(AFDStateError, match="all 4 exchanges of step 4 were already sent"):
        q.next_send(0, "send_attn_output")


def test_ffn_receives_in_order_and_replies_follow_receives():
    q = _ffn(layers=1, stages=(0, 2))
    with pytest.raises(AFDStateError, match="no received exchange of step 4 awaits its reply"):
        q.next_reply_send("send_ffn_output")
    with pytest.raises(ValueError, match="next exchange is step 4, layer 0, stage 0"):
        q.next_fan_in(2, "recv_attn_output")
    assert q.next_fan_in(0, "recv_attn_output") == (0, 0)
    q.received += 1
    assert q.moved and not q.complete
    assert q.next_reply_send("send_ffn_output") == (0, 0)
    q.sent += 1
    assert q.next_fan_in(2, "recv_attn_output") == (0, 2)
    q.received += 1
    with pytest.raises(AFDStateError, match="were received"):
        q.next_fan_in(0, "recv_attn_output")
    q.sent += 1
    assert q.complete and q.progress() == "2 of 2 exchanges received, 2 replies sent"


def test_new_payload_decides_drop_drain_abort_or_done():
    q = _att()
    assert q.on_new_payload() == "drop"  # replaced before any exchange
    q.abandoned = True
    assert q.on_new_payload() == "drain"  # a rejected first exchange: zeros for the rest
    q.abandoned, q.sent = False, 1
    assert q.on_new_payload() == "abort"  # data moved, step incomplete
    q.sent = q.received = q.total
    assert q.on_new_payload() == "done"
    f = _ffn()
    f.abandoned = True
    assert f.on_new_payload() == "abort"  # an FFN rank cannot drain: its peers already sent
    f.abandoned = False
    assert f.on_new_payload() == "drop"


def test_due_names_the_exchange_each_call_would_serve():
    q = _att(layers=1, stages=(0, 1))
    assert q.due("send_attn_output") == (0, 0) and q.due("recv_ffn_output") is None  # no reply due yet
    q.sent = 2
    assert q.due("send_attn_output") is None and q.due("recv_ffn_output") == (0, 0)
    f = _ffn(layers=2, stages=(3,))
    f.received = 1
    assert f.due("recv_attn_output") == (1, 3) and f.due("send_ffn_output") == (0, 3)
    assert f.due("warmup") is None


def test_where_and_index():
    q = _att(layers=2, stages=(0,))
    assert q.where(1) == "step 4, layer 1, stage 0"
    assert q.where(2) == "step 4 (all 2 exchanges done)"
    assert q.index(1, 0) == 1 and q.index(2, 0) is None


def test_one_exchange_per_stage_in_flight_on_the_attention_side():
    # The margin probe's pattern (layers 1..3 of a stage sent before layer 0's reply) overran the
    # peer-memory plane's one slot per stage: refused before anything moves, position unchanged.
    q = _att(layers=3, stages=(0,))
    assert q.next_send(0, "send_attn_output") == (0, 0)
    q.sent += 1
    with pytest.raises(AFDStateError, match=r"layer 1, stage 0, but the reply of layer 0, stage 0 was not "
                                            r"received yet: call recv_ffn_output\(ubatch_idx=0\) first"):
        q.next_send(0, "send_attn_output")
    assert (q.sent, q.received) == (1, 0)
    assert q.next_reply(0, "recv_ffn_output") == (0, 0)
    q.received += 1
    assert q.next_send(0, "send_attn_output") == (1, 0)
    # Two stages (DBO): both stages of a layer in flight, and a stage's next layer once its own reply is in.
    d = _att(layers=2, stages=(0, 1))
    d.sent = 2
    with pytest.raises(AFDStateError, match="reply of layer 0, stage 0 was not received"):
        d.next_send(0, "send_attn_output")
    d.received = 1
    assert d.next_send(0, "send_attn_output") == (1, 0)
    d.sent = 3
    with pytest.raises(AFDStateError, match="reply of layer 0, stage 1 was not received"):
        d.next_send(1, "send_attn_output")
    d.received = 2
    assert d.next_send(1, "send_attn_output") == (1, 1)


def test_one_exchange_per_stage_in_flight_on_the_ffn_side():
    q = _ffn(layers=2, stages=(0, 1))
    q.received = 2  # both stages of layer 0 taken before either reply: allowed
    with pytest.raises(AFDStateError, match=r"recv_attn_output\(ubatch_idx=0\) on FFN rank 0 \(world rank 0\) "
                                            r"for step 4, layer 1, but the reply of layer 0, stage 0 was not sent "
                                            r"yet: call send_ffn_output first"):
        q.next_fan_in(0, "recv_attn_output")
    q.sent = 1
    assert q.next_fan_in(0, "recv_attn_output") == (1, 0)
    q.received = 3
    with pytest.raises(AFDStateError, match="reply of layer 0, stage 1 was not sent"):
        q.next_fan_in(1, "recv_attn_output")
