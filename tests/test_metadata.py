"""Metadata types, the control-payload codecs and StepCountAgreement (CPU, pure)."""

from __future__ import annotations

import json
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_ext import metadata as md
from afd_ext.control import codec
from afd_ext.control.codec import CONTROL_FORMAT_VERSION, decode_control_payload, encode_control_payload
from afd_ext.errors import AFDConfigError, AFDProtocolError, ControlProtocolError
from afd_ext.metadata import (
    AFDA2FTransferPayload,
    AFDControlPayload,
    AFDDPMetadata,
    AFDExpertRoutingSpec,
    AFDF2ATransferPayload,
    AFDTransferContext,
    AFDTransferMetadata,
    StepCountAgreement,
)

# ---------------------------------------------------------------- types


def test_dp_metadata_coerces_to_cpu_int32_and_computes_max():
    m = AFDDPMetadata(num_tokens_across_dp_cpu=[3, 0, 7])
    assert m.num_tokens_across_dp_cpu.dtype == torch.int32
    assert m.num_tokens_across_dp_cpu.device.type == "cpu"
    assert int(m.max_tokens_across_dp_cpu) == 7
    assert m.counts == (3, 0, 7)
    m2 = AFDDPMetadata(torch.tensor([[1, 2]], dtype=torch.int64), max_tokens_across_dp_cpu=9)
    assert m2.counts == (1, 2) and int(m2.max_tokens_across_dp_cpu) == 9


@pytest.mark.parametrize("bad", [[-1, 2], [1.5], [True], torch.tensor([1.0]), "12", [2**31]])
def test_dp_metadata_rejects_bad_counts(bad):
    with pytest.raises(ValueError):
        AFDDPMetadata(num_tokens_across_dp_cpu=bad)


def test_dp_metadata_vllm_helpers():
    m = AFDDPMetadata([5, 2])
    with m.sp_local_sizes(2) as sizes:
        assert sizes == [3, 3, 1, 1]
        assert m.get_chunk_sizes_across_dp_rank() == [3, 3, 1, 1]
    assert m.get_chunk_sizes_across_dp_rank() is None
    assert m.cu_tokens_across_sp(2).tolist() == [3, 6, 7, 8]
    with m.chunked_sizes(1, 3, 1) as sizes:
        assert sizes == [2, 1]  # 5-3=2; 2-3<1 -> 1
    assert m.local_sizes is None


def test_dp_metadata_sp_local_sizes_takes_vllm_033s_keywords():
    # vLLM 0.33's MoE runner: dp_metadata.sp_local_sizes(sp_size, pcp_size=pcp_size, use_ep=use_ep).
    # Hand-computed from vLLM's rule: under EP each PCP rank holds its DP rank's n, else one entry of
    # n * pcp; each entry is split as ceil(entry / sp) over the sp ranks.
    m = AFDDPMetadata([5, 2])
    moe = types.SimpleNamespace(sp_size=2, pcp_size=2, use_ep=True)
    with m.sp_local_sizes(moe.sp_size, pcp_size=moe.pcp_size, use_ep=moe.use_ep) as sizes:
        assert sizes == [3, 3, 3, 3, 1, 1, 1, 1]  # entries 5, 5, 2, 2
        assert m.get_chunk_sizes_across_dp_rank() == sizes
    assert m.local_sizes is None
    with m.sp_local_sizes(2, pcp_size=2, use_ep=False) as sizes:
        assert sizes == [5, 5, 2, 2]  # entries 10, 4
    with m.sp_local_sizes(4, pcp_size=3, use_ep=False) as sizes:
        assert sizes == [4] * 4 + [2] * 4  # entries 15, 6: ceil(15 / 4) = 4, not 3 * ceil(5 / 4) = 6
    with m.sp_local_sizes(2, pcp_size=1, use_ep=True) as sizes:
        assert sizes == [3, 3, 1, 1]  # no PCP: the older call's sizes
    for bad in ({"pcp_size": 0}, {"pcp_size": True}, {"use_ep": 1}):
        with pytest.raises(AFDConfigError):
            with m.sp_local_sizes(2, **bad):
                pass
    assert m.local_sizes is None


def test_control_payload_converts_dpmetadata_like_and_lists():
    class FakeVllmDPMetadata:
        num_tokens_across_dp_cpu = torch.tensor([4, 4])

    p = AFDControlPayload({0: FakeVllmDPMetadata(), 1: [1, 0]})
    assert isinstance(p.dp_metadata_list[0], AFDDPMetadata)
    assert p.stage_counts() == {0: (4, 4), 1: (1, 0)}
    with pytest.raises(ValueError, match="stage ints"):
        AFDControlPayload({-1: [1]})
    with pytest.raises(ValueError, match="is_warmup"):
        AFDControlPayload({0: [1]}, is_warmup=1)


