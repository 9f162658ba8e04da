"""The peer-memory plane's kernels on a GPU (one GPU is enough).

* In one process, every role is a :class:`PeerPlane` with its own CUDA
  streams; a same-process "open" aliases the memory, so the kernels of the two
  roles run concurrently on one GPU: the stress test (10^6 exchanges in CUDA
  graphs, each stage on its own stream, every exchange's data summed on the
  device into exact checksums, the slot reused every layer, slow readers),
  CUDA-graph replays bit-exact against eager, eager steps with uneven and zero
  counts.
* Deadlines: a missing flag becomes the error record and
  :class:`AFDTimeoutError`, later waits return at once, puts stop; a host
  abort ends a spin; a stale generation is never taken; a flag ahead is a
  protocol error.
* Two processes sharing GPU 0 through CUDA IPC (time-sliced by the driver:
  correctness only): a role that dies while its peer spins. The connector
  scenarios over this transport (``test_connector_peer.py``) cover the
  multi-process exchanges of every topology.

Tests are ordered by importance per second: a time cut loses the least.
Every wait has a device deadline, every test a tight ``timeout``.

Run: ``pytest -m gpu tests/gpu/test_peer_gpu.py -v``.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import pytest
import torch

ops = pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")

from afd_ext.errors import AFDAbortedError, AFDConfigError, AFDProtocolError, AFDTimeoutError  # noqa: E402
from afd_ext.schedule import ScheduleConfig  # noqa: E402
from afd_ext.transport.peer.plane import PeerPlane, WireSpec, open_plane  # noqa: E402
from afd_ext.topology import ATTENTION, FFN, Topology  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ops.is_cuda_built() and torch.cuda.is_available()),
                       reason="needs a CUDA build of afd_ext and one CUDA GPU"),
]

DEV = torch.device("cuda", 0)
# GPU clock cycles for torch.cuda._sleep: ~50-100 us on an H200 (a slow reader).
SLEEP_CYCLES = 100_000
class Spec(NamedTuple):
    """The tests' wire facts; :meth:`plane` is the plane's WireSpec, built from the connector's layout."""

    hidden_size: int
    hidden_dtype: torch.dtype
    logits_width: int = 0
    logits_dtype: torch.dtype = torch.float32
    has_token_ids: bool = False

    def plane(self) -> WireSpec:
        return WireSpec.of(ScheduleConfig(1, self.hidden_size, self.hidden_dtype, self.logits_width or None,
                                          self.logits_dtype, self.has_token_ids))


SPEC_FULL = Spec(7168, torch.bfloat16, 256, torch.float32, True)
SPEC_SMALL = Spec(96, torch.float16, 0, torch.float32, False)


# ------------------------------------------------------------------ helpers


