"""``afd-ext demo``: a real transformers MoE decoder served AFD-style, checked against the whole model.

What it does, in order:

1. Builds a Hugging Face ``transformers`` mixture-of-experts decoder from a
   config kept in this package (``afd_ext/tools/data/models/*.json``; Qwen3-MoE by
   default, ``--dims deepseek-v2-lite`` for DeepSeek-V2-Lite's MoE shapes) with
   weights drawn from a fixed seed, identical in every process (each
   parameter has its own generator seeded from its name).
2. Starts ``A`` attention processes and ``F`` FFN processes on this machine
   (AFD world order: FFN ranks first). Attention processes keep embeddings,
   attention, norms, the LM head and their own KV cache; FFN processes hold
   the MLP / MoE blocks (:mod:`afd_ext.integrations.transformers`).
3. Each attention rank serves its own requests (prompts from
   ``afd_ext/tools/data/prompts.txt``, UTF-8 bytes, different lengths, different
   numbers of tokens to generate): one prefill step, then greedy decoding with
   a KV cache. Requests leave the batch when done, so later steps see ranks
   with zero tokens. The attention ranks agree on every step's per-rank
   counts with :class:`afd_ext.metadata.StepCountAgreement`; the control plane
   carries them to the FFN ranks.
4. Checks itself: the whole model, in one process, runs on the same token
   sequences (teacher forcing) and the logits at every position must agree
   within a named tolerance; greedy tokens must be identical wherever the
   gap between the top two logits exceeds it. A mismatch exits non-zero
   and names the rank, request and position.
5. Prints a summary (topology, backend and FP8 wire format, model, steps,
   tokens, tokens/s, exchange latency p50 / p99, bytes per step);
   ``--json PATH`` writes the same as JSON.

Run: ``afd-ext demo`` (or ``python -m afd_ext demo``); ``afd-ext demo --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.resources
import json
import logging
import math
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from afd_ext.errors import AFDConfigError, AFDError, AFDTimeoutError
from afd_ext.tools.cli import ranged
from afd_ext.topology import rank_label

if TYPE_CHECKING:
    from afd_ext.tools.testing import GpuPlacement

logger = logging.getLogger("afd_ext.tools.demo")

# ---------------------------------------------------------------------------
# Tolerances of the self-check (absolute, on logits)
# ---------------------------------------------------------------------------

#: fp32 on CPU: the split computes exactly the whole model's operations; the
#: only differences come from GEMM shapes (the FFN rank multiplies the
#: concatenated rows of every attention rank, the whole model one request's
#: rows), i.e. summation order, about 1e-6 on logits of order 1. 1e-4 leaves
#: two orders of magnitude of headroom and still catches any real error (a
#: wrong row, layer or expert moves logits by 1e-2 or more).
LOGIT_ATOL_FP32 = 1e-4
#: bf16 on GPU: the fan-in changes GEMM shapes and with them cuBLAS kernels
#: and accumulation order; every intermediate is rounded to bf16 (relative
#: step 2**-8), across 4+ layers of residual stream and a router whose top-k
#: can flip on a near tie (an expert of weight ~1/num_experts swapped). On
#: logits of order 1 that is a few hundredths; 0.25 is loose enough for that
#: and still far below the spread of wrong results (a misrouted row or a
#: swapped request moves logits by order 1).
LOGIT_ATOL_BF16 = 0.25
#: ``--fp8`` (FP8 hidden states attention -> FFN): the whole model rounds its FFN inputs by the same rule,
#: so an element differs only where its bf16 input already differs, by d < one e4m3 step s (a bf16 ulp is
#: s / 16): it crosses a rounding boundary with probability |d| / s and then differs by s, i.e. by |d| in
#: expectation, what the bf16 tolerance allows. The factor covers the crossing count's fluctuation
#: (twice its mean: under 1% for a row of 128 channels, far less at real hidden sizes). docs/fp8.md.
LOGIT_ATOL_FP8_FACTOR = 2.0

# Byte vocabulary: 256 byte values + specials.
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258

_DATA = importlib.resources.files("afd_ext.tools.data")


# ---------------------------------------------------------------------------
# Model config, prompts, requests
# ---------------------------------------------------------------------------


def available_dims() -> list[str]:
    """Names of the model configs shipped in ``afd_ext/tools/data/models`` (without ``.json``)."""
    return sorted(p.name[:-5] for p in _DATA.joinpath("models").iterdir() if p.name.endswith(".json"))


def load_model_config(name_or_path: str) -> dict[str, Any]:
    """Load a model config: a shipped name (``tiny``, ``small``, ``deepseek-v2-lite``) or a JSON path.

    Args:
        name_or_path: see :func:`available_dims`, or a path to a JSON file with
            ``model_type`` and the config fields of that transformers class.

    Returns:
        The config as a dict (``_comment`` keys dropped), with ``model_type``.

    Raises:
        AFDConfigError: unknown name, unreadable or invalid JSON, no ``model_type``.
    """
    shipped = not name_or_path.endswith(".json")
    if shipped and name_or_path not in available_dims():
        raise AFDConfigError(f"unknown model dims {name_or_path!r}: choose one of {available_dims()} or give a .json path")
    try:
        text = (_DATA.joinpath("models", f"{name_or_path}.json") if shipped else Path(name_or_path)).read_text("utf-8")
    except OSError as e:
        raise AFDConfigError(f"model dims file {name_or_path!r}: cannot read it ({e.strerror or e})") from None
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise AFDConfigError(f"model config {name_or_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise AFDConfigError(f"model config {name_or_path} must be a JSON object with a 'model_type' string")
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def load_prompts(path: str | None = None) -> list[str]:
    """Prompts, one per line (blank lines and ``#`` comments skipped); default the shipped file.

    Raises:
        AFDConfigError: the file cannot be read, or has no prompt.
    """
    try:
        text = (_DATA.joinpath("prompts.txt") if path is None else Path(path)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AFDConfigError(f"--prompts {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    prompts = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise AFDConfigError(f"no prompts in {path or 'afd_ext/tools/data/prompts.txt'}")
    return prompts


def encode_prompt(text: str, max_len: int) -> list[int]:
    """``[BOS] + UTF-8 bytes of text``, truncated to ``max_len`` token ids (>= 2)."""
    if max_len < 2:
        raise AFDConfigError(f"max prompt length must be >= 2, got {max_len}")
    return ([BOS_ID] + list(text.encode("utf-8")))[:max_len]


@dataclass(frozen=True)
class Request:
    """One request of one attention rank.

    Attributes:
        rid: request id, ``"a<rank>r<j>"``.
        rank: attention role rank serving it.
        prompt_ids: token ids (BOS + bytes).
        max_new_tokens: tokens to generate (>= 1) unless EOS comes first.
    """

    rid: str
    rank: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int


def make_requests(num_attention: int, requests_per_rank: int, max_new_tokens: int, *, prompts: Sequence[str],
                  max_prompt_len: int = 32) -> dict[int, list[Request]]:
    """Deterministic requests for every attention rank.

    Request ``j`` of rank ``a`` takes prompt ``(a + j * A) % len(prompts)`` and
    generates ``max(1, max_new_tokens - 2*j - 3*a)`` tokens, so requests leave
    the batch at different steps and higher ranks run out first (their later
    steps carry zero tokens).
    """
    if num_attention < 1 or requests_per_rank < 1 or max_new_tokens < 1:
        raise AFDConfigError("num_attention, requests_per_rank and max_new_tokens must be >= 1")
    A = num_attention
    return {a: [Request(f"a{a}r{j}", a, tuple(encode_prompt(prompts[(a + j * A) % len(prompts)], max_prompt_len)),
                        max(1, max_new_tokens - 2 * j - 3 * a)) for j in range(requests_per_rank)] for a in range(A)}


# ---------------------------------------------------------------------------
# Model construction and deterministic weights
# ---------------------------------------------------------------------------


def _no_init_context():
    """transformers' ``no_init_weights`` (5.x and 4.x homes) when available: skips its random init; ours follows."""
    for mod in ("transformers.initialization", "transformers.modeling_utils"):
        with contextlib.suppress(ImportError, AttributeError):
            return importlib.import_module(mod).no_init_weights()
    return contextlib.nullcontext()


def construct_model(model_config: Mapping[str, Any]):
    """Construct the transformers model of ``model_config`` on CPU, weights not initialised.

    Uses ``AutoConfig.for_model`` and ``AutoModelForCausalLM.from_config`` with
    eager attention: with left padding, eager attention's finite mask keeps
    padded rows finite on every transformers version (SDPA may give NaN rows).

    Returns:
        The model in eval mode (float32, CPU). Call :func:`init_weights` next
        (after splitting, so the attention side never initialises experts).

    Raises:
        AFDConfigError: unknown ``model_type`` for the installed transformers.
    """
    import torch
    import transformers

    cfg = dict(model_config)
    model_type = cfg.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    except (KeyError, ValueError) as e:
        raise AFDConfigError(f"transformers {transformers.__version__} does not know model_type {model_type!r}: "
                             f"{e}") from None
    config.use_cache = True
    with _no_init_context(), torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.float().eval()


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_weights(model, seed: int, *, device: str = "cpu", dtype=None) -> None:
    """Draw every parameter of ``model`` from its own generator, seeded by ``(seed, name)``.

    The values depend only on the seed, the parameter's name and shape and the
    device type, never on construction order or on which parameters exist,
    so an attention process (experts removed), an FFN process and the
    whole-model reference get identical weights wherever they share a
    parameter. Scheme: 1-D weights (norms) ``1 + 0.1 * N(0, 1)``; biases 0;
    embeddings ``N(0, 1)``; other matrices ``N(0, 1/fan_in)`` (fan-in = last
    dim), so activations and logits are of order 1 and the self-check's
    tolerances mean something.

    Args:
        model: an ``nn.Module``; parameters are replaced in place.
        seed: the demo seed.
        device: where to draw and keep the weights (``"cpu"`` or ``"cuda"``);
            values differ between device types, so compare runs on one type.
        dtype: cast to this dtype after drawing in float32 (``None``: keep float32).
    """
    import torch

    dev = torch.device(device)
    emb_w = getattr(model.get_input_embeddings(), "weight", None) if hasattr(model, "get_input_embeddings") else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name.rsplit(".", 1)[-1]:
                p.data = torch.zeros(p.shape, device=dev)
                continue
            v = torch.randn(p.shape, generator=torch.Generator(device=dev).manual_seed(_param_seed(seed, name)),
                            device=dev)
            p.data = 1.0 + 0.1 * v if p.dim() == 1 else v if p is emb_w else v / math.sqrt(p.shape[-1])
        model.to(device=dev, dtype=dtype)


def build_model(model_config: Mapping[str, Any], seed: int, *, device: str = "cpu", dtype=None):
    """Whole model: :func:`construct_model` then :func:`init_weights`."""
    model = construct_model(model_config)
    init_weights(model, seed, device=device, dtype=dtype)
    return model


def _cache_kwarg(model) -> str:
    """Name of the KV-cache keyword (``cache`` in transformers >= 5.x, else ``past_key_values``)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def reference_logits(model, token_ids: Sequence[int], device: str = "cpu"):
    """Whole-model logits for one sequence, teacher forced (no cache, no padding).

    Returns:
        ``[len(token_ids), vocab]`` float32 CPU tensor.
    """
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
        return model(input_ids=ids, use_cache=False).logits[0].float().cpu()


# ---------------------------------------------------------------------------
# Attention rank: prefill + greedy decoding through the split model
# ---------------------------------------------------------------------------


@dataclass
class RankResult:
    """What an attention rank reports back (picklable)."""

    rank: int
    requests: list[dict[str, Any]]
    step_counts: list[list[int]]  # per step: agreed total count of every attention rank
    wall_s: float
    latency_ns: dict[int, list[int]]
    bytes_sent: int
    bytes_received: int
    steps: int


def generate_attention_rank(model, exchange, agree: Callable[[list[int]], Any], requests: Sequence[Request], *,
                            rank: int, num_stages: int = 1, device: str = "cpu", progress: Any = None) -> RankResult:
    """Serve ``requests`` on one attention rank of a split model.

    Left-padded batch, one prefill step, then one decode step per generated
    token; a finished request stays in the batch masked out (its rows are not
    sent), so the KV cache never has to be re-packed. A step in which this
    rank has no live request runs only the exchanges, with zero rows
    (``exchange.idle_forward``). The loop ends when the agreed counts of all
    ranks are zero; then the FFN side is told to stop.

    Args:
        model: the attention role (after ``split_attention_role``), on ``device``.
        exchange: its ``AttentionExchange``.
        agree: ``f(local per-stage counts) -> AFDControlPayload`` (the step's
            agreement among attention ranks).
        requests: this rank's requests (may be empty).
        rank: this rank's DP index.
        num_stages: micro-batches per step.
        device: the model's device.
        progress: optional tqdm-like object (``update(1)``).

    Returns:
        :class:`RankResult` with, per request, the prompt, the generated tokens
        and the logits at every fed position (``[T, vocab]`` float32 CPU; the
        last generated token is never fed, so T = prompt + generated - 1).
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from afd_ext.integrations.transformers import stage_split

    B, dtype = len(requests), next(model.parameters()).dtype
    ids = pad_sequence([torch.tensor(r.prompt_ids) for r in requests], batch_first=True, padding_value=PAD_ID,
                       padding_side="left") if B else torch.empty(0, 0, dtype=torch.long)
    mask = (ids != PAD_ID).long()
    generated: list[list[int]] = [[] for _ in range(B)]
    logits_rec: list[list[torch.Tensor]] = [[] for _ in range(B)]
    forward_kw = {_cache_kwarg(model): _new_cache(model) if B else None, "use_cache": True}
    step_counts: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        while True:
            prefill = not step_counts
            live = [not g or (len(g) < r.max_new_tokens and g[-1] != EOS_ID) for g, r in zip(generated, requests)]
            row_mask = mask.bool() if prefill else torch.tensor(live, dtype=torch.bool).reshape(B, 1)
            n_local = int(row_mask.sum())
            payload = agree(stage_split(n_local, num_stages))
            totals = [sum(c) for c in zip(*payload.stage_counts().values())]
            if sum(totals) == 0:
                break
            step_counts.append(totals)
            exchange.begin_step(payload, dp_rank=rank, row_mask=row_mask if n_local else None)
            try:
                if n_local == 0:
                    exchange.idle_forward(device, dtype)
                else:
                    if prefill:
                        inp, pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
                    else:
                        inp = torch.tensor([g[-1] if ok else PAD_ID for g, ok in zip(generated, live)]).reshape(B, 1)
                        pos = mask.sum(-1, keepdim=True)  # index of the new token among the valid ones
                        mask = torch.cat([mask, row_mask.long()], dim=1)
                    logits = model(input_ids=inp.to(device), attention_mask=mask.to(device),
                                   position_ids=pos.to(device), **forward_kw).logits.float().cpu()
                    for b in (b for b in range(B) if live[b]):
                        logits_rec[b].append(logits[b, -int(mask[b].sum()):] if prefill else logits[b, -1:])
                        generated[b].append(int(logits_rec[b][-1][-1].argmax()))
            finally:
                exchange.end_step()
            if progress is not None:
                progress.update(1)
    wall = time.perf_counter() - t0
    exchange.shutdown()
    st = exchange.stats
    return RankResult(
        rank=rank, step_counts=step_counts, wall_s=wall, steps=len(step_counts),
        requests=[{"rid": r.rid, "rank": rank, "prompt_ids": list(r.prompt_ids), "generated": g,
                   "logits": torch.cat(lg, 0)} for r, g, lg in zip(requests, generated, logits_rec)],
        latency_ns={k: list(v) for k, v in st.latency_ns.items()},
        bytes_sent=st.bytes_sent, bytes_received=st.bytes_received)


# ---------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------


@dataclass
class CheckResult:
    """Outcome of :func:`self_check`.

    Attributes:
        ok: every position within tolerance and every decisive greedy token equal.
        tolerance: the absolute logit tolerance used.
        max_abs_diff: largest |split - whole| logit difference over all positions.
        positions: positions compared.
        worst: where the largest difference is (rank, request, position).
        failures: human-readable descriptions of the failures (first 20).
    """

    ok: bool
    tolerance: float
    max_abs_diff: float
    positions: int
    worst: str
    failures: list[str] = field(default_factory=list)


def self_check(results: Sequence[dict[str, Any]], whole_logits: Callable[[Sequence[int]], Any],
               tolerance: float) -> CheckResult:
    """Compare the split model's logits with the whole model's, teacher forced.

    Args:
        results: per request ``{"rid", "rank", "prompt_ids", "generated",
            "logits" [T, vocab]}`` from the attention ranks.
        whole_logits: ``f(token_ids) -> [len, vocab]`` of the whole model.
        tolerance: absolute logit tolerance.

    Returns:
        :class:`CheckResult`. A position fails when its largest difference
        exceeds ``tolerance``, or when its greedy token (argmax) differs from
        the whole model's while the whole model's top-2 gap exceeds ``tolerance``.
    """
    import torch

    max_diff, worst, failures, positions = 0.0, "-", [], 0
    for r in results:
        seq = list(r["prompt_ids"]) + list(r["generated"][:-1])
        split = torch.as_tensor(r["logits"]).float()
        where = f"attention rank {r['rank']}, request {r['rid']}"
        if split.shape[0] != len(seq):
            failures.append(f"{where}: {split.shape[0]} logit rows for {len(seq)} fed tokens")
            continue
        ref = whole_logits(seq).float()
        diff = (split - ref).abs().amax(dim=-1)
        top2 = ref.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        positions += len(seq)
        if float(diff.max()) > max_diff:
            max_diff, worst = float(diff.max()), f"{where}, position {int(diff.argmax())}"
        for p, (d, g, a, b) in enumerate(zip(diff.tolist(), gap.tolist(), split.argmax(-1).tolist(),
                                             ref.argmax(-1).tolist())):
            if not math.isfinite(d) or d > tolerance:
                failures.append(f"{where}, position {p}: max |logit diff| {d:.3g} > tolerance {tolerance:g}")
            elif a != b and g > tolerance:
                failures.append(f"{where}, position {p}: greedy token {a} != whole model's {b} (top-2 gap {g:.3g})")
    return CheckResult(ok=not failures, tolerance=tolerance, max_abs_diff=max_diff, positions=positions,
                       worst=worst, failures=failures[:20])


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


@dataclass
class DemoPlan:
    """Everything a worker needs (picklable).

    Attributes:
        num_attention / num_ffn: ``A`` and ``F``.
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` or ``"peer"`` (CUDA tensors; peer: the
            peer-memory transport over CUDA IPC, docs/peer-memory.md).
        dims: model config name or path; model_config: the loaded config.
        dtype: ``"float32"`` or ``"bfloat16"``.
        seed: weight seed.
        stages: micro-batches per step.
        gate_on_attention: router logits computed on the attention side.
        requests: ``{attention rank: [Request]}``.
        host / port: rendezvous of the connector; agree_port: the attention
            ranks' count agreement store, hosted by the launching process
            (:func:`run_demo` binds it before any worker starts; 0 until then).
        step_timeout_s: the connector's per-operation deadline (its init deadline: at least 120 s).
        progress: show a progress bar on attention rank 0.
        threads: torch intra-op threads per process.
        connector: a connector registry name, or ``"module:Class"`` for a
            class that is not registered (it is registered under that string).
        graph: graph mode (``--graph``): steps that fit the capture sizes are
            padded and replayed from captured graphs on both roles
            (:mod:`afd_ext.graphs`); on CPU/gloo a stand-in re-runs the
            captured exchanges instead (the same protocol, no CUDA graph).
        gpu_placement: the GPU of every process (NCCL only;
            :func:`afd_ext.tools.testing.place_processes`: one GPU per process with
            enough GPUs, else shared, on one GPU with NCCL over sockets).
        fp8: the scale format of FP8 hidden states on the wire (``"fp32"`` or ``"ue8m0"``), None: off.
    """

    num_attention: int
    num_ffn: int
    backend: str
    dims: str
    model_config: dict[str, Any]
    dtype: str
    stages: int
    gate_on_attention: bool
    requests: dict[int, list[Request]]
    host: str
    port: int
    agree_port: int = 0
    seed: int = 0
    step_timeout_s: float = 60.0
    progress: bool = True
    threads: int = 1
    connector: str = "AfdExtConnector"
    gpu_placement: GpuPlacement | None = None
    graph: bool = False
    verbose: bool = False
    fp8: str | None = None

    @property
    def device_type(self) -> str:
        return "cpu" if self.backend == "gloo" else "cuda"

    @property
    def init_timeout_s(self) -> float:
        return max(self.step_timeout_s, 120.0)

    @property
    def max_steps(self) -> int:
        return max((r.max_new_tokens for rs in self.requests.values() for r in rs), default=0)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)  # "float32" / "bfloat16"


