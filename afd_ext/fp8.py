"""FP8 hidden states on the wire (attention -> FFN; opt-in: ``hidden_wire_dtype: "fp8_e4m3"``).

The format of DeepEP's low-latency dispatch and DeepGEMM: ``float8_e4m3fn``
values ``[T, H]`` and float32 scales ``[T, H/128]``, one per token and 128
channels. Per group: ``scale = amax(|x|) / 448`` over its finite ``x`` (``1.0``
when that is 0, so an all-zero group gives zeros), ``values = x / scale`` in
float32, saturated to +-448 and rounded to nearest even; ``x ~= values * scale``;
an inf or NaN ``x`` becomes the NaN byte with its sign (``0x7F`` / ``0xFF``).
UE8M0 scales (``fp8_scale_format: "ue8m0"``): ``scale = 2^ceil(log2(amax / 448))``,
at least ``2^-22`` (DeepEP's ``round_scale``, its amax floor 1e-4); the values the same way.
The CUDA kernels (``csrc/cuda/peer_kernels.cu``) compute the same bytes; this is
the rule on CPU (the gloo transport, and the ops' CPU kernels). docs/fp8.md.
"""

from __future__ import annotations

import torch

from .errors import AFDConfigError

__all__ = ["GROUP", "FP8_MAX", "FP8_DTYPE", "HIDDEN_WIRE_DTYPES", "DELIVERIES", "SCALE_FORMATS", "UE8M0_MIN_EXP",
           "check_hidden", "quantize", "dequantize", "wire_bytes_per_token"]

#: Channels per scale.
GROUP = 128
#: Largest finite float8_e4m3fn.
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: ``connector_extra_config.hidden_wire_dtype`` values (None: the hidden dtype itself travels).
HIDDEN_WIRE_DTYPES = ("fp8_e4m3",)
#: ``connector_extra_config.fp8_delivery``: what an FFN rank's ``recv_attn_output`` returns.
DELIVERIES = ("dequant", "fp8")
#: ``connector_extra_config.fp8_scale_format``: float32 ``amax / 448``, or that rounded up to a power of two.
SCALE_FORMATS = ("fp32", "ue8m0")
#: Smallest UE8M0 scale's float32 exponent field: 2^-22 = 2^ceil(log2(1e-4 / 448)), DeepEP's amax floor 1e-4.
UE8M0_MIN_EXP = 127 - 22


def check_hidden(hidden_size: int, dtype: torch.dtype) -> None:
    """Refuse a hidden state the FP8 wire cannot carry (before anything is built).

    Raises:
        AFDConfigError: ``hidden_size`` is not a multiple of 128, or ``dtype`` is not bfloat16.
    """
    if hidden_size % GROUP:
        raise AFDConfigError(f"hidden_wire_dtype 'fp8_e4m3' needs a hidden size that is a multiple of {GROUP} "
                             f"(one scale per {GROUP} channels), got {hidden_size}")
    if dtype != torch.bfloat16:
        raise AFDConfigError(f"hidden_wire_dtype 'fp8_e4m3' quantizes bfloat16 hidden states, got {dtype}")


def quantize(x: torch.Tensor, values: torch.Tensor | None = None, scales: torch.Tensor | None = None,
             ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on ``x`` ``[T, H]`` (any float dtype, CPU): ``(values e4m3 [T, H], scales fp32 [T, H/128])``.

    A scale is its 128-channel group's largest finite ``|x|`` over 448 (1.0 when that is 0; with
    ``ue8m0`` rounded up to a power of two, at least 2^-22); a finite value is ``x / scale`` in
    float32, saturated to +-448 and rounded to nearest even, an inf or NaN
    the NaN byte with its sign, ``0x7F`` / ``0xFF`` (docs/fp8.md). Writes
    into ``values`` (``float8_e4m3fn [T, H]``) / ``scales`` (``float32 [T, H/128]``) when given, on
    ``x``'s device.

    Raises:
        RuntimeError: (torch) ``H`` is not a multiple of 128, or ``values``/``scales`` have other
            shapes; :func:`check_hidden` refuses such a hidden size at connector build instead.
    """
    xf = x.float().reshape(x.shape[0], x.shape[1] // GROUP, GROUP)
    finite = xf.isfinite()
    amax = torch.where(finite, xf.abs(), 0.0).amax(-1)  # an inf or NaN does not set its group's scale
    scale = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: a true division on every device
    if ue8m0:  # the exponent field, one up where a mantissa bit is set (scale >= 0: int32 bits order like it)
        b = scale.view(torch.int32)
        scale = (((b >> 23) + (b & 0x7FFFFF != 0)).clamp_min(UE8M0_MIN_EXP) << 23).view(torch.float32)
    else:
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    # An inf or NaN x: e4m3fn's NaN 0x7F with x's sign (torch's cast would saturate an inf to +-448).
    nan = xf.signbit().to(torch.uint8) << 7 | 0x7F
    q = torch.where(finite, q, nan).view(FP8_DTYPE).reshape(x.shape)
    if values is None:
        return q, scale
    values.copy_(q)
    scales.copy_(scale)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``values`` (e4m3 ``[T, H]``) times their group's scale (fp32 ``[T, H/128]``), in float32, rounded once.

    Returns a new ``[T, H]`` tensor of ``dtype`` on ``values``' device, or ``out`` (``[T, H]``,
    written in its own dtype) when given.

    Raises:
        RuntimeError: (torch) shapes that do not match as above.
    """
    v = values.float().reshape(values.shape[0], values.shape[1] // GROUP, GROUP)
    y = (v * scales.unsqueeze(-1)).reshape(values.shape)
    if out is None:
        return y.to(dtype)
    out.copy_(y)
    return out


def wire_bytes_per_token(hidden_size: int) -> int:
    """Hidden-state bytes per token on the FP8 wire: ``H + 4 H / 128`` (7,392 at H = 7168)."""
    return hidden_size + 4 * (hidden_size // GROUP)
