"""GPU placement of multi-process tests, the demo and the benchmark (CPU tier, fake GPU counts).

:func:`afd_ext.tools.testing.place_processes` is the one place that decides which GPU
each process uses; these tests pin its three arrangements, the environment it
hands to :func:`afd_ext.tools.testing.run_workers` (which must reach the child before
its interpreter imports anything), the ``gpu`` tier's skip reasons, and the
demo's use of it.
"""

from __future__ import annotations

import os
import time

import pytest

from afd_ext.tools import testing
from afd_ext.tools.testing import GpuPlacement, place_processes, run_workers


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(testing.SHARE_GPU_ENV, raising=False)


def _gpus(p: GpuPlacement) -> list[str]:
    return list(p.gpus)


def test_enough_gpus_one_process_each_attention_first():
    p = place_processes(2, 2, 4)
    # AFD world order (FFN first): FFN ranks on GPUs 2, 3; attention ranks on 0, 1.
    assert (p.arrangement, _gpus(p), p.nccl_hostids) == ("own-gpu", ["2", "3", "0", "1"], ())
    assert not p.shared and p.timings_meaningful
    assert p.env() == [{"CUDA_VISIBLE_DEVICES": g} for g in ("2", "3", "0", "1")]


def test_two_gpus_keep_every_edge_across_gpus():
    p = place_processes(4, 2, 2)
    assert p.arrangement == "split-roles" and _gpus(p) == ["1", "1", "0", "0", "0", "0"]
    assert p.shared and not p.timings_meaningful and not p.nccl_hostids
    p3 = place_processes(4, 2, 4)  # FFN on the last GPUs, attention round-robin over the rest
    assert _gpus(p3) == ["2", "3", "0", "1", "0", "1"]


@pytest.mark.parametrize("A,F", [(1, 1), (2, 1), (4, 2)])
def test_one_gpu_everyone_on_gpu0_with_its_own_hostid(A, F):
    p = place_processes(A, F, 1)
    env = p.env()
    assert p.arrangement == "shared-gpu" and p.shared and not p.timings_meaningful
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0"] * (A + F)
    hostids = [e["NCCL_HOSTID"] for e in env]
    assert len(set(hostids)) == A + F, hostids  # NCCL sees A + F hosts: no "Duplicate GPU"
    assert "NCCL over sockets" in p.describe() and "correctness only" in p.describe()


def test_share_forced_by_env_or_argument(monkeypatch):
    assert place_processes(1, 1, 2, share=True).arrangement == "shared-gpu"
    monkeypatch.setenv(testing.SHARE_GPU_ENV, "1")
    p = place_processes(1, 1, 2)
    assert p.arrangement == "shared-gpu" and _gpus(p) == ["0", "0"] and len(set(p.nccl_hostids)) == 2
    monkeypatch.setenv(testing.SHARE_GPU_ENV, "0")
    assert place_processes(1, 1, 2).arrangement == "own-gpu"


def test_labels_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert _gpus(place_processes(1, 1, 2)) == ["7", "6"]
    assert _gpus(place_processes(2, 1, 1)) == ["6", "6", "6"]
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        place_processes(2, 2, 4)


def test_gpu_map_edge_on_one_gpu_gets_hostids():
    p = place_processes(1, 1, 2, gpu_map=(0, 0))
    assert p.arrangement == "shared-gpu" and len(set(p.nccl_hostids)) == 2
    p = place_processes(2, 1, 2, gpu_map=(0, 0, 1))  # attention ranks share GPU 0, edges cross GPUs
    assert p.arrangement == "split-roles" and not p.nccl_hostids
    with pytest.raises(ValueError, match="gpu-map"):
        place_processes(1, 1, 2, gpu_map=(0, 2))
    with pytest.raises(ValueError, match="gpu-map"):
        place_processes(1, 1, 2, gpu_map=(0,))


def test_bad_sizes_and_no_gpu():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        place_processes(1, 1, 0)
    with pytest.raises(ValueError, match="at least one"):
        place_processes(0, 1, 1)


def test_no_gpu_count_given_counts_the_visible_ones(monkeypatch):
    monkeypatch.setattr(testing, "visible_gpu_count", lambda: 1)
    assert place_processes(1, 1).arrangement == "shared-gpu"
    monkeypatch.setattr(testing, "visible_gpu_count", lambda: 2)
    assert place_processes(1, 1).arrangement == "own-gpu"


