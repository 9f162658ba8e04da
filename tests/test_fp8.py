"""FP8 hidden states on the wire (CPU tier): the rule, the CPU path, gloo round trips, refusals, fakes.

The reference is ``tests/fp8_reference.py`` (numpy and integer arithmetic, independent of
``afd_ext.fp8``), pinned here by hand-computed bytes; the CPU path and the CUDA kernels
(tests/gpu/test_fp8_gpu.py) must match it bit for bit, values and scales.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402
from afd_ext.errors import AFDConfigError  # noqa: E402
from afd_ext.fp8 import GROUP  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402
from fp8_reference import (decode_e4m3, encode_e4m3, reference_dequantize, reference_quantize,  # noqa: E402
                           ue8m0_scale)

pytestmark = pytest.mark.timeout(180)

E4M3 = torch.float8_e4m3fn
INF, NAN = float("inf"), float("nan")


def error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per element |dequant(quant(x)) - x| bound (docs/fp8.md): e4m3 rounding 2^-4 |x| (normal)
    or 2^-10 scale (subnormal), plus the bf16 rounding of the result 2^-8 |x| (with margin); 2^-132
    absolute where bf16 / the fp32 scale are subnormal (|x| < 1e-38, fixed spacing)."""
    xf, s = x.float().cpu(), scales.cpu().repeat_interleave(GROUP, dim=1)
    return 2.0 ** -4 * xf.abs() + 2.0 ** -10 * s + 2.0 ** -8 * xf.abs() + 2.0 ** -132


