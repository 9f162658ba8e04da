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

#: Stable wire codes of every dtype that may travel (headers, handshakes). Never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.float64: 7,
    torch.float8_e4m3fn: 8,
    torch.float8_e5m2: 9,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

#: Dtypes the compiled ops move (as bytes; fp8 included).
WIRE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                         torch.float8_e5m2, torch.int32, torch.int64, torch.uint8)
#: Dtypes the hidden states may have on the wire.
HIDDEN_DTYPES: tuple[torch.dtype, ...] = tuple(d for d in WIRE_DTYPES if d.is_floating_point)
#: Token ids travel as int32 (the reference's wire dtype).
TOKEN_IDS_DTYPE = torch.int32


def dtype_code(dtype: torch.dtype) -> int:
    """The header/handshake code of ``dtype``.

    Raises:
        AFDConfigError: the dtype cannot travel.
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
        AFDConfigError: neither (names ``name`` and the value).
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        d = getattr(torch, value.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
        raise AFDConfigError(f"{name}: unknown dtype name {value!r}; pass a torch.dtype or its name (e.g. 'bfloat16')")
    raise AFDConfigError(f"{name} must be a torch.dtype or its name (e.g. 'bfloat16'), got {value!r}")


# ------------------------------------------------------------------ the exchange's static facts

#: Keyword arguments of the connector that carry model facts (besides ``device`` / ``warmup_on_init``).
SPEC_KWARGS = ("hidden_size", "num_layers", "dtype", "router_logits_width", "router_logits_dtype",
               "routing_spec", "send_token_ids", "tp_size", "vllm_config")


@dataclass(frozen=True)
class ExchangeSpec:
    """What travels per exchange; both roles must agree on every field but ``tp_size`` (init handshake).

    Attributes:
        hidden_size: hidden states width.
        num_layers: layer exchanges per stage per step (every decoder layer, or
            only the MoE layers when the gate runs on the attention side).
        dtype: wire dtype of the hidden states (and of the FFN output).
        router_logits_width: router logits ``[n, width]`` travel a2f, or None.
        router_logits_dtype: their dtype.
        send_token_ids: ``[n]`` int32 token ids travel a2f.
        tp_size: attention workers per DP rank (PCP x TP) as this rank knows
            them: it only narrows the count-vector lengths this rank accepts
            (1: any divisor of ``A``, the reference's rule). Not compared: an
            FFN rank does not know the attention side's layout, and each
            vector's length says how it expands.
    """

    hidden_size: int
    num_layers: int
    dtype: torch.dtype = torch.bfloat16
    router_logits_width: int | None = None
    router_logits_dtype: torch.dtype = torch.float32
    send_token_ids: bool = False
    tp_size: int = 1

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, role: str = "attention", compute_gate_on_attention: bool = False,
                         num_exchange_layers: int | None = None, router_logits_dtype: Any = None,
                         send_token_ids: bool = False) -> "ExchangeSpec":
        """The spec of a vLLM worker, every fact from its ``VllmConfig``.

        Args:
            vllm_config: ``model_config`` (``hf_text_config``/``hf_config``:
                ``hidden_size``, ``num_hidden_layers``, the expert count and MoE
                layout; ``dtype``) and ``parallel_config`` (PCP and TP sizes).
            role: ``"attention"`` or ``"ffn"``; only an attention rank knows its
                workers per DP rank (``tp_size``).
            compute_gate_on_attention: router logits travel and only the MoE
                layers are exchanged (see :func:`moe_layer_indices`); width from
                ``n_routed_experts`` / ``num_experts`` / ``num_local_experts``.
            num_exchange_layers: exchanges per step when the model config does
                not say which layers are MoE.
            router_logits_dtype: their wire dtype, overriding what the model's
                gate emits (default: :func:`router_logits_dtype`).
            send_token_ids: ``[n]`` int32 token ids travel a2f.

        Raises:
            AFDConfigError: a fact is missing; the message names every missing field.
        """
        facts, missing = _vllm_facts(vllm_config, role, compute_gate_on_attention, num_exchange_layers)
        if missing:
            raise AFDConfigError("cannot configure the AFD exchange from vllm_config; missing: " + "; ".join(missing))
        if router_logits_dtype is not None and compute_gate_on_attention:
            facts["router_logits_dtype"] = as_dtype(router_logits_dtype, "router_logits_dtype")
        return cls.from_kwargs({**facts, "send_token_ids": send_token_ids})

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any], *, role: str = "attention",
                    compute_gate_on_attention: bool = False) -> "ExchangeSpec":
        """Parse the connector's keyword arguments (explicit values win over ``vllm_config``'s).

        ``vllm_config`` supplies what :meth:`from_vllm_config` reads (with the
        gate-on-attention facts when ``compute_gate_on_attention``).
        ``routing_spec`` (an ``AFDExpertRoutingSpec`` or ``(width, dtype)``) may
        stand for the router-logits pair.

        Raises:
            AFDConfigError: a missing or invalid fact (named, with the value).
        """
        vc = kw.get("vllm_config")
        derived: dict[str, Any] = {}
        missing: list[str] = []
        if vc is not None:
            derived, missing = _vllm_facts(vc, role, compute_gate_on_attention, None)
        get = lambda k, default=None: kw[k] if kw.get(k) is not None else derived.get(k, default)  # noqa: E731
        hidden = get("hidden_size")
        layers = get("num_layers")
        for name, v in (("hidden_size", hidden), ("num_layers", layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AFDConfigError(
                    f"AFDConnector needs {name} (an int >= 1) as a keyword argument or from vllm_config, got {v!r}"
                    + (f" (from vllm_config, missing: {'; '.join(missing)})" if missing else "")
                )
        dtype = as_dtype(get("dtype", torch.bfloat16), "dtype")
        width = get("router_logits_width")
        ldtype = get("router_logits_dtype")
        spec = kw.get("routing_spec")
        if spec is not None:
            if not hasattr(spec, "router_logits_width"):
                from .metadata import AFDExpertRoutingSpec

                spec = AFDExpertRoutingSpec(*spec)
            given = kw.get("router_logits_width")
            if given is not None and given != spec.router_logits_width:
                raise AFDConfigError(f"router_logits_width={given} disagrees with routing_spec {spec}")
            width = spec.router_logits_width
            ldtype = kw.get("router_logits_dtype") or spec.router_logits_dtype
        if compute_gate_on_attention and width is None:
            raise AFDConfigError(
                "compute_gate_on_attention is set but the router-logits width is unknown: pass router_logits_width "
                "(or routing_spec)" + (f"; from vllm_config, missing: {'; '.join(missing)}" if missing else ""))
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise AFDConfigError(f"router_logits_width must be None or an int >= 1, got {width!r}")
        ldtype = as_dtype(ldtype or torch.float32, "router_logits_dtype")
        ids = kw.get("send_token_ids", False)
        if not isinstance(ids, bool):
            raise AFDConfigError(f"send_token_ids must be a bool, got {ids!r}")
        tp = get("tp_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise AFDConfigError(f"tp_size must be an int >= 1, got {tp!r}")
        return cls(hidden, layers, dtype, width, ldtype, ids, tp)

    def handshake_fields(self) -> dict[str, Any]:
        """This spec as handshake fields (what both roles must agree on; ``tp_size`` is local)."""
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "hidden_dtype": dtype_name(self.dtype),
            "router_logits": None if self.router_logits_width is None
            else [self.router_logits_width, dtype_name(self.router_logits_dtype)],
            "token_ids": dtype_name(TOKEN_IDS_DTYPE) if self.send_token_ids else None,
        }


# ------------------------------------------------------------------ facts from a vLLM config


def moe_layer_indices(hf_config: Any, num_layers: int) -> tuple[int, ...] | None:
    """Indices of the MoE decoder layers, by the conventions of the model families vLLM serves.

    DeepSeek-V2/V3 (``first_k_dense_replace``, ``moe_layer_freq``),
    Qwen2/3-MoE (``decoder_sparse_step``, ``mlp_only_layers``), and models
    whose every layer is MoE (``num_local_experts``, e.g. Mixtral).

    Returns:
        The indices, or ``None`` when the config follows none of these conventions.
    """
    if getattr(hf_config, "first_k_dense_replace", None) is not None:
        if getattr(hf_config, "n_routed_experts", None) is None:
            return ()
        k, freq = int(hf_config.first_k_dense_replace), int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return tuple(i for i in range(num_layers) if i >= k and i % freq == 0)
    if getattr(hf_config, "decoder_sparse_step", None) is not None:
        if not getattr(hf_config, "num_experts", 0):
            return ()
        step, dense = int(hf_config.decoder_sparse_step), set(getattr(hf_config, "mlp_only_layers", None) or ())
        return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if getattr(hf_config, "num_local_experts", None):
        return tuple(range(num_layers))
    return None


def router_logits_dtype(model_config: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the router logits vLLM's MoE gate emits (what the FFN runner's ``routing_spec`` says).

    vLLM 0.26.0's DeepSeek gate (``deepseek_v2._get_moe_router_dtype``, used by
    every model afd-plugin registers) emits float32 when the model type is
    ``glm_moe_dsa`` or the config sets ``moe_router_dtype: "float32"``, and
    otherwise the gate weight's dtype, i.e. the model dtype.

    Args:
        model_config: vLLM's ``ModelConfig`` (``hf_config`` / ``hf_text_config`` read).
        model_dtype: the model dtype.
    """
    for hf in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        if getattr(hf, "model_type", None) == "glm_moe_dsa" or getattr(hf, "moe_router_dtype", None) == "float32":
            return torch.float32
    return model_dtype


