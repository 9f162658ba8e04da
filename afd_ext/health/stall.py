"""Which peer is stuck, for transports whose multi-peer groups complete as a whole (NCCL).

A fan-in over several peers is one NCCL group: its event cannot say whose rows
are missing. So every rank publishes its step progress to the rendezvous store
(``progress/<world rank>``), but only once it has been waiting on an operation
or idle mid-step in its caller for ``publish_after_s`` (nothing on the healthy
path), and the rank whose operation expires reads its peers' reports: a peer
that reported the matching call is cleared, one idle in its caller is named as
stalled, one that reported nothing is named as probably dead.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ..topology import step_words

logger = logging.getLogger(__name__)

__all__ = ["StallReports"]


class StallReports:
    """Publishes this rank's progress and reads the peers' (the watchdog's ``on_tick`` and ``blame``).

    Args:
        store: the generation's store (``set`` / ``check`` / ``get``).
        peers: this rank's :class:`~afd_ext.transport.base.PeerMap`.
        progress: callable returning this rank's :class:`~afd_ext.transport.base.StepProgress` or None.
        publish_after_s: waiting or idling longer than this publishes a report, seconds.
    """

    def __init__(self, store: Any, peers: Any, progress: Callable[[], Any],
                 publish_after_s: float):
        self.store = store
        self.peers = peers
        self.progress = progress
        self.publish_after_s = float(publish_after_s)
        self._published: tuple | None = None

    def tick(self, now: float, oldest: Any) -> None:
        """Watchdog thread: publish this rank's progress once it waits or idles mid-step for long.

        Publishes only when an operation is in flight for more than
        ``publish_after_s``, or the step is incomplete with nothing in flight and
        no connector call for that long (its caller is stalled), and only when
        the report changed.
        """
        p = self.progress()
        if p is None or self.store is None:
            return
        thr = self.publish_after_s
        if oldest is not None and now - oldest.started > thr:
            state, detail = "waiting", f"waiting {now - oldest.started:.1f} s on {oldest.describe()}"
            key = (p.step, p.sent, p.received, "waiting", id(oldest))
        elif oldest is None and not p.complete and p.idle_s > thr:
            state = "idle"
            detail = (f"idle in its caller mid-step for {p.idle_s:.1f} s (no connector call; "
                      f"{p.text}): the process is alive but stalled outside the connector")
            key = (p.step, p.sent, p.received, "idle")
        else:
            return
        if key == self._published:
            return
        self._published = key  # once per report, even if the store is gone (no retry storm)
        rec = {"step": p.step, "user_step": p.user_step, "sent": p.sent, "received": p.received, "total": p.total,
               "state": state, "detail": detail, "time": time.time()}
        try:
            self.store.set(f"progress/{self.peers.world_rank}", json.dumps(rec))
        except Exception as e:  # noqa: BLE001 - diagnostics only; the store may be gone with FFN rank 0
            logger.warning("%s: could not publish step progress: %s", self.peers.me, e)

    def forget(self) -> None:
        """Publish again even when the next report equals the last one (the store was wiped)."""
        self._published = None

    def read(self, world_rank: int) -> dict | None:
        """The last progress report of ``world_rank``, or None."""
        key = f"progress/{world_rank}"
        if self.store is None or not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode("utf-8"))

    def blame(self, op: Any) -> tuple[str, list[str]] | None:
        """Watchdog thread, when ``op`` expired: which of its peers did not make the matching call.

        Returns ``(text, culprit labels)`` from the peers' reports, or None when
        ``op`` carries no exchange.
        """
        tag = op.tag
        if tag is None or not op.peer_ranks or tag.layer < 0:
            return None
        p = self.progress()
        need = None
        if p is not None and p.step == tag.step and (tag.layer, tag.stage) in p.seq:
            need = p.seq.index((tag.layer, tag.stage)) + 1
        is_send = op.what.endswith("send (split-back)")
        field, call = ("received", "receive") if is_send else ("sent", "send")
        culprits: list[str] = []
        notes: list[str] = []
        for wr, label in zip(op.peer_ranks, op.peers):
            try:
                rec = self.read(wr)
            except Exception as e:  # noqa: BLE001 - the store may be gone with FFN rank 0
                notes.append(f"{label}: progress unknown ({e})")
                continue
            if rec is None or int(rec.get("step", -1)) < tag.step:
                why = ("it published no progress report (nothing in flight, not idle mid-step: it is "
                       "probably dead)") if rec is None else \
                    f"its last progress report is from {_label(rec)}: {rec.get('detail')}"
                culprits.append(label)
                notes.append(f"waiting on {label}: it has not issued the matching {call} ({why})")
            elif need is not None and int(rec["step"]) == tag.step and int(rec.get(field, 0)) < need:
                culprits.append(label)
                notes.append(f"waiting on {label}: it has not issued the matching {call} ({_label(rec)}: "
                             f"{rec.get(field)} of {rec.get('total')} exchanges {field}; {rec.get('detail')})")
            elif need is None and int(rec["step"]) == tag.step:
                notes.append(f"{label} reports {_label(rec)}: {rec.get(field)} of {rec.get('total')} "
                             f"exchanges {field} ({rec.get('detail')})")
            else:
                notes.append(f"{label} issued the matching {call} ({rec.get('detail')})")
        if not notes:
            return None
        return "; ".join(notes) + ".", culprits


def _label(rec: dict) -> str:
    """How a peer's progress report names its step (:func:`step_words`)."""
    n = int(rec.get("user_step", -1))
    return step_words(n if n >= 0 else int(rec.get("step", -1)))
