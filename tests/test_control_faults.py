"""A bad control payload in mid-stream (#34 item 5): every rank sees a named error within 0.5 s.

Attention rank 0 (the control sender) applies step 2's payload but sends the FFN rank other
bytes (a wrong-length count vector, flipped bytes, another rank's counts) straight on its
channel, as a corrupted or buggy sender would; both attention ranks then run the step. The FFN
rank names the payload (``ControlProtocolError``, the step-abort signal posted first), the
attention ranks stop with ``StepAbortedError`` naming it: not their 6 s step deadline, not an
unnamed error. Over gloo, on the shm and tcp control channels.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(120)

STEPS = ({0: [2, 3]}, {0: [1, 2], 1: [2, 2]})


def _bad_bytes(case: str) -> bytes:
    from afd_ext.control.codec import encode_control_binary
    from afd_ext.metadata import AFDControlPayload

    good = encode_control_binary(cs._payload(STEPS[1]))
    if case == "wrong-length counts":
        return encode_control_binary(AFDControlPayload({0: [1, 2, 4], 1: [2, 2]}))
    if case == "flipped bytes":
        return good[:23] + bytes([good[23] ^ 0x80]) + good[24:]  # stage 0's first count turns negative
    if case == "another rank's counts":
        return encode_control_binary(AFDControlPayload({0: [2, 1], 1: [2, 2]}))
    raise ValueError(case)


def _worker(rank, nprocs, sc, port, case):
    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    t_sent = None
    try:
        if conn.role == "attention":
            cs.attention_step(conn, sc, 0, STEPS[0])
            payload = cs._payload(STEPS[1])
            conn.control_plane.update_state_from_dp_metadata(payload)
            if conn.role_rank == 0:
                t_sent = time.monotonic()
                conn.control_plane.channels[0].send(_bad_bytes(case))
            for layer in range(sc.layers):
                for s in sorted(STEPS[1]):
                    n = cs.expected_rows(sc, STEPS[1][s], conn.role_rank)
                    h, lg, ids = cs.make_inputs(sc, 1, layer, s, conn.role_rank, n)
                    conn.send_attn_output(h, cs._ctx(layer, s, n))
                for s in sorted(STEPS[1]):
                    n = cs.expected_rows(sc, STEPS[1][s], conn.role_rank)
                    conn.recv_ffn_output(cs.make_inputs(sc, 1, layer, s, conn.role_rank, n)[0], ubatch_idx=s)
        else:
            cs.ffn_step(conn, sc)
            cs.ffn_step(conn, sc)
        return {"error": None, "t_sent": t_sent}
    except Exception as e:  # noqa: BLE001 - classified by the test
        return {"error": type(e).__name__, "msg": str(e), "t": time.monotonic(), "t_sent": t_sent}
    finally:
        conn.close()


@pytest.mark.parametrize("channel", ["shm", "tcp"])
@pytest.mark.parametrize("case", ["wrong-length counts", "flipped bytes", "another rank's counts"])
def test_a_bad_control_payload_mid_stream_is_a_named_error_on_every_rank_within_half_a_second(case, channel):
    sc = cs.Scenario(A=2, F=1, steps=STEPS, layers=2, strict=False, step_timeout_s=6.0,
                     extra=(("control_channel", channel),))
    ffn, a0, a1 = run_workers(_worker, sc.nprocs, (sc, find_free_port(), case), timeout_s=100)
    t_sent = a0["t_sent"]
    assert t_sent is not None, a0
    if case == "another rank's counts":  # well-formed, fits the job: the ranks' step-count agreement names it
        assert ffn["error"] == "AFDProtocolError" and "the ranks disagree" in ffn["msg"], ffn
        fact = "disagree"
    else:
        assert ffn["error"] == "ControlProtocolError", ffn
        assert "control payload from attention rank 0 (world rank 1)" in ffn["msg"], ffn
        fact = "control payload from attention rank 0 (world rank 1)"
    for r in (a0, a1):
        assert r["error"] == "StepAbortedError" and fact in r["msg"], r
    for r in (ffn, a0, a1):
        assert r["t"] - t_sent <= 0.5, (case, channel, r["t"] - t_sent, r)