class World:
    """Every rank of an A:F topology as planes in this process, each with its own stream."""

    def __init__(self, A, F, spec, *, max_tokens, stages, timeout_s=20.0, generation=5, att_dev=DEV, ffn_dev=DEV):
        self.topo = Topology(A, F)
        self.spec = spec
        self.stages = stages
        self.devices = (att_dev, ffn_dev)
        kw = dict(max_tokens=max_tokens, num_stages=stages, generation=generation, timeout_s=timeout_s)
        self.att = [PeerPlane(self.topo, ATTENTION, a, spec.plane(), device=att_dev, **kw) for a in range(A)]
        self.ffn = [PeerPlane(self.topo, FFN, f, spec.plane(), device=ffn_dev, **kw) for f in range(F)]
        for p in self.att:
            for f in p.peers:
                p.attach(f, self.ffn[f].ipc_handle, self.ffn[f].layout.nbytes)
        for p in self.ffn:
            for a in p.peers:
                p.attach(a, self.att[a].ipc_handle, self.att[a].layout.nbytes)
        self.sa = [torch.cuda.Stream(att_dev) for _ in range(A)]
        self.sf = [torch.cuda.Stream(ffn_dev) for _ in range(F)]

    def plan(self, counts):
        """Rows and destination rows of every put, from the attention ranks' token counts."""
        topo = self.topo
        share = {}  # (a, f) -> (start in a's rows, rows)
        for a, n in enumerate(counts):
            for f, start, c in topo.split_rows(a, n):
                share[(a, f)] = (start, c)
        fan_off = {}  # (a, f) -> row offset of a in f's fan-in
        totals = []
        for f in range(topo.F):
            off = 0
            for a in topo.ffn_peers(f):
                fan_off[(a, f)] = off
                off += share[(a, f)][1]
            totals.append(off)
        att_put = [([share[(a, f)][1] for f in topo.attention_peers(a)],
                    [fan_off[(a, f)] for f in topo.attention_peers(a)]) for a in range(topo.A)]
        ffn_put = [([share[(a, f)][1] for a in topo.ffn_peers(f)],
                    [share[(a, f)][0] for a in topo.ffn_peers(f)]) for f in range(topo.F)]
        return att_put, ffn_put, totals

    def wire(self, n, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        s = self.spec
        h = torch.randn(n, s.hidden_size, generator=g, device=DEV).to(s.hidden_dtype)
        lg = torch.randn(n, s.logits_width, generator=g, device=DEV).to(s.logits_dtype) if s.logits_width else None
        ids = (torch.randint(0, 1 << 30, (n,), generator=g, device=DEV, dtype=torch.int32)
               if s.has_token_ids else None)
        return [t for t in (h, lg, ids) if t is not None]  # the wire parts present, in wire order

    def close(self):
        for d in self.devices:
            torch.cuda.synchronize(d)
        for p in self.att + self.ffn:
            p.close()


def ffn_compute(x):
    """A deterministic stand-in for the FFN: the same bits in graphs and eagerly."""
    return (x.float() * 2 + 1).to(x.dtype)


def run_step(w, counts, stage, layer, inputs, outs, *, check=None, slow_ffn=False):
    """One layer exchange of one stage, every role on its own stream, issued without host waits."""
    att_put, ffn_put, totals = w.plan(counts)
    for a, p in enumerate(w.att):
        with torch.cuda.stream(w.sa[a]):
            p.put(stage, inputs[a], *att_put[a])
    for f, p in enumerate(w.ffn):
        with torch.cuda.stream(w.sf[f]):
            if slow_ffn:
                torch.cuda._sleep(SLEEP_CYCLES)  # the flag is there before the wait starts
            views = p.wait(stage, totals[f], layer=layer)
            if slow_ffn:
                torch.cuda._sleep(SLEEP_CYCLES)  # a slow reader of the fan-in views
            if check is not None:
                check.append((f, [v.clone() for v in views]))
            p.put(stage, (ffn_compute(views[0]),), *ffn_put[f])
    for a, p in enumerate(w.att):
        with torch.cuda.stream(w.sa[a]):
            p.wait(stage, counts[a], layer=layer, out=outs[a])


def expected_fan_in(w, inputs, f, counts):
    """The FFN rank's concatenated wire tensors, from the attention ranks' inputs."""
    topo = w.topo
    parts = []
    for a in topo.ffn_peers(f):
        for ff, start, c in topo.split_rows(a, counts[a]):
            if ff == f:
                parts.append([t[start:start + c] for t in inputs[a] if t is not None])
    return [torch.cat([p[k] for p in parts]) for k in range(len(parts[0]))]




# ------------------------------------------------------------------ capacity and reply views


@pytest.mark.timeout(60)
def test_reply_views_without_a_copy_and_a_step_at_capacity():
    w = World(2, 1, SPEC_SMALL, max_tokens=128, stages=1, timeout_s=10.0)
    try:
        def exchange(counts, layer, seed):
            inputs = [w.wire(n, seed=seed + a) for a, n in enumerate(counts)]
            torch.cuda.synchronize(DEV)  # made on the default stream, read on the ranks' streams
            att_put, ffn_put, totals = w.plan(counts)
            for a, p in enumerate(w.att):
                with torch.cuda.stream(w.sa[a]):
                    p.put(0, inputs[a], *att_put[a])
            with torch.cuda.stream(w.sf[0]):
                (x,) = w.ffn[0].wait(0, totals[0], layer=layer)
                w.ffn[0].put(0, (ffn_compute(x),), *ffn_put[0])
            replies = []
            for a, p in enumerate(w.att):
                with torch.cuda.stream(w.sa[a]):
                    (r,) = p.wait(0, counts[a], layer=layer)
                    replies.append(r)
            torch.cuda.synchronize(DEV)
            for a in range(2):
                assert replies[a].data_ptr() == w.att[a].views(0, counts[a])[0].data_ptr()  # a view, no copy
                assert torch.equal(replies[a], ffn_compute(inputs[a][0])), (layer, a)

        exchange([128, 128], 0, seed=0)  # exactly the capacity
        # One row past an attention rank's capacity is refused before anything moves, although it would
        # still fit in the FFN rank's fan-in region (it would overwrite attention rank 1's rows).
        big = w.wire(129, seed=9)
        with pytest.raises(AFDConfigError, match="capacity"):
            w.att[0].put(0, big, [129], [0])
        with pytest.raises(AFDConfigError, match="capacity"):
            w.att[1].put(0, w.wire(2, seed=3), [2], [255])  # past the fan-in part's end
        with pytest.raises(AFDConfigError, match="capacity"):
            w.ffn[0].put(0, (w.wire(130, seed=4)[0],), [1, 129], [0, 0])  # past attention rank 1's reply part
        with pytest.raises(AFDConfigError, match="capacity"):
            w.att[0].wait(0, 129, layer=1)
        torch.cuda.synchronize(DEV)
        for p in w.att + w.ffn:
            assert p.record() is None
        # Nothing moved and no counter advanced: the next exchange still works.
        exchange([7, 0], 1, seed=20)
        exchange([128, 1], 2, seed=30)
        for p in w.att + w.ffn:
            p.raise_if_failed()
    finally:
        w.close()


# ------------------------------------------------------------------ the stress test (CUDA graphs, device checks)

#: One-way exchanges (a put, its flag, the wait, the data checked) the stress test runs on one GPU.
STRESS_EXCHANGES = 1_000_000
#: Distinct wire sets: consecutive uses of a slot (and the replay boundary) carry different data.
STRESS_SETS = 7
STRESS_LAYERS = 250


def _bits(t):
    """The bit patterns of a 4-byte tensor as int64 (exact checksums, whatever the values)."""
    return t.view(torch.int32).long()


def _stress(rows, H, E, exchanges, att_dev, ffn_dev):
    """Round trips in CUDA graphs, both stages concurrently (one stream per stage and role).

    Every exchange's data is summed on the device, element by element, into
    int64 checksums of its bit patterns (one kernel per wire part, no host
    sync); at the end each checksum must equal the sum of what was put. A
    reader that took stale data (a missing fence, a slot reused too early)
    adds the bits of another wire set and the checksum differs. Slow readers
    (sleep kernels) in a few layers of every replay let the writers run as far
    ahead as the protocol allows.
    """
    spec = Spec(H, torch.float32, E, torch.float32, True)
    S, L, K = 2, STRESS_LAYERS, STRESS_SETS
    w = World(1, 1, spec, max_tokens=rows, stages=S, timeout_s=30.0, att_dev=att_dev, ffn_dev=ffn_dev)
    try:
        att, ffn = w.att[0], w.ffn[0]
        g = torch.Generator(device=att_dev).manual_seed(rows + H)
        sets = [(torch.randn(rows, H, generator=g, device=att_dev),
                 torch.randn(rows, E, generator=g, device=att_dev),
                 torch.randint(-(1 << 30), 1 << 30, (rows,), generator=g, device=att_dev, dtype=torch.int32))
                for _ in range(K)]
        acc_f = [[torch.zeros(rows, n, dtype=torch.int64, device=ffn_dev) for n in (H, E)]
                 + [torch.zeros(rows, dtype=torch.int64, device=ffn_dev)] for _ in range(S)]
        acc_r = [torch.zeros(rows, H, dtype=torch.int64, device=att_dev) for _ in range(S)]
        outs = [torch.empty(rows, H, device=ffn_dev) for _ in range(S)]
        side = (torch.cuda.Stream(att_dev), torch.cuda.Stream(ffn_dev))
        for d in (att_dev, ffn_dev):
            torch.cuda.synchronize(d)

        def attention_stage(s):
            for layer in range(L):
                att.put(s, sets[(layer * S + s) % K], [rows], [0])
                if layer == 4:
                    torch.cuda._sleep(SLEEP_CYCLES)  # the reply's flag is there before the wait starts
                (r,) = att.wait(s, rows, layer=layer)  # a view of the reply slot
                if layer == 6:
                    torch.cuda._sleep(SLEEP_CYCLES)  # a slow reader of the reply view
                acc_r[s].add_(r.view(torch.int32))

        def ffn_stage(s):
            for layer in range(L):
                if layer == 3:
                    torch.cuda._sleep(SLEEP_CYCLES)  # the fan-in's flag is there before the wait starts
                x, lg, ids = ffn.wait(s, rows, layer=layer)
                if layer == 5:
                    torch.cuda._sleep(SLEEP_CYCLES)  # a slow reader: an early reuse would change the views
                for acc, v in zip(acc_f[s], (x, lg, ids)):
                    acc.add_(v.view(torch.int32))
                torch.add(x, x, out=outs[s])  # exact in fp32: the reply differs from the input
                ffn.put(s, (outs[s],), [rows], [0])

        def capture(graph, dev, main, other, body):
            # Stage 1 on a forked stream, stage 0 on the capture stream: two concurrent branches.
            with torch.cuda.device(dev), torch.cuda.graph(graph, stream=main):
                other.wait_stream(main)
                with torch.cuda.stream(other):
                    body(1)
                body(0)
                main.wait_stream(other)

        ga, gf = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        capture(ga, att_dev, w.sa[0], side[0], attention_stage)
        capture(gf, ffn_dev, w.sf[0], side[1], ffn_stage)
        replays = -(-exchanges // (2 * S * L))  # two exchanges (there and back) per round trip
        t0 = time.perf_counter()
        for _ in range(replays):
            # A replay launches on the current stream: each role on its own, so they run concurrently.
            with torch.cuda.device(ffn_dev), torch.cuda.stream(w.sf[0]):
                gf.replay()  # the FFN graph first: its waits spin until the attention graph's puts land
            with torch.cuda.device(att_dev), torch.cuda.stream(w.sa[0]):
                ga.replay()
        for d in (att_dev, ffn_dev):
            torch.cuda.synchronize(d)
        dt = time.perf_counter() - t0
        for p in w.att + w.ffn:
            p.raise_if_failed()
        for s in range(S):
            uses = [0] * K
            for layer in range(L):
                uses[(layer * S + s) % K] += replays
            want_f = [sum(n * _bits(t[k]).to(ffn_dev) for n, t in zip(uses, sets)) for k in range(3)]
            want_r = sum(n * _bits(t[0] * 2) for n, t in zip(uses, sets))
            for k, name in enumerate(("hidden states", "router logits", "token ids")):
                assert torch.equal(acc_f[s][k], want_f[k]), f"stage {s}: fan-in {name} differed from what was put"
            assert torch.equal(acc_r[s], want_r), f"stage {s}: the reply differed from the FFN output"
            # The checks can fail: the last fan-in is the last layer's set, not the one before.
            last, prev = sets[((L - 1) * S + s) % K], sets[((L - 2) * S + s) % K]
            x = ffn.views(s, rows)[0]
            assert torch.equal(x, last[0].to(ffn_dev)) and not torch.equal(x, prev[0].to(ffn_dev))
        n = replays * 2 * S * L
        print(f"\n{n} exchanges ({rows} rows x {H} fp32 + {E} logits + ids, two stages concurrently) in "
              f"{dt:.1f} s: {dt / (n / 2) * 1e6:.2f} us per round trip (attention on {att_dev}, FFN on {ffn_dev})")
    finally:
        w.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rows,H,E,exchanges", [(2, 256, 8, STRESS_EXCHANGES), (1024, 1024, 64, 20_000)],
                         ids=["1M-small", "20k-4MiB"])
def test_stress_exchanges_in_graphs_on_concurrent_streams(rows, H, E, exchanges):
    _stress(rows, H, E, exchanges, DEV, DEV)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rows,H,E,exchanges", [(2, 256, 8, STRESS_EXCHANGES // 4), (1024, 1024, 64, 20_000)],
                         ids=["250k-small", "20k-4MiB"])
