"""FP8 hidden states on the wire (CPU tier): the rule, the CPU path, gloo round trips, refusals, fakes.

``reference_quantize`` / ``reference_dequantize`` are the definition (issue #35; DeepEP's
low-latency dispatch format), written here group by group, independently of ``afd_ext.fp8``;
the CPU path and the CUDA kernels (tests/gpu/test_fp8_gpu.py) must match them bit for bit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402
from afd_ext.errors import AFDConfigError  # noqa: E402
from afd_ext.testing import find_free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(180)

E4M3 = torch.float8_e4m3fn


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, one 128-channel group at a time on CPU: scale = amax / 448 (1 if 0), q = RNE(sat(x / scale))."""
    x = x.detach().cpu().float()
    t, h = x.shape
    values = torch.empty(t, h, dtype=E4M3)
    scales = torch.empty(t, h // 128, dtype=torch.float32)
    for r in range(t):
        for g in range(h // 128):
            grp = x[r, g * 128:(g + 1) * 128]
            s = torch.div(grp.abs().max(), torch.tensor(448.0))  # float32 division, exactly rounded
            if s.item() == 0.0:
                s = torch.tensor(1.0)
            values[r, g * 128:(g + 1) * 128] = torch.div(grp, s).clamp(-448.0, 448.0).to(E4M3)
            scales[r, g] = s
    return values, scales


def reference_dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values * their group's scale in float32, rounded once to bf16."""
    v = values.cpu().float()
    return (v * scales.cpu().repeat_interleave(128, dim=1)).to(torch.bfloat16)


def error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per element |dequant(quant(x)) - x| bound (docs/fp8.md): e4m3 rounding 2^-4 |x| (normal)
    or 2^-10 scale (subnormal), plus the bf16 rounding of the result 2^-8 |x| (with margin); 2^-132
    absolute where bf16 / the fp32 scale are subnormal (|x| < 1e-38, fixed spacing)."""
    xf, s = x.float().cpu(), scales.cpu().repeat_interleave(128, dim=1)
    return 2.0 ** -4 * xf.abs() + 2.0 ** -10 * s + 2.0 ** -8 * xf.abs() + 2.0 ** -132


def hard_inputs(t: int = 6, h: int = 256, seed: int = 0) -> torch.Tensor:
    """Random bf16 rows ``[t, h]`` (``h % 128 == 0``) of mixed scale whose first 128-channel groups, in
    row-major order (group ``k`` is row ``k // (h/128)``, channels ``128 (k % (h/128))`` on), are the edge
    cases: 0 all zero, 1 bf16 subnormals (a subnormal fp32 scale), 2 huge, 3 exact ties after scaling,
    4 +-448, +-0, +-subnormal x and e4m3-subnormal ties at scale 1. Needs ``t * h / 128 >= 5``."""
    groups = h // 128
    if h % 128 or t * groups < 5:
        raise ValueError(f"hard_inputs needs h % 128 == 0 and t * h / 128 >= 5 groups, got t={t}, h={h}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)
    cases = [
        torch.zeros(128),                                 # scale 1, values 0
        torch.randn(128, generator=g) * 1e-39,            # bf16 subnormals: amax / 448 is a subnormal fp32
        torch.randn(128, generator=g) * 1e37,             # huge
        torch.arange(128) / 8 - 8,                        # scale 8/448: x / scale ~ 7k, 10 exact e4m3 ties
        torch.cat([torch.tensor([448.0, -448.0, 0.0, -0.0, 1e-39, -1e-39, 2.0 ** -10, 3 * 2.0 ** -10]),
                   torch.randn(120, generator=g)]),        # scale 1: -0, flushed x, ties between e4m3 subnormals
    ]
    flat = x.view(t * groups, 128)
    for k, c in enumerate(cases):
        flat[k] = c
    return x.to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int32)


def test_cpu_path_is_the_reference_bit_for_bit():
    from afd_ext import fp8, ops

    x = hard_inputs()
    rv, rs = reference_quantize(x)
    v, s = fp8.quantize(x)
    assert torch.equal(bits(v), bits(rv)) and torch.equal(bits(s), bits(rs))
    assert rs[0, 0].item() == 1.0 and not bits(rv[0, :128]).any()  # the zero guard
    assert 0 < rs[0, 1].item() < torch.finfo(torch.float32).tiny  # a subnormal scale survives
    assert bits(rv[0, 128:]).any()  # and its values are not flushed
    assert rs[2, 0].item() == 1.0 and bits(rv[2, :8]).tolist() == [0x7E, 0xFE, 0, 0x80, 0, 0x80, 0, 2]
    ov, os_ = torch.empty_like(v), torch.empty_like(s)
    ops.fp8_quantize(x, ov, os_)  # the op's CPU kernel
    assert torch.equal(bits(ov), bits(rv)) and torch.equal(bits(os_), bits(rs))
    out = torch.empty_like(x)
    ops.fp8_dequantize(rv, rs, out)
    assert torch.equal(out, reference_dequantize(rv, rs))
    assert ((out.float() - x.float()).abs() <= error_bound(x, rs)).all()
    v0, s0 = fp8.quantize(x[:0])  # a zero-token stage
    assert (tuple(v0.shape), tuple(s0.shape)) == ((0, 256), (0, 2))


def test_kernels_emit_no_flushing_float_op(tmp_path):
    """Under the build's fast math (setup.py: -O3 --use_fast_math) the FP8 kernels must compile to no
    ``.ftz`` instruction: one (a float ``s == 0``) flushed subnormal scales on the GPU (docs/fp8.md)."""
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("afd_setup", root / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # setup() runs only under __main__
    home = setup.find_cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit: cannot compile the kernels to PTX")
    ptx = tmp_path / "peer_kernels.ptx"
    subprocess.run([f"{home}/bin/nvcc", "-O3", "--use_fast_math", "-arch=sm_90", "-ptx",
                    str(root / "csrc/cuda/peer_kernels.cu"), "-o", str(ptx)], check=True, timeout=240)
    text = ptx.read_text()
    assert "fp8_quantize_kernel" in text and "cvt.rn.satfinite.e4m3x2.f32" in text
    assert [ln.strip() for ln in text.splitlines() if ".ftz" in ln] == []


@pytest.mark.parametrize("h", [100, 7168 + 64])
def test_hidden_size_not_a_multiple_of_128_is_refused(h):
    from afd_ext.schedule import ScheduleConfig

    with pytest.raises(AFDConfigError, match="multiple of 128"):
        ScheduleConfig(num_layers=1, hidden_size=h, hidden_dtype=torch.bfloat16, hidden_wire="fp8_e4m3")
    with pytest.raises(AFDConfigError, match="bfloat16"):
        ScheduleConfig(num_layers=1, hidden_size=256, hidden_dtype=torch.float32, hidden_wire="fp8_e4m3")
    sc = cs.Scenario(A=1, F=1, hidden=h, dtype="bfloat16", strict=False, extra=(("hidden_wire_dtype", "fp8_e4m3"),))
    with pytest.raises(AFDConfigError, match="multiple of 128"):
        cs.make_connector(sc, 0, find_free_port())  # at construction, before any rendezvous


def test_config_refusals():
    from afd_ext.config import AfdExtConnectorConfig

    with pytest.raises(AFDConfigError, match="hidden_wire_dtype"):
        AfdExtConnectorConfig(hidden_wire_dtype="fp8_e5m2")
    with pytest.raises(AFDConfigError, match="strict"):
        AfdExtConnectorConfig(hidden_wire_dtype="fp8_e4m3", strict=True)
    with pytest.raises(AFDConfigError, match="fp8_delivery"):
        AfdExtConnectorConfig(fp8_delivery="bf16")


def test_layout_bytes_and_graph_key():
    from afd_ext import fp8
    from afd_ext.graphs import graph_key_from_schedule
    from afd_ext.metadata import AFDControlPayload
    from afd_ext.schedule import ScheduleConfig, build_step_schedule, stage_buffers
    from afd_ext.topology import Topology

    assert fp8.wire_bytes_per_token(7168) == 7392
    base = dict(num_layers=1, hidden_size=7168, hidden_dtype=torch.bfloat16)
    cfg = ScheduleConfig(**base, hidden_wire="fp8_e4m3")
    assert sum(p.dtype.itemsize * p.cols[0] for p in cfg.wire_parts) == 7392
    meta = lambda key, shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    sent = stage_buffers(meta, cfg, 0, 5)
    assert sent["hidden"].dtype == torch.bfloat16 and "hidden_scales" not in sent
    got = stage_buffers(meta, cfg, 0, 5, fan_in=True)
    assert (got["hidden_fp8"].dtype, tuple(got["hidden_scales"].shape)) == (E4M3, (5, 56))
    assert got["hidden"].dtype == torch.bfloat16
    raw = stage_buffers(meta, ScheduleConfig(**base, hidden_wire="fp8_e4m3", fp8_delivery="fp8"), 0, 5, fan_in=True)
    assert raw["hidden"] is None and raw["hidden_fp8"].dtype == E4M3
    payload = AFDControlPayload({0: [3]})
    keys = [graph_key_from_schedule(build_step_schedule(Topology(1, 1), payload, c))
            for c in (ScheduleConfig(**base), cfg)]
    assert keys[0] != keys[1] and keys[1].hidden_wire == "fp8_e4m3"


def test_fakes_give_shapes_under_compile():
    from afd_ext import ops

    def f(x, v, s, out):
        ops.fp8_quantize(x, v, s)
        ops.fp8_dequantize(v, s, out)
        return out * 2

    x = hard_inputs(4, 256)
    v, s, out = torch.empty(4, 256, dtype=E4M3), torch.empty(4, 2), torch.empty(4, 256, dtype=torch.bfloat16)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, v, s, out)
    rv, rs = reference_quantize(x)
    assert torch.equal(bits(v), bits(rv)) and torch.equal(got, reference_dequantize(rv, rs) * 2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        bad = torch.empty(4, 200, dtype=torch.bfloat16)
        with pytest.raises(AFDConfigError, match="multiple of 128"):
            ops.fp8_quantize(bad, torch.empty(4, 200, dtype=E4M3), torch.empty(4, 1))


# -- over gloo, in processes ------------------------------------------------------------------

def fp8_worker(rank: int, nprocs: int, port: int, A: int, delivery: str, mismatch: bool = False,
               transport: str = "gloo", misaligned: bool = False) -> dict:
    """A:1 with FP8 on the wire (also run over NCCL and peer memory by tests/gpu/test_fp8_gpu.py); the FFN
    doubles what it receives; the attention side checks every reply against the reference round trip
    (exactly: every path computes the rule's bytes) and the stated bound. ``misaligned``: each layer-0
    send is first tried with a contiguous bf16 copy 2 bytes off 8-byte alignment; a refusal (CUDA
    transports) is recorded and the aligned tensor sent instead."""
    from afd_ext import ops

    extra = (("hidden_wire_dtype", None if mismatch and rank == 0 else "fp8_e4m3"), ("fp8_delivery", delivery))
    sc = cs.Scenario(A=A, F=1, hidden=256, layers=2, dtype="bfloat16", strict=False, extra=extra,
                     transport=transport)
    cs._setup_device(sc)
    dev = cs.device_for(sc)
    conn = cs.make_connector(sc, rank, port)
    try:
        if mismatch:
            from afd_ext.rendezvous import HandshakeMismatchError

            try:
                conn.init_afd_connector()
            except HandshakeMismatchError as e:
                return {"field": e.field, "message": str(e)}
            raise AssertionError("a hidden_wire_dtype mismatch passed the handshake")
        conn.init_afd_connector()
        steps = ({0: [3] * A}, {0: [0] * A, 1: [130] * A})
        checked, refused = 0, []
        for step in steps:
            if conn.role == "ffn":
                payload = conn.control_plane.recv_dp_metadata_list()
                conn.control_plane.update_state_from_dp_metadata(payload)
                for layer in range(sc.layers):
                    for s in sorted(step):
                        p = conn.recv_attn_output(ubatch_idx=s)
                        h = p.hidden_states
                        if delivery == "fp8":
                            assert h.dtype == E4M3 and p.hidden_scales.shape == (h.shape[0], 2)
                            h, v = torch.empty(h.shape, dtype=torch.bfloat16, device=dev), h
                            ops.fp8_dequantize(v, p.hidden_scales, h)
                        else:
                            assert h.dtype == torch.bfloat16 and p.hidden_scales is None
                        conn.send_ffn_output(h * 2, p.context)
                        checked += h.shape[0]
                if dev.type == "cuda":
                    conn.synchronize()
                continue
            payload = cs._payload(step)
            conn.control_plane.update_state_from_dp_metadata(payload)
            conn.control_plane.send_dp_metadata_list(payload)
            for layer in range(sc.layers):
                for s in sorted(step):
                    n = step[s][conn.role_rank]
                    x = hard_inputs(max(n, 4), 256, seed=100 * layer + 10 * s + conn.role_rank)[:n]
                    sent = False
                    if misaligned and layer == 0 and n:
                        odd = torch.empty(n * 256 + 1, dtype=x.dtype, device=dev)[1:].view(n, 256).copy_(x)
                        try:
                            conn.send_attn_output(odd, cs._ctx(layer, s, n))
                            sent = True
                        except AFDConfigError as e:
                            refused.append(str(e))
                    if not sent:
                        conn.send_attn_output(x.to(dev), cs._ctx(layer, s, n))
                    out = conn.recv_ffn_output(torch.empty(x.shape, dtype=x.dtype, device=dev), ubatch_idx=s)
                    if dev.type == "cuda":
                        conn.synchronize()
                    out = out.cpu()
                    if n:
                        rv, rs = reference_quantize(x)
                        assert torch.equal(out, reference_dequantize(rv, rs) * 2)
                        assert ((out.float() / 2 - x.float()).abs() <= error_bound(x, rs)).all()
                    checked += n
        return {"role": conn.role, "checked": checked, "transport": conn.transport_kind, "refused": refused}
    finally:
        conn.close()


@pytest.mark.parametrize("delivery", ["dequant", "fp8"])
def test_gloo_round_trip(delivery):
    res = run_workers(fp8_worker, 3, (find_free_port(), 2, delivery), timeout_s=150)
    total = 2 * (3 + 130) * 2  # layers x rows x attention ranks
    assert sorted(r["checked"] for r in res) == [total // 2, total // 2, total]


def test_misaligned_hidden_states_pass_on_gloo_and_are_refused_where_the_kernels_need_alignment():
    """Issue 41 item 9: the CUDA FP8 kernels read bf16 hidden states 8 bytes at a time, so the input checks
    refuse a misaligned row start on the transports that run them (on the calling rank, before anything
    moves: tests/gpu/test_fp8_gpu.py); gloo quantizes in torch and takes it."""
    from afd_ext.metadata import AFDControlPayload
    from afd_ext.schedule import ScheduleConfig, build_step_schedule
    from afd_ext.topology import Topology
    from afd_ext.transport.gloo import GlooTransport
    from afd_ext.transport.nccl import NcclTransport
    from afd_ext.transport.peer.transport import PeerTransport

    assert (NcclTransport.fp8_hidden_align, PeerTransport.fp8_hidden_align, GlooTransport.fp8_hidden_align) == (8, 8, 1)
    cfg = ScheduleConfig(num_layers=1, hidden_size=256, hidden_dtype=torch.bfloat16, hidden_wire="fp8_e4m3")
    sch = build_step_schedule(Topology(1, 1), AFDControlPayload({0: [3]}), cfg)
    odd = torch.empty(3 * 256 + 1, dtype=torch.bfloat16)[1:].view(3, 256)
    assert odd.is_contiguous() and odd.data_ptr() % 8 == 2
    with pytest.raises(AFDConfigError, match=r"hidden_states must be 8-byte aligned for attention rank 0, stage 0 "
                                             r"with FP8 on the wire .*clone\(\)"):
        sch.check_attention_tensors(0, 0, odd, hidden_align=8)
    sch.check_attention_tensors(0, 0, odd.clone(), hidden_align=8)
    sch.check_attention_tensors(0, 0, odd)  # gloo
    plain = build_step_schedule(Topology(1, 1), AFDControlPayload({0: [3]}),
                                ScheduleConfig(num_layers=1, hidden_size=256, hidden_dtype=torch.bfloat16))
    plain.check_attention_tensors(0, 0, odd, hidden_align=8)  # no FP8 on the wire: any alignment
    res = run_workers(fp8_worker, 2, (find_free_port(), 1, "dequant", False, "gloo", True), timeout_s=150)
    assert [r["refused"] for r in res] == [[], []] and sorted(r["checked"] for r in res) == [2 * 133] * 2


def test_handshake_refuses_a_mismatch():
    res = run_workers(fp8_worker, 2, (find_free_port(), 1, "dequant", True), timeout_s=120)
    for r in res:
        assert r["field"] == "hidden_wire_dtype"
        assert "'fp8_e4m3'" in r["message"] and "None" in r["message"]
        assert "FFN rank 0" in r["message"] and "attention rank 0" in r["message"]


@pytest.mark.timeout(300)
def test_demo_runs_with_fp8_on_gloo(tmp_path):
    """The demo with FP8 hidden states passes its self-check against the whole model rounding the same way."""
    import json
    import subprocess

    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "afd_ext", "demo", "--backend", "gloo", "--fp8", "--no-progress",
                           "--topology", "2A1F", "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["self_check"]["ok"] and s["self_check"]["tolerance"] == pytest.approx(0.25 * 2)
    # The summary counts FP8 wire bytes (H + 4 H / 128 per token) attention -> FFN, bf16 (2 H) back.
    h = s["model"]["hidden_size"]
    assert s["bytes"]["attention_to_ffn"] * 2 * h == s["bytes"]["ffn_to_attention"] * (h + 4 * h // 128)
