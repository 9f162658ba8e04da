"""pack_rows / unpack_rows on the CPU: the byte layout against a Python reference,
round trips for every wire dtype and layout, opcheck, zero rows, and bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ops = pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")

DTYPES = list(ops.WIRE_DTYPES)
LAYOUTS = ("contiguous", "col_stride2", "transposed", "offset_slice")


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    hi = 255 if dtype == torch.uint8 else 2**31 - 1
    return torch.randint(0, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``t`` ([n, w] or [n]) in a non-contiguous (or offset) layout."""
    if layout == "contiguous":
        return t
    if t.dim() == 1:
        if layout == "offset_slice":
            big = torch.zeros(t.shape[0] + 1, dtype=t.dtype)
            big[1:] = t
            return big[1:]
        big = torch.zeros(t.shape[0], 2, dtype=t.dtype)
        big[:, 0] = t
        return big[:, 0]  # stride 2
    n, w = t.shape
    if layout == "col_stride2":
        big = torch.zeros(n, 2 * w, dtype=t.dtype)
        big[:, ::2] = t
        return big[:, ::2]
    if layout == "transposed":
        return t.t().contiguous().t()
    if layout == "offset_slice":  # row starts not 16-byte aligned
        big = torch.zeros(n + 1, w + 3, dtype=t.dtype)
        big[1:, 3:] = t
        return big[1:, 3:]
    raise ValueError(layout)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, bytes per row] uint8 copy of ``t`` ([n] or [n, w])."""
    n = t.shape[0]
    w = t[0].numel() if n else (t.shape[1] if t.dim() == 2 else 1)
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(n, w)  # truly dense strides
    if t.numel() == 0:
        return torch.zeros(n, w * t.element_size(), dtype=torch.uint8)
    return t.view(torch.uint8).reshape(n, w * t.element_size())


def reference_wire(hidden, logits, ids) -> torch.Tensor:
    parts = []
    for t in (hidden, logits, ids):
        if t is None:
            continue
        b = as_bytes(t)
        pad = (-b.shape[1]) % 16
        parts += [b, torch.zeros(b.shape[0], pad, dtype=torch.uint8)]
    return torch.cat(parts, dim=1)


def new_wire(hidden, logits, ids, fill=0xAB):
    width = ops.wire_row_bytes(
        hidden.shape[1], hidden.dtype,
        logits.shape[1] if logits is not None else None,
        logits.dtype if logits is not None else torch.float32,
        ids is not None,
    )
    return torch.full((hidden.shape[0], width), fill, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def round_trip(hidden, logits, ids, out_layout="contiguous"):
    wire = new_wire(hidden, logits, ids)
    ops.pack_rows(hidden, logits, ids, wire)
    assert torch.equal(wire, reference_wire(hidden, logits, ids)), "wire bytes differ from the reference layout"
    h2 = relayout(torch.zeros_like(hidden.contiguous()), out_layout)
    l2 = None if logits is None else relayout(torch.zeros_like(logits.contiguous()), out_layout)
    i2 = None if ids is None else relayout(torch.zeros_like(ids.contiguous()), out_layout)
    ops.unpack_rows(wire, h2, l2, i2)
    assert same_bits(h2, hidden)
    if logits is not None:
        assert same_bits(l2, logits)
    if ids is not None:
        assert same_bits(i2, ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_hidden_dtype(dtype):
    n = 5
    round_trip(make((n, 7), dtype, 1), make((n, 3), torch.float32, 2), make((n,), torch.int32, 3))
    round_trip(make((n, 16), dtype, 4), None, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_logits_dtype(dtype):
    round_trip(make((4, 9), torch.bfloat16, 1), make((4, 5), dtype, 2), None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_inputs_and_outputs(layout):
    n = 6
    h = relayout(make((n, 12), torch.bfloat16, 1), layout)
    lg = relayout(make((n, 5), torch.float32, 2), layout)
    ids = relayout(make((n,), torch.int32, 3), layout)
    if layout != "contiguous":
        assert not (h.is_contiguous() and lg.is_contiguous())
    round_trip(h, lg, ids, out_layout=layout)


def test_wire_may_be_a_row_slice_of_a_bigger_buffer():
    h, ids = make((4, 8), torch.float16, 1), make((4,), torch.int32, 2)
    width = ops.wire_row_bytes(8, torch.float16, None, torch.float32, True)
    big = torch.zeros(10, width, dtype=torch.uint8)
    wire = big[3:7]
    ops.pack_rows(h, None, ids, wire)
    assert torch.equal(wire, reference_wire(h, None, ids))
    assert big[:3].count_nonzero() == 0 and big[7:].count_nonzero() == 0


def test_zero_rows_is_a_no_op():
    h = torch.zeros(0, 8, dtype=torch.bfloat16)
    wire = torch.zeros(0, 16, dtype=torch.uint8)
    ops.pack_rows(h, None, None, wire)
    ops.unpack_rows(wire, h, None, None)


def test_padding_is_zeroed():
    h = make((3, 3), torch.bfloat16, 1)  # 6 bytes of data, 10 of padding
    wire = new_wire(h, None, None, fill=0xFF)
    ops.pack_rows(h, None, None, wire)
    assert wire[:, 6:].count_nonzero() == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 9),
    width=st.integers(0, 40),
    hidden_dtype=st.sampled_from(DTYPES),
    logits_width=st.one_of(st.none(), st.integers(0, 12)),
    logits_dtype=st.sampled_from(DTYPES),
    with_ids=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(n, width, hidden_dtype, logits_width, logits_dtype, with_ids, layout, seed):
    h = relayout(make((n, width), hidden_dtype, seed), layout)
    lg = None if logits_width is None else relayout(make((n, logits_width), logits_dtype, seed + 1), layout)
    ids = relayout(make((n,), torch.int32, seed + 2), layout) if with_ids else None
    round_trip(h, lg, ids, out_layout=layout)


# ---------------------------------------------------------------------------
# opcheck: schema, fake, autograd registration, AOT dispatch (static + dynamic)
# ---------------------------------------------------------------------------

OPCHECK_CASES = [
    ("bf16+logits+ids", 5, torch.bfloat16, (3, torch.float32), True, "contiguous"),
    ("fp16 only", 4, torch.float16, None, False, "contiguous"),
    ("fp32 strided", 3, torch.float32, (4, torch.bfloat16), True, "col_stride2"),
    ("fp8 e4m3 transposed", 6, torch.float8_e4m3fn, (2, torch.float32), True, "transposed"),
    ("fp8 e5m2 offset", 2, torch.float8_e5m2, None, True, "offset_slice"),
    ("int32", 3, torch.int32, (2, torch.int64), False, "contiguous"),
    ("int64", 3, torch.int64, None, True, "contiguous"),
    ("uint8", 3, torch.uint8, (5, torch.uint8), True, "contiguous"),
    ("zero rows", 0, torch.bfloat16, (3, torch.float32), True, "contiguous"),
    ("zero rows strided", 0, torch.float32, None, True, "col_stride2"),
]


def _utils(dtype):
    # opcheck's test_schema compares tensors with arithmetic that torch's CPU
    # backend lacks for fp8 ("mul_cpu_reduced_float"); the other checks run.
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return torch.library._OPCHECK_DEFAULT_UTILS


def _case(n, dtype, logits, ids, layout):
    h = relayout(make((n, 10), dtype, 1), layout)
    lg = None if logits is None else relayout(make((n, logits[0]), logits[1], 2), layout)
    ii = relayout(make((n,), torch.int32, 3), layout) if ids else None
    return h, lg, ii


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_pack_rows(case):
    _, n, dtype, logits, ids, layout = case
    h, lg, ii = _case(n, dtype, logits, ids, layout)
    wire = new_wire(h, lg, ii)
    torch.library.opcheck(torch.ops.afd_ext.pack_rows.default, (h, lg, ii, wire), test_utils=_utils(dtype))


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_unpack_rows(case):
    _, n, dtype, logits, ids, layout = case
    h, lg, ii = _case(n, dtype, logits, ids, layout)
    wire = new_wire(h, lg, ii)
    ops.pack_rows(h, lg, ii, wire)
    outs = [None if t is None else relayout(torch.zeros_like(t.contiguous()), layout) for t in (h, lg, ii)]
    torch.library.opcheck(torch.ops.afd_ext.unpack_rows.default, (wire, *outs), test_utils=_utils(dtype))


# ---------------------------------------------------------------------------
# Bad input: a clear error naming the tensor, before anything is written
# ---------------------------------------------------------------------------


def test_wrong_wire_width_names_the_expected_bytes():
    h = make((2, 8), torch.bfloat16)
    wire = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"wire must have 16 bytes per row"):
        ops.pack_rows(h, None, None, wire)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(ids=torch.zeros(2, dtype=torch.int64)), r"token_ids must be int32"),
        (dict(wire_dtype=torch.int8), r"wire must be uint8"),
        (dict(hidden=torch.zeros(3, 8, dtype=torch.bfloat16)), r"hidden_states has 3 rows but wire has 2"),
        (dict(hidden=torch.zeros(2, 8, dtype=torch.float64)), r"hidden_states has dtype Double"),
        (dict(hidden=torch.zeros(2, 2, 4, dtype=torch.bfloat16)), r"hidden_states must be 2-D"),
        (dict(logits=torch.zeros(2, 3, 1)), r"router_logits must be 2-D"),
        (dict(wire_cols_stride2=True), r"each wire row must be dense"),
    ],
)
def test_bad_pack_inputs(kwargs, pattern):
    h = kwargs.get("hidden", torch.zeros(2, 8, dtype=torch.bfloat16))
    lg = kwargs.get("logits")
    ids = kwargs.get("ids")
    width = 16 + (16 if ids is not None else 0)
    if kwargs.get("wire_cols_stride2"):
        wire = torch.zeros(2, 2 * width, dtype=torch.uint8)[:, ::2]
    else:
        wire = torch.zeros(2, width, dtype=kwargs.get("wire_dtype", torch.uint8))
    with pytest.raises(RuntimeError, match=pattern):
        ops.pack_rows(h, lg, ids, wire)


def test_unpack_into_overlapping_output_is_refused():
    h = make((3, 8), torch.float32)
    wire = new_wire(h, None, None)
    ops.pack_rows(h, None, None, wire)
    expanded = torch.zeros(1, 8).expand(3, 8)
    with pytest.raises(RuntimeError, match=r"hidden_states is written but has overlapping elements"):
        ops.unpack_rows(wire, expanded, None, None)


def test_mixed_devices_are_refused():
    h = make((2, 8), torch.float32).to("meta")
    wire = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        ops.pack_rows(h, None, None, wire)
