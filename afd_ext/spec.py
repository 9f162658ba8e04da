"""Facts of the exchange written once: :class:`ExchangeSpec` and the wire dtype table.

:class:`ExchangeSpec` is parsed once from the connector's keyword arguments
(or a vLLM config) and gives the handshake its model fields. The dtype table
(names, stable wire codes, which dtypes may travel) is read by strict headers
(:mod:`afd_ext.transport.strict`), the handshake, the schedule's dtype check
and the compiled ops' dtype list. Torch-free callers should not import this
module (it imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import AFDConfigError

__all__ = ["ExchangeSpec", "SPEC_KWARGS", "DTYPE_CODES", "WIRE_DTYPES", "HIDDEN_DTYPES", "TOKEN_IDS_DTYPE", "dtype_code", "dtype_name",
           "dtype_from_code", "as_dtype"]

#: Stable wire codes of every dtype that may travel (headers, handshakes). Never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.float64: 7,
}
for _name, _code in (("float8_e4m3fn", 8), ("float8_e5m2", 9)):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

#: Dtypes the compiled ops move (as bytes; fp8 included).
WIRE_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in (torch.bfloat16, torch.float16, torch.float32, getattr(torch, "float8_e4m3fn", None),
                getattr(torch, "float8_e5m2", None), torch.int32, torch.int64, torch.uint8)
    if d is not None)
#: Dtypes the hidden states may have on the wire.
HIDDEN_DTYPES: tuple[torch.dtype, ...] = tuple(d for d in WIRE_DTYPES if d.is_floating_point)
#: Token ids travel as int32 (the reference's wire dtype).
TOKEN_IDS_DTYPE = torch.int32


def dtype_code(dtype: torch.dtype) -> int:
    """The header/handshake code of ``dtype``.

    Raises:
        ValueError: the dtype cannot travel.
    """
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise AFDConfigError(f"dtype {dtype} cannot travel on the AFD wire; known: {list(DTYPE_CODES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of handshakes, headers and configs)."""
    return str(dtype).replace("torch.", "")


def dtype_from_code(code: int) -> str:
    """The name of the dtype with wire code ``code``, or ``"<dtype code N>"`` for an unknown code."""
    d = _CODE_DTYPES.get(int(code))
    return dtype_name(d) if d is not None else f"<dtype code {int(code)}>"


