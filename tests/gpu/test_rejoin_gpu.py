"""Issue 45 on the GPU tier: restarted ranks rejoin over NCCL and over peer memory, with FFN-side CUDA graphs.

The CPU tier's scenarios (``tests/test_rejoin.py``) with the transport set to ``nccl`` or ``peer`` and the
processes placed by :func:`afd_ext.tools.testing.place_processes`; then a graph-mode run: the FFN process serves
through :class:`afd_ext.integrations.graph_runners.FFNGraphServer` (CUDA graphs), its attention ranks exit in
order after warm-up, capture and replays, new attention processes come, the FFN process re-initialises the same
connector, and the graph of the old generation must be dropped (never replayed against the new communicators
or peer buffers) and captured again; every reply is checked exactly.

Written for issue 45 without a GPU machine: not run yet.
Run: ``pytest -m gpu tests/gpu/test_rejoin_gpu.py -v``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import connector_scenarios as cs  # noqa: E402
import test_rejoin as tr  # noqa: E402
from afd_ext.tools.testing import find_free_port, place_processes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


class PlacedRun(tr.Run):
    """``tr.Run`` with each process's GPU placement (``CUDA_VISIBLE_DEVICES``, ``NCCL_HOSTID``) by world rank."""

    def __init__(self, A: int, F: int):
        super().__init__()
        self.env = place_processes(A, F).env()

    def start(self, name, fn, *args):  # args: (sc, world rank, port, ...)
        saved = dict(os.environ)
        os.environ.update(self.env[args[1]])  # spawn copies the parent's environment at start
        try:
            super().start(name, fn, *args)
        finally:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture
def placed():
    runs = []

    def make(A, F):
        r = PlacedRun(A, F)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.close()


def _sc(A, F, transport):
    return dataclasses.replace(tr._sc(A, F), transport=transport, dtype="bfloat16", hidden=64)


@pytest.mark.parametrize("transport", ["nccl", "peer"])
def test_one_attention_rank_killed_and_restarted_gpu(placed, transport):
    sc, port, run = _sc(2, 1, transport), find_free_port(), placed(2, 1)
    run.start("f0", tr.ffn_proc, sc, 0, port, 2)
    run.start("a0", tr.attention_proc, sc, 1, port, [0, 1, 2, 3])
    run.start("a1", tr.attention_proc, sc, 2, port, [0, 1], 1)
    assert run.exited("a1") == -signal.SIGKILL
    run.start("a1'", tr.attention_proc, sc, 2, port, [2, 3])
    f0, a0, a1 = run.finish(["f0", "a0", "a1'"])
    assert [e[0] for e in a0["errors"]] == [1] and "attention rank 1" in a0["errors"][0][2], a0
    tr._check_attention(sc, a0, 0, [0, 2, 3])
    tr._check_attention(sc, a1, 1, [2, 3])
    assert f0["rows"][1] == [sum(tr._expected(sc, i, a) for a in range(2)) for i in (2, 3)], f0
    tr._report(f"GPU {transport} 2A1F, attention rank 1 killed", a1)


@pytest.mark.parametrize("transport", ["nccl", "peer"])
@pytest.mark.parametrize("victim", [1, 0], ids=["ffn-rank-1", "ffn-rank-0-store-host"])
def test_an_ffn_rank_killed_and_restarted_gpu(placed, transport, victim):
    sc, port, run = _sc(1, 2, transport), find_free_port(), placed(1, 2)
    other = 1 - victim
    run.start(f"f{other}", tr.ffn_proc, sc, other, port, 2)
    run.start(f"f{victim}", tr.ffn_proc, sc, victim, port, 1, 1)
    run.start("a0", tr.attention_proc, sc, 2, port, [0, 1, 2, 3])
    assert run.exited(f"f{victim}") == -signal.SIGKILL
    run.start(f"f{victim}'", tr.ffn_proc, sc, victim, port, 1)
    fo, fv, a0 = run.finish([f"f{other}", f"f{victim}'", "a0"])
    assert [e[0] for e in a0["errors"]] == [1], a0
    tr._check_attention(sc, a0, 0, [0, 2, 3])
    assert [fo["rows"][1][k] + fv["rows"][0][k] for k in range(2)] == [tr._expected(sc, i, 0) for i in (2, 3)]
    tr._report(f"GPU {transport} 1A2F, FFN rank {victim} killed", fv)


# ------------------------------------------------------------------ graphs across a rejoin
REPLAYS = 5


