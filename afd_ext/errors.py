"""Every exception ``afd_ext`` raises on purpose, defined here under one root.

``except afd_ext.errors.AFDError`` catches anything the package raises on
purpose; the leaves say what kind of failure it was, and they also derive
from the builtin a caller would expect (``TimeoutError``, ``ValueError``,
``ConnectionError``, ``RuntimeError``). What each one means and what to do:
``docs/troubleshooting.md``. Torch-free, so any layer can import it.

Older names (``AFDTransportError``, ``ConnectorStateError``, ``PeerDeadError``
...) stay importable from here and from their old modules as aliases or
subclasses of a leaf, so existing ``except`` clauses keep working.
"""

from __future__ import annotations

from typing import Any, Iterable


class AFDError(RuntimeError):
    """Root of every error ``afd_ext`` raises on purpose.

    A ``RuntimeError`` so that code written against the older classes (all of
    which were) still catches them.

    Attributes (``None`` where not known):
        op: the operation that failed (a connector call, a transport step).
        peer: label of the peer involved, e.g. ``"attention rank 1 (world rank 2)"``.
        layer: the layer exchange ordinal.
        stage: the stage (micro-batch) id.
    """

    def __init__(self, message: str = "", *, op: str | None = None, peer: str | None = None,
                 layer: int | None = None, stage: int | None = None):
        super().__init__(message)
        self.op = op
        self.peer = peer
        self.layer = layer
        self.stage = stage


# ----------------------------------------------------------------- the leaves
class AFDConfigError(AFDError, ValueError):
    """Bad configuration or argument, found before anything moved; the next call still works."""


class AFDTypeError(AFDConfigError, TypeError):
    """An argument of the wrong type or dtype (e.g. ``token_ids`` not int32), found before anything moved."""


class AFDDeviceError(AFDError, RuntimeError):
    """CUDA failed inside an op (the message carries CUDA's error string); the device may be unusable."""


class AFDStateError(AFDError, RuntimeError):
    """The call cannot be served in the connector's state (not initialised, aborted, wrong role, order)."""


class AFDTimeoutError(AFDError, TimeoutError):
    """A deadline passed; the message names the op, the peer, the layer and the stage."""


class AFDPeerError(AFDError, ConnectionError):
    """A peer went away (exited, closed its end, its communicator failed, its host stopped answering)."""


class AFDProtocolError(AFDError):
    """Two ranks disagree (handshake field, message header, row counts, malformed payload)."""


class AFDAbortedError(AFDError, RuntimeError):
    """Some rank aborted the step; close and re-initialise the connector on every rank."""


class AFDClosedError(AFDError, ConnectionError):
    """The transport or channel was closed; re-initialise the connector."""


class AFDGraphError(AFDError, RuntimeError):
    """A CUDA-graph request cannot be served (no captured graph for the key, conflicting flags, buffers)."""


# ------------------------------------------- subclasses that carry extra fields
class RendezvousTimeoutError(AFDTimeoutError):
    """A rendezvous wait passed its deadline.

    Attributes:
        missing: world ranks that had not arrived.
        what: what was awaited (e.g. ``"handshake"``, ``"unique id a2f/0/1"``).
    """

    def __init__(self, message: str, *, missing: Iterable[int] = (), what: str = ""):
        super().__init__(message, op=what or None)
        self.missing = tuple(missing)
        self.what = what


class HandshakeMismatchError(AFDProtocolError, ValueError):
    """Two ranks disagree on a handshake field.

    Attributes:
        field: the field name; ``local_value``/``peer_value`` the two values;
        ``local_rank``/``peer_rank`` the two world ranks.
    """

    def __init__(self, message: str, *, field: str, local_value: Any, peer_value: Any,
                 local_rank: int, peer_rank: int):
        super().__init__(message, op="handshake")
        self.field = field
        self.local_value = local_value
        self.peer_value = peer_value
        self.local_rank = local_rank
        self.peer_rank = peer_rank


class StepAbortedError(AFDAbortedError):
    """Some rank posted the step-abort signal; this rank stops waiting.

    Attributes:
        reason: the reason the aborting rank gave; ``by``: who aborted (a rank label).
    """

    def __init__(self, reason: str, by: str, *, op: str = ""):
        where = f" while {op}" if op else ""
        # The aborting rank's reason may already say how to recover; say it once.
        again = "" if "init_afd_connector" in reason else (
            " The connector must be closed and re-initialised on every rank (init_afd_connector) before the next step.")
        super().__init__(f"AFD step aborted by {by}{where}: {reason.rstrip().rstrip('.')}.{again}", op=op or None)
        self.reason = reason
        self.by = by


class PeerClosedError(StepAbortedError):
    """A peer closed its connector in order (``close()``, a shutdown) with this rank's step in flight.

    Not a failure of either rank: the peer stopped; this rank's call ends without waiting for its deadline.
    """


