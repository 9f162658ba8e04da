"""The connector scenarios over the peer-memory transport (GPU tier), and the ``auto`` rule.

Processes are placed by :func:`afd_ext.tools.testing.place_processes`: on two GPUs
attention processes on GPU 0 and FFN processes on GPU 1 (CUDA IPC over
NVLink); on one GPU every process on GPU 0 (CUDA IPC within one GPU,
time-sliced: correctness only). The peer transport also builds its NCCL
fallback (steps beyond its capacity, strict-mode headers), which on one GPU
needs the per-process ``NCCL_HOSTID`` the placement sets.

Connector-level CUDA graphs over peer memory: the reference runner's graph
protocol (``tests/plugin_runners.py``: the FFN forward captured once, 200
replays with fresh inputs bit-exact, an eager step with larger counts between
replays) at 1A1F and 2A1F with the NCCL fallback off.

Run: ``pytest -m gpu tests/gpu/test_connector_peer.py -v``.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import connector_scenarios as cs  # noqa: E402
from afd_ext.tools.testing import find_free_port, place_processes, run_workers  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def _env(sc: cs.Scenario) -> list[dict]:
    diag = {"AFD_TEST_LOG_LEVEL": os.environ.get("AFD_TEST_LOG_LEVEL", "INFO"),
            "AFD_TEST_STACK_DUMP_S": os.environ.get("AFD_TEST_STACK_DUMP_S", "90")}
    return [{**e, **diag} for e in place_processes(sc.A, sc.F).env()]


def _run(scs, *, transport: str = "peer", expect: str = "peer", timeout_s: float = 200.0):
    scs = tuple(cs.replace(s, transport=transport) for s in (scs if isinstance(scs, tuple) else (scs,)))
    results = run_workers(cs.scenario_worker, scs[0].nprocs, (scs, find_free_port()), timeout_s=timeout_s,
                          per_rank_env=_env(scs[0]))
    for i, one in enumerate(scs):
        per_scenario = [r[i] for r in results]
        cs.check_scenario_results(one, per_scenario)
        assert {r["transport"] for r in per_scenario} == {expect}, [r["transport"] for r in per_scenario]
    return [[r[i] for r in results] for i in range(len(scs))]


@pytest.mark.parametrize(
    "A,F,tp",
    [(1, 1, 1), (2, 1, 1), (4, 2, 1), (3, 2, 1), (1, 2, 1), (2, 2, 2)],
    ids=["1A1F", "2A1F", "4A2F", "3A2F", "1A2F", "2A2F-DP1xTP2"],
)
def test_topologies_peer(A, F, tp):
    steps = cs.default_steps(A) if tp == 1 else ({0: [5]}, {0: [0]}, {0: [3], 1: [2]}, {0: [1]})
    _run((
        # Strict headers travel over the NCCL fallback, the data through peer memory.
        cs.Scenario(A=A, F=F, tp_size=tp, steps=steps, dtype="bfloat16", hidden=64),
        cs.Scenario(A=A, F=F, tp_size=tp, steps=steps, dtype="bfloat16", hidden=64, logits_width=16,
                    send_ids=True),
        cs.Scenario(A=A, F=F, tp_size=tp, steps=steps, dtype="bfloat16", hidden=64, logits_width=16,
                    send_ids=True, overlap=False, strict=False),
    ))


@pytest.mark.parametrize("A,F", [(2, 1)])  # 1A1F is a subset
def test_auto_picks_nccl_before_peer_memory_on_one_node(A, F):
    # Peer memory stays behind NCCL in AUTO_ORDER until a two-GPU timing shows it ahead (issue #35).
    _run(cs.Scenario(A=A, F=F, steps=cs.default_steps(A), dtype="bfloat16", hidden=64, logits_width=16,
                     send_ids=True, strict=False), transport="auto", expect="nccl")


def test_steps_beyond_capacity_go_over_nccl_between_plane_steps():
    # peer_max_tokens 4: steps of up to 4 tokens per attention rank use the plane, larger ones NCCL.
    steps = ({0: [2, 3]}, {0: [9, 1]}, {0: [4, 0], 1: [1, 4]}, {0: [0, 17], 1: [3, 3]}, {0: [1, 1]})
    _run(cs.Scenario(A=2, F=1, steps=steps, dtype="bfloat16", hidden=64, logits_width=16, send_ids=True,
                     strict=False, extra=(("peer_max_tokens", 4),)))


@pytest.mark.timeout(330)
def test_two_stages_8192_rows_hidden_7168_with_logits_and_ids():
    n = 8192
    sc = cs.Scenario(A=2, F=1, steps=({0: [n, n], 1: [n, n]},), hidden=7168, dtype="bfloat16", layers=2,
                     logits_width=256, send_ids=True, strict=False,
                     step_timeout_s=120.0, extra=(("peer_max_tokens", n),))
    _run(sc, timeout_s=300)


def test_bad_first_input_then_next_step_peer():
    steps = ({0: [2, 3]}, {0: [4, 1]}, {0: [3, 3], 1: [1, 2]})
    sc = cs.replace(cs.Scenario(A=2, F=1, steps=steps), transport="peer")
    res = run_workers(cs.bad_first_input_worker, sc.nprocs, (sc, find_free_port(), 0, 1, False), timeout_s=200,
                      per_rank_env=_env(sc))
    assert len(res[1]["rejections"]) == 1
    assert res[2]["checked"] == [6, 2, 10]


def test_mid_step_failure_then_reinit_peer():
    steps = ({0: [2, 3]}, {0: [1, 2]}, {0: [3, 1]})
    sc = cs.replace(cs.Scenario(A=2, F=1, steps=steps, step_timeout_s=10.0), transport="peer")
    res = run_workers(cs.mid_step_failure_worker, sc.nprocs, (sc, find_free_port(), 1), timeout_s=200,
                      per_rank_env=_env(sc))
    ffn, a0, a1 = res
    assert a1["rejection"][0] == "AFDConfigError" and a1["error"][0] == "AFDStateError", a1  # rejected, then given up
    for r in (ffn, a0):
        assert "attention rank 1" in r["error"][1], r["error"]
    assert ffn["after"] == 8 and a0["after"] == 6 and a1["after"] == 2


def test_margin_probe_decode_pattern_over_peer_memory():
    """The margin probe's settings (1A1F on one GPU, hidden 2048, 8 tokens, 4 layers, bf16, strict off).

    Its original order (layers 1..3 of stage 0 sent before layer 0's reply) overran the plane's one
    slot per stage: the FFN rank's wait saw a later sequence ("flag at sequence 6 while waiting for 4").
    Now that call is refused before anything moves, and 60 steps in the corrected order (layer 0 sent
    and left, then receive before each next send) come back bit-exact through the plane.
    """
    sc = cs.replace(cs.Scenario(A=1, F=1, steps=({0: [8]},) * 60, layers=4, hidden=2048, dtype="bfloat16",
                                strict=False), transport="peer")
    res = run_workers(cs.decode_pattern_worker, sc.nprocs, (sc, find_free_port()), timeout_s=200,
                      per_rank_env=_env(sc))
    cs.check_decode_pattern(sc, res)
    assert {r["transport"] for r in res} == {"peer"}


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_peer_loss_is_the_named_error_within_the_deadline(mode):
    """Attention rank 1 dies / stalls before sending layer 1 of step 1.

    The FFN rank's device wait for layer 1, stage 0 expires (its deadline is
    the shorter one) and the error record names attention rank 1;
    the FFN rank posts the abort; attention rank 0 ends the step with it.
    """
    deadline = 5.0
    sc = cs.replace(cs.Scenario(A=2, F=1, steps=({0: [2, 3]}, {0: [2, 2]}), step_timeout_s=deadline,
                                strict=False), transport="peer")
    victim = 2
    out = cs.run_tolerating_death(cs.peer_loss_worker, sc.nprocs, (sc, find_free_port(), victim, mode),
                                  timeout_s=200, may_die=[victim] if mode == "kill" else [],
                                  per_rank_env=_env(sc))
    ffn, a0 = out[0], out[1]
    for r in (ffn, a0):
        assert "error" in r, r
        assert r["elapsed"] < deadline * 2 + 10, r
    assert ffn["error"][0] == "AFDTimeoutError", ffn["error"]
    assert "attention rank 1 (world rank 2)" in ffn["error"][1] and "layer 1, stage 0" in ffn["error"][1]
    assert a0["error"][0] == "StepAbortedError", a0["error"]
    assert "attention rank 1 (world rank 2)" in a0["error"][1], a0["error"]
    if mode == "stall":
        assert "error" in out[victim], out[victim]
    assert out["exitcodes"][0] == 0 and out["exitcodes"][1] == 0


@pytest.mark.parametrize("attn,steps", [((1, 1, 1), ({0: [8]},)), ((2, 1, 1), ({0: [8, 5]},))],
                         ids=["1A1F", "2A1F"])
def test_reference_runner_ffn_graph_over_peer_memory_200_replays_bit_exact(attn, steps):
    """The reference runner's graph protocol over the peer transport, every step through the plane.

    The FFN worker captures its whole forward (every recv/compute/send of 3
    layers: ``peer_wait`` views, compute, ``peer_put``) once and replays it 200
    times with no connector call; the attention side sends fresh inputs every
    step and checks every reply bit-exactly against the FFN computed eagerly.
    Then an eager step with larger counts, then 5 more replays. The NCCL
    fallback is off, so a step that did not go through peer memory fails.
    """
    import plugin_runners as pr

    sc = pr.PluginScenario(attn=attn, layers=3, hidden=256, steps=steps, transport="peer",
                           extra=(("peer_fallback", False),))
    res = run_workers(pr.ffn_graph_worker, sc.nprocs, (sc, find_free_port(), 200, pr.finish_barrier(sc.nprocs)),
                      timeout_s=200, per_rank_env=place_processes(sc.A, sc.F).env())
    atts = [r for r in res if r["role"] == "attention"]
    assert len(atts) == sc.A
    for att in atts:
        # warm-up + 200 replays + the larger eager step + 5 replays, 3 layers each
        assert att["checked"] == (1 + 200 + 1 + 5) * sc.layers
