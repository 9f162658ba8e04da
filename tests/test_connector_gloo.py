"""The whole connector protocol over gloo, in several processes, strict mode on (CPU tier).

Every reply is checked against ``ffn_fn`` applied to the attention rank's own
rows (see ``tests/connector_scenarios.py``); the FFN ranks' row totals are
checked against the scenario's counts computed without afd_ext.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _run(sc, timeout_s: float = 90.0):
    """Run one scenario, or a tuple of scenarios with the same A/F in the same processes."""
    scs = sc if isinstance(sc, tuple) else (sc,)
    results = run_workers(cs.scenario_worker, scs[0].nprocs, (scs, find_free_port()), timeout_s=timeout_s)
    for i, one in enumerate(scs):
        cs.check_scenario_results(one, [r[i] for r in results])
    return [[r[i] for r in results] for i in range(len(scs))]


def _bf16_mixed(A: int, F: int, **kw) -> cs.Scenario:
    """bf16 wire, logits + ids, one stage small and one large."""
    steps = ({0: [2] * A}, {0: [1] + [0] * (A - 1), 1: [300] * A})
    return cs.Scenario(A=A, F=F, steps=steps, dtype="bfloat16", logits_width=4, send_ids=True, hidden=16,
                       **kw)


# -- topologies, counts, stages, optional tensors --------------------------------
# Each test starts A + F processes once and runs several scenarios in them.

def test_1a1f():
    _run((
        cs.Scenario(A=1, F=1, steps=cs.default_steps(1)),
        cs.Scenario(A=1, F=1, steps=cs.default_steps(1), logits_width=6, send_ids=True,
                    overlap=False),
        _bf16_mixed(1, 1),
    ))


def test_2a1f():
    res = _run((
        cs.Scenario(A=2, F=1, steps=cs.default_steps(2), logits_width=6, send_ids=True),
        cs.Scenario(A=2, F=1, steps=cs.default_steps(2), logits_width=6),
        _bf16_mixed(2, 1, overlap=False),
        # Reference compatibility switch: an idle rank sends a one-row dummy batch.
        cs.Scenario(A=2, F=1, steps=({0: [0, 3]}, {0: [2, 0]}), extra=(("clamp_idle_to_one", True),)),
    ))
    clamp = res[3]
    assert sorted(r["checked"] for r in clamp if r["role"] == "attention") == [[2, 4], [6, 2]]


def test_4a2f():
    _run(cs.Scenario(A=4, F=2, steps=cs.default_steps(4), logits_width=6, send_ids=True))


def test_3a2f():
    _run((
        cs.Scenario(A=3, F=2, steps=cs.default_steps(3), send_ids=True),
        cs.Scenario(A=3, F=2, steps=cs.default_steps(3), logits_width=6),
    ))


def test_1a2f():
    _run((
        cs.Scenario(A=1, F=2, steps=cs.default_steps(1), logits_width=6, send_ids=True),
        cs.Scenario(A=1, F=2, steps=({0: [7]}, {0: [1]}, {0: [0], 1: [5]}), logits_width=6),
    ))


def test_2a2f_dp1_tp2():
    # Per-DP count vectors, expanded over the TP workers of the DP rank.
    steps = ({0: [5]}, {0: [0]}, {0: [3], 1: [2]}, {0: [1]})
    res = _run((
        cs.Scenario(A=2, F=2, tp_size=2, steps=steps, logits_width=6, send_ids=True),
        cs.Scenario(A=2, F=2, tp_size=2, steps=steps),
    ))
    for one in res:
        attn = sorted((r for r in one if r["role"] == "attention"), key=lambda r: r["rank"])
        assert attn[0]["checked"] == attn[1]["checked"] == [10, 0, 10, 2]


# -- failures -----------------------------------------------------------------

def test_handshake_mismatch_names_field_and_values():
    sc = cs.Scenario(A=2, F=1)
    res = run_workers(cs.handshake_mismatch_worker, sc.nprocs, (sc, find_free_port()), timeout_s=60)
    for r in res:
        assert r["field"] == "hidden_size"
        assert "8" in r["message"] and "16" in r["message"]
        assert not r["initialized"]


def test_handshake_mismatch_graph_cache_size():
    """Both roles' graph caches must be the same size (they must evict the same graphs)."""
    sc = cs.Scenario(A=1, F=1)
    res = run_workers(cs.handshake_mismatch_worker, sc.nprocs, (sc, find_free_port(), "graph_cache_size"),
                      timeout_s=60)
    for r in res:
        assert r["field"] == "graph_cache_size", r
        assert "8" in r["message"] and "16" in r["message"] and not r["initialized"]


