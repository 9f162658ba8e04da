"""``afd-ext bench --peer-structure``: the peer-memory plane against the simplest kernels doing its work.

Both roles run in one process (two streams on one GPU; attention on cuda:0 and
FFN on cuda:1 when two GPUs are visible), each side's 100 round trips captured
in one CUDA graph, the two graphs replayed together; a round trip moves, per
token, hidden ``H`` bf16 + router logits ``E`` fp32 + an int32 id to the FFN
and ``H`` bf16 back (the FFN replies with its fan-in hidden states). Structures:
* ``floor``: one persistent kernel per side, one block, flags between round trips (1 token only);
* ``min``: put kernel (multi-block copy, last block releases a flag) + wait-and-copy-out kernel on the
  attention side; wait kernel + put kernel on the FFN side;
* ``fused``: ``min`` with the attention side's put and wait in one kernel;
* ``plane``: :class:`afd_ext.transport.peer.PeerPlane` put/wait, as
  ``tests/gpu/test_peer_gpu.py::test_round_trip_time_in_graphs_on_one_gpu`` uses it;
* ``plane_nopdl``: ``plane`` captured with ``AFD_PEER_PDL=0`` (without programmatic dependent
  launch, which ``plane`` uses on Hopper for grids of at most half the SMs: each plane kernel's
  launch overlaps the end of the one before it on the stream).

``AFD_PEER_STRUCTURE_ONE_GPU=1`` keeps both roles on cuda:0 where two GPUs are
visible. The floor copies its one token's data too (so it is validated like the rest).

The minimal kernels are bench-only: their CUDA source (``peer_structure.cu``
beside this module) is compiled at run time with ``nvcc`` into a small shared
library called through ctypes (no torch headers: seconds to build, and nothing
added to the product's csrc). The profiles that explained the plane's gap to
them (``ncu`` and the PyTorch profiler, issue #35) are recorded in
``docs/gpu-test-results.md`` (runs 54 and 55).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from afd_ext import envs, ops
from afd_ext.errors import AFDConfigError, AFDDeviceError
from afd_ext.schedule import ScheduleConfig
from afd_ext.tools.bench.plan import parse_int_list, parse_names
from afd_ext.tools.bench.report import md_table
from afd_ext.tools.testing import patched_env
from afd_ext.topology import ATTENTION, FFN, Topology
from afd_ext.transport.peer.plane import PeerPlane, WireSpec


STRUCTURES = ("floor", "min", "fused", "plane", "plane_nopdl")
PLANES = ("plane", "plane_nopdl")  # structures that run afd_ext's PeerPlane
DEFAULT_TOKENS = (1, 8, 128, 1024, 8192)
BYTES_PER_BLOCK = 64 << 10  # the plane's launch rule (blocks_for): ~64 KiB per block
PUT_BLOCKS_PER_SM = 2  # ... and puts at most 2 blocks per SM (copying waits at most 1)

#: The minimal kernels' CUDA source, shipped as package data beside this module.
CUDA_FILE = Path(__file__).with_name("peer_structure.cu")


@dataclass(frozen=True)
class Plan:
    """What one ``--peer-structure`` run measures.

    Attributes:
        structures: subset of :data:`STRUCTURES`, in order.
        tokens: tokens per round trip (``floor`` runs at 1 token only).
        hidden: hidden size (bf16 elements); logits: router-logits width (fp32); rounds: round trips per graph;
        replays: timed replays (best taken; one warm-up replay before them).
    """

    structures: tuple[str, ...]
    tokens: tuple[int, ...]
    hidden: int = 7168
    logits: int = 256
    rounds: int = 100
    replays: int = 8

    @staticmethod
    def blocks(nbytes: int, cap: int) -> int:
        """Grid of a minimal kernel moving ``nbytes`` (the plane's rule): one block per 64 KiB, at most ``cap``."""
        return max(1, min(cap, -(-nbytes // BYTES_PER_BLOCK)))

    def fan_in_bytes(self, t: int) -> int:
        """Bytes one round trip moves to the FFN."""
        return t * (2 * self.hidden + 4 * self.logits + 4)

    def reply_bytes(self, t: int) -> int:
        return t * 2 * self.hidden

    def cases(self) -> list[tuple[str, int]]:
        """(structure, tokens) pairs, sizes outermost (so a size's structures run back to back)."""
        return [(s, t) for t in self.tokens for s in self.structures if s != "floor" or t == 1]


def build_parser(prog: str = "afd-ext bench --peer-structure") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--structures", default=",".join(STRUCTURES), help="comma list of " + ", ".join(STRUCTURES))
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens per round trip")
    p.add_argument("--out", default=None, help="folder for peer_structure.json")
    return p


def parse_plan(args: argparse.Namespace) -> Plan:
    """The plan of parsed arguments.

    Raises:
        AFDConfigError: an unknown structure, a bad token list, or nothing to run.
    """
    plan = Plan(parse_names(args.structures, STRUCTURES, "--structures"), parse_int_list(args.tokens, "--tokens"))
    if not plan.cases():
        raise AFDConfigError("nothing to run: 'floor' runs at 1 token only; add 1 to --tokens")
    return plan


# ------------------------------------------------------------------ the bench-only library


def build_library(arch: str = "sm_90") -> str:
    """Compile :data:`CUDA_FILE` (cached by source hash) and return the shared library's path.

    Raises:
        AFDConfigError: nvcc failed or is missing (its output in the message).
    """
    src = CUDA_FILE.read_text(encoding="utf-8")
    key = hashlib.sha256((src + arch).encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir(), "afd_ext_peer_structure")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"ps_{key}.so")
    if os.path.exists(so):
        return so
    nvcc = os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc")
    cmd = [nvcc if os.path.isfile(nvcc) else "nvcc", f"-arch={arch}", "-O3", "-std=c++17", "-shared",
           "-Xcompiler", "-fPIC", "-Xptxas", "-v", "-o", so + ".tmp", str(CUDA_FILE)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise AFDDeviceError(f"cannot compile the bench kernels ({' '.join(cmd)}): {e}") from e
    if r.returncode != 0:
        raise AFDDeviceError(f"nvcc failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    os.replace(so + ".tmp", so)
    with open(so + ".ptxas.txt", "w") as f:
        f.write(r.stderr)
    return so


class _Lib:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        P, I, L, U = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong
        PP, LP = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong)
        sig = {
            "ps_put": [P, I, I, PP, PP, LP, P, P, P],
            "ps_wait": [P, I, P, P, U, P, P, L],
            "ps_fused": [P, I, I, PP, PP, LP, P, P, P, P, P, P, L],
            "ps_floor_attn": [P, I, I, PP, PP, LP, P, P, P, P, P, L],
            "ps_floor_ffn": [P, I, P, P, P, P, P, L],
            "ps_enable_peer": [I, I],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, I
        self._keep: list = []  # ctypes arrays passed to launches (capture reads them at launch only)

    def call(self, name: str, *args) -> None:
        err = getattr(self.lib, name)(*args)
        if err:
            raise AFDDeviceError(f"{name}: CUDA error {err}")

    def parts(self, srcs, dsts):
        n = len(srcs)
        a = ((ctypes.c_void_p * n)(*[t.data_ptr() for t in srcs]), (ctypes.c_void_p * n)(*[t.data_ptr() for t in dsts]),
             (ctypes.c_longlong * n)(*[t.numel() * t.element_size() for t in srcs]))
        self._keep.append(a)
        return n, a[0], a[1], a[2]


# ------------------------------------------------------------------ one case


class _Case:
    """Buffers and streams of one (structure, tokens) case; ``att_rounds``/``ffn_rounds`` enqueue round trips."""

    def __init__(self, plan: Plan, structure: str, tokens: int, lib: Optional[_Lib], att_dev, ffn_dev):
        self.plan, self.structure, self.T = plan, structure, tokens
        self.att_dev, self.ffn_dev = att_dev, ffn_dev
        self.lib = lib
        self.sa, self.sf = torch.cuda.Stream(att_dev), torch.cuda.Stream(ffn_dev)
        H, E = plan.hidden, plan.logits
        self.inp = [torch.empty(tokens, H, dtype=torch.bfloat16, device=att_dev),
                    torch.empty(tokens, E, dtype=torch.float32, device=att_dev),
                    torch.empty(tokens, dtype=torch.int32, device=att_dev)]
        self.out = torch.empty(tokens, H, dtype=torch.bfloat16, device=att_dev)
        self.sms = torch.cuda.get_device_properties(att_dev).multi_processor_count
        self.plane = None
        if structure in PLANES:
            self._make_plane()
        else:
            self.fan_in = [torch.empty_like(t, device=ffn_dev) for t in self.inp]
            self.reply = torch.empty(tokens, H, dtype=torch.bfloat16, device=att_dev)
            # flags: [0] the FFN's (in FFN memory), [8] the attention's (in attention memory); seq words per side
            self.flag_f = torch.zeros(8, dtype=torch.int64, device=ffn_dev)
            self.flag_a = torch.zeros(8, dtype=torch.int64, device=att_dev)
            self.ctr_a = torch.zeros(8, dtype=torch.int64, device=att_dev)  # [0] seq, [1] done (u32)
            self.ctr_f = torch.zeros(8, dtype=torch.int64, device=ffn_dev)
        self.fill(seed=1)

    def _make_plane(self) -> None:
        p = self.plan
        spec = WireSpec.of(ScheduleConfig(1, p.hidden, torch.bfloat16, p.logits, send_token_ids=True))
        topo = Topology(1, 1)
        kw = dict(max_tokens=self.T, num_stages=1, generation=5, timeout_s=30.0)
        self.att = PeerPlane(topo, ATTENTION, 0, spec, device=self.att_dev, **kw)
        self.ffn = PeerPlane(topo, FFN, 0, spec, device=self.ffn_dev, **kw)
        self.att.attach(0, self.ffn.ipc_handle, self.ffn.layout.nbytes)
        self.ffn.attach(0, self.att.ipc_handle, self.att.layout.nbytes)
        self.plane = (self.att, self.ffn)

    def fill(self, seed: int) -> None:
        """Fresh random inputs (in place: captured graphs read them)."""
        g = torch.Generator(device=self.att_dev).manual_seed(seed)
        h, lg, ids = self.inp
        h.copy_(torch.randn(h.shape, generator=g, device=self.att_dev))
        lg.copy_(torch.randn(lg.shape, generator=g, device=self.att_dev))
        ids.copy_(torch.randint(0, 1 << 30, ids.shape, generator=g, device=self.att_dev, dtype=torch.int32))

    def destinations(self):
        """Every tensor a round trip writes (poisoned before the validation replay)."""
        if self.plane is not None:
            return [*self.ffn.views(0, self.T), self.att.views(0, self.T)[0], self.out]
        return [*self.fan_in, self.reply, self.out]

    def check(self) -> Optional[str]:
        """None when every destination holds this round's data, else what differs."""
        fan = self.ffn.views(0, self.T) if self.plane is not None else self.fan_in
        names = ("fan-in hidden", "fan-in logits", "fan-in ids")
        for name, got, want in zip(names, fan, self.inp):
            if not torch.equal(got.to(want.device), want):
                return f"{name} differs from the attention side's input"
        if not torch.equal(self.out, self.inp[0]):
            return "the attention side's output differs from its input hidden states (echoed by the FFN)"
        if self.plane is not None:
            for p in self.plane:
                err = p.failure()
                if err is not None:
                    return f"plane failure: {err}"
        return None

    # -- enqueue ------------------------------------------------------------------

    def att_rounds(self, n: int) -> None:
        """n round trips of the attention side on the current stream."""
        s, T, lib = self.structure, self.T, self.lib
        if s in PLANES:
            for layer in range(n):
                self.att.put(0, self.inp, [T], [0])
                self.att.wait(0, T, layer=layer, out=self.out)
            return

        st = torch.cuda.current_stream(self.att_dev).cuda_stream
        nparts, src, dst, nb = lib.parts(self.inp, self.fan_in)
        seq, done = self.ctr_a.data_ptr(), self.ctr_a.data_ptr() + 8
        cbytes = self.plan.reply_bytes(T)
        if s == "floor":
            lib.call("ps_floor_attn", st, n, nparts, src, dst, nb, seq, self.flag_f.data_ptr(),
                     self.flag_a.data_ptr(), self.reply.data_ptr(), self.out.data_ptr(), cbytes)
            return
        put_grid = self.plan.blocks(self.plan.fan_in_bytes(T), PUT_BLOCKS_PER_SM * self.sms)
        for _ in range(n):
            if s == "min":
                lib.call("ps_put", st, put_grid, nparts, src, dst, nb, done, seq, self.flag_f.data_ptr())
                lib.call("ps_wait", st, self.plan.blocks(cbytes, self.sms), self.flag_a.data_ptr(), seq, 0,
                         self.reply.data_ptr(), self.out.data_ptr(), cbytes)
            else:  # fused: one kernel, at most one block per SM (all resident while spinning)
                lib.call("ps_fused", st, min(put_grid, self.sms), nparts, src, dst, nb, done, seq,
                         self.flag_f.data_ptr(), self.flag_a.data_ptr(), self.reply.data_ptr(),
                         self.out.data_ptr(), cbytes)

    def ffn_rounds(self, n: int) -> None:
        """n round trips of the FFN side on the current stream (it echoes its fan-in hidden states)."""
        s, T, lib = self.structure, self.T, self.lib
        if s in PLANES:
            for layer in range(n):
                x, _lg, _ids = self.ffn.wait(0, T, layer=layer)
                self.ffn.put(0, [x], [T], [0])
            return

        st = torch.cuda.current_stream(self.ffn_dev).cuda_stream
        seq, done = self.ctr_f.data_ptr(), self.ctr_f.data_ptr() + 8
        cbytes = self.plan.reply_bytes(T)
        if s == "floor":
            lib.call("ps_floor_ffn", st, n, seq, self.flag_a.data_ptr(), self.flag_f.data_ptr(),
                     self.fan_in[0].data_ptr(), self.reply.data_ptr(), cbytes)
            return
        nparts, src, dst, nb = lib.parts([self.fan_in[0]], [self.reply])
        for _ in range(n):
            lib.call("ps_wait", st, 1, self.flag_f.data_ptr(), seq, 1, None, None, 0)
            lib.call("ps_put", st, self.plan.blocks(cbytes, PUT_BLOCKS_PER_SM * self.sms), nparts,
                     src, dst, nb, done, seq, self.flag_a.data_ptr())

    def close(self) -> None:
        _sync({self.att_dev, self.ffn_dev})
        if self.plane is not None:
            for p in self.plane:
                p.close()


def _sync(devs) -> None:
    for d in devs:
        torch.cuda.synchronize(d)


def _run_case(plan: Plan, case: _Case) -> dict:
    """Capture, time (best of plan.replays after one warm-up), then validate once on fresh data."""
    devs = sorted({case.att_dev.index, case.ffn_dev.index})
    ga, gf = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    # AFD_PEER_PDL is read by the plane's launcher at capture time; restored afterwards.
    with patched_env({"AFD_PEER_PDL": "0"} if case.structure == "plane_nopdl" else {}):
        with torch.cuda.device(case.ffn_dev), torch.cuda.graph(gf, stream=case.sf):
            case.ffn_rounds(plan.rounds)
        with torch.cuda.device(case.att_dev), torch.cuda.graph(ga, stream=case.sa):
            case.att_rounds(plan.rounds)
    _sync(devs)

    def replay() -> float:
        _sync(devs)
        t0 = time.perf_counter()
        with torch.cuda.device(case.ffn_dev), torch.cuda.stream(case.sf):
            gf.replay()
        with torch.cuda.device(case.att_dev), torch.cuda.stream(case.sa):
            ga.replay()
        _sync(devs)
        return (time.perf_counter() - t0) / plan.rounds * 1e6

    replay()  # warm-up
    times = [replay() for _ in range(plan.replays)]
    # Validation: fresh inputs, poisoned destinations, one replay, exact comparison.
    case.fill(seed=1000 + case.T)
    for t in case.destinations():
        t.view(torch.uint8).fill_(0xA5)
    _sync(devs)
    replay()
    why = case.check()
    rec = {"structure": case.structure, "tokens": case.T, "best_us": min(times), "replays_us": times,
           "valid": why is None, "why": why,
           "fan_in_bytes": plan.fan_in_bytes(case.T), "reply_bytes": plan.reply_bytes(case.T)}
    rec["gbps"] = (rec["fan_in_bytes"] + rec["reply_bytes"]) / (rec["best_us"] * 1e3)
    del ga, gf
    return rec


# ------------------------------------------------------------------ entry


def _table(recs: list[dict], plan: Plan) -> str:
    """µs per round trip per structure and size, then each plane structure's ratio to ``min``."""
    by = {(r["structure"], r["tokens"]): r for r in recs}

    def cell(s: str, t: int) -> str:
        r = by.get((s, t))
        return "" if r is None else f"{r['best_us']:.2f}" + ("" if r["valid"] else " INVALID")

    def ratio(s: str, t: int) -> str:
        a, b = by.get((s, t)), by.get(("min", t))
        return f"{a['best_us'] / b['best_us']:.2f}x" if a and b else ""

    rows = [[s, *(cell(s, t) for t in plan.tokens)] for s in plan.structures]
    if "min" in plan.structures:
        rows += [[f"{s}/min", *(ratio(s, t) for t in plan.tokens)] for s in PLANES if s in plan.structures]
    return "\n".join([f"µs per round trip (best of {plan.replays} replays of {plan.rounds}-round-trip graphs)", "",
                      *md_table(["structure", *map(str, plan.tokens)], rows)])


def run(plan: Plan, out: Optional[str]) -> int:
    """Run the plan on this machine's GPUs; returns 0 when every case validated, 1 otherwise.

    Raises:
        AFDConfigError: no CUDA GPU, or (``plane``) no CUDA build of afd_ext.
    """
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise AFDConfigError("needs a CUDA GPU (none is visible)")
    if set(PLANES) & set(plan.structures) and not ops.is_cuda_built():
        raise AFDConfigError("the 'plane' structures need a CUDA build of afd_ext (this build has no CUDA ops)")
    two = torch.cuda.device_count() >= 2 and not envs.get("AFD_PEER_STRUCTURE_ONE_GPU")
    att_dev, ffn_dev = torch.device("cuda", 0), torch.device("cuda", 1 if two else 0)
    lib = None
    if any(s not in PLANES for s in plan.structures):
        lib = _Lib(build_library())
        if two:
            for a, b in ((0, 1), (1, 0)):
                lib.call("ps_enable_peer", a, b)
    meta = {"device": torch.cuda.get_device_name(0), "gpus": 2 if two else 1, "torch": torch.__version__,
            "plan": plan.__dict__}
    print(f"peer structure: {meta['device']}, {'attention cuda:0, FFN cuda:1' if two else 'both roles on cuda:0'}",
          flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
    recs = []
    for s, t in plan.cases():
        case = _Case(plan, s, t, lib, att_dev, ffn_dev)
        try:
            rec = _run_case(plan, case)
        finally:
            case.close()
            del case
            torch.cuda.empty_cache()
        recs.append(rec)
        print(f"{s:>6} {t:>5} tokens: {rec['best_us']:9.2f} us  {rec['gbps']:7.1f} GB/s"
              + ("  valid" if rec["valid"] else f"  INVALID: {rec['why']}"), flush=True)
    doc = {"meta": meta, "results": recs, "table": _table(recs, plan)}
    print("\n" + doc["table"])
    if out:
        with open(os.path.join(out, "peer_structure.json"), "w") as f:
            json.dump(doc, f, indent=1)
    bad = [r for r in recs if not r["valid"]]
    if bad:
        print(f"INVALID: {len(bad)} case(s): " + "; ".join(f"{r['structure']}@{r['tokens']}: {r['why']}"
                                                          for r in bad), file=sys.stderr)
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``afd-ext bench --peer-structure [options]``: 0 ok, 1 a case failed validation, 2 bad usage / no GPU."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(parse_plan(args), args.out)
    except AFDConfigError as e:
        print(f"afd-ext bench --peer-structure: {e}", file=sys.stderr)
        return 2