def test_stress_exchanges_without_programmatic_dependent_launch(rows, H, E, exchanges, monkeypatch):
    # Unset, AFD_PEER_PDL gives small grids PDL on Hopper (the small stress tests run with it); 0, read
    # at capture, launches every plane kernel in plain stream order: every exchange's data still checked.
    monkeypatch.setenv("AFD_PEER_PDL", "0")
    _stress(rows, H, E, exchanges, DEV, DEV)


@pytest.mark.timeout(150)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the stress test across NVLink")
@pytest.mark.distinct_gpus(2, "the memory-ordering rule across NVLink: attention on GPU 0, FFN on GPU 1")
@pytest.mark.parametrize("rows,H,E,exchanges", [(2, 256, 8, STRESS_EXCHANGES), (1024, 1024, 64, 20_000)],
                         ids=["1M-small", "20k-4MiB"])
def test_stress_exchanges_across_two_gpus(rows, H, E, exchanges):
    _stress(rows, H, E, exchanges, torch.device("cuda", 0), torch.device("cuda", 1))


# ------------------------------------------------------------------ CUDA graphs bit-exact against eager

#: Replays with fresh inputs per topology (the issue asks 200), then more after an eager step.
GRAPH_REPLAYS = 200


@pytest.mark.timeout(120)
@pytest.mark.parametrize("A,F,stages", [(1, 1, 1), (2, 1, 2), (4, 2, 1)])
def test_graph_replays_are_bit_exact_and_survive_a_larger_eager_step(A, F, stages):
    w = World(A, F, SPEC_FULL, max_tokens=32, stages=stages)
    try:
        counts = [5 + a for a in range(A)]
        static_in = [w.wire(counts[a], seed=100 + a) for a in range(A)]
        static_out = [torch.zeros(counts[a], SPEC_FULL.hidden_size, dtype=SPEC_FULL.hidden_dtype, device=DEV)
                      for a in range(A)]
        layers = 2
        att_put, ffn_put, totals = w.plan(counts)
        torch.cuda.synchronize(DEV)  # inputs made on the default stream, read on the ranks' streams
        # Warm every edge and direction once eagerly (as the connector does), then capture.
        for s in range(stages):
            run_step(w, counts, s, 0, static_in, static_out)
        torch.cuda.synchronize(DEV)
        ga = [torch.cuda.CUDAGraph() for _ in range(A)]
        gf = [torch.cuda.CUDAGraph() for _ in range(F)]
        for a, p in enumerate(w.att):
            with torch.cuda.graph(ga[a], stream=w.sa[a]):
                for layer in range(layers):
                    for s in range(stages):
                        p.put(s, static_in[a], *att_put[a])
                        p.wait(s, counts[a], layer=layer, out=static_out[a])
        for f, p in enumerate(w.ffn):
            with torch.cuda.graph(gf[f], stream=w.sf[f]):
                for layer in range(layers):
                    for s in range(stages):
                        (x, _lg, _ids) = p.wait(s, totals[f], layer=layer)
                        p.put(s, (ffn_compute(x),), *ffn_put[f])

        def replays_checked(first, n):
            """`n` replays with fresh inputs, each result kept on the device; one host sync at the end."""
            fresh = [[w.wire(counts[a], seed=10_000 + (first + i) * 10 + a) for i in range(n)] for a in range(A)]
            results = [torch.empty(n, counts[a], SPEC_FULL.hidden_size, dtype=SPEC_FULL.hidden_dtype, device=DEV)
                       for a in range(A)]
            torch.cuda.synchronize(DEV)  # fresh inputs made on the default stream
            for i in range(n):
                for a in range(A):
                    with torch.cuda.stream(w.sa[a]):  # copied on the rank's stream, after its previous replay
                        for t, new in zip(static_in[a], fresh[a][i]):
                            if t is not None:
                                t.copy_(new)
                for f in range(F):  # a replay launches on the current stream: each rank on its own
                    with torch.cuda.stream(w.sf[f]):
                        gf[f].replay()
                for a in range(A):
                    with torch.cuda.stream(w.sa[a]):
                        ga[a].replay()
                        results[a][i].copy_(static_out[a])
            torch.cuda.synchronize(DEV)
            for a in range(A):
                want = ffn_compute(torch.stack([fresh[a][i][0] for i in range(n)]))
                bad = [i for i in range(n) if not torch.equal(results[a][i], want[i])]
                assert not bad, f"attention rank {a}: replays {bad[:5]} (of {n}) differ from eager"

        replays_checked(0, GRAPH_REPLAYS)
        kept = [o.clone() for o in static_out]
        # An eager step with larger counts between replays, on the same planes.
        big = [20 + a for a in range(A)]
        big_in = [w.wire(big[a], seed=777 + a) for a in range(A)]
        big_out = [torch.zeros(big[a], SPEC_FULL.hidden_size, dtype=SPEC_FULL.hidden_dtype, device=DEV)
                   for a in range(A)]
        torch.cuda.synchronize(DEV)
        for s in range(stages):
            run_step(w, big, s, 0, big_in, big_out)
        torch.cuda.synchronize(DEV)
        for a in range(A):
            assert torch.equal(big_out[a], ffn_compute(big_in[a][0]))
            assert torch.equal(static_out[a], kept[a]), "the eager step touched a captured buffer"
        replays_checked(GRAPH_REPLAYS, 20)
        for p in w.att + w.ffn:
            p.raise_if_failed()
    finally:
        w.close()


