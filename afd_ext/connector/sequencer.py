"""The step machine, pure (no torch, no transport): which (layer, stage) exchange comes next.

A step runs ``num_layers x len(stages)`` exchanges in one order, layer-major
and stage-minor, on every rank. Each role counts two positions:

* attention: ``sent`` (``send_attn_output`` calls) and ``received`` (replies,
  ``recv_ffn_output``); a reply is due only for an exchange already sent.
* FFN: ``received`` (``recv_attn_output`` fan-ins) and ``sent`` (replies,
  ``send_ffn_output``); a reply is due only for an exchange already received.

At most one exchange per stage is in flight on either role: a stage's next
layer is sent (received, on an FFN rank) only after the previous layer's reply
of that stage was received (sent). The transports reuse one buffer per stage
for every layer (the peer-memory plane's slot-reuse rule, docs/peer-memory.md;
an NCCL send of one layer could otherwise wait on a receive queued behind it),
and a model cannot do otherwise: a layer's input is the previous layer's reply.

Every call is checked against the order before anything moves; a violation is
:class:`~afd_ext.errors.AFDConfigError` (wrong stage) or
:class:`~afd_ext.errors.AFDStateError` (nothing due), raised on the calling
rank only: the position does not change, so the corrected call proceeds. What
a new payload does to a step left incomplete (drop it, drain it with zeros, or
abort it on every rank) is decided here too (:meth:`StepSequencer.moved`,
:meth:`StepSequencer.on_new_payload`).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, Sequence

from ..errors import AFDConfigError, AFDStateError
from ..topology import step_words

__all__ = ["StepSequencer", "exchange_order", "stage_arg"]


def stage_arg(value: Any, name: str, what: str = "stage id") -> int:
    """``value`` as a stage id (or another index, ``what``): an int (or anything with ``__index__``) or an
    integral float (``0.0``, as the reference accepts); whether it is the stage due is the sequencer's check.

    Raises:
        AFDConfigError: ``None``, a bool, a string, a non-integral float or any other type, naming ``name``.
    """
    if type(value) is int:  # the hot path
        return value
    # bools (Python's, numpy's bool_/bool, torch's via __index__) are flags, not indices
    if value is not None and not isinstance(value, bool) and type(value).__name__ not in ("bool_", "bool"):
        try:
            return operator.index(value)  # numpy and torch integers
        except TypeError:
            pass
        if isinstance(value, numbers.Real):
            f = float(value)
            if math.isfinite(f) and f.is_integer():
                return int(f)
    got = "None" if value is None else f"{type(value).__name__} {value!r}"[:120]
    raise AFDConfigError(f"{name} must be an int {what} (an integral float such as 0.0 is taken), got {got}")


def exchange_order(num_layers: int, stages: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The step's exchanges, layer-major and stage-minor: ``((0, s0), (0, s1), (1, s0), ...)``."""
    return tuple((layer, s) for layer in range(num_layers) for s in stages)