def graph_attention_proc(emit, sc, wr, port, gen):
    """Warm-up, capture (the attention side captures its loop; nothing moves), then ``REPLAYS`` replay steps
    sent eagerly with fresh rows and checked exactly; then the goodbye."""
    import torch

    from afd_ext.metadata import AFDControlPayload

    with cs.hang_diagnostics(wr, "graph_attention_proc"):
        torch.cuda.set_device(0)
        conn = cs.make_connector(sc, wr, port)
        a, step = wr - sc.F, sc.steps[0]
        conn.init_afd_connector()
        checked = []
        try:
            for i, flags in enumerate([dict(is_warmup=True), dict(is_graph_capturing=True)]
                                      + [dict(is_graph_replaying=True)] * REPLAYS):
                p = AFDControlPayload({s: list(c) for s, c in step.items()}, **flags)
                if "is_graph_capturing" in flags:
                    conn.control_plane.update_state_from_dp_metadata(p)
                    conn.control_plane.send_dp_metadata_list(p)
                    n = cs.expected_rows(sc, step[0], a)
                    static = torch.zeros(n, sc.hidden, dtype=cs._dt(sc.dtype), device="cuda")
                    g = torch.cuda.CUDAGraph()
                    torch.cuda.synchronize()
                    with conn.watchdog_suspended(), torch.cuda.graph(g):
                        for layer in range(sc.layers):
                            conn.send_attn_output(static, cs._ctx(layer, 0, n))
                            conn.recv_ffn_output(static, ubatch_idx=0)
                    continue
                conn.control_plane.update_state_from_dp_metadata(p)
                conn.control_plane.send_dp_metadata_list(p)
                for layer in range(sc.layers):
                    n = cs.expected_rows(sc, step[0], a)
                    h, _, _ = cs.make_inputs(sc, 100 * gen + i, layer, 0, a, n)
                    want = cs.ffn_fn(h, None, None, layer)
                    conn.send_attn_output(h, cs._ctx(layer, 0, n))
                    cs._check_reply(conn, sc, i, layer, 0, h, want)
                checked.append(i)
            return {"checked": checked}
        finally:
            conn.close()


def graph_ffn_proc(emit, sc, wr, port, generations):
    """Serve through FFNGraphServer; after each goodbye ``close(); init_afd_connector()`` on the same connector."""
    import torch

    from afd_ext.errors import AFDError
    from afd_ext.integrations.graph_runners import FFNGraphServer

    class Server:
        def __init__(self, conn):
            self.connector, self.steps, self.rows_served = conn, 0, 0

        def serve_exchanges(self, payload):
            conn = self.connector
            for layer in range(sc.layers):
                for s in sorted(payload.dp_metadata_list):
                    p = conn.recv_attn_output(ubatch_idx=s)
                    conn.send_ffn_output(cs.ffn_fn(p.hidden_states, None, None, layer), p.context)

        def serve_step(self, payload):
            self.connector.control_plane.update_state_from_dp_metadata(payload)
            self.serve_exchanges(payload)
            self.steps += 1

    with cs.hang_diagnostics(wr, "graph_ffn_proc"):
        torch.cuda.set_device(0)
        conn = cs.make_connector(sc, wr, port)
        gsrv = FFNGraphServer(Server(conn), cache_size=4)
        out = {"modes": [], "cache": []}
        conn.init_afd_connector()
        try:
            for gen in range(generations):
                modes = {}
                while True:
                    try:
                        payload = conn.control_plane.recv_dp_metadata_list()
                    except AFDError:
                        break  # the goodbye
                    before = len(gsrv.ctl.cache)
                    m = gsrv.serve_step(payload).value
                    if not modes:  # this generation's first step (its warm-up) dropped the old graphs
                        out["cache"].append((before, len(gsrv.ctl.cache)))
                    modes[m] = modes.get(m, 0) + 1
                    torch.cuda.synchronize()
                out["modes"].append(modes)
                if gen + 1 < generations:
                    conn.close()
                    emit("waiting")
                    conn.init_afd_connector()
            return out
        finally:
            gsrv.close()
            conn.close()


@pytest.mark.parametrize("transport", ["nccl", "peer"])
def test_ffn_graphs_are_recaptured_after_the_attention_side_rejoins(placed, transport):
    sc = dataclasses.replace(_sc(2, 1, transport), steps=({0: [3, 2]},), strict=False, overlap=False)
    port, run = find_free_port(), placed(2, 1)
    run.start("f0", graph_ffn_proc, sc, 0, port, 2)
    for gen in (1, 2):
        names = [f"a0.{gen}", f"a1.{gen}"]
        for a, name in enumerate(names):
            run.start(name, graph_attention_proc, sc, 1 + a, port, gen)
        res = run.finish(names)
        assert all(r["checked"] == [0] + list(range(2, 2 + REPLAYS)) for r in res), res
        assert run.exited(names[0]) == 0 and run.exited(names[1]) == 0
        if gen == 1:
            run.event("f0", "waiting")
    f0 = run.finish(["f0"])[0]
    # each generation: its warm-up eager, one capture, every replay of its own graph; none left from before
    assert f0["modes"] == [{"warmup": 1, "capture": 1, "replay": REPLAYS}] * 2, f0
    assert f0["cache"] == [(0, 0), (1, 0)], f0  # generation 1's graph, dropped at generation 2's first step