@pytest.mark.parametrize("retry", [False, True], ids=["next-step", "retry"])
def test_bad_first_input_is_rejected_and_next_step_works(retry):
    steps = ({0: [2, 3]}, {0: [4, 1]}, {0: [3, 3], 1: [1, 2]})
    sc = cs.Scenario(A=2, F=1, steps=steps)
    res = run_workers(cs.bad_first_input_worker, sc.nprocs, (sc, find_free_port(), 0, 1, retry), timeout_s=60)
    bad = res[1]  # world rank 1 = attention rank 0 (the control sender)
    assert len(bad["rejections"]) == 1 and "float64" in bad["rejections"][0]
    assert bad["checked"][0] == 2 * 2 and bad["checked"][2] == (3 + 1) * 2
    assert bad["checked"][1] == (4 * 2 if retry else 0)
    other = res[2]
    assert other["rejections"] == [] and other["checked"] == [3 * 2, 1 * 2, (3 + 2) * 2]
    assert res[0]["rows"] == [5 * 2, 5 * 2, 9 * 2]


def test_decode_pattern_one_exchange_per_stage_in_flight_is_enforced_and_the_step_completes():
    # The margin probe's order (layer 1 sent before layer 0's reply) is refused on every transport;
    # over peer memory it had overrun the plane's one slot per stage (tests/gpu/test_connector_peer.py).
    sc = cs.Scenario(A=1, F=1, steps=({0: [8]},) * 3, layers=4, hidden=64)
    cs.check_decode_pattern(sc, run_workers(cs.decode_pattern_worker, 2, (sc, find_free_port()), timeout_s=60))


def test_mid_step_failure_aborts_every_rank_then_reinit_works():
    steps = ({0: [2, 3]}, {0: [1, 2]}, {0: [3, 1]})
    sc = cs.Scenario(A=2, F=1, steps=steps, step_timeout_s=10.0)
    res = run_workers(cs.mid_step_failure_worker, sc.nprocs, (sc, find_free_port(), 1), timeout_s=90)
    ffn, a0, a1 = res
    kind, msg = a1["rejection"]
    assert kind == "AFDConfigError" and "layer 1" in msg and "aborted" not in msg, a1["rejection"]
    assert a1["error"][0] == "AFDStateError" and "aborted on every rank" in a1["error"][1], a1["error"]
    for r in (ffn, a0):
        kind, msg = r["error"]
        assert kind == "StepAbortedError", r["error"]
        assert "attention rank 1" in msg and "rejected call" in msg, msg
        assert r["elapsed"] < sc.step_timeout_s, r
    assert all(r["usable_after"] for r in res)
    assert ffn["after"] == 4 * 2 and a0["after"] == 3 * 2 and a1["after"] == 1 * 2


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_peer_loss_mid_step_is_a_named_error_within_the_deadline(mode):
    steps = ({0: [2, 3]}, {0: [2, 2]})
    deadline = 3.0
    sc = cs.Scenario(A=2, F=1, steps=steps, step_timeout_s=deadline)
    victim = 2  # attention rank 1
    t0 = time.monotonic()
    out = cs.run_tolerating_death(cs.peer_loss_worker, sc.nprocs, (sc, find_free_port(), victim, mode),
                                  timeout_s=90, may_die=[victim] if mode == "kill" else [])
    ffn, a0 = out[0], out[1]
    for r in (ffn, a0):
        assert "error" in r, r
        msg = r["error"][1]
        assert "attention rank 1" in msg and "layer 1" in msg and "stage 0" in msg, r["error"]
        # the fan-in names the peer whose rows are missing, and only that one
        assert "waiting on attention rank 1 (world rank 2)" in msg, r["error"]
        assert "waiting on attention rank 0" not in msg, r["error"]
        limit = deadline + 2.0 if mode == "stall" else 2.0
        assert r["elapsed"] < limit, r
    if mode == "kill":
        assert ffn["error"][0] == "AFDPeerError", ffn["error"]
        assert out["exitcodes"][victim] != 0
    else:
        assert ffn["error"][0] == "AFDTimeoutError", ffn["error"]
        # The stalled rank wakes up to an aborted step (or a store already gone with FFN rank 0).
        assert "error" in out[victim], out[victim]
    assert out["exitcodes"][0] == 0 and out["exitcodes"][1] == 0
    assert time.monotonic() - t0 < 60


