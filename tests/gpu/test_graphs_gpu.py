"""GPU tier: CUDA graphs across the whole AFD exchange, on both roles (issue 5).

Run on the GPU machine from the repository root, after the CUDA build:

    pytest -m gpu tests/gpu/test_graphs_gpu.py -v

Processes are placed by :func:`afd_ext.tools.testing.place_processes`
(``CUDA_VISIBLE_DEVICES`` per process): on two GPUs FFN ranks on GPU 1 and
attention ranks on GPU 0; on one GPU every process on GPU 0 with its own
``NCCL_HOSTID`` (NCCL over sockets, ~4.5 ms per round trip). Several processes
on one GPU prove correctness only (time-sliced), never speed.

Each test is a scripted sequence of steps that every process derives from the
same parameters: the control payload (counts and flags) of each step, and the
seed of each attention rank's fresh inputs. Both roles build the step's
schedule and graph key, and act on the payload's flags through
``GraphController.decide`` — the decision rule under test. The FFN side
captures its whole per-step loop (all layers x all stages: fan-in, compute,
split-back) into one graph per key; the attention side captures its layer loop
(per layer and stage: its "attention" compute, split-back of the wire tensors,
fan-in of the reply). Every buffer a graph touches comes from the graph's
``StaticArena``; eager steps allocate their own.

The FFN compute is elementwise (row-independent), so every attention rank can
also compute, locally and with the same kernels, what its rows must come back
as: each replay is compared bit-exactly with that, and every tenth replay is
followed by a real eager exchange step on the same inputs, compared bit-exactly
with the replay.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

# No CUDA call at import: the spawned workers import this module before they set
# CUDA_VISIBLE_DEVICES, and a CUDA call would pin every worker to all GPUs.
pytestmark = pytest.mark.gpu

HIDDEN = 64
LAYERS = 2
LOGITS_WIDTH = 8
CAPTURE_SIZES = (1, 2, 4, 8)
REPLAYS = 200
#: Replays per capture size when NCCL goes over sockets (one shared GPU): a round
#: trip costs ~4.5 ms there, so 4 sizes x 200 replays would take minutes. 50 fresh-input
#: replays per size, 5 of them compared with an eager step, still test every size.
SHARED_REPLAYS = 50
EAGER_EVERY = 10
TIMEOUT_S = 420


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every process of one test agrees on."""

    A: int
    F: int
    stages: int = 1
    router_logits: bool = True
    token_ids: bool = True
    hidden: int = HIDDEN
    layers: int = LAYERS
    dtype: str = "bfloat16"
    logits_width: int = LOGITS_WIDTH
    replays: int = REPLAYS  # per capture size, in the "sizes" script


@dataclasses.dataclass(frozen=True)
class Step:
    """One scripted step: counts per stage, the flag set, whether graph padding applies."""

    counts: tuple[tuple[int, ...], ...]  # per stage, per attention rank (real counts)
    mode: str  # "eager" | "warmup" | "capture" | "replay" | "refuse"
    seed: int = 0
    pad: bool = False
    compare_with_previous: bool = False  # eager step on the previous replay's inputs


# ---------------------------------------------------------------------------
# Scripts (pure: every process computes the same list)
# ---------------------------------------------------------------------------


def _sizes_script(A: int, stages: int, replays: int) -> list[Step]:
    """Capture per-peer sizes 1, 2, 4, 8; ``replays`` replays each with fresh inputs and counts <= size."""
    steps = [Step(tuple((CAPTURE_SIZES[-1],) * A for _ in range(stages)), "warmup", seed=1, pad=True)]
    seed = 100
    for size in CAPTURE_SIZES:
        full = tuple((size,) * A for _ in range(stages))
        steps.append(Step(full, "capture", pad=True))
        for i in range(replays):
            seed += 1
            # Fresh real counts <= size; attention rank 0 carries `size` rows so the padded key is `size`.
            counts = tuple(
                tuple(size if a == 0 else (seed * 7 + a * 3 + s) % (size + 1) for a in range(A))
                for s in range(stages)
            )
            steps.append(Step(counts, "replay", seed=seed, pad=True))
            if i % EAGER_EVERY == 0:
                steps.append(Step(counts, "eager", seed=seed, compare_with_previous=True))
    return steps