def _initial_environ(rank: int, nprocs: int, keys: tuple[str, ...]) -> dict:
    # /proc/self/environ is the environment the interpreter was started with: a
    # variable set later (after imports) would not be in it.
    with open("/proc/self/environ", "rb") as f:
        start = dict(kv.split("=", 1) for kv in f.read().decode().split("\0") if "=" in kv)
    return {k: start.get(k) for k in keys}


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
def test_run_workers_env_is_there_from_the_child_interpreters_start():
    p = place_processes(1, 1, 1)
    keys = ("CUDA_VISIBLE_DEVICES", "NCCL_HOSTID", "AFD_TEST_COMMON")
    before = {k: os.environ.get(k) for k in keys}
    out = run_workers(_initial_environ, 2, (keys,), timeout_s=60, env={"AFD_TEST_COMMON": "x"},
                      per_rank_env=p.env())
    assert out == [{"CUDA_VISIBLE_DEVICES": "0", "NCCL_HOSTID": p.nccl_hostids[r], "AFD_TEST_COMMON": "x"}
                   for r in range(2)]
    assert {k: os.environ.get(k) for k in keys} == before  # the parent's environment is restored


def test_patched_env_touches_only_its_keys(monkeypatch):
    monkeypatch.setenv("AFD_TEST_KEEP", "kept")
    monkeypatch.setenv("AFD_TEST_OVER", "old")
    monkeypatch.delenv("AFD_TEST_NEW", raising=False)
    writes = []
    real_putenv, real_unsetenv = os.putenv, os.unsetenv
    monkeypatch.setattr(os, "putenv", lambda k, v: (writes.append(k), real_putenv(k, v)))
    monkeypatch.setattr(os, "unsetenv", lambda k: (writes.append(k), real_unsetenv(k)))
    with testing.patched_env({"AFD_TEST_OVER": "new", "AFD_TEST_NEW": "1"}):
        assert os.environ["AFD_TEST_OVER"] == "new" and os.environ["AFD_TEST_NEW"] == "1"
    assert os.environ["AFD_TEST_OVER"] == "old" and "AFD_TEST_NEW" not in os.environ
    assert os.environ["AFD_TEST_KEEP"] == "kept"
    # Only the two keys were written to the C environment (mock.patch.dict rewrites every variable).
    assert {os.fsdecode(k) for k in writes} == {"AFD_TEST_OVER", "AFD_TEST_NEW"}, sorted(set(writes))[:10]


def _fail_in_order(rank: int, nprocs: int, errors: tuple) -> None:
    # Rank 0 fails at once with its error; the others fail 0.3 s later (a rank that closes its
    # connector before its own report is queued: its peer's follow-on error arrives first).
    import time

    from afd_ext import errors as E

    if rank:
        time.sleep(0.3)
    cls, msg = errors[rank]
    if cls == "StepAbortedError":
        raise E.StepAbortedError(msg, "FFN rank 0")
    raise (ValueError if cls == "ValueError" else getattr(E, cls))(msg)


def test_run_workers_raises_the_cause_not_the_peers_follow_on_error():
    with pytest.raises(testing.WorkerError) as ei:
        run_workers(_fail_in_order, 2, ((("ControlChannelClosed", "attention rank 0 closed the control channel"),
                                         ("ValueError", "the cause")),), timeout_s=60)
    assert ei.value.rank == 1 and "ValueError: the cause" in ei.value.traceback
    # Only follow-on errors: the first one, after at most ROOT_CAUSE_WAIT_S.
    t0 = time.monotonic()
    with pytest.raises(testing.WorkerError) as ei:
        run_workers(_fail_in_order, 2, ((("ControlChannelClosed", "closed"), ("StepAbortedError", "aborted")),),
                    timeout_s=60)
    assert ei.value.rank == 0 and "ControlChannelClosed: closed" in ei.value.traceback
    assert time.monotonic() - t0 < testing.ROOT_CAUSE_WAIT_S + 30  # spawn start-up included
    # A root cause first is raised as it is.
    with pytest.raises(testing.WorkerError) as ei:
        run_workers(_fail_in_order, 2, ((("ValueError", "first"), ("ControlChannelClosed", "closed")),),
                    timeout_s=60)
    assert ei.value.rank == 0 and "ValueError: first" in ei.value.traceback


def test_gpu_tier_skip_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(testing, "visible_gpu_count", lambda: 1)
    why = testing.distinct_gpus_missing(2, "timings")
    assert why is not None and "needs 2 distinct GPUs (timings)" in why and "1 visible" in why
    monkeypatch.setattr(testing, "visible_gpu_count", lambda: 2)
    assert testing.distinct_gpus_missing(2, "timings") is None
    monkeypatch.setenv(testing.SHARE_GPU_ENV, "1")
    assert "AFD_TEST_SHARE_GPU=1" in testing.distinct_gpus_missing(2, "timings")


# ---------------------------------------------------------------------------
# The demo: placement from the one helper, and a summary that says when latencies mean nothing
# ---------------------------------------------------------------------------