def test_strict_header_mismatch_names_both_sides():
    res = run_workers(cs.strict_mismatch_worker, 2, (find_free_port(),), timeout_s=60)
    err = res[0]["error"]
    assert err is not None and res[0]["field_layer"]
    assert "FFN rank 0" in err and "attention rank 0" in err
    assert "layer 0" in err and "layer 1" in err


# -- single-process checks --------------------------------------------------------

def test_constructor_is_device_light_and_validates():
    from afd_ext.config import AFDConfig
    from afd_ext.connector import AFDConnector, ConnectorStateError

    cfg = AFDConfig(role="attention", num_attention_ranks=2, num_ffn_ranks=1,
                    connector_extra_config={"transport": "gloo"})
    c = AFDConnector(0, 0, cfg, 1, hidden_size=8, num_layers=2)
    assert c.world_rank == 2 and c.device == torch.device("cpu") and not c.is_initialized
    with pytest.raises(ConnectorStateError, match="not initialized"):
        c.send_attn_output(torch.zeros(1, 8, dtype=torch.bfloat16), None)
    with pytest.raises(ConnectorStateError, match="not initialized"):
        c.control_plane.send_dp_metadata_list(None)
    c.close()
    c.close()
    with pytest.raises(TypeError, match="unknown keyword"):
        AFDConnector(0, 0, cfg, 0, hidden_size=8, num_layers=2, hiden_size=3)
    with pytest.raises(ValueError, match="hidden_size"):
        AFDConnector(0, 0, cfg, 0, num_layers=2)
    with pytest.raises(ValueError):
        AFDConnector(0, 0, cfg, 2, hidden_size=8, num_layers=2)  # role rank out of range


def test_watchdog_names_op_peer_layer_stage_and_aborts():
    from afd_ext.errors import StepAbortedError
    from afd_ext.health.watchdog import Watchdog
    from afd_ext.transport.base import AFDPeerError, AFDTimeoutError
    from afd_ext.transport.nccl import CommErrors

    failures = []
    wd = Watchdog(0.05, owner="FFN rank 0", on_failure=failures.append)
    wd.track(lambda: False, "recv_attn_output: receive (fan-in)", peers=["attention rank 1"], layer=3, stage=1,
             where="step 2, layer 3, stage 1")
    wd.track(lambda: True, "done op")
    wd.poll_once()
    assert wd.failure is None and len(wd.in_flight) == 1
    time.sleep(0.06)
    wd.poll_once()
    assert isinstance(wd.failure, AFDTimeoutError) and failures == [wd.failure]
    msg = str(wd.failure)
    assert "attention rank 1" in msg and "layer 3" in msg and "stage 1" in msg and "recv_attn_output" in msg
    with pytest.raises(AFDTimeoutError):
        wd.check()

    wd2 = Watchdog(10, owner="x", polls=[CommErrors(lambda: [(5, "a2f a0-f0")], lambda h: 6)])
    wd2.poll_once()
    assert isinstance(wd2.failure, AFDPeerError) and "a2f a0-f0" in str(wd2.failure)
    wd3 = Watchdog(10, owner="x", polls=[CommErrors(lambda: [(5, "a2f a0-f0")], lambda h: 7)])
    wd3.poll_once()
    assert wd3.failure is None  # ncclInProgress is not an error

    wd4 = Watchdog(10, owner="x", abort_check=lambda: StepAbortedError("bad input", "attention rank 1"),
                   poll_interval_s=0.001, abort_poll_s=0.001)
    wd4.start()
    t0 = time.monotonic()
    while wd4.failure is None and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    wd4.stop()
    assert wd4.failure is not None and "attention rank 1" in str(wd4.failure)