# ------------------------------------------------------------------ deadlines, aborts, generations


@pytest.mark.timeout(60)
def test_a_missing_flag_times_out_records_the_error_and_later_waits_return_at_once():
    w = World(1, 1, SPEC_SMALL, max_tokens=8, stages=2, timeout_s=0.2)
    try:
        ffn, att = w.ffn[0], w.att[0]
        t0 = time.perf_counter()
        with torch.cuda.stream(w.sf[0]):
            ffn.wait(1, 3, layer=4)  # nobody puts
        w.sf[0].synchronize()
        assert 0.15 < time.perf_counter() - t0 < 5.0
        rec = ffn.record()
        assert rec is not None and rec.code == ops.PEER_TIMEOUT
        assert (rec.op_name, rec.peer, rec.layer, rec.stage, rec.want) == ("recv_attn_output", 0, 4, 1, 1)
        assert rec.waited_ns >= 200_000_000
        with pytest.raises(AFDTimeoutError) as ei:
            ffn.raise_if_failed()
        assert (ei.value.op, ei.value.layer, ei.value.stage) == ("recv_attn_output", 4, 1)
        assert ei.value.peer == "attention rank 0 (world rank 1)"
        # Every later wait of the failed plane returns at once, even with a long deadline.
        ffn.timeout_ns = int(30e9)
        t0 = time.perf_counter()
        with torch.cuda.stream(w.sf[0]):
            for layer in range(100):
                ffn.wait(0, 3, layer=layer)
        w.sf[0].synchronize()
        assert time.perf_counter() - t0 < 2.0
        # A failed plane's puts write nothing: the attention rank's reply region keeps its bytes and flag.
        before = att.views(0, 8)[0].clone()
        with torch.cuda.stream(w.sf[0]):
            ffn.put(0, (torch.ones(3, SPEC_SMALL.hidden_size, dtype=SPEC_SMALL.hidden_dtype, device=DEV),), [3], [0])
        w.sf[0].synchronize()
        assert torch.equal(att.views(0, 8)[0], before)
        att.timeout_ns = int(0.1e9)
        with torch.cuda.stream(w.sa[0]):
            att.wait(0, 3, layer=0)
        w.sa[0].synchronize()
        assert att.record() is not None and att.record().code == ops.PEER_TIMEOUT  # no flag came
        # The first failure keeps its record.
        assert ffn.record() == rec
    finally:
        w.close()