def _connector_class(name: str) -> type:
    """The connector class ``--connector`` names (a registry name, or ``module:Class``, registered here).

    Raises:
        AFDConfigError: unknown name, a module that does not import, or not a connector class.
    """
    from afd_ext.factory import get_connector_class, known_connectors, register_connector

    if ":" in name and name not in known_connectors():
        register_connector(name, *name.split(":", 1))
    try:
        return get_connector_class(name)
    except (ImportError, TypeError) as e:
        raise AFDConfigError(f"--connector {name}: {e}") from None


def _make_connector(plan: DemoPlan, role: str, role_rank: int, world_rank: int, model) -> Any:
    """Create (not initialise) this process's connector through the factory."""
    import torch

    from afd_ext.config import AFDConfig
    from afd_ext.factory import create_connector
    from afd_ext.integrations.transformers import describe_layers, remote_layer_indices

    _connector_class(plan.connector)  # registers a module:Class connector in this process too
    extra = {"transport": plan.backend, "step_timeout_s": plan.step_timeout_s, "init_timeout_s": plan.init_timeout_s,
             "max_stages": max(4, plan.stages)}
    if plan.fp8:
        extra.update(hidden_wire_dtype="fp8_e4m3", fp8_scale_format=plan.fp8)
    afd = AFDConfig(connector=plan.connector, role=role, host=plan.host, port=plan.port,
                    num_attention_ranks=plan.num_attention, num_ffn_ranks=plan.num_ffn,
                    compute_gate_on_attention=plan.gate_on_attention, connector_extra_config=extra)
    infos = describe_layers(model)
    moe = [li for li in infos if li.is_moe]
    return create_connector(
        world_rank, 0, afd, role_rank=role_rank, hidden_size=infos[0].hidden_size, dtype=_torch_dtype(plan.dtype),
        # layer exchanges per stage per step: every layer, or only the MoE layers (gate on attention)
        num_layers=len(remote_layer_indices(model, gate_on_attention=plan.gate_on_attention)),
        router_logits_width=moe[0].num_experts if (plan.gate_on_attention and moe) else None,
        router_logits_dtype=torch.float32)


