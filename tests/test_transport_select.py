"""The one transport selection rule: explicit name, else the tensors' device, else the machine; logged once."""

from __future__ import annotations

import logging

import pytest
import torch

import afd_ext.transport as tp
from afd_ext.errors import AFDConfigError
from afd_ext.transport.gloo import GlooTransport
from afd_ext.transport.nccl import NcclTransport


@pytest.fixture
def nccl_runs(monkeypatch):
    """Set whether NCCL can run here: None (it can) or a reason (it cannot)."""
    def set_(reason):
        monkeypatch.setattr(NcclTransport, "unavailable", classmethod(lambda cls: reason))
    return set_


def test_explicit_name_wins(nccl_runs):
    nccl_runs("no GPU is visible")
    assert tp.select_transport("nccl") == ("nccl", "configured")  # the user asked; init will say if it cannot
    assert tp.select_transport("gloo", device="cpu").name == "gloo"
    with pytest.raises(AFDConfigError, match="unknown AFD transport 'nvlink'"):
        tp.select_transport("nvlink")


def test_auto_follows_the_tensors(nccl_runs):
    nccl_runs(None)
    assert tp.select_transport("auto", device="cpu") == ("gloo", "auto: the tensors are on cpu")
    nccl_runs("no GPU is visible")
    # the tensors decide (a missing GPU surfaces at init); NCCL first, peer memory if it cannot serve the world
    assert tp.select_transport("auto", device=torch.device("cuda", 1)) == (
        "nccl", "auto: the tensors are on cuda, else peer if it cannot serve this AFD world")
    with pytest.raises(AFDConfigError, match="no AFD transport moves META tensors"):
        tp.select_transport("auto", device="meta")


def test_auto_follows_the_machine(nccl_runs):
    nccl_runs(None)
    assert tp.select_transport() == ("nccl", "auto: nccl can run here, else peer then gloo if it cannot serve "
                                             "this AFD world")
    nccl_runs("no GPU is visible")  # the peer plane needs what NCCL needs
    assert tp.select_transport() == ("gloo", "auto: not nccl: no GPU is visible; not peer: no GPU is visible")
    nccl_runs("afd_ext was built without CUDA")
    assert tp.select_transport().why.startswith("auto: not nccl: afd_ext was built without CUDA")
    assert tp.transport_availability() == {"nccl": "afd_ext was built without CUDA",
                                           "peer": "afd_ext was built without CUDA", "gloo": None}


def test_the_real_nccl_check_matches_this_machine():
    from afd_ext import ops

    can = ops.is_cuda_built() and torch.cuda.device_count() > 0
    assert (NcclTransport.unavailable() is None) is can
    assert GlooTransport.unavailable() is None


def test_each_decision_is_logged_once(nccl_runs, caplog, monkeypatch):
    monkeypatch.setattr(tp, "_logged", set())
    nccl_runs("no GPU is visible")
    with caplog.at_level(logging.INFO, logger="afd_ext.transport"):
        for _ in range(3):
            tp.select_transport()
        tp.select_transport("auto", device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "afd_ext.transport"]
    assert lines == ["afd_ext: transport gloo (auto: not nccl: no GPU is visible; not peer: no GPU is visible)",
                     "afd_ext: transport gloo (auto: the tensors are on cpu)"]


def test_a_registered_plane_with_auto_goes_first_where_it_runs(nccl_runs, monkeypatch):
    """How the peer-memory data plane extends the rule: register with auto=True, answer unavailable()."""
    monkeypatch.setattr(tp, "AUTO_ORDER", list(tp.AUTO_ORDER))
    monkeypatch.setattr(tp, "_REGISTRY", dict(tp._REGISTRY))

    class PeerMemory(NcclTransport):
        kind = "peer_memory"
        reason: str | None = None

        @classmethod
        def unavailable(cls):
            return cls.reason

    tp.register_transport("peer_memory", PeerMemory, auto=True)
    from afd_ext.transport.peer import PeerTransport

    monkeypatch.setattr(tp, "transport_class", lambda n: PeerMemory if n == "peer_memory" else
                        {"peer": PeerTransport, "nccl": NcclTransport, "gloo": GlooTransport}[n])
    nccl_runs(None)
    assert tp.AUTO_ORDER[0] == "peer_memory"
    assert tp.select_transport().name == "peer_memory"
    PeerMemory.reason = "the peers are on other hosts"
    assert tp.select_transport() == ("nccl", "auto: not peer_memory: the peers are on other hosts, else peer "
                                             "then gloo if it cannot serve this AFD world")
    assert tp.select_transport("auto", device="cuda:0").name == "peer_memory"  # first that moves CUDA tensors


