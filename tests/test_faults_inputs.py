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
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402

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


# ---------------------------------------------------------------- issue 34 items 3 and 4: argument types
def _bad_kwargs(case: str, h=None, ctx=None, n=0):
    """The keyword arguments of one bad call (``case``: ``"<call>: <what>"``) and the argument it must name."""
    from types import SimpleNamespace as NS

    import torch

    from afd_ext.metadata import AFDExpertRoutingSpec

    call, what = case.split(": ", 1)
    md = ctx.metadata if ctx is not None else None
    table = {
        # item 4: stage indices
        "recv_attn_output": {
            "ubatch_idx None": ({"ubatch_idx": None}, "ubatch_idx"),
            "ubatch_idx '0'": ({"ubatch_idx": "0"}, "ubatch_idx"),
            "ubatch_idx 0.5": ({"ubatch_idx": 0.5}, "ubatch_idx"),
            "ubatch_idx nan": ({"ubatch_idx": float("nan")}, "ubatch_idx"),
            "ubatch_idx True": ({"ubatch_idx": True}, "ubatch_idx"),
            "ubatch_idx [0]": ({"ubatch_idx": [0]}, "ubatch_idx"),
            "ubatch_idx -1": ({"ubatch_idx": -1}, "ubatch_idx"),
            "ubatch_idx 7": ({"ubatch_idx": 7}, "ubatch_idx"),
            # item 3: types of the other arguments
            "routing_spec '4'": ({"ubatch_idx": 0, "routing_spec": "4"}, "routing_spec"),
            "routing_spec 4": ({"ubatch_idx": 0, "routing_spec": 4}, "routing_spec"),
            "routing_spec tuple": ({"ubatch_idx": 0, "routing_spec": (4, torch.float32)}, "routing_spec"),
            "routing_spec width '4'": ({"ubatch_idx": 0, "routing_spec": AFDExpertRoutingSpec("4", torch.float32)},
                                       "routing_spec"),
            "recv_input_ids 'yes'": ({"ubatch_idx": 0, "recv_input_ids": "yes"}, "recv_input_ids"),
            "recv_input_ids None": ({"ubatch_idx": 0, "recv_input_ids": None}, "recv_input_ids"),
        },
        "recv_ffn_output": {
            "ubatch_idx None": ({"ref_tensor": h, "ubatch_idx": None}, "ubatch_idx"),
            "ubatch_idx '0'": ({"ref_tensor": h, "ubatch_idx": "0"}, "ubatch_idx"),
            "ubatch_idx 0.5": ({"ref_tensor": h, "ubatch_idx": 0.5}, "ubatch_idx"),
            "ref_tensor a list": ({"ref_tensor": [[0.0]], "ubatch_idx": 0}, "ref_tensor"),
        },
        "send_attn_output": {
            "stage_idx None": ({"hidden_states": h, "context": NS(metadata=NS(layer_idx=0, stage_idx=None,
                                                                            seq_lens=[n]))}, "stage_idx"),
            "stage_idx '0'": ({"hidden_states": h, "context": NS(metadata=NS(layer_idx=0, stage_idx="0",
                                                                           seq_lens=[n]))}, "stage_idx"),
            "layer_idx '0'": ({"hidden_states": h, "context": NS(metadata=NS(layer_idx="0", stage_idx=0,
                                                                           seq_lens=[n]))}, "layer_idx"),
            "seq_lens '3'": ({"hidden_states": h, "context": NS(metadata=NS(layer_idx=0, stage_idx=0,
                                                                          seq_lens="3"))}, "seq_lens"),
            "no metadata fields": ({"hidden_states": h, "context": NS(metadata=NS(stage_idx=0))}, "context"),
            "router_logits a str": ({"hidden_states": h, "context": ctx, "router_logits": "x"}, "router_logits"),
        },
        "send_ffn_output": {
            "context an object": ({"ffn_output": h, "context": object()}, "context"),
            "context without states": ({"ffn_output": h, "context": NS(metadata=md)}, None),  # accepted
            "ffn_output a str": ({"ffn_output": "out", "context": ctx}, "ffn_output"),
        },
    }
    return table[call][what]