@pytest.mark.timeout(60)
def test_a_host_abort_ends_a_spin_at_once():
    w = World(1, 1, SPEC_SMALL, max_tokens=8, stages=1, timeout_s=30.0)
    try:
        att = w.att[0]
        with torch.cuda.stream(w.sa[0]):
            att.wait(0, 2, layer=0)
        time.sleep(0.2)
        assert not w.sa[0].query(), "the wait should still be spinning"
        t0 = time.perf_counter()
        att.abort()
        w.sa[0].synchronize()
        assert time.perf_counter() - t0 < 1.0
        with pytest.raises(AFDAbortedError):
            att.raise_if_failed()
    finally:
        w.close()


def _raw_flag(plane, stage, peer_index):
    off = plane.layout.flag_offset(stage, peer_index)
    return ops.peer_region_view(plane._region, off, 8).view(torch.int64)


@pytest.mark.timeout(60)
def test_a_stale_generation_is_never_taken_and_a_flag_ahead_is_a_protocol_error():
    w = World(1, 1, SPEC_SMALL, max_tokens=8, stages=1, timeout_s=0.2, generation=9)
    try:
        ffn = w.ffn[0]
        flag = _raw_flag(ffn, 0, 0)
        flag.fill_((8 << 48) | 1)  # generation 8, sequence 1: what a late writer of the old plane would leave
        torch.cuda.synchronize(DEV)
        with torch.cuda.stream(w.sf[0]):
            ffn.wait(0, 1, layer=0)
        w.sf[0].synchronize()
        assert ffn.record().code == ops.PEER_TIMEOUT  # not taken for new data
        w2 = World(1, 1, SPEC_SMALL, max_tokens=8, stages=1, timeout_s=5.0, generation=9)
        try:
            f2 = w2.ffn[0]
            _raw_flag(f2, 0, 0).fill_((9 << 48) | 2)  # this generation, but one call ahead
            torch.cuda.synchronize(DEV)
            with torch.cuda.stream(w2.sf[0]):
                f2.wait(0, 1, layer=3)
            w2.sf[0].synchronize()
            with pytest.raises(AFDProtocolError, match="sequence 2 while waiting for 1"):
                f2.raise_if_failed()
        finally:
            w2.close()
    finally:
        w.close()


