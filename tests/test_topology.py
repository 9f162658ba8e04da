"""Topology: edges for any A, F; world order; control routing; DP x TP expansion (pure)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_ext.topology import ATTENTION, FFN, Topology, validate_role_rank

COMBOS = [(a, f) for a in range(1, 10) for f in range(1, 10)] + [(64, 8), (7, 64), (128, 3)]


@pytest.mark.parametrize("A,F", COMBOS)
def test_edges_cover_every_rank_consistently(A, F):
    t = Topology(A, F)
    edges = t.edges()
    # both views agree edge by edge
    from_ffn = {(a, f) for f in range(F) for a in t.ffn_peers(f)}
    from_attn = {(a, f) for a in range(A) for f in t.attention_peers(a)}
    assert from_ffn == from_attn == set(edges)
    assert len(edges) == len(set(edges)) == max(A, F)
    # every rank has at least one peer
    assert all(t.attention_peers(a) for a in range(A))
    assert all(t.ffn_peers(f) for f in range(F))
    if A >= F:
        # every attention rank appears exactly once over all FFN ranks, in contiguous blocks
        blocks = [t.ffn_peers(f) for f in range(F)]
        assert list(itertools.chain(*blocks)) == list(range(A))
        sizes = [len(b) for b in blocks]
        assert max(sizes) - min(sizes) <= 1
        assert all(len(t.attention_peers(a)) == 1 for a in range(A))
    else:
        owned = [t.attention_peers(a) for a in range(A)]
        assert list(itertools.chain(*owned)) == list(range(F))
        sizes = [len(o) for o in owned]
        assert max(sizes) - min(sizes) <= 1
        assert all(len(t.ffn_peers(f)) == 1 for f in range(F))


@pytest.mark.parametrize("A,F", [(a, f) for a in range(1, 13) for f in range(1, 7) if a % f == 0])
def test_blocks_equal_reference_head_when_divisible(A, F):
    t = Topology(A, F)
    ratio = A // F
    for f in range(F):
        assert t.ffn_peers(f) == tuple(f * ratio + k for k in range(ratio))
    for a in range(A):
        assert t.attention_peers(a) == (a // ratio,)


def _subgroup(t: Topology, f: int) -> tuple[int, ...]:
    """The reference's data-plane subgroup of FFN rank f, in AFD world ranks: f, then its attention peers."""
    return (f,) + tuple(t.world_rank(ATTENTION, a) for a in t.ffn_peers(f))


def test_reference_worked_examples():
    # 4A2F: world F0=0 F1=1 A0=2 A1=3 A2=4 A3=5; subgroups (0,2,3), (1,4,5); metadata A0->F0, A1->F1
    t = Topology(4, 2)
    assert [t.world_rank(FFN, f) for f in range(2)] == [0, 1]
    assert [t.world_rank(ATTENTION, a) for a in range(4)] == [2, 3, 4, 5]
    assert _subgroup(t, 0) == (0, 2, 3)
    assert _subgroup(t, 1) == (1, 4, 5)
    assert [t.control_destinations(a) for a in range(4)] == [(0,), (1,), (), ()]
    # 2A1F: subgroup (0,1,2); A0 sends the metadata to F0; A1 sends none
    t = Topology(2, 1)
    assert _subgroup(t, 0) == (0, 1, 2) and t.control_destinations(0) == (0,)
    assert [a for a in range(2) if t.control_destinations(a)] == [0]  # the control senders
    # 3A2F (NEWEST): A0, A1 -> F0; A2 -> F1; subgroups (0,2,3), (1,4)
    t = Topology(3, 2)
    assert t.ffn_peers(0) == (0, 1) and t.ffn_peers(1) == (2,)
    assert _subgroup(t, 1) == (1, 4)
    # reference test table: (A,F,role,role_rank) -> (subgroup_ranks, dsts); an attention rank's
    # subgroup is that of its first FFN peer
    table = {
        (2, 2, ATTENTION, 1): ((1, 3), (1,)),
        (2, 1, ATTENTION, 0): ((0, 1, 2), (0,)),
        (4, 2, ATTENTION, 2): ((1, 4, 5), ()),
        (4, 2, FFN, 1): ((1, 4, 5), ()),
    }
    for (A, F, role, r), (ranks, dsts) in table.items():
        t = Topology(A, F)
        f = r if role == FFN else t.attention_peers(r)[0]
        got_dsts = () if role == FFN else t.control_destinations(r)
        assert (_subgroup(t, f), got_dsts) == (ranks, dsts)
        assert t.world_rank(role, r) in _subgroup(t, f)