def _progress_bar(total: int, stream=None):
    """The steps bar on ``stream`` (default stderr), or None where that is not a terminal.

    Its lock is a thread lock: tqdm's default also makes a multiprocessing lock,
    a semaphore that this worker, stopped by its launcher, would leave to the
    resource tracker ("leaked semaphore objects" at exit).
    """
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc="afd demo steps", unit="step", file=stream, leave=True)


def _finish_bar(bar) -> None:
    """Close the bar at the steps actually run (``max_steps`` is an upper bound), ending its line."""
    bar.total = bar.n
    bar.close()  # leave=True: the final bar and a newline, so the summary starts on its own line


def _worker(rank: int, nprocs: int, plan: DemoPlan) -> dict[str, Any]:
    """One AFD process: FFN ranks are world ranks ``0..F-1``, attention ranks follow."""
    import torch

    from afd_ext.integrations import graph_runners
    from afd_ext.integrations.transformers import FFNServer, split_attention_role

    torch.set_num_threads(plan.threads)
    role, role_rank = ("ffn", rank) if rank < plan.num_ffn else ("attention", rank - plan.num_ffn)
    logging.basicConfig(level=logging.INFO if plan.verbose else logging.WARNING,
                        format=f"%(asctime)s {role} {role_rank} %(name)s %(levelname)s %(message)s")
    if plan.device_type == "cuda":
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES already binds this process to its GPU
    model = construct_model(plan.model_config)
    connector = _make_connector(plan, role, role_rank, rank, model)
    with contextlib.ExitStack() as stack:
        if role == "ffn":
            init_weights(model, plan.seed, device=plan.device_type, dtype=_torch_dtype(plan.dtype))
            server = FFNServer.from_model(model, connector, gate_on_attention=plan.gate_on_attention)
        else:
            # The attention side never initialises (nor moves to its device) the experts it gives away.
            exchange = split_attention_role(model, connector, gate_on_attention=plan.gate_on_attention,
                                            num_stages=plan.stages, timing=True)  # the summary's exchange latency
            init_weights(model, plan.seed, device=plan.device_type, dtype=_torch_dtype(plan.dtype))
            import torch.distributed as dist

            from afd_ext.metadata import StepCountAgreement

            # The attention ranks' step-count agreement as a serving engine does it: all_gather_object on a
            # gloo group (its timeout bounds the wait), over the store the launching process hosts.
            td = datetime.timedelta(seconds=plan.step_timeout_s)
            dist.init_process_group("gloo", store=dist.TCPStore(plan.host, plan.agree_port, is_master=False,
                                                                timeout=td),
                                    rank=role_rank, world_size=plan.num_attention, timeout=td)
            stack.callback(dist.destroy_process_group)
            agreement = StepCountAgreement.from_process_group()
        logger.info("model built; initialising the connector")
        connector.init_afd_connector()
        stack.callback(logger.info, "connector closed")
        stack.callback(connector.close)
        if role == "ffn":
            graph = graph_runners.FFNGraphServer(server, **_graph_options(plan)) if plan.graph else None
            if graph is not None:
                stack.callback(graph.close)
            logger.info("served %d steps", (graph or server).serve())
            return {"role": "ffn", "rank": role_rank, "rows": server.rows_served,
                    **({"graph_modes": dict(graph.modes)} if graph else {})}
        if plan.graph:
            exchange.graph_runner = stack.enter_context(contextlib.closing(
                graph_runners.AttentionGraphRunner(exchange, connector, **_graph_options(plan))))
        bar = _progress_bar(plan.max_steps) if plan.progress and role_rank == 0 else None
        if bar is not None:
            stack.callback(_finish_bar, bar)
        res = generate_attention_rank(model, exchange, agreement.agree, plan.requests.get(role_rank, []),
                                      rank=role_rank, num_stages=plan.stages, device=plan.device_type,
                                      progress=bar)
        logger.info("generated in %.2f s (%d steps)", res.wall_s, res.steps)
        # numpy, not torch: torch tensors cross a multiprocessing queue as shared-memory
        # handles that die with this process.
        for r in res.requests:
            r["logits"] = r["logits"].numpy()
        return {"role": "attention", "rank": role_rank, "result": res}


