"""Transports: move consecutive row ranges of wire tensors between attention and FFN ranks.

* ``"nccl"``: :class:`~afd_ext.transport.nccl.NcclTransport` - CUDA tensors, the
  compiled core's NCCL ops, one communicator per edge and direction.
* ``"gloo"``: :class:`~afd_ext.transport.gloo.GlooTransport` - CPU tensors over
  ``torch.distributed`` gloo (the CI path; same connector logic).

The contract lives in :mod:`afd_ext.transport.base`; strict-mode headers in
:mod:`afd_ext.transport.strict` (a wrapper over any transport). The one
selection point is :func:`create_transport`; a new data plane registers
itself with :func:`register_transport` and the connector needs no change.
Importing this package imports no transport (the NCCL one needs the compiled ops).

Which transport a connector uses is one rule, :func:`select_transport`: an
explicit ``connector_extra_config.transport`` wins; ``"auto"`` (the default)
follows the tensors (``device=``: the first transport in :data:`AUTO_ORDER`
that moves that device type) or else the machine (the first in
:data:`AUTO_ORDER` that can run here: NCCL needs a CUDA build and a visible
GPU, gloo always runs). A data plane that should win where it can run (the
peer-memory plane) registers with ``auto=True`` and answers
:meth:`~afd_ext.transport.base.Transport.unavailable`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, NamedTuple

from .base import (
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
    AFDTransportClosedError,
    AFDTransportError,
    MessageTag,
    PeerMap,
    PendingSend,
    StepProgress,
    Transport,
    TransportSetup,
)

__all__ = [
    "AFDPeerError",
    "AFDProtocolError",
    "AFDTimeoutError",
    "AFDTransportClosedError",
    "AFDTransportError",
    "MessageTag",
    "PeerMap",
    "PendingSend",
    "StepProgress",
    "Transport",
    "TransportSetup",
    "TRANSPORT_KINDS",
    "AUTO_ORDER",
    "TransportChoice",
    "create_transport",
    "register_transport",
    "select_transport",
    "transport_availability",
    "transport_class",
]

logger = logging.getLogger(__name__)

# name -> "module:Class", imported on first use.
_REGISTRY: dict[str, str] = {
    "nccl": "afd_ext.transport.nccl:NcclTransport",
    "gloo": "afd_ext.transport.gloo:GlooTransport",
}

#: Transport names accepted by the connector's ``transport`` setting (built-in ones).
TRANSPORT_KINDS = tuple(_REGISTRY)

#: The transports ``transport: "auto"`` considers, best first.
AUTO_ORDER: list[str] = ["nccl", "gloo"]


def register_transport(name: str, target: str | type[Transport], *, auto: bool = False) -> None:
    """Make ``name`` a transport the connector can be configured with.

    Args:
        name: the ``connector_extra_config.transport`` value.
        target: a :class:`~afd_ext.transport.base.Transport` subclass, or
            ``"module:Class"`` imported on first use.
        auto: ``transport: "auto"`` tries it first (before NCCL) wherever its
            :meth:`~afd_ext.transport.base.Transport.unavailable` says it can run.
    """
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _REGISTRY[name] = target
    if auto and name not in AUTO_ORDER:
        AUTO_ORDER.insert(0, name)


class TransportChoice(NamedTuple):
    """What :func:`select_transport` decided: the transport's name and why, in words."""

    name: str
    why: str


def transport_availability() -> dict[str, str | None]:
    """Every transport ``"auto"`` considers, in order: ``name -> None`` (runs here) or why it cannot."""
    return {name: transport_class(name).unavailable() for name in AUTO_ORDER}


_logged: set[TransportChoice] = set()


def select_transport(requested: str = "auto", device: Any = None) -> TransportChoice:
    """The one rule that decides a connector's transport (logged once per process and decision).

    Args:
        requested: ``connector_extra_config.transport``: a registered name, or ``"auto"``.
        device: the device the caller's tensors live on (the connector's
            ``device=``), or None.

    Returns:
        :class:`TransportChoice`: an explicit name as given; for ``"auto"``,
        with ``device``, the first transport of :data:`AUTO_ORDER` that moves
        tensors of that device type (CPU tensors: gloo); without, the first
        that can run on this machine (a CUDA build and a visible GPU: NCCL;
        else gloo).

    Raises:
        AFDConfigError: an unknown name, or no transport moves ``device``'s tensors.
    """
    from ..errors import AFDConfigError

    if requested != "auto":
        transport_class(requested)  # an unknown name fails here, naming the known ones
        choice = TransportChoice(requested, "configured")
    elif device is not None:
        import torch

        dtype = torch.device(device).type
        name = next((n for n in AUTO_ORDER if transport_class(n).device_type == dtype), None)
        if name is None:
            raise AFDConfigError(f"no AFD transport moves {dtype.upper()} tensors (device={device}); "
                                 f"transports: {', '.join(AUTO_ORDER)}")
        choice = TransportChoice(name, f"auto: the tensors are on {dtype}")
    else:
        why_not = []
        for n in AUTO_ORDER:
            reason = transport_class(n).unavailable()
            if reason is None:
                choice = TransportChoice(n, "auto: " + ("; ".join(why_not) if why_not else f"{n} can run here"))
                break
            why_not.append(f"not {n}: {reason}")
        else:  # gloo always runs; only a registry without it gets here
            raise AFDConfigError("no AFD transport can run here: " + "; ".join(why_not))
    if choice not in _logged:
        _logged.add(choice)
        logger.info("afd_ext: transport %s (%s)", choice.name, choice.why)
    return choice


def transport_class(name: str) -> type[Transport]:
    """The transport class registered as ``name``.

    Raises:
        AFDConfigError: no transport has that name.
    """
    from ..errors import AFDConfigError

    try:
        target = _REGISTRY[name]
    except KeyError:
        raise AFDConfigError(f"unknown AFD transport {name!r}; known: {sorted(_REGISTRY)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_transport(name: str, setup: TransportSetup, *, strict: bool = False) -> tuple[Transport, Transport]:
    """Build transport ``name`` (collective) and its strict-mode view.

    Returns:
        ``(plain, checked)``: the transport, and the transport the connector
        uses for steps that may carry headers (a
        :class:`~afd_ext.transport.strict.StrictTransport` over ``plain`` when
        ``strict``, else ``plain`` itself).

    Raises:
        AFDConfigError: unknown name. Whatever the transport's ``from_setup`` raises.
    """
    plain = transport_class(name).from_setup(setup)
    if not strict:
        return plain, plain
    from .strict import StrictTransport

    return plain, StrictTransport(plain)
