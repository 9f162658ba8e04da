"""afd_ext under the reference vLLM AFD plugin's factory and runner call sequences (CPU tier, gloo).

The plugin is the test stand-in in ``tests/fake_afd_plugin`` (its contract
re-created from the reference's docs and repository); the call sequences are in
``tests/plugin_runners.py``. Multi-process runs are kept small (a few steps,
hidden 8) for the 2-core CI machine.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import plugin_runners as pr  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402

sys.path.insert(0, pr.FAKE_PLUGIN)
pytestmark = pytest.mark.timeout(240)


def _ffn(res, sc):
    return [r for r in res if r["role"] == "ffn"]


# ---------------------------------------------------------------------------
# Multi-process: the runners' call sequences (scenarios of one topology share processes)
# ---------------------------------------------------------------------------


def _run_all(*scs: pr.PluginScenario, timeout_s: float = 180.0) -> list:
    """Run scenarios of one topology in the same processes; returns one result list per scenario."""
    n = scs[0].nprocs
    res = run_workers(pr.dropin_worker, n, (tuple(scs), find_free_port(), pr.finish_barrier(n)), timeout_s=timeout_s)
    out = [[r[i] for r in res] for i in range(len(scs))]
    assert all(r["type"] == "AfdExtAFDConnector" for one in out for r in one)
    return out


def test_1a1f_eager_dbo_gate_on_attention_and_compiled_dbo_stage():
    eager = pr.PluginScenario(steps=({0: [3]}, {0: [5]}, {0: [2]}))
    # DBO: two stages in the ubatch threads' order (send s0, send s1, recv s0, send s0', recv s1, ...).
    dbo = pr.PluginScenario(steps=({0: [2], 1: [3]}, {0: [4], 1: [1]}))
    # Gate on attention, DeepSeek-style config: layer 0 dense (stays on attention), layers 1..3 MoE:
    # 3 exchanges per stage with router logits; the FFN runner passes routing_spec on each.
    gate = pr.PluginScenario(layers=4, gate=True, experts=4, steps=({0: [3]}, {0: [2], 1: [2]}))
    # A graph traced once and dispatched without guards (vLLM) carries the stage it saw while
    # tracing (0 here); the custom ops must ask vLLM's DBO for this thread's ubatch instead.
    frozen = pr.PluginScenario(steps=({0: [2], 1: [3]},), frozen_stage=True)
    r_eager, r_dbo, r_gate, r_frozen = _run_all(eager, dbo, gate, frozen)
    assert _ffn(r_eager, eager)[0]["steps"] == [[(0, [3])], [(0, [5])], [(0, [2])]]
    assert r_eager[1]["steps"] == [[(0, 3)], [(0, 5)], [(0, 2)]]
    assert _ffn(r_dbo, dbo)[0]["steps"] == [[(0, [2]), (1, [3])], [(0, [4]), (1, [1])]]
    assert _ffn(r_gate, gate)[0]["steps"] == [[(0, [3])], [(0, [2]), (1, [2])]]
    assert _ffn(r_frozen, frozen)[0]["steps"] == [[(0, [2]), (1, [3])]]


def test_capture_step_buffers_come_from_an_arena_eager_steps_never_touch():
    # The reference's FFN runner replays a captured graph without calling the connector, so
    # what a capture step received into must stay put while later eager steps (here a larger
    # one, which grows the eager buffers) run. On CPU the capture step itself runs eagerly.
    sc = pr.PluginScenario(layers=2, steps=({0: [4]}, {0: [4]}, {0: [9]}, {0: [4]}), capture_steps=(1,))
    (res,) = _run_all(sc)
    ffn = _ffn(res, sc)[0]
    eager0, captured, big, eager3 = ffn["buffers"][0]
    assert ffn["arenas"] and captured in ffn["arenas"][0]  # the capture step's fan-in buffer is the arena's
    assert captured not in (eager0, big, eager3)
    att = [r for r in res if r["role"] == "attention"][0]
    assert len(att["arenas"]) == 1  # the attention side reserves one too


def test_idle_dp_rank_and_attention_tp2_with_ffn_tp1():
    # DP2 attention, one FFN rank: a count of 0 becomes one row (clamp on by default under the plugin),
    # the rank runs a one-token dummy batch.
    idle = pr.PluginScenario(attn=(2, 1, 1), steps=({0: [0, 3]}, {0: [2, 0]}))
    # The roles' TP sizes differ: the handshake compares what both must agree on, not each role's TP.
    tp = pr.PluginScenario(attn=(1, 1, 2), ffn=(1, 1, 1), steps=({0: [3]}, {0: [1]}))
    r_idle, r_tp = _run_all(idle, tp)
    assert _ffn(r_idle, idle)[0]["steps"] == [[(0, [1, 3])], [(0, [2, 1])]]
    att = {r["role_rank"]: r["steps"] for r in r_idle if r["role"] == "attention"}
    assert att == {0: [[(0, 1)], [(0, 2)]], 1: [[(0, 3)], [(0, 1)]]}
    assert _ffn(r_tp, tp)[0]["steps"] == [[(0, [3, 3])], [(0, [1, 1])]]


def test_dp1_tp2_on_both_roles():
    sc = pr.PluginScenario(attn=(1, 1, 2), ffn=(1, 1, 2), steps=({0: [3]}, {0: [4]}))
    (res,) = _run_all(sc)
    # TP workers have distinct role ranks (from parallel_state), each pairs with its own FFN rank.
    assert sorted((r["role"], r["role_rank"]) for r in res) == [
        ("attention", 0), ("attention", 1), ("ffn", 0), ("ffn", 1)]
    assert [r["steps"] for r in _ffn(res, sc)] == [[[(0, [3])], [(0, [4])]]] * 2


def test_dp2_pcp2_tp2():
    # A = 8 attention workers; the per-DP vector [3, 5] is expanded over PCP x TP = 4 workers per DP rank.
    sc = pr.PluginScenario(attn=(2, 2, 2), ffn=(1, 1, 1), layers=2, steps=({0: [3, 5]},))
    (res,) = _run_all(sc)
    assert _ffn(res, sc)[0]["steps"] == [[(0, [3, 3, 3, 3, 5, 5, 5, 5])]]
    assert sorted(r["role_rank"] for r in res if r["role"] == "attention") == list(range(8))


# ---------------------------------------------------------------------------
# Single process: registration, configuration, role rank
# ---------------------------------------------------------------------------


@pytest.fixture
def plugin(monkeypatch):
    """A fresh stand-in plugin (its factory registry is class-level state)."""
    for name in [m for m in sys.modules if m == "afd_plugin" or m.startswith("afd_plugin.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "afd_ext.integrations.afd_plugin", raising=False)
    factory = importlib.import_module("afd_plugin.connectors.factory")
    adapter = importlib.import_module("afd_ext.integrations.afd_plugin")
    return types.SimpleNamespace(factory=factory.AFDConnectorFactory, adapter=adapter,
                                 config=importlib.import_module("afd_plugin.config"))


def _vc(**afd):
    sc = pr.PluginScenario()
    vc = pr.vllm_config(sc, afd.pop("role", "attention"), 0, 1239, torch.float32)
    vc.additional_config["afd"].update(afd)
    return vc


def test_import_afd_ext_needs_neither_vllm_nor_afd_plugin():
    import subprocess

    # Where vLLM and afd-plugin are installed too (make test-vllm): importing afd_ext loads neither.
    code = ("import sys, afd_ext, afd_ext.factory, afd_ext.connector; "
            "assert 'vllm' not in sys.modules and 'afd_plugin' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    # Where they are absent (made so by an import hook, whatever this environment has), the
    # integration module still imports and its entry point does nothing.
    code = ("import sys\n"
            "class Absent:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('vllm', 'afd_plugin'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, Absent())\n"
            "import afd_ext, afd_ext.factory, afd_ext.connector, afd_ext.integrations.afd_plugin as m\n"
            "assert not m.HAVE_AFD_PLUGIN; m.register()\n"
            "assert 'vllm' not in sys.modules and 'afd_plugin' not in sys.modules; print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_entry_point_registers_our_name_and_replaces_p2p_only_on_opt_in(plugin, monkeypatch):
    monkeypatch.delenv("AFD_EXT_REPLACE_P2P", raising=False)
    pr.entry_point()()
    assert plugin.factory.get_connector_class("AfdExtConnector") is plugin.adapter.AfdExtAFDConnector
    with pytest.raises(ModuleNotFoundError):  # still the reference's own (absent here) P2P module
        plugin.factory.get_connector_class("P2pNcclAFDConnector")
    monkeypatch.setenv("AFD_EXT_REPLACE_P2P", "1")
    pr.entry_point()()
    assert plugin.factory.get_connector_class("P2pNcclAFDConnector") is plugin.adapter.AfdExtAFDConnector


def test_reference_validation_refuses_our_name_and_applies_p2p_topology(plugin):
    with pytest.raises(ValueError, match="AFD connector must be one of"):
        plugin.config.parse_afd_config(_vc(connector="AfdExtConnector"))
    with pytest.raises(ValueError, match="multiple of num_ffn_ranks"):
        plugin.config.parse_afd_config(_vc(num_attention_ranks=3, num_ffn_ranks=2))


def test_factory_builds_afd_ext_with_the_reference_constructor(plugin, monkeypatch):
    from afd_ext.errors import AFDConfigError

    monkeypatch.setenv("AFD_EXT_REPLACE_P2P", "1")
    plugin.adapter.register()
    vc = _vc(connector_extra_config={"transport": "gloo", "strict": True})
    conn = plugin.factory.create_connector(5, 0, vc, plugin.config.parse_afd_config(vc))
    assert isinstance(conn, importlib.import_module("afd_plugin.connectors.base").AFDConnectorBase)
    inner = conn.connector
    assert (inner.hidden_size, inner.num_layers, inner.dtype) == (8, 3, torch.float32)
    assert inner.extra.clamp_idle_to_one and inner.extra.strict  # clamp defaults on; the rest is passed on
    assert "tp_size" not in inner.handshake_fields()  # each role's TP layout is its own
    assert conn.control_plane is not None and not conn.is_initialized
    with pytest.raises(AFDConfigError, match="strict needs enforce_eager"):
        graphs = _vc(connector_extra_config={"transport": "gloo", "strict": True})
        graphs.model_config.enforce_eager = False
        plugin.factory.create_connector(0, 0, graphs, plugin.config.parse_afd_config(graphs))
    with pytest.raises(AFDConfigError, match="fp8_delivery 'fp8'.*use 'dequant'"):  # at construction, not at step 1
        fp8 = _vc(connector_extra_config={"transport": "gloo", "hidden_wire_dtype": "fp8_e4m3", "fp8_delivery": "fp8"})
        plugin.factory.create_connector(0, 0, fp8, plugin.config.parse_afd_config(fp8))
    ids = _vc(connector_extra_config={"transport": "gloo", "send_token_ids": "true"})
    assert plugin.factory.create_connector(0, 0, ids, plugin.config.parse_afd_config(ids)).connector.send_token_ids
    with pytest.raises(ValueError, match="unknown connector_extra_config field"):
        bad = _vc(connector_extra_config={"transport": "gloo", "wire": "packed"})
        plugin.factory.create_connector(0, 0, bad, plugin.config.parse_afd_config(bad))
    for role, on_exit, refused in (("ffn", "rejoin", True), ("attention", "rejoin", False), ("ffn", "exit", False)):
        graphs = _vc(role=role, connector_extra_config={"transport": "gloo", "on_attention_exit": on_exit})
        graphs.model_config.enforce_eager = False  # the FFN runner would replay another generation's graphs
        cfg = plugin.config.parse_afd_config(graphs)
        if refused:
            with pytest.raises(AFDConfigError, match="on_attention_exit 'rejoin' needs enforce_eager"):
                plugin.factory.create_connector(0, 0, graphs, cfg)
        else:
            assert plugin.factory.create_connector(0, 0, graphs, cfg).extra_info.config.on_attention_exit == on_exit
    with pytest.raises(AFDConfigError, match="on_attention_exit must be 'exit' or 'rejoin', got 'wait'"):
        bad = _vc(connector_extra_config={"transport": "gloo", "on_attention_exit": "wait"})
        plugin.factory.create_connector(0, 0, bad, plugin.config.parse_afd_config(bad))
    off = _vc(connector_extra_config={"transport": "gloo", "clamp_idle_to_one": False})
    conn_off = plugin.factory.create_connector(0, 0, off, plugin.config.parse_afd_config(off))
    assert not conn_off.connector.extra.clamp_idle_to_one


@pytest.mark.parametrize("base_name", ["afd_plugin.connectors.base.AFDConnectorBase",
                                       "afd_plugin.connectors.base.AFDControlPlane"])
def test_a_newer_afd_plugin_base_with_a_member_afd_ext_lacks_is_named_at_construction(request, monkeypatch,
                                                                                      base_name):
    # A newer afd-plugin whose base declares one more abstract member: the factory's construction raises
    # afd_ext's error naming it and both versions (Python's own TypeError would surface inside vLLM).
    import abc

    from afd_ext.errors import AFDConfigError

    ours = lambda n: n in ("afd_plugin", "afd_ext.integrations.afd_plugin") or n.startswith("afd_plugin.")  # noqa: E731
    for name in [m for m in sys.modules if ours(m)]:
        monkeypatch.delitem(sys.modules, name)
    # The modules built on the patched base go before monkeypatch puts the originals back.
    request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules) if ours(m)])
    module, cls_name = base_name.rsplit(".", 1)
    base = getattr(importlib.import_module(module), cls_name)
    monkeypatch.setattr(base, "drain_stage", abc.abstractmethod(lambda self: None), raising=False)
    monkeypatch.setattr(base, "__abstractmethods__", base.__abstractmethods__ | {"drain_stage"})
    adapter = importlib.import_module("afd_ext.integrations.afd_plugin")  # subclasses the newer base
    monkeypatch.setattr(adapter, "versions", lambda: {"afd_ext": "0.1.0", "afd_plugin": "0.9.1", "vllm": None})
    adapter.register()
    factory = importlib.import_module("afd_plugin.connectors.factory").AFDConnectorFactory
    vc = _vc(connector="AfdExtConnector", connector_extra_config={"transport": "gloo"})
    cfg = importlib.import_module("afd_plugin.config").parse_afd_config(vc, validate=False)
    with pytest.raises(AFDConfigError) as e:
        factory.create_connector(0, 0, vc, cfg)
    assert str(e.value).startswith(f"afd_ext 0.1.0 does not implement {cls_name}.drain_stage, abstract in the "
                                   "installed afd-plugin 0.9.1: "), e.value


def test_declares_the_capabilities_newer_afd_plugin_modules_read(plugin):
    # afd-plugin's newer attention modules read connector.yield_after_attn_send (no getattr default).
    plugin.adapter.register()
    vc = _vc(connector="AfdExtConnector", connector_extra_config={"transport": "gloo"})
    conn = plugin.factory.create_connector(0, 0, vc, plugin.config.parse_afd_config(vc, validate=False))
    assert conn.yield_after_attn_send is True


def test_untested_vllm_version_is_warned_once_naming_the_tested_ones(plugin, monkeypatch, caplog):
    import logging
    import re
    from pathlib import Path

    m = plugin.adapter
    # One source: every pinned test-vllm environment is a tested version, and no other.
    pins = sorted(Path(__file__).parent.glob("integration_vllm/pins*.txt"))
    pinned = [re.search(r"^vllm==(\S+)$", p.read_text(), re.M).group(1) for p in pins]
    assert sorted(pinned) == sorted(m.TESTED_VLLM_VERSIONS), (pins, pinned)
    inner = types.SimpleNamespace(control_plane=types.SimpleNamespace(channels={0: types.SimpleNamespace(kind="tcp")}),
                                  transport_kind="nccl", attn_size=2, ffn_size=1,
                                  peer_map=types.SimpleNamespace(me="FFN rank 0 (world rank 0)"))
    conn = types.SimpleNamespace(_inner=inner)
    caplog.set_level(logging.INFO, logger=m.__name__)
    for tested in m.TESTED_VLLM_VERSIONS:
        monkeypatch.setattr(m, "versions", lambda: {"afd_ext": "0.1.0", "vllm": tested, "afd_plugin": "0.0.0"})
        m._log_connected(conn)
    assert [r.levelname for r in caplog.records] == ["INFO"] * len(m.TESTED_VLLM_VERSIONS)
    assert caplog.records[0].getMessage() == (f"afd_ext 0.1.0 is the AFD connector (vLLM {m.TESTED_VLLM_VERSIONS[0]}, "
                                              "afd-plugin 0.0.0): FFN rank 0 (world rank 0), transport nccl, "
                                              "topology 2A1F, control channel tcp")
    caplog.clear()
    monkeypatch.setattr(m, "versions", lambda: {"afd_ext": "0.1.0", "vllm": "0.27.1", "afd_plugin": "0.0.0"})
    m._log_connected(conn)
    m._log_connected(conn)  # a second connector in the same process: no second warning
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING", "INFO"]
    assert caplog.records[1].getMessage() == (f"afd_ext is tested with vLLM {', '.join(m.TESTED_VLLM_VERSIONS)} "
                                              "(make test-vllm); this is vLLM 0.27.1")


def _spec(vc, gate, extra, role="attention"):
    from afd_ext.integrations.afd_plugin import AdapterExtraConfig, exchange_spec

    return exchange_spec(vc, types.SimpleNamespace(role=role, compute_gate_on_attention=gate),
                         AdapterExtraConfig.from_mapping(extra))


def test_exchange_spec_gate_on_attention_counts_moe_layers_and_router_width():
    from afd_ext.spec import moe_layer_indices

    ns = types.SimpleNamespace
    ds = ns(hidden_size=16, num_hidden_layers=6, first_k_dense_replace=2, moe_layer_freq=2, n_routed_experts=64)
    assert moe_layer_indices(ds, 6) == (2, 4)
    qwen = ns(hidden_size=16, num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0], num_experts=8)
    assert moe_layer_indices(qwen, 4) == (1, 2, 3)
    vc = ns(model_config=ns(dtype=torch.bfloat16, hf_config=ds, hf_text_config=None),
            parallel_config=ns(data_parallel_size=2, prefill_context_parallel_size=2, tensor_parallel_size=2))
    spec = _spec(vc, True, {})
    assert dataclasses.asdict(spec) == dict(hidden_size=16, num_layers=2, dtype=torch.bfloat16,
                                            router_logits_width=64, router_logits_dtype=torch.bfloat16,
                                            send_token_ids=False, tp_size=4)  # PCP x TP workers per DP rank
    spec = _spec(vc, True, {"router_logits_dtype": "float32", "num_exchange_layers": 5, "send_token_ids": True})
    assert (spec.num_layers, spec.router_logits_dtype, spec.send_token_ids) == (5, torch.float32, True)
    assert _spec(vc, False, {}).num_layers == 6 and _spec(vc, False, {}).router_logits_width is None
    assert _spec(vc, False, {}, role="ffn").tp_size == 1  # an FFN rank does not know the attention layout


def test_exchange_spec_says_what_is_missing():
    from afd_ext.errors import AFDConfigError

    ns = types.SimpleNamespace
    with pytest.raises(AFDConfigError, match="hidden_size.*num_hidden_layers.*dtype"):
        _spec(ns(model_config=ns(hf_config=ns())), False, {})
    dense = ns(model_config=ns(dtype=torch.float16, hf_config=ns(hidden_size=8, num_hidden_layers=2)))
    with pytest.raises(AFDConfigError, match="router width.*num_exchange_layers"):
        _spec(dense, True, {})


def test_afd_ext_create_connector_takes_a_vllm_config_and_derives_the_role_rank(monkeypatch):
    from afd_ext.config import parse_afd_config
    from afd_ext.factory import create_connector, resolve_role_rank

    sc = pr.PluginScenario(attn=(2, 2, 2))
    vc = pr.vllm_config(sc, "attention", 1, 1239, torch.float32)
    vc.additional_config["afd"]["connector"] = "AfdExtConnector"
    cfg = parse_afd_config(vc)  # a VllmConfig-like object, not only the mapping
    assert cfg.num_attention_ranks == 8
    for name in ("vllm", "vllm.distributed", "vllm.distributed.parallel_state"):
        monkeypatch.setitem(sys.modules, name, None)  # not importable, even where vLLM is installed
    with pytest.raises(ValueError, match="parallel_state is not importable"):
        resolve_role_rank(vc, cfg)
    pr.install_fake_vllm(pcp_rank=1, tp_rank=1)
    try:
        assert resolve_role_rank(vc, cfg) == 7  # (1 * 2 + 1) * 2 + 1, the reference's DP2PCP2TP2 case
        conn = create_connector(7, 0, vc, hidden_size=8, num_layers=1)
        assert conn.role_rank == 7
        pr.install_fake_vllm(pcp_rank=0, tp_rank=1)
        assert resolve_role_rank(vc, cfg) == 5  # TP ranks never collapse
        vc.parallel_config.data_parallel_rank = 2
        with pytest.raises(ValueError, match="out of range.*dp x pcp x tp"):
            resolve_role_rank(vc, cfg)
    finally:
        for name in ("vllm", "vllm.distributed", "vllm.distributed.parallel_state"):
            sys.modules.pop(name, None)


def test_payload_from_the_references_class_by_fields():
    from afd_plugin.connectors.metadata import AFDControlPayload as RefPayload
    from afd_plugin.connectors.metadata import AFDDPMetadata as RefMd

    from afd_ext.metadata import AFDControlPayload

    ref = RefPayload({1: RefMd(torch.tensor([0, 4])), 0: RefMd(torch.tensor([2, 2]))}, True, False)
    p = AFDControlPayload.from_fields(ref)
    assert p.stage_counts() == {0: (2, 2), 1: (0, 4)}
    assert (p.is_graph_capturing, p.is_warmup, p.is_graph_replaying) == (True, False, False)
    with pytest.raises(ValueError, match="dp_metadata_list"):
        AFDControlPayload.from_fields(object())


def test_attention_side_compiled_once_and_reused_across_counts():
    # fullgraph=True: a graph break is an error. The counts differ every step (>= 2: Dynamo
    # specialises sizes 0 and 1); the compiled forward must call the connector on every step.
    sc = pr.PluginScenario(layers=3, steps=({0: [3]}, {0: [5]}, {0: [2]}, {0: [7]}))
    res = run_workers(pr.compiled_attention_worker, sc.nprocs,
                      (sc, find_free_port(), "aot_eager", pr.finish_barrier(sc.nprocs)), timeout_s=180.0)
    att = [r for r in res if r["role"] == "attention"][0]
    # One graph for all four steps, holding one send and one receive per exchange layer.
    assert att["graphs"] == [2 * sc.layers]


# ---------------------------------------------------------------------------
# afd_ext's own connector given a VllmConfig (afd_ext.factory.create_connector)
# ---------------------------------------------------------------------------


def _native(sc: pr.PluginScenario, role: str, role_rank: int):
    from afd_ext.factory import create_connector

    vc = pr.vllm_config(sc, role, 0, 1239, torch.float32)
    vc.additional_config["afd"]["connector"] = "AfdExtConnector"
    return create_connector(0, 0, vc, role_rank=role_rank)


def test_native_handshake_does_not_compare_each_roles_tp():
    sc = pr.PluginScenario(attn=(1, 1, 2), ffn=(1, 1, 1), extra=(("transport", "gloo"),))
    att, ffn = _native(sc, "attention", 0), _native(sc, "ffn", 0)
    assert att.handshake_fields() == ffn.handshake_fields()


def test_native_dp2_pcp2_tp2_expands_the_per_dp_vector():
    sc = pr.PluginScenario(attn=(2, 2, 2), extra=(("transport", "gloo"),))
    att = _native(sc, "attention", 0)
    assert att.topology.expand_counts([3, 5]) == (3, 3, 3, 3, 5, 5, 5, 5)
    # An attention rank knows its DP size: a vector per PCP or TP worker group is refused (nothing moved).
    with pytest.raises(ValueError, match="count vector has 4 entries; expected 8 .* or 2"):
        att.topology.expand_counts([1, 2, 3, 4])


def test_adapter_checks_before_anything_moves(plugin, monkeypatch):
    # The check runs before the (here uninitialised) connector is touched.
    from afd_plugin.connectors.metadata import AFDExpertRoutingSpec

    from afd_ext.errors import AFDConfigError

    plugin.adapter.register()
    vc = _vc(connector="P2pNcclAFDConnector", compute_gate_on_attention=True,
             connector_extra_config={"transport": "gloo"})
    vc.model_config.hf_config.first_k_dense_replace, vc.model_config.hf_config.n_routed_experts = 1, 4
    monkeypatch.setitem(vc.additional_config["afd"], "connector", "AfdExtConnector")
    cfg = plugin.config.parse_afd_config(vc, validate=False)
    att = plugin.factory.create_connector(0, 0, vc, cfg)
    assert att.connector.num_layers == 2  # layers 1, 2 of 3 are MoE
    vc.additional_config["afd"]["role"] = "ffn"
    ffn = plugin.factory.create_connector(0, 0, vc, plugin.config.parse_afd_config(vc, validate=False))
    with pytest.raises(AFDConfigError, match=r"routing_spec is \[4\] torch.bfloat16.*router_logits_dtype"):
        ffn.recv_attn_output(ubatch_idx=0, routing_spec=AFDExpertRoutingSpec(4, torch.bfloat16))


def test_the_adapter_forwards_a_declared_part(plugin, monkeypatch):
    # A part declared through afd_ext.wire reaches the connector under the plugin too: eager, and through the
    # custom op a torch.compile trace calls (the op takes the parts as a list, in the adapter's part_args order).
    from afd_plugin.connectors.metadata import AFDTransferContext, AFDTransferMetadata

    from afd_ext import wire

    wire.declare_part("topk_ids", dtype=torch.int32, cols=(3,))
    try:
        plugin.adapter.register()
        vc = _vc(connector="AfdExtConnector", connector_extra_config={"transport": "gloo"})
        att = plugin.factory.create_connector(0, 0, vc, plugin.config.parse_afd_config(vc, validate=False))
    finally:
        wire.remove_part("topk_ids")
    assert att.part_args[-1] == "topk_ids"
    got = []
    monkeypatch.setattr(att._inner, "send_attn_output", lambda h, ctx, **kw: got.append((ctx.metadata, kw)))
    h, topk = torch.zeros(2, 8), torch.ones(2, 3, dtype=torch.int32)
    md = AFDTransferMetadata.create_attention_metadata(layer_idx=1, stage_idx=0, seq_len=2)
    att.send_attn_output(h, AFDTransferContext(metadata=md), topk_ids=topk)
    torch.ops.afd_ext_plugin.send_attn_output(h, [None] * (len(att.part_args) - 1) + [topk], att._handle, 1, 0)
    assert [kw["topk_ids"] is topk for _, kw in got] == [True, True]
    assert got[1][0].layer_idx == 1 and got[1][0].seq_lens == [2]


def test_orderly_close_ends_only_the_plugins_ffn_loop_thread(plugin, monkeypatch):
    # afd-plugin's FFN loop records any Exception as a failure; after an orderly close its thread
    # (and only that thread) gets SystemExit, which threading ends quietly. Any other caller gets
    # the named error, and a receive that fails without a close is never turned into an exit.
    import threading

    from afd_ext.errors import AFDStateError

    plugin.adapter.register()
    vc = _vc(role="ffn", connector_extra_config={"transport": "gloo"})
    monkeypatch.setitem(vc.additional_config["afd"], "connector", "AfdExtConnector")
    conn = plugin.factory.create_connector(0, 0, vc, plugin.config.parse_afd_config(vc, validate=False))

    def recv_on(name):
        box = {}

        def run():
            try:
                conn.control_plane.recv_dp_metadata_list()
            except BaseException as e:  # noqa: BLE001 - what the thread's target would see
                box["e"] = e

        t = threading.Thread(target=run, name=name)
        t.start()
        t.join(30)
        return box["e"]

    loop = "afd-ffn-worker-loop"  # the name afd-plugin's AFDFFNWorker gives its loop thread
    assert type(recv_on(loop)) is AFDStateError  # never initialised, never closed: a failure
    conn.close()
    e = recv_on(loop)
    assert type(e) is SystemExit and isinstance(e.__cause__, AFDStateError), repr(e)
    assert "AFD FFN worker loop ended: this FFN rank's connector was closed" in str(e)
    assert type(recv_on("some-other-thread")) is AFDStateError
    with pytest.raises(AFDStateError):  # the main thread: never SystemExit
        conn.control_plane.recv_dp_metadata_list()


def test_native_connector_takes_the_references_objects_in_the_runners_sequence():
    # afd_ext's own connector (no adapter) under the runners' calls and the reference's classes.
    sc = pr.PluginScenario(steps=({0: [3]}, {0: [2], 1: [4]}), native=True)
    res = run_workers(pr.dropin_worker, sc.nprocs, (sc, find_free_port(), pr.finish_barrier(sc.nprocs)),
                      timeout_s=90.0)
    assert {r["type"] for r in res} == {"AFDConnector"}
    assert _ffn(res, sc)[0]["steps"] == [[(0, [3])], [(0, [2]), (1, [4])]]


def test_native_connector_reads_gate_on_attention_from_the_config():
    sc = pr.PluginScenario(layers=4, gate=True, experts=4, extra=(("transport", "gloo"),))
    att = _native(sc, "attention", 0)
    assert (att.num_layers, att.router_logits_width) == (3, 4)


@pytest.mark.parametrize("control", ["shm", "tcp"])
@pytest.mark.parametrize("first", ["ffn", "attention"])
def test_a_stop_with_a_step_in_flight_ends_the_ffn_loop_quietly_and_names_the_closed_peer(first, control):
    """Issue 41 item 2: the FFN loop thread waits in recv_attn_output (step 2 in flight). A local close() of
    the FFN rank, or attention rank 1's close(), ends it within 1 s with nothing recorded as a failure (a
    quiet SystemExit); an attention rank waiting for its reply gets PeerClosedError naming who closed."""
    sc = pr.PluginScenario(attn=(2, 1, 1), steps=({0: [2, 3]}, {0: [1, 2]}), layers=1,
                           extra=(("control_channel", control), ("step_timeout_s", 60.0)))
    ffn, a0, a1 = run_workers(pr.stop_mid_step_worker, 3, (sc, find_free_port(), first, pr.finish_barrier(3)),
                              timeout_s=180)
    assert not ffn["alive"] and ffn["loop_ended_s"] < 1.0, ffn
    assert ffn["failures"] == [] and ffn["hooked"] == ["SystemExit"], ffn
    closer = "FFN rank 0 (world rank 0)" if first == "ffn" else "attention rank 1 (world rank 2)"
    for a in ([a0, a1] if first == "ffn" else [a0]):
        assert a["error"] == "PeerClosedError" and f"aborted by {closer}" in a["msg"], a
        assert "closed its connector (an orderly close(), not a failure)" in a["msg"], a
        assert a["took"] < 10.0, a  # step_timeout_s is 60


@pytest.mark.parametrize("how,attn", [("close", 1), ("killed", 1), ("timeout", 1), ("close", 2)],
                         ids=["close", "killed", "timeout", "2A1F-close"])
def test_on_attention_exit_rejoin_serves_restarted_attention_processes_on_the_same_ffn_loop(how, attn):
    """Issue 45: with on_attention_exit "rejoin", every attention process exits between steps (a goodbye,
    or SIGKILL), new ones start, and the same FFN loop thread serves them (replies checked exactly), logging
    at WARNING whom it waits for. Then a local close() ends the next wait at once (a quiet SystemExit), or
    the wait passes init_timeout_s: a named RendezvousTimeoutError the loop records. 1A1F and 2A1F (DP 2)."""
    import multiprocessing as mp
    import time

    lives = ((({0: [3]}, {0: [2]}), ({0: [4]}, {0: [1]}, {0: [2]})) if attn == 1 else
             (({0: [3, 2]}, {0: [0, 4]}), ({0: [1, 2]},)))
    sc = pr.PluginScenario(attn=(attn, 1, 1), layers=2, extra=(("on_attention_exit", "rejoin"),
                                                                ("init_timeout_s", 30.0), ("heartbeat_timeout_s", 1.0)))
    ctx = mp.get_context("spawn")
    q, go, port = ctx.Queue(), ctx.Event(), find_free_port()
    procs = []

    def run(ranks, life):
        """Start ``ranks`` in their ``life``-th processes; their records by rank once they exited (reaped)."""
        started = {r: ctx.Process(target=pr.rejoin_worker, args=(r, life, sc, port, lives, how, go, q))
                   for r in ranks}
        procs.extend(started.values())
        for p in started.values():
            p.start()
        if 0 in ranks:
            return {}
        got = [q.get(timeout=180) for _ in ranks]
        assert all(g[1] == life and isinstance(g[2], dict) for g in got), got
        for p in started.values():
            p.join(60)
            assert p.exitcode == (-9 if how == "killed" and life == 0 else 0), p.exitcode
        return {g[0]: g[2] for g in got}

    try:
        run([0], 0)
        a = [run(range(1, 1 + attn), 0)]
        time.sleep(3.5)  # one interval (init_timeout_s / 10) of the FFN rank's wait passes
        a.append(run(range(1, 1 + attn), 1))
        go.set()
        got = q.get(timeout=180)
        assert got[:2] == (0, 0) and isinstance(got[2], dict), got
        ffn = got[2]
    finally:
        for p in procs:
            p.kill() if p.is_alive() else None
    for r in range(attn):  # every reply checked, in each life
        assert [recs[1 + r]["steps"] for recs in a] == [[[(0, max(1, c[0][r]))] for c in life] for life in lives]
    want = [[(0, [max(1, n) for n in c[0]])] for life in lives for c in life]  # an idle DP rank: one row
    assert ffn["steps"] == want, ffn  # one loop thread served every life
    assert not ffn["alive"] and not ffn["initialized"], ffn
    waits = [m for m in ffn["logged"] if "on_attention_exit is 'rejoin': waiting up to init_timeout_s" in m]
    assert len(waits) == 2 and all(m.startswith("WARNING ") for m in waits), ffn["logged"]
    assert ("PeerDeadError" if how == "killed" else "ControlChannelClosed") in waits[0], waits
    still = [m for m in ffn["logged"] if "still waits for" in m and "attention rank 0 (world rank 1)" in m]
    assert still and all(m.startswith("WARNING afd_ext.rendezvous") for m in still), ffn["logged"]
    if how == "timeout":
        assert ffn["hooked"] == [] and len(ffn["failures"]) == 1, ffn
        assert ffn["failures"][0].startswith("RendezvousTimeoutError: ") and "attention rank 0" in ffn["failures"][0]
    else:
        assert ffn["failures"] == [] and ffn["hooked"] == ["SystemExit"], ffn
        assert ffn["ended_s"] < 1.0, ffn  # init_timeout_s is 30