def test_transfer_metadata_allows_zero_rejects_negative_and_empty():
    m = AFDTransferMetadata.create_ffn_metadata(layer_idx=1, stage_idx=0, seq_lens=[0, 3, 0])
    assert m.total_tokens == 3
    assert m.validate_tensor_shape((3, 16))
    assert not m.validate_tensor_shape((4, 16))
    assert not m.validate_tensor_shape(())
    assert AFDTransferMetadata.create_ffn_metadata(layer_idx=0, stage_idx=0, seq_lens=[0, 0]).total_tokens == 0
    a = AFDTransferMetadata.create_attention_metadata(layer_idx=0, stage_idx=1, seq_len=0)
    assert a.seq_lens == [0] and a.validate_tensor_shape((0, 8))
    with pytest.raises(ValueError, match="empty"):
        AFDTransferMetadata(0, 0, [])
    with pytest.raises(ValueError, match=">= 0"):
        AFDTransferMetadata(0, 0, [2, -1])
    with pytest.raises(ValueError, match="int"):
        AFDTransferMetadata(0, 0, [1.0])


def test_payload_types_defaults():
    ctx = AFDTransferContext(AFDTransferMetadata(0, 0, [2]))
    assert ctx.states is None
    h = torch.zeros(2, 4)
    p = AFDA2FTransferPayload(h, ctx)
    assert p.router_logits is None and p.input_ids is None
    assert AFDF2ATransferPayload(h).shared_output is None
    spec = AFDExpertRoutingSpec(8, torch.float32)
    assert spec.router_logits_width == 8 and spec.router_logits_dtype is torch.float32


@pytest.mark.parametrize("dynamic", [False, True])
def test_transfer_context_is_dynamo_traceable(dynamic):
    def f(x):
        md_ = AFDTransferMetadata.create_attention_metadata(layer_idx=0, stage_idx=0, seq_len=x.shape[0])
        ctx = AFDTransferContext(md_)
        assert ctx.metadata.validate_tensor_shape(tuple(x.shape))
        return x * ctx.metadata.total_tokens

    g = torch.compile(f, backend="eager", fullgraph=True, dynamic=dynamic)
    assert g(torch.ones(4)).tolist() == [4.0] * 4
    assert g(torch.ones(3)).tolist() == [3.0] * 3


# ---------------------------------------------------------------- codec

REFERENCE_BYTES = (
    b'{"dp_metadata_list":{"0":{"max_tokens_across_dp_cpu":5,"num_tokens_across_dp_cpu":[3,5]},'
    b'"1":{"max_tokens_across_dp_cpu":4,"num_tokens_across_dp_cpu":[4,1]}},'
    b'"is_graph_capturing":true,"is_warmup":false}'
)


def test_reference_format_decodes():
    p = decode_control_payload(REFERENCE_BYTES)
    assert p.stage_counts() == {0: (3, 5), 1: (4, 1)}
    assert int(p.dp_metadata_list[0].max_tokens_across_dp_cpu) == 5
    assert p.is_graph_capturing and not p.is_warmup and not p.is_graph_replaying and not p.is_profile
    assert p.dp_metadata_list[1].num_tokens_across_dp_cpu.dtype == torch.int32


def test_reference_format_with_newer_flags_and_unknown_keys_decodes():
    doc = json.loads(REFERENCE_BYTES)
    doc.update(is_graph_replaying=True, is_profile=True, extension={"x": 1})
    p = decode_control_payload(json.dumps(doc).encode())
    assert p.is_graph_replaying and p.is_profile


def test_encode_layout_is_reference_keys_plus_version():
    p = AFDControlPayload({1: [4, 1], 0: [3, 5]}, is_graph_capturing=True)
    b = encode_control_payload(p)
    doc = json.loads(b)
    assert doc["format_version"] == CONTROL_FORMAT_VERSION
    assert set(doc) == {"dp_metadata_list", "format_version", "is_graph_capturing", "is_warmup",
                        "is_graph_replaying", "is_profile"}
    # compact and sorted, as the reference
    assert b == json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    ref = json.loads(REFERENCE_BYTES)
    assert doc["dp_metadata_list"] == ref["dp_metadata_list"]


def test_round_trip_zero_counts_and_empty_step():
    p = AFDControlPayload({0: [0, 0, 3], 2: [0, 0, 0]}, is_warmup=True, is_profile=True)
    q = decode_control_payload(encode_control_payload(p))
    assert q.stage_counts() == p.stage_counts()
    assert (q.is_warmup, q.is_profile, q.is_graph_capturing) == (True, True, False)
    e = decode_control_payload(encode_control_payload(AFDControlPayload({})))
    assert e.dp_metadata_list == {}


