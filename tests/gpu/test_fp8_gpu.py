"""FP8 hidden states on the wire (GPU tier): the CUDA kernels against the reference rule, bit for bit.

* ``fp8_quantize`` (the NCCL path's send-buffer kernel) and ``fp8_dequantize`` (its fan-in kernel)
  against the numpy reference (``tests/fp8_reference.py``) on random data with all-zero, subnormal,
  huge and tie groups, on ``tests/test_fp8.py``'s hand-computed groups and adversarial inputs (every
  bf16 bit pattern, banded random bits), and with inf and NaN (values NaN with their sign, scales
  from the finite channels: docs/fp8.md);
* the peer plane's put with the quantization fused in, and its wait dequantizing (or not), also with inf and NaN;
* a graph-captured round trip over the plane (both roles on one GPU);
* connector round trips per transport (NCCL, peer memory) and per delivery form (2A1F);
* each with fp32 and UE8M0 scales (``fp8_scale_format``), and ``afd-ext bench --check`` of the FP8 variants.

Run: ``python3 -m pytest -q tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from afd_ext import fp8, ops  # noqa: E402
from afd_ext.tools.testing import find_free_port, place_processes, run_workers  # noqa: E402
from afd_ext.topology import ATTENTION, FFN, Topology  # noqa: E402
from afd_ext.schedule import ScheduleConfig  # noqa: E402
from afd_ext.transport.peer.plane import PeerPlane, WireSpec  # noqa: E402
from fp8_reference import reference_dequantize, reference_quantize  # noqa: E402
from test_fp8 import (E4M3, GROUP_CASES, INF, UE8M0_GROUP_CASES, adversarial_inputs, bits, error_bound,  # noqa: E402
                      fp8_worker, hard_inputs, nonfinite_inputs, same_bf16)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

DEV = torch.device("cuda", 0)


def inputs(t: int, h: int, seed: int, nonfinite: bool = False) -> torch.Tensor:
    """``hard_inputs`` rows first (its edge-case groups lead; with ``nonfinite``, ``nonfinite_inputs``'),
    random rows of mixed scale after."""
    x = (nonfinite_inputs if nonfinite else hard_inputs)(max(t, 5), h, seed)
    if t > 5:
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.cat([x, (torch.randn(t - 5, h, generator=g) * 10.0 ** torch.randint(-6, 6, (t - 5, 1),
                                                                                     generator=g)).bfloat16()])
    return x[:t]


def check_kernels(x: torch.Tensor, ue8m0: bool = False) -> None:
    """Both kernels on bf16 ``x`` against the reference: values and scales bit for bit, the bf16 round trip
    bit for bit (any NaN equal to any NaN), NaN exactly where ``x`` is not finite, the bound elsewhere
    (UE8M0: +-inf where |x| >= 248 2^120, as in tests/test_fp8.py)."""
    t, h = x.shape
    rv, rs = reference_quantize(x, ue8m0)
    v = torch.full((t, h), 0x7f, dtype=torch.uint8, device=DEV).view(E4M3)  # poisoned
    s = torch.full((t, h // fp8.GROUP), float("nan"), device=DEV)
    ops.fp8_quantize(x.to(DEV), v, s, ue8m0)
    assert torch.equal(bits(v).cpu(), bits(rv)) and torch.equal(bits(s).cpu(), bits(rs))
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=DEV)
    ops.fp8_dequantize(v, s, out)
    assert same_bf16(out, reference_dequantize(rv, rs))
    finite = x.isfinite()
    assert torch.equal(out.cpu().isnan(), ~finite)
    top = finite & (x.float().abs() >= 248 * 2.0 ** 120) if ue8m0 else torch.zeros_like(finite)
    assert torch.equal(out.cpu().float()[top], x.float()[top].sign() * INF)
    assert ((out.cpu().float() - x.float()).abs() <= error_bound(x, rs))[finite & ~top].all()


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("t,h", [(0, 256), (1, 128), (4, 256), (7, 7168), (300, 7168), (4097, 512)])
def test_cuda_kernels_are_the_reference_bit_for_bit(t, h, nonfinite, ue8m0):
    check_kernels(inputs(t, h, seed=t + h, nonfinite=nonfinite), ue8m0)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_cuda_kernels_on_hand_computed_and_adversarial_inputs(ue8m0):
    for x, scale_bits, head, rest in (UE8M0_GROUP_CASES if ue8m0 else GROUP_CASES).values():
        if x.dtype == torch.bfloat16:  # the kernels take bf16 (the float32 floor cases are CPU-only)
            check_kernels(x, ue8m0)
            v, s = torch.empty(x.shape, dtype=E4M3, device=DEV), torch.empty(1, 1, device=DEV)
            ops.fp8_quantize(x.to(DEV), v, s, ue8m0)  # and the hand-computed bytes themselves
            assert bits(s).tolist() == [[scale_bits]] and bits(v)[0, :len(head)].tolist() == head
    for x in adversarial_inputs():
        if x.dtype == torch.bfloat16:
            check_kernels(x, ue8m0)


def _pair(spec: WireSpec, max_tokens: int) -> tuple[PeerPlane, PeerPlane]:
    topo = Topology(1, 1)
    kw = dict(max_tokens=max_tokens, num_stages=1, generation=9, timeout_s=20.0, device=DEV)
    att, ffn = PeerPlane(topo, ATTENTION, 0, spec, **kw), PeerPlane(topo, FFN, 0, spec, **kw)
    att.attach(0, ffn.ipc_handle, ffn.layout.nbytes)
    ffn.attach(0, att.ipc_handle, att.layout.nbytes)
    return att, ffn


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_fused_peer_put_and_dequantizing_wait_are_the_reference_bit_for_bit(nonfinite, fmt):
    spec = WireSpec.of(ScheduleConfig(1, 7168, torch.bfloat16, 256, torch.float32, True, hidden_wire="fp8_e4m3",
                                      fp8_scale_format=fmt))
    assert spec.ue8m0 == (fmt == "ue8m0")
    att, ffn = _pair(spec, 200)
    try:
        for layer, n in enumerate([1, 0, 129, 7, 200]):
            x = inputs(n, 7168, seed=layer, nonfinite=nonfinite)
            lg = torch.randn(n, 256, device=DEV)
            ids = torch.arange(n, dtype=torch.int32, device=DEV) + 1000 * layer
            att.put(0, (x.to(DEV), lg, ids), [n], [0])
            dq = torch.full((n, 7168), float("nan"), dtype=torch.bfloat16, device=DEV)
            views = ffn.wait(0, n, layer=layer, out=dq if layer % 2 else None)  # both delivery forms
            v, s, glg, gids = (t.clone() for t in views)
            ffn.put(0, (dq if layer % 2 else x.to(DEV),), [n], [0])
            reply = torch.empty(n, 7168, dtype=torch.bfloat16, device=DEV)
            att.wait(0, n, layer=layer, out=reply)
            torch.cuda.synchronize(DEV)
            rv, rs = reference_quantize(x, fmt == "ue8m0")
            assert torch.equal(bits(v).cpu(), bits(rv)) and torch.equal(bits(s).cpu(), bits(rs)), layer
            assert torch.equal(glg, lg) and torch.equal(gids, ids)
            if layer % 2:
                assert same_bf16(dq, reference_dequantize(rv, rs)) and torch.equal(bits(reply), bits(dq))
            else:
                assert torch.equal(bits(reply).cpu(), bits(x))  # the reply stays bf16
        att.raise_if_failed()
        ffn.raise_if_failed()
    finally:
        torch.cuda.synchronize(DEV)
        att.close()
        ffn.close()


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_graph_captured_round_trip_over_the_plane(fmt):
    """Both roles captured (put quantizing, wait dequantizing, reply, reply wait), replayed with fresh inputs."""
    n, h = 64, 1024
    spec = WireSpec.of(ScheduleConfig(1, h, torch.bfloat16, hidden_wire="fp8_e4m3", fp8_scale_format=fmt))
    att, ffn = _pair(spec, n)
    sa, sf = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
    try:
        inp = torch.zeros(n, h, dtype=torch.bfloat16, device=DEV)
        dq = torch.empty(n, h, dtype=torch.bfloat16, device=DEV)
        reply = torch.empty(n, h, dtype=torch.bfloat16, device=DEV)
        ga, gf = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        torch.cuda.synchronize(DEV)
        with torch.cuda.graph(ga, stream=sa):
            att.put(0, (inp,), [n], [0])
            att.wait(0, n, layer=0, out=reply)
        with torch.cuda.graph(gf, stream=sf):
            ffn.wait(0, n, layer=0, out=dq)
            ffn.put(0, (dq * 2,), [n], [0])
        for rep in range(5):
            x = inputs(n, h, seed=50 + rep)
            inp.copy_(x.to(DEV))
            torch.cuda.synchronize(DEV)
            with torch.cuda.stream(sf):
                gf.replay()  # its wait spins until the attention graph's put lands
            with torch.cuda.stream(sa):
                ga.replay()
            torch.cuda.synchronize(DEV)
            assert torch.equal(reply.cpu(), reference_dequantize(*reference_quantize(x, fmt == "ue8m0")) * 2), rep
        att.raise_if_failed()
        ffn.raise_if_failed()
    finally:
        torch.cuda.synchronize(DEV)
        att.close()
        ffn.close()


@pytest.mark.parametrize("scales", ["fp32", "ue8m0"])
@pytest.mark.parametrize("delivery", ["dequant", "fp8"])
@pytest.mark.parametrize("transport", ["nccl", "peer"])
def test_connector_round_trip(transport, delivery, scales):
    A, F = 2, 1
    res = run_workers(fp8_worker, A + F, (find_free_port(), A, delivery, False, transport, False, scales),
                      timeout_s=200, per_rank_env=place_processes(A, F).env())
    total = 2 * (3 + 130) * A
    assert sorted(r["checked"] for r in res) == [total // A] * A + [total]
    assert {r["transport"] for r in res} == {transport}


@pytest.mark.parametrize("transport", ["nccl", "peer"])
def test_misaligned_hidden_states_are_refused_on_the_calling_rank_only(transport):
    """Issue 41 item 9: each attention rank's layer-0 send of a contiguous bf16 tensor 2 bytes off 8-byte
    alignment is refused by the input checks on that rank (AFDConfigError, nothing moved); the aligned
    call that follows proceeds and every reply is exact, so no step was aborted."""
    A, F = 2, 1
    res = run_workers(fp8_worker, A + F, (find_free_port(), A, "dequant", False, transport, True), timeout_s=200,
                      per_rank_env=place_processes(A, F).env())
    assert sorted(r["checked"] for r in res) == [2 * (3 + 130)] * A + [2 * (3 + 130) * A]
    for r in res:
        if r["role"] == "ffn":
            assert r["refused"] == []
            continue
        assert len(r["refused"]) == 2, r  # layer 0 of step 1 stage 0 and of step 2 stage 1 (its stage 0 has 0 rows)
        assert all("hidden_states must be 8-byte aligned" in m for m in r["refused"]), r["refused"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("scales", ["fp32", "ue8m0"])
@pytest.mark.parametrize("backend,graph", [("nccl", False), ("peer", True)])
def test_demo_with_fp8(tmp_path, backend, graph, scales):
    pytest.importorskip("transformers")
    import json
    import subprocess

    out = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "afd_ext", "demo", "--backend", backend, "--fp8", scales, "--no-progress",
           "--topology", "2A1F", "--json", str(out)] + (["--graph"] if graph else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["backend"] == backend and s["fp8"] == scales and s["self_check"]["ok"], s["self_check"]["failures"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scales", ["fp32", "ue8m0"])
def test_bench_check_of_the_fp8_variants(tmp_path, scales):
    """``afd-ext bench --check`` of ``ours_fp8`` (NCCL kernels) and ``peer_fp8`` (fused put/wait), eager and graph:
    the FFN's values and scales are the CPU rule's of the sent pattern, the reply their bf16 form."""
    import json

    from afd_ext.tools.bench import main

    rc = main(["--check", "--variants", "ours_fp8,peer_fp8", "--fp8-scale-format", scales, "--out",
               str(tmp_path / "c"), "--timeout", "280", "--no-progress"])
    doc = json.loads((tmp_path / "c" / "bench.json").read_text())
    bad = [c for c in doc["checks"] if not c["ok"]]
    assert rc == 0 and not bad, bad
    assert doc["meta"]["fp8_scale_format"] == scales
    assert {(c["variant"], c["mode"]) for c in doc["checks"]} >= {(v, m) for v in ("ours_fp8", "peer_fp8")
                                                                  for m in ("eager", "graph")}