def hard_inputs(t: int = 6, h: int = 256, seed: int = 0) -> torch.Tensor:
    """Random bf16 rows ``[t, h]`` (``h % GROUP == 0``) of mixed scale whose first groups, in row-major
    order (group ``k`` is row ``k // (h/GROUP)``, channels ``GROUP (k % (h/GROUP))`` on), are the edge
    cases: 0 all zero, 1 bf16 subnormals (a subnormal fp32 scale), 2 huge, 3 exact ties after scaling,
    4 +-448, +-0, +-subnormal x and e4m3-subnormal ties at scale 1. Needs ``t * h / GROUP >= 5``. All finite."""
    groups = h // GROUP
    if h % GROUP or t * groups < 5:
        raise ValueError(f"hard_inputs needs h % {GROUP} == 0 and t * h / {GROUP} >= 5 groups, got t={t}, h={h}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)
    cases = [
        torch.zeros(GROUP),                               # scale 1, values 0
        torch.randn(GROUP, generator=g) * 1e-39,          # bf16 subnormals: amax / 448 is a subnormal fp32
        torch.randn(GROUP, generator=g) * 1e37,           # huge
        torch.arange(GROUP) / 8 - 8,                      # scale 8/448: x / scale ~ 7k, 10 exact e4m3 ties
        torch.cat([torch.tensor([448.0, -448.0, 0.0, -0.0, 1e-39, -1e-39, 2.0 ** -10, 3 * 2.0 ** -10]),
                   torch.randn(GROUP - 8, generator=g)]),  # scale 1: -0, flushed x, ties between e4m3 subnormals
    ]
    flat = x.view(t * groups, GROUP)
    for k, c in enumerate(cases):
        flat[k] = c
    return x.to(torch.bfloat16)


def nonfinite_inputs(t: int = 4, h: int = 256, seed: int = 0) -> torch.Tensor:
    """``hard_inputs`` with +-inf and +-NaN (bf16 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, and NaN payloads 0x7F81,
    0xFFFF) at random places in a third of the groups, one group all non-finite, one inf beside tiny values."""
    x = hard_inputs(max(t, 5), h, seed)[:t].view(torch.int16).clone()
    g = torch.Generator().manual_seed(seed + 7)
    special = torch.tensor([0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF], dtype=torch.int32).to(torch.int16)
    flat = x.view(-1, GROUP)
    for k in range(0, flat.shape[0], 3):
        pos = torch.randint(0, GROUP, (1 + k % 4,), generator=g)
        flat[k, pos] = special[torch.randint(0, len(special), pos.shape, generator=g)]
    flat[-1] = special[torch.arange(GROUP) % len(special)]
    if flat.shape[0] > 2:
        flat[1, 0] = special[1]  # group 1 is bf16 subnormals: the inf must not take their scale
    return x.view(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (torch's CPU bf16 conversion writes 0xFFFF for every NaN,
    CUDA's and the reference's other NaNs: the NaN's bits are not part of the rule)."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


# -- the reference, pinned by hand ----------------------------------------------------------

E = 2.0 ** -10  # half the e4m3 subnormal step 2^-9
ENCODE_CASES = [  # (float32 x / scale, e4m3fn byte)
    (1.0, 0x38), (1.0625, 0x38), (1.1875, 0x3A),     # ties at 1: down to 1.0 (even), up to 1.25 (even)
    (-1.0625, 0xB8), (-1.1875, 0xBA),                  # the same, negative
    (17.0, 0x58), (19.0, 0x5A),                        # ties at 16: 16 | 18, 18 | 20
    (15.5, 0x58),                                      # tie 15 | 16: up, carries into the next binade
    (400.0, 0x7C), (432.0, 0x7E),                      # ties 384 | 416 (down), 416 | 448 (up)
    (448.0, 0x7E), (449.0, 0x7E), (464.0, 0x7E),       # saturation: 464 would round to 480 (0x7F is NaN)
    (1e30, 0x7E), (-448.0, 0xFE), (-3.4e38, 0xFE),
    (2 * E, 0x01), (14 * E, 0x07), (16 * E, 0x08),     # subnormals 2^-9, 7 * 2^-9; 2^-6 the smallest normal
    (E, 0x00), (3 * E, 0x02), (5 * E, 0x02), (7 * E, 0x04),  # subnormal ties: 0|1, 1|2, 2|3, 3|4 to even
    (15 * E, 0x08),                                    # tie 7 * 2^-9 | 2^-6: up to the normal
    (float(np.nextafter(np.float32(E), np.float32(1))), 0x01),  # just above a tie
    (2.0 ** -149, 0x00), (-(2.0 ** -149), 0x80), (0.0, 0x00), (-0.0, 0x80),
    (INF, 0x7F), (-INF, 0xFF), (NAN, 0x7F), (-NAN, 0xFF),  # no inf in e4m3fn: NaN, with the sign
]


@pytest.mark.parametrize("v,byte", ENCODE_CASES)
def test_reference_encoder_hand_computed(v, byte):
    x = np.array([v], dtype=np.float32)
    if np.isnan(v):
        x = (x.view(np.uint32) | (0x80000000 if np.signbit(v) else 0)).view(np.float32)
    assert encode_e4m3(x)[0] == byte, hex(encode_e4m3(x)[0])


def test_reference_encoder_rounds_every_midpoint_half_to_even():
    """Between every two neighbouring e4m3 values: the midpoint goes to the even byte, one float32 ulp
    off it to the nearer one; every byte but NaN decodes and encodes back to itself."""
    b = np.arange(0x7E, dtype=np.int64)  # lower neighbours 0 .. 416
    lo, hi = decode_e4m3(b), decode_e4m3(b + 1)
    mid = ((lo.astype(np.float64) + hi) / 2).astype(np.float32)  # exact in float32
    assert ((mid - lo) == (hi - mid)).all()
    below, above = np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))
    for sign in (1, -1):
        s = 0x80 if sign < 0 else 0
        assert (encode_e4m3(sign * mid) == np.where(b % 2 == 0, b, b + 1) | s).all()
        assert (encode_e4m3(sign * below) == b | s).all() and (encode_e4m3(sign * above) == (b + 1) | s).all()
    every = np.array([v for v in range(256) if (v & 0x7F) != 0x7F], dtype=np.uint8)
    assert (encode_e4m3(decode_e4m3(every)) == every).all()
    assert decode_e4m3(np.array([0x7E, 0x01, 0x08, 0x38, 0x80])).tolist() == [448.0, 2.0 ** -9, 2.0 ** -6, 1.0, -0.0]


def _group(head: list[float], dtype=torch.bfloat16, fill: float = 0.0) -> torch.Tensor:
    """One row of one group: ``head``, then ``fill``; a NaN is the quiet NaN with its sign, set in the bits
    (torch's float32 -> bf16 conversion makes every NaN 0xFFFF)."""
    x = torch.tensor(head + [fill] * (GROUP - len(head)), dtype=torch.float32).to(dtype).unsqueeze(0)
    quiet, sign = {2: (0x7FC0, 1 << 15), 4: (0x7FC00000, 1 << 31)}[x.element_size()]
    for i, v in enumerate(head):
        if np.isnan(v):
            bits(x)[0, i] = torch.tensor(quiet | (sign if np.signbit(v) else 0)).to(bits(x).dtype)  # wraps
    return x


T = 2.0 ** -133  # the smallest bf16 (subnormal)
F32_TINY = 2.0 ** -149  # the smallest float32 (subnormal)
GROUP_CASES = {  # name: (x [1, GROUP], scale's float32 bits, first bytes, the rest's byte)
    # scale RNE(3/448) = 2^-8 * 12/7 = 2^-8 * 1.(101)...b -> mantissa rounds up: 0x3BDB6DB7;
    # 1 / scale = 149.33 -> 144 (0x71; the step at 128..256 is 16)
    "rounded scale": (_group([3.0, 1.0, -1.0]), 0x3BDB6DB7, [0x7E, 0x71, 0xF1], 0x00),
    # scale 7/448 = 2^-6 exactly: x / scale = 64 x; 17/64 and 19/64 are ties at 16
    "exact scale, ties": (_group([7.0, -7.0, 17 / 64, 19 / 64, -3.5]), 0x3C800000, [0x7E, 0xFE, 0x58, 0x5A, 0xF6], 0),
    # scale 1 (amax 448): ENCODE_CASES' ties and subnormals in a group
    "scale 1": (_group([448.0, -448.0, 1.0625, 1.1875, 17.0, 19.0, 15.5, 432.0, 400.0, E, 3 * E, 15 * E]),
                0x3F800000, [0x7E, 0xFE, 0x38, 0x3A, 0x58, 0x5A, 0x58, 0x7E, 0x7C, 0x00, 0x02, 0x08], 0x00),
    # the zero guard: scale 1, values +-0
    "all zero": (_group([]), 0x3F800000, [], 0x00),
    "all -0": (_group([], fill=-0.0), 0x3F800000, [], 0x80),
    # no floor: 2^-133 / 448 = (1024/7) 2^-149 = 146.29 2^-149 -> 146 2^-149 (bits 0x92, subnormal);
    # x / scale = 65536/146 = 448.88: saturates to 448
    "all tiny bf16": (_group([T, -T]), 0x00000092, [0x7E, 0xFE], 0x00),
    # float32 input (fp8.quantize takes any float): 224 2^-149 / 448 is half the smallest float32,
    # a tie that rounds to 0, so the zero guard gives scale 1 and the values round to 0 ...
    "float32 below the floor": (_group([224 * F32_TINY, -224 * F32_TINY], torch.float32), 0x3F800000, [0x00, 0x80], 0),
    # ... while 225 2^-149 / 448 = 0.502 2^-149 rounds up: scale 2^-149, value 225 -> 224 (0x76)
    "float32 at the floor": (_group([225 * F32_TINY], torch.float32), 0x00000001, [0x76], 0x00),
    # inf and NaN do not set the scale (7/448 = 2^-6) and become NaN with their sign
    "inf and nan": (_group([INF, -INF, NAN, -NAN, 7.0, -3.5, 0.5]), 0x3C800000,
                    [0x7F, 0xFF, 0x7F, 0xFF, 0x7E, 0xF6, 0x60], 0x00),
    # only non-finite: amax over no finite value is 0 -> scale 1
    "all inf": (_group([], fill=-INF), 0x3F800000, [], 0xFF),
    # an inf among tiny values: the tiny values keep their own scale
    "inf beside tiny": (_group([INF, T]), 0x00000092, [0x7F, 0x7E], 0x00),
}


@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_reference_groups_hand_computed(name):
    from afd_ext import fp8

    x, scale_bits, head, rest = GROUP_CASES[name]
    want = torch.tensor(head + [rest] * (GROUP - len(head)), dtype=torch.int32).to(torch.uint8)
    for v, s in (reference_quantize(x), fp8.quantize(x)):
        assert bits(s).tolist() == [[scale_bits]], hex(bits(s).item())
        assert torch.equal(bits(v)[0], want), [hex(b) for b in bits(v)[0, :len(head) + 1].tolist()]


def test_reference_dequantize_hand_computed():
    v, s = reference_quantize(GROUP_CASES["all tiny bf16"][0])  # 448 * 146 2^-149 = 0.998 2^-133 -> 2^-133
    assert bits(reference_dequantize(v, s))[0, :3].tolist() == [0x0001, -0x7FFF, 0]
    x = GROUP_CASES["inf and nan"][0]
    out = reference_dequantize(*reference_quantize(x))[0]
    assert out[:4].isnan().all() and out[4:7].tolist() == [7.0, -3.5, 0.5] and not out[7:].any()


F32_MAX = float(np.finfo(np.float32).max)
UE8M0_GROUP_CASES = {  # name: (x [1, GROUP], scale's float32 bits, first bytes, the rest's byte); 2^-22 = 0x34800000
    # amax 0 under the 1e-4 floor: 1e-4 / 448 = 2.23e-7 -> 2^-22 (the UE8M0 byte 105 = 0x69); values +-0
    "all zero": (_group([]), 0x34800000, [], 0x00),
    "all -0": (_group([], fill=-0.0), 0x34800000, [], 0x80),
    # bf16 subnormals (fp32 scales: a subnormal scale) are floored too: 2^-133 / 2^-22 = 2^-111 -> 0
    "all tiny bf16": (_group([T, -T]), 0x34800000, [0x00, 0x80], 0x00),
    # below the floor: 2^-15 / 2^-22 = 128 (0x70), 3 2^-16 / 2^-22 = 192 (0x74)
    "below the floor": (_group([2.0 ** -15, -3 * 2.0 ** -16]), 0x34800000, [0x70, 0xF4], 0x00),
    # exact powers of two: 448 2^-22 = 7 2^-16 -> exactly 2^-22, value 448; 448 -> scale 1
    "exact 2^-22": (_group([7 * 2.0 ** -16]), 0x34800000, [0x7E], 0x00),
    "scale 1": (GROUP_CASES["scale 1"][0], 0x3F800000, GROUP_CASES["scale 1"][2], 0x00),
    # one bf16 ulp above 448 2^-22 doubles the scale: 1.7578125 2^-14 / 2^-21 = 225 -> 224 (0x76)
    "one ulp above": (_group([1.7578125 * 2.0 ** -14]), 0x35000000, [0x76], 0x00),
    # 450 / 448 > 1 -> scale 2: 225 -> 224 (0x76), 0.5 (0x30)
    "450": (_group([450.0, -450.0, 1.0]), 0x40000000, [0x76, 0xF6, 0x30], 0x00),
    # 3 / 448 = 1.71 2^-8 -> 2^-7: 3 * 128 = 384 (0x7C), 128 (0x70)
    "rounded scale": (_group([3.0, 1.0, -1.0]), 0x3C000000, [0x7C, 0x70, 0xF0], 0x00),
    # 7 / 448 = 2^-6 exactly: the fp32 bytes (ties and saturation as there), also beside inf and NaN
    "exact scale, ties": (GROUP_CASES["exact scale, ties"][0], 0x3C800000, GROUP_CASES["exact scale, ties"][2], 0),
    "inf and nan": (GROUP_CASES["inf and nan"][0], 0x3C800000, GROUP_CASES["inf and nan"][2], 0x00),
    # only non-finite: amax over no finite value is 0 -> the floor's 2^-22, values NaN with their sign
    "all inf": (_group([], fill=-INF), 0x34800000, [], 0xFF),
    "inf beside tiny": (_group([INF, T]), 0x34800000, [0x7F, 0x00], 0x00),
    # float32 input: the largest float, (2^128 - 2^104) / 448 = 2^119.2 -> 2^120 (0x7B800000), value 256 (0x78)
    "float32 max": (_group([F32_MAX, -F32_MAX], torch.float32), 0x7B800000, [0x78, 0xF8], 0x00),
    "float32 tiny": (_group([F32_TINY], torch.float32), 0x34800000, [0x00], 0x00),
}


@pytest.mark.parametrize("name", list(UE8M0_GROUP_CASES))
def test_reference_ue8m0_groups_hand_computed(name):
    from afd_ext import fp8

    x, scale_bits, head, rest = UE8M0_GROUP_CASES[name]
    want = torch.tensor(head + [rest] * (GROUP - len(head)), dtype=torch.int32).to(torch.uint8)
    for v, s in (reference_quantize(x, ue8m0=True), fp8.quantize(x, ue8m0=True)):
        assert bits(s).tolist() == [[scale_bits]], hex(bits(s).item())
        assert torch.equal(bits(v)[0], want), [hex(b) for b in bits(v)[0, :len(head) + 1].tolist()]
        assert (bits(s) >> 23).tolist() == [[scale_bits >> 23]]  # the UE8M0 byte: the exponent field


def test_ue8m0_reference_is_deepep_round_scale_and_deepgemm_ceil():
    """The reference's scale (exact quotient, frexp) equals DeepEP's kernel (csrc/kernels/legacy/utils.cuh:
    ``amax = fmaxf(1e-4f, amax)``, ``fast_log2_ceil(amax * (1 / 448.0f))`` on the float32 product's bits,
    ``fast_pow2``) and DeepGEMM's ``ceil_to_ue8m0(amax.clamp(1e-4) / 448)`` (float32 quotient) for every
    finite bf16 amax and for float32 ones around every 448 2^k and at random."""
    def deepep(amax):
        p = (np.maximum(np.float32(1e-4), amax) * (np.float32(1) / np.float32(448))).astype(np.float32)
        b = p.view(np.uint32).astype(np.int64)
        e = ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0)
        return ((e + 127) << 23).astype(np.uint32).view(np.float32)

    def deepgemm(amax):
        q = (np.maximum(amax, np.float32(1e-4)) / np.float32(448)).astype(np.float32)
        b = q.view(np.uint32).astype(np.int64)  # 2^ceil(log2 q), exactly (torch.log2 in float32 is not)
        return (((b >> 23) + ((b & 0x7FFFFF) != 0)) << 23).astype(np.uint32).view(np.float32)

    bf = (np.arange(0x7F80, dtype=np.uint32) << 16).view(np.float32)  # every finite bf16 >= 0
    g = np.random.default_rng(0)
    k = np.arange(-40, 120, dtype=np.float64)
    at = (448.0 * 2.0 ** k).astype(np.float32)
    f32 = np.concatenate([at, np.nextafter(at, np.float32(0)), np.nextafter(at, np.float32(np.inf)),
                          g.integers(0, 0x7F800000, 1 << 20, dtype=np.uint32).view(np.float32)])
    for amax in (bf, f32):
        ref = ue8m0_scale(amax)
        assert np.array_equal(ref, deepep(amax)) and np.array_equal(ref, deepgemm(amax))
        assert (ref.view(np.uint32) & 0x807FFFFF == 0).all() and ref.min() == np.float32(2.0 ** -22)
    assert ue8m0_scale(np.float32([448 * 2.0 ** -22, 0])).tolist() == [2.0 ** -22] * 2