def test_watchdog_blame_names_the_culprit_and_on_tick_sees_the_oldest_op():
    from afd_ext.transport.base import AFDTimeoutError, MessageTag
    from afd_ext.health.watchdog import Watchdog

    ticks = []
    wd = Watchdog(0.05, owner="FFN rank 0", poll_interval_s=0.001, abort_poll_s=0.001,
                  blame=lambda op: ("waiting on attention rank 1 (world rank 2): it has not issued the matching send",
                                    ["attention rank 1 (world rank 2)"]),
                  on_tick=lambda now, oldest: ticks.append(oldest))
    tag = MessageTag("recv_attn_output", "a2f", 3, 1, 0)
    first = wd.track(lambda: False, "recv_attn_output: receive (fan-in)",
                     peers=["attention rank 0 (world rank 1)", "attention rank 1 (world rank 2)"], layer=1, stage=0,
                     where=tag.where(), tag=tag, peer_ranks=[1, 2])
    wd.track(lambda: False, "synchronize: wait for every exchange issued", peers=["every peer"], where="step 3")
    assert wd.oldest() is first
    wd.start()
    t0 = time.monotonic()
    while wd.failure is None and time.monotonic() - t0 < 5:
        time.sleep(0.005)
    wd.stop()
    err = wd.failure
    assert isinstance(err, AFDTimeoutError), err
    # the oldest unfinished op is reported (not the later synchronize), with the blame's verdict
    assert err.layer == 1 and err.stage == 0 and err.op == "recv_attn_output: receive (fan-in)"
    assert err.peer == "attention rank 1 (world rank 2)"
    assert "step 3, layer 1, stage 0" in str(err) and "waiting on attention rank 1" in str(err)
    assert ticks and ticks[0] is first

    # a failing blame hook does not lose the timeout
    def broken(op):
        raise RuntimeError("store gone")

    wd2 = Watchdog(0.01, owner="x", blame=broken)
    wd2.track(lambda: False, "recv_ffn_output: receive (fan-in)", peers=["FFN rank 0 (world rank 0)"], layer=0,
              stage=1, where="step 1, layer 0, stage 1")
    time.sleep(0.02)
    wd2.poll_once()
    assert isinstance(wd2.failure, AFDTimeoutError) and wd2.failure.peer == "FFN rank 0 (world rank 0)"


class _DictStore:
    """The few AFDStore methods the progress reports use, over a dict (one process, threads)."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else bytes(value)

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, key):
        return self.d[key]


class _Rank:
    """One rank's stall reports over a shared store, with its step position set by the test."""

    SEQ = ((0, 0), (1, 0))  # two layers, one stage

    def __init__(self, role: str, role_rank: int, store, *, A=2, F=1, timeout_s=5.0):
        from afd_ext.transport.base import PeerMap
        from afd_ext.health.stall import StallReports

        self.step, self.sent, self.received, self.idle_s = 1, 0, 0, 0.0
        self.role = role
        self.data_timeout_s = timeout_s if role == "ffn" else timeout_s + min(5.0, timeout_s / 2)
        self.publish_after_s = 0.4 * self.data_timeout_s
        self.reports = StallReports(store, PeerMap(role, role_rank, A, F), self.progress, self.publish_after_s)

    def progress(self):
        from afd_ext.transport.base import StepProgress

        done = (self.received if self.role == "attention" else self.sent) >= len(self.SEQ)
        text = (f"{self.sent} of 2 exchanges sent, {self.received} replies received" if self.role == "attention"
                else f"{self.received} of 2 exchanges received, {self.sent} replies sent")
        return StepProgress(self.step, len(self.SEQ), self.sent, self.received, done, self.SEQ, text, self.idle_s)