def _doc(**over):
    doc = json.loads(encode_control_payload(AFDControlPayload({0: [1, 2]})))
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "JSON"),
        (b"\xff\xfe", "UTF-8|JSON"),
        (_doc().decode().encode("utf-16"), "UTF-8"),  # valid JSON, but not UTF-8 (json.loads alone would guess)
        (b"[1, 2]", "JSON object"),
        (b'{"format_version": 2}', "dp_metadata_list"),
        (_doc(format_version=3), "format_version 3"),
        (_doc(format_version="2"), "format_version"),
        (_doc(format_version=True), "format_version"),
        (_doc(is_warmup=1), "is_warmup"),
        (_doc(dp_metadata_list=[1]), "JSON object"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": [-1]}}), ">= 0"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": [1.0]}}), "int"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": [True]}}), "int"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": [2**31]}}), "int32"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": "12"}}), "list"),
        (_doc(dp_metadata_list={"0": {}}), "list"),
        (_doc(dp_metadata_list={"0": [1]}), "JSON object"),
        (_doc(dp_metadata_list={"01": {"num_tokens_across_dp_cpu": [1]}}), "canonical"),
        (_doc(dp_metadata_list={"-1": {"num_tokens_across_dp_cpu": [1]}}), "canonical"),
        (_doc(dp_metadata_list={" 1": {"num_tokens_across_dp_cpu": [1]}}), "canonical"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": [1], "max_tokens_across_dp_cpu": -2}}), ">= 0"),
        (_doc(dp_metadata_list={"0": {"num_tokens_across_dp_cpu": [1], "max_tokens_across_dp_cpu": [1]}}), "int"),
        (b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[NaN]}}}', "must be an int, got float nan"),
        (b"[" * 100000 + b"]" * 100000, "nested|JSON"),
        (b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[' + b"9" * 5000 + b"]}}}", "JSON|int"),
    ],
)
def test_malformed_inputs_raise_value_error(data, match):
    with pytest.raises(ControlProtocolError, match=match):  # a ValueError
        decode_control_payload(data)


@pytest.mark.parametrize("stage, entry, what", [
    ("0", b'{"num_tokens_across_dp_cpu":[1.0],"max_tokens_across_dp_cpu":1}', r"num_tokens_across_dp_cpu\[0\] must be an int"),
    ("3", b'{"num_tokens_across_dp_cpu":[1],"max_tokens_across_dp_cpu":-1}', "max_tokens_across_dp_cpu must be >= 0"),
])
def test_a_bad_count_names_its_stage(stage, entry, what):
    data = b'{"dp_metadata_list":{"' + stage.encode() + b'":' + entry + b"}}"
    with pytest.raises(ControlProtocolError, match=rf"dp_metadata_list\[{stage}\]: {what}"):
        decode_control_payload(data)


def test_limits():
    big = encode_control_payload(AFDControlPayload({0: list(range(100))}))
    with pytest.raises(ValueError, match="max_bytes"):
        decode_control_payload(big, max_bytes=len(big) - 1)
    assert decode_control_payload(big, max_bytes=len(big)).stage_counts()[0] == tuple(range(100))
    with pytest.raises(ValueError, match="max_ranks"):
        decode_control_payload(big, max_ranks=99)
    many = encode_control_payload(AFDControlPayload({s: [1] for s in range(5)}))
    with pytest.raises(ValueError, match="max_stages"):
        decode_control_payload(many, max_stages=4)
    with pytest.raises(ValueError, match="bytes"):
        decode_control_payload("not bytes")  # type: ignore[arg-type]


payloads = st.builds(
    lambda stages, flags: AFDControlPayload(stages, *flags),
    st.dictionaries(
        st.integers(0, 1000),
        st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=16),
        max_size=6,
    ),
    st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
)


