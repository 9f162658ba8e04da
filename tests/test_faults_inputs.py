"""Bad input on one rank is an error on that rank only, before anything moves; the corrected call proceeds.

The project rule: "Bad input gets a clear error before anything moves, and the
next step still works." Every case here is a data call with a wrong tensor or
a wrong ``ubatch_idx`` in the middle of a step (data of the step already moved)
or at its first exchange. The rank that made it gets an ``AFDConfigError`` /
``AFDStateError`` naming the call, the step, the layer and the stage; it then
makes the right call, and every rank finishes the step and the next one with
checked replies (no abort anywhere). Over gloo, strict headers off (the default).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402
from afd_ext.testing import find_free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _rejected(fn) -> dict:
    """Call ``fn``; return what it raised (type, fields, message, seconds to the error)."""
    from afd_ext.errors import AFDConfigError, AFDError

    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"type": type(e).__name__, "config": isinstance(e, AFDConfigError), "afd": isinstance(e, AFDError),
                "value_error": isinstance(e, ValueError), "msg": str(e), "op": getattr(e, "op", None),
                "layer": getattr(e, "layer", None), "stage": getattr(e, "stage", None),
                "took": time.monotonic() - t0}
    return {"type": None}


def _bad_output(case: str, good):
    import torch

    if case == "dtype":
        return good.double()
    if case == "width":
        return good[:, :-1].contiguous()
    if case == "rows short":
        return good[:-1].contiguous()
    if case == "rows extra":
        return torch.cat([good, good[:1]])
    if case == "device":
        return torch.empty(good.shape, dtype=good.dtype, device="meta")
    if case == "not contiguous":
        return good.t().contiguous().t()
    if case == "a list":
        return good.tolist()
    raise ValueError(case)


OUTPUT_CASES = ("dtype", "width", "rows short", "rows extra", "device", "not contiguous", "a list")


def _ffn_bad_output_worker(rank, nprocs, sc, port, cases):
    """The FFN rank answers layer 1, stage 0 of the first step with each bad output, then the right one."""
    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    try:
        if conn.role == "attention":
            return {"checked": [cs.attention_step(conn, sc, i, step) for i, step in enumerate(sc.steps)]}
        out: dict = {"rejections": {}, "rows": []}
        for i in range(len(sc.steps)):
            payload = conn.control_plane.recv_dp_metadata_list()
            conn.control_plane.update_state_from_dp_metadata(payload)
            rows = 0
            for layer in range(sc.layers):
                for s in sorted(payload.dp_metadata_list):
                    p = conn.recv_attn_output(ubatch_idx=s)
                    good = cs.ffn_fn(p.hidden_states, None, None, layer)
                    if i == 0 and layer == 1 and s == 0:
                        for case in cases:
                            out["rejections"][case] = _rejected(
                                lambda c=case: conn.send_ffn_output(_bad_output(c, good), p.context))
                    conn.send_ffn_output(good, p.context)
                    rows += int(p.hidden_states.shape[0])
            out["rows"].append(rows)
        return out
    finally:
        conn.close()


def test_a_bad_ffn_output_is_a_local_config_error_and_the_retried_call_completes_the_step():
    """Items 1 and 3: wrong dtype, width, rows (short, extra), device, layout or type of ``ffn_output``."""
    sc = cs.Scenario(A=2, F=1, steps=({0: [2, 3]}, {0: [1, 2]}), layers=2, strict=False, step_timeout_s=20.0)
    ffn, a0, a1 = run_workers(_ffn_bad_output_worker, sc.nprocs, (sc, find_free_port(), OUTPUT_CASES), timeout_s=100)
    for case, r in ffn["rejections"].items():
        assert r["type"] == "AFDConfigError" and r["value_error"], (case, r)
        assert (r["op"], r["layer"], r["stage"]) == ("send_ffn_output", 1, 0), (case, r)
        msg = r["msg"]
        assert msg.startswith("send_ffn_output on FFN rank 0 (world rank 0) at step 1, layer 1, stage 0: "), (case, msg)
        assert "aborted" not in msg and "repeat the call" in msg, (case, msg)
        assert r["took"] < 0.5, (case, r)
    assert "float64" in ffn["rejections"]["dtype"]["msg"]
    assert "[5, 8]" in ffn["rejections"]["width"]["msg"] and "[5, 7]" in ffn["rejections"]["width"]["msg"]
    assert "meta" in ffn["rejections"]["device"]["msg"]
    assert "contiguous" in ffn["rejections"]["not contiguous"]["msg"]
    # Every rank finished both steps with checked replies: nothing was aborted.
    assert ffn["rows"] == [5 * 2, 3 * 2]
    assert a0["checked"] == [2 * 2, 1 * 2] and a1["checked"] == [3 * 2, 2 * 2]
    took = max(r["took"] for r in ffn["rejections"].values())
    print(f"\n[inputs] {len(OUTPUT_CASES)} bad ffn_output cases: AFDConfigError on the FFN rank within {took * 1e3:.1f} ms, "
          "retried call completed the step on every rank")


def _wrong_stage_worker(rank, nprocs, sc, port):
    """Wrong ``ubatch_idx`` / stage on the FFN rank (first exchange and mid-step) and on attention rank 1
    (mid-step, sends and replies); each then makes the right call."""
    import torch

    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    rej: dict = {}
    try:
        if conn.role == "ffn":
            rows = []
            for i in range(len(sc.steps)):
                payload = conn.control_plane.recv_dp_metadata_list()
                conn.control_plane.update_state_from_dp_metadata(payload)
                n = 0
                prev = None
                for layer in range(sc.layers):
                    for s in sorted(payload.dp_metadata_list):
                        if i == 0 and (layer, s) == (0, 0):
                            rej["ffn first, stage 1 for 0"] = _rejected(lambda: conn.recv_attn_output(ubatch_idx=1))
                            rej["ffn first, stage 9"] = _rejected(lambda: conn.recv_attn_output(ubatch_idx=9))
                        if i == 0 and (layer, s) == (1, 1):
                            rej["ffn mid, stage 0 for 1"] = _rejected(lambda: conn.recv_attn_output(ubatch_idx=0))
                            rej["ffn mid, stage -1"] = _rejected(lambda: conn.recv_attn_output(ubatch_idx=-1))
                            rej["ffn mid, reply twice"] = _rejected(
                                lambda: conn.send_ffn_output(prev[0], prev[1]))
                        p = conn.recv_attn_output(ubatch_idx=s)
                        out = cs.ffn_fn(p.hidden_states, None, None, layer)
                        conn.send_ffn_output(out, p.context)
                        prev = (out, p.context)
                        n += int(p.hidden_states.shape[0])
                rows.append(n)
            return {"rows": rows, "rejections": rej}
        a = conn.role_rank
        checked = []
        for i, step in enumerate(sc.steps):
            payload = cs._payload(step)
            conn.control_plane.update_state_from_dp_metadata(payload)
            conn.control_plane.send_dp_metadata_list(payload)
            n_ok = 0
            for layer in range(sc.layers):
                sent = []
                for s in sorted(step):
                    n = cs.expected_rows(sc, step[s], a)
                    h, _, _ = cs.make_inputs(sc, i, layer, s, a, n)
                    want = cs.ffn_fn(h, None, None, layer)
                    if a == 1 and i == 0 and (layer, s) == (1, 0):
                        other = sorted(step)[1]
                        rej["attention mid, send stage 1 for 0"] = _rejected(lambda: conn.send_attn_output(
                            torch.zeros(cs.expected_rows(sc, step[other], a), sc.hidden), cs._ctx(layer, other,
                            cs.expected_rows(sc, step[other], a))))
                        rej["attention mid, send stage 4"] = _rejected(lambda: conn.send_attn_output(
                            h, cs._ctx(layer, 4, n)))
                    conn.send_attn_output(h, cs._ctx(layer, s, n))
                    sent.append((s, h, want))
                for s, h, want in sent:
                    if a == 1 and i == 0 and (layer, s) == (1, 0):
                        rej["attention mid, reply stage 1 for 0"] = _rejected(
                            lambda: conn.recv_ffn_output(torch.empty(cs.expected_rows(sc, step[1], a), sc.hidden), 1))
                        rej["attention mid, reply stage 7"] = _rejected(lambda: conn.recv_ffn_output(h, 7))
                    n_ok += cs._check_reply(conn, sc, i, layer, s, h, want)
            checked.append(n_ok)
            if a == 1 and i == 0:
                rej["attention, reply with nothing due"] = _rejected(lambda: conn.recv_ffn_output(h, 0))
        return {"checked": checked, "rejections": rej}
    finally:
        conn.close()


def test_a_wrong_ubatch_idx_is_a_local_error_and_the_corrected_call_proceeds():
    """Items 2 and 3: a stage out of range, or not the one the sequencer expects, on either role."""
    sc = cs.Scenario(A=2, F=1, steps=({0: [2, 3], 1: [1, 2]}, {0: [1, 1]}), layers=2, strict=False,
                     step_timeout_s=20.0)
    ffn, a0, a1 = run_workers(_wrong_stage_worker, sc.nprocs, (sc, find_free_port()), timeout_s=100)
    rej = {**ffn["rejections"], **a1["rejections"]}
    assert len(rej) == 10, sorted(rej)
    assert a0["rejections"] == {}
    for case, r in rej.items():
        assert r["afd"] and r["type"] in ("AFDConfigError", "AFDStateError"), (case, r)
        msg = r["msg"]
        assert "step 1" in msg and "aborted" not in msg, (case, msg)
        assert ("repeat the call" if case != "attention, reply with nothing due" else "step is complete") in msg, msg
        assert r["took"] < 0.5, (case, r)
    for case in ("ffn first, stage 1 for 0", "ffn first, stage 9", "ffn mid, stage 0 for 1", "ffn mid, stage -1",
                 "attention mid, send stage 1 for 0", "attention mid, send stage 4",
                 "attention mid, reply stage 1 for 0", "attention mid, reply stage 7"):
        assert rej[case]["type"] == "AFDConfigError" and rej[case]["value_error"], (case, rej[case])
    assert "layer 0, stage 0" in rej["ffn first, stage 9"]["msg"] and "ubatch_idx=9" in rej["ffn first, stage 9"]["msg"]
    assert "layer 1, stage 1" in rej["ffn mid, stage 0 for 1"]["msg"]
    assert rej["ffn mid, stage -1"]["stage"] == -1 and rej["ffn mid, stage -1"]["layer"] == 1
    assert "layer 1, stage 0" in rej["attention mid, send stage 4"]["msg"]
    assert "ubatch_idx=7" in rej["attention mid, reply stage 7"]["msg"]
    assert rej["ffn mid, reply twice"]["type"] == "AFDStateError"
    assert rej["attention, reply with nothing due"]["type"] == "AFDStateError"
    # Every rank finished both steps with checked replies.
    assert ffn["rows"] == [(5 + 3) * 2, 2 * 2]
    assert a0["checked"] == [(2 + 1) * 2, 1 * 2] and a1["checked"] == [(3 + 2) * 2, 1 * 2]
    took = max(r["took"] for r in rej.values())
    print(f"\n[inputs] {len(rej)} wrong-stage cases: local error within {took * 1e3:.1f} ms, the corrected calls "
          "completed both steps on every rank")
