"""What a raw link error means: the first line of a torch/gloo error, and the named error of one that reached
the connector (the session's step-failure rule then aborts the step everywhere)."""

from __future__ import annotations

import re
from typing import Any

from ..errors import AFDError, AFDPeerError, AFDTimeoutError

__all__ = ["error_text", "link_error"]


def error_text(exc: BaseException) -> str:
    """The first line of a torch/gloo error, without C++ frames or ``[file.cc:123]``/``[c10d]`` tags."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    line = re.sub(r"^(\[[^\]]*\]\s*)+", "", line)
    # source locations anywhere in the line ("[enforce fail at pair.cc:446]") and gloo's sign-off
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)
    line = re.sub(r"\s*GLHF!?", "", line)
    return line.strip() or type(exc).__name__


def link_error(exc: BaseException, tr: Any, tag: Any, peers: Any = None) -> AFDError | None:
    """The named error for a raw ``torch.distributed`` / gloo error that reached the connector, or None.

    ``tr``: the transport (its ``peers`` and ``kind``), ``tag``: the call's ``MessageTag``, ``peers``: its peer role
    ranks (each may be None).

    Only errors of the links are translated (``torch.distributed``'s ``DistError``
    family, or a message about a closed / reset connection or a timeout): a
    timeout becomes :class:`~afd_ext.errors.AFDTimeoutError`, the rest
    :class:`~afd_ext.errors.AFDPeerError`, naming the op, the peers, the step,
    layer and stage. Anything else (a CUDA error) is not a link error: None.
    """
    text = error_text(exc)
    low = text.lower()
    dist_error = any(c.__name__ == "DistError" for c in type(exc).__mro__)
    timeout = "timed out" in low or "timeout" in low
    if not (dist_error or timeout or any(w in low for w in ("connection", "closed by peer", "reset by peer",
                                                            "broken pipe"))):
        return None
    me = tr.peers.me if tr is not None else "this rank"
    kind = tr.kind if tr is not None else "AFD"
    where = f"{tag.op} at {tag.where()}" if tag is not None else "a transport call"
    try:
        who = ", ".join(tr.peers.peer_label(int(p)) for p in peers) if tr is not None and peers else None
    except (TypeError, ValueError):
        who = None
    with_ = f" with {who}" if who else ""
    cls = AFDTimeoutError if timeout else AFDPeerError
    return cls(f"AFD {where}{with_} on {me} failed in the {kind} transport: {type(exc).__name__}: {text}. "
               "A peer or the rendezvous store (FFN rank 0) went away or stopped answering; check the other "
               "ranks' logs, then close and re-initialise the connector on every rank.",
               op=None if tag is None else tag.op, peer=who, layer=None if tag is None else tag.layer,
               stage=None if tag is None else tag.stage)
