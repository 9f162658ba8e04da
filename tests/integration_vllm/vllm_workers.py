"""Worker processes of the vLLM integration suite: real vLLM and afd-plugin, afd_ext as the transport.

Each worker is the module-level ``worker(rank, nprocs, scenarios, ports, model_dirs, done)`` for
:func:`afd_ext.tools.testing.run_workers`; ranks ``0..F-1`` are FFN workers, ``F..F+A-1`` attention
workers. What is real (nothing of vLLM or afd-plugin is stood in for):

* vLLM's plugin loader (``vllm.plugins.load_general_plugins``: afd-plugin's ``register_afd`` and
  afd_ext's entry point, with ``AFD_EXT_REPLACE_P2P=1``), a ``VllmConfig`` built from a
  ``ModelConfig`` of a small DeepSeek-V3 / GLM-MoE-DSA config on disk, vLLM's distributed and
  model-parallel state over gloo (one vLLM world per role and DP rank, TP wide);
* FFN: afd-plugin's ``GPUFFNModelRunner`` (its factory builds the connector) inside its
  ``AFDFFNWorker``, whose own ``initialize_from_config`` starts its own FFN loop thread and whose
  ``shutdown`` stops it and runs vLLM's ``Worker.shutdown``. Only the weights are replaced: the
  runner's ``model`` computes :func:`ffn_fn` (elementwise), so every reply is exact; its
  ``routing_spec`` is the one vLLM's gate gives (``_get_moe_router_dtype`` or the model dtype);
* attention: afd-plugin's ``AFDDeepseekV2RemoteExpertsMoE`` (vLLM's ``GateLinear`` gate when the
  gate runs on attention, then the ``AFDAttentionFusedMoE`` proxy) and ``RemoteFFNProxy`` for
  dense layers, called in vLLM forward contexts carrying afd-plugin's
  ``AFDForwardContextMetadata``; step payloads of vLLM's ``DPMetadata``.

Two stages: vLLM's DBO needs a GPU, so the ubatch id of each call is set directly
(``afd_metadata.stage_idx``) and, per layer, stage 0's exchange runs before stage 1's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

#: The vLLM the whole suite runs on (afd-plugin 2e4378f's); conftest.py skips the rest on the others.
FULL_SUITE_VLLM = "0.26.0"

#: The attention side's MoE layers are 1..L-1 (``first_k_dense_replace=1``).
LAYERS = 3
HIDDEN = 64
EXPERTS = 8
#: The sequence-parallel size the FFN model hands vLLM's MoE runner (its ``moe_config.sp_size``).
SP = 2


@dataclass(frozen=True)
class Scenario:
    """One run under the real runners.

    Attributes:
        name: label (the test id).
        attn, ffn: ``(dp, tp)`` of each role.
        steps: per step ``{stage: per-DP-rank counts}``.
        model: key of the model config (``"dsv3"`` bf16, ``"dsv3_fp32router"``,
            ``"glm_moe_dsa"``, ``"dsv3_f32"`` a float32 model).
        gate: ``compute_gate_on_attention``.
        control: ``connector_extra_config.control_channel``.
        flags: per step index, payload flags (``is_warmup`` / ``is_graph_capturing``).
        idle_before: per step index, seconds the attention side idles before it.
        heartbeat_timeout_s: the control channel's heartbeat timeout.
        compile: ``torch.compile`` backend for the attention modules, or None.
        order: ``"attn_first"`` (attention closes, the FFN loop ends on the goodbye) or
            ``"ffn_first"`` (the FFN worker shuts down first, then attention closes).
        ffn_model: the FFN role's model config when it differs from ``model``.
        mismatch: the roles' configs disagree: both must refuse at the handshake.
        attention_dies: the attention process exits after its steps without closing (no goodbye):
            the FFN loop must end in a named error, recorded by afd-plugin as a failure.
        in_flight: after ``steps``, a step (``{stage: counts}``) whose payload the attention side
            applies and sends but whose rows it never sends: the FFN loop thread waits in
            ``recv_attn_output`` when ``order``'s first role stops.
        rejoin: ``on_attention_exit: "rejoin"``; the steps of each restarted attention process (the first
            runs ``steps``), each a new process started once the last one has exited (``ffn_role``).
        killed: with ``rejoin``, the first attention process is SIGKILLed after its steps (no goodbye).
    """

    name: str
    attn: tuple = (1, 1)
    ffn: tuple = (1, 1)
    steps: tuple = ({0: [3]}, {0: [5]})
    model: str = "dsv3"
    gate: bool = False
    control: str = "shm"
    flags: dict = field(default_factory=dict)
    idle_before: dict = field(default_factory=dict)
    heartbeat_timeout_s: float = 10.0
    compile: str | None = None
    order: str = "attn_first"
    ffn_model: str | None = None
    mismatch: bool = False
    attention_dies: bool = False
    in_flight: dict | None = None
    rejoin: tuple = ()
    killed: bool = False

    @property
    def A(self) -> int:  # noqa: N802
        return self.attn[0] * self.attn[1]

    @property
    def F(self) -> int:  # noqa: N802
        return self.ffn[0] * self.ffn[1]

    @property
    def nprocs(self) -> int:
        return self.A + self.F


#: The model configs (``config.json``) the suite writes; ``dtype`` is the served dtype.
MODELS: dict[str, dict[str, Any]] = {
    "dsv3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "dtype": "bfloat16"},
    "dsv3_fp32router": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                        "moe_router_dtype": "float32", "dtype": "bfloat16"},
    "glm_moe_dsa": {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "dtype": "bfloat16"},
}


def model_config_json(key: str) -> dict[str, Any]:
    """A small DeepSeek-V3-shaped config (3 layers, layer 0 dense, 8 routed experts)."""
    m = {k: v for k, v in MODELS[key].items() if k != "dtype"}
    base = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": 128,
            "moe_intermediate_size": 32, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "q_lora_rank": None,
            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "routed_scaling_factor": 1.0, "max_position_embeddings": 512, "rope_theta": 10000.0,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False, "norm_topk_prob": True,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1}
    if key == "glm_moe_dsa":  # GLM-5's sparse-attention indexer fields
        base.update({"index_topk": 64, "index_head_dim": 32, "index_n_heads": 4, "q_lora_rank": 32})
    base.update(m)
    return base


# ---------------------------------------------------------------------------- the "model"


def ffn_fn(hidden: torch.Tensor, logits: torch.Tensor | None, layer: int) -> torch.Tensor:
    """The FFN side's computation: elementwise in the hidden states and the first router-logit column."""
    out = hidden * 2 + (layer + 1)
    if logits is not None:
        out = out + logits[:, :1].to(hidden.dtype)
    return out


