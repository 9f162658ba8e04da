"""The wire stated once (afd_ext/wire.py): a declared part travels end to end; nothing below names a part.

The add-a-part test declares top-k expert ids (int32 ``[n, K]``) through
:func:`afd_ext.wire.declare_part` and moves them over gloo through the
connector's four calls, touching only the declaration, the handshake (which
compares the declared layout) and the connector's argument (``topk_ids=``).
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest
import torch

from afd_ext import wire
from afd_ext.errors import AFDConfigError
from afd_ext.schedule import ScheduleConfig
from afd_ext.testing import WorkerError, find_free_port, run_workers

ROOT = pathlib.Path(__file__).resolve().parents[1]
K = 3  # experts per token
LAYERS = 2
COUNTS = [4, 2]  # rows of each attention rank (stage 0)


def declare_topk() -> None:
    """The whole change a new part needs: its declaration."""
    wire.declare_part("topk_ids", dtype=torch.int32, cols=(K,))


def _connector(role: str, role_rank: int, port: int, A: int, F: int, strict: bool, transport: str, device: str):
    from afd_ext.config import AFDConfig
    from afd_ext.connector import AFDConnector

    cfg = AFDConfig(role=role, host="127.0.0.1", port=port, num_attention_ranks=A, num_ffn_ranks=F,
                    connector_extra_config={"transport": transport, "strict": strict, "step_timeout_s": 30,
                                            "init_timeout_s": 60})
    world = role_rank if role == "ffn" else F + role_rank
    return AFDConnector(world, 0, cfg, role_rank, hidden_size=8, num_layers=LAYERS, dtype=torch.float32,
                        router_logits_width=5, device=device, warmup_on_init=True)


def _topk(a: int, layer: int, n: int, device: str = "cpu") -> torch.Tensor:
    return (torch.arange(n * K, dtype=torch.int32, device=device).reshape(n, K) * 7 + 100 * a + 10 * layer)


def add_a_part_worker(rank: int, nprocs: int, port: int, strict: bool, declare_on: tuple[str, ...],
                      transport: str = "gloo", device: str = "cpu"):
    """One rank of the add-a-part exchange (also the GPU tier's, tests/gpu/test_wire_gpu.py)."""
    from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata

    A, F = len(COUNTS), nprocs - len(COUNTS)
    role, rr = ("ffn", rank) if rank < F else ("attention", rank - F)
    if role in declare_on:
        declare_topk()
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    conn = _connector(role, rr, port, A, F, strict, transport, device)
    conn.init_afd_connector()
    payload = AFDControlPayload(dp_metadata_list={0: list(COUNTS)})
    got = []
    try:
        if role == "attention":
            conn.control_plane.update_state_from_dp_metadata(payload)
            conn.control_plane.send_dp_metadata_list(payload)
            n = COUNTS[rr]
            for layer in range(LAYERS):
                h = torch.full((n, 8), float(rr + layer), device=device)
                ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                    layer_idx=layer, stage_idx=0, seq_len=n))
                conn.send_attn_output(h, ctx, torch.zeros(n, 5, device=device), topk_ids=_topk(rr, layer, n, device))
                reply = conn.recv_ffn_output(torch.empty_like(h), 0)
                got.append(reply[:, 0].tolist())
        else:
            conn.control_plane.update_state_from_dp_metadata(conn.control_plane.recv_dp_metadata_list())
            for layer in range(LAYERS):
                p = conn.recv_attn_output(0)
                t = p.parts["topk_ids"]
                got.append(t.tolist())
                # Reply with each row's first expert id, so the attention side sees the part came through.
                conn.send_ffn_output(t[:, :1].float().expand(-1, 8).contiguous(), p.context)
        conn.synchronize()
    finally:
        conn.close()
    return role, rr, got, conn.transport_kind