# -- the CPU path against it ----------------------------------------------------------------

def adversarial_inputs(seed: int = 0) -> list[torch.Tensor]:
    """bf16 and float32 ``[T, H]`` inputs for the bit-for-bit comparison: the edge cases, every bf16
    bit pattern, random bits with one exponent band per group (so the values span e4m3's normals,
    subnormals and zeros), random mixed magnitudes, inf and NaN."""
    g = np.random.default_rng(seed)
    every = torch.from_numpy(g.permutation(np.arange(1 << 16, dtype=np.uint16)).view(np.int16)).view(torch.bfloat16)

    def banded(rows: int, width: int, fbits: int, ebits: int, emax: int) -> np.ndarray:
        """Random sign and mantissa, exponent within 24 of a per-group base drawn from [0, emax]."""
        base = g.integers(0, emax + 1, (rows, width // GROUP, 1))
        e = np.clip(base - g.integers(0, 24, (rows, width // GROUP, GROUP)), 0, emax)
        u = (g.integers(0, 2, e.shape) << (fbits + ebits)) | (e << fbits) | g.integers(0, 1 << fbits, e.shape)
        return u.reshape(rows, width)

    bf_banded = torch.from_numpy(banded(64, 512, 7, 8, 254).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    f32_banded = torch.from_numpy(banded(64, 512, 23, 8, 254).astype(np.uint32).view(np.float32))
    f32_tiny = torch.from_numpy(banded(8, 512, 23, 8, 3).astype(np.uint32).view(np.float32))  # scales at the floor
    mixed = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(seed))
             * torch.logspace(-38, 38, 64).unsqueeze(1)).bfloat16()
    return [hard_inputs(), every.view(-1, 2 * GROUP), bf_banded, f32_banded, f32_tiny, mixed,
            nonfinite_inputs(16, 512, seed), torch.from_numpy(banded(4, 256, 23, 8, 255).astype(np.uint32)
                                                               .view(np.float32))]  # float32 with inf/NaN


@pytest.mark.parametrize("ue8m0", [False, True])
def test_cpu_path_is_the_reference_bit_for_bit(ue8m0):
    from afd_ext import fp8, ops

    for i, x in enumerate(adversarial_inputs()):
        rv, rs = reference_quantize(x, ue8m0)
        v, s = fp8.quantize(x, ue8m0=ue8m0)
        assert torch.equal(bits(v), bits(rv)) and torch.equal(bits(s), bits(rs)), i
        assert same_bf16(fp8.dequantize(v, s), reference_dequantize(rv, rs)), i
        if x.dtype != torch.bfloat16:
            continue
        ov, os_ = torch.empty_like(v), torch.empty_like(s)
        ops.fp8_quantize(x, ov, os_, ue8m0)  # the op's CPU kernel
        assert torch.equal(bits(ov), bits(rv)) and torch.equal(bits(os_), bits(rs)), i
        out = torch.empty_like(x)
        ops.fp8_dequantize(rv, rs, out)
        assert same_bf16(out, reference_dequantize(rv, rs)), i
        finite = x.isfinite()
        assert torch.equal(out.isnan(), ~finite), i  # NaN exactly where x was inf or NaN
        # UE8M0 only: |x| >= 248 2^120 (the scale 2^120, x / scale rounds to 256) comes back as +-inf
        top = finite & (x.float().abs() >= 248 * 2.0 ** 120) if ue8m0 else torch.zeros_like(finite)
        assert torch.equal(out.float()[top], x.float()[top].sign() * INF), i
        assert ((out.float() - x.float()).abs() <= error_bound(x, rs))[finite & ~top].all(), i
        if ue8m0:  # a power of two in [q, 2 q), q = max(amax, 1e-4) / 448 over the finite |x|
            xf = x.double().reshape(x.shape[0], -1, GROUP)
            q = torch.where(xf.isfinite(), xf.abs(), 0).amax(-1).clamp_min(float(np.float32(1e-4))) / 448
            assert (bits(rs) & 0x807FFFFF == 0).all() and (q <= rs).all() and (rs < 2 * q).all(), i
    if ue8m0:
        return
    x = hard_inputs()
    rv, rs = reference_quantize(x)
    assert rs[0, 0].item() == 1.0 and not bits(rv[0, :GROUP]).any()  # the zero guard
    assert 0 < rs[0, 1].item() < torch.finfo(torch.float32).tiny  # a subnormal scale survives
    assert bits(rv[0, GROUP:]).any()  # and its values are not flushed
    assert rs[2, 0].item() == 1.0 and bits(rv[2, :8]).tolist() == [0x7E, 0xFE, 0, 0x80, 0, 0x80, 0, 2]
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

    with pytest.raises(AFDConfigError, match=f"multiple of {GROUP}"):
        ScheduleConfig(num_layers=1, hidden_size=h, hidden_dtype=torch.bfloat16, hidden_wire="fp8_e4m3")
    with pytest.raises(AFDConfigError, match="bfloat16"):
        ScheduleConfig(num_layers=1, hidden_size=256, hidden_dtype=torch.float32, hidden_wire="fp8_e4m3")
    sc = cs.Scenario(A=1, F=1, hidden=h, dtype="bfloat16", strict=False, extra=(("hidden_wire_dtype", "fp8_e4m3"),))
    with pytest.raises(AFDConfigError, match=f"multiple of {GROUP}"):
        cs.make_connector(sc, 0, find_free_port())  # at construction, before any rendezvous


def test_config_refusals():
    from afd_ext.config import AfdExtConnectorConfig

    with pytest.raises(AFDConfigError, match="hidden_wire_dtype"):
        AfdExtConnectorConfig(hidden_wire_dtype="fp8_e5m2")
    with pytest.raises(AFDConfigError, match="strict"):
        AfdExtConnectorConfig(hidden_wire_dtype="fp8_e4m3", strict=True)
    with pytest.raises(AFDConfigError, match="fp8_delivery"):
        AfdExtConnectorConfig(fp8_delivery="bf16")
    with pytest.raises(AFDConfigError, match=r"fp8_scale_format must be one of .*'fp32', 'ue8m0'.* got 'e8m0'"):
        AfdExtConnectorConfig(hidden_wire_dtype="fp8_e4m3", fp8_scale_format="e8m0")
    with pytest.raises(AFDConfigError, match="fp8_scale_format 'ue8m0' sets the scales of FP8 hidden states; set "
                                             "hidden_wire_dtype 'fp8_e4m3' too"):
        AfdExtConnectorConfig.from_mapping({"fp8_scale_format": "ue8m0"})
    cfg = AfdExtConnectorConfig.from_mapping({"hidden_wire_dtype": "fp8_e4m3", "fp8_scale_format": "ue8m0"})
    assert cfg.fp8_scale_format == "ue8m0" and AfdExtConnectorConfig().fp8_scale_format == "fp32"


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
    assert "hidden" not in raw and raw["hidden_fp8"].dtype == E4M3  # "fp8" delivery: no bf16 buffer
    payload = AFDControlPayload({0: [3]})
    keys = [graph_key_from_schedule(build_step_schedule(Topology(1, 1), payload, c))
            for c in (ScheduleConfig(**base), cfg)]
    assert keys[0] != keys[1] and keys[1].hidden_wire == "fp8_e4m3"


def test_scale_format_is_a_property_of_the_scales_part():
    """UE8M0 is the scales part's encoding (afd_ext/wire.py): the same bytes on the wire, compared at the
    handshake beside the dtype, carried to the peer plane's spec; a ScheduleConfig refuses another format."""
    from afd_ext import wire
    from afd_ext.schedule import ScheduleConfig
    from afd_ext.transport.peer.plane import WireSpec

    base = dict(num_layers=1, hidden_size=7168, hidden_dtype=torch.bfloat16, hidden_wire="fp8_e4m3")
    fp32, ue = ScheduleConfig(**base), ScheduleConfig(**base, fp8_scale_format="ue8m0")
    assert [(p.name, p.encoding) for p in ue.wire_parts[:2]] == [("hidden_fp8", None), ("hidden_scales", "ue8m0")]
    assert [p[:4] for p in ue.wire_parts] == [p[:4] for p in fp32.wire_parts]  # same parts, dtypes, widths
    a, b = wire.handshake_field(fp32), wire.handshake_field(ue)
    assert [i for i in range(len(a)) if a[i] != b[i]] == [1]
    assert (a[1], b[1]) == (["a2f", "hidden_scales", [56], "float32", "fp32"], ["a2f", "hidden_scales", [56], "float32", "ue8m0"])
    assert a[0] == ["a2f", "hidden_fp8", [7168], "float8_e4m3fn"]  # a part without an encoding: as before
    assert (WireSpec.of(fp32).ue8m0, WireSpec.of(ue).ue8m0) == (False, True)
    assert WireSpec.of(fp32).signature() != WireSpec.of(ue).signature()
    assert WireSpec.of(ScheduleConfig(1, 256, torch.bfloat16, fp8_scale_format="ue8m0")).ue8m0 is False  # no FP8
    with pytest.raises(AFDConfigError, match="fp8_scale_format must be one of"):
        ScheduleConfig(**base, fp8_scale_format="e8m0")


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fakes_give_shapes_under_compile(ue8m0):
    from afd_ext import ops

    def f(x, v, s, out):
        ops.fp8_quantize(x, v, s, ue8m0)
        ops.fp8_dequantize(v, s, out)
        return out * 2

    x = hard_inputs(4, 256)
    v, s, out = torch.empty(4, 256, dtype=E4M3), torch.empty(4, 2), torch.empty(4, 256, dtype=torch.bfloat16)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, v, s, out)
    rv, rs = reference_quantize(x, ue8m0)
    assert torch.equal(bits(v), bits(rv)) and torch.equal(got, reference_dequantize(rv, rs) * 2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        bad = torch.empty(4, 200, dtype=torch.bfloat16)
        with pytest.raises(AFDConfigError, match=f"multiple of {GROUP}"):
            ops.fp8_quantize(bad, torch.empty(4, 200, dtype=E4M3), torch.empty(4, 1))


# -- over gloo, in processes ------------------------------------------------------------------

def fp8_worker(rank: int, nprocs: int, port: int, A: int, delivery: str, mismatch: bool = False,
               transport: str = "gloo", misaligned: bool = False, scales: str = "fp32") -> dict:
    """A:1 with FP8 on the wire (also run over NCCL and peer memory by tests/gpu/test_fp8_gpu.py); the FFN
    doubles what it receives; the attention side checks every reply against the reference round trip
    (exactly: every path computes the rule's bytes) and the stated bound. ``misaligned``: each layer-0
    send is first tried with a contiguous bf16 copy 2 bytes off 8-byte alignment; a refusal (CUDA
    transports) is recorded and the aligned tensor sent instead. ``scales``: ``fp8_scale_format``;
    ``"mix"``: UE8M0 on rank 0, fp32 elsewhere (a mismatch the handshake must refuse)."""
    from afd_ext import ops

    mismatch = mismatch or scales == "mix"
    fmt = ("ue8m0" if rank == 0 else "fp32") if scales == "mix" else scales
    extra = (("hidden_wire_dtype", None if mismatch and scales != "mix" and rank == 0 else "fp8_e4m3"),
             ("fp8_delivery", delivery), ("fp8_scale_format", fmt))
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
            raise AssertionError("a hidden_wire_dtype or fp8_scale_format mismatch passed the handshake")
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
                        rv, rs = reference_quantize(x, fmt == "ue8m0")
                        assert torch.equal(out, reference_dequantize(rv, rs) * 2)
                        assert ((out.float() / 2 - x.float()).abs() <= error_bound(x, rs)).all()
                    checked += n
        return {"role": conn.role, "checked": checked, "transport": conn.transport_kind, "refused": refused}
    finally:
        conn.close()


@pytest.mark.parametrize("scales", ["fp32", "ue8m0"])
@pytest.mark.parametrize("delivery", ["dequant", "fp8"])
def test_gloo_round_trip(delivery, scales):
    res = run_workers(fp8_worker, 3, (find_free_port(), 2, delivery, False, "gloo", False, scales), timeout_s=150)
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


def test_handshake_refuses_a_mix_of_scale_formats():
    """UE8M0 scales on one role and fp32 on the other: refused at init, naming the option, both values and ranks."""
    res = run_workers(fp8_worker, 2, (find_free_port(), 1, "dequant", False, "gloo", False, "mix"), timeout_s=120)
    for r in res:
        assert r["field"] == "fp8_scale_format"
        assert "'ue8m0'" in r["message"] and "'fp32'" in r["message"]
        assert "FFN rank 0" in r["message"] and "attention rank 0" in r["message"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scales, gate", [([], []), (["ue8m0"], []), (["ue8m0"], ["--gate-on-attention"])])
def test_demo_runs_with_fp8_on_gloo(tmp_path, scales, gate):
    """The demo with FP8 hidden states (``--fp8``: fp32 scales; ``--fp8 ue8m0``) passes its self-check against
    the whole model rounding the same way (with the gate on the attention side, only the experts' input)."""
    import json
    import subprocess

    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "afd_ext", "demo", "--backend", "gloo", "--fp8", *scales,
                           "--no-progress", "--topology", "2A1F", "--json", str(out), *gate],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["self_check"]["ok"] and s["self_check"]["tolerance"] == pytest.approx(0.25 * 2)
    assert s["fp8"] == (scales or ["fp32"])[0]
    if gate:  # router logits travel too: the byte count below is hidden states alone
        return
    # The summary counts FP8 wire bytes (H + 4 H / GROUP per token) attention -> FFN, bf16 (2 H) back.
    h = s["model"]["hidden_size"]
    assert s["bytes"]["attention_to_ffn"] * 2 * h == s["bytes"]["ffn_to_attention"] * (h + 4 * h // GROUP)