@settings(max_examples=200, deadline=None)
@given(payloads)
def test_property_round_trip(p):
    q = decode_control_payload(encode_control_payload(p))
    assert q.stage_counts() == p.stage_counts()
    for s in p.dp_metadata_list:
        assert int(q.dp_metadata_list[s].max_tokens_across_dp_cpu) == int(p.dp_metadata_list[s].max_tokens_across_dp_cpu)
    for f in ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile"):
        assert getattr(q, f) == getattr(p, f)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_property_random_bytes_only_value_error(data):
    try:
        p = decode_control_payload(data)
    except ValueError as e:
        assert isinstance(e, ControlProtocolError), repr(e)  # named: an AFDError, not json's own ValueError
        return
    assert isinstance(p, AFDControlPayload)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**33) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["dp_metadata_list", "format_version", "is_warmup", "is_profile", "x"]),
        json_values | st.dictionaries(st.sampled_from(["0", "1", "x"]), st.dictionaries(
            st.sampled_from(["num_tokens_across_dp_cpu", "max_tokens_across_dp_cpu"]), json_values)),
    )
)
def test_property_structured_garbage_only_value_error(doc):
    try:
        p = decode_control_payload(json.dumps(doc).encode())
    except ValueError as e:
        assert isinstance(e, ControlProtocolError), repr(e)
        return
    # whatever decoded must re-encode and decode to the same thing
    q = decode_control_payload(encode_control_payload(p))
    assert q.stage_counts() == p.stage_counts()


# ---------------------------------------------------------------- lazy tensors, fast paths


def _eager_tensors(counts, mx=None):
    """What the reference builds eagerly: CPU int32 [n] and a CPU int32 0-d maximum."""
    t = torch.as_tensor(list(counts), dtype=torch.int32).reshape(-1)
    m = torch.tensor(max(counts, default=0) if mx is None else mx, dtype=torch.int32)
    return t, m


def _assert_same_tensor(got, want):
    assert isinstance(got, torch.Tensor)
    assert got.dtype == torch.int32 and got.device.type == "cpu"
    assert got.shape == want.shape and torch.equal(got, want)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=12), st.sampled_from(["list", "tuple", "tensor64", "decoded"]))
def test_property_lazy_tensors_equal_eager_ones(counts, source):
    if source == "decoded":
        m = decode_control_payload(encode_control_payload(AFDControlPayload({0: counts}))).dp_metadata_list[0]
    elif source == "tensor64":
        m = AFDDPMetadata(torch.tensor(counts, dtype=torch.int64))
    else:
        m = AFDDPMetadata(counts if source == "list" else tuple(counts))
    t, mx = _eager_tensors(counts)
    assert m.counts == tuple(counts) and all(type(c) is int for c in m.counts)
    _assert_same_tensor(m.num_tokens_across_dp_cpu, t)
    _assert_same_tensor(m.max_tokens_across_dp_cpu, mx)
    assert m.num_tokens_across_dp_cpu.is_contiguous() and m.max_tokens_across_dp_cpu.dim() == 0
    assert m.num_tokens_across_dp_cpu is m.num_tokens_across_dp_cpu  # built once


def test_lazy_tensors_readable_in_compiled_code():
    m = AFDDPMetadata([3, 4])

    def f(x):
        return x * m.num_tokens_across_dp_cpu.sum() + m.max_tokens_across_dp_cpu

    g = torch.compile(f, backend="eager", fullgraph=True)
    assert g(torch.ones(2)).tolist() == [11.0, 11.0]
    assert m.num_tokens_across_dp_cpu.tolist() == [3, 4]  # eager access after: built and cached
    assert g(torch.ones(2)).tolist() == [11.0, 11.0]


def test_lazy_tensors_not_built_by_the_per_step_path():
    p = decode_control_payload(encode_control_payload(AFDControlPayload({0: [3, 0], 1: [1, 2]})))
    assert p.stage_counts() == {0: (3, 0), 1: (1, 2)}
    encode_control_payload(p)
    assert all(m._t is None and m._mt is None for m in p.dp_metadata_list.values())


def test_in_place_modification_of_a_tensor_is_seen_and_checked():
    m = AFDDPMetadata([3, 5])
    before = encode_control_payload(AFDControlPayload({0: m}))
    m.num_tokens_across_dp_cpu[1] = 9  # handed-out tensor: still the source of truth
    assert m.counts == (3, 9)
    m.max_tokens_across_dp_cpu.fill_(9)
    after = json.loads(encode_control_payload(AFDControlPayload({0: m})))
    assert after["dp_metadata_list"]["0"] == {"max_tokens_across_dp_cpu": 9, "num_tokens_across_dp_cpu": [3, 9]}
    assert before != encode_control_payload(AFDControlPayload({0: m}))
    caller = torch.tensor([1, 2], dtype=torch.int32)
    m2 = AFDDPMetadata(caller)
    caller[0] = 7
    assert m2.counts == (7, 2)
    caller[0] = -1
    with pytest.raises(ValueError, match="modified in place"):
        m2.counts
    m3 = AFDDPMetadata([4])
    m3.num_tokens_across_dp_cpu = [1, 2, 3]  # setter validates like the constructor
    assert m3.counts == (1, 2, 3)
    with pytest.raises(ValueError):
        m3.num_tokens_across_dp_cpu = [-1]
    with torch.inference_mode():  # inference tensors have no version counter: re-read each time
        t = torch.tensor([5, 6], dtype=torch.int32)
        m4 = AFDDPMetadata(t)
        t[0] = 8
        assert m4.counts == (8, 6)