#: Per-peer capture sizes of ``--graph`` (decode batches of the demo are small;
#: larger steps, e.g. long prefills, run eagerly).
GRAPH_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)


def _graph_options(plan: DemoPlan) -> dict[str, Any]:
    """The graph runners' options: CUDA graphs on GPU; on CPU the stand-in re-runs the captured exchanges."""
    from afd_ext import graphs

    return {"capture_sizes": GRAPH_CAPTURE_SIZES,
            "backend": None if plan.device_type == "cuda" else graphs.EagerRecordingBackend()}


def _round_ffn_inputs(whole, plan: DemoPlan) -> None:
    """Make the whole model round its FFN inputs as FP8 on the wire does (docs/fp8.md): forward pre-hooks."""
    from afd_ext import fp8
    from afd_ext.integrations.transformers import decoder_layers, describe_layers, remote_layer_indices

    def rounded(m, a: tuple) -> tuple:
        m.afd_unrounded = a[0]  # the gate's input when it runs on the attention side
        x = fp8.quantize(a[0].reshape(-1, a[0].shape[-1]).cpu(), ue8m0=plan.fp8 == "ue8m0")
        return (fp8.dequantize(*x).reshape(a[0].shape).to(a[0].device),) + a[1:]

    infos = describe_layers(whole)
    for i in remote_layer_indices(whole, gate_on_attention=plan.gate_on_attention):
        mlp = getattr(decoder_layers(whole)[i], infos[i].mlp_attr)
        mlp.register_forward_pre_hook(rounded)
        if plan.gate_on_attention:  # the router sees what the attention rank has: the input unrounded
            getattr(mlp, infos[i].gate_attr).register_forward_pre_hook(
                lambda g, a, mlp=mlp: (mlp.afd_unrounded.reshape(a[0].shape),) + a[1:])


