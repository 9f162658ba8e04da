"""afd_ext under the real vLLM (each tested version) and afd-plugin (2e4378f), over gloo on CPU (``make test-vllm``).

Every scenario runs real ``VllmConfig`` objects through afd-plugin's factory, its FFN runner inside
its ``AFDFFNWorker`` loop thread, and its attention-side MoE modules (see ``vllm_workers.py``); every
reply is checked exactly on the attention side, and the FFN side records each call of its model.
Scenarios of one topology share worker processes (importing vLLM takes most of a worker's start).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

pytest.importorskip("vllm.config", reason="the vLLM integration suite runs in make test-vllm's environment")
pytest.importorskip("afd_plugin.v1.worker.ffn_worker", reason="needs afd-plugin (make test-vllm)")

from afd_ext.integrations.afd_plugin import versions  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402

import vllm_workers as W  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

VLLM = versions()["vllm"]
#: afd-plugin 2e4378f's attention-side MoE sends the hidden states as router logits under vLLM 0.30
#: (whose DeepseekV2MoE.forward passes router_logits=hidden_states, its gate moved into FusedMoE);
#: afd_ext refuses that call by its shape. So the gate-on-attention scenarios run on 0.26.0 only.
GATE_ON_ATTENTION = VLLM == W.FULL_SUITE_VLLM

WARM = {0: {"is_warmup": True}, 1: {"is_graph_capturing": True}, 2: {"is_graph_capturing": True}}
TWO_STAGES = ({0: [3], 1: [2]}, {0: [1], 1: [4]}, {0: [6], 1: [1]})

#: 1A1F: both control channels, both shutdown orders over each, the gate on attention with bf16 and
#: float32 router logits (moe_router_dtype, glm_moe_dsa), two stages, warm-up and capture flags,
#: an idle gap four times the heartbeat timeout, torch.compile of the plugin's modules.
ONE_ONE = (
    W.Scenario("shm-attn_first", control="shm", order="attn_first"),
    W.Scenario("shm-ffn_first", control="shm", order="ffn_first"),
    W.Scenario("tcp-attn_first", control="tcp", order="attn_first"),
    W.Scenario("tcp-ffn_first", control="tcp", order="ffn_first"),
    W.Scenario("gate-bf16", gate=True, model="dsv3", control="shm"),
    W.Scenario("gate-f32-moe_router_dtype", gate=True, model="dsv3_fp32router", control="tcp", order="ffn_first"),
    W.Scenario("gate-f32-glm_moe_dsa", gate=True, model="glm_moe_dsa", control="shm"),
    W.Scenario("two-stages", gate=True, steps=TWO_STAGES),
    W.Scenario("warmup-capture-flags", steps=({0: [2]}, {0: [4]}, {0: [4]}, {0: [3]}, {0: [4]}), flags=WARM),
    W.Scenario("idle-gap", control="tcp", heartbeat_timeout_s=0.5, idle_before={1: 2.0}),
    W.Scenario("compile-aot_eager", gate=True, compile="aot_eager", steps=({0: [3]}, {0: [5]}, {0: [2]})),
    W.Scenario("compile-inductor", compile="inductor", steps=({0: [3]}, {0: [5]})),
    W.Scenario("router-dtype-mismatch", gate=True, model="dsv3_fp32router", ffn_model="dsv3", mismatch=True),
)
#: 1A1F, a stop with a step in flight (the FFN loop thread waiting in recv_attn_output): both orders, both channels.
IN_FLIGHT = tuple(W.Scenario(f"in-flight-{c}-{o}", control=c, order=o, in_flight={0: [4]}, steps=({0: [3]},))
                  for c in ("shm", "tcp") for o in ("ffn_first", "attn_first"))
#: 2A1F with attention DP=2 (vLLM's DPMetadata.make), an idle DP rank's one-token dummy batch.
TWO_ONE = (
    W.Scenario("2A1F-dp2", attn=(2, 1), steps=({0: [3, 2]}, {0: [0, 4]}, {0: [5, 0]})),
    W.Scenario("2A1F-dp2-gate-two-stages", attn=(2, 1), gate=True, model="glm_moe_dsa", control="tcp",
               order="ffn_first", steps=({0: [3, 1], 1: [2, 2]}, {0: [0, 3], 1: [1, 0]})),
)
#: 2A2F: attention TP2 and FFN TP2 in vLLM's own model-parallel state, the gate on either side.
TWO_TWO = (W.Scenario("2A2F-tp2-gate", attn=(1, 2), ffn=(1, 2), gate=True, steps=({0: [3]}, {0: [1]})),
           W.Scenario("2A2F-tp2", attn=(1, 2), ffn=(1, 2), control="tcp", steps=({0: [2]}, {0: [4]})))


def _here(group):
    """The scenarios this vLLM runs (see GATE_ON_ATTENTION)."""
    return tuple(sc for sc in group if GATE_ON_ATTENTION or not sc.gate)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = {}
    for key in W.MODELS:
        d = tmp_path_factory.mktemp(key)
        (d / "config.json").write_text(json.dumps(W.model_config_json(key)))
        out[key] = str(d)
    return out


def _world_port():
    """A base port whose offsets the vLLM worlds use are free (each role's world and DP master port)."""
    import socket

    for _ in range(50):
        base = find_free_port()
        try:
            socks = []
            for off in (0, 1, 50, 51, 60, 61, 62, 70, 71, 72):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range for the vLLM worlds")


def _run(group, model_dirs, timeout_s):
    nprocs = group[0].nprocs
    ports = tuple(find_free_port() for _ in group)
    done = mp.get_context("spawn").Barrier(nprocs)
    recs = run_workers(W.worker, nprocs, (group, ports, _world_port(), model_dirs, done), timeout_s=timeout_s,
                       env={"AFD_EXT_REPLACE_P2P": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                            "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    return [{sc.name: recs[r][i] for i, sc in enumerate(group)} for r in range(nprocs)]


def _expected_ffn_calls(sc):
    """The FFN model's calls, in the runner's order: per step, per layer, per stage; with the sizes
    vLLM's MoE runner finds (each DP rank's count split over SP ranks, as vLLM's DPMetadata)."""
    layers = range(1, W.LAYERS) if sc.gate else range(W.LAYERS)
    calls = []
    for step in sc.steps:
        for layer in layers:
            for s in sorted(step):
                rows = sum(max(1, c) for c in step[s])  # fan-in of every attention DP rank (idle: 1 row)
                calls.append((layer, rows, sc.gate, [-(-c // W.SP) for c in step[s] for _ in range(W.SP)]))
    return calls


def _check(group, recs):
    for sc in group:
        for rank, by_name in enumerate(recs):
            rec = by_name[sc.name]
            if sc.mismatch:
                msg = rec["error"]
                assert "HandshakeMismatchError" in msg and "router_logits" in msg, msg
                assert "float32" in msg and "bfloat16" in msg, msg  # both sides' values
                continue
            infos = [m for m in rec["logged"] if " is the AFD connector " in m]
            assert len(infos) == 1, (sc.name, rec["logged"])  # one INFO line at connector init
            assert infos[0].startswith("INFO afd_ext ") and f"(vLLM {VLLM}, afd-plugin " in infos[0], infos[0]
            # An attention rank that is no FFN rank's control source holds no channel ("none").
            channels = (sc.control, "none") if rec["role"] == "attention" else (sc.control,)
            assert any(infos[0].endswith(f"transport gloo, topology {sc.A}A{sc.F}F, control channel {c}")
                       for c in channels), infos[0]
            assert not [m for m in rec["logged"] if m.startswith(("WARNING", "ERROR"))], rec["logged"]
            if rec["role"] == "ffn":
                want = _expected_ffn_calls(sc)
                assert rec["calls"] == want, (sc.name, rank, rec["calls"], want)
                assert rec["shutdown_s"] < 1.0, (sc.name, rec["shutdown_s"])
                assert "afd-ffn-worker-loop" not in rec["thread_names"], (sc.name, rec["thread_names"])
                if sc.gate:
                    assert rec["router_dtype"] == ("torch.bfloat16" if sc.model == "dsv3" else "torch.float32")
            else:
                layers = W.LAYERS - 1 if sc.gate else W.LAYERS
                assert rec["checked"] == layers * sum(len(step) for step in sc.steps), (sc.name, rec)
                if sc.in_flight is not None and sc.order == "ffn_first":  # the closed FFN rank is named, promptly
                    err = rec["stop_error"]
                    assert err.startswith("PeerClosedError: ") and "FFN rank 0 (world rank 0) closed its " \
                        "connector (an orderly close(), not a failure)" in err, err
                    assert rec["stop_error_s"] < 5.0, rec  # step_timeout_s is 120
                else:
                    assert "stop_error" not in rec, rec
                if sc.compile:
                    assert rec["graphs"] and all(n >= 1 for n in rec["graphs"]), (sc.name, rec["graphs"])


def test_one_attention_one_ffn(model_dirs):
    """1A1F: 13 scenarios in the same two processes (see ONE_ONE)."""
    recs = _run(ONE_ONE, model_dirs, timeout_s=900)
    _check(ONE_ONE, recs)


@pytest.mark.every_vllm
def test_a_stop_with_a_step_in_flight(model_dirs):
    """1A1F, the FFN loop thread in recv_attn_output when the FFN worker shuts down (the attention side's next
    call: PeerClosedError naming it) or the attention side closes: the loop ends within 1 s, nothing is recorded,
    vLLM's Worker.shutdown() runs; over the shm and TCP control channels (see IN_FLIGHT)."""
    recs = _run(_here(IN_FLIGHT), model_dirs, timeout_s=600)
    _check(_here(IN_FLIGHT), recs)


@pytest.mark.every_vllm
def test_two_attention_one_ffn_dp2(model_dirs):
    recs = _run(_here(TWO_ONE), model_dirs, timeout_s=600)
    _check(_here(TWO_ONE), recs)


@pytest.mark.every_vllm
def test_two_attention_two_ffn_tp2(model_dirs):
    """2A2F with TP2 on both roles: four vLLM workers on the CI box's two cores (time-boxed)."""
    recs = _run(_here(TWO_TWO), model_dirs, timeout_s=600)
    _check(_here(TWO_TWO), recs)


@pytest.mark.parametrize("control", ["tcp", "shm"])
def test_a_dead_attention_peer_is_a_failure_not_a_shutdown(model_dirs, control):
    """The attention process exits without closing: the FFN loop ends in PeerDeadError, which afd-plugin
    records and stop_ffn_server_loop raises ("AFD FFN worker loop failed"); no quiet exit."""
    sc = W.Scenario(f"attention-dies-{control}", control=control, heartbeat_timeout_s=1.0, attention_dies=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = ((sc,), (find_free_port(),), _world_port(), model_dirs, ctx.Barrier(sc.nprocs))
    procs = [ctx.Process(target=W.worker_to_queue, args=(r, sc.nprocs, args, q), daemon=True) for r in range(2)]
    env = {"AFD_EXT_REPLACE_P2P": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        rank, status, rec = q.get(timeout=300)
        assert (rank, status) == (0, "ok"), rec
        procs[1].join(60)
        assert procs[1].exitcode == 0
    finally:
        for p in procs:
            p.kill() if p.is_alive() else None
    rec = rec[0]
    assert rec["calls"] == _expected_ffn_calls(sc)  # it served every step first
    assert rec["loop_error"].startswith("PeerDeadError: ") and "attention rank 0" in rec["loop_error"], rec
    assert rec["stop_error"] == "AFD FFN worker loop failed" and rec["cause"] == "PeerDeadError", rec
    assert rec["worker_shutdown_ran"] == 0  # afd-plugin's shutdown stops at the raised failure


@pytest.mark.every_vllm
@pytest.mark.parametrize("control,killed", [("shm", False), ("tcp", True)], ids=["goodbye-shm", "killed-tcp"])
def test_a_restarted_attention_process_rejoins_the_running_ffn_worker(model_dirs, control, killed):
    """Issue 45, on_attention_exit "rejoin": the attention process runs its steps and exits (closing in
    order, or SIGKILLed: no goodbye), then a new attention process runs its steps and closes: the same
    AFDFFNWorker loop thread (its process and weights kept) serves both, every reply checked exactly.
    While it waits, the FFN side logs at WARNING whom it waits for; the worker's shutdown() ends its wait
    for a third process at once, quietly (vLLM's Worker.shutdown() runs)."""
    import dataclasses
    import time

    sc = W.Scenario(f"rejoin-{control}", control=control, steps=({0: [3]}, {0: [5]}), rejoin=(({0: [2]}, {0: [4]}),),
                    killed=killed, heartbeat_timeout_s=1.0)
    lives = (sc.steps, *sc.rejoin)
    ctx = mp.get_context("spawn")
    q, go, port = ctx.Queue(), ctx.Event(), find_free_port()
    env = {"AFD_EXT_REPLACE_P2P": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    procs, readies, barriers = [], [ctx.Event() for _ in lives], [ctx.Barrier(1) for _ in lives]  # kept alive

    def start(rank, scenario, done, ready=None):
        args = ((scenario,), (port,), _world_port(), model_dirs, done)
        procs.append(ctx.Process(target=W.worker_to_queue, args=(rank, 2, args, q, ready), daemon=True))
        procs[-1].start()
        return procs[-1]

    def result(rank):
        got = q.get(timeout=600)
        assert got[:2] == (rank, "ok"), got
        return got[2][0]

    try:
        start(0, sc, go)
        attention = []
        for k, steps in enumerate(lives):
            one = dataclasses.replace(sc, steps=steps, killed=killed and k == 0)
            p = start(1, one, barriers[k], readies[k])  # imports vLLM now, connects once ready is set
            if k:
                time.sleep(8.0)  # more than one interval (init_timeout_s / 10) of the FFN side's wait passes
            readies[k].set()
            if not one.killed:
                attention.append(result(1))
            p.join(600)
            assert p.exitcode == (-9 if one.killed else 0), p.exitcode
        go.set()
        ffn = result(0)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        for p in procs:
            p.kill() if p.is_alive() else None
    assert ffn["calls"] == W._ffn_calls(sc), (ffn["calls"], W._ffn_calls(sc))  # one loop served every process
    assert ffn["shutdown_s"] < 1.0, ffn["shutdown_s"]  # init_timeout_s is 60
    assert len([m for m in ffn["logged"] if " is the AFD connector " in m]) == 1, ffn["logged"]  # one connector
    waits = [m for m in ffn["logged"] if "on_attention_exit is 'rejoin': waiting up to init_timeout_s" in m]
    assert len(waits) == len(lives) and all(m.startswith("WARNING ") for m in waits), ffn["logged"]
    assert ("PeerDeadError" if killed else "ControlChannelClosed") in waits[0], waits[0]
    still = [m for m in ffn["logged"] if m.startswith("WARNING ") and "still waits for" in m]
    assert still and all("attention rank 0 (world rank 1)" in m for m in still), ffn["logged"]
    assert not [m for m in ffn["logged"] if m.startswith("ERROR")], ffn["logged"]
    for rec, steps in zip(attention, lives[1:] if killed else lives):
        assert rec["checked"] == W.LAYERS * len(steps), rec  # every reply checked exactly