def _arg_types_worker(rank, nprocs, sc, port, cases):
    """The FFN rank tries each ``recv_attn_output``/``send_ffn_output`` case at step 1, layer 0, stage 0 (the
    step's first exchange) and layer 1, stage 1 (mid-step); attention rank 1 its ``send_attn_output``/
    ``recv_ffn_output`` cases at layer 1, stage 0. Each then makes the right call (``ubatch_idx=0.0``, an integral
    float, for the FFN's first receive); every reply is checked."""
    import torch

    from afd_ext.metadata import AFDExpertRoutingSpec

    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    rej: dict = {}

    def attempt(case, fn, kw, name):
        r = _rejected(lambda: fn(**kw))
        r["name"] = name
        rej[case] = r

    try:
        if conn.role == "ffn":
            spec = AFDExpertRoutingSpec(sc.logits_width, torch.float32)
            rows = []
            for i in range(len(sc.steps)):
                payload = conn.control_plane.recv_dp_metadata_list()
                conn.control_plane.update_state_from_dp_metadata(payload)
                n = 0
                for layer in range(sc.layers):
                    for s in sorted(payload.dp_metadata_list):
                        if i == 0 and (layer, s) in ((0, 0), (1, 1)):
                            for case in (c for c in cases if c.startswith("recv_attn_output")):
                                kw, name = _bad_kwargs(case)
                                kw = {**kw, "ubatch_idx": kw["ubatch_idx"] if kw["ubatch_idx"] != 0 else s}
                                attempt(f"{case} at {(layer, s)}", conn.recv_attn_output, kw, name)
                        p = conn.recv_attn_output(ubatch_idx=0.0 if (i, layer, s) == (0, 0, 0) else s,
                                                  routing_spec=spec, recv_input_ids=True)
                        out = cs.ffn_fn(p.hidden_states, p.router_logits, p.input_ids, layer)
                        ctx = p.context
                        if i == 0 and (layer, s) in ((0, 0), (1, 1)):
                            for case in (c for c in cases if c.startswith("send_ffn_output")):
                                kw, name = _bad_kwargs(case, out, p.context)
                                if name is None:
                                    ctx = kw["context"]  # accepted: the real call uses it
                                    continue
                                attempt(f"{case} at {(layer, s)}", conn.send_ffn_output, kw, name)
                        conn.send_ffn_output(out, ctx)
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
                    h, lg, ids = cs.make_inputs(sc, i, layer, s, a, n)
                    want = cs.ffn_fn(h, lg, ids, layer)
                    ctx = cs._ctx(layer, s, n)
                    if a == 1 and i == 0 and (layer, s) == (1, 0):
                        for case in (c for c in cases if c.startswith("send_attn_output")):
                            kw, name = _bad_kwargs(case, h, ctx, n)
                            kw.setdefault("router_logits", lg)
                            kw.setdefault("input_ids", ids)
                            attempt(case, conn.send_attn_output, kw, name)
                    conn.send_attn_output(h, ctx, router_logits=lg, input_ids=ids)
                    sent.append((s, h, want))
                for s, h, want in sent:
                    if a == 1 and i == 0 and (layer, s) == (1, 0):
                        for case in (c for c in cases if c.startswith("recv_ffn_output")):
                            kw, name = _bad_kwargs(case, h)
                            attempt(case, conn.recv_ffn_output, kw, name)
                    n_ok += cs._check_reply(conn, sc, i, layer, s, h, want)
            checked.append(n_ok)
        return {"checked": checked, "rejections": rej}
    finally:
        conn.close()


def _check_arg_cases(cases: list[str], control: str = "auto") -> dict:
    sc = cs.Scenario(A=2, F=1, steps=({0: [2, 3], 1: [1, 2]}, {0: [1, 1]}), layers=2, strict=False,
                     logits_width=4, send_ids=True, step_timeout_s=20.0, extra=(("control_channel", control),))
    ffn, a0, a1 = run_workers(_arg_types_worker, sc.nprocs, (sc, find_free_port(), cases), timeout_s=100)
    rej = {**ffn["rejections"], **a1["rejections"]}
    assert a0["rejections"] == {}
    for case, r in rej.items():
        # A ValueError leaf of AFDError, on this rank only, before anything moved, naming the argument.
        assert r["type"] == "AFDConfigError" and r["value_error"], (case, r)
        msg = r["msg"]
        assert r["name"] in msg and "step 1" in msg and "aborted" not in msg, (case, msg)
        assert "repeat the call" in msg, (case, msg)
        assert r["took"] < 0.5, (case, r)
    # Every rank finished both steps with checked replies: the peers never saw the bad calls.
    assert ffn["rows"] == [(5 + 3) * 2, 2 * 2]
    assert a0["checked"] == [(2 + 1) * 2, 1 * 2] and a1["checked"] == [(3 + 2) * 2, 1 * 2]
    return rej


