"""The FP8 rule of docs/fp8.md, written from its statement with numpy and integer arithmetic only.

Independent of ``afd_ext.fp8``: no torch float casts; the e4m3fn encoding (saturation, round half
to even, subnormals, NaN bytes) works on float32 bit patterns as integers, and the only float
operations are numpy's correctly rounded float32 division and product that the rule itself names.
``tests/test_fp8.py`` checks the CPU path against it, ``tests/gpu/test_fp8_gpu.py`` the CUDA kernels.

Per token and group of ``GROUP`` channels (float32): ``scale = amax / 448`` over the group's finite
``|x|`` (1 when that is 0); a finite ``x`` becomes ``RNE(sat(x / scale))``, an inf or NaN ``x`` the
NaN byte with its sign (``0x7F`` / ``0xFF``). UE8M0 scales (``ue8m0=True``): ``scale =
2^ceil(log2(max(amax, 1e-4) / 448))`` (DeepEP's ``round_scale``), here from the exact quotient in
float64 split by ``frexp`` (no float32 rounding, no bit tricks).
"""

from __future__ import annotations

import numpy as np
import torch

from afd_ext.fp8 import GROUP

FP8_MAX_BITS = 0x43E00000  # 448.0 as float32 bits
NAN_BYTE = 0x7F  # e4m3fn's NaN (with the sign bit: 0xFF); it has no inf
AMAX_FLOOR = np.float32(1e-4)  # DeepEP's kFP8Margin, a float32 constant: UE8M0 scales only


def encode_e4m3(v: np.ndarray) -> np.ndarray:
    """float32 ``v`` (any shape) -> e4m3fn bytes (uint8, same shape): saturated to +-448, rounded half
    to even; an inf or NaN -> the NaN byte with v's sign."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.int64)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    nonfinite = a >= 0x7F800000
    a = np.minimum(a, FP8_MAX_BITS)  # positive float32 bits order like their values: saturation
    exp, frac = a >> 23, a & 0x7FFFFF
    m = np.where(exp > 0, frac | 0x800000, frac)  # |v| = m * 2^(e - 150), m < 2^24
    e = np.maximum(exp, 1)
    p = np.maximum(exp - 127, -6)  # binade of the e4m3 result; below 2^-6 the subnormal step 2^-9
    shift = np.minimum(p - 3 - (e - 150), 26)  # >= 20; from 26 on m < half a step: rounds to 0
    k = m >> shift  # |v| in steps of 2^(p-3), truncated
    rem, half = m & ((1 << shift) - 1), 1 << (shift - 1)
    k = k + ((rem > half) | ((rem == half) & ((k & 1) == 1)))  # half to even
    byte = ((p + 6) << 3) + k  # k = 16 carries into the next binade; below 2^-6 p = -6: byte = k
    return (np.where(nonfinite, NAN_BYTE, byte) | sign).astype(np.uint8)


def decode_e4m3(b: np.ndarray) -> np.ndarray:
    """e4m3fn bytes (uint8) -> their float32 values (exact; 0x7F / 0xFF -> NaN)."""
    b = np.asarray(b, dtype=np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    mag = np.where((b & 0x7F) == NAN_BYTE, np.nan, mag)
    return np.where((b & 0x80) != 0, -mag, mag).astype(np.float32)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16 or int16) -> float32 (exact: the upper half of the float32 bits)."""
    return (np.asarray(bits).astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even; any NaN -> 0x7FC0."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.int64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r).astype(np.uint16)


def ue8m0_scale(amax: np.ndarray) -> np.ndarray:
    """float32 ``amax`` (>= 0, finite) -> ``2^ceil(log2(max(amax, 1e-4) / 448))`` as float32.

    The quotient of two float32 in float64 is a power of two exactly when the real one is (a float32
    has 24 significant bits, so a real quotient off a power of two is off by far more than float64's
    rounding); ``frexp`` gives ``q = m 2^e`` with ``m`` in [0.5, 1): ``ceil(log2 q)`` is ``e - 1`` when
    ``m == 0.5``, else ``e``."""
    q = np.maximum(np.asarray(amax, dtype=np.float32), AMAX_FLOOR).astype(np.float64) / 448.0
    m, e = np.frexp(q)
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(np.float32)


def quantize_np(x: np.ndarray, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[T, H]`` (``H % GROUP == 0``) -> (e4m3fn bytes uint8 ``[T, H]``, float32 scales ``[T, H/GROUP]``)."""
    t, h = x.shape
    xg = np.asarray(x, dtype=np.float32).reshape(t, h // GROUP, GROUP)
    finite = np.isfinite(xg)
    amax = np.where(finite, np.abs(xg), np.float32(0)).max(-1, initial=np.float32(0))
    if ue8m0:
        scale = ue8m0_scale(amax)
    else:
        scale = amax / np.float32(448.0)
        scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    v = np.where(finite, xg, np.float32(0)) / scale[..., None]  # non-finite x: their bytes come from x itself
    q = np.where(finite, encode_e4m3(v), encode_e4m3(xg))
    return q.reshape(t, h), scale


def dequantize_np(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e4m3fn bytes ``[T, H]`` and float32 scales ``[T, H/GROUP]`` -> bf16 bits ``[T, H]`` (one float32
    product, rounded to nearest even)."""
    t, h = values.shape
    with np.errstate(over="ignore"):  # UE8M0 scales: 256 * 2^120 is inf, as the rule says
        f = decode_e4m3(values).reshape(t, h // GROUP, GROUP) * np.asarray(scales, dtype=np.float32)[..., None]
    return f32_to_bf16_bits(f.astype(np.float32)).reshape(t, h)


def to_f32(x: torch.Tensor) -> np.ndarray:
    """A CPU/GPU tensor of bf16 or float32 -> float32 numpy, bit-exact (bf16 through its bits)."""
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return bf16_bits_to_f32(x.view(torch.int16).numpy())
    if x.dtype != torch.float32:
        raise TypeError(f"the reference takes bfloat16 or float32, got {x.dtype}")
    return x.numpy().copy()


def reference_quantize(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on ``x`` ``[T, H]`` (bf16 or float32; TypeError otherwise): ``(values float8_e4m3fn
    [T, H], scales float32 [T, H/GROUP])``, on CPU; ``ue8m0``: UE8M0 scales."""
    q, s = quantize_np(to_f32(x), ue8m0)
    return torch.from_numpy(q).view(torch.float8_e4m3fn), torch.from_numpy(s)


def reference_dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values`` (e4m3fn ``[T, H]``) times their group's scale (float32 ``[T, H/GROUP]``), rounded once
    to bf16 ``[T, H]``, on CPU (a NaN as 0x7FC0)."""
    v = values.detach().cpu().contiguous().view(torch.uint8).numpy()
    b = dequantize_np(v, scales.detach().cpu().numpy())
    return torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