def test_dp_metadata_max_argument_forms_and_object_protocol():
    import pickle

    assert AFDDPMetadata([1], 7).max_tokens == 7
    assert AFDDPMetadata([1], torch.tensor([7])).max_tokens == 7
    assert AFDDPMetadata([], None).max_tokens == 0
    for bad in (-1, 2**31, 1.5, True, torch.tensor([1, 2]), torch.tensor(1.0), "x"):
        with pytest.raises(ValueError, match="max_tokens_across_dp_cpu"):
            AFDDPMetadata([1], bad)
    m = AFDDPMetadata([3, 4], local_sizes=[1])
    assert m == AFDDPMetadata(torch.tensor([3, 4]), local_sizes=[1]) and m != AFDDPMetadata([3, 5])
    assert pickle.loads(pickle.dumps(m)) == m
    assert "[3, 4]" in repr(m)


def test_encode_matches_json_dumps_for_many_stages():
    p = AFDControlPayload({s: [s, 0] for s in (0, 2, 10, 11, 100)}, is_profile=True)
    b = encode_control_payload(p)
    assert b == json.dumps(json.loads(b), separators=(",", ":"), sort_keys=True).encode()
    assert decode_control_payload(b).stage_counts() == p.stage_counts()
    p.is_warmup = 1  # modified after construction into something invalid
    with pytest.raises(ValueError, match="bools"):
        encode_control_payload(p)


@pytest.mark.parametrize("data", [
    b'{"dp_metadata_list":{"0":{"max_tokens_across_dp_cpu":1,"num_tokens_across_dp_cpu":[9999999999]}},'
    b'"format_version":2,"is_graph_capturing":false,"is_graph_replaying":false,"is_profile":false,"is_warmup":false}',
    b'{"dp_metadata_list":{"0":{"max_tokens_across_dp_cpu":1,"num_tokens_across_dp_cpu":[01]}},'
    b'"format_version":2,"is_graph_capturing":false,"is_graph_replaying":false,"is_profile":false,"is_warmup":false}',
])
def test_canonical_looking_but_malformed_inputs_raise(data):
    with pytest.raises(ValueError):
        decode_control_payload(data)


def test_decoder_bounds_stages_and_ranks():
    b = encode_control_payload(AFDControlPayload({s: [1, 2, 3] for s in range(3)}))
    with pytest.raises(ValueError, match="max_stages"):
        decode_control_payload(b, max_stages=2)
    with pytest.raises(ValueError, match="max_ranks"):
        decode_control_payload(b, max_ranks=2)
    assert decode_control_payload(b, max_stages=3, max_ranks=3).stage_counts()[2] == (1, 2, 3)


# ---------------------------------------------------------------- binary codec (afd_ext <-> afd_ext)


@settings(max_examples=200, deadline=None)
@given(payloads)
def test_property_binary_round_trip(p):
    b = codec.encode_control_binary(p)
    assert len(b) == 8 + sum(12 + 4 * len(m.counts) for m in p.dp_metadata_list.values())
    q = codec.decode_control_binary(b)
    assert q == p and list(q.dp_metadata_list) == sorted(p.dp_metadata_list)
    assert q.dp_metadata_list is not p.dp_metadata_list
    for s, m in q.dp_metadata_list.items():  # what the reference's runners read
        assert m.num_tokens_across_dp_cpu.dtype == torch.int32
        assert m.num_tokens_across_dp_cpu.tolist() == list(p.dp_metadata_list[s].counts)
        assert int(m.max_tokens_across_dp_cpu) == p.dp_metadata_list[s].max_tokens
    for f in ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile"):
        assert getattr(q, f) is getattr(p, f)


def test_binary_layout_is_documented_one():
    p = AFDControlPayload({1: [3, 0], 0: [5]}, is_warmup=True, is_profile=True)
    want = (b"AFDb" + bytes([1, 0b1010]) + (2).to_bytes(2, "little")
            + b"".join(v.to_bytes(4, "little") for v in (0, 1, 5, 5))
            + b"".join(v.to_bytes(4, "little") for v in (1, 2, 3, 3, 0)))
    assert codec.encode_control_binary(p) == want


def _bin(stages, flags=0, magic=b"AFDb", version=1, tail=b""):
    import struct

    out = magic + bytes([version, flags]) + struct.pack("<H", len(stages))
    for s, counts, mx in stages:
        out += struct.pack(f"<III{len(counts)}i", s, len(counts), mx, *counts)
    return out + tail