def test_a_stage_index_that_is_none_a_string_or_not_integral_is_refused_and_0_0_is_taken():
    """Issue 34 item 4: ``recv_attn_output(ubatch_idx=None)`` was taken as "the stage due" (the sequencer's
    shortcut). None, strings, bools, non-integral and out-of-range values are refused by name; 0.0 is taken
    (the FFN's first receive uses it), as the reference takes it."""
    cases = ["recv_attn_output: " + c for c in ("ubatch_idx None", "ubatch_idx '0'", "ubatch_idx 0.5",
                                                 "ubatch_idx nan", "ubatch_idx True", "ubatch_idx [0]",
                                                 "ubatch_idx -1", "ubatch_idx 7")]
    cases += ["recv_ffn_output: ubatch_idx None", "recv_ffn_output: ubatch_idx '0'", "recv_ffn_output: ubatch_idx 0.5",
              "send_attn_output: stage_idx None", "send_attn_output: stage_idx '0'"]
    rej = _check_arg_cases(cases)
    assert len(rej) == 8 * 2 + 5, sorted(rej)
    for where in ((0, 0), (1, 1)):
        none = rej[f"recv_attn_output: ubatch_idx None at {where}"]
        assert "ubatch_idx must be an int stage id" in none["msg"] and "got None" in none["msg"], none
        assert f"layer {where[0]}, stage {where[1]}" in none["msg"] and none["stage"] == where[1], none
        assert "got str '0'" in rej[f"recv_attn_output: ubatch_idx '0' at {where}"]["msg"]
        assert "got float 0.5" in rej[f"recv_attn_output: ubatch_idx 0.5 at {where}"]["msg"]
    assert "got None" in rej["recv_ffn_output: ubatch_idx None"]["msg"]
    assert "context.metadata.stage_idx must be an int stage id" in rej["send_attn_output: stage_idx None"]["msg"]
    took = max(r["took"] for r in rej.values())
    print(f"\n[issue 34.4] {len(rej)} bad stage indices refused by name within {took * 1e3:.1f} ms; 0.0 taken; "
          "both steps exact on every rank")


@pytest.mark.parametrize("control", ["shm", "tcp"])
def test_wrong_argument_types_are_named_value_errors_and_leave_the_step_and_the_peers_intact(control):
    """Issue 34 item 3: ``recv_attn_output(routing_spec="4")`` raised AttributeError (and its caller's exit took
    the peers down); every data call's argument of a wrong type is an AFDConfigError naming the argument, the
    expected type and what was given, and the corrected call completes the step on every rank."""
    cases = ["recv_attn_output: " + c for c in ("routing_spec '4'", "routing_spec 4", "routing_spec tuple",
                                                 "routing_spec width '4'", "recv_input_ids 'yes'",
                                                 "recv_input_ids None")]
    cases += ["send_ffn_output: " + c for c in ("context an object", "context without states", "ffn_output a str")]
    cases += ["send_attn_output: " + c for c in ("layer_idx '0'", "seq_lens '3'", "no metadata fields",
                                                  "router_logits a str")]
    cases += ["recv_ffn_output: ref_tensor a list"]
    rej = _check_arg_cases(cases, control)
    assert len(rej) == (6 + 2) * 2 + 4 + 1, sorted(rej)
    spec = rej["recv_attn_output: routing_spec '4' at (0, 0)"]["msg"]
    assert "routing_spec must be None or an AFDExpertRoutingSpec" in spec and "got str '4'" in spec, spec
    assert "got bool" not in spec
    assert "recv_input_ids must be a bool, got str 'yes'" in rej["recv_attn_output: recv_input_ids 'yes' at (1, 1)"]["msg"]
    assert "got object" in rej["send_ffn_output: context an object at (0, 0)"]["msg"]
    assert "context.metadata.layer_idx must be an int" in rej["send_attn_output: layer_idx '0'"]["msg"]
    assert "context.metadata.seq_lens must be a list" in rej["send_attn_output: seq_lens '3'"]["msg"]
    took = max(r["took"] for r in rej.values())
    print(f"\n[issue 34.3, {control}] {len(rej)} wrong argument types refused by name within {took * 1e3:.1f} ms; "
          "both steps exact on every rank")


def test_stage_arg_takes_ints_and_integral_floats_and_refuses_the_rest():
    """The rule behind item 4, without processes: what a stage index may be."""
    import math

    import numpy as np
    import torch

    from afd_ext.connector.sequencer import StepSequencer, stage_arg, exchange_order
    from afd_ext.errors import AFDConfigError

    for good, want in ((0, 0), (3, 3), (0.0, 0), (2.0, 2), (np.int64(1), 1), (np.float32(1.0), 1),
                       (torch.tensor(1), 1), (-1, -1)):
        got = stage_arg(good, "ubatch_idx")
        assert got == want and type(got) is int, (good, got)
    for bad in (None, "0", b"0", 0.5, math.nan, math.inf, True, False, np.bool_(True), [0], (0,), 1j,
                torch.tensor(0.5), object()):
        with pytest.raises(AFDConfigError, match="ubatch_idx must be an int stage id") as e:
            stage_arg(bad, "ubatch_idx")
        assert isinstance(e.value, ValueError)
    q = StepSequencer(1, "ffn", exchange_order(1, (0, 1)))
    with pytest.raises(AFDConfigError, match="got None"):
        q.next_fan_in(None, "recv_attn_output")  # was "the stage due"
    assert q.next_fan_in(0.0, "recv_attn_output") == (0, 0) and q.received == 0