class PeerDeadError(AFDPeerError):
    """The peer at the other end of a control channel is gone.

    Attributes:
        peer: label of the peer rank (e.g. ``"attention rank 0 (world rank 1)"``).
        op: the operation that noticed (``"recv_dp_metadata_list"`` ...).
    """

    def __init__(self, peer: str, op: str, detail: str):
        super().__init__(f"{op}: peer {peer} is dead: {detail}", op=op, peer=peer)


class TransportUnavailableError(AFDPeerError):
    """A transport's collective set-up found, on every rank together, that it cannot serve this AFD world.

    ``transport: "auto"`` then builds the next candidate (afd_ext.transport.AUTO_ORDER).
    """


class PeerMemoryUnavailableError(TransportUnavailableError):
    """The peer-memory plane cannot serve this AFD world (a region did not open, a flag round trip failed).

    Every rank raises it together (the verdicts are shared through the
    rendezvous store), so ``transport: auto`` can fall back to NCCL everywhere.

    Attributes:
        reasons: ``{rank label: why}`` for every rank that failed.
    """

    def __init__(self, message: str, *, reasons: dict[str, str] | None = None):
        super().__init__(message, op="peer-memory probe")
        self.reasons = dict(reasons or {})


# ------------------------- older names, kept for callers that catch them
#: Base of the transport errors before the single root existed.
AFDTransportError = AFDError
AFDTransportClosedError = AFDClosedError
ConnectorStateError = AFDStateError


class RendezvousError(AFDError, RuntimeError):
    """The rendezvous could not be set up (address not local, store unreachable...)."""


class StoreUnavailableError(RendezvousError, AFDPeerError):
    """The rendezvous store stopped answering: FFN rank 0, which hosts it, exited or is unreachable."""


class StoreTimeoutError(RendezvousTimeoutError, StoreUnavailableError):
    """The rendezvous store did not answer a round trip in time: FFN rank 0 is stopped, frozen or unreachable."""


class JobMismatchError(RendezvousError, AFDConfigError):
    """A rank of another job (another ``job_id``) reached this job's rendezvous store; it is refused.

    Attributes:
        job_id: this rank's job id; ``store_job_id``: the job id the store was opened with.
    """

    def __init__(self, message: str, *, job_id: str, store_job_id: str):
        super().__init__(message, op="rendezvous")
        self.job_id = job_id
        self.store_job_id = store_job_id


class DuplicateRankError(RendezvousError, AFDConfigError):
    """Two live processes claim the same role rank (world rank) on one rendezvous store.

    Attributes:
        world_rank: the contested world rank; ``holder``: the process that holds it (host, pid).
    """

    def __init__(self, message: str, *, world_rank: int, holder: str):
        super().__init__(message, op="rendezvous")
        self.world_rank = world_rank
        self.holder = holder


class ExtensionConflictError(AFDError, ImportError):
    """A second copy of the compiled extension was imported into a process that already holds one."""


class TorchMismatchError(AFDError, ImportError):
    """The compiled core was built against another torch than the one installed; rebuild it.

    Attributes:
        built: ``torch.__version__`` of the build; ``installed``: the one imported now.
    """

    def __init__(self, message: str, *, built: str, installed: str):
        super().__init__(message, op="import afd_ext._C")
        self.built = built
        self.installed = installed


class ControlChannelClosed(AFDClosedError):
    """The peer's end of the control channel was closed in order: the receiver gets it after the sender's
    last payload, a sender once the receiver (the FFN rank) closed. Not a failure of either."""


class ControlRecvTimeout(AFDTimeoutError):
    """A control-channel ``recv`` passed its ``timeout_s`` while the peer was alive (idle)."""


class ControlProtocolError(AFDProtocolError, ValueError):
    """A control message broke the wire format (malformed payload, corrupt ring slot, wrong sender)."""


class GraphKeyMismatchError(AFDGraphError):
    """A replay was asked for a key that has no captured graph (refused, never replayed)."""


class GraphModeError(AFDGraphError):
    """The control payload's flags cannot be acted on (conflicting flags, graphs off, no warm-up)."""


class GraphBufferError(AFDGraphError):
    """A static buffer of a captured graph is missing, misshaped, or moved."""


GraphError = AFDGraphError

#: Errors that report another rank's failure (a peer gone or silent, an abort, a channel closed):
#: launchers report the rank that caused them instead (:func:`afd_ext.tools.testing.run_workers`).
FOLLOW_ON_ERRORS = (AFDPeerError, AFDAbortedError, AFDClosedError, AFDTimeoutError)

__all__ = sorted(n for n, o in list(globals().items())
                 if isinstance(o, type) and issubclass(o, Exception) and not n.startswith("_"))