def check_add_a_part(results: list) -> None:
    """Every attention rank's ids reached the FFN rank in fan-in order, and came back in the replies."""
    for role, rr, got, _ in results:
        if role == "ffn":  # every attention rank's ids, in fan-in order, layer by layer
            assert got == [torch.cat([_topk(a, layer, n) for a, n in enumerate(COUNTS)]).tolist()
                           for layer in range(LAYERS)]
        else:
            assert got == [_topk(rr, layer, COUNTS[rr])[:, 0].float().tolist() for layer in range(LAYERS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strict", [False, True])
def test_add_a_part_moves_end_to_end_on_gloo(strict):
    check_add_a_part(run_workers(add_a_part_worker, 1 + len(COUNTS),
                                 (find_free_port(), strict, ("attention", "ffn")), timeout_s=90))


@pytest.mark.timeout(120)
def test_a_part_declared_on_one_role_only_is_refused_at_init():
    with pytest.raises(WorkerError, match="handshake mismatch in field 'wire'"):
        run_workers(add_a_part_worker, 1 + len(COUNTS), (find_free_port(), False, ("ffn",)), timeout_s=90)


def test_a_declared_part_is_checked_like_the_others():
    """The schedule checks the new part's rows and dtype; a missing one is refused on the caller's rank."""
    from afd_ext.metadata import AFDControlPayload
    from afd_ext.schedule import build_step_schedule
    from afd_ext.topology import Topology

    declare_topk()
    try:
        cfg = ScheduleConfig(num_layers=1, hidden_size=8, hidden_dtype=torch.float32)
        assert [p.name for p in cfg.wire_parts] == ["hidden", "topk_ids"]
        assert wire.handshake_field(cfg)[1] == ["a2f", "topk_ids", [K], "int32"]
        sch = build_step_schedule(Topology(1, 1), AFDControlPayload({0: [2]}), cfg)
        h = torch.zeros(2, 8)
        out = sch.check_attention_tensors(0, 0, h, topk_ids=torch.zeros(2, K, dtype=torch.int32))
        assert len(out) == 2 and out[0] is h
        with pytest.raises(ValueError, match="topk_ids missing"):
            sch.check_attention_tensors(0, 0, h)
        with pytest.raises(ValueError, match="topk_ids must be torch.int32"):
            sch.check_attention_tensors(0, 0, h, topk_ids=torch.zeros(2, K))
        with pytest.raises(ValueError, match=r"topk_ids must have shape \[2, 3\]"):
            sch.check_attention_tensors(0, 0, h, topk_ids=torch.zeros(2, K + 1, dtype=torch.int32))
        with pytest.raises(ValueError, match="already declared"):
            declare_topk()
    finally:
        wire.remove_part("topk_ids")
    assert [p.name for p in ScheduleConfig(1, 8, torch.float32).wire_parts] == ["hidden"]


@pytest.mark.parametrize("kwargs, what", [
    ({"name": "", "dtype": torch.int32}, "non-empty string"),
    ({"name": 5, "dtype": torch.int32}, "non-empty string"),
    ({"name": "p", "dtype": torch.complex64}, "dtype torch.complex64"),
    ({"name": "p", "dtype": "float32"}, "dtype 'float32'"),
    ({"name": "p", "dtype": torch.int32, "cols": 4}, "cols 4"),
    ({"name": "p", "dtype": torch.int32, "cols": (-3,)}, r"cols \(-3,\)"),
    ({"name": "p", "dtype": torch.int32, "present": "no"}, "present 'no'"),
    ({"name": "p", "dtype": torch.int32, "arg": 3}, "arg must be"),
    ({"name": "p", "dtype": torch.int32, "direction": "up"}, "direction"),
])
def test_a_bad_declaration_is_refused_before_it_is_kept(kwargs, what):
    n = len(wire._PARTS)
    with pytest.raises(AFDConfigError, match=what):
        wire.declare_part(**kwargs)
    assert len(wire._PARTS) == n


@pytest.mark.parametrize("kwargs, what", [
    ({"cols": lambda c: (0,)}, r"cols \(0,\)"),
    ({"cols": lambda c: [K]}, r"cols \[3\]"),
    ({"dtype": lambda c: torch.complex64}, "dtype torch.complex64"),
    ({"present": lambda c: 1}, "present 1"),
    ({"arg": "hidden_states"}, r"\['hidden', 'p'\] are all carried by the connector argument 'hidden_states'"),
])
def test_a_rule_of_the_wrong_kind_is_refused_when_the_layout_is_made(kwargs, what):
    wire.declare_part("p", **{"dtype": torch.int32, **kwargs})
    try:
        with pytest.raises(AFDConfigError, match=what):
            ScheduleConfig(num_layers=1, hidden_size=8, hidden_dtype=torch.float32).wire_parts
    finally:
        wire.remove_part("p")


_PART_NAMES = re.compile(r"hidden_scales|router_logits|token_ids")


def _py_identifiers(path: pathlib.Path) -> set[str]:
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in toks if t.type == tokenize.NAME}


def _cpp_identifiers(path: pathlib.Path) -> set[str]:
    src = re.sub(r"//[^\n]*|/\*.*?\*/", " ", path.read_text(), flags=re.S)  # comments
    src = re.sub(r'"(?:\\.|[^"\\])*"', '""', src)  # string literals
    return set(re.findall(r"[A-Za-z_]\w*", src))


def test_no_transport_op_or_csrc_file_names_a_wire_part(tmp_path):
    """The transports, the op wrappers and the C++ code move lists of parts and never name one."""
    files = sorted((ROOT / "afd_ext" / "transport").rglob("*.py")) + [ROOT / "afd_ext" / "ops.py"]
    named = {str(p.relative_to(ROOT)): sorted(i for i in _py_identifiers(p) if _PART_NAMES.search(i)) for p in files}
    cpp = [p for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in (".cpp", ".cu", ".h")]
    named.update({str(p.relative_to(ROOT)): sorted(i for i in _cpp_identifiers(p) if _PART_NAMES.search(i))
                  for p in cpp})
    assert len(files) >= 9 and len(cpp) >= 10
    assert {k: v for k, v in named.items() if v} == {}
    # The check can fail: it sees an identifier that names a part, and not a comment or a string.
    (tmp_path / "x.cpp").write_text('int has_token_ids = 0;  // router_logits\nauto s = "hidden_scales";\n')
    (tmp_path / "x.py").write_text('wire_split = 1  # router_logits\ns = "hidden_scales"\n')
    assert [i for i in _cpp_identifiers(tmp_path / "x.cpp") if _PART_NAMES.search(i)] == ["has_token_ids"]
    assert not [i for i in _py_identifiers(tmp_path / "x.py") if _PART_NAMES.search(i)]


def test_the_connector_takes_each_caller_part_by_its_keyword_and_no_scales_keyword():
    # FP8 scales are made by the transport from hidden_states (docs/fp8.md): no caller keyword carries them
    assert wire.declared_args("a2f") == ("hidden_states", "router_logits", "input_ids")
    assert wire.declared_args("f2a") == ("ffn_output",)
