"""The reference vLLM AFD plugin's runner call sequences, driving afd_ext through the plugin's own factory.

Shared by ``tests/test_afd_plugin_dropin.py`` (CPU tier, gloo) and
``tests/gpu/test_afd_plugin_gpu.py`` (GPU tier, NCCL). Each worker is a
module-level ``fn(rank, nprocs, ...)`` for :func:`afd_ext.tools.testing.run_workers`:
ranks ``0..F-1`` are FFN workers, ``F..F+A-1`` attention workers.

What each worker does, as a vLLM worker with the reference plugin would
(sequences read from ``afd_plugin/v1/worker/*_model_runner.py``,
``ffn_worker.py`` and ``model_executor/models/deepseek_v2.py`` at ``2e4378f``):

* puts ``tests/fake_afd_plugin`` on ``sys.path`` (the reference's contract,
  re-created) and a stand-in ``vllm.distributed.parallel_state`` in
  ``sys.modules`` that reports this worker's PCP and TP ranks;
* calls the ``vllm.general_plugins`` entry point declared in ``pyproject.toml``
  (with ``AFD_EXT_REPLACE_P2P=1``), parses the config with the plugin's own
  validating ``parse_afd_config(vllm_config, expected_role=role)`` and builds
  the connector with ``AFDConnectorFactory.create_connector(rank, local_rank,
  vllm_config, afd_config)``, which resolves the role rank itself;
* attention, per step: builds the plugin's ``AFDControlPayload`` of
  ``AFDDPMetadata`` (per-DP counts), calls
  ``control_plane.update_state_from_dp_metadata`` then
  ``send_dp_metadata_list``; then the model's proxy per (layer, stage):
  ``send_attn_output(h, AFDTransferContext(AFDTransferMetadata.create_attention_metadata(...)))``
  and ``recv_ffn_output(ref_tensor=h, ubatch_idx=stage)``; with two stages in
  the DBO thread order (send s0, send s1, recv s0, send s0', recv s1, ...). An
  idle DP rank runs a one-token dummy batch.
* FFN, per step: ``recv_dp_metadata_list()``, a fresh plugin payload from its
  ``dp_metadata_list`` into ``update_state_from_dp_metadata``, then for each
  layer (every layer, or only the MoE layers with the gate on attention) and
  stage: ``recv_attn_output(ubatch_idx=stage, routing_spec=...)``, the runner
  overwriting ``metadata.layer_idx``/``stage_idx``, compute,
  ``send_ffn_output(out, payload.context)``.

The FFN "model" is elementwise (:func:`ffn_fn`), so each attention worker
checks its reply exactly against its own rows.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FAKE_PLUGIN = str(ROOT / "tests" / "fake_afd_plugin")


@dataclass(frozen=True)
class PluginScenario:
    """One multi-process run under the reference's runners.

    Attributes:
        attn, ffn: ``(dp, pcp, tp)`` of each role (A and F are the products).
        steps: per step ``{stage: per-DP counts of the attention role}``.
        hidden, layers: model facts (``hf_config``).
        gate: ``compute_gate_on_attention`` with a DeepSeek-style config
            (``first_k_dense_replace=1``: layers ``1..layers-1`` are MoE).
        experts: ``n_routed_experts`` (router logits width).
        transport: ``"gloo"`` (CPU) or ``"nccl"``.
        extra: more ``connector_extra_config`` items.
        frozen_stage: the attention side calls the compiled path's custom ops
            with stage 0 everywhere, as a graph traced once and dispatched by
            vLLM without guards would; the stage comes from a stand-in
            ``vllm.v1.worker.ubatching`` reporting the running ubatch.
        capture_steps: indices of steps whose payload sets ``is_graph_capturing``
            (run eagerly here: on CPU only the connector's buffer handling is checked).
        native: build afd_ext's own connector with ``afd_ext.factory.create_connector(rank,
            local_rank, vllm_config)`` instead of going through the plugin's factory.
    """

    attn: tuple = (1, 1, 1)
    ffn: tuple = (1, 1, 1)
    steps: tuple = ()
    hidden: int = 8
    layers: int = 3
    gate: bool = False
    experts: int = 4
    transport: str = "gloo"
    extra: tuple = ()
    connector: str = "P2pNcclAFDConnector"
    frozen_stage: bool = False
    capture_steps: tuple = ()
    native: bool = False

    @property
    def A(self) -> int:  # noqa: N802
        return self.attn[0] * self.attn[1] * self.attn[2]

    @property
    def F(self) -> int:  # noqa: N802
        return self.ffn[0] * self.ffn[1] * self.ffn[2]

    @property
    def nprocs(self) -> int:
        return self.A + self.F

    def exchange_layers(self) -> list[int]:
        return list(range(1, self.layers)) if self.gate else list(range(self.layers))


def coords(role_rank: int, dims: tuple) -> tuple[int, int, int]:
    """``(dp_rank, pcp_rank, tp_rank)`` of a role rank, the inverse of the reference's linearisation."""
    _, pcp, tp = dims
    return role_rank // (pcp * tp), (role_rank // tp) % pcp, role_rank % tp