def _router_width(hf_config: Any) -> int | None:
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        v = getattr(hf_config, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _vllm_facts(vllm_config: Any, role: str, gate: bool, num_exchange_layers: int | None
                ) -> tuple[dict[str, Any], list[str]]:
    """``(facts found, what is missing)`` from a ``VllmConfig`` (see :meth:`ExchangeSpec.from_vllm_config`)."""
    mc = getattr(vllm_config, "model_config", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    facts: dict[str, Any] = {}
    missing: list[str] = []
    hidden, layers, dtype = getattr(hf, "hidden_size", None), getattr(hf, "num_hidden_layers", None), \
        getattr(mc, "dtype", None)
    if isinstance(hidden, int) and hidden >= 1:
        facts["hidden_size"] = hidden
    else:
        missing.append("vllm_config.model_config.hf_text_config.hidden_size (an int >= 1)")
    if isinstance(layers, int) and layers >= 1:
        facts["num_layers"] = layers
    else:
        missing.append("vllm_config.model_config.hf_text_config.num_hidden_layers (an int >= 1)")
    if isinstance(dtype, torch.dtype):
        facts["dtype"] = dtype
    else:
        missing.append("vllm_config.model_config.dtype (a torch.dtype)")
    if gate:
        width = _router_width(hf)
        if width is None:
            missing.append("the router width: hf config n_routed_experts / num_experts / num_local_experts")
        else:
            facts["router_logits_width"] = width
        if isinstance(dtype, torch.dtype):
            facts["router_logits_dtype"] = router_logits_dtype(mc, dtype)
        if num_exchange_layers is not None:
            facts["num_layers"] = num_exchange_layers
        elif "num_layers" in facts:
            moe = moe_layer_indices(hf, layers)
            if moe is None:
                missing.append("the number of MoE layers (the model config follows no known convention): give "
                               "it (num_exchange_layers / num_layers) on both roles")
            elif not moe:
                missing.append("MoE layers: compute_gate_on_attention is set but the model config has none")
            if moe:
                facts["num_layers"] = len(moe)
            else:
                del facts["num_layers"]
    if role == "attention":
        pc = getattr(vllm_config, "parallel_config", None)
        workers = 1
        for name in ("prefill_context_parallel_size", "tensor_parallel_size"):
            v = getattr(pc, name, 1) or 1
            workers *= int(v) if isinstance(v, int) and not isinstance(v, bool) else 1
        facts["tp_size"] = workers
    return facts, missing
