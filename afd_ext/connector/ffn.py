"""The FFN side's data path: fan-in every attention peer's rows, split the output back.

The fan-in lands in this rank's per-stage buffers (views returned to the
caller, valid until the next receive of the stage); a reply is sent as row
views of the caller's output, kept alive until the stage's stream is joined
again. Caller-facing docstrings are the facade's (:class:`afd_ext.connector.AFDConnector`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import AFDConfigError, AFDError, AFDStateError
from ..metadata import AFDA2FTransferPayload, AFDExpertRoutingSpec, AFDTransferContext, AFDTransferMetadata
from .session import RoleSide, Session
from .step import AfdExtTransferState, ReplySend, Step, check_routing_spec, context_metadata, flag_arg

__all__ = ["FFNSide"]


class FFNSide(RoleSide):
    """``recv_attn_output`` / ``send_ffn_output`` of one FFN rank, and its replies in flight."""

    def __init__(self, session: Session, role_rank: int, device: torch.device):
        super().__init__(session, role_rank, device)
        self._reply_sends: dict[int, ReplySend] = {}

    def recv_attn_output(self, ubatch_idx: int, routing_spec: AFDExpertRoutingSpec | None,
                         recv_input_ids: bool) -> AFDA2FTransferPayload:
        op = "recv_attn_output"
        c = self.s
        c.check_usable(op)
        st = c.require_step(op)
        cfg = st.schedule.config
        try:
            layer, stage = st.seq.next_fan_in(ubatch_idx, op)
            if routing_spec is not None:
                check_routing_spec(routing_spec, cfg.router_logits_width, cfg.router_logits_dtype)
            if recv_input_ids is not False and flag_arg(recv_input_ids, "recv_input_ids") and not cfg.send_token_ids:
                raise AFDConfigError(f"{op}: recv_input_ids=True but the connector was initialised with "
                                 "send_token_ids=False; enable it on both roles")
        except (ValueError, AFDStateError) as e:
            raise c.reject(st, e, op, stage=ubatch_idx) from None
        sch = st.schedule
        plan = sch.ffn_plan(stage, self.role_rank)
        bufs = st.bufs[stage]
        hidden, kw, scales = bufs.get("hidden"), {}, None
        if cfg.hidden_wire is not None:  # FP8 arrives; "dequant" delivery: bf16 written in the fan-in
            if hidden is not None:
                kw = {"dequant": hidden}
            else:
                hidden, scales = bufs["hidden_fp8"], bufs["hidden_scales"]
        tag = st.tag(op, "a2f", layer, stage, layer)
        # The previous reply of this stage may still be sending from memory the
        # caller computed in place in this buffer (gloo); it completes as soon as
        # the peer posts its receive, which it does without waiting for us.
        self._wait_reply_send(stage, release=False)
        try:
            c.data(st).fan_in(st.wire[stage], plan.peers, plan.rows, tag=tag, **kw)
        except (AFDError, RuntimeError) as e:
            c.transport_failed(e, tag, plan.peers)
        self._reply_sends.pop(stage, None)  # the previous reply's memory is free for the caller again
        st.seq.received += 1
        meta = AFDTransferMetadata.create_ffn_metadata(layer_idx=layer, stage_idx=stage, seq_lens=list(plan.rows))
        ctx = AFDTransferContext(meta, AfdExtTransferState(st.seq.step, layer, stage))
        return AFDA2FTransferPayload(hidden, ctx, bufs.get("router_logits"), bufs.get("token_ids"), scales, bufs)

    def send_ffn_output(self, ffn_output: torch.Tensor, context: AFDTransferContext) -> None:
        op = "send_ffn_output"
        c = self.s
        tr = c.check_usable(op)
        st = c.require_step(op)
        try:
            layer, stage = st.seq.next_reply_send(op)
            md = context_metadata(context, op)
            try:
                state = context.states
            except AttributeError:  # the reference's context may lack it
                state = None
            if isinstance(state, AfdExtTransferState):
                if (state.step, state.layer, state.stage) != (st.seq.step, layer, stage):
                    ctx_step = st.seq.label if state.step == st.seq.step else "an earlier step"
                    raise AFDConfigError(
                        f"{op} on {c.me} with the context of {ctx_step}, layer {state.layer}, "
                        f"stage {state.stage}, but the reply due next is {st.seq.label}, layer {layer}, stage "
                        f"{stage} (replies go in receive order)")
            elif md.stage_idx != stage:
                raise AFDConfigError(f"{op} on {c.me} for stage {md.stage_idx}, but the reply due next is "
                                     f"{st.seq.label}, layer {layer}, stage {stage}")
            if not isinstance(ffn_output, torch.Tensor):
                raise AFDConfigError(f"ffn_output must be a torch.Tensor, got {type(ffn_output).__name__}")
            if not md.validate_tensor_shape(tuple(ffn_output.shape)):
                raise AFDConfigError(f"ffn_output shape {tuple(ffn_output.shape)!r} does not match metadata "
                                 f"(total_tokens {md.total_tokens}).")
            plan = st.schedule.ffn_plan(stage, self.role_rank)
            st.schedule.check_ffn_output(stage, self.role_rank, ffn_output, device=tr.device,
                                         check_device=tr.check_device, rows=plan.total)
        except (ValueError, AFDStateError) as e:
            raise c.reject(st, e, op) from None
        tag = st.tag(op, "f2a", layer, stage, layer)
        try:
            pending = c.data(st).split_back([ffn_output], plan.peers, plan.rows, tag=tag)
        except (AFDError, RuntimeError) as e:
            c.transport_failed(e, tag, plan.peers)
        # Keep ffn_output alive until the stage stream is joined again (next
        # recv_attn_output of this stage, or the end of the step): the caching
        # allocator must not hand its memory to the caller's stream while the
        # stage stream still sends from it.
        self._reply_sends[stage] = ReplySend(pending, ffn_output)
        st.seq.sent += 1
        if st.seq.complete:
            tr.join()

    # -- replies in flight ----------------------------------------------------------

    def settle(self) -> None:
        """Wait (bounded) until every reply in flight was taken by its peers."""
        for s in list(self._reply_sends):
            self._wait_reply_send(s)

    def forget(self) -> None:
        """Drop the replies in flight without waiting (the transport is broken or closing)."""
        for rs in self._reply_sends.values():
            rs.pending.done = True
        self._reply_sends.clear()

    def _wait_reply_send(self, stage: int, *, release: bool = True) -> None:
        rs = self._reply_sends.get(stage)
        if rs is None:
            return
        try:
            rs.pending.wait()
        except BaseException as e:
            self.s.fail_step(e)
            raise
        if release:
            del self._reply_sends[stage]

    def warmup(self, st: Step, op: str, synchronize: Callable[[], None]) -> None:
        """One warm-up round: echo what every stage received (see ``AFDConnector.warmup``)."""
        for s in st.schedule.stages:
            p = self.recv_attn_output(s, None, False)
            h = p.hidden_states
            if p.hidden_scales is not None:  # "fp8" delivery: echo what it stands for
                from .. import ops

                h = torch.empty(h.shape, dtype=st.schedule.config.hidden_dtype, device=h.device)
                ops.fp8_dequantize(p.hidden_states, p.hidden_scales, h)
            self.send_ffn_output(h, p.context)
        self.settle()
        synchronize()
