"""Transports: move consecutive row ranges of wire tensors between attention and FFN ranks.

* ``"nccl"``: :class:`~afd_ext.transport.nccl.NcclTransport` - CUDA tensors, the
  compiled core's NCCL ops, one communicator per edge and direction.
* ``"gloo"``: :class:`~afd_ext.transport.gloo.GlooTransport` - CPU tensors over
  ``torch.distributed`` gloo (the CI path; same connector logic).
* ``"peer"``: :class:`~afd_ext.transport.peer.PeerTransport` - CUDA tensors written
  straight into the peer's memory over CUDA IPC (one node; the plane and the
  transport live in the :mod:`afd_ext.transport.peer` package; docs/peer-memory.md).

The contract lives in :mod:`afd_ext.transport.base`; strict-mode headers in
:mod:`afd_ext.transport.strict` (a wrapper over any transport). The one
selection point is :func:`create_transport`; a new data plane registers
itself with :func:`register_transport` and the connector needs no change.
Importing this package imports no transport (the NCCL one needs the compiled ops).

Which transport a connector uses is one rule, written here once: an explicit
``connector_extra_config.transport`` wins; ``"auto"`` (the default) walks
:data:`AUTO_ORDER` (NCCL, peer, gloo) and keeps the transports that move the
tensors' device type (``device=``) or, without one, that can run on this
machine (:meth:`~afd_ext.transport.base.Transport.unavailable`).
:func:`select_transport` names the first of them before anything is built (it
fixes the connector's device); :func:`create_transport` then builds them in
that order at init, collectively: a transport whose set-up says, on every
rank together, that it cannot serve this AFD world
(:class:`~afd_ext.errors.TransportUnavailableError`, e.g. peer memory that does
not open) hands over to the next. A data plane registered with ``auto=True``
joins the front of the order.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, NamedTuple

from ..config import TRANSPORTS
from .base import Transport, TransportSetup

__all__ = ["auto_transport", "AUTO_ORDER", "TransportChoice", "create_transport", "register_transport",
           "select_transport", "transport_availability", "transport_class"]

logger = logging.getLogger(__name__)

# name -> "module:Class", imported on first use: the configuration's table, so a registered name is a valid setting.
_REGISTRY: dict[str, str] = TRANSPORTS

#: The transports ``transport: "auto"`` considers, best first. Peer memory stays behind NCCL
#: until a two-GPU timing shows it ahead (issue #35: on one GPU it is only measured against
#: its own minimal kernels; NCCL's 8192-token round trip on 2x H200 is 724.7 us).
AUTO_ORDER: list[str] = ["nccl", "peer", "gloo"]


def register_transport(name: str, target: str | type[Transport], *, auto: bool = False) -> None:
    """Make ``name`` a transport the connector can be configured with (``connector_extra_config.transport``).

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


def _auto_candidates(device_type: str | None) -> tuple[list[str], list[str]]:
    """``transport: "auto"``'s candidates, best first, and why the others were left out.

    ``device_type`` given: the transports of :data:`AUTO_ORDER` that move that
    device type (the caller's tensors decide; a missing GPU surfaces at init);
    None: every one that can run on this machine.
    """
    names, why_not = [], []
    for n in AUTO_ORDER:
        cls = transport_class(n)
        if device_type is not None:
            if cls.device_type == device_type:
                names.append(n)
            continue
        reason = cls.unavailable()
        if reason is None:
            names.append(n)
        else:
            why_not.append(f"not {n}: {reason}")
    return names, why_not


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
    else:
        dtype = None
        if device is not None:
            import torch

            dtype = torch.device(device).type
        names, why_not = _auto_candidates(dtype)
        if not names:
            what = f"moves {dtype.upper()} tensors (device={device})" if dtype else "can run here"
            raise AFDConfigError(f"no AFD transport {what}: " + "; ".join(why_not))
        then = f", else {' then '.join(names[1:])} if it cannot serve this AFD world" if len(names) > 1 else ""
        because = f"the tensors are on {dtype}" if dtype else (
            "; ".join(why_not) if why_not else f"{names[0]} can run here")
        choice = TransportChoice(names[0], f"auto: {because}{then}")
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

    ``name == "auto"`` applies the one selection rule (:func:`auto_transport`).

    Raises:
        AFDConfigError: unknown name. Whatever the transport's ``from_setup`` raises.
    """
    plain = auto_transport(setup) if name == "auto" else transport_class(name).from_setup(setup)
    fp8 = getattr(setup.schedule_config, "hidden_wire", None) is not None
    ue8m0 = fp8 and setup.schedule_config.fp8_scale_format == "ue8m0"
    for t in (plain, getattr(plain, "fallback", None)):
        if t is not None:
            t.fp8, t.fp8_ue8m0 = fp8, ue8m0
    if not strict:
        return plain, plain
    from .strict import StrictTransport

    return plain, StrictTransport(plain)


def auto_transport(setup: TransportSetup) -> Transport:
    """Build ``transport: "auto"``'s first candidate that serves this AFD world (collective).

    The candidates are :func:`select_transport`'s, for ``setup.device``'s type,
    in :data:`AUTO_ORDER`: on CUDA, NCCL, else (its set-up cannot serve this
    world) the peer-memory plane when every rank opens every peer's memory and a
    flag round trip succeeds (decided on every rank together; host names are
    never consulted); on CPU, gloo.

    Raises:
        AFDConfigError: no transport moves tensors of that device type here.
        Whatever the chosen transport's ``from_setup`` raises.
    """
    from ..errors import AFDConfigError, TransportUnavailableError

    names, why_not = _auto_candidates(setup.device.type)
    for name in names:
        try:
            return transport_class(name).from_setup(setup)
        except TransportUnavailableError as e:
            if name == names[-1]:
                raise
            logger.info("%s: transport auto: %s: %s; trying the next", setup.peers.me, name, e)
    raise AFDConfigError(f"no AFD transport moves {setup.device.type.upper()} tensors here: " + "; ".join(why_not))