def _mismatch_script() -> list[Step]:
    """[4, 4] captured; an eager [7, 1] step (same total) must run eagerly, and its replay is refused."""
    return [
        Step(((4, 4),), "warmup", seed=1, pad=True),
        Step(((4, 4),), "capture", pad=True),
        Step(((4, 4),), "replay", seed=2, pad=True),
        Step(((7, 1),), "eager", seed=3),
        Step(((7, 1),), "refuse", seed=3),
        Step(((4, 4),), "replay", seed=4, pad=True),
        Step(((7, 1),), "eager", seed=5),
        Step(((3, 4),), "replay", seed=6, pad=True),
    ]


def _big_eager_script() -> list[Step]:
    """An eager [1000, 760] step between replays of a [2, 2] graph."""
    steps = [Step(((2, 2),), "warmup", seed=1, pad=True), Step(((2, 2),), "capture", pad=True)]
    for i in range(6):
        steps.append(Step(((2, 2),), "replay", seed=10 + i, pad=True))
        steps.append(Step(((1000, 760),), "eager", seed=20 + i))
    steps.append(Step(((2, 1),), "replay", seed=30, pad=True))
    return steps


def _zero_peer_script() -> list[Step]:
    """Two stages with zero-token peers in captured steps (padded to one capture size per stage)."""
    return [
        Step(((4, 4), (2, 2)), "warmup", seed=1, pad=True),
        Step(((4, 4), (2, 2)), "capture", pad=True),
        Step(((3, 0), (0, 2)), "replay", seed=2, pad=True),
        Step(((3, 0), (0, 2)), "eager", seed=2, compare_with_previous=True),
        Step(((0, 4), (2, 0)), "replay", seed=3, pad=True),
        Step(((0, 4), (2, 0)), "eager", seed=3, compare_with_previous=True),
        Step(((4, 1), (1, 2)), "replay", seed=4, pad=True),
    ]


SCRIPTS = {
    "sizes": lambda setup: _sizes_script(setup.A, setup.stages, setup.replays),
    "mismatch": lambda setup: _mismatch_script(),
    "big_eager": lambda setup: _big_eager_script(),
    "zero_peer": lambda setup: _zero_peer_script(),
}


# ---------------------------------------------------------------------------
# The compute of each role (elementwise, so real rows never depend on padding)
# ---------------------------------------------------------------------------


def attention_compute(layer: int, h: torch.Tensor, out: torch.Tensor) -> None:
    """The attention side's per-layer work before the exchange: ``out = h * 0.9 + 0.1 * layer``."""
    out.copy_((h.float() * 0.9 + 0.1 * layer).to(out.dtype))


def ffn_compute(layer: int, hidden, logits, ids, out: torch.Tensor) -> None:
    """The FFN: ``tanh(h * (0.5 + 0.1 layer)) + 0.25 * logits[:, 0] + 1e-3 * ids``, per row."""
    y = torch.tanh(hidden.float() * (0.5 + 0.1 * layer))
    if logits is not None:
        y = y + logits[:, :1].float() * 0.25
    if ids is not None:
        y = y + ids.float().unsqueeze(1) * 1e-3
    out.copy_(y.to(out.dtype))