@pytest.mark.parametrize("data,match", [
    (b"", "shorter than its header"),
    (_bin([(0, [1], 1)], magic=b"AFDx"), "bad magic"),
    (_bin([(0, [1], 1)], version=2), "version 2"),
    (_bin([(0, [1], 1)], flags=0x10), "flag bits"),
    (_bin([(0, [1], 1)])[:-1], "truncated"),
    (_bin([(0, [1], 1)])[:12], "truncated"),
    (_bin([(0, [1], 1)], tail=b"\0"), "trailing"),
    (_bin([(1, [1], 1), (0, [1], 1)]), "not increasing"),
    (_bin([(0, [1], 1), (0, [1], 1)]), "not increasing"),
    (_bin([(0, [-1], 1)]), "negative"),
    (_bin([(0, [1], 2**31)]), "exceeds int32"),
    ("not bytes", "bytes"),
])
def test_binary_malformed_inputs_raise_value_error(data, match):
    # both are ValueErrors: a wrong argument type is the caller's, bad bytes are the sender's
    with pytest.raises(AFDConfigError if isinstance(data, str) else ControlProtocolError, match=match):
        codec.decode_control_binary(data)


def test_binary_bounds_and_encoder_checks():
    b = codec.encode_control_binary(AFDControlPayload({s: [1, 2, 3] for s in range(3)}))
    with pytest.raises(ValueError, match="max_stages"):
        codec.decode_control_binary(b, max_stages=2)
    with pytest.raises(ValueError, match="max_ranks"):
        codec.decode_control_binary(b, max_ranks=2)
    with pytest.raises(ValueError, match="AFDControlPayload"):
        codec.encode_control_binary({0: [1]})  # type: ignore[arg-type]
    p = AFDControlPayload({0: [1]})
    p.is_warmup = 1  # modified after construction into something invalid
    with pytest.raises(ValueError, match="bools"):
        codec.encode_control_binary(p)
    p = AFDControlPayload({2**32: [1]})
    with pytest.raises(ValueError, match="2\\*\\*32"):
        codec.encode_control_binary(p)


@pytest.mark.parametrize("stages", [{0: [1, 2], 5: [], 2**31: [3], 2**32 - 1: [0, 7, 2**31 - 1]}, {4: [1], 3: [4] * 5}])
def test_binary_round_trip_of_any_stage_keys_and_lengths(stages):
    q = codec.decode_control_binary(codec.encode_control_binary(AFDControlPayload(stages, is_warmup=True, is_profile=True)))
    assert q.stage_counts() == {s: tuple(c) for s, c in sorted(stages.items())}
    assert [q.dp_metadata_list[s].max_tokens for s in sorted(stages)] == [max(c, default=0) for _, c in sorted(stages.items())]
    assert (q.is_graph_capturing, q.is_warmup, q.is_graph_replaying, q.is_profile) == (False, True, False, True)


@settings(max_examples=300, deadline=None)
@given(payloads, st.integers(0, 400), st.binary(min_size=0, max_size=3))
def test_property_binary_garbage_only_value_error(p, cut, insert):
    good = codec.encode_control_binary(p)
    for data in (good[:cut] + insert + good[cut:], good[:cut] + good[cut + 1:], insert * 4):
        try:
            q = codec.decode_control_binary(data)
        except ValueError:
            continue
        for m in q.dp_metadata_list.values():  # whatever decodes is a valid payload
            assert all(0 <= c <= md.MAX_TOKEN_COUNT for c in m.counts) and 0 <= m.max_tokens <= md.MAX_TOKEN_COUNT



# ---------------------------------------------------------------- the native codec's edges


def test_native_encoder_writes_the_documented_layout_for_any_stage_keys_and_flags():
    import struct

    stages = {2**32 - 1: [0, 7, 2**31 - 1], 3: [], 0: [5, 5]}
    p = AFDControlPayload(stages, is_graph_capturing=True, is_warmup=False, is_graph_replaying=True, is_profile=True)
    want = b"AFDb" + struct.pack("<BBH", 1, 0b1101, 3)
    for s in sorted(stages):
        c = stages[s]
        want += struct.pack(f"<III{len(c)}i", s, len(c), max(c, default=0), *c)
    assert codec.encode_control_binary(p) == want


