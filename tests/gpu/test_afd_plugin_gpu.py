"""afd_ext under the reference vLLM AFD plugin's runners, over NCCL (GPU tier).

The CPU tier's scenarios (``tests/test_afd_plugin_dropin.py``) over NCCL, plus
what only a GPU shows: the attention side compiled once with
``torch.compile(fullgraph=True)`` (inductor) and reused across steps with
different counts, and the FFN forward captured once in a CUDA graph and
replayed 100 times by the runner with no connector call in between, every
reply bit-exact against the FFN computed eagerly.

Run on the GPU machine (after ``pip install --no-build-isolation -e .``):

    pytest -m gpu tests/gpu/test_afd_plugin_gpu.py -v

Placement: ``afd_ext.tools.testing.place_processes`` (attention and FFN workers on
different GPUs where there are two; on one GPU every worker shares it, each
with its own ``NCCL_HOSTID``, NCCL then using its socket transport).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import plugin_runners as pr  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from afd_ext import ops

        return bool(ops.is_cuda_built())
    except Exception:  # noqa: BLE001
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA build of afd_ext and a GPU"),
]


def _env(sc: pr.PluginScenario) -> list[dict]:
    # The GPU tier's one placement rule (afd_ext.tools.testing on main): per world rank, FFN ranks first.
    from afd_ext.tools.testing import place_processes

    return place_processes(sc.A, sc.F).env()


def _nccl(sc: pr.PluginScenario) -> pr.PluginScenario:
    from dataclasses import replace

    return replace(sc, transport="nccl")


def _run(fn, sc, *args, timeout_s: float = 400.0):
    sc = _nccl(sc)
    return run_workers(fn, sc.nprocs, (sc, find_free_port(), *args, pr.finish_barrier(sc.nprocs)),
                       timeout_s=timeout_s, per_rank_env=_env(sc))


SCENARIOS = {
    "eager_1a1f": pr.PluginScenario(steps=({0: [3]}, {0: [5]})),
    "dbo_two_stages": pr.PluginScenario(steps=({0: [2], 1: [3]}, {0: [4], 1: [1]})),
    "dbo_compiled_ops_frozen_stage": pr.PluginScenario(steps=({0: [2], 1: [3]},), frozen_stage=True),
    "idle_dp_rank": pr.PluginScenario(attn=(2, 1, 1), steps=({0: [0, 3]}, {0: [2, 0]})),
    "gate_on_attention": pr.PluginScenario(layers=4, gate=True, steps=({0: [3]}, {0: [2], 1: [2]})),
    "dp1_tp2_both": pr.PluginScenario(attn=(1, 1, 2), ffn=(1, 1, 2), steps=({0: [3]},)),
    "attn_tp2_ffn_tp1": pr.PluginScenario(attn=(1, 1, 2), steps=({0: [3]}, {0: [1]})),
    "dp2_pcp2_tp2": pr.PluginScenario(attn=(2, 2, 2), layers=2, steps=({0: [3, 5]},)),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_runner_sequences_over_nccl(name):
    res = _run(pr.dropin_worker, SCENARIOS[name])
    assert all(r["type"] == "AfdExtAFDConnector" for r in res)
    assert all(len(r["steps"]) == len(SCENARIOS[name].steps) for r in res)


def test_attention_compiled_once_inductor_reused_across_counts():
    sc = pr.PluginScenario(layers=3, steps=({0: [3]}, {0: [17]}, {0: [2]}, {0: [64]}, {0: [5]}))
    res = _run(pr.compiled_attention_worker, sc, "inductor")
    att = [r for r in res if r["role"] == "attention"][0]
    assert att["graphs"] == [2 * sc.layers]  # one compiled graph for every step


def test_ffn_graph_captured_once_replayed_100_times_bit_exact():
    sc = pr.PluginScenario(layers=3, hidden=256, steps=({0: [8]},))
    res = _run(pr.ffn_graph_worker, sc, 100)
    att = [r for r in res if r["role"] == "attention"][0]
    # warm-up + 100 replays + the larger eager step + 5 replays, 3 layers each
    assert att["checked"] == (1 + 100 + 1 + 5) * sc.layers
