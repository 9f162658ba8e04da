"""The one schedule: invariants, validation, padding, graph key, tensor checks (pure)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_ext.metadata import AFDControlPayload
from afd_ext.schedule import (
    ScheduleConfig,
    build_step_schedule,
    pad_sizes,
    warmup_payload,
)
from afd_ext.topology import Topology

H = 16


def cfg(**kw):
    base = dict(num_layers=2, hidden_size=H, hidden_dtype=torch.bfloat16)
    base.update(kw)
    return ScheduleConfig(**base)


def sched(A, F, stages, tp=1, **kw):
    return build_step_schedule(Topology(A, F, tp), AFDControlPayload(stages), cfg(**kw))


def check_invariants(s):
    t = s.topology
    for stage in s.stages:
        attn_total = sum(s.attention_rows(stage, a) for a in range(t.num_attention_ranks))
        ffn_total = sum(s.ffn_plan(stage, f).total for f in range(t.num_ffn_ranks))
        assert attn_total == ffn_total
        for a in range(t.num_attention_ranks):
            ap = s.attention_plan(stage, a)
            assert sum(ap.rows) == ap.total == s.attention_rows(stage, a)
            assert ap.offsets == tuple(sum(ap.rows[:i]) for i in range(len(ap.rows)))
            for f, r in zip(ap.peers, ap.rows):
                fp = s.ffn_plan(stage, f)
                assert fp.rows[fp.peers.index(a)] == r == s.edge_rows(stage, a, f)
        for f in range(t.num_ffn_ranks):
            fp = s.ffn_plan(stage, f)
            assert fp.peers == t.ffn_peers(f)
            assert fp.offsets == tuple(sum(fp.rows[:i]) for i in range(len(fp.rows)))
            assert fp.total == sum(fp.rows)


def test_basic_3a2f():
    s = sched(3, 2, {0: [1, 0, 5], 1: [2, 2, 2]})
    assert s.stages == (0, 1)
    assert s.ffn_plan(0, 0) == ((0, 1), (1, 0), (0, 1), 1, (1, 0))
    assert s.ffn_plan(0, 1).total == 5
    assert s.edge_rows(0, 1, 0) == 0  # skipped on both sides
    assert s.edge_rows(0, 0, 0) == 1
    check_invariants(s)


def test_a_less_than_f_splits():
    s = sched(2, 5, {0: [7, 1]})
    assert s.attention_plan(0, 0) == ((0, 1, 2), (3, 2, 2), (0, 3, 5), 7, (3, 2, 2))
    assert s.attention_plan(0, 1).rows == (1, 0)
    assert s.ffn_plan(0, 4).total == 0 and s.edge_rows(0, 1, 4) == 0
    check_invariants(s)


def test_dp_tp_expansion_and_clamp():
    s = sched(2, 2, {0: [5]}, tp=2)
    assert s.rows_vector(0) == (5, 5)
    s = sched(4, 2, {0: [3, 0]}, clamp_idle_to_one=True)
    assert s.rows_vector(0) == (3, 3, 1, 1)
    s = sched(4, 2, {0: [3, 0]})
    assert s.rows_vector(0) == (3, 3, 0, 0) and s.ffn_plan(0, 1).total == 0


def test_stages_sorted_and_empty_step():
    s = sched(1, 1, {3: [1], 0: [2], 1: [0]})
    assert s.stages == (0, 1, 3)
    e = sched(1, 1, {})
    assert e.stages == ()


@pytest.mark.parametrize(
    "stages, kw, match",
    [
        ({0: [1, 2, 3]}, {}, "stage 0: count vector has 3 entries"),
        ({0: [1, 2], 1: [1]}, {"max_stages": 1}, "max_stages=1"),
        ({0: [1, 2]}, {"pad_to": {0: 1}}, "attention rank 1 has 2 tokens"),
        ({0: [1, 2]}, {"pad_to": {1: 4}}, "pad_to covers"),
    ],
)
def test_validation_errors(stages, kw, match):
    with pytest.raises(ValueError, match=match):
        sched(2, 1, stages, **kw)


def test_lookup_errors():
    s = sched(4, 2, {0: [1, 1, 1, 1]})
    with pytest.raises(ValueError, match="stage 5 is not in this step"):
        s.attention_rows(5, 0)
    with pytest.raises(ValueError, match="not peers"):
        s.edge_rows(0, 0, 1)
    with pytest.raises(ValueError, match="within attention size"):
        s.attention_plan(0, 4)
    with pytest.raises(ValueError):
        build_step_schedule(Topology(1, 1), {0: [1]}, cfg())  # type: ignore[arg-type]


def test_config_validation():
    with pytest.raises(ValueError, match="hidden_dtype"):
        cfg(hidden_dtype=torch.int32)
    with pytest.raises(ValueError, match="num_layers"):
        cfg(num_layers=0)
    with pytest.raises(ValueError, match="router_logits_dtype"):
        cfg(router_logits_width=8, router_logits_dtype=torch.int64)
    with pytest.raises(ValueError, match="pad_to"):
        cfg(pad_to={0: -1})
    assert hash(cfg(pad_to={1: 4, 0: 2})) == hash(cfg(pad_to={0: 2, 1: 4}))


def test_padding():
    s = sched(2, 1, {0: [3, 0], 1: [1, 2]}, pad_to={0: 4, 1: 2})
    assert s.rows_vector(0) == (4, 4) and s.counts(0) == (3, 0)
    assert s.real_rows(0, 0) == 3 and s.attention_rows(0, 1) == 4
    fp = s.ffn_plan(0, 0)
    assert fp.rows == (4, 4) and fp.valid_rows == (3, 0) and fp.total == 8
    assert s.edge_rows(0, 1, 0) == 4  # padded rows travel
    check_invariants(s)
    s = sched(1, 2, {0: [3]}, pad_to={0: 8})
    assert s.attention_plan(0, 0) == ((0, 1), (4, 4), (0, 4), 8, (3, 0))


def test_pad_sizes_and_warmup():
    t = Topology(2, 1)
    p = AFDControlPayload({0: [3, 1], 1: [9, 0]})
    assert pad_sizes(t, p, [1, 2, 4, 8, 16]) == {0: 4, 1: 16}
    assert pad_sizes(t, p, [1, 2, 4]) is None
    assert pad_sizes(t, p, []) is None
    for A, F in [(1, 1), (3, 2), (2, 5), (1, 4)]:
        topo = Topology(A, F)
        s = build_step_schedule(topo, warmup_payload(topo, 2), cfg())
        assert s.payload.is_warmup
        assert all(s.edge_rows(st, a, f) > 0 for st in s.stages for a, f in topo.edges())


def test_graph_key():
    # The key lives in afd_ext.graphs (one implementation); it is built from the schedule.
    from afd_ext.graphs import graph_key_from_schedule as graph_key

    a = sched(2, 1, {0: [4, 4]})
    b = sched(2, 1, {0: [7, 1]})  # same total, different per-peer counts (reference #261)
    assert graph_key(a) != graph_key(b)
    assert graph_key(a) == graph_key(sched(2, 1, {0: [4, 4]}))
    assert graph_key(a) != graph_key(sched(2, 1, {0: [4, 4]}, router_logits_width=8))
    assert graph_key(a) != graph_key(sched(2, 1, {0: [4, 4]}, send_token_ids=True))
    assert graph_key(a) != graph_key(sched(2, 1, {0: [4, 4]}, hidden_dtype=torch.float16))
    assert graph_key(a) != graph_key(sched(2, 1, {0: [4, 4], 1: [4, 4]}))
    # padded: real counts do not matter, the padded vector does
    assert graph_key(sched(2, 1, {0: [1, 3]}, pad_to={0: 4})) == graph_key(sched(2, 1, {0: [4, 0]}, pad_to={0: 4}))
    hash(graph_key(a))


def test_check_attention_tensors():
    s = sched(2, 1, {0: [3, 0]}, router_logits_width=8, send_token_ids=True)
    h = torch.zeros(3, H, dtype=torch.bfloat16)
    lg = torch.zeros(3, 8)
    ids = torch.zeros(3, dtype=torch.int32)
    s.check_attention_tensors(0, 0, h, lg, ids, device="cpu")
    s.check_attention_tensors(0, 1, h[:0], lg[:0], ids[:0])
    bad = [
        ((torch.zeros(4, H, dtype=torch.bfloat16), lg, ids), r"hidden_states must have shape \[3, 16\]"),
        ((h.float(), lg, ids), "hidden_states must be torch.bfloat16.*cast"),
        ((h, None, ids), "router_logits missing"),
        ((h, lg.double(), ids), "router_logits must be torch.float32"),
        ((h, torch.zeros(3, 9), ids), r"router_logits must have shape \[3, 8\]"),
        ((h, lg, None), "token_ids .* missing"),
        ((h, lg, ids.long()), "token_ids must be torch.int32"),
        ((h, lg, torch.zeros(3, 1, dtype=torch.int32)), r"token_ids must have shape \[3\]"),
        ((torch.zeros(H, 3, dtype=torch.bfloat16).t(), lg, ids), "contiguous"),
        (("x", lg, ids), "torch.Tensor"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            s.check_attention_tensors(0, 0, *args)
    plain = sched(1, 1, {0: [2]})
    with pytest.raises(ValueError, match="configured without them"):
        plain.check_attention_tensors(0, 0, torch.zeros(2, H, dtype=torch.bfloat16), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="configured without them"):
        plain.check_attention_tensors(0, 0, torch.zeros(2, H, dtype=torch.bfloat16), None,
                                      torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be on meta"):
        plain.check_attention_tensors(0, 0, torch.zeros(2, H, dtype=torch.bfloat16), device="meta")


def test_check_ffn_output_and_reply():
    s = sched(2, 1, {0: [3, 2]})
    s.check_ffn_output(0, 0, torch.zeros(5, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ffn_output must have shape \[5, 16\]"):
        s.check_ffn_output(0, 0, torch.zeros(3, H, dtype=torch.bfloat16))
    s.check_attention_reply(0, 1, torch.zeros(2, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ref_tensor"):
        s.check_attention_reply(0, 1, torch.zeros(2, H))


@st.composite
def topo_and_counts(draw):
    A = draw(st.integers(1, 9))
    F = draw(st.integers(1, 9))
    tp = draw(st.sampled_from([d for d in range(1, A + 1) if A % d == 0]))
    n_stages = draw(st.integers(0, 3))
    per_dp = A // tp if draw(st.booleans()) else A
    stages = {
        s: draw(st.lists(st.integers(0, 40), min_size=per_dp, max_size=per_dp))
        for s in draw(st.lists(st.integers(0, 10), min_size=n_stages, max_size=n_stages, unique=True))
    }
    clamp = draw(st.booleans())
    pad = None
    if draw(st.booleans()):
        pad = {s: max(max(c), 1 if clamp else 0) + draw(st.integers(0, 5)) for s, c in stages.items()}
    return Topology(A, F, tp), stages, clamp, pad


@settings(max_examples=150, deadline=None)
@given(topo_and_counts())
def test_property_views_agree(case):
    topo, stages, clamp, pad = case
    s = build_step_schedule(topo, AFDControlPayload(stages), cfg(clamp_idle_to_one=clamp, pad_to=pad))
    check_invariants(s)
    for stage in s.stages:
        real = s.counts(stage)
        assert all(n >= (1 if clamp else 0) for n in real)
        # real rows per attention rank equal the valid rows summed over its edges
        for a in range(topo.num_attention_ranks):
            assert sum(s.attention_plan(stage, a).valid_rows) == real[a]
        assert sum(sum(s.ffn_plan(stage, f).valid_rows) for f in range(topo.num_ffn_ranks)) == sum(real)




def test_one_stage_layout_for_every_role_keyed_by_name_and_stage():
    from afd_ext.schedule import stage_buffers
    from afd_ext.wire import WirePart

    c = cfg(router_logits_width=8, send_token_ids=True)
    hidden = WirePart("hidden", (H,), torch.bfloat16, "hidden_states")
    assert c.wire_parts == (hidden, WirePart("router_logits", (8,), torch.float32, "router_logits"),
                            WirePart("token_ids", (), torch.int32, "input_ids"))
    assert len(c.wire_parts) == 3 and cfg().wire_parts == (hidden,)
    calls = []

    def alloc(key, shape, dtype):
        calls.append((key, shape, dtype))
        return torch.empty(shape, dtype=dtype)

    bufs = stage_buffers(alloc, c, 2, 5, ("reply",))
    assert [k for k, _, _ in calls] == [("hidden", 2), ("router_logits", 2), ("token_ids", 2), ("reply", 2)]
    assert bufs["hidden"].shape == (5, H) and bufs["token_ids"].shape == (5,) and bufs["reply"].dtype == torch.bfloat16
    bare = stage_buffers(alloc, cfg(), 0, 3)
    assert set(bare) == {"hidden"} and bare["hidden"].shape == (3, H)  # a part that does not travel has no buffer