@pytest.mark.parametrize("bits", range(16))
def test_every_flag_combination_round_trips_and_higher_bits_are_refused(bits):
    names = ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile")
    p = AFDControlPayload({0: [1]}, **{n: bool(bits >> i & 1) for i, n in enumerate(names)})
    b = codec.encode_control_binary(p)
    assert b[5] == bits
    q = codec.decode_control_binary(b)
    assert [getattr(q, n) for n in names] == [bool(bits >> i & 1) for i in range(4)]
    with pytest.raises(ControlProtocolError, match="unknown flag bits"):
        codec.decode_control_binary(b[:5] + bytes([bits | 0x10 << (bits % 4)]) + b[6:])


def test_every_truncation_and_any_trailing_bytes_are_named():
    good = _bin([(0, [1, 2, 3], 3), (4, [], 0), (9, [7], 7)])
    for cut in range(len(good)):
        with pytest.raises(ControlProtocolError, match="shorter than its header|truncated"):
            codec.decode_control_binary(good[:cut])
    for extra in range(1, 9):
        with pytest.raises(ControlProtocolError, match=f"has {extra} trailing bytes"):
            codec.decode_control_binary(good + b"\0" * extra)


def test_counts_and_stages_announced_beyond_the_bytes_are_refused_without_reading_past_them():
    import struct

    huge = b"AFDb" + struct.pack("<BBH", 1, 0, 1) + struct.pack("<III", 0, 2**32 - 1, 0) + b"\0" * 8
    with pytest.raises(ControlProtocolError, match="max_ranks"):
        codec.decode_control_binary(huge)
    with pytest.raises(ControlProtocolError, match="truncated \\(stage 0 counts\\)"):
        codec.decode_control_binary(huge, max_ranks=2**32)
    many = b"AFDb" + struct.pack("<BBH", 1, 0, 0xFFFF) + struct.pack("<III", 0, 0, 0)
    with pytest.raises(ControlProtocolError, match="65535 stages exceed max_stages=64"):
        codec.decode_control_binary(many)
    with pytest.raises(ControlProtocolError, match="truncated \\(stage header\\)"):
        codec.decode_control_binary(many, max_stages=0xFFFF)


@pytest.mark.parametrize("stages,match", [
    ([(5, [1], 1), (5, [1], 1)], "stage 5 after stage 5 \\(not increasing\\)"),
    ([(2**32 - 1, [1], 1), (2**31, [1], 1)], f"stage {2**31} after stage {2**32 - 1}"),
    ([(0, [1, 2**31 - 1, -2**31], 1)], "stage 0 has a negative count \\(rank 2: -2147483648\\)"),
    ([(0, [1], 2**32 - 1)], "max_tokens_across_dp_cpu 4294967295 exceeds int32"),
])
def test_native_decoder_names_order_sign_and_range_faults(stages, match):
    import struct

    data = b"AFDb" + struct.pack("<BBH", 1, 0, len(stages))
    for s, counts, mx in stages:
        data += struct.pack(f"<III{len(counts)}i", s, len(counts), mx, *counts)
    with pytest.raises(ControlProtocolError, match=match):
        codec.decode_control_binary(data)
    with pytest.raises(ControlProtocolError, match=match):
        codec.decode_control_binary(bytearray(data))


def test_native_encoder_reads_tensors_modified_in_place_and_converts_other_payload_classes():
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    p = AFDControlPayload({0: AFDDPMetadata(t), 1: AFDDPMetadata([4])})
    t[1] = 9  # modified after construction: the encoder sends what the tensor holds now
    assert codec.decode_control_binary(codec.encode_control_binary(p)).stage_counts() == {0: (1, 9, 3), 1: (4,)}
    t[0] = -1
    with pytest.raises(AFDConfigError, match="modified in place"):
        codec.encode_control_binary(p)

    class Foreign:  # the reference plugin's own class: int flags, count lists
        dp_metadata_list = {1: [3, 0], 0: [5]}
        is_graph_capturing, is_warmup = 0, 1

    want = codec.encode_control_binary(AFDControlPayload({1: [3, 0], 0: [5]}, is_warmup=True))
    assert codec.encode_control_binary(Foreign()) == want

    class Sub(AFDDPMetadata):  # a subclass is read through its public fields
        pass

    assert codec.encode_control_binary(AFDControlPayload({1: Sub([3, 0]), 0: [5]}, is_warmup=True)) == want