class StepSequencer:
    """One step's position on one rank.

    Args:
        step: the step ordinal (1, 2, ... per generation, warm-up steps included).
        role: ``"attention"`` or ``"ffn"``.
        seq: the exchange order (:func:`exchange_order`).
        me: this rank's label, for messages.
        user_step: the step as the caller counts it: N for its N-th step,
            0 for the connector's own warm-up (:func:`~afd_ext.topology.step_words`);
            default: ``step``.
    """

    def __init__(self, step: int, role: str, seq: Sequence[tuple[int, int]], me: str = "", user_step: int = -1):
        self.step = step
        self.user_step = step if user_step < 0 else user_step
        #: How messages name this step: "step 3", "warm-up step".
        self.label = step_words(self.user_step)
        self.role = role
        self.seq = tuple(seq)
        #: Exchanges of the step.
        self.total = len(self.seq)
        self.me = me
        self.sent = 0
        self.received = 0
        #: A call of this step was rejected before anything moved (drain with zeros or retry).
        self.abandoned = False
        #: The first line of the last rejected call's error (named when the step is later aborted).
        self.rejected: str | None = None

    # -- position -------------------------------------------------------------------

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s for _, s in self.seq))

    @property
    def complete(self) -> bool:
        """Every exchange of the step is done on this rank (attention: replies in; FFN: replies out)."""
        return (self.received if self.role == "attention" else self.sent) >= self.total

    @property
    def moved(self) -> bool:
        """Data of this step has left or reached this rank (a failure now must abort the step everywhere)."""
        return (self.sent if self.role == "attention" else self.received) > 0

    def progress(self) -> str:
        """The position in words, e.g. ``"3 of 8 exchanges sent, 2 replies received"``."""
        if self.role == "attention":
            return f"{self.sent} of {self.total} exchanges sent, {self.received} replies received"
        return f"{self.received} of {self.total} exchanges received, {self.sent} replies sent"

    def where(self, pos: int) -> str:
        """``"step 3, layer 1, stage 0"`` for position ``pos``."""
        if pos >= self.total:
            return f"{self.label} (all {self.total} exchanges done)"
        layer, stage = self.seq[pos]
        return f"{self.label}, layer {layer}, stage {stage}"

    def _due(self, pos: int, bound: int, stage: int | None, nothing_due: Callable[[], str],
             wrong_stage: Callable[[int, int], str] | None = None) -> tuple[int, int]:
        """The exchange at ``pos`` if ``pos < bound`` and its stage is ``stage`` (None: any), else raise.

        The messages are callables so the hot path builds no strings.

        Raises:
            AFDStateError: ``pos >= bound`` (nothing due), with ``nothing_due()``.
            AFDConfigError: the exchange's stage is not ``stage``, with ``wrong_stage(layer, want)``
                (given whenever ``stage`` is).
        """
        if pos >= bound:
            raise AFDStateError(nothing_due())
        layer, want = self.seq[pos]
        if stage is not None and stage != want:
            raise AFDConfigError(wrong_stage(layer, want))  # type: ignore[misc]
        return layer, want

    # -- attention ------------------------------------------------------------------

    def next_send(self, stage: Any, op: str) -> tuple[int, int]:
        """The ``(layer, stage)`` an attention send for ``stage`` (``context.metadata.stage_idx``) is (not advanced).

        Raises:
            AFDStateError: every exchange was sent, or the reply of this stage's previous exchange
                was not received yet (one exchange per stage in flight).
            AFDConfigError: ``stage`` is not a stage id (:func:`stage_arg`) or not the next exchange's stage.
        """
        if type(stage) is not int:  # the hot path takes an int as it is
            stage = stage_arg(stage, "context.metadata.stage_idx")
        layer, want = self._due(
            self.sent, self.total, stage,
            lambda: (f"{op} on {self.me}: all {self.total} exchanges of {self.label} were already sent; "
                     "apply the next step's payload (update_state_from_dp_metadata) first"),
            lambda layer, want: (
                f"{op} on {self.me} for stage {stage} (context.metadata.stage_idx), but the next exchange of the "
                f"step ({self.label}) is "
                f"layer {layer}, stage {want} (exchanges run layer-major, stage-minor over stages "
                f"{list(self.stages)})"))
        if self.received < self.sent:  # an exchange in flight: is it this stage's?
            self._one_in_flight(self.received, self.sent, layer, want,
                                f"{op} on {self.me} for {self.label}, layer {layer}, stage {want}", "received",
                                f"recv_ffn_output(ubatch_idx={want})")
        return layer, want

    def next_reply(self, stage: Any, op: str) -> tuple[int, int]:
        """The ``(layer, stage)`` whose reply an attention receive for ``stage`` (``ubatch_idx``) takes (not advanced).

        Raises:
            AFDStateError: no sent exchange awaits its reply.
            AFDConfigError: ``stage`` is not a stage id (:func:`stage_arg`) or not the stage of the oldest one.
        """
        if type(stage) is not int:
            stage = stage_arg(stage, "ubatch_idx")
        return self._due(
            self.received, self.sent, stage,
            lambda: (f"{op}(ubatch_idx={stage}) on {self.me}: no exchange of {self.label} is awaiting its reply "
                     f"({self.progress()}); call send_attn_output first"),
            lambda layer, want: (f"{op}(ubatch_idx={stage}) on {self.me}, but the reply due next is {self.label}, "
                                 f"layer {layer}, stage {want} (replies arrive in send order: layer-major, "
                                 "stage-minor)"))

    # -- FFN ------------------------------------------------------------------------

    def next_fan_in(self, stage: Any, op: str) -> tuple[int, int]:
        """The ``(layer, stage)`` an FFN receive for ``stage`` (``ubatch_idx``) is (not advanced).

        Raises:
            AFDStateError: every exchange was received, or the reply of this stage's previous exchange
                was not sent yet (one exchange per stage in flight).
            AFDConfigError: ``stage`` is not a stage id (:func:`stage_arg`) or not the next exchange's stage.
        """
        if type(stage) is not int:
            stage = stage_arg(stage, "ubatch_idx")
        layer, want = self._due(
            self.received, self.total, stage,
            lambda: (f"{op} on {self.me}: all {self.total} exchanges of {self.label} were received; "
                     "receive and apply the next step's payload first"),
            lambda layer, want: (f"{op}(ubatch_idx={stage}) on {self.me}, but the next exchange is "
                                 f"{self.label}, layer {layer}, stage {want} (layer-major, stage-minor over "
                                 f"stages {list(self.stages)})"))
        if self.sent < self.received:
            self._one_in_flight(self.sent, self.received, layer, want,
                                f"{op}(ubatch_idx={want}) on {self.me} for {self.label}, layer {layer}", "sent",
                                "send_ffn_output")
        return layer, want

    def next_reply_send(self, op: str) -> tuple[int, int]:
        """The ``(layer, stage)`` the next FFN reply belongs to (not advanced).

        Raises:
            AFDStateError: no received exchange awaits its reply.
        """
        return self._due(
            self.sent, self.received, None,
            lambda: (f"{op} on {self.me}: no received exchange of {self.label} awaits its reply "
                     f"({self.progress()}); call recv_attn_output first"))

    # -- both -------------------------------------------------------------------------

    def _one_in_flight(self, replied: int, issued: int, layer: int, stage: int, call: str, done: str,
                       first: str) -> None:
        """Raise AFDStateError if an exchange of ``stage`` in ``seq[replied:issued]`` still awaits its reply.

        At most ``len(stages)`` exchanges are in flight, so the scan is that short.
        """
        for pos in range(replied, issued):
            if self.seq[pos][1] == stage:
                raise AFDStateError(
                    f"{call}, but the reply of layer {self.seq[pos][0]}, stage {stage} was not {done} yet: call "
                    f"{first} first. One exchange per stage may be in flight: every layer of a stage reuses "
                    "that stage's buffers (docs/internals.md, \"Per step\")")

    def due(self, op: str) -> tuple[int, int] | None:
        """The ``(layer, stage)`` the next call ``op`` would serve, or None when none is due (for messages).

        ``op``: ``send_attn_output`` / ``recv_ffn_output`` (attention), ``recv_attn_output`` /
        ``send_ffn_output`` (FFN).
        """
        if op in ("send_attn_output", "recv_attn_output"):
            pos, limit = (self.sent, self.total) if op == "send_attn_output" else (self.received, self.total)
        elif op == "recv_ffn_output":
            pos, limit = self.received, self.sent
        elif op == "send_ffn_output":
            pos, limit = self.sent, self.received
        else:
            return None
        return self.seq[pos] if pos < limit else None

    def index(self, layer: int, stage: int) -> int | None:
        """Position of exchange ``(layer, stage)`` in the step, or None."""
        try:
            return self.seq.index((layer, stage))
        except ValueError:
            return None

    def on_new_payload(self) -> str:
        """What a new step's payload does to this (incomplete or complete) step.

        Returns:
            ``"done"`` (complete), ``"drop"`` (nothing moved, not abandoned: the
            step was only replaced), ``"drain"`` (attention: abandoned before
            anything moved; send zeros for the rest so the peers finish it), or
            ``"abort"`` (data moved and the step is incomplete, or an FFN step
            abandoned: the step must be aborted on every rank).
        """
        if self.complete:
            return "done"
        if not self.moved and not (self.abandoned and self.role == "ffn"):
            return "drain" if self.abandoned else "drop"
        return "abort"