def fresh_inputs(setup: Setup, seed: int, rank: int, stage: int, n: int, device):
    """Deterministic fresh inputs of attention rank ``rank``: hidden, logits, ids (real rows only)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank * 31 + stage)
    dtype = getattr(torch, setup.dtype)
    h = torch.randn(n, setup.hidden, generator=g).to(dtype)
    lg = torch.randn(n, setup.logits_width, generator=g) if setup.router_logits else None
    ids = torch.randint(0, 50000, (n,), generator=g, dtype=torch.int32) if setup.token_ids else None
    return tuple(None if t is None else t.to(device) for t in (h, lg, ids))


def local_reference(setup: Setup, h, lg, ids) -> torch.Tensor:
    """What the exchange must return for these real rows after the whole layer loop."""
    h = h.clone()
    send = torch.empty_like(h)
    reply = torch.empty_like(h)
    for layer in range(setup.layers):
        attention_compute(layer, h, send)
        ffn_compute(layer, send, lg, ids, reply)
        h.copy_(reply + send)
    return h


# ---------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------


class _Ctx:
    """Per-process state: role, communicators, controller."""

    def __init__(self, rank: int, setup: Setup, port: int, nprocs: int):
        from afd_ext import graphs, ops
        from afd_ext.topology import Topology

        self.ops, self.graphs = ops, graphs
        self.setup = setup
        self.topo = Topology(setup.A, setup.F)
        self.role, self.rr = ("ffn", rank) if rank < setup.F else ("attention", rank - setup.F)
        torch.cuda.set_device(0)
        self.device = torch.device("cuda", 0)
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, nprocs, rank == 0, timeout=timedelta(seconds=120)
        )
        self.store = store
        self.comms: dict[tuple[int, int, str], int] = {}
        # Every rank walks the edges in one global order, so blocking inits cannot form a cycle.
        for a, f in self.topo.edges():
            if not ((self.role == "attention" and a == self.rr) or (self.role == "ffn" and f == self.rr)):
                continue
            for d in ("a2f", "f2a"):
                k = f"graphs-test/uid/{d}/{a}/{f}"
                if self.role == "ffn":
                    uid = ops.nccl_unique_id()
                    store.set(k, uid.numpy().tobytes())
                else:
                    uid = torch.frombuffer(bytearray(store.get(k)), dtype=torch.uint8)
                self.comms[(a, f, d)] = ops.comm_create(uid, 2, 0 if self.role == "ffn" else 1, 0)
        self.ctl = graphs.GraphController(role=self.role, cache_size=8, device=self.device,
                                          capture_sizes=CAPTURE_SIZES)

    def close(self):
        self.ctl.close()
        torch.cuda.synchronize()
        for h in self.comms.values():
            self.ops.comm_destroy(h)

    # -- schedule ------------------------------------------------------------

    def schedule(self, step: Step):
        from afd_ext import schedule as sch
        from afd_ext.metadata import AFDControlPayload

        s = self.setup
        flags = {
            "warmup": dict(is_warmup=True),
            "capture": dict(is_graph_capturing=True),
            "replay": dict(is_graph_replaying=True),
            "refuse": dict(is_graph_replaying=True),
        }.get(step.mode, {})
        payload = AFDControlPayload(
            dp_metadata_list={i: list(c) for i, c in enumerate(step.counts)}, **flags
        )
        pad = sch.pad_sizes(self.topo, payload, CAPTURE_SIZES) if step.pad else None
        if step.pad and pad is None:
            raise AssertionError(f"step {step} does not fit the capture sizes")
        config = sch.ScheduleConfig(
            num_layers=s.layers, hidden_size=s.hidden, hidden_dtype=getattr(torch, s.dtype),
            router_logits_width=s.logits_width if s.router_logits else None,
            send_token_ids=s.token_ids, pad_to=pad,
        )
        sched = sch.build_step_schedule(self.topo, payload, config)
        return payload, sched, self.graphs.graph_key_from_schedule(sched)

    # -- the two loops -----------------------------------------------------------

    def _send(self, b, comms, rows):
        # The wire parts in wire order (afd_ext.wire): the sent hidden states, then what else travels.
        wire = [b["send"]] + [b[k] for k in ("router_logits", "token_ids") if k in b]
        self.ops.split_back(wire, comms, [self._peer] * len(comms), rows)

    @property
    def _peer(self) -> int:
        return 0 if self.role == "attention" else 1  # the other end's rank in a size-2 communicator

    def attention_exchange(self, b, plan):
        """Attention half of one stage's exchange: send the wire tensors, fan in the reply into ``b["reply"]``."""
        a2f = [self.comms[(self.rr, f, "a2f")] for f in plan.peers]
        f2a = [self.comms[(self.rr, f, "f2a")] for f in plan.peers]
        self._send(b, a2f, list(plan.rows))
        self.ops.fan_in([b["reply"]], f2a, [self._peer] * len(f2a), list(plan.rows))

    def ffn_fan_in(self, b, plan):
        """FFN side: fan in one stage from every peer into ``b``."""
        a2f = [self.comms[(a, self.rr, "a2f")] for a in plan.peers]
        wire = [b[k] for k in ("hidden", "router_logits", "token_ids") if k in b]
        self.ops.fan_in(wire, a2f, [self._peer] * len(plan.peers), list(plan.rows))

    def ffn_split_back(self, out, plan):
        """FFN side: send each peer of one stage its rows of ``out``."""
        f2a = [self.comms[(a, self.rr, "f2a")] for a in plan.peers]
        self.ops.split_back([out], f2a, [self._peer] * len(f2a), list(plan.rows))

    def attention_loop(self, sched, bufs):
        """Per layer and stage: attention compute, split-back of the wire tensors, fan-in of the reply."""
        for layer in range(self.setup.layers):
            for s in sched.stages:
                b = bufs[s]
                attention_compute(layer, b["hidden"], b["send"])
                self.attention_exchange(b, sched.attention_plan(s, self.rr))
                b["hidden"].copy_(b["reply"] + b["send"])
        return bufs

    def ffn_loop(self, sched, bufs):
        """All layers x all stages: fan-in, compute, split-back."""
        for layer in range(self.setup.layers):
            for s in sched.stages:
                b = bufs[s]
                plan = sched.ffn_plan(s, self.rr)
                self.ffn_fan_in(b, plan)
                ffn_compute(layer, b["hidden"], b.get("router_logits"), b.get("token_ids"), b["output"])
                self.ffn_split_back(b["output"], plan)
        return bufs

    def buffers(self, arena, sched):
        """The rank's static buffers of every stage (``schedule.stage_buffers``, the one stage layout)."""
        from afd_ext.schedule import stage_buffers

        if self.role == "ffn":
            return {s: stage_buffers(arena.buffer, sched.config, s, sched.ffn_rows(s, self.rr), ("output",),
                                     fan_in=True) for s in sched.stages}
        return {s: stage_buffers(arena.buffer, sched.config, s, sched.attention_rows(s, self.rr), ("reply", "send"))
                for s in sched.stages}

    def fill(self, sched, bufs, step: Step):
        """Attention side: copy fresh real rows into the step's buffers, zero the padding rows."""
        real = {}
        for s in sched.stages:
            n = sched.real_rows(s, self.rr)
            h, lg, ids = fresh_inputs(self.setup, step.seed, self.rr, s, n, self.device)
            b = bufs[s]
            self.graphs.pad_rows_into(h, b["hidden"])
            if lg is not None:
                self.graphs.pad_rows_into(lg, b["router_logits"])
            if ids is not None:
                self.graphs.pad_rows_into(ids, b["token_ids"])
            real[s] = (h, lg, ids)
        return real


