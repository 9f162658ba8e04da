"""The wire, stated once: every tensor that travels between an attention rank and its FFN ranks.

Each tensor is a *part*, declared here with :func:`declare_part`: its name, its
dtype rule, its row width, its direction, when it is present and its encoding. Declaration
order is wire order. Everything else reads :func:`layout`: the schedule's input
checks, the buffers (:func:`afd_ext.schedule.stage_buffers`), the handshake
(:func:`handshake_field`), the strict headers and the peer plane's regions. The
transports and the ops move a list of tensors in that order and never name a
part. A part's rules take the connector's :class:`~afd_ext.schedule.ScheduleConfig`.

FP8 hidden states (docs/fp8.md) are two parts, values and scales, that stand
for one caller tensor: the attention caller passes bf16 hidden states (the
caller layout, ``layout(cfg, caller=True)``) and the transport's send
quantizes its first tensor into the first two parts.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import torch

from .errors import AFDConfigError
from .fp8 import GROUP
from .spec import TOKEN_IDS_DTYPE, WIRE_DTYPES, dtype_name

__all__ = ["Part", "WirePart", "declare_part", "remove_part", "layout", "declared_args", "handshake_field"]

#: A rule: a value, or a callable of the connector's ScheduleConfig giving it.
Rule = Union[Any, Callable[[Any], Any]]


class Part(NamedTuple):
    """A declared part (see :func:`declare_part`)."""

    name: str
    direction: str
    dtype: Rule
    cols: Rule
    present: Rule
    arg: str | None
    encoding: Rule = None


class WirePart(NamedTuple):
    """A part under one config: its name, columns per row (``()``: one value per row), dtype, connector
    argument, encoding (None: plain values of the dtype)."""

    name: str
    cols: tuple[int, ...]
    dtype: torch.dtype
    arg: str | None = None
    encoding: str | None = None


_PARTS: list[Part] = []


def declare_part(name: str, *, dtype: Rule, cols: Rule = (), present: Rule = True, direction: str = "a2f",
                 arg: str | None = "", encoding: Rule = None) -> Part:
    """Declare a part of the wire; it travels after every part declared before it.

    Args:
        name: the part's name (buffer key, ``AFDA2FTransferPayload.parts`` key, header names), unique.
        dtype: a ``torch.dtype`` (one of :data:`afd_ext.spec.WIRE_DTYPES`) or ``cfg -> dtype``.
        cols: columns per row, e.g. ``(k,)`` for ``[rows, k]``; ``()`` for ``[rows]``; or ``cfg -> cols``.
        present: whether it travels, a bool or ``cfg -> bool``.
        direction: ``"a2f"`` (attention -> FFN) or ``"f2a"`` (the reply).
        arg: the keyword of ``send_attn_output`` that carries it (default ``name``); None for a part
            the transport makes itself (FP8 scales).
        encoding: what the dtype's values mean beyond their type, a string or ``cfg -> str``, compared at
            the handshake like the dtype (FP8 scales: ``"fp32"`` or ``"ue8m0"``, docs/fp8.md); None: plain.

    Declare parts before building connectors (a connector reads the layout once); both roles
    must declare the same parts, which the init handshake checks (:func:`handshake_field`).

    Raises:
        AFDConfigError: a name already declared or not a non-empty string, a bad direction, ``arg`` not a
            string or None, or a fixed dtype, cols, present or encoding of the wrong kind (a rule's value
            is checked the same way when :func:`layout` applies it).
    """
    if not isinstance(name, str) or not name:
        raise AFDConfigError(f"a wire part's name must be a non-empty string, got {name!r}")
    if direction not in ("a2f", "f2a"):
        raise AFDConfigError(f"wire part {name!r}: direction must be 'a2f' or 'f2a', got {direction!r}")
    if any(p.name == name for p in _PARTS):
        raise AFDConfigError(f"wire part {name!r} is already declared")
    if not (arg is None or isinstance(arg, str)):
        raise AFDConfigError(f"wire part {name!r}: arg must be a keyword name or None, got {arg!r}")
    _checked(name, *(None if callable(r) else r for r in (cols, dtype, present, encoding)))
    part = Part(name, direction, dtype, cols, present, name if arg == "" else arg, encoding)
    _PARTS.append(part)
    return part


def remove_part(name: str) -> None:
    """Forget a declared part (connectors built since keep their layout).

    Raises:
        AFDConfigError: no part of that name.
    """
    for i, p in enumerate(_PARTS):
        if p.name == name:
            del _PARTS[i]
            return
    raise AFDConfigError(f"no wire part {name!r} is declared")


def _rule(r: Rule, cfg: Any) -> Any:
    return r(cfg) if callable(r) else r


def _checked(name: str, cols: Any = None, dtype: Any = None, present: Any = None, encoding: Any = None) -> Any:
    """Refuse a part's value of the wrong kind (None: not given); returns ``present``."""
    bad = ("cols", cols) if cols is not None and not (
        isinstance(cols, tuple) and all(type(c) is int and c >= 1 for c in cols)) else \
        ("dtype", dtype) if dtype is not None and dtype not in WIRE_DTYPES else \
        ("present", present) if present is not None and not isinstance(present, bool) else \
        ("encoding", encoding) if encoding is not None and not isinstance(encoding, str) else None
    if bad:
        raise AFDConfigError(f"wire part {name!r}: {bad[0]} {bad[1]!r} is not a tuple of positive ints (cols), one "
                             f"of {[dtype_name(d) for d in WIRE_DTYPES]} (dtype), a bool (present) or a string "
                             "(encoding), as its field needs")
    return present