def inputs(step: int, layer: int, stage: int, a: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic hidden states of attention rank ``a`` (values exact in bf16)."""
    base = torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN)
    return (((base * (a + 1) + 7 * step + 3 * layer + stage) % 17 - 8) / 4).to(dtype)


class FFNModel:
    """The FFN runner's ``model``: afd-plugin's model interface, :func:`ffn_fn` as its weights."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        from vllm.model_executor.models import deepseek_v2 as native

        self.dtype = dtype
        self.router_dtype = native._get_moe_router_dtype(hf_config) or dtype  # vLLM's gate: out_dtype or weight
        self.calls: list[tuple[int, int, bool]] = []

    def get_experts_layer_indices(self) -> tuple[int, ...]:
        return tuple(range(1, LAYERS))

    def get_experts_routing_spec(self, layer_idx: int) -> Any:
        from afd_plugin.connectors import AFDExpertRoutingSpec

        return AFDExpertRoutingSpec(router_logits_width=EXPERTS, router_logits_dtype=self.router_dtype)

    def compute_ffn_output(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.calls.append((layer_idx, int(hidden_states.shape[0]), False, self._moe_runner_sizes()))
        return ffn_fn(hidden_states, None, layer_idx)

    def compute_experts_output(self, hidden_states: torch.Tensor, layer_idx: int,
                               router_logits: torch.Tensor) -> torch.Tensor:
        assert router_logits.dtype == self.router_dtype, (router_logits.dtype, self.router_dtype)
        self.calls.append((layer_idx, int(hidden_states.shape[0]), True, self._moe_runner_sizes()))
        return ffn_fn(hidden_states, router_logits, layer_idx)

    @staticmethod
    def _moe_runner_sizes() -> list[int]:
        """vLLM's MoE runner's own calls on the forward context's DP metadata (afd_ext's, set by the
        FFN runner from the payload): its sequence-parallel context, then the per-rank sizes."""
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        moe = types.SimpleNamespace(moe_config=types.SimpleNamespace(sp_size=SP, pcp_size=1, use_ep=True))
        dp = get_forward_context().dp_metadata
        assert type(dp).__module__ == "afd_ext.metadata", type(dp)
        with MoERunner._sequence_parallel_context(moe):
            return list(dp.get_chunk_sizes_across_dp_rank())


# ---------------------------------------------------------------------------- vLLM state


_STATE: dict[str, Any] = {}


def _vllm_world(role: str, dp_rank: int, tp: int, tp_rank: int, port: int) -> None:
    """vLLM's distributed and model-parallel state of this worker (once per process)."""
    if "world" in _STATE:
        assert _STATE["world"] == (role, dp_rank, tp, tp_rank), "one vLLM world per worker process"
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=tp, rank=tp_rank, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(tensor_model_parallel_size=tp)
    _STATE["world"] = (role, dp_rank, tp, tp_rank)


def _model_config(model_dir: str, dtype: str) -> Any:
    key = (model_dir, dtype)
    if key not in _STATE:
        from vllm.config import ModelConfig

        _STATE[key] = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True, dtype=dtype,
                                  enforce_eager=True)
    return _STATE[key]


def vllm_config(sc: Scenario, role: str, dp_rank: int, port: int, model_dir: str, dp_port: int) -> Any:
    """A real ``VllmConfig``: the model config on disk, DP/TP sizes, CPU, ``additional_config["afd"]``.

    ``dp_port``: the DP master port (vLLM joins a role's DP ranks in one world through it).
    """
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    dp, tp = sc.attn if role == "attention" else sc.ffn
    extra = {"transport": "gloo", "control_channel": sc.control, "step_timeout_s": 120.0, "init_timeout_s": 600.0,
             "heartbeat_interval_s": min(0.2, sc.heartbeat_timeout_s / 4),
             "heartbeat_timeout_s": sc.heartbeat_timeout_s}
    if sc.rejoin:  # a wait's log interval is init_timeout_s / 10
        extra.update(on_attention_exit="rejoin", init_timeout_s=60.0)
    afd = {"connector": "P2pNcclAFDConnector", "role": role, "host": "127.0.0.1", "port": port,
           "num_attention_ranks": sc.A, "num_ffn_ranks": sc.F, "compute_gate_on_attention": sc.gate,
           "connector_extra_config": extra}
    pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_rank=dp_rank,
                        data_parallel_size_local=dp, data_parallel_master_ip="127.0.0.1",
                        data_parallel_master_port=dp_port)
    return VllmConfig(model_config=_model_config(model_dir, MODELS[sc.model]["dtype"]), parallel_config=pc,
                      device_config=DeviceConfig(device="cpu"), additional_config={"afd": afd})


