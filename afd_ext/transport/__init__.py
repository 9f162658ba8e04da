"""Transports: move consecutive row ranges of wire tensors between attention and FFN ranks.

* :class:`~afd_ext.transport.nccl.NcclTransport` - CUDA tensors, the compiled
  core's NCCL ops, one communicator per edge and direction.
* :class:`~afd_ext.transport.gloo.GlooTransport` - CPU tensors over
  ``torch.distributed`` gloo (the CI path; same connector logic).

The contract and the errors live in :mod:`afd_ext.transport.base`. Importing
this package imports neither transport (the NCCL one needs the compiled ops).
"""

from .base import (
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
    AFDTransportClosedError,
    AFDTransportError,
    MessageTag,
    PeerMap,
    PendingSend,
    Transport,
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
    "Transport",
    "TRANSPORT_KINDS",
]

#: Transport names accepted by the connector's ``transport`` setting.
TRANSPORT_KINDS = ("nccl", "gloo")