def test_connector_progress_snapshot_matches_its_step():
    """The connector hands its transport a StepProgress snapshot of its sequencer (sent/received/total/seq)."""
    from afd_ext.config import AFDConfig
    from afd_ext.connector import AFDConnector
    from afd_ext.metadata import AFDControlPayload
    from afd_ext.schedule import build_step_schedule

    cfg = AFDConfig(role="attention", num_attention_ranks=2, num_ffn_ranks=1,
                    connector_extra_config={"transport": "gloo", "step_timeout_s": 5.0})
    c = AFDConnector(0, 0, cfg, 0, hidden_size=8, num_layers=2)
    assert c._s.progress() is None  # not initialised
    c._s.initialized = True
    payload = AFDControlPayload({0: [2, 3]})
    c._s.start_step(build_step_schedule(c.topology, payload, c.schedule_config), payload)
    c._s.step.seq.sent, c._s.step.seq.received = 2, 1
    p = c._s.progress()
    assert (p.step, p.total, p.sent, p.received, p.complete, p.seq) == (1, 2, 2, 1, False, ((0, 0), (1, 0)))
    assert p.text == "2 of 2 exchanges sent, 1 replies received" and p.idle_s >= 0


def test_progress_reports_let_a_fan_in_timeout_name_the_stalled_or_dead_attention_rank():
    """NCCL fan-in completes as a whole: the FFN names the missing peer from the peers' progress reports."""
    from afd_ext.transport.base import MessageTag
    from afd_ext.health.watchdog import TrackedOp

    store = _DictStore()
    ffn = _Rank("ffn", 0, store)
    a0 = _Rank("attention", 0, store)
    a1 = _Rank("attention", 1, store)
    # layer 0 (exchange 0) done everywhere; a0 also sent layer 1, a1 did not
    a0.sent, a0.received = 2, 1
    a1.sent, a1.received = 1, 1
    ffn.received, ffn.sent = 2, 2
    now = time.monotonic()
    thr = a0.publish_after_s
    assert 0 < thr < ffn.data_timeout_s
    # healthy / not yet slow: nothing is published (no store traffic)
    reply = TrackedOp(lambda: False, "recv_ffn_output: receive (fan-in)", ("FFN rank 0 (world rank 0)",), 1, 0,
                      "step 1, layer 1, stage 0", started=now - thr / 2)
    a0.reports.tick(now, reply)
    a1.idle_s = thr / 2
    a1.reports.tick(now, None)
    assert store.d == {}
    # a0 waits on its reply for long, a1 is idle mid-step in its caller
    reply.started = now - thr - 0.1
    a0.reports.tick(now, reply)
    a1.idle_s = thr + 0.1
    a1.reports.tick(now, None)
    assert set(store.d) == {"progress/1", "progress/2"}
    step = ffn.step
    peers = ("attention rank 0 (world rank 1)", "attention rank 1 (world rank 2)")
    fan_in = TrackedOp(lambda: False, "recv_attn_output: receive (fan-in)", peers, 1, 0,
                       f"step {step}, layer 1, stage 0", tag=MessageTag("recv_attn_output", "a2f", step, 1, 0),
                       peer_ranks=(1, 2))
    text, culprits = ffn.reports.blame(fan_in)
    assert culprits == ["attention rank 1 (world rank 2)"], text
    assert "waiting on attention rank 1 (world rank 2): it has not issued the matching send" in text
    assert "idle in its caller" in text and "waiting on attention rank 0" not in text
    assert "attention rank 0 (world rank 1) issued the matching send" in text
    # a dead rank publishes nothing
    del store.d["progress/2"]
    text, culprits = ffn.reports.blame(fan_in)
    assert culprits == ["attention rank 1 (world rank 2)"] and "probably dead" in text, text
    # the attention side's reply receive blames the FFN rank by its replies sent
    store.d.clear()
    ffn.sent = 1
    ffn_wait = TrackedOp(lambda: False, "recv_attn_output: receive (fan-in)", peers, 1, 0, "",
                         started=now - ffn.publish_after_s - 0.1)
    ffn.reports.tick(now, ffn_wait)
    reply_op = TrackedOp(lambda: False, "recv_ffn_output: receive (fan-in)", ("FFN rank 0 (world rank 0)",), 1, 0,
                         "", tag=MessageTag("recv_ffn_output", "f2a", step, 1, 0), peer_ranks=(0,))
    text, culprits = a0.reports.blame(reply_op)
    assert culprits == ["FFN rank 0 (world rank 0)"] and "1 of 2 exchanges sent" in text, text
    assert "recv_attn_output: receive (fan-in)" in text  # what the FFN rank itself is waiting on
    # a send waits on the peer's receive
    send_op = TrackedOp(lambda: False, "send_ffn_output: send (split-back)", peers, 1, 0, "",
                        tag=MessageTag("send_ffn_output", "f2a", step, 1, 0), peer_ranks=(1, 2))
    a0.reports.forget()  # the store was wiped above; a0 reports again
    a0.reports.tick(now, reply)
    text, culprits = ffn.reports.blame(send_op)
    assert "waiting on attention rank 0 (world rank 1): it has not issued the matching receive" in text, text
    assert "1 of 2 exchanges received" in text  # a0 issued only layer 0's reply receive
    assert culprits == ["attention rank 0 (world rank 1)", "attention rank 1 (world rank 2)"]