def dp_metadata(vc: Any, counts: list[int]) -> Any:
    """vLLM's ``DPMetadata`` of one stage (``make`` where vLLM would call it: DP > 1)."""
    from vllm.forward_context import DPMetadata

    t = torch.tensor(counts, dtype=torch.int32)
    pc = vc.parallel_config
    if pc.data_parallel_size > 1:
        return DPMetadata.make(pc, int(counts[pc.data_parallel_rank]), t)
    return DPMetadata(t)


# ---------------------------------------------------------------------------- FFN role


class _ShutdownSpy:
    """Counts completed calls of vLLM's ``Worker.shutdown`` (the original runs)."""

    def __init__(self):
        from vllm.v1.worker.gpu_worker import Worker

        self.done = 0
        original = Worker.shutdown

        def shutdown(worker_self):
            original(worker_self)
            self.done += 1

        Worker.shutdown = shutdown


def ffn_role(sc: Scenario, rank: int, vc: Any, done: Any) -> dict[str, Any]:
    from afd_plugin.v1.worker.ffn_model_runner import GPUFFNModelRunner
    from afd_plugin.v1.worker.ffn_worker import AFDFFNWorker
    from vllm.distributed.elastic_ep.elastic_execute import ElasticEPScalingExecutor

    spy = _STATE.get("spy") or _STATE.setdefault("spy", _ShutdownSpy())
    hooked: list[str] = []  # what reached threading.excepthook, whose default ignores exactly SystemExit
    original_hook = threading.excepthook
    threading.excepthook = lambda args: (hooked.append(f"{args.thread.name}: {args.exc_type.__qualname__}"
                                                       + ("" if args.exc_type is SystemExit else " (not exactly)")),
                                         original_hook(args))
    before = spy.done
    runner = GPUFFNModelRunner(vc, torch.device("cpu"))
    assert type(runner.connector).__module__ == "afd_ext.integrations.afd_plugin", type(runner.connector)
    model = FFNModel(vc.model_config.hf_config, vc.model_config.dtype)
    runner.model = model
    # The worker as vLLM builds it, minus Worker.__init__/init_device (a GPU's): the fields they set
    # (vLLM >= 0.30's Worker.shutdown() calls elastic_ep_executor.shutdown()).
    w = AFDFFNWorker.__new__(AFDFFNWorker)
    w.vllm_config, w.cache_config, w.model_runner = vc, vc.cache_config, runner
    w.device, w.profiler = torch.device("cpu"), None
    w.elastic_ep_executor = ElasticEPScalingExecutor(w)
    w._ffn_thread = w._ffn_shutdown_event = w._ffn_loop_error = None
    if sc.mismatch:
        try:
            w.initialize_from_config(type("KVCacheConfig", (), {"num_blocks": 0})())
        except Exception as e:  # noqa: BLE001 - returned to the test, which checks it
            done.wait(600)
            runner.connector.close()
            return {"role": "ffn", "error": f"{type(e).__name__}: {e}"}
        raise AssertionError("the FFN rank connected despite a router-logits dtype mismatch")
    w.initialize_from_config(type("KVCacheConfig", (), {"num_blocks": 0})())  # connects, starts its loop thread
    thread = w._ffn_thread
    assert thread is not None and thread.is_alive()
    if sc.attention_dies:
        thread.join(timeout=600)
        assert not thread.is_alive(), "the FFN loop thread is still waiting on a dead peer"
        loop_error = w._ffn_loop_error
        try:
            w.shutdown()
        except RuntimeError as e:
            stop_error = e
        else:
            raise AssertionError("stop_ffn_server_loop did not raise the loop's failure")
        threading.excepthook = original_hook
        assert hooked == [], hooked  # a failure is recorded by the loop, never a SystemExit
        return {"role": "ffn", "calls": model.calls, "loop_error": f"{type(loop_error).__name__}: {loop_error}",
                "stop_error": str(stop_error), "cause": type(stop_error.__cause__).__name__,
                "worker_shutdown_ran": spy.done - before}
    if sc.rejoin:
        done.wait(600)  # every attention process has run its steps and exited (the test sets the event)
        end = time.monotonic() + 60
        while not (len(model.calls) == len(_ffn_calls(sc)) and _in_call(thread, "init_afd_connector")):
            assert time.monotonic() < end and thread.is_alive(), ("the loop never waited again", model.calls)
            time.sleep(0.01)
        t0 = time.monotonic()
        w.shutdown()  # its connector's close() ends the loop's wait for the next attention process
        took = time.monotonic() - t0
    elif sc.in_flight is not None:
        done.wait(600)  # the attention side sent the in-flight step's payload, not its rows
        end = time.monotonic() + 60
        while not _in_call(thread, "recv_attn_output") and time.monotonic() < end:
            time.sleep(0.01)
        if not _in_call(thread, "recv_attn_output"):
            import sys
            import traceback

            raise AssertionError("the FFN loop thread is not waiting in recv_attn_output: " + "".join(
                traceback.format_stack(sys._current_frames().get(thread.ident))) + repr(w._ffn_loop_error))
        t0 = time.monotonic()
        if sc.order == "attn_first":
            done.wait(600)  # the attention side closes mid-step now
            thread.join(timeout=5)
            assert not thread.is_alive() and time.monotonic() - t0 < 1.0, "the loop did not end on the close"
            assert w._ffn_loop_error is None, repr(w._ffn_loop_error)
            t0 = time.monotonic()
        w.shutdown()  # stop_ffn_server_loop (the loop thread is in recv_attn_output if still running), Worker.shutdown
        took = time.monotonic() - t0
        if sc.order == "ffn_first":
            done.wait(600)  # the attention side calls now
        done.wait(600)  # the attention side is done
    elif sc.order == "attn_first":
        thread.join(timeout=600)  # ends on the attention side's goodbye
        assert not thread.is_alive(), "the FFN loop thread did not end on the peer's goodbye"
        assert w._ffn_loop_error is None, repr(w._ffn_loop_error)
        t0 = time.monotonic()
        w.shutdown()
        took = time.monotonic() - t0
        done.wait(600)
    else:
        done.wait(600)  # every reply checked on the attention side
        t0 = time.monotonic()
        w.shutdown()  # stop_ffn_server_loop, then vLLM's Worker.shutdown
        took = time.monotonic() - t0
        done.wait(600)  # only now does the attention side close
    assert not thread.is_alive(), "the FFN loop thread is still running after shutdown()"
    assert spy.done == before + 1, "vLLM's Worker.shutdown() did not complete"
    assert took < 1.0, f"AFDFFNWorker.shutdown() took {took:.2f} s"
    assert not runner.connector.is_initialized
    threading.excepthook = original_hook
    assert hooked == ["afd-ffn-worker-loop: SystemExit"], hooked  # the loop ended quietly, nothing else raised
    return {"role": "ffn", "calls": model.calls, "shutdown_s": took, "router_dtype": str(model.router_dtype)}