def test_reference_ffn_peer_token_fixtures():
    # (A, F, ffn_rank, counts) -> peer tokens; the reference clamps zero to one
    fixtures = [
        ((2, 1, 0, [3, 5]), [3, 5]),
        ((4, 2, 0, [3, 5, 7, 11]), [3, 5]),
        ((4, 2, 1, [3, 5, 7, 0]), [7, 1]),
        ((6, 3, 2, [2, 3, 5, 7, 11, 13]), [11, 13]),
    ]
    for (A, F, f, counts), want in fixtures:
        t = Topology(A, F)
        exp = t.expand_counts(counts, clamp_idle_to_one=True)
        assert [exp[a] for a in t.ffn_peers(f)] == want
    # without the switch zero stays zero
    t = Topology(4, 2)
    assert [t.expand_counts([3, 5, 7, 0])[a] for a in t.ffn_peers(1)] == [7, 0]
    # idle-rank test: counts [0, 4] -> FFN peers [1, 4] total 5 (clamped)
    assert sum(Topology(2, 1).expand_counts([0, 4], clamp_idle_to_one=True)) == 5


@pytest.mark.parametrize("A,F", COMBOS)
def test_control_routing(A, F):
    t = Topology(A, F)
    m = min(A, F)
    received = [0] * F
    for a in range(A):
        dsts = t.control_destinations(a)
        if a >= m:
            assert dsts == ()
        else:
            assert dsts == tuple(range(a, F, m))  # the reference's strided pairing
        for f in dsts:
            received[f] += 1
            assert t.control_source(f) == a
    assert received == [1] * F  # exactly one payload per FFN rank per step
    assert [a for a in range(A) if t.control_destinations(a)] == list(range(m))  # the control senders


def test_tp_control_pairing_2a2f():
    # reference test_p2p_tp2_maps_shared_dp_payload_one_to_one: dsts [(0,), (1,)], FFN srcs world [2, 3]
    t = Topology(2, 2, tp_size=2)
    assert [t.control_destinations(a) for a in range(2)] == [(0,), (1,)]
    assert [t.world_rank(ATTENTION, t.control_source(f)) for f in range(2)] == [2, 3]
    assert t.expand_counts([5]) == (5, 5)


def test_expand_counts():
    t = Topology(4, 2)
    assert t.expand_counts([1, 0, 3, 4]) == (1, 0, 3, 4)
    assert t.expand_counts([2, 0]) == (2, 2, 0, 0)
    assert t.expand_counts([7]) == (7, 7, 7, 7)
    assert t.expand_counts([2, 0], clamp_idle_to_one=True) == (2, 2, 1, 1)
    with pytest.raises(ValueError, match="3 entries"):
        t.expand_counts([1, 2, 3])
    with pytest.raises(ValueError, match="5 entries"):
        t.expand_counts([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="empty"):
        t.expand_counts([])
    with pytest.raises(ValueError, match=">= 0"):
        t.expand_counts([1, -1, 0, 0])
    tp = Topology(4, 2, tp_size=2)
    assert tp.expand_counts([3, 4]) == (3, 3, 4, 4)
    with pytest.raises(ValueError, match="tp_size=2"):
        tp.expand_counts([3])


@pytest.mark.parametrize("A,F", [(1, 2), (1, 3), (2, 5), (3, 7), (1, 1), (4, 2)])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 6, 7, 100])
def test_split_rows(A, F, n):
    t = Topology(A, F)
    for a in range(A):
        split = t.split_rows(a, n)
        assert tuple(f for f, _, _ in split) == t.attention_peers(a)
        # contiguous, covering [0, n)
        pos = 0
        for _, start, count in split:
            assert start == pos
            pos += count
        assert pos == n
        counts = [c for _, _, c in split]
        assert max(counts) - min(counts) <= 1
        assert counts == sorted(counts, reverse=True)  # the first ranks get the remainder
    with pytest.raises(ValueError):
        t.split_rows(0, -1)


def test_world_order_and_role_of():
    t = Topology(3, 2)
    assert t.world_size == 5
    for w in range(5):
        role, r = t.role_of(w)
        assert t.world_rank(role, r) == w
    with pytest.raises(ValueError):
        t.role_of(5)


def test_validation_messages():
    with pytest.raises(ValueError, match="positive"):
        Topology(0, 1)
    with pytest.raises(ValueError, match="positive"):
        Topology(1, True)
    with pytest.raises(ValueError, match="multiple of tp_size"):
        Topology(3, 1, tp_size=2)
    with pytest.raises(ValueError, match="non-negative"):
        validate_role_rank(ATTENTION, -1, 2, 2)
    with pytest.raises(ValueError, match="within attention size 2"):
        validate_role_rank(ATTENTION, 2, 2, 2)
    with pytest.raises(ValueError, match="within FFN size 1"):
        Topology(2, 1).ffn_peers(1)
    with pytest.raises(ValueError, match="unknown AFD role"):
        Topology(2, 1).world_rank("expert", 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 500))
def test_property_split_rows_sum_over_edges(A, F, n):
    t = Topology(A, F)
    total_by_ffn = [0] * F
    for a in range(A):
        for f, _, c in t.split_rows(a, n):
            total_by_ffn[f] += c
    assert sum(total_by_ffn) == n * A
    for f in range(F):
        assert total_by_ffn[f] == sum(c for a in t.ffn_peers(f) for ff, _, c in t.split_rows(a, n) if ff == f)