#: FFN side: per stage, the address of the fan-in buffer of each step's first exchange.
BUFFERS: dict = {}

#: The ubatch the stand-in ``vllm.v1.worker.ubatching`` reports (set by the DBO driver).
CURRENT_UBATCH = [0]


def install_fake_ubatching(enabled: bool) -> None:
    """A stand-in ``vllm.v1.worker.ubatching``: ``dbo_enabled()``, ``dbo_current_ubatch_id()``."""
    ub = types.ModuleType("vllm.v1.worker.ubatching")
    ub.dbo_enabled = lambda: enabled
    ub.dbo_current_ubatch_id = lambda: CURRENT_UBATCH[0] if enabled else 0
    for name in ("vllm.v1", "vllm.v1.worker"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.v1.worker.ubatching"] = ub


def install_fake_vllm(pcp_rank: int, tp_rank: int) -> None:
    """A stand-in ``vllm.distributed.parallel_state`` reporting this worker's PCP and TP ranks."""
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_pcp_group = lambda: types.SimpleNamespace(rank_in_group=pcp_rank)
    ps.get_tensor_model_parallel_rank = lambda: tp_rank
    dist = types.ModuleType("vllm.distributed")
    dist.parallel_state = ps
    vllm = types.ModuleType("vllm")
    vllm.distributed = dist
    sys.modules.update({"vllm": vllm, "vllm.distributed": dist, "vllm.distributed.parallel_state": ps})


def vllm_config(sc: PluginScenario, role: str, dp_rank: int, port: int, dtype: torch.dtype):
    """A ``VllmConfig``-like object: additional_config["afd"], model_config, parallel_config."""
    dims = sc.attn if role == "attention" else sc.ffn
    extra = {"transport": sc.transport, "step_timeout_s": 20.0, "init_timeout_s": 60.0,
             "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0}
    extra.update(dict(sc.extra))
    afd = {"connector": sc.connector, "role": role, "host": "127.0.0.1", "port": port,
           "num_attention_ranks": sc.A, "num_ffn_ranks": sc.F, "compute_gate_on_attention": sc.gate,
           "connector_extra_config": extra}
    hf = types.SimpleNamespace(hidden_size=sc.hidden, num_hidden_layers=sc.layers)
    if sc.gate:
        hf.first_k_dense_replace, hf.moe_layer_freq, hf.n_routed_experts = 1, 1, sc.experts
    ns = types.SimpleNamespace
    return ns(additional_config={"afd": afd},
              model_config=ns(dtype=dtype, hf_config=hf, hf_text_config=hf),
              parallel_config=ns(data_parallel_size=dims[0], data_parallel_rank=dp_rank,
                                 prefill_context_parallel_size=dims[1], tensor_parallel_size=dims[2]))


def entry_point():
    """The function named by this package's ``vllm.general_plugins`` entry point (read from pyproject.toml)."""
    import importlib
    import tomllib  # Python >= 3.11 (the test environments); only the tests read pyproject.toml

    with open(ROOT / "pyproject.toml", "rb") as f:
        value = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]["afd_ext"]
    mod, _, fn = value.partition(":")
    return getattr(importlib.import_module(mod), fn)


def build(sc: PluginScenario, rank: int, port: int, device: torch.device, dtype: torch.dtype):
    """This worker's connector, built the way the reference's runners build it."""
    sys.path.insert(0, FAKE_PLUGIN)
    os.environ["AFD_EXT_REPLACE_P2P"] = "1"
    role = "ffn" if rank < sc.F else "attention"
    role_rank = rank if role == "ffn" else rank - sc.F
    dims = sc.attn if role == "attention" else sc.ffn
    dp_rank, pcp_rank, tp_rank = coords(role_rank, dims)
    install_fake_vllm(pcp_rank, tp_rank)
    install_fake_ubatching(sc.frozen_stage)
    entry_point()()
    from afd_plugin.config import parse_afd_config
    from afd_plugin.connectors.factory import AFDConnectorFactory

    vc = vllm_config(sc, role, dp_rank, port, dtype)
    if sc.native:
        from afd_ext.factory import create_connector

        conn = create_connector(rank, device.index or 0, vc)
        return conn, role, conn.role_rank, dp_rank
    cfg = parse_afd_config(vc, expected_role=role)
    conn = AFDConnectorFactory.create_connector(rank, device.index or 0, vc, cfg)
    assert conn.role_rank == role_rank, (conn.role_rank, role_rank)
    return conn, role, role_rank, dp_rank


def finish_barrier(nprocs: int):
    """A barrier for every worker of a run (pass it as the workers' ``done`` argument).

    FFN rank 0 hosts the rendezvous store: a worker that finishes early must not
    take it away (by exiting) from peers still in their last step; a vLLM
    worker simply lives on.
    """
    import multiprocessing as mp

    return mp.get_context("spawn").Barrier(nprocs)


def finish(done, timeout_s: float = 120.0) -> None:
    """Wait at ``done`` (a :func:`finish_barrier`) when given."""
    if done is not None:
        done.wait(timeout_s)


def ffn_fn(hidden: torch.Tensor, logits: torch.Tensor | None, layer: int) -> torch.Tensor:
    """The FFN side's "model": elementwise in the hidden states and the first router-logit column."""
    out = hidden * 2 + (layer + 1)
    if logits is not None:
        out = out + logits[:, :1].to(hidden.dtype)
    return out


def inputs(sc: PluginScenario, step: int, layer: int, stage: int, a: int, n: int, device, dtype):
    """Deterministic hidden states (and router logits) of attention rank ``a``."""
    base = torch.arange(n * sc.hidden, dtype=torch.float32, device=device).reshape(n, sc.hidden)
    h = (((base * (a + 1) + 7 * step + 3 * layer + stage) % 17 - 8) / 4).to(dtype)
    logits = None
    if sc.gate:
        lb = torch.arange(n * sc.experts, dtype=torch.float32, device=device).reshape(n, sc.experts)
        logits = (((lb + 5 * a + layer) % 11) - 5).to(dtype)
    return h, logits


def reference_payload(step: dict, **flags: Any):
    from afd_plugin.connectors.metadata import AFDControlPayload, AFDDPMetadata

    md = {int(s): AFDDPMetadata(torch.tensor(c, dtype=torch.int32)) for s, c in step.items()}
    return AFDControlPayload(md, is_graph_capturing=flags.get("is_graph_capturing", False),
                             is_warmup=flags.get("is_warmup", False))


def proxy_exchange(conn, h: torch.Tensor, layer: int, stage: int, logits: torch.Tensor | None = None):
    """The model's remote-FFN proxy (``RemoteFFNProxy._send_and_receive``): send, then receive into ``h``."""
    from afd_plugin.connectors.metadata import AFDTransferContext, AFDTransferMetadata

    md = AFDTransferMetadata.create_attention_metadata(layer_idx=layer, stage_idx=stage, seq_len=int(h.shape[0]))
    kw = {} if logits is None else {"router_logits": logits}
    conn.send_attn_output(h, AFDTransferContext(metadata=md), **kw)
    return conn.recv_ffn_output(ref_tensor=h, ubatch_idx=stage)


def attention_step(conn, sc: PluginScenario, i: int, step: dict, a: int, dp_rank: int, device, dtype) -> list:
    """One attention-runner step; returns ``(stage, rows)`` per stage after checking every reply."""
    from afd_plugin.connectors.metadata import AFDTransferContext, AFDTransferMetadata

    p = reference_payload(step, is_graph_capturing=i in sc.capture_steps)
    conn.control_plane.update_state_from_dp_metadata(p)
    conn.control_plane.send_dp_metadata_list(p)
    stages = sorted(step)
    rows = {s: max(1, int(step[s][dp_rank])) for s in stages}  # idle DP rank: a one-token dummy batch

    def ubatch(s):
        for layer in sc.exchange_layers():
            h, lg = inputs(sc, i, layer, s, a, rows[s], device, dtype)
            want = ffn_fn(h.clone(), lg, layer)
            if sc.frozen_stage:
                torch.ops.afd_ext_plugin.send_attn_output(h, [{"router_logits": lg}.get(a) for a in conn.part_args],
                                                          conn._handle, layer, 0)
            else:
                md = AFDTransferMetadata.create_attention_metadata(layer_idx=layer, stage_idx=s, seq_len=rows[s])
                conn.send_attn_output(h, AFDTransferContext(metadata=md), **({} if lg is None else
                                                                               {"router_logits": lg}))
            yield  # DBO: the other ubatch thread runs between this send and its receive
            CURRENT_UBATCH[0] = s
            if sc.frozen_stage:
                torch.ops.afd_ext_plugin.recv_ffn_output(h, conn._handle, 0)
                out = h
            else:
                out = conn.recv_ffn_output(ref_tensor=h, ubatch_idx=s)
            assert out is h, "the reply must land in ref_tensor"
            torch.testing.assert_close(out, want, rtol=0, atol=0,
                                       msg=lambda m: f"step {i} layer {layer} stage {s}: {m}")

    gens = [(s, ubatch(s)) for s in stages]
    while gens:
        for s, g in list(gens):
            CURRENT_UBATCH[0] = s  # what vLLM's dbo_current_ubatch_id() reports in that ubatch thread
            try:
                next(g)
            except StopIteration:
                gens.remove((s, g))
    return [(s, rows[s]) for s in stages]


def ffn_step(conn, sc: PluginScenario, dtype) -> list:
    """One FFN-worker step; returns ``(stage, seq_lens)`` of the first exchange of each stage."""
    from afd_plugin.connectors.metadata import AFDControlPayload, AFDExpertRoutingSpec

    payload = conn.control_plane.recv_dp_metadata_list()
    dml = payload.dp_metadata_list
    conn.control_plane.update_state_from_dp_metadata(
        AFDControlPayload(dml, is_graph_capturing=payload.is_graph_capturing, is_warmup=payload.is_warmup))
    seen = {}
    spec = AFDExpertRoutingSpec(sc.experts, dtype) if sc.gate else None
    for layer in sc.exchange_layers():
        for s in sorted(int(k) for k in dml):
            p = conn.recv_attn_output(ubatch_idx=s, routing_spec=spec)
            md = p.context.metadata
            md.layer_idx, md.stage_idx = layer, s
            assert (p.router_logits is not None) == sc.gate
            if s not in seen:
                seen[s] = list(md.seq_lens)
                BUFFERS.setdefault(s, []).append(p.hidden_states.data_ptr())
            conn.send_ffn_output(ffn_fn(p.hidden_states, p.router_logits, layer), p.context)
    return sorted(seen.items())


def dropin_worker(rank: int, nprocs: int, sc: PluginScenario | tuple, port: int, done=None):
    """Run every step of ``sc`` on one rank; returns this rank's record.

    ``sc`` may be a tuple of scenarios with the same ``A`` and ``F``: they run
    one after the other in the same processes, each with a fresh connector (a
    new rendezvous generation), which saves process start-ups on small CI
    machines; the result is then a list of records. ``done`` (a
    :func:`finish_barrier`) holds every worker until all finished.
    """
    if isinstance(sc, tuple):
        return [dropin_worker(rank, nprocs, one, port, done) for one in sc]
    device = torch.device("cpu") if sc.transport == "gloo" else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32
    conn, role, role_rank, dp_rank = build(sc, rank, port, device, dtype)
    BUFFERS.clear()
    try:
        conn.init_afd_connector()
        assert conn.is_initialized
        record = []
        for i, step in enumerate(sc.steps):
            if role == "attention":
                record.append(attention_step(conn, sc, i, step, role_rank, dp_rank, device, dtype))
            else:
                record.append(ffn_step(conn, sc, dtype))
        if device.type == "cuda":
            torch.cuda.synchronize()
        # FFN rank 0 hosts the rendezvous store: a worker that finishes early must not take it
        # away from peers still in their last step (a vLLM worker simply lives on).
        finish(done)
        arenas = [[slot.tensor.data_ptr() for slot in a._slots.values()] for a in getattr(conn, "_arenas", ())]
        return {"role": role, "role_rank": role_rank, "steps": record, "type": type(conn).__name__,
                "buffers": dict(BUFFERS), "arenas": arenas}
    finally:
        conn.close()
        assert not conn.is_initialized


# ---------------------------------------------------------------------------
# The attention side compiled once (torch.compile, fullgraph) and reused every step
# ---------------------------------------------------------------------------


def attention_layer_math(h: torch.Tensor, layer: int) -> torch.Tensor:
    """The attention side's own compute around each exchange (elementwise, so exact on any backend)."""
    return h * 0.5 + (layer + 1)


def compiled_attention_worker(rank: int, nprocs: int, sc: PluginScenario, port: int, backend: str, done=None):
    """Attention: one ``torch.compile(fullgraph=True, dynamic=True)`` forward over every exchange layer,
    compiled once and run for every step (different counts); FFN: the eager runner loop.

    Returns the number of graphs the backend compiled (attention) and each reply checked exactly
    against the same forward run eagerly with the FFN computed locally.
    """
    device = torch.device("cpu") if sc.transport == "gloo" else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32
    conn, role, role_rank, dp_rank = build(sc, rank, port, device, dtype)
    from afd_plugin.connectors.metadata import AFDTransferContext, AFDTransferMetadata

    layers = sc.exchange_layers()

    def forward(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:  # as the model's decoder layers: attention compute, then the remote FFN proxy
            x = attention_layer_math(h, layer)
            md = AFDTransferMetadata.create_attention_metadata(layer_idx=layer, stage_idx=0,
                                                              seq_len=int(x.shape[0]))
            conn.send_attn_output(x, AFDTransferContext(metadata=md))
            h = h + conn.recv_ffn_output(ref_tensor=x, ubatch_idx=0)
        return h

    def expected(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = h + ffn_fn(attention_layer_math(h, layer), None, layer)
        return h

    graphs = []
    try:
        conn.init_afd_connector()
        if role == "attention":
            inner = torch._dynamo.lookup_backend(backend)

            def counting(gm, example_inputs):
                graphs.append(sum(1 for n in gm.graph.nodes if "afd_ext_plugin" in str(n.target)))
                return inner(gm, example_inputs)

            compiled = torch.compile(forward, backend=counting, fullgraph=True, dynamic=True)
            for i, step in enumerate(sc.steps):
                p = reference_payload(step)
                conn.control_plane.update_state_from_dp_metadata(p)
                conn.control_plane.send_dp_metadata_list(p)
                n = int(step[0][dp_rank])
                h, _ = inputs(sc, i, 0, 0, role_rank, n, device, dtype)
                out = compiled(h.clone())
                torch.testing.assert_close(out, expected(h), rtol=0, atol=0, msg=lambda m: f"step {i}: {m}")
        else:
            for _ in sc.steps:
                ffn_step(conn, sc, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        finish(done)
        return {"role": role, "graphs": graphs}
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# The FFN forward captured once in a CUDA graph and replayed by the runner (GPU tier)
# ---------------------------------------------------------------------------


def ffn_graph_worker(rank: int, nprocs: int, sc: PluginScenario, port: int, replays: int, done=None):
    """The reference's graph protocol (``ffn_worker.py`` / ``ffn_model_runner.py``), 1 stage.

    Step 0 warm-up (``is_warmup``, eager on both sides); step 1 capture
    (``is_graph_capturing``): the attention side captures its exchange loop,
    the FFN side applies the payload outside the graph, then captures
    ``_ffn_forward`` (every recv/compute/send) into one CUDA graph - neither
    moves data. Then ``replays`` steps with the captured counts: the attention
    side runs eagerly with new data every step; the FFN worker receives the
    payload and calls ``graph.replay()`` with no other connector call. Then one
    eager step with larger counts (the FFN grows its eager buffers), and five
    more replays. The attention side checks every reply bit-exactly against
    the FFN function computed eagerly on its own rows.
    """
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    conn, role, role_rank, dp_rank = build(sc, rank, port, device, dtype)
    from afd_plugin.connectors.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata

    graph_step = sc.steps[0]
    plan = ([dict(is_warmup=True), dict(is_graph_capturing=True)] + [{}] * replays
            + [dict(big=True)] + [{}] * 5)
    big = {0: [c * 3 + 5 for c in graph_step[0]]}
    checked = 0
    try:
        conn.init_afd_connector()
        if role == "attention":
            n = max(1, int(graph_step[0][dp_rank]))
            static_x = torch.zeros(n, sc.hidden, dtype=dtype, device=device)
            for i, flags in enumerate(plan):
                step = big if flags.get("big") else graph_step
                p = reference_payload(step, **flags)
                conn.control_plane.update_state_from_dp_metadata(p)
                conn.control_plane.send_dp_metadata_list(p)
                if flags.get("is_graph_capturing"):
                    g = torch.cuda.CUDAGraph()
                    torch.cuda.synchronize()
                    with torch.cuda.graph(g):
                        for layer in sc.exchange_layers():
                            md = AFDTransferMetadata.create_attention_metadata(layer_idx=layer, stage_idx=0,
                                                                              seq_len=n)
                            conn.send_attn_output(static_x, AFDTransferContext(metadata=md))
                            conn.recv_ffn_output(ref_tensor=static_x, ubatch_idx=0)
                    continue  # captured, never replayed here: the FFN's capture moved no data either
                rows = max(1, int(step[0][dp_rank]))
                for layer in sc.exchange_layers():
                    h, _ = inputs(sc, i, layer, 0, role_rank, rows, device, dtype)
                    want = ffn_fn(h, None, layer)
                    x = h.clone()
                    md = AFDTransferMetadata.create_attention_metadata(layer_idx=layer, stage_idx=0, seq_len=rows)
                    conn.send_attn_output(x, AFDTransferContext(metadata=md))
                    out = conn.recv_ffn_output(ref_tensor=x, ubatch_idx=0)
                    torch.cuda.synchronize()
                    assert torch.equal(out, want), f"step {i} layer {layer}: reply differs from eager ffn_fn"
                    checked += 1
        else:
            graphs: dict = {}
            pool = torch.cuda.graph_pool_handle()
            calls = {"data": 0}

            def ffn_forward():
                for layer in sc.exchange_layers():
                    pl = conn.recv_attn_output(ubatch_idx=0)
                    calls["data"] += 1
                    conn.send_ffn_output(ffn_fn(pl.hidden_states, None, layer), pl.context)

            for i, flags in enumerate(plan):
                payload = conn.control_plane.recv_dp_metadata_list()
                dml = payload.dp_metadata_list
                key = tuple((s, tuple(md.num_tokens_across_dp_cpu.tolist())) for s, md in sorted(dml.items()))
                ref = AFDControlPayload(dml, is_graph_capturing=payload.is_graph_capturing,
                                        is_warmup=payload.is_warmup)
                if payload.is_graph_capturing:
                    conn.control_plane.update_state_from_dp_metadata(ref)  # outside the graph
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        ffn_forward()
                    graphs[key] = g
                elif key in graphs and not payload.is_warmup:
                    before = calls["data"]
                    graphs[key].replay()  # no connector call: the graph holds every exchange
                    assert calls["data"] == before
                else:
                    conn.control_plane.update_state_from_dp_metadata(ref)
                    ffn_forward()
                torch.cuda.synchronize()
            assert len(graphs) == 1
        finish(done)
        return {"role": role, "checked": checked}
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# A stop with a step in flight (issue 41 item 2)
# ---------------------------------------------------------------------------


def _in_call(thread, name: str) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def stop_mid_step_worker(rank: int, nprocs: int, sc: PluginScenario, port: int, first: str, done) -> dict:
    """2A1F; step 2 is in flight: attention rank 0 sent its rows and waits for the reply, attention rank 1
    has sent nothing, FFN rank 0's loop thread waits in ``recv_attn_output`` for rank 1's rows. Then
    ``first`` (``"ffn"`` or ``"attention"``: attention rank 1) closes. The FFN loop is afd-plugin's
    (``AFDFFNWorker``: any ``Exception`` recorded as a failure) on a thread of its name."""
    import threading
    import time

    dtype = torch.float32
    conn, role, role_rank, dp_rank = build(sc, rank, port, torch.device("cpu"), dtype)
    conn.init_afd_connector()
    out: dict = {"role": role}
    try:
        if role == "ffn":
            failures: list = []
            hooked: list = []
            ended: list = []
            threading.excepthook = lambda a: hooked.append(a.exc_type.__name__)

            def loop() -> None:
                try:
                    while True:
                        ffn_step(conn, sc, dtype)
                except Exception as e:  # noqa: BLE001 - what afd-plugin's loop does: a recorded failure
                    failures.append(f"{type(e).__name__}: {e}")
                except BaseException as e:
                    ended.append(f"{type(e).__name__}: {e} <- {e.__cause__!r}")
                    raise

            t = threading.Thread(target=loop, name="afd-ffn-worker-loop", daemon=True)
            t.start()
            done.wait(60)  # step 1 served; attention rank 0 sent step 2's payload and rows
            end = time.monotonic() + 30
            while not _in_call(t, "recv_attn_output") and time.monotonic() < end:
                time.sleep(0.01)
            assert _in_call(t, "recv_attn_output"), ("the loop thread never waited in recv_attn_output", failures,
                                                     ended, t.is_alive())
            t0 = time.monotonic()
            if first == "ffn":
                conn.close()  # what afd-plugin's stop_ffn_server_loop does (via model_runner.shutdown)
            done.wait(60)  # ffn: the attention ranks may call now; attention: attention rank 1 closes now
            t.join(5)
            out.update(loop_ended_s=time.monotonic() - t0, alive=t.is_alive(), failures=failures, hooked=hooked)
            done.wait(60)
        else:
            attention_step(conn, sc, 0, sc.steps[0], role_rank, dp_rank, torch.device("cpu"), dtype)
            p = reference_payload(sc.steps[1])
            conn.control_plane.update_state_from_dp_metadata(p)
            conn.control_plane.send_dp_metadata_list(p)
            h, _ = inputs(sc, 1, 0, 0, role_rank, int(sc.steps[1][0][dp_rank]), torch.device("cpu"), dtype)
            done.wait(60)  # the FFN loop thread now waits in recv_attn_output
            if role_rank == 1 or first == "attention":
                done.wait(60)  # ffn: the FFN rank has closed; attention: the FFN rank saw its loop thread wait
            if role_rank == 1 and first == "attention":
                conn.close()  # mid-step: it sent the payload, not its rows
                done.wait(60)
                return {**out, "closed": True}
            t0 = time.monotonic()
            try:  # attention rank 0 (ffn first): waits in recv_ffn_output when the FFN rank closes
                proxy_exchange(conn, h, 0, 0)
            except Exception as e:  # noqa: BLE001 - returned to the test
                out.update(error=type(e).__name__, msg=str(e), took=time.monotonic() - t0)
            if role_rank == 0 and first == "ffn":
                done.wait(60)
            done.wait(60)
        return out
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# on_attention_exit "rejoin": restarted attention processes served by the same FFN loop thread
# ---------------------------------------------------------------------------


def rejoin_worker(rank: int, life: int, sc: PluginScenario, port: int, lives: tuple, how: str, go, q) -> None:
    """One process of a rejoin run (spawned by the test, which reaps each attention process before the next).

    ``rank`` 0 is FFN rank 0: its loop is afd-plugin's (a thread of its name, any ``Exception`` recorded as a
    failure) and serves ``lives`` (the steps of each attention process in turn); once ``go`` is set it
    ends as ``how`` says: ``"close"`` (its ``close()`` while the loop waits for a third attention process) or
    ``"timeout"`` (the loop's wait passes a 3 s ``init_timeout_s``). Ranks ``1..A`` are the attention ranks
    in their ``life``-th process: each runs ``lives[life]``, then closes (a goodbye), or with ``how ==
    "killed"`` its first process is SIGKILLed after its steps. Puts ``(rank, life, record or traceback)`` on ``q``.
    """
    import dataclasses
    import logging
    import signal
    import threading
    import time
    import traceback

    try:
        dtype = torch.float32
        logged: list = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda r: logged.append(f"{r.levelname} {r.name}: {r.getMessage()}")
        logging.getLogger("afd_ext").addHandler(handler)
        conn, role, role_rank, dp_rank = build(sc, rank, port, torch.device("cpu"), dtype)
        conn.init_afd_connector()
        if role == "attention":
            rec = [attention_step(conn, sc, i, step, role_rank, dp_rank, torch.device("cpu"), dtype)
                   for i, step in enumerate(lives[life])]
            if how == "killed" and life == 0:
                q.put((rank, life, {"steps": rec}))
                time.sleep(1.0)  # the queue's feeder thread delivers the record
                os.kill(os.getpid(), signal.SIGKILL)
            conn.close()
            q.put((rank, life, {"steps": rec, "logged": logged}))
            return
        served: list = []
        failures: list = []
        hooked: list = []
        threading.excepthook = lambda a: hooked.append(a.exc_type.__name__)
        total = sum(len(steps) for steps in lives)

        def loop() -> None:
            try:
                while True:
                    if len(served) == total and how == "timeout":
                        conn._inner.extra = dataclasses.replace(conn._inner.extra, init_timeout_s=3.0)
                    served.append(ffn_step(conn, sc, dtype))
            except Exception as e:  # noqa: BLE001 - what afd-plugin's loop does: a recorded failure
                failures.append(f"{type(e).__name__}: {e}")

        t = threading.Thread(target=loop, name="afd-ffn-worker-loop", daemon=True)
        t.start()
        go.wait(240)  # every attention process has run and exited
        end = time.monotonic() + 60
        while how != "timeout" and (len(served) < total or not _in_call(t, "init_afd_connector")):
            assert time.monotonic() < end and t.is_alive(), ("the loop never waited again", served, failures)
            time.sleep(0.01)
        t0 = time.monotonic()
        if how != "timeout":
            conn.close()  # afd-plugin's stop_ffn_server_loop does this (model_runner.shutdown)
        t.join(30)
        q.put((rank, life, {"steps": served, "failures": failures, "hooked": hooked, "alive": t.is_alive(),
                            "ended_s": time.monotonic() - t0, "logged": logged,
                            "initialized": conn.is_initialized}))
        conn.close()
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, life, traceback.format_exc()))