def layout(cfg: Any, direction: str = "a2f", *, caller: bool = False) -> tuple[WirePart, ...]:
    """The parts of ``direction`` present under ``cfg``, in wire order.

    ``caller``: as the attention caller passes them (FP8 not applied: hidden states in the
    hidden dtype, no scales).

    Raises:
        AFDConfigError: a rule's value of the wrong kind (as :func:`declare_part`), or two present parts
            carried by one connector argument.
    """
    if caller and cfg.hidden_wire is not None:
        cfg = cfg.without_fp8
    out = tuple(WirePart(p.name, _rule(p.cols, cfg), _rule(p.dtype, cfg), p.arg, _rule(p.encoding, cfg))
                for p in _PARTS if p.direction == direction and _checked(p.name, present=_rule(p.present, cfg)))
    for i, p in enumerate(out):
        _checked(p.name, p.cols, p.dtype, None, p.encoding)
        if p.arg and any(q.arg == p.arg for q in out[:i]):
            raise AFDConfigError(f"wire parts {[q.name for q in out if q.arg == p.arg]} are all carried by the "
                                 f"connector argument {p.arg!r} under this config: give each its own")
    return out


def declared_args(direction: str = "a2f") -> tuple[str, ...]:
    """The connector arguments of every declared part of ``direction``, in wire order, once each."""
    return tuple(dict.fromkeys(p.arg for p in _PARTS if p.direction == direction and p.arg))


def handshake_field(cfg: Any) -> list[list[Any]]:
    """Both directions' layouts as ``[[direction, name, cols, dtype name(, encoding)], ...]``: both roles must agree."""
    return [[d, p.name, list(p.cols), dtype_name(p.dtype)] + ([p.encoding] if p.encoding else [])
            for d in ("a2f", "f2a") for p in layout(cfg, d)]


def _fp8(cfg: Any) -> bool:
    return cfg.hidden_wire is not None


# The parts afd_ext carries, in wire order.
declare_part("hidden", dtype=lambda c: c.hidden_dtype, cols=lambda c: (c.hidden_size,),
             present=lambda c: not _fp8(c), arg="hidden_states")
declare_part("hidden_fp8", dtype=torch.float8_e4m3fn, cols=lambda c: (c.hidden_size,), present=_fp8,
             arg="hidden_states")
declare_part("hidden_scales", dtype=torch.float32, cols=lambda c: (c.hidden_size // GROUP,), present=_fp8, arg=None,
             encoding=lambda c: c.fp8_scale_format)
declare_part("router_logits", dtype=lambda c: c.router_logits_dtype, cols=lambda c: (c.router_logits_width,),
             present=lambda c: c.router_logits_width is not None)
declare_part("token_ids", dtype=TOKEN_IDS_DTYPE, present=lambda c: c.send_token_ids, arg="input_ids")
declare_part("output", direction="f2a", dtype=lambda c: c.hidden_dtype, cols=lambda c: (c.hidden_size,),
             arg="ffn_output")
