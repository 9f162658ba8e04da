"""The connector scenarios of the CPU tier, over NCCL (GPU tier).

Processes placed by :func:`afd_ext.tools.testing.place_processes`: on two GPUs
attention processes on GPU 0 and FFN processes on GPU 1 (several processes of
one role share a GPU; one size-2 communicator per edge and direction makes that
legal); on one GPU every process on GPU 0 with its own ``NCCL_HOSTID`` (NCCL
over sockets). Correctness only either way.

Run on the GPU machine (after ``pip install --no-build-isolation -e .``):

    pytest -m gpu tests/gpu/test_connector_nccl.py -v -s

(``-s`` shows the workers' phase lines, ``[afd-test ...] init start/end,
close start/end``, and any stack dump of a stuck worker as they happen.)

Needs a CUDA build of afd_ext (``afd_ext.ops.is_cuda_built()``) and a GPU
(``tests/conftest.py`` skips the ``gpu`` tier otherwise, saying why).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import connector_scenarios as cs  # noqa: E402
from afd_ext.tools.testing import find_free_port, place_processes, run_workers  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _env(sc: cs.Scenario) -> list[dict]:
    """Per world rank (FFN ranks first): the placement's GPU (and ``NCCL_HOSTID``) plus diagnostics.

    Diagnostics: afd_ext logs at INFO (communicator setup/teardown times) and
    every worker dumps all thread stacks to stderr when it is still running
    after ``AFD_TEST_STACK_DUMP_S`` seconds or is terminated by the harness
    (see ``connector_scenarios.hang_diagnostics``); both can be overridden
    from the environment of the pytest run.
    """
    diag = {"AFD_TEST_LOG_LEVEL": os.environ.get("AFD_TEST_LOG_LEVEL", "INFO"),
            "AFD_TEST_STACK_DUMP_S": os.environ.get("AFD_TEST_STACK_DUMP_S", "90")}
    return [{**e, **diag} for e in place_processes(sc.A, sc.F).env()]


def _nccl(sc: cs.Scenario) -> cs.Scenario:
    return cs.replace(sc, transport="nccl")


def _run(scs, timeout_s: float = 300.0):
    scs = tuple(_nccl(s) for s in (scs if isinstance(scs, tuple) else (scs,)))
    results = run_workers(cs.scenario_worker, scs[0].nprocs, (scs, find_free_port()), timeout_s=timeout_s,
                          per_rank_env=_env(scs[0]))
    for i, one in enumerate(scs):
        cs.check_scenario_results(one, [r[i] for r in results])
    return [[r[i] for r in results] for i in range(len(scs))]


@pytest.mark.parametrize(
    "A,F,tp",
    [(1, 1, 1), (2, 1, 1), (4, 2, 1), (3, 2, 1), (1, 2, 1), (2, 2, 2)],
    ids=["1A1F", "2A1F", "4A2F", "3A2F", "1A2F", "2A2F-DP1xTP2"],
)
def test_topologies_nccl(A, F, tp):
    if tp == 1:
        steps = cs.default_steps(A)
    else:
        steps = ({0: [5]}, {0: [0]}, {0: [3], 1: [2]}, {0: [1]})
    _run((
        cs.Scenario(A=A, F=F, tp_size=tp, steps=steps, dtype="bfloat16", hidden=64),
        cs.Scenario(A=A, F=F, tp_size=tp, steps=steps, dtype="bfloat16", hidden=64, logits_width=16,
                    send_ids=True),
        cs.Scenario(A=A, F=F, tp_size=tp, steps=steps, dtype="bfloat16", hidden=64, logits_width=16,
                    send_ids=True, overlap=False, strict=False),
    ))


def test_two_stages_8192_rows_hidden_7168_finish():
    """Large enough to defeat NCCL's internal buffering: a stage's reply must not queue behind the
    next stage's send (DBO pattern: send stage 0, send stage 1, then receive both)."""
    n = 8192
    sc = cs.Scenario(A=2, F=1, steps=({0: [n, n], 1: [n, n]},), hidden=7168, dtype="bfloat16", layers=2,
                     strict=False, overlap=True, step_timeout_s=120.0)
    t0 = time.monotonic()
    _run(sc, timeout_s=500)
    assert time.monotonic() - t0 < 500