def test_connector_defaults_to_gloo_on_cpu_and_a_cuda_transport_with_a_gpu(nccl_runs):
    from afd_ext.config import AFDConfig
    from afd_ext.factory import create_connector

    cfg = AFDConfig.from_dict({"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 1})
    assert cfg.extra_config().transport == "auto"
    nccl_runs("no GPU is visible")
    conn = create_connector(0, 0, cfg, role_rank=0, hidden_size=8, num_layers=1)
    assert conn.transport_kind == "gloo" and conn.device == torch.device("cpu")
    nccl_runs(None)
    conn = create_connector(0, 1, cfg, role_rank=0, hidden_size=8, num_layers=1)
    # Peer memory stays behind NCCL until a two-GPU timing shows it ahead (issue #35).
    assert conn.transport_kind == "nccl" and conn.device == torch.device("cuda", 1)
    conn = create_connector(0, 1, cfg, role_rank=0, hidden_size=8, num_layers=1, device="cpu")
    assert conn.transport_kind == "gloo"  # the tensors decide before the machine
    with pytest.raises(AFDConfigError, match="the gloo transport moves CPU tensors"):
        create_connector(0, 0, AFDConfig.from_dict({"role": "ffn", "connector_extra_config": {"transport": "gloo"}}),
                         role_rank=0, hidden_size=8, num_layers=1, device="cuda:0")


H, L = 16, 2


def _readme_worker(rank: int, nprocs: int, port: int) -> int:
    """The README's excerpt filled in: no transport, no device, bf16 (CUDA hidden: the rule must pick gloo).

    Every statement of the README's excerpt appears here verbatim
    (:func:`test_readme_excerpt_is_what_the_test_runs` checks it).
    """
    from afd_ext.config import AFDConfig
    from afd_ext.factory import create_connector
    from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    host, local_rank, stage = "127.0.0.1", 0, 0
    role = "ffn" if rank == 0 else "attention"
    role_rank = 0 if role == "ffn" else rank - 1
    cfg = AFDConfig.from_dict({"role": role, "host": host, "port": port,
                               "num_attention_ranks": 2, "num_ffn_ranks": 1})
    conn = create_connector(rank, local_rank, cfg, role_rank=role_rank,
                            hidden_size=H, num_layers=L, dtype=torch.bfloat16)
    assert conn.transport_kind == "gloo"
    conn.init_afd_connector()
    try:
        if role == "ffn":
            conn.control_plane.update_state_from_dp_metadata(conn.control_plane.recv_dp_metadata_list())
            for _layer in range(L):
                a2f = conn.recv_attn_output(ubatch_idx=stage)
                conn.send_ffn_output(mlp(a2f.hidden_states), a2f.context)
            return 0
        payload = AFDControlPayload(dp_metadata_list={0: [3, 5]})
        conn.control_plane.update_state_from_dp_metadata(payload)
        conn.control_plane.send_dp_metadata_list(payload)
        hidden_states = torch.ones(payload.dp_metadata_list[0].num_tokens_across_dp_cpu[role_rank], H,
                                   dtype=torch.bfloat16)
        for layer in range(L):
            ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                layer_idx=layer, stage_idx=stage, seq_len=hidden_states.shape[0]))
            conn.send_attn_output(hidden_states, ctx)
            hidden_states = conn.recv_ffn_output(hidden_states, ubatch_idx=stage)
        assert torch.equal(hidden_states, torch.full_like(hidden_states, 4))
        return int(hidden_states.shape[0])
    finally:
        conn.close()


def test_readme_excerpt_is_what_the_test_runs():
    """Each statement of the README's python excerpt is one the worker above runs (compared as syntax trees)."""
    import ast
    import inspect
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "create_connector(" in b]
    excerpt = [ast.dump(st) for st in ast.parse(block).body]
    assert len(excerpt) >= 12, block
    module = ast.parse(inspect.getsource(inspect.getmodule(_readme_worker)))
    ran = {ast.dump(n) for n in ast.walk(module) if isinstance(n, ast.stmt)}
    missing = [ast.unparse(st) for st, d in zip(ast.parse(block).body, excerpt) if d not in ran]
    assert not missing, f"README excerpt statements the test does not run: {missing}"


@pytest.mark.timeout(120)
def test_readme_snippet_runs_on_a_cpu_machine_as_written():
    from afd_ext.tools.testing import find_free_port, run_workers

    rows = run_workers(_readme_worker, 3, (find_free_port(),), timeout_s=100, env={"CUDA_VISIBLE_DEVICES": ""})
    assert rows == [0, 3, 5]
