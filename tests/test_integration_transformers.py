"""The transformers integration, in one process, with fake connectors.

The split model (attention role with RemoteMLP proxies + FFN role serving the
MLPs) must compute what the whole model computes, for several transformers
MoE classes, with the gate on either side, with stages, with padding rows,
and through the FFN serving loop (queues stand in for the transport).
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

pytest.importorskip("transformers")

from afd_ext.tools import demo  # noqa: E402
from afd_ext.errors import AFDConfigError, AFDStateError  # noqa: E402
from afd_ext.integrations import transformers as integ  # noqa: E402
from afd_ext.metadata import (  # noqa: E402
    AFDA2FTransferPayload,
    AFDTransferContext,
    AFDTransferMetadata,
    StepCountAgreement,
)

SEED = 7


def _tiny(model_type: str = "qwen3_moe", **over):
    cfg = demo.load_model_config("tiny")
    if model_type == "mixtral":
        cfg = {
            "model_type": "mixtral", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 16,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            "tie_word_embeddings": False, "pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258,
        }
    elif model_type == "qwen2_moe":
        cfg = {
            "model_type": "qwen2_moe", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 8, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 256,
            "use_sliding_window": False, "tie_word_embeddings": False, "pad_token_id": 256,
            "bos_token_id": 257, "eos_token_id": 258,
        }
    cfg.update(over)
    return cfg


class LoopbackConnector:
    """Attention-side fake: ``send_attn_output`` runs the FFN role at once, ``recv_ffn_output`` returns it."""

    def __init__(self, server: integ.FFNServer):
        self.server = server
        self.control_plane = self
        self.pending: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[int, int, int, bool]] = []
        self.payloads = []

    def update_state_from_dp_metadata(self, payload):
        self.payloads.append(payload)

    def send_dp_metadata_list(self, payload):
        pass

    def send_attn_output(self, hidden_states, context, router_logits=None, input_ids=None):
        md = context.metadata
        assert md.validate_tensor_shape(tuple(hidden_states.shape))
        self.calls.append((md.layer_idx, md.stage_idx, hidden_states.shape[0], router_logits is not None))
        assert md.stage_idx not in self.pending, "a stage was sent twice before its reply was received"
        self.pending[md.stage_idx] = self.server.compute(md.layer_idx, hidden_states.clone(), router_logits)

    def recv_ffn_output(self, ref_tensor, ubatch_idx=0):
        y = self.pending.pop(ubatch_idx)
        ref_tensor.copy_(y)
        return ref_tensor


def _split_pair(cfg, *, gate_on_attention=False, num_stages=1):
    whole = demo.build_model(cfg, SEED)
    ffn_model = demo.build_model(cfg, SEED)
    server = integ.FFNServer.from_model(ffn_model, None, gate_on_attention=gate_on_attention)
    conn = LoopbackConnector(server)
    att = demo.construct_model(cfg)
    exchange = integ.split_attention_role(att, conn, gate_on_attention=gate_on_attention, num_stages=num_stages)
    demo.init_weights(att, SEED)
    return whole, att, exchange, conn


def _payload(counts_per_stage):
    return StepCountAgreement(1, 0, lambda o: [o]).agree(counts_per_stage)


@pytest.mark.parametrize(
    "model_type,gate_on_attention,num_stages",
    [
        ("qwen3_moe", False, 1),
        ("qwen3_moe", True, 1),
        ("qwen3_moe", False, 2),
        ("mixtral", False, 1),
        ("mixtral", True, 2),
        ("qwen2_moe", True, 1),
    ],
)
def test_split_model_equals_whole_model(model_type, gate_on_attention, num_stages):
    cfg = _tiny(model_type)
    whole, att, exchange, conn = _split_pair(cfg, gate_on_attention=gate_on_attention, num_stages=num_stages)
    ids = torch.tensor([[257, 72, 101, 108, 108, 111, 33]])
    with torch.no_grad():
        ref = whole(input_ids=ids).logits
        exchange.begin_step(_payload(integ.stage_split(ids.numel(), num_stages)), dp_rank=0)
        got = att(input_ids=ids).logits
        exchange.end_step()
    assert torch.allclose(got, ref, atol=demo.LOGIT_ATOL_FP32, rtol=0), (got - ref).abs().max()
    # Every layer went remote, in layer order, stage-minor, with logits iff the gate is on attention.
    n_layers = cfg["num_hidden_layers"]
    rows = integ.stage_split(ids.numel(), num_stages)
    expected = [(l, s, rows[s], gate_on_attention) for l in range(n_layers) for s in range(num_stages)]
    assert conn.calls == expected
    # The attention side really lost the experts (only the gate may stay).
    for p_name, _ in att.named_parameters():
        assert "experts" not in p_name, p_name


def test_split_is_not_the_identity():
    """A broken FFN side must show: zero the FFN output of one layer and the logits move."""
    cfg = _tiny()
    whole, att, exchange, conn = _split_pair(cfg)
    mlp = conn.server.modules[2]
    with torch.no_grad():
        for p in mlp.parameters():
            p.mul_(1.5)
    ids = torch.tensor([[257, 1, 2, 3, 4]])
    with torch.no_grad():
        exchange.begin_step(_payload([ids.numel()]), dp_rank=0)
        got = att(input_ids=ids).logits
        exchange.end_step()
        ref = whole(input_ids=ids).logits
    assert (got - ref).abs().max() > 100 * demo.LOGIT_ATOL_FP32


def test_padding_rows_are_not_sent():
    cfg = _tiny()
    whole, att, exchange, conn = _split_pair(cfg)
    ids = torch.tensor([[256, 256, 257, 5, 6], [257, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        exchange.begin_step(_payload([8]), dp_rank=0, row_mask=mask.bool())
        got = att(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        exchange.end_step()
        ref0 = whole(input_ids=ids[:1, 2:]).logits[0]
        ref1 = whole(input_ids=ids[1:]).logits[0]
    assert all(c[2] == 8 for c in conn.calls)
    assert torch.allclose(got[0, 2:], ref0, atol=demo.LOGIT_ATOL_FP32)
    assert torch.allclose(got[1], ref1, atol=demo.LOGIT_ATOL_FP32)


def test_rows_must_match_the_payload():
    cfg = _tiny()
    _, att, exchange, _ = _split_pair(cfg)
    ids = torch.tensor([[257, 1, 2]])
    with pytest.raises(AFDStateError, match="outside a step"):
        att(input_ids=ids)
    exchange.begin_step(_payload([2]), dp_rank=0)
    with pytest.raises(AFDConfigError, match="gives this rank 2"):
        att(input_ids=ids)
    with pytest.raises(AFDConfigError, match="num_stages"):
        exchange.begin_step(_payload([1, 2]), dp_rank=0)


def test_stage_split():
    assert integ.stage_split(5, 2) == [3, 2]
    assert integ.stage_split(1, 2) == [1, 0]
    assert integ.stage_split(0, 3) == [0, 0, 0]
    assert sum(integ.stage_split(17, 4)) == 17
    with pytest.raises(AFDConfigError):
        integ.stage_split(3, 0)


def test_describe_layers_and_remote_layers():
    cfg = _tiny(mlp_only_layers=[1])  # layer 1 dense
    m = demo.construct_model(cfg)
    infos = integ.describe_layers(m)
    assert [li.is_moe for li in infos] == [True, False, True, True]
    assert infos[0].num_experts == 8 and infos[0].hidden_size == 32
    assert integ.remote_layer_indices(m) == [0, 1, 2, 3]
    assert integ.remote_layer_indices(m, gate_on_attention=True) == [0, 2, 3]


def test_dense_layer_stays_local_with_gate_on_attention():
    cfg = _tiny(mlp_only_layers=[1])
    whole, att, exchange, conn = _split_pair(cfg, gate_on_attention=True)
    ids = torch.tensor([[257, 3, 4, 5]])
    with torch.no_grad():
        exchange.begin_step(_payload([4]), dp_rank=0)
        got = att(input_ids=ids).logits
        exchange.end_step()
        ref = whole(input_ids=ids).logits
    assert [c[0] for c in conn.calls] == [0, 2, 3]
    assert torch.allclose(got, ref, atol=demo.LOGIT_ATOL_FP32)


def test_shutdown_payload_roundtrips_the_codec():
    from afd_ext.control.codec import decode_control_payload, encode_control_payload

    p = decode_control_payload(encode_control_payload(integ.make_shutdown_payload()))
    assert integ.is_shutdown_payload(p)
    assert not integ.is_shutdown_payload(_payload([0]))


class _Queues:
    def __init__(self):
        self.ctrl = queue.Queue()
        self.a2f = queue.Queue()
        self.f2a = queue.Queue()


class QueueAttentionConnector:
    """1A1F attention side over in-process queues."""

    def __init__(self, q: _Queues):
        self.q = q
        self.control_plane = self

    def update_state_from_dp_metadata(self, payload):
        pass

    def send_dp_metadata_list(self, payload):
        self.q.ctrl.put(payload)

    def send_attn_output(self, hidden_states, context, router_logits=None, input_ids=None):
        self.q.a2f.put((context.metadata.layer_idx, context.metadata.stage_idx, hidden_states.clone(),
                        None if router_logits is None else router_logits.clone()))

    def recv_ffn_output(self, ref_tensor, ubatch_idx=0):
        stage, y = self.q.f2a.get(timeout=30)
        assert stage == ubatch_idx
        return y


class QueueFFNConnector:
    def __init__(self, q: _Queues):
        self.q = q
        self.control_plane = self
        self.state = None

    def update_state_from_dp_metadata(self, payload):
        self.state = payload

    def recv_dp_metadata_list(self):
        return self.q.ctrl.get(timeout=30)

    def recv_attn_output(self, ubatch_idx=0, routing_spec=None):
        layer, stage, h, lg = self.q.a2f.get(timeout=30)
        assert stage == ubatch_idx
        assert (lg is not None) == (routing_spec is not None)
        ctx = AFDTransferContext(AFDTransferMetadata.create_ffn_metadata(layer_idx=0, stage_idx=stage,
                                                                         seq_lens=[h.shape[0]]))
        return AFDA2FTransferPayload(h, ctx, router_logits=lg)

    def send_ffn_output(self, ffn_output, context):
        assert context.metadata.validate_tensor_shape(tuple(ffn_output.shape))
        self.q.f2a.put((context.metadata.stage_idx, ffn_output.clone()))


@pytest.mark.parametrize("num_stages,gate_on_attention", [(1, False), (2, True)])
def test_generation_through_the_ffn_serving_loop(num_stages, gate_on_attention):
    """Prefill + greedy decode with a KV cache through FFNServer.serve, checked against the whole model."""
    cfg = _tiny()
    q = _Queues()
    ffn_model = demo.build_model(cfg, SEED)
    server = integ.FFNServer.from_model(ffn_model, QueueFFNConnector(q), gate_on_attention=gate_on_attention)
    served = {}
    t = threading.Thread(target=lambda: served.setdefault("steps", server.serve()), daemon=True)
    t.start()
    att = demo.construct_model(cfg)
    exchange = integ.split_attention_role(att, QueueAttentionConnector(q), num_stages=num_stages,
                                          gate_on_attention=gate_on_attention)
    demo.init_weights(att, SEED)
    reqs = demo.make_requests(1, 3, 6, prompts=["Hello", "The quick brown fox", "pi"], max_prompt_len=12)[0]
    res = demo.generate_attention_rank(att, exchange, StepCountAgreement(1, 0, lambda o: [o]).agree, reqs,
                                       rank=0, num_stages=num_stages)
    t.join(timeout=30)
    assert not t.is_alive(), "FFN loop did not stop on the shutdown payload"
    assert served["steps"] == res.steps == 6
    # Step k > 0 carries one row per request still generating (request j generates 6 - 2j tokens).
    expected = [sum(len(r.prompt_ids) for r in reqs)] + [
        sum(1 for r in reqs if r.max_new_tokens > k) for k in range(1, 6)
    ]
    assert [c[0] for c in res.step_counts] == expected == [21, 3, 2, 2, 1, 1]
    whole = demo.build_model(cfg, SEED)
    check = demo.self_check(res.requests, lambda s: demo.reference_logits(whole, s), demo.LOGIT_ATOL_FP32)
    assert check.ok, check.failures
    assert check.positions == sum(len(r.prompt_ids) + r.max_new_tokens - 1 for r in reqs)
    assert [len(r["generated"]) for r in res.requests] == [r.max_new_tokens for r in reqs]


def test_self_check_reports_where():
    cfg = _tiny()
    whole = demo.build_model(cfg, SEED)
    seq = [257, 1, 2, 3]
    lg = demo.reference_logits(whole, seq)
    good = {"rid": "a1r0", "rank": 1, "prompt_ids": seq[:3], "generated": [seq[3], 9], "logits": lg.clone()}
    assert demo.self_check([good], lambda s: demo.reference_logits(whole, s), 1e-4).ok
    bad = dict(good, logits=lg.clone())
    bad["logits"][2, 5] += 0.01
    ck = demo.self_check([bad], lambda s: demo.reference_logits(whole, s), 1e-4)
    assert not ck.ok
    assert "attention rank 1, request a1r0, position 2" in ck.failures[0]
    # A swapped greedy choice with a decisive gap fails even within the tolerance... of a huge tol only
    swapped = dict(good, logits=lg.clone())
    i = int(lg[1].argmax())
    j = int(lg[1].topk(2).indices[1])
    swapped["logits"][1, i], swapped["logits"][1, j] = lg[1, j], lg[1, i]
    gap = float(lg[1, i] - lg[1, j])
    ck2 = demo.self_check([swapped], lambda s: demo.reference_logits(whole, s), gap * 2)
    assert ck2.ok  # within tolerance and the gap is not decisive
    ck3 = demo.self_check([swapped], lambda s: demo.reference_logits(whole, s), 1e-4)
    assert not ck3.ok


def test_gate_on_attention_refuses_an_unsupported_router():
    class WeirdRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):  # uses the hidden states beyond F.linear(x, weight)
            return x @ self.weight.t() + x.mean(-1, keepdim=True)

    with pytest.raises(NotImplementedError, match="WeirdRouter"):
        integ.ReceivedLogitsGate(WeirdRouter())


def test_timing_is_off_by_default_and_records_one_latency_per_exchange_when_on():
    """Default: no latency recorded (nothing added to the hot path); timing=True: one per (layer, stage)."""
    cfg = _tiny()
    _, att, exchange, conn = _split_pair(cfg)
    assert exchange.timing is False
    ids = torch.tensor([[257, 1, 2, 3]])
    with torch.no_grad():
        exchange.begin_step(_payload([ids.numel()]), dp_rank=0)
        att(input_ids=ids)
        exchange.end_step()
    assert exchange.stats.latency_ns == {} and exchange.stats.steps == 1
    assert exchange.stats.bytes_sent > 0
    timed = integ.AttentionExchange(conn, hidden_size=cfg["hidden_size"], num_stages=2, timing=True)
    exchange.proxies, exchange.timing = [], False  # detach the first exchange's proxies
    for p in att.modules():
        if isinstance(p, integ.RemoteMLP):
            p.exchange = timed
            timed.proxies.append(p)
    with torch.no_grad():
        timed.begin_step(_payload(integ.stage_split(ids.numel(), 2)), dp_rank=0)
        att(input_ids=ids)
        timed.end_step()
    lat = timed.stats.latency_ns
    assert sorted(lat) == list(range(cfg["num_hidden_layers"]))
    assert all(len(v) == 2 and all(ns > 0 for ns in v) for v in lat.values()), lat