def test_two_stages_8192_rows_with_logits_and_ids_per_tensor():
    n = 8192
    sc = cs.Scenario(A=1, F=1, steps=({0: [n], 1: [n]},), hidden=7168, dtype="bfloat16", layers=2,
                     logits_width=256, send_ids=True, strict=False,
                     step_timeout_s=120.0)
    _run(sc, timeout_s=500)


def test_handshake_mismatch_nccl():
    sc = _nccl(cs.Scenario(A=2, F=1))
    res = run_workers(cs.handshake_mismatch_worker, sc.nprocs, (sc, find_free_port()), timeout_s=120,
                      per_rank_env=_env(sc))
    assert all(r["field"] == "hidden_size" for r in res)


def test_bad_first_input_then_next_step_nccl():
    steps = ({0: [2, 3]}, {0: [4, 1]}, {0: [3, 3], 1: [1, 2]})
    sc = _nccl(cs.Scenario(A=2, F=1, steps=steps))
    res = run_workers(cs.bad_first_input_worker, sc.nprocs, (sc, find_free_port(), 0, 1, False), timeout_s=180,
                      per_rank_env=_env(sc))
    assert len(res[1]["rejections"]) == 1
    assert res[2]["checked"] == [6, 2, 10]


def test_mid_step_failure_then_reinit_nccl():
    steps = ({0: [2, 3]}, {0: [1, 2]}, {0: [3, 1]})
    sc = _nccl(cs.Scenario(A=2, F=1, steps=steps, step_timeout_s=10.0))
    res = run_workers(cs.mid_step_failure_worker, sc.nprocs, (sc, find_free_port(), 1), timeout_s=240,
                      per_rank_env=_env(sc))
    ffn, a0, a1 = res
    assert a1["rejection"][0] == "AFDConfigError" and a1["error"][0] == "AFDStateError", a1  # rejected, then given up
    for r in (ffn, a0):
        assert "attention rank 1" in r["error"][1], r["error"]
    assert ffn["after"] == 8 and a0["after"] == 6 and a1["after"] == 2


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_peer_loss_nccl_watchdog(mode):
    """NCCL does not notice a dead peer by itself: the watchdog must turn the stall into a named error.

    Attention rank 1 (world rank 2) dies / stalls before sending layer 1 of step 1. The FFN rank's
    fan-in of layer 1 (stage 0) expires (its deadline is the shortest); it names the missing peer from
    the peers' progress reports (attention rank 0 reported sending; attention rank 1 reported being idle
    in its caller, or nothing when dead), posts the abort, then aborts its communicators. Attention rank
    0 (its own exchanges fine, its sibling gone) ends the step with that abort: either its watchdog sees
    the abort signal, or its last reply is released by the FFN's abort and synchronize() then finds the
    abort posted (posted before the communicators were aborted). Before, it returned without an error
    (the reply came through the FFN's abort and it never looked at the abort signal), and the FFN's
    message came from synchronize's host wait (layer -1, stage -1, "every peer") when that clock ran
    out a few ms before the watchdog's.
    """
    deadline = 5.0
    sc = _nccl(cs.Scenario(A=2, F=1, steps=({0: [2, 3]}, {0: [2, 2]}), step_timeout_s=deadline, strict=False))
    victim = 2
    out = cs.run_tolerating_death(cs.peer_loss_worker, sc.nprocs, (sc, find_free_port(), victim, mode),
                                  timeout_s=240, may_die=[victim] if mode == "kill" else [],
                                  per_rank_env=_env(sc))
    ffn, a0 = out[0], out[1]
    for r in (ffn, a0):
        assert "error" in r, r
        msg = r["error"][1]
        assert "attention rank 1 (world rank 2)" in msg and "layer 1, stage 0" in msg, r["error"]
        assert "layer -1" not in msg and "waiting on attention rank 0" not in msg, r["error"]
        assert r["elapsed"] < deadline * 2 + 10, r
    assert a0["error"][0] == "StepAbortedError", a0["error"]
    if ffn["error"][0] == "AFDTimeoutError":  # (a communicator error, AFDPeerError, names its edge's peer instead)
        assert "waiting on attention rank 1 (world rank 2)" in ffn["error"][1], ffn["error"]
        if mode == "stall":
            assert "idle in its caller" in ffn["error"][1], ffn["error"]
        else:
            assert "probably dead" in ffn["error"][1], ffn["error"]
    if mode == "stall":
        assert "error" in out[victim], out[victim]  # it wakes up to an aborted connector
    assert out["exitcodes"][0] == 0 and out["exitcodes"][1] == 0