def test_whatever_the_native_decoder_accepts_re_encodes_to_the_same_bytes():
    import random
    import struct

    rng = random.Random(1)
    good = [codec.encode_control_binary(AFDControlPayload(
        {s: [rng.randrange(100) for _ in range(rng.randrange(9))] for s in rng.sample(range(50), rng.randrange(5))}))
        for _ in range(20)]
    accepted = 0
    for _ in range(20000):  # mutated payloads: bytes flipped, cut, inserted, the stage count rewritten
        b = bytearray(rng.choice(good))
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(4)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1:
                del b[rng.randrange(len(b) + 1):rng.randrange(len(b) + 1)]
            elif op == 2:
                b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
            elif len(b) >= 8:
                b[6:8] = struct.pack("<H", rng.randrange(65536))
        try:
            q = codec.decode_control_binary(bytes(b), max_stages=rng.choice([1, 64, 65535]),
                                         max_ranks=rng.choice([8, 4096, 2**32]))
        except ControlProtocolError:
            continue
        accepted += 1
        assert codec.encode_control_binary(q) == bytes(b)  # one canonical layout: nothing is read loosely
    assert accepted > 100


# ---------------------------------------------------------------- agreement


def test_step_count_agreement_builds_same_payload():
    gathered = []

    def make(r):
        def gather(obj):
            gathered.append((r, obj))
            return [(0, ((0, 3), (1, 0)), (False,) * 4), (0, ((0, 0), (1, 5)), (False,) * 4)]
        return gather

    a0 = StepCountAgreement(2, 0, make(0))
    p = a0.agree({0: 3, 1: 0})
    assert p.stage_counts() == {0: (3, 0), 1: (0, 5)}
    assert gathered[0] == (0, (0, ((0, 3), (1, 0)), (False,) * 4))
    assert a0.step == 1


def test_step_count_agreement_detects_disagreement():
    def gather_with(*contribs):
        return lambda obj: list(contribs)

    ok = (0, ((0, 1),), (False,) * 4)
    with pytest.raises(AFDProtocolError, match="out of step"):
        StepCountAgreement(2, 0, gather_with(ok, (1, ((0, 1),), (False,) * 4))).agree([1])
    with pytest.raises(AFDProtocolError, match="stages"):
        StepCountAgreement(2, 0, gather_with(ok, (0, ((1, 1),), (False,) * 4))).agree([1])
    with pytest.raises(AFDProtocolError, match="flags"):
        StepCountAgreement(2, 0, gather_with(ok, (0, ((0, 1),), (True, False, False, False)))).agree([1])
    with pytest.raises(AFDConfigError, match="expected 2"):
        StepCountAgreement(2, 0, gather_with(ok)).agree([1])
    with pytest.raises(AFDConfigError, match=">= 0"):
        StepCountAgreement(1, 0, gather_with(ok)).agree([-1])
    with pytest.raises(AFDConfigError):
        StepCountAgreement(2, 2, gather_with(ok))


def _agreement_worker(rank, nprocs, port):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                            timeout=datetime.timedelta(seconds=30))
    try:
        ag = StepCountAgreement.from_process_group()
        out = []
        for step in range(2):
            p = ag.agree({0: rank + step, 1: 0}, is_warmup=step == 0)
            out.append((p.stage_counts(), p.is_warmup))
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_step_count_agreement_over_gloo():
    from afd_ext.tools.testing import find_free_port, run_workers

    res = run_workers(_agreement_worker, 3, (find_free_port(),), timeout_s=90)
    expected = [({0: (0, 1, 2), 1: (0, 0, 0)}, True), ({0: (1, 2, 3), 1: (0, 0, 0)}, False)]
    assert res == [expected] * 3


def test_repeated_payload_decodes_to_fresh_objects_and_bounds_still_apply():
    b = encode_control_payload(AFDControlPayload({0: [5, 6, 7]}, is_warmup=True))
    p1 = decode_control_payload(b)
    p1.dp_metadata_list[0].num_tokens_across_dp_cpu[0] = 1  # a caller mutating its copy
    p1.is_warmup = False
    p2 = decode_control_payload(b)
    assert p2 is not p1 and p2.dp_metadata_list[0] is not p1.dp_metadata_list[0]
    assert p2.stage_counts() == {0: (5, 6, 7)} and p2.is_warmup
    with pytest.raises(ValueError, match="max_ranks"):
        decode_control_payload(b, max_ranks=2)
    with pytest.raises(ValueError, match="max_bytes"):
        decode_control_payload(b, max_bytes=len(b) - 1)


@pytest.mark.parametrize("change", ["del p.is_warmup", "del p.dp_metadata_list", "p.dp_metadata_list = None",
                                    "p.dp_metadata_list = ()"])
def test_a_payload_changed_after_construction_is_a_config_error_before_it_is_sent(change):
    from afd_ext.errors import AFDConfigError
    from afd_ext.control.codec import encode_control_binary

    p = AFDControlPayload(dp_metadata_list={0: AFDDPMetadata([1])})
    exec(change)
    with pytest.raises(AFDConfigError):
        encode_control_binary(p)
