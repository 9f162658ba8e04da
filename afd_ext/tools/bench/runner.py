"""The per-process benchmark loop: set up links, alternate variants, time, check.

One process per AFD world rank (FFN ranks first), started by
:func:`afd_ext.tools.testing.run_workers` with ``CUDA_VISIBLE_DEVICES`` bound per
rank before the first CUDA call. Processes meet through a ``TCPStore`` hosted
by world rank 0 and a gloo process group (barriers, agreement, unique ids);
the data plane uses one pair of 2-rank NCCL communicators (one per direction)
per edge, created with our ``comm_create``.

Lockstep: every rank walks the same list of measurements in the same order.
Before each timed block every rank drains its stream (an event polled with a
deadline) and meets the others at a gloo barrier, so variants never overlap.
Attention ranks time the loop with CUDA events (the round trip from the
attention side); FFN ranks time their own loop too (reported separately).

"""


from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import threading
import zlib
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

import afd_ext.tools.bench.variants as V  # attributes read at call time: the tests patch the pattern
from afd_ext import ops
from afd_ext.errors import AFDConfigError
from afd_ext.tools.bench.plan import Case, RunConfig
from afd_ext.tools.bench.timing import capture_graph, drain_stream, summarize, time_eager, time_graph
from afd_ext.topology import ATTENTION, FFN, Topology
from afd_ext.transport.base import PeerMap
from afd_ext.transport.gloo import GlooTransport