def _worker(rank: int, nprocs: int, setup: Setup, script_name: str, port: int) -> dict:
    ctx = _Ctx(rank, setup, port, nprocs)
    try:
        return run_script(ctx, setup, script_name)
    finally:
        ctx.close()


def run_script(ctx, setup: Setup, script_name: str) -> dict:
    """Run one scripted test on one rank; return its report (``failures`` empty when it passed)."""
    from afd_ext.graphs import GraphKeyMismatchError, StaticArena, StepMode

    report = {"role": ctx.role, "rank": ctx.rr, "failures": [], "replays": 0, "eager_compared": 0,
              "refused": 0, "captures": 0, "address_checks": 0}
    fail = report["failures"].append
    last_replay: dict[int, torch.Tensor] = {}
    addresses: dict = {}
    static: dict = {}  # key -> the captured graph's buffers (the graph's arena owns them)
    for i, step in enumerate(SCRIPTS[script_name](setup)):
        payload, sched, key = ctx.schedule(step)
        if step.mode == "refuse":
            # Both roles refuse locally (no traffic): the key was never captured.
            try:
                ctx.ctl.decide(payload, key)
                fail(f"step {i}: replay of uncaptured {key.describe()} was not refused")
            except GraphKeyMismatchError:
                report["refused"] += 1
            continue
        mode = ctx.ctl.decide(payload, key)
        if mode.value != step.mode:
            fail(f"step {i}: decided {mode.value}, script says {step.mode}")
        if mode is StepMode.CAPTURE:
            arena = ctx.ctl.new_arena(key)
            bufs = ctx.buffers(arena, sched)
            loop = ctx.ffn_loop if ctx.role == "ffn" else ctx.attention_loop
            entry = ctx.ctl.capture(key, arena, lambda loop=loop, sched=sched, bufs=bufs: loop(sched, bufs))
            addresses[key] = entry.arena.addresses()
            static[key] = bufs
            report["captures"] += 1
            continue
        if mode is StepMode.REPLAY:
            bufs = static[key]
            real = ctx.fill(sched, bufs, step) if ctx.role == "attention" else None
            ctx.ctl.replay(key)
            report["replays"] += 1
        else:  # EAGER / WARMUP: separate buffers, real traffic
            bufs = ctx.buffers(StaticArena(ctx.device, label="eager"), sched)
            real = ctx.fill(sched, bufs, step) if ctx.role == "attention" else None
            (ctx.ffn_loop if ctx.role == "ffn" else ctx.attention_loop)(sched, bufs)
            ctx.ctl.note_eager_step(mode, sched, ctx.rr)
        # Every captured graph keeps its buffers where they were captured.
        for k, addr in addresses.items():
            e = ctx.ctl.entry(k)
            if e is None or e.arena.addresses() != addr:
                fail(f"step {i}: buffers of {k.describe()} moved or were freed")
            report["address_checks"] += 1
        if ctx.role != "attention":
            continue
        for s in sched.stages:
            n = sched.real_rows(s, ctx.rr)
            got = bufs[s]["hidden"][:n]
            want = local_reference(setup, *real[s])
            if not torch.equal(got, want):
                fail(f"step {i} ({step.mode}, counts {step.counts}) stage {s}: "
                     f"max diff {(got.float() - want.float()).abs().max().item()}")
            if mode is StepMode.REPLAY:
                last_replay[s] = got.clone()
            elif step.compare_with_previous:
                if not torch.equal(got, last_replay[s]):
                    fail(f"step {i} stage {s}: eager result differs from the replay on the same inputs")
                elif s == sched.stages[-1]:
                    report["eager_compared"] += 1
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    if ctx.role == "ffn":
        report["entry_replays"] = {k.describe(): ctx.ctl.entry(k).replays for k in ctx.ctl.cache.keys()}
    report["cached"] = [(k.describe(), ctx.ctl.entry(k).arena.nbytes) for k in ctx.ctl.cache.keys()]
    return report