def test_demo_nccl_on_one_gpu_shares_it(monkeypatch):
    from afd_ext import ops
    from afd_ext.tools import demo

    monkeypatch.setattr(testing, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(ops, "is_cuda_built", lambda: True)
    plan = demo.build_plan(demo.parse_args(["--backend", "nccl", "--topology", "2A1F", "--dims", "tiny"]))
    assert plan.gpu_placement == place_processes(2, 1, 1)
    monkeypatch.setattr(testing, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="needs a visible GPU"):
        demo.build_plan(demo.parse_args(["--backend", "nccl", "--dims", "tiny"]))


@pytest.mark.parametrize("ngpu,note", [(1, True), (2, False)])
def test_demo_summary_says_when_latencies_are_not_meaningful(monkeypatch, ngpu, note):
    import dataclasses

    from afd_ext.tools import demo

    plan = demo.build_plan(demo.parse_args(["--backend", "gloo", "--topology", "1A1F", "--dims", "tiny"]))
    plan = dataclasses.replace(plan, gpu_placement=place_processes(1, 1, ngpu))
    res = demo.RankResult(rank=0, requests=[], step_counts=[[3]], wall_s=0.1, latency_ns={0: [1000, 2000]},
                          bytes_sent=10, bytes_received=10, steps=2)
    ck = demo.CheckResult(ok=True, tolerance=1e-4, max_abs_diff=0.0, positions=3, worst="-")
    s = demo.summarize(plan, [res], [{"rank": 0, "rows": 3}], ck, 1.0)
    assert s["latencies_meaningful"] is (not note)
    assert s["placement"] == place_processes(1, 1, ngpu).describe()
    text = demo.format_summary(s)
    assert ("latencies are not meaningful" in text) is note
    assert "placement       " + s["placement"] in text


def test_find_free_port_avoids_the_ephemeral_range_and_is_bindable():
    """A port from bind(0) can be taken as an outgoing connection's local port before the store binds it
    (EADDRINUSE with several test groups at once); the harness picks below that range."""
    import socket

    from afd_ext.tools.testing import _ephemeral_low, find_free_port

    low = _ephemeral_low()
    ports = {find_free_port() for _ in range(20)}
    assert len(ports) > 1  # random, not one fixed port
    for p in ports:
        if low > 11000:
            assert 10000 <= p < low, (p, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def _ffn_fails_at_its_first_step(rank: int, nprocs: int, port: int, how: str) -> int:
    # 2A1F over gloo; FFN rank 0 (world rank 0, the store host) fails in its first step while the attention
    # ranks wait for its replies: they then see its absence (a peer gone, an abort) and report that.
    import signal as sig

    import connector_scenarios as cs
    from afd_ext.errors import TorchMismatchError

    sc = cs.Scenario(A=2, F=1, layers=1, strict=False, steps=({0: [2, 3]},),
                     extra=(("init_timeout_s", 60.0), ("step_timeout_s", 60.0)))
    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    try:
        if rank:
            return cs.attention_step(conn, sc, 0, sc.steps[0])
        conn.control_plane.update_state_from_dp_metadata(conn.control_plane.recv_dp_metadata_list())
        if how == "raise":  # what a broken build shows at the FFN's first use of the ops
            raise TorchMismatchError("afd_ext was built against torch 2.11.0, this is torch 2.14.1", built="2.11.0",
                                     installed="2.14.1")
        os.kill(os.getpid(), sig.SIGKILL) if how == "signal" else os._exit(3)
    finally:
        conn.close()
        if not rank:
            time.sleep(1.5)  # a slow teardown (CUDA, vLLM): the peers' follow-on errors come first
    return 0


@pytest.mark.parametrize("how,cause", [("raise", "TorchMismatchError: afd_ext was built against torch 2.11.0"),
                                       ("signal", "worker rank 0 was killed by SIGKILL without reporting"),
                                       ("exit", "worker rank 0 exited with code 3 without reporting")])
def test_run_workers_reports_the_failed_process_not_its_peers_follow_on_errors(how, cause):
    """Issue 41 item 8: a process that raises, is killed or exits names itself, whatever its peers report first;
    one that died without a report is an AFDPeerError naming the signal that killed it."""
    from afd_ext.errors import AFDPeerError
    from afd_ext.tools.testing import find_free_port

    with pytest.raises((testing.WorkerError, AFDPeerError)) as ei:
        run_workers(_ffn_fails_at_its_first_step, 3, (find_free_port(), how), timeout_s=120)
    assert cause in str(ei.value), str(ei.value)[-2000:]
    assert ei.value.rank == 0, str(ei.value)[-2000:]
    assert isinstance(ei.value, testing.WorkerError if how == "raise" else AFDPeerError), type(ei.value)
    if how != "raise":
        assert (ei.value.op, ei.value.peer) == ("run_workers", "worker rank 0")