# ------------------------------------------------------------------ two processes sharing GPU 0 through CUDA IPC


def _ipc_worker(rank, nprocs, port, A, F, steps, victim):
    import torch

    from afd_ext import rendezvous
    from afd_ext.transport.peer.plane import open_plane

    topo = Topology(A, F)
    role, rr = (FFN, rank) if rank < F else (ATTENTION, rank - F)
    store = rendezvous.connect("127.0.0.1", port, rank, A + F, 120.0, num_ffn_ranks=F)
    spec = Spec(512, torch.bfloat16, 16, torch.float32, True)
    timeout = 3.0 if victim else 60.0
    plane = open_plane(store, topo, role, rr, spec.plane(), max_tokens=16, num_stages=2, device=DEV, timeout_s=timeout,
                       setup_timeout_s=120.0)
    assert plane.record() is None
    rendezvous.barrier(store, rank, A + F, "opened", 120.0)
    stream = torch.cuda.Stream(DEV)
    results = []
    with torch.cuda.stream(stream):
        for step in range(steps):
            counts = [(step * 7 + a * 3) % 17 for a in range(A)]  # uneven, zero every 17th
            for layer in range(2):
                for s in range(2):
                    g = torch.Generator(device=DEV).manual_seed(step * 100 + layer * 10 + s)
                    wires = [(torch.randn(n, 512, generator=g, device=DEV).bfloat16(),
                              torch.randn(n, 16, generator=g, device=DEV),
                              torch.randint(0, 99, (n,), generator=g, device=DEV, dtype=torch.int32))
                             for n in counts]
                    if role == ATTENTION:
                        rows = [c for _, _, c in topo.split_rows(rr, counts[rr])]
                        dst = []
                        for f, _, _ in topo.split_rows(rr, counts[rr]):
                            off = 0
                            for a in topo.ffn_peers(f):
                                if a == rr:
                                    break
                                off += [c for ff, _, c in topo.split_rows(a, counts[a]) if ff == f][0]
                            dst.append(off)
                        plane.put(s, wires[rr], rows, dst)
                        out = torch.empty(counts[rr], 512, dtype=torch.bfloat16, device=DEV)
                        plane.wait(s, counts[rr], layer=layer, out=out)
                        results.append(bool(torch.equal(out, ffn_compute(wires[rr][0]))))
                    else:
                        peers = topo.ffn_peers(rr)
                        share = {a: [(st, c) for ff, st, c in topo.split_rows(a, counts[a]) if ff == rr][0]
                                 for a in peers}
                        total = sum(c for _, c in share.values())
                        x, lg, ids = plane.wait(s, total, layer=layer)
                        want = [torch.cat([wires[a][k][st:st + c] for a in peers for st, c in [share[a]]])
                                for k in range(3)]
                        results.append(all(bool(torch.equal(v, wv)) for v, wv in zip((x, lg, ids), want)))
                        plane.put(s, (ffn_compute(x),), [share[a][1] for a in peers], [share[a][0] for a in peers])
        stream.synchronize()
    plane.raise_if_failed()
    if victim is None:
        rendezvous.barrier(store, rank, A + F, "done", 120.0)
        plane.close()
        return sum(results), len(results)
    # A role dies while its peer spins: the victim starts a wait that nobody answers, reports, and is
    # killed (SIGKILL) while that wait spins; it never makes its next call.
    if role == victim:
        import signal
        import threading

        with torch.cuda.stream(stream):
            plane.wait(1, 0, layer=8)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return ("victim",)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        if role == ATTENTION:
            plane.put(0, wires[rr], rows, dst)
            plane.wait(0, counts[rr], layer=7, out=out)
        else:
            plane.wait(0, 1, layer=7)
        stream.synchronize()  # bounded by the 3 s device deadline
    waited = time.perf_counter() - t0
    err = plane.failure()
    plane.close()
    # Re-initialisation in the same process works (both roles here, aliased memory).
    w = World(1, 1, spec, max_tokens=4, stages=1, generation=2)
    ok = []
    for layer in range(5):
        inp = [w.wire(3, seed=layer)]
        out = [torch.empty(3, 512, dtype=torch.bfloat16, device=DEV)]
        torch.cuda.synchronize(DEV)  # made on the default stream, read on the ranks' streams
        run_step(w, [3], 0, layer, inp, out)
        torch.cuda.synchronize(DEV)
        ok.append(bool(torch.equal(out[0], ffn_compute(inp[0][0]))))
    w.close()
    return (type(err).__name__, err.op, err.peer, err.layer, err.stage, waited, all(ok))