def _ffn_calls(sc: Scenario) -> list:
    """The FFN model's calls of ``sc``: every attention process's steps (``rejoin``), each as in the runner."""
    return [c for steps in (sc.steps, *sc.rejoin) for c in _layer_calls(sc, steps)]


def _layer_calls(sc: Scenario, steps: tuple) -> list:
    layers = range(1, LAYERS) if sc.gate else range(LAYERS)
    return [(layer, sum(max(1, c) for c in step[s]), sc.gate, [-(-c // SP) for c in step[s] for _ in range(SP)])
            for step in steps for layer in layers for s in sorted(step)]


def _in_call(thread: Any, name: str) -> bool:
    """Whether ``thread`` is inside a function called ``name`` now."""
    import sys

    frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame.f_code.co_name != name:
        frame = frame.f_back
    return frame is not None


# ---------------------------------------------------------------------------- attention role


def _attention_modules(vc: Any, gate: bool) -> dict[int, Any]:
    """afd-plugin's attention-side FFN modules per exchanged layer, with deterministic gate weights."""
    from afd_plugin.model_executor.models.deepseek_v2 import AFDDeepseekV2RemoteExpertsMoE, RemoteFFNProxy

    hf = vc.model_config.hf_config
    mods: dict[int, Any] = {}
    old = torch.get_default_dtype()
    torch.set_default_dtype(vc.model_config.dtype)
    try:
        for layer in range(LAYERS):
            if layer == 0:
                if not gate:
                    mods[layer] = RemoteFFNProxy(layer_idx=layer)
                continue
            m = AFDDeepseekV2RemoteExpertsMoE(config=hf, parallel_config=vc.parallel_config, layer_idx=layer,
                                              prefix=f"model.layers.{layer}.mlp", compute_gate_on_attention=gate)
            if gate:
                w = torch.arange(EXPERTS * HIDDEN, dtype=torch.float32).reshape(EXPERTS, HIDDEN)
                m.gate.weight.data.copy_(((w * (layer + 1)) % 5 - 2) / 64)
            mods[layer] = m
    finally:
        torch.set_default_dtype(old)
    return mods


def attention_role(sc: Scenario, rank: int, role_rank: int, dp_rank: int, vc: Any, done: Any) -> dict[str, Any]:
    from afd_plugin.config import parse_afd_config
    from afd_plugin.connectors import AFDConnectorFactory, AFDControlPayload, AFDForwardContextMetadata
    from vllm.forward_context import get_forward_context, set_forward_context

    conn = AFDConnectorFactory.create_connector(rank, 0, vc, parse_afd_config(vc, expected_role="attention"))
    assert type(conn).__module__ == "afd_ext.integrations.afd_plugin", type(conn)
    assert conn.role_rank == role_rank, (conn.role_rank, role_rank)
    dtype = vc.model_config.dtype
    mods = _attention_modules(vc, sc.gate)
    calls = {layer: m for layer, m in mods.items()}
    graphs: list[int] = []
    if sc.compile:
        inner = torch._dynamo.lookup_backend(sc.compile)

        def counting(gm, example_inputs):
            graphs.append(sum(1 for n in gm.graph.nodes if "afd_ext_plugin" in str(n.target)))
            return inner(gm, example_inputs)

        calls = {layer: torch.compile(m, backend=counting, dynamic=True) for layer, m in mods.items()}
    checked = 0
    if sc.mismatch:
        try:
            conn.init_afd_connector()
        except Exception as e:  # noqa: BLE001 - returned to the test, which checks it
            return {"role": "attention", "error": f"{type(e).__name__}: {e}"}
        finally:
            done.wait(600)
            conn.close()
        raise AssertionError("the attention rank connected despite a router-logits dtype mismatch")
    conn.init_afd_connector()
    try:
        for i, step in enumerate(sc.steps):
            time.sleep(sc.idle_before.get(i, 0.0))
            flags = sc.flags.get(i, {})
            p = AFDControlPayload({s: dp_metadata(vc, c) for s, c in step.items()},
                                  is_graph_capturing=flags.get("is_graph_capturing", False),
                                  is_warmup=flags.get("is_warmup", False))
            conn.control_plane.update_state_from_dp_metadata(p)
            conn.control_plane.send_dp_metadata_list(p)
            stages = sorted(step)
            rows = {s: max(1, int(step[s][dp_rank])) for s in stages}  # idle DP rank: a one-token dummy batch
            for layer in sorted(mods):
                for s in stages:  # the ubatch ids vLLM's DBO would run, driven directly
                    h = inputs(i, layer, s, role_rank, rows[s], dtype)
                    logits = None
                    if sc.gate:
                        logits, _ = mods[layer].gate(h)
                        want_dtype = torch.float32 if sc.model in ("dsv3_fp32router", "glm_moe_dsa") else dtype
                        assert logits.dtype == want_dtype, (logits.dtype, want_dtype)
                    want = ffn_fn(h, logits, layer)
                    with set_forward_context(None, vc):
                        fc = get_forward_context()
                        fc.dp_metadata = p.dp_metadata_list[s]
                        fc.additional_kwargs["afd_metadata"] = AFDForwardContextMetadata(
                            tokens_start_loc=[0], requests_start_loc=[0], stage_idx=s, connector=conn,
                            tokens_lens=[rows[s]], num_stages=len(stages))
                        out = calls[layer](h.clone())
                    assert out.dtype == dtype and out.shape == h.shape
                    assert torch.equal(out, want), f"step {i} layer {layer} stage {s}: reply differs\n{out}\n{want}"
                    checked += 1
        if sc.in_flight is not None:
            return _stop_in_flight(sc, conn, vc, calls, mods, role_rank, dp_rank, done, checked)
        if sc.attention_dies:
            os._exit(0)  # no close, no goodbye: the process is gone
        if sc.killed:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)  # every reply checked; no close, no goodbye
        if sc.order == "ffn_first":
            done.wait(600)  # every rank checked its replies
            done.wait(600)  # the FFN worker has shut down
    finally:
        conn.close()
    if sc.order == "attn_first":
        done.wait(600)  # the FFN worker ended its loop on the goodbye and shut down
    return {"role": "attention", "checked": checked, "graphs": graphs}


def _stop_in_flight(sc: Scenario, conn: Any, vc: Any, calls: dict, mods: dict, role_rank: int, dp_rank: int,
                    done: Any, checked: int) -> dict[str, Any]:
    """Apply and send the in-flight step's payload, then stop in ``sc.order`` (see ``ffn_role``)."""
    from afd_plugin.connectors import AFDControlPayload, AFDForwardContextMetadata
    from vllm.forward_context import get_forward_context, set_forward_context

    p = AFDControlPayload({s: dp_metadata(vc, c) for s, c in sc.in_flight.items()}, is_graph_capturing=False,
                          is_warmup=False)
    conn.control_plane.update_state_from_dp_metadata(p)
    conn.control_plane.send_dp_metadata_list(p)
    done.wait(600)  # the FFN loop thread now waits in recv_attn_output for this step's rows
    out: dict[str, Any] = {"role": "attention", "checked": checked, "graphs": []}
    done.wait(600)  # attn_first: the FFN rank saw its loop thread wait; ffn_first: the FFN worker has shut down
    if sc.order == "attn_first":
        conn.close()  # mid-step
    else:
        layer, rows = min(mods), max(1, int(sc.in_flight[0][dp_rank]))
        t0 = time.monotonic()
        try:
            with set_forward_context(None, vc):
                fc = get_forward_context()
                fc.dp_metadata = p.dp_metadata_list[0]
                fc.additional_kwargs["afd_metadata"] = AFDForwardContextMetadata(
                    tokens_start_loc=[0], requests_start_loc=[0], stage_idx=0, connector=conn,
                    tokens_lens=[rows], num_stages=1)
                calls[layer](inputs(len(sc.steps), layer, 0, role_rank, rows, vc.model_config.dtype))
        except Exception as e:  # noqa: BLE001 - checked by the test
            out.update(stop_error=f"{type(e).__name__}: {e}", stop_error_s=time.monotonic() - t0)
        conn.close()
    done.wait(600)
    return out


# ---------------------------------------------------------------------------- entry


def worker_to_queue(rank: int, nprocs: int, args: tuple, q: Any, ready: Any = None) -> None:
    """:func:`worker` in a process that may exit without reporting: its record (or traceback) goes to ``q``.

    ``ready``: an event to wait for before starting (a restarted attention process imports vLLM first).
    """
    import traceback

    try:
        if ready is not None:
            import vllm.config  # noqa: F401 - the slow part of a start, done before the wait

            assert ready.wait(600)
        q.put((rank, "ok", worker(rank, nprocs, *args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", traceback.format_exc()))


def worker(rank: int, nprocs: int, scenarios: tuple, ports: tuple, world_port: int, model_dirs: dict,
           done: Any) -> list:
    """Run ``scenarios`` (same topology) one after the other in this process; one record each.

    ``ports``: each scenario's AFD port; ``world_port``: the base of the vLLM worlds' ports (80 free).
    """
    os.environ["AFD_EXT_REPLACE_P2P"] = "1"
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    logged: list[str] = []  # afd_ext's INFO/WARNING lines of the integration module
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(f"{record.levelname} {record.getMessage()}")
    log = logging.getLogger("afd_ext.integrations.afd_plugin")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    if any(sc.rejoin for sc in scenarios):  # the rendezvous's waits, named
        logging.getLogger("afd_ext.rendezvous").addHandler(handler)
    out = []
    for sc, port in zip(scenarios, ports):
        logged.clear()
        role = "ffn" if rank < sc.F else "attention"
        role_rank = rank if role == "ffn" else rank - sc.F
        dp, tp = sc.ffn if role == "ffn" else sc.attn
        dp_rank, tp_rank = role_rank // tp, role_rank % tp
        vc = vllm_config(sc, role, dp_rank, port, model_dirs[sc.ffn_model if role == "ffn" and sc.ffn_model
                                                             else sc.model], world_port + 60)
        # One vLLM world (TP wide) per role and DP rank, as each DP engine runs its own TP world; the DP
        # ranks' own group is left out (it would join both roles' DP ranks through one master port).
        one = dataclasses.replace(sc, attn=(1, sc.attn[1]), ffn=(1, sc.ffn[1]))
        with set_current_vllm_config(vllm_config(one, role, 0, port, model_dirs[sc.model], 0)):
            _vllm_world(role, dp_rank, tp, tp_rank, world_port + (0 if role == "ffn" else 50) + dp_rank)
        with set_current_vllm_config(vc):  # as a vLLM worker runs
            if role == "ffn":
                rec = ffn_role(sc, rank, vc, done)
            else:
                rec = attention_role(sc, rank, role_rank, dp_rank, vc, done)
        out.append({"scenario": sc.name, "thread_names": sorted(t.name for t in threading.enumerate()),
                    "logged": list(logged), **rec})
    return out