class _Env:
    """Everything set up once per process, and the current case's edges: the ``ctx`` every variant gets."""

    def __init__(self, rank: int, nprocs: int, cfg: RunConfig):
        self.cfg, self.rank, self.nprocs = cfg, rank, nprocs
        self.backend, self.fp8_scale_format, self.cuda = cfg.backend, cfg.fp8_scale_format, cfg.backend == "nccl"
        self.topo = Topology(cfg.layout.num_attention_ranks, cfg.layout.num_ffn_ranks)
        self.role, self.role_rank = self.topo.role_of(rank)
        if self.cuda and not torch.cuda.is_available():
            raise AFDConfigError(f"world rank {rank}: backend nccl but no CUDA device is visible "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(0)
        td = datetime.timedelta(seconds=cfg.peer_wait_s)
        self.store = dist.TCPStore("127.0.0.1", cfg.master_port, nprocs, rank == 0, timeout=td)
        dist.init_process_group("gloo", store=self.store, rank=rank, world_size=nprocs, timeout=td)
        self.comms: dict[tuple[int, int, str], int] = {}
        self.gloo_transport = None
        self.links: list = []  # this rank's edges in the current case (set_case)
        self.graph_mode = False  # set while a variant is captured/replayed (the reference then preallocates)
        if self.cuda:
            self._create_comms()
        else:  # this package's gloo transport over the default group: the ours_* variants' CPU path
            peers = PeerMap(self.role, self.role_rank, self.topo.num_attention_ranks, self.topo.num_ffn_ranks)
            self.gloo_transport = GlooTransport(self.store, peers, timeout_s=cfg.peer_wait_s,
                                                init_timeout_s=cfg.peer_wait_s)

    def label(self) -> str:
        return f"{self.role} rank {self.role_rank} (world rank {self.rank})"

    def sync(self, what: str) -> None:
        """Drain this rank's stream, then meet every rank: nothing of one block overlaps the next."""
        self.drain(what)
        dist.barrier()

    def drain(self, what: str) -> None:
        if self.cuda:
            drain_stream(self.cfg.case_timeout_s, f"{self.label()}: {what}")

    def _create_comms(self) -> None:
        # Global edge order on every rank: each 2-rank comm_create blocks until
        # both ends arrive, and a total order cannot deadlock.
        mine = 0 if self.role == ATTENTION else 1
        for a, f in [e for e in self.topo.edges() if e[mine] == self.role_rank]:
            for d in ("a2f", "f2a"):
                key = f"afd-bench/uid/{a}/{f}/{d}"
                if self.role == FFN:
                    uid = ops.nccl_unique_id()
                    self.store.set(key, bytes(uid.numpy().tobytes()))
                else:
                    raw = self.store.get(key)  # bounded by the store timeout
                    uid = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
                self.comms[(a, f, d)] = ops.comm_create(uid, 2, 0 if self.role == FFN else 1, 0)

    def set_case(self, case: Case) -> None:
        """This rank's edges for ``case`` (rows per edge from the topology), in fan-in order (FFN) or peer order."""
        topo, n = self.topo, case.tokens

        def fan_in(f: int) -> dict[int, tuple[int, int, int]]:  # attention peer -> (start, count, offset in fan-in)
            out, off = {}, 0
            for a in topo.ffn_peers(f):
                start, count = next((s, c) for ff, s, c in topo.split_rows(a, n) if ff == f)
                out[a], off = (start, count, off), off + count
            return out

        def link(a: int, f: int, start: int, count: int, offset: int, dst: int) -> V.Link:
            peer = (FFN, f) if self.role == ATTENTION else (ATTENTION, a)
            return V.Link(peer[1], topo.world_rank(*peer), start, count, offset, dst,
                        {d: self.comms[(a, f, d)] for d in ("a2f", "f2a") if (a, f, d) in self.comms},
                        nccl_peer=0 if self.role == ATTENTION else 1)

        if self.role == ATTENTION:
            a = self.role_rank
            self.links = [link(a, f, s, c, s, fan_in(f)[a][2]) for f, s, c in topo.split_rows(a, n)]
        else:
            f = self.role_rank
            self.links = [link(a, f, s, c, off, s) for a, (s, c, off) in fan_in(f).items()]

    @property
    def rows(self) -> int:
        """Rows of this rank's tensors: the attention rank's tokens, or the FFN rank's fan-in total."""
        if self.role == ATTENTION:
            return max((l.offset + l.count for l in self.links), default=0)
        return sum(l.count for l in self.links)

    def close(self) -> None:
        try:
            self.drain("close")
        finally:
            for h in self.comms.values():  # none on the CPU path
                with contextlib.suppress(Exception):  # best effort at exit
                    ops.comm_destroy(h)
            dist.destroy_process_group()


def _setup_variants(env: _Env, case: Case) -> tuple[list, dict[str, str]]:
    """The variants that run ``case``, agreed by every rank, and why the others are skipped."""
    local: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    for name in env.cfg.variants:
        try:
            why = V.VARIANTS[name].skip_reason(case, env.cfg.backend)
            if why is None:
                local[name] = V.VARIANTS[name](env, case)
        except Exception as e:  # noqa: BLE001 - agreed below, reported in the JSON
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            reasons[name] = why
    every: list[Any] = [None] * env.nprocs
    dist.all_gather_object(every, reasons)  # a variant skipped on one rank is skipped on all
    merged: dict[str, str] = {}
    for r in reversed(every):  # the lowest rank's reason
        merged.update(r)
    for n in [n for n in local if n in merged]:  # in the same order on every rank
        local.pop(n).close()
    return list(local.values()), merged


def _key(env: _Env, case: Case, name: str, mode: str) -> dict:
    """The fields naming one measurement (or one check) of this rank."""
    return {"case": dataclasses.asdict(case), "case_key": case.key(), "variant": name, "mode": mode,
            "direction": "round_trip", "role": env.role, "role_rank": env.role_rank}


def _time_case(env: _Env, case: Case, variants: list) -> list[dict]:
    """Round trips of every variant, eager then graph, variants alternated per timed block."""
    cfg, reps, nb = env.cfg, env.cfg.reps, case.a2f_bytes() + case.f2a_bytes()
    records: list[dict] = []
    for mode in cfg.modes:
        env.graph_mode = mode == "graph"
        vlist = [v for v in variants if mode == "eager" or v.graph_ok]
        # Eager warm-up of every edge (NCCL connects lazily, never inside a capture).
        for v in vlist:
            env.sync("warm-up")
            time_eager(v.step(), iters=reps.warmup, warmup=0, cuda=env.cuda, timed=False,
                       timeout_s=cfg.case_timeout_s, what=f"{env.label()} warm-up {v.name}")
        graphs: dict[str, Any] = {}
        k = reps.graph_k(nb)
        if mode == "graph":
            for v in vlist:
                env.sync("before capture")
                graphs[v.name] = capture_graph(v.step(), k)
        samples: dict[str, list[float]] = {v.name: [] for v in vlist}
        calls: dict[str, defaultdict[str, list[float]]] = {v.name: defaultdict(list) for v in vlist}
        for _ in range(reps.rounds):
            for v in vlist:
                env.sync("between variants")
                what = f"{env.label()} {case.key()} {v.name}/{mode}"
                if mode == "eager":
                    v.call_us = defaultdict(list)  # host µs per data call, warm-up iterations first
                    s = time_eager(v.step(), iters=reps.per_round(nb, True), warmup=reps.warmup,
                                   cuda=env.cuda, timeout_s=cfg.case_timeout_s, what=what)
                    for call, us in v.call_us.items():
                        calls[v.name][call] += us[reps.warmup:]
                    v.call_us = None
                else:
                    s = time_graph(graphs[v.name], reps.graph_replays_per_round(nb), warmup=1, graph_iters=k,
                                   timeout_s=cfg.case_timeout_s, what=what)
                samples[v.name].extend(s)
        env.drain("end of mode")
        graphs.clear()
        env.graph_mode = False
        for v in vlist:
            stats = dataclasses.asdict(summarize(samples[v.name]))
            rec = dict(_key(env, case, v.name, mode), A=env.topo.num_attention_ranks, F=env.topo.num_ffn_ranks,
                       peers=[l.peer for l in env.links if l.count > 0], rows=env.rows,
                       bytes_a2f=env.rows * v.a2f_row_bytes(),  # FP8 variants move fewer
                       bytes_f2a=case.f2a_bytes(env.rows), hidden_bytes_per_token=v.hidden_bytes_per_token(),
                       stats_us=stats)
            rec["gbps"] = (rec["bytes_a2f"] + rec["bytes_f2a"]) / (stats["median"] * 1e3)
            if mode == "graph":
                rec["graph_iters"] = k
            if calls[v.name]:
                rec["calls_us"] = {c: dataclasses.asdict(summarize(us)) for c, us in calls[v.name].items()}
            records.append(rec)
    return records


def _check_case(env: _Env, case: Case, variants: list) -> list[dict]:
    """Two checked round trips per variant and mode: the FFN rank verifies every received byte
    against each attention peer's pattern, the attention rank the XOR-ed reply."""
    out: list[dict] = []
    hb = case.f2a_row_bytes()
    for mode in env.cfg.modes:
        env.graph_mode = mode == "graph"
        for v in [v for v in variants if mode == "eager" or v.graph_ok]:
            v.check = True
            step = v.step()
            env.sync("check warm-up")
            step()  # eager warm-up of this edge
            graph = None
            if mode == "graph":
                env.sync("before capture")  # drained and met: the warm-up never overlaps the capture
                graph = capture_graph(step, 1)
            else:
                env.drain("check warm-up")
            errors: list[str] = []
            for it in range(2):
                seed = zlib.crc32(f"{case.key()}/{v.name}/{mode}/{it}".encode()) & 0x7FFFFFFF
                if env.role == ATTENTION:
                    for k, t in enumerate(v.inputs):
                        V.rows_bytes(t).copy_(V.pattern_bytes(t.shape[0], V.rows_bytes(t).shape[1], seed,
                                                          env.role_rank * 8 + k, env.device))
                    expected = torch.bitwise_xor(V.rows_bytes(v.delivered(v.inputs[0]))[:, :hb], V.XOR_BYTE)
                    if all(v.reply.data_ptr() != t.data_ptr() for t in v.inputs):
                        v.reply.zero_()
                env.sync("check fill")
                if graph is None:
                    step()
                else:
                    graph.replay()
                env.drain(f"check {v.name}/{mode}")
                if env.role == ATTENTION:
                    errors += _compare(V.rows_bytes(v.reply), expected, f"reply at {env.label()}")
                    continue
                snap, cols = v.snap, v.input_cols()
                for l in [l for l in env.links if l.count]:
                    want = v.as_received([V.pattern_bytes(case.tokens, c, seed, l.peer * 8 + k, env.device)
                                          [l.start:l.start + l.count] for k, c in enumerate(cols)])
                    if snap is None or len(snap) != len(want):
                        errors.append(f"the FFN check hook saw {snap and len(snap)} tensors, expected {len(want)}")
                        break
                    for k, t in enumerate(snap):
                        errors += _compare(V.rows_bytes(t)[l.offset:l.offset + l.count], want[k],
                                           f"tensor {k} rows of attention rank {l.peer} at {env.label()}")
            del graph
            out.append(dict(_key(env, case, v.name, mode), ok=not errors, errors=errors[:5]))
            v.check = False
        env.graph_mode = False
    return out


def _compare(got, expected, what: str) -> list[str]:
    if tuple(got.shape) != tuple(expected.shape):
        return [f"{what}: shape {tuple(got.shape)} != expected {tuple(expected.shape)}"]
    if torch.equal(got, expected):
        return []
    bad = (got != expected)
    first = bad.nonzero()[0].tolist()
    return [f"{what}: {int(bad.sum())} of {got.numel()} bytes differ, first at row {first[0]} byte {first[1]}"]


def bench_worker(rank: int, nprocs: int, cfg: RunConfig) -> dict:
    """Worker body for :func:`afd_ext.tools.testing.run_workers` (one process per AFD world rank).

    Every wait on the device or a peer is bounded by ``cfg.case_timeout_s`` and fails with a
    ``TimeoutError`` naming the rank, case, variant and direction; a call that cannot be
    interrupted (a hung NCCL call holds the GIL) is ended by the run's overall timeout.

    Returns:
        ``{"rank", "role", "role_rank", "records", "checks", "skipped", "device"?, "cuda_visible_devices"?}``.
    """
    logging.basicConfig(level=logging.INFO, format=f"[bench r{rank}] %(message)s")
    env = _Env(rank, nprocs, cfg)
    info: dict[str, Any] = {"rank": rank, "role": env.role, "role_rank": env.role_rank, "records": [],
                            "checks": [], "skipped": []}
    if env.cuda:
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    cases = cfg.cases
    if cfg.progress and env.role == ATTENTION and env.role_rank == 0:  # the one progress display: cases done
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock leaks a semaphore at exit
        cases = tqdm(cases, unit="case", desc=f"afd-ext bench {'check' if cfg.check else 'sweep'} over {cfg.backend}",
                     mininterval=1.0 if sys.stderr.isatty() else 15.0)
    for case in cases:
        env.set_case(case)
        variants, skipped = _setup_variants(env, case)
        info["skipped"] += [{"case_key": case.key(), "variant": n, "reason": why} for n, why in skipped.items()]
        if cfg.check:
            info["checks"] += _check_case(env, case, variants)
        else:
            info["records"] += _time_case(env, case, variants)
        for v in variants:
            v.close()
        del variants
        env.drain("end of case")
    env.sync("end of run")
    env.close()
    return info