@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim", [ATTENTION, FFN])
def test_a_role_dying_mid_spin_gives_the_survivor_the_named_error_and_a_working_reinit(victim):
    from afd_ext.tools.testing import find_free_port, place_processes, run_workers

    res = run_workers(_ipc_worker, 2, (find_free_port(), 1, 1, 1, victim), timeout_s=150,
                      per_rank_env=place_processes(1, 1).env())
    survivor = res[1] if victim == FFN else res[0]
    name, op, peer, layer, stage, waited, reinit_ok = survivor
    assert name == "AFDTimeoutError" and layer == 7 and stage == 0
    if victim == FFN:
        assert op == "recv_ffn_output" and peer == "FFN rank 0 (world rank 0)"
    else:
        assert op == "recv_attn_output" and peer == "attention rank 0 (world rank 1)"
    assert 2.5 < waited < 30
    assert reinit_ok




# ------------------------------------------------------------------ eager exchanges




@pytest.mark.timeout(120)
# 1A1F and 2A1F are subsets of these (and run through the connector in test_connector_peer.py).
@pytest.mark.parametrize("A,F", [(1, 2), (4, 2), (3, 2)])
def test_eager_steps_uneven_and_zero_counts_two_stages(A, F):
    w = World(A, F, SPEC_FULL, max_tokens=64, stages=2)
    try:
        g = torch.Generator().manual_seed(A * 10 + F)
        for step in range(8):
            counts = [int(x) for x in torch.randint(0, 65, (A,), generator=g)]
            if step % 4 == 1:
                counts[0] = 0  # a zero-token peer still advances its flags
            if step == 5:
                counts = [0] * A  # a step with no tokens at all
            for layer in range(3):
                for stage in range(2):
                    inputs, outs = [], []
                    for a in range(A):
                        with torch.cuda.stream(w.sa[a]):
                            inputs.append(w.wire(counts[a], seed=step * 1000 + layer * 10 + stage * 7 + a))
                            outs.append(torch.full((counts[a], SPEC_FULL.hidden_size), float("nan"),
                                                   dtype=SPEC_FULL.hidden_dtype, device=DEV))
                    seen = []
                    run_step(w, counts, stage, layer, inputs, outs, check=seen, slow_ffn=(step % 3 == 2))
                    torch.cuda.synchronize(DEV)
                    for f, got in seen:
                        if sum(1 for a in w.topo.ffn_peers(f) for ff, _, c in w.topo.split_rows(a, counts[a])
                               if ff == f and c) == 0:
                            assert all(v.shape[0] == 0 for v in got)
                            continue
                        want = expected_fan_in(w, inputs, f, counts)
                        assert len(got) == len(want) == 3
                        for gv, wv in zip(got, want):
                            assert torch.equal(gv, wv), (step, layer, stage, f)
                    for a in range(A):
                        assert torch.equal(outs[a], ffn_compute(inputs[a][0])), (step, layer, stage, a)
        for p in w.att + w.ffn:
            p.raise_if_failed()
    finally:
        w.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tokens", [1, 128])
