"""The attention side's data path: send this rank's rows, take the replies, drain an abandoned step.

Checks run before anything moves (order from the sequencer, tensors against
the schedule) and a failed check is an error on this rank only
(:meth:`~afd_ext.connector.session.Session.reject`); the caller-facing docstrings are the facade's
(:class:`afd_ext.connector.AFDConnector`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import fp8
from ..errors import AFDConfigError, AFDError, AFDProtocolError, AFDStateError
from ..metadata import AFDTransferContext, AFDTransferMetadata
from ..schedule import stage_buffers
from .session import RoleSide
from .step import Exchange, Step, context_metadata

logger = logging.getLogger(__name__)

__all__ = ["AttentionSide"]


class AttentionSide(RoleSide):
    """``send_attn_output`` / ``recv_ffn_output`` / ``abandon_step`` of one attention rank."""

    def send_attn_output(self, hidden_states: torch.Tensor, context: AFDTransferContext,
                         router_logits: torch.Tensor | None, input_ids: torch.Tensor | None, **parts: Any) -> None:
        op = "send_attn_output"
        c = self.s
        tr = c.check_usable(op)
        st = c.require_step(op)
        stage = None
        try:
            md = context_metadata(context, op)
            stage = md.stage_idx
            layer, stage = st.seq.next_send(stage, op)
            if not isinstance(hidden_states, torch.Tensor):
                raise AFDConfigError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
            if not md.validate_tensor_shape(tuple(hidden_states.shape)):
                raise AFDConfigError(f"hidden_states shape {tuple(hidden_states.shape)!r} does not match AFD metadata "
                                 f"token count {md.total_tokens}.")
            plan = st.schedule.attention_plan(stage, self.role_rank)
            # The one check of the wire tensors: types, rows, dtypes, devices, contiguity.
            wire = st.schedule.check_attention_tensors(stage, self.role_rank, hidden_states, router_logits,
                                                       input_ids, device=tr.device, check_device=tr.check_device,
                                                       hidden_align=tr.fp8_hidden_align, rows=plan.total,
                                                       **parts)
        except (ValueError, AFDStateError) as e:
            raise c.reject(st, e, op, stage=stage) from None
        st.seq.abandoned = False
        self._send_rows(st, layer, stage, wire, md.layer_idx, op, plan)

    def _send_rows(self, st: Step, layer: int, stage: int, wire: list, layer_idx: int, op: str, plan=None) -> None:
        c = self.s
        if plan is None:
            plan = st.schedule.attention_plan(stage, self.role_rank)
        tag = st.tag(op, "a2f", layer, stage, layer_idx)
        try:
            pending = c.data(st).split_back(wire, plan.peers, plan.rows, tag=tag)
        except (AFDError, RuntimeError) as e:
            c.transport_failed(e, tag, plan.peers)
        st.pending[stage].append(Exchange(layer, stage, tag, pending, wire))
        st.seq.sent += 1

    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int) -> torch.Tensor:
        op = "recv_ffn_output"
        c = self.s
        tr = c.check_usable(op)
        st = c.require_step(op)
        try:
            layer, stage = st.seq.next_reply(ubatch_idx, op)
            if not isinstance(ref_tensor, torch.Tensor):
                raise AFDConfigError(f"ref_tensor must be a torch.Tensor, got {type(ref_tensor).__name__}")
            plan = st.schedule.attention_plan(stage, self.role_rank)
            st.schedule.check_attention_reply(stage, self.role_rank, ref_tensor, device=tr.device,
                                              check_device=tr.check_device, rows=plan.total)
        except (ValueError, AFDStateError) as e:
            raise c.reject(st, e, op, stage=ubatch_idx) from None
        self._recv_reply(st, st.pending[stage][0], ref_tensor, op, plan)
        return ref_tensor

    def _recv_reply(self, st: Step, ex: Exchange, ref_tensor: torch.Tensor, op: str, plan=None) -> None:
        c = self.s
        if plan is None:
            plan = st.schedule.attention_plan(ex.stage, self.role_rank)
        tag = st.tag(op, "f2a", ex.layer, ex.stage, ex.tag.layer_idx)
        try:
            c.data(st).fan_in([ref_tensor], plan.peers, plan.rows, tag=tag)
            # The reply came back, so our sends of this exchange were received: safe to release.
            ex.pending.wait()
        except (AFDError, RuntimeError) as e:
            c.transport_failed(e, tag, plan.peers)
        st.pending[ex.stage].popleft()
        st.seq.received += 1

    def abandon_step(self) -> None:
        c = self.s
        st = c.step
        if st is None or st.seq.complete:
            return
        if st.seq.moved:
            raise AFDStateError(
                f"abandon_step on {c.me}: {st.seq.label} already sent data ({st.seq.progress()})")
        self.drain(st)

    def drain(self, st: Step) -> None:
        """Send zeros of the scheduled shapes for every remaining exchange and discard the replies."""
        c = self.s
        c.check_usable("draining an abandoned step")
        logger.warning("%s: draining abandoned %s (%d exchanges carry zeros)", c.me, st.seq.label,
                       st.seq.total)
        zeros = {s: list(self._zeros(st, s).values()) for s in st.schedule.stages}
        op = "abandon_step (drain)"
        while st.seq.sent < st.seq.total:
            layer, stage = st.seq.seq[st.seq.sent]
            wire = zeros[stage]
            self._send_rows(st, layer, stage, wire, -1, op)
            self._recv_reply(st, st.pending[stage][0], torch.empty_like(wire[0]), op)
        st.seq.abandoned = False

    def _zeros(self, st: Step, stage: int) -> dict[str, torch.Tensor | None]:
        """Zeros in this rank's wire layout of ``stage`` (:func:`~afd_ext.schedule.stage_buffers`)."""
        return stage_buffers(lambda key, shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device),
                             st.schedule.config, stage, st.schedule.attention_rows(stage, self.role_rank))

    def warmup(self, st: Step, op: str, synchronize: Callable[[], None]) -> None:
        """One warm-up round: send a known pattern per stage, check the echo (see ``AFDConnector.warmup``)."""
        c = self.s
        cfg = st.schedule.config
        hs = cfg.hidden_size
        sent: dict[int, Any] = {}
        for s in st.schedule.stages:
            n = st.schedule.attention_rows(s, self.role_rank)
            h = (torch.arange(n * hs, device=self.device) % 7 + 1 + self.role_rank).float().to(cfg.hidden_dtype)
            h = h.reshape(n, hs)
            z = self._zeros(st, s)
            rest = {p.arg: z[p.name] for p in cfg.caller_parts[1:]}
            ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(layer_idx=0, stage_idx=s,
                                                                                   seq_len=n))
            self.send_attn_output(h, ctx, rest.pop("router_logits", None), rest.pop("input_ids", None), **rest)
            sent[s] = h
        outs = {s: self.recv_ffn_output(torch.empty_like(sent[s]), s) for s in st.schedule.stages}
        synchronize()  # bounded: a dead peer is a named error, not a hang
        for s, out in outs.items():
            if cfg.hidden_wire is not None:  # the echo of FP8 on the wire: the rule's round trip, exactly
                sent[s] = fp8.dequantize(*fp8.quantize(sent[s].cpu(), ue8m0=cfg.fp8_scale_format == "ue8m0")).to(out.device)
            if not torch.equal(out, sent[s]):
                raise AFDProtocolError(f"{op} on {c.me}: stage {s} echo differs from what was sent",
                                       op=op, stage=s)