def as_dtype(value: Any, name: str) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``).

    Raises:
        ValueError: neither (names ``name`` and the value).
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        d = getattr(torch, value.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
    if isinstance(value, str):
        raise AFDConfigError(f"{name}: unknown dtype name {value!r}; pass a torch.dtype or its name (e.g. 'bfloat16')")
    raise AFDConfigError(f"{name} must be a torch.dtype or its name (e.g. 'bfloat16'), got {value!r}")


# ------------------------------------------------------------------ the exchange's static facts

#: Keyword arguments of the connector that carry model facts (besides ``device`` / ``warmup_on_init``).
SPEC_KWARGS = ("hidden_size", "num_layers", "dtype", "router_logits_width", "router_logits_dtype",
               "routing_spec", "send_token_ids", "tp_size", "vllm_config")


@dataclass(frozen=True)
class ExchangeSpec:
    """What travels per exchange; both roles must agree on every field (checked in the init handshake).

    Attributes:
        hidden_size: hidden states width.
        num_layers: layer exchanges per stage per step.
        dtype: wire dtype of the hidden states (and of the FFN output).
        router_logits_width: router logits ``[n, width]`` travel a2f, or None.
        router_logits_dtype: their dtype.
        send_token_ids: ``[n]`` int32 token ids travel a2f.
        tp_size: attention tensor-parallel size.
    """

    hidden_size: int
    num_layers: int
    dtype: torch.dtype = torch.bfloat16
    router_logits_width: int | None = None
    router_logits_dtype: torch.dtype = torch.float32
    send_token_ids: bool = False
    tp_size: int = 1

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any]) -> "ExchangeSpec":
        """Parse the connector's keyword arguments (explicit values win over ``vllm_config``'s).

        ``vllm_config`` supplies ``hidden_size`` and ``num_layers``
        (``model_config.hf_text_config``), ``dtype`` (``model_config.dtype``) and
        ``tp_size`` (``parallel_config.tensor_parallel_size``). ``routing_spec``
        (an ``AFDExpertRoutingSpec`` or ``(width, dtype)``) may stand for the router-logits pair.

        Raises:
            ValueError: a missing or invalid fact (named, with the value).
        """
        vc = kw.get("vllm_config")
        derived: dict[str, Any] = {}
        if vc is not None:
            mc = getattr(vc, "model_config", None)
            hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
            if hf is not None:
                derived["hidden_size"] = getattr(hf, "hidden_size", None)
                derived["num_layers"] = getattr(hf, "num_hidden_layers", None)
            if mc is not None and getattr(mc, "dtype", None) is not None:
                derived["dtype"] = mc.dtype
            pc = getattr(vc, "parallel_config", None)
            if pc is not None and getattr(pc, "tensor_parallel_size", None):
                derived["tp_size"] = int(pc.tensor_parallel_size)
        get = lambda k, default=None: kw[k] if kw.get(k) is not None else derived.get(k, default)  # noqa: E731
        hidden = get("hidden_size")
        layers = get("num_layers")
        for name, v in (("hidden_size", hidden), ("num_layers", layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AFDConfigError(
                    f"AFDConnector needs {name} (an int >= 1) as a keyword argument or from vllm_config, got {v!r}"
                )
        dtype = as_dtype(get("dtype", torch.bfloat16), "dtype")
        width = kw.get("router_logits_width")
        ldtype = kw.get("router_logits_dtype")
        spec = kw.get("routing_spec")
        if spec is not None:
            if not hasattr(spec, "router_logits_width"):
                from .metadata import AFDExpertRoutingSpec

                spec = AFDExpertRoutingSpec(*spec)
            if width is not None and width != spec.router_logits_width:
                raise AFDConfigError(f"router_logits_width={width} disagrees with routing_spec {spec}")
            width = spec.router_logits_width
            ldtype = ldtype or spec.router_logits_dtype
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise AFDConfigError(f"router_logits_width must be None or an int >= 1, got {width!r}")
        ldtype = as_dtype(ldtype or torch.float32, "router_logits_dtype")
        ids = kw.get("send_token_ids", False)
        if not isinstance(ids, bool):
            raise AFDConfigError(f"send_token_ids must be a bool, got {ids!r}")
        return cls(hidden, layers, dtype, width, ldtype, ids, get("tp_size", 1))

    def handshake_fields(self) -> dict[str, Any]:
        """This spec as handshake fields (names and dtype spellings both roles compare)."""
        return {
            "tp_size": self.tp_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "hidden_dtype": dtype_name(self.dtype),
            "router_logits": None if self.router_logits_width is None
            else [self.router_logits_width, dtype_name(self.router_logits_dtype)],
            "token_ids": dtype_name(TOKEN_IDS_DTYPE) if self.send_token_ids else None,
        }

    def schedule_config(self, extra: Any) -> Any:
        """The :class:`~afd_ext.schedule.ScheduleConfig` of this spec under ``extra`` (an ``AfdExtConnectorConfig``)."""
        from .schedule import ScheduleConfig

        return ScheduleConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size, hidden_dtype=self.dtype,
            router_logits_width=self.router_logits_width, router_logits_dtype=self.router_logits_dtype,
            send_token_ids=self.send_token_ids, wire_format=extra.wire_format,
            clamp_idle_to_one=extra.clamp_idle_to_one, packed_max_bytes=extra.packed_max_bytes,
            max_stages=extra.max_stages)