def test_round_trip_time_in_graphs_on_one_gpu(tokens):
    """Indicative only: both roles on one GPU ("peer" memory is local), 7168 bf16 + 256 fp32 logits + ids.

    The FFN rank replies with its fan-in view itself (no compute), so a round trip
    is put -> wait -> put -> wait(copy into ref_tensor): four kernels.
    """
    w = World(1, 1, SPEC_FULL, max_tokens=tokens, stages=1, timeout_s=30.0)
    try:
        att, ffn = w.att[0], w.ffn[0]
        with torch.cuda.stream(w.sa[0]):
            inp = w.wire(tokens, seed=1)
            ref = torch.empty(tokens, SPEC_FULL.hidden_size, dtype=SPEC_FULL.hidden_dtype, device=DEV)
        torch.cuda.synchronize(DEV)
        n = 100
        ga, gf = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(ga, stream=w.sa[0]):
            for layer in range(n):
                att.put(0, inp, [tokens], [0])
                att.wait(0, tokens, layer=layer, out=ref)
        with torch.cuda.graph(gf, stream=w.sf[0]):
            for layer in range(n):
                x, _lg, _ids = ffn.wait(0, tokens, layer=layer)
                ffn.put(0, (x,), [tokens], [0])
        times = []
        for rep in range(6):
            torch.cuda.synchronize(DEV)
            t0 = time.perf_counter()
            with torch.cuda.stream(w.sf[0]):
                gf.replay()
            with torch.cuda.stream(w.sa[0]):
                ga.replay()
            torch.cuda.synchronize(DEV)
            times.append((time.perf_counter() - t0) / n * 1e6)
        assert torch.equal(ref, inp[0])
        att.raise_if_failed()
        ffn.raise_if_failed()
        best = min(times[1:])
        print(f"\n{tokens} token(s): {best:.2f} us per round trip in a CUDA graph (both roles on one GPU; "
              f"replays: {', '.join(f'{t:.2f}' for t in times)})")
        assert best > 0
    finally:
        w.close()


# ------------------------------------------------------------------ the demo over peer memory, CUDA graphs on both roles


@pytest.mark.timeout(420)
@pytest.mark.parametrize("topology", ["2A1F"])  # fan-in; 1A1F is a subset
def test_demo_graph_over_peer_memory(tmp_path, topology):
    """A real MoE decoder served AFD-style over the peer transport, decode steps replayed from CUDA graphs,
    checked position by position against the whole model."""
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "afd_ext", "demo", "--backend", "peer", "--no-progress", "--graph",
           "--topology", topology, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=os.getcwd())
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["backend"] == "peer" and s["graph"] is True and s["device"] == "cuda"
    assert s["self_check"]["ok"], s["self_check"]["failures"]
    modes = s["ffn_graph_modes"][0]
    assert modes["replay"] >= 1 and modes["capture"] >= 1
    assert modes["replay"] + modes["eager"] == s["steps"]