def _run(setup: Setup, script: str) -> list[dict]:
    from afd_ext.tools.testing import find_free_port, place_processes, run_workers

    n = setup.A + setup.F
    per_rank = place_processes(setup.A, setup.F).env()
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_DEBUG": "WARN"}
    reports = run_workers(_worker, n, (setup, script, find_free_port()), timeout_s=TIMEOUT_S, env=env,
                          per_rank_env=per_rank)
    for r in reports:
        assert not r["failures"], f"{r['role']} rank {r['rank']}: " + "\n".join(r["failures"][:10])
    return reports


def _replays() -> int:
    """Replays per capture size for this machine's arrangement (fewer when NCCL goes over sockets)."""
    from afd_ext.tools.testing import place_processes

    return SHARED_REPLAYS if place_processes(1, 1).nccl_hostids else REPLAYS


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(Setup(1, 1), id="1A1F"),
        pytest.param(Setup(2, 1, stages=2), id="2A1F-2stages"),
        pytest.param(Setup(4, 2), id="4A2F"),
    ],
)
def test_replays_bit_exact_for_every_capture_size(setup):
    setup = dataclasses.replace(setup, replays=_replays())
    reports = _run(setup, "sizes")
    per_size = setup.replays
    for r in reports:
        assert r["captures"] == len(CAPTURE_SIZES)
        assert r["replays"] == per_size * len(CAPTURE_SIZES)
        if r["role"] == "attention":
            assert r["eager_compared"] == len(CAPTURE_SIZES) * (per_size // EAGER_EVERY)
        else:
            assert sorted(r["entry_replays"].values()) == [per_size] * len(CAPTURE_SIZES)
            assert len(r["cached"]) == len(CAPTURE_SIZES) and all(n > 0 for _, n in r["cached"])


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_ffn_never_replays_4_4_graph_for_7_1_step():
    reports = _run(Setup(2, 1), "mismatch")
    for r in reports:
        assert r["refused"] == 1 and r["replays"] == 3
    ffn = [r for r in reports if r["role"] == "ffn"][0]
    # One graph ([4, 4]) replayed exactly for the three replay steps: never for the [7, 1] steps.
    assert list(ffn["entry_replays"].values()) == [3]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_eager_1000_760_between_replays_keeps_graph_buffers():
    reports = _run(Setup(2, 1), "big_eager")
    for r in reports:
        assert r["replays"] == 7 and r["address_checks"] >= 13


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_zero_token_peers_in_captured_two_stage_step():
    reports = _run(Setup(2, 1, stages=2), "zero_peer")
    for r in reports:
        assert r["replays"] == 3
        if r["role"] == "attention":
            assert r["eager_compared"] == 2


# ---------------------------------------------------------------------------
# The demo with --graph (decode steps replay captured graphs on both roles)
# ---------------------------------------------------------------------------


def _demo_graph(tmp_path, *args: str) -> dict:
    import json
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "afd_ext", "demo", "--backend", "nccl", "--no-progress", "--graph",
           "--json", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=os.getcwd())
    print(" ".join(cmd[1:]))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["graph"] is True and s["device"] == "cuda"
    assert s["self_check"]["ok"], s["self_check"]["failures"]
    modes = s["ffn_graph_modes"][0]
    assert modes["replay"] >= 1 and modes["capture"] >= 1 and modes["capture"] == modes["warmup"]
    assert modes["replay"] + modes["eager"] == s["steps"]
    return s


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_demo_graph_1a1f_deepseek_v2_lite_dims(tmp_path):
    pytest.importorskip("transformers")
    s = _demo_graph(tmp_path, "--topology", "1A1F", "--dims", "deepseek-v2-lite")
    assert s["model"]["hidden_size"] == 2048


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_demo_graph_2a1f(tmp_path):
    pytest.importorskip("transformers")
    s = _demo_graph(tmp_path, "--topology", "2A1F")
    assert s["steps_with_zero_token_rank"] > 0


@pytest.mark.timeout(120)
def test_a_capture_joins_only_the_stage_streams_it_used():
    """A stage stream whose last work was eager (an earlier step beyond the peer plane's capacity ran
    over NCCL's stage streams) must not be joined inside a capture: CUDA refuses that dependency
    (cudaErrorStreamCaptureIsolation), which broke `demo --graph --backend peer` at 2A1F (GPU run 15)."""
    from afd_ext.transport.streams import StageStreams

    dev = torch.device("cuda", 0)
    st = StageStreams(dev)
    st.prepare((0, 1))
    x = torch.zeros(16, device=dev)
    with st.on(1):  # eager work on stage 1, joined
        x.add_(1)
    st.join()
    with st.on(1):  # eager work on stage 1 left unjoined would be the caller's bug; joined too
        x.add_(1)
    st.join((1,))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            with st.on(0):
                x.mul_(3)
            st.join()  # all stages: only stage 0 has work since its last join
    torch.cuda.current_stream(dev).wait_stream(s)
    g.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(x, torch.full_like(x, 6.0))