def run_demo(plan: DemoPlan, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the processes of ``plan`` and the self-check; return the summary dict.

    Raises:
        afd_ext.tools.testing.WorkerError: a process failed (``label`` names its role); AFDTimeoutError: the
            processes still running at ``timeout_s``, by role; AFDPeerError: a process died without reporting
            (a signal, an exit).
    """
    import torch.distributed as dist

    from afd_ext.tools.testing import WorkerError, run_workers

    # The attention ranks' count-agreement store: bound here, before any worker
    # starts, so no other socket can take its port in between.
    agree_store = dist.TCPStore(plan.host, 0, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=plan.step_timeout_s))
    plan = dataclasses.replace(plan, agree_port=int(agree_store.port))
    t0 = time.perf_counter()
    logger.info("starting %d processes", plan.num_attention + plan.num_ffn)
    try:
        outs = run_workers(_worker, plan.num_attention + plan.num_ffn, (plan,), timeout_s=timeout_s,
                           env={"OMP_NUM_THREADS": str(plan.threads), "TOKENIZERS_PARALLELISM": "false"},
                           per_rank_env=plan.gpu_placement.env() if plan.gpu_placement is not None else None)
    except WorkerError as e:
        e.label = rank_label(e.rank, plan.num_ffn)  # the one-line error names the role (afd_ext.tools.cli.error_line)
        raise
    except TimeoutError as e:
        still = ", ".join(rank_label(r, plan.num_ffn) for r in getattr(e, "ranks", ()))
        raise AFDTimeoutError(f"the demo did not finish within --timeout {timeout_s:g} s; still running: {still}") from None
    run_s = time.perf_counter() - t0
    att = sorted((o["result"] for o in outs if o["role"] == "attention"), key=lambda r: r.rank)
    logger.info("processes done in %.1f s; running the whole model for the self-check", run_s)
    # Whole model, one process, same sequences (teacher forcing).
    whole = build_model(plan.model_config, plan.seed, device=plan.device_type, dtype=_torch_dtype(plan.dtype))
    tol = LOGIT_ATOL_FP32 if plan.dtype == "float32" else LOGIT_ATOL_BF16
    if plan.fp8:
        _round_ffn_inputs(whole, plan)
        tol *= LOGIT_ATOL_FP8_FACTOR
    check = self_check([r for a in att for r in a.requests],
                       lambda seq: reference_logits(whole, seq, plan.device_type), tol)
    return summarize(plan, att, [o for o in outs if o["role"] == "ffn"], check, run_s)


def _pct(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (a measured sample, not an interpolation); NaN when empty."""
    import numpy as np

    return float(np.percentile(xs, q, method="inverted_cdf")) if len(xs) else float("nan")


def summarize(plan: DemoPlan, att: Sequence[RankResult], ffn: Sequence[Mapping[str, Any]],
              check: CheckResult, run_s: float) -> dict[str, Any]:
    """The summary as a JSON-able dict (see :func:`format_summary`)."""
    mc = plan.model_config
    steps = max((a.steps for a in att), default=0)
    gen_tokens = sum(len(r["generated"]) for a in att for r in a.requests)
    wall = max((a.wall_s for a in att), default=0.0)
    # The first step's exchanges (one per stage and layer, in step order) pay the lazy set-up (NCCL
    # connections, cuBLAS handles, allocator growth): kept apart so p50/p99 describe the steady state.
    first_us = [ns / 1e3 for a in att for v in a.latency_ns.values() for ns in v[:plan.stages]]
    steady_us = [ns / 1e3 for a in att for v in a.latency_ns.values() for ns in v[plan.stages:]]
    bytes_a2f, bytes_f2a = sum(a.bytes_sent for a in att), sum(a.bytes_received for a in att)
    step_counts = att[0].step_counts if att else []
    ffn = sorted(ffn, key=lambda o: o["rank"])
    return {
        "topology": f"{plan.num_attention}A{plan.num_ffn}F",
        "num_attention_ranks": plan.num_attention,
        "num_ffn_ranks": plan.num_ffn,
        "backend": plan.backend,
        "fp8": plan.fp8,
        "device": plan.device_type,
        "placement": _placement_text(plan),
        # Processes sharing a GPU are time-sliced (and on one GPU NCCL goes over sockets).
        "latencies_meaningful": plan.gpu_placement is None or plan.gpu_placement.timings_meaningful,
        "model": {
            "model_type": mc.get("model_type"), "dims": plan.dims, "layers": mc.get("num_hidden_layers"),
            "hidden_size": mc.get("hidden_size"),
            "num_experts": mc.get("num_experts", mc.get("num_local_experts", mc.get("n_routed_experts"))),
            "top_k": mc.get("num_experts_per_tok"),
            "moe_intermediate_size": mc.get("moe_intermediate_size", mc.get("intermediate_size")),
            "vocab_size": mc.get("vocab_size"), "dtype": plan.dtype,
        },
        "stages": plan.stages,
        "gate": "attention" if plan.gate_on_attention else "ffn",
        "requests": sum(len(v) for v in plan.requests.values()),
        "steps": steps,
        "steps_with_zero_token_rank": sum(1 for c in step_counts if 0 in c),
        "step_counts": step_counts,
        "prompt_tokens": sum(len(r["prompt_ids"]) for a in att for r in a.requests),
        "generated_tokens": gen_tokens,
        "generation_s": wall,
        "tokens_per_s": gen_tokens / wall if wall > 0 else float("nan"),
        "total_s": run_s,
        "exchange_latency_us": {"p50": _pct(steady_us, 50), "p99": _pct(steady_us, 99), "count": len(steady_us),
                                "first_step_max": max(first_us, default=float("nan"))},
        "bytes": {"attention_to_ffn": bytes_a2f, "ffn_to_attention": bytes_f2a,
                  "per_step": (bytes_a2f + bytes_f2a) / steps if steps else 0.0},
        "ffn_rows_served": [int(o["rows"]) for o in ffn],
        "graph": plan.graph,
        "ffn_graph_modes": [o.get("graph_modes") for o in ffn],
        "self_check": asdict(check),
    }


def _shared_gpu_note(backend: str) -> str:
    """How processes sharing one GPU exchange data with ``backend`` (the summary's note)."""
    return ("peer memory (CUDA IPC) between processes on one GPU" if backend == "peer"
            else "on one GPU NCCL goes over sockets")


def _placement_text(plan: DemoPlan) -> str:
    """Where the processes run, with what sharing a GPU means for ``plan.backend``."""
    placement = plan.gpu_placement
    if placement is None:
        return "CPU processes (gloo)"
    if plan.backend != "peer" or not placement.nccl_hostids:
        return placement.describe()
    # describe() explains NCCL's NCCL_HOSTID arrangement, which the peer-memory plane does not use.
    base = dataclasses.replace(placement, nccl_hostids=()).describe().split(" (", 1)[0]
    return f"{base} ({_shared_gpu_note('peer')}; correctness only)"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GiB"


def format_summary(s: Mapping[str, Any]) -> str:
    """Human-readable summary of :func:`summarize`'s dict."""
    m, lat, ck, b = s["model"], s["exchange_latency_us"], s["self_check"], s["bytes"]
    wire = f"; FP8 hidden states attention->FFN ({s['fp8']} scales)" if s.get("fp8") else ""
    lines = [
        "afd_ext demo summary",
        f"  topology        {s['topology']} ({s['num_attention_ranks']} attention, {s['num_ffn_ranks']} FFN ranks), "
        f"stages {s['stages']}, gate on {s['gate']}",
        f"  backend         {s['backend']} ({s['device']}){wire}",
        f"  placement       {s['placement']}",
        f"  model           {m['model_type']} '{m['dims']}': {m['layers']} layers, hidden {m['hidden_size']}, "
        f"{m['num_experts']} experts top-{m['top_k']}, moe_intermediate {m['moe_intermediate_size']}, "
        f"vocab {m['vocab_size']}, {m['dtype']}",
        f"  requests        {s['requests']}, steps {s['steps']} (with a zero-token attention rank: "
        f"{s['steps_with_zero_token_rank']})",
        f"  tokens          prompt {s['prompt_tokens']}, generated {s['generated_tokens']} in "
        f"{s['generation_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s",
        f"  layer exchange  p50 {lat['p50']:.1f} us, p99 {lat['p99']:.1f} us over {lat['count']} exchanges "
        "(attention side: send, FFN compute, receive; from step 2 on)",
        f"                  step 1 (lazy set-up) slowest {lat['first_step_max']:.1f} us",
    ]
    if not s["latencies_meaningful"]:
        lines.append(f"  NOTE            processes share a GPU (time-sliced; {_shared_gpu_note(s['backend'])}): "
                     "these latencies are not meaningful, only the self-check is")
    lines.append(f"  bytes moved     {_fmt_bytes(b['per_step'])} per step (attention->FFN "
                 f"{_fmt_bytes(b['attention_to_ffn'])}, FFN->attention {_fmt_bytes(b['ffn_to_attention'])} in total)")
    lines.append(f"  self-check      {'PASS' if ck['ok'] else 'FAIL'}: max |logit diff| {ck['max_abs_diff']:.3g} "
                 f"(tolerance {ck['tolerance']:g}) over {ck['positions']} positions vs the whole model; "
                 f"worst at {ck['worst']}")
    return "\n".join(lines + [f"    mismatch: {f}" for f in ck["failures"]])


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


_TOPOLOGY_RE = re.compile(r"\s*(\d+)\s*(?:A\s*(\d+)\s*F|[x:]\s*(\d+))\s*", re.IGNORECASE)


def parse_topology(text: str) -> tuple[int, int]:
    """``"2A1F"``, ``"2x1"`` or ``"2:1"`` (any case) -> ``(attention ranks, FFN ranks)``.

    Raises:
        AFDConfigError: another form, or fewer than one rank of a role.
    """
    m = _TOPOLOGY_RE.fullmatch(text)
    if m is None:
        raise AFDConfigError(f"topology must look like 2A1F, 2x1 or 2:1 (attention, FFN ranks), got {text!r}")
    A, F_ = int(m[1]), int(m[2] or m[3])
    if A < 1 or F_ < 1:
        raise AFDConfigError(f"topology needs >= 1 attention and >= 1 FFN rank, got {text!r}")
    return A, F_


def _topology(text: str) -> tuple[int, int]:
    try:
        return parse_topology(text)
    except AFDConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``afd-ext demo`` arguments (see ``--help``); a bad value is argparse's usage error (exit 2)."""
    p = argparse.ArgumentParser(
        prog="afd-ext demo",
        description="Serve a transformers MoE decoder AFD-style (attention and FFN in separate "
        "processes) and check it against the whole model.",
    )
    p.add_argument("--topology", type=_topology, default=(2, 1), metavar="TOPOLOGY",
                   help="attention and FFN ranks: 2A1F (default), 1A1F, 3A2F; also written 2x1 or 2:1")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl", "peer"), default="auto",
                   help="gloo: CPU tensors, float32; nccl: CUDA tensors, bfloat16, one GPU per process when there "
                   "are enough, else attention on GPU 0 and FFN on GPU 1, and on a one-GPU machine every process "
                   "on GPU 0 (NCCL over sockets: a demo arrangement, latencies not meaningful); "
                   "peer: CUDA tensors through peer memory (CUDA IPC), placed like nccl; "
                   "auto: nccl when 2 GPUs are visible, else gloo")
    p.add_argument("--dims", default="small",
                   help=f"model config: one of {available_dims()} or a path to a .json config")
    p.add_argument("--stages", type=ranged(int, 1), default=1, help="micro-batches per step (stages), >= 1 (default 1)")
    p.add_argument("--gate-on-attention", action="store_true",
                   help="compute router logits on the attention side and send them with the hidden states")
    p.add_argument("--requests-per-rank", type=ranged(int, 1), default=3,
                   help="requests per attention rank (default 3)")
    p.add_argument("--max-new-tokens", type=ranged(int, 1), default=16,
                   help="most tokens generated per request; requests get different budgets up to it (default 16)")
    p.add_argument("--prompts", default=None, help="prompts file (default: the shipped afd_ext/tools/data/prompts.txt)")
    p.add_argument("--connector", default="AfdExtConnector",
                   help="connector registry name, or module:Class of your own connector")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=ranged(int, 0, 65535), default=0, help="rendezvous port (0: pick a free one)")
    p.add_argument("--timeout", type=ranged(float, 0, above=True), default=600.0,
                   help="deadline for the whole run, seconds (default 600)")
    p.add_argument("--step-timeout", type=ranged(float, 0, above=True), default=60.0,
                   help="connector per-operation deadline, seconds")
    p.add_argument("--threads", type=ranged(int, 1), default=1, help="torch threads per process")
    p.add_argument("--json", dest="json_path", default=None, help="write the summary as JSON to this path")
    p.add_argument("--graph", action="store_true",
                   help="graph mode: steps whose per-rank counts fit the capture sizes "
                        f"{list(GRAPH_CAPTURE_SIZES)} are padded and replayed from CUDA graphs on both roles "
                        "(on CPU/gloo the same protocol runs with eager re-execution instead of graphs)")
    p.add_argument("--fp8", nargs="?", const="fp32", choices=("fp32", "ue8m0"), metavar="SCALES",
                   help="FP8 hidden states attention -> FFN (hidden_wire_dtype fp8_e4m3, docs/fp8.md; bfloat16), "
                   "SCALES their fp8_scale_format: fp32 (default) or ue8m0; the whole model checking it "
                   "rounds its FFN inputs the same way, and the self-check's tolerance doubles")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _gpu_placement(num_attention: int, num_ffn: int) -> GpuPlacement:
    """Where the demo's NCCL processes run (:func:`afd_ext.tools.testing.place_processes`).

    Raises:
        AFDConfigError: no GPU is visible, or afd_ext was built without CUDA.
    """
    from afd_ext import ops
    from afd_ext.tools.testing import place_processes, visible_gpu_count

    n = visible_gpu_count()
    if n < 1:
        raise AFDConfigError("--backend nccl/peer needs a visible GPU; found none. Use --backend gloo (CPU) or --backend auto")
    if not ops.is_cuda_built():
        raise AFDConfigError("--backend nccl/peer needs a CUDA build of afd_ext; use --backend gloo (CPU)")
    return place_processes(num_attention, num_ffn, n)


