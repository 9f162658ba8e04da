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
"""

from __future__ import annotations

import importlib

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
    "auto_transport",
    "create_transport",
    "register_transport",
    "transport_class",
]

# name -> "module:Class", imported on first use.
_REGISTRY: dict[str, str] = {
    "nccl": "afd_ext.transport.nccl:NcclTransport",
    "gloo": "afd_ext.transport.gloo:GlooTransport",
    "peer": "afd_ext.transport.peer:PeerTransport",
}

#: Transport names accepted by the connector's ``transport`` setting (built-in ones).
TRANSPORT_KINDS = tuple(_REGISTRY) + ("auto",)


def register_transport(name: str, target: str | type[Transport]) -> None:
    """Make ``name`` a transport the connector can be configured with.

    Args:
        name: the ``connector_extra_config.transport`` value.
        target: a :class:`~afd_ext.transport.base.Transport` subclass, or
            ``"module:Class"`` imported on first use.
    """
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _REGISTRY[name] = target


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

    ``name == "auto"`` applies the one selection rule (:func:`auto_transport`).

    Raises:
        AFDConfigError: unknown name. Whatever the transport's ``from_setup`` raises.
    """
    plain = auto_transport(setup) if name == "auto" else transport_class(name).from_setup(setup)
    if not strict:
        return plain, plain
    from .strict import StrictTransport

    return plain, StrictTransport(plain)


def auto_transport(setup: TransportSetup) -> Transport:
    """The ``transport: auto`` rule, the only place it is written.

    * CPU device: ``gloo``.
    * Otherwise ``peer`` when every rank of the AFD world opens every peer's
      memory and a flag round trip succeeds (the peer transport's collective
      set-up decides on every rank together; host names are never consulted);
    * ``nccl`` when it does not (:class:`~afd_ext.errors.PeerMemoryUnavailableError`
      on every rank).

    Raises:
        Whatever the chosen transport's ``from_setup`` raises.
    """
    import logging

    from ..errors import PeerMemoryUnavailableError

    if setup.device.type == "cpu":
        return transport_class("gloo").from_setup(setup)
    try:
        return transport_class("peer").from_setup(setup)
    except PeerMemoryUnavailableError as e:
        logging.getLogger(__name__).info("%s: transport auto: %s; using NCCL", setup.peers.me, e)
    return transport_class("nccl").from_setup(setup)