def test_headers_round_trip_and_mismatch():
    from afd_ext.transport.base import AFDProtocolError, MessageTag, PeerMap
    from afd_ext.transport.strict import check_headers, encode_headers

    pm = PeerMap("ffn", 0, 2, 1)
    h = torch.zeros(3, 8)
    ids = torch.zeros(3, dtype=torch.int32)
    tag = MessageTag("recv_attn_output", "a2f", 4, 2, 1)
    msgs = [h, ids]  # the exchange's tensors, in wire order
    block = encode_headers(tag, 2, 0, 3, msgs)
    check_headers(block.clone(), block, tag=tag, receiver_label="r", sender_label="s", label=pm.label)
    other = encode_headers(tag, 2, 0, 4, msgs)
    with pytest.raises(AFDProtocolError, match="'rows'") as ei:
        check_headers(other, block, tag=tag, receiver_label="FFN rank 0", sender_label="attention rank 1",
                      label=pm.label)
    assert "[3, 8]" in str(ei.value) and "[4, 8]" in str(ei.value)


def test_a_remote_error_waits_for_the_posted_abort_that_names_the_root_cause():
    """A peer that posts the step abort and then aborts its communicators shows here as ncclRemoteError
    first; the posted abort (naming the failed rank) must win if it arrives within REMOTE_GRACE_S."""
    from afd_ext.errors import StepAbortedError
    from afd_ext.health.watchdog import Watchdog
    from afd_ext.transport.base import AFDPeerError
    from afd_ext.transport.nccl import REMOTE_GRACE_S, CommErrors

    posted: list[StepAbortedError] = []
    wd = Watchdog(10, owner="attention rank 0", polls=[CommErrors(lambda: [(5, "f2a a0-f0")], lambda h: 6)],
                  abort_check=lambda: posted[0] if posted else None)
    t0 = time.monotonic()
    wd.poll_once(now=t0)
    assert wd.failure is None  # within the grace: the abort thread may still name the root cause
    posted.append(StepAbortedError("attention rank 1 (world rank 2) stalled", "FFN rank 0"))
    wd.fail(posted[0])  # what the watchdog does when its store round reads the post
    wd.poll_once(now=t0 + REMOTE_GRACE_S + 0.1)
    assert "attention rank 1 (world rank 2)" in str(wd.failure)

    alone = Watchdog(10, owner="attention rank 0", polls=[CommErrors(lambda: [(5, "f2a a0-f0")], lambda h: 6)],
                     abort_check=lambda: None)
    alone.poll_once(now=t0)
    assert alone.failure is None
    alone.poll_once(now=t0 + REMOTE_GRACE_S + 0.1)  # no abort posted: the communicator's error itself
    assert isinstance(alone.failure, AFDPeerError) and "ncclRemoteError" in str(alone.failure)