def build_plan(args: argparse.Namespace) -> DemoPlan:
    """Resolve arguments into a :class:`DemoPlan` (backend, dtype, ports, requests).

    Raises:
        AFDError / ValueError: what would fail only after the processes started (a busy port, an unknown
            connector, no GPU, a bad --json path or --dims, --fp8 with a hidden size it cannot quantize).
    """
    from afd_ext.tools.launch import check_port_free
    from afd_ext.tools.testing import find_free_port, visible_gpu_count

    # A busy port, or a host that is not this machine's, named now (port 0: the host alone), not
    # when FFN rank 0 binds it seconds later.
    check_port_free(args.host, args.port)
    _connector_class(args.connector)
    backend = args.backend if args.backend != "auto" else "nccl" if visible_gpu_count() >= 2 else "gloo"
    A, F_ = args.topology
    placement = _gpu_placement(A, F_) if backend != "gloo" else None
    if args.json_path:  # checked before the run, not after it: a bad path must not cost the whole demo
        try:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AFDConfigError(f"--json {args.json_path}: cannot create its folder ({e})") from None
        if Path(args.json_path).is_dir():
            raise AFDConfigError(f"--json {args.json_path} is a folder; give a file path")
    model_config = load_model_config(args.dims)
    if args.fp8:
        import torch

        from afd_ext import fp8

        fp8.check_hidden(model_config["hidden_size"], torch.bfloat16)
    requests = make_requests(A, args.requests_per_rank, args.max_new_tokens, prompts=load_prompts(args.prompts))
    return DemoPlan(
        num_attention=A, num_ffn=F_, backend=backend, dims=args.dims, model_config=model_config,
        dtype="float32" if backend == "gloo" and not args.fp8 else "bfloat16", stages=args.stages,
        gate_on_attention=args.gate_on_attention, requests=requests, host=args.host,
        port=args.port or find_free_port(args.host), step_timeout_s=args.step_timeout,
        progress=not args.no_progress, threads=args.threads,
        connector=args.connector, verbose=args.verbose, graph=args.graph, gpu_placement=placement, fp8=args.fp8)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``afd-ext demo``; returns the exit code (0: self-check passed)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        plan = build_plan(args)
    except (AFDError, ValueError) as e:  # bad input, found before any process starts: a usage error
        print(f"afd-ext demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    summary = run_demo(plan, timeout_s=args.timeout)
    print(format_summary(summary))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    if not summary["self_check"]["ok"]:
        print(f"afd-ext demo: self-check FAILED ({len(summary['self_check']['failures'])} shown); "
              "see the mismatches above", file=sys.stderr)
        return 1
    return 0
