"""Split a Hugging Face ``transformers`` decoder into attention and FFN roles.

Attention side (:func:`split_attention_role`): every remote decoder layer's
MLP / MoE block is replaced, in place, by a :class:`RemoteMLP` proxy. The
model keeps its embeddings, attention, norms, LM head and KV cache and is
called exactly as before (``model(input_ids=..., ...)``); each proxy sends its
rows through ``connector.send_attn_output`` and takes the FFN output from
``connector.recv_ffn_output``. An :class:`AttentionExchange` holds the per-step
state the proxies share (which rows are real, how they split into stages,
timing and byte counters) and drives the control plane once per step.

FFN side (:class:`FFNServer`): holds the MLP / MoE block of every remote layer
and serves steps: per step ``recv_dp_metadata_list()`` then
``update_state_from_dp_metadata``, then for each remote layer and each stage
``recv_attn_output`` -> MLP -> ``send_ffn_output``. A control payload with no
stages (:func:`make_shutdown_payload`) ends the loop.

Which layers are remote (:func:`remote_layer_indices`): every layer when the
gate runs on the FFN side (the default, as in the reference plugin); only the
mixture-of-experts layers when the gate runs on the attention side
(``gate_on_attention=True``), whose router logits then travel with the hidden
states and are used by the FFN side for routing.

The code finds the pieces by feature detection, not by class: the decoder
layers (``model.model.layers`` and a few other spellings), the MLP attribute
(``mlp``, ``block_sparse_moe``, ``feed_forward``), the router (``gate`` or
``router`` with a ``[num_experts, hidden]`` weight), and whether the block
returns ``(hidden_states, router_logits)`` (transformers 4.x) or a tensor
(5.x). It works with the transformers MoE decoders (Qwen3-MoE, Qwen2-MoE,
Mixtral, DeepSeek-V2, ...) and any user model laid out the same way.

Example (attention rank)::

    exchange = split_attention_role(model, connector, num_stages=1)
    payload = agreement.agree({0: n_rows})          # StepCountAgreement
    exchange.begin_step(payload, dp_rank=my_rank, row_mask=mask)
    logits = model(input_ids=ids, attention_mask=am, ...).logits
    ...
    exchange.shutdown()

Example (FFN rank)::

    server = FFNServer.from_model(model, connector)
    server.serve()
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from afd_ext import fp8
from afd_ext.errors import AFDConfigError, AFDProtocolError, AFDStateError
from afd_ext.metadata import AFDControlPayload, AFDExpertRoutingSpec, AFDTransferContext, AFDTransferMetadata

logger = logging.getLogger(__name__)

#: Attribute names under which decoder layers keep their MLP / MoE block.
MLP_ATTRS = ("mlp", "block_sparse_moe", "feed_forward", "moe")
#: Attribute names under which MoE blocks keep their router.
GATE_ATTRS = ("gate", "router")
_LAYER_PATHS = ("model.layers", "layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")


# ---------------------------------------------------------------------------
# Model structure (feature detection)
# ---------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Return the decoder layers of ``model``.

    Looks at ``model.model.layers``, ``model.layers``, ``model.model.decoder.layers``,
    ``model.transformer.h`` and ``model.gpt_neox.layers``, in that order.

    Raises:
        AFDConfigError: none of them is an ``nn.ModuleList``; pass a model laid out
            like the transformers decoders or wrap yours so one of them exists.
    """
    for path in _LAYER_PATHS:
        with contextlib.suppress(AttributeError):
            layers = operator.attrgetter(path)(model)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return layers
    raise AFDConfigError(f"cannot find the decoder layers of {type(model).__name__}: looked for "
                         f"{', '.join(_LAYER_PATHS)} (an nn.ModuleList); expose the layers under one of these names")


def _mlp_attr(layer: nn.Module, idx: int) -> str:
    name = next((n for n in MLP_ATTRS if isinstance(getattr(layer, n, None), nn.Module)), None)
    if name is None:
        raise AFDConfigError(f"decoder layer {idx} ({type(layer).__name__}) has no MLP under any of {MLP_ATTRS}")
    return name


def _find_gate(mlp: nn.Module) -> tuple[str, nn.Module] | None:
    """The router of an MoE block: an attribute in GATE_ATTRS with a 2-D ``weight``."""
    if not hasattr(mlp, "experts"):
        return None
    for name in GATE_ATTRS:
        g = getattr(mlp, name, None)
        if isinstance(g, ReceivedLogitsGate):
            return name, g.original
        w = getattr(g, "weight", None)
        if isinstance(g, nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2:
            return name, g
    return None


@dataclass(frozen=True)
class LayerInfo:
    """What the split needs to know about one decoder layer.

    Attributes:
        index: decoder layer index.
        mlp_attr: attribute of the layer holding the MLP / MoE block.
        is_moe: the block has experts and a router.
        gate_attr: attribute of the block holding the router (MoE only).
        num_experts: router width (MoE only).
        hidden_size: width of the block's input and output.
    """

    index: int
    mlp_attr: str
    is_moe: bool
    gate_attr: str | None
    num_experts: int | None
    hidden_size: int


def _hidden_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for c in (getattr(cfg, "text_config", None), cfg):
        h = getattr(c, "hidden_size", None)
        if isinstance(h, int):
            return h
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        return int(emb.weight.shape[1])
    raise AFDConfigError(f"cannot tell the hidden size of {type(model).__name__}: no config.hidden_size")


def describe_layers(model: nn.Module) -> list[LayerInfo]:
    """Describe every decoder layer of ``model`` (see :class:`LayerInfo`).

    Works on an unsplit model and on one already split by
    :func:`split_attention_role` (the proxies remember what they replaced).

    Raises:
        AFDConfigError: the layers or an MLP cannot be found.
    """
    hidden = _hidden_size(model)
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        attr = _mlp_attr(layer, i)
        mlp = getattr(layer, attr)
        if isinstance(mlp, RemoteMLP):
            out.append(mlp.info)
            continue
        name, gate = _find_gate(mlp) or (None, None)
        out.append(LayerInfo(i, attr, gate is not None, name, None if gate is None else int(gate.weight.shape[0]),
                             hidden))
    return out


def remote_layer_indices(model: nn.Module, *, gate_on_attention: bool = False) -> list[int]:
    """Indices of the layers whose MLP runs on the FFN side, in exchange order.

    Every layer when ``gate_on_attention`` is False; only the MoE layers when
    it is True (dense MLPs then stay on the attention side, as in the
    reference plugin). Both roles call this on the same model description and
    get the same list.
    """
    return [li.index for li in describe_layers(model) if li.is_moe or not gate_on_attention]


def router_logits_from_gate(gate: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Compute router logits the way the transformers routers do, in float32.

    Args:
        gate: an ``nn.Linear`` or a router module with a ``weight``
            ``[num_experts, hidden]`` (and optionally a ``bias``).
        hidden_states: ``[n, hidden]`` any float dtype, on the gate's device.

    Returns:
        ``[n, num_experts]`` float32, same device. Float32 because routers
        softmax in float32 and DeepSeek's routers compute their logits in it.
    """
    w = gate.weight
    b = getattr(gate, "bias", None)
    b = b.float() if isinstance(b, torch.Tensor) else None
    return F.linear(hidden_states.reshape(-1, w.shape[1]).float(), w.float(), b)


def stage_split(n: int, num_stages: int) -> list[int]:
    """Split ``n`` rows into ``num_stages`` contiguous stages (earlier stages get the remainder).

    >>> stage_split(5, 2)
    [3, 2]
    >>> stage_split(0, 2)
    [0, 0]
    """
    if num_stages < 1:
        raise AFDConfigError(f"num_stages must be >= 1, got {num_stages}")
    if n < 0:
        raise AFDConfigError(f"row count must be >= 0, got {n}")
    base, rem = divmod(n, num_stages)
    return [base + (1 if s < rem else 0) for s in range(num_stages)]


def make_shutdown_payload() -> AFDControlPayload:
    """The control payload that ends an :class:`FFNServer` loop: a step with no stages."""
    return AFDControlPayload(dp_metadata_list={})


def is_shutdown_payload(payload: AFDControlPayload) -> bool:
    """True for the payload of :func:`make_shutdown_payload` (no stages)."""
    return len(payload.dp_metadata_list) == 0


# ---------------------------------------------------------------------------
# Attention side
# ---------------------------------------------------------------------------


@dataclass
class ExchangeStats:
    """Counters of one attention rank.

    Attributes:
        latency_ns: ``layer_idx -> [ns per exchange]`` from send to reply of
            one (layer, stage) on this rank, recorded only with ``timing=True``
            (CUDA: two events on the caller's stream, read back when the stats
            are read; no device synchronisation).
        bytes_sent / bytes_received: wire payload bytes (hidden states, as FP8 values
            and scales when the connector sends FP8; router logits) this rank sent to /
            received from FFN ranks, in total.
        steps: steps begun.
    """

    latency_ns: dict[int, list[int]] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0


class _ExchangeTimer:
    """Per-exchange latency without device synchronisation (CUDA events, read back lazily)."""

    def __init__(self, stats: ExchangeStats):
        self.stats = stats
        self._pending: list[tuple[int, Any, Any]] = []  # (layer_idx, start event, end event)

    @contextlib.contextmanager
    def measure(self, layer_idx: int, device: torch.device) -> Any:
        """Record the latency of the ``with`` body (not when it raises)."""
        if device.type != "cuda":
            t0 = time.perf_counter_ns()
            yield
            self.stats.latency_ns.setdefault(layer_idx, []).append(time.perf_counter_ns() - t0)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((layer_idx, start, end))

    def flush(self, *, wait: bool) -> None:
        """Move finished measurements into the stats (``wait``: wait for the recorded events first)."""
        left = []
        for layer_idx, a, b in self._pending:
            if wait:
                b.synchronize()  # this event only, not the device
            if b.query():
                self.stats.latency_ns.setdefault(layer_idx, []).append(int(a.elapsed_time(b) * 1e6))
            else:
                left.append((layer_idx, a, b))
        self._pending = left


class AttentionExchange:
    """State shared by the :class:`RemoteMLP` proxies of one attention rank.

    Args:
        connector: an initialised connector (``send_attn_output``,
            ``recv_ffn_output``, ``control_plane``).
        hidden_size: width of the exchanged hidden states.
        num_stages: micro-batches per step (1 or more).
        timing: record per-exchange latency in :attr:`stats` (off by default; CUDA events, no
            device synchronisation).
    """

    def __init__(self, connector: Any, *, hidden_size: int, num_stages: int = 1, timing: bool = False):
        if num_stages < 1:
            raise AFDConfigError(f"num_stages must be >= 1, got {num_stages}")
        self.connector = connector
        self.hidden_size = hidden_size
        self.num_stages = num_stages
        self.timing = timing
        self._stats = ExchangeStats()
        self._timer = _ExchangeTimer(self._stats) if timing else None
        self.proxies: list[RemoteMLP] = []
        # Hidden-state wire bytes per row: FP8 values + scales when the connector sends FP8 (docs/fp8.md).
        fp8_wire = getattr(getattr(connector, "schedule_config", None), "hidden_wire", None) is not None
        self._hidden_wire_bytes = fp8.wire_bytes_per_token(hidden_size) if fp8_wire else None
        self._stage_rows: list[int] | None = None
        self._row_mask: torch.Tensor | None = None
        # (mask object, device, flat row index): the step's mask as an index, built
        # once per step instead of a boolean gather/scatter (a device sync) per layer.
        self._mask_index: tuple[Any, torch.device, torch.Tensor] | None = None
        #: Optional ``afd_ext.integrations.graph_runners.AttentionGraphRunner``: steps that fit its
        #: capture sizes replay captured exchange graphs (``afd-ext demo --graph``).
        self.graph_runner: Any = None

    @property
    def stats(self) -> ExchangeStats:
        """This rank's counters; with ``timing``, every recorded exchange's latency is in (waits for its events)."""
        if self._timer is not None:
            self._timer.flush(wait=True)
        return self._stats

    # -- per step ----------------------------------------------------------

    def row_index(self, device: torch.device) -> torch.Tensor:
        """The current ``row_mask`` as flat row indices (int64 on ``device``), cached per step.

        Raises:
            AFDStateError: no row mask is set.
        """
        mask = self._row_mask
        if mask is None:
            raise AFDStateError("AttentionExchange.row_index: no row mask is set for this step")
        cached = self._mask_index
        if cached is None or cached[0] is not mask or cached[1] != device:
            idx = mask.reshape(-1).nonzero().squeeze(1).to(device)
            self._mask_index = cached = (mask, device, idx)
        return cached[2]

    def begin_step(self, payload: AFDControlPayload, *, dp_rank: int, row_mask: torch.Tensor | None = None,
                   send: bool = True) -> list[int]:
        """Start a step: apply ``payload`` locally, send it to the FFN side, set the rows.

        With ``graph_runner`` set, the runner pads the step to a capture size
        and replays what fits (its own errors: ``afd_ext.graphs``, :mod:`afd_ext.integrations.graph_runners`).

        Args:
            payload: the step's control payload, the same on every attention
                rank (e.g. from ``StepCountAgreement.agree``); must have
                exactly ``num_stages`` stages.
            dp_rank: this rank's index in the payload's count vectors.
            row_mask: ``[batch, seq]`` bool (any device) selecting the rows the
                next forward sends (left padding and finished requests are
                False); ``None`` sends every row.
            send: call ``control_plane.send_dp_metadata_list`` (it is a no-op on
                ranks that are not control senders).

        Returns:
            This rank's rows per stage.

        Raises:
            AFDConfigError: the payload's stages do not match ``num_stages`` or
                ``dp_rank`` is out of range.
        """
        if self.graph_runner is not None:
            return self.graph_runner.begin_step(payload, dp_rank=dp_rank, row_mask=row_mask, send=send)
        return self.begin_eager_step(payload, dp_rank=dp_rank, row_mask=row_mask, send=send)

    def begin_eager_step(self, payload: AFDControlPayload, *, dp_rank: int, row_mask: torch.Tensor | None = None,
                         send: bool = True) -> list[int]:
        """:meth:`begin_step` without the graph runner (the runner calls it for the steps it runs eagerly)."""
        rows = self.step_rows(payload, dp_rank, row_mask)
        cp = self.connector.control_plane
        cp.update_state_from_dp_metadata(payload)
        if send:
            cp.send_dp_metadata_list(payload)
        self.set_step_rows(rows, row_mask)
        return rows

    def step_rows(self, payload: AFDControlPayload, dp_rank: int, row_mask: torch.Tensor | None) -> list[int]:
        """This rank's rows per stage in ``payload``, checked against ``num_stages`` and ``row_mask``.

        Raises:
            AFDConfigError: as :meth:`begin_step`.
        """
        stages = sorted(payload.dp_metadata_list)
        if stages != list(range(self.num_stages)):
            raise AFDConfigError(f"payload stages {stages} do not match num_stages={self.num_stages} "
                                 f"(expected {list(range(self.num_stages))})")
        counts = [payload.dp_metadata_list[s].counts for s in stages]
        if bad := [(s, c) for s, c in zip(stages, counts) if not 0 <= dp_rank < len(c)]:
            raise AFDConfigError(f"dp_rank {dp_rank} out of range for stage {bad[0][0]} counts {bad[0][1]}")
        rows = [int(c[dp_rank]) for c in counts]
        if row_mask is not None and int(row_mask.sum()) != sum(rows):
            raise AFDConfigError(f"row_mask selects {int(row_mask.sum())} rows but the payload gives this rank "
                                 f"{sum(rows)} (per stage {rows})")
        return rows

    def set_step_rows(self, rows: list[int], row_mask: torch.Tensor | None) -> None:
        """Make ``rows`` (per stage) and ``row_mask`` the current step's (counts the step).

        For a caller that applied the step's payload itself (the graph runner's replayed steps).
        """
        self._stage_rows = list(rows)
        self._row_mask = row_mask
        self._stats.steps += 1

    def end_step(self) -> None:
        """Forget the step's rows (a forward outside a step then fails clearly)."""
        self._stage_rows = None
        self._row_mask = None
        if self._timer is not None:
            self._timer.flush(wait=False)
        if self.graph_runner is not None:
            self.graph_runner.end_step()

    def idle_forward(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Run a step's exchanges with zero rows, without running the model.

        For an attention rank that carries no tokens this step: the proxies
        are called in layer order with ``[0, hidden]`` inputs, so the rank
        takes part in every (layer, stage) exchange of the step.
        """
        empty = torch.empty(0, self.hidden_size, device=device, dtype=dtype)
        for proxy in self.proxies:
            proxy(empty)

    def shutdown(self) -> None:
        """Tell the FFN side to leave its serving loop (sends :func:`make_shutdown_payload`)."""
        self.connector.control_plane.send_dp_metadata_list(make_shutdown_payload())

    # -- per exchange ------------------------------------------------------

    def rows_for(self, n: int) -> list[int]:
        """This rank's rows per stage for a forward of ``n`` rows.

        Raises:
            AFDStateError: outside a step.
            AFDConfigError: ``n`` is not the step's row count (a wrong ``row_mask``).
        """
        if self._stage_rows is None:
            raise AFDStateError("RemoteMLP called outside a step: call AttentionExchange.begin_step(payload, ...) "
                                "before the model forward")
        if sum(self._stage_rows) != n:
            raise AFDConfigError(f"the forward has {n} rows to send but the step's payload gives this rank "
                                 f"{sum(self._stage_rows)} (per stage {self._stage_rows}); pass the right row_mask")
        return self._stage_rows

    def exchange(self, layer_idx: int, rows: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        """Send ``rows`` stage by stage and return the FFN output.

        Args:
            layer_idx: decoder layer index.
            rows: ``[n, hidden]`` contiguous, the model's dtype and device.
            router_logits: ``[n, num_experts]`` float32 or ``None``.

        Returns:
            ``[n, hidden]`` FFN output, same dtype and device.

        Raises:
            AFDStateError / AFDConfigError: as :meth:`rows_for`.
            AFDProtocolError: the FFN output's shape differs from the rows sent.
        """
        if self.graph_runner is not None and self.graph_runner.active:
            out = self.graph_runner.exchange_rows(layer_idx, rows, router_logits)
        else:
            stage_rows = self.rows_for(rows.shape[0])
            logits = [None] * len(stage_rows) if router_logits is None else router_logits.split(stage_rows)
            outs = []
            for s, (x, lg) in enumerate(zip(rows.split(stage_rows), logits)):
                with self.timed(layer_idx, rows.device):
                    y = self.send_recv(layer_idx, s, x, lg)
                if tuple(y.shape) != tuple(x.shape):
                    raise AFDProtocolError(f"layer {layer_idx} stage {s}: FFN output has shape {tuple(y.shape)}, "
                                           f"expected {tuple(x.shape)}")
                outs.append(y)
            out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        # Wire payload bytes of the real rows (graph padding rows travel too but carry nothing).
        hidden = rows.nbytes if self._hidden_wire_bytes is None else rows.shape[0] * self._hidden_wire_bytes
        self._stats.bytes_sent += hidden + (0 if router_logits is None else router_logits.nbytes)
        self._stats.bytes_received += out.nbytes
        return out

    def send_recv(self, layer_idx: int, stage: int, x: torch.Tensor, router_logits: torch.Tensor | None = None,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One (layer, stage) exchange through the connector: send ``x`` ``[n, hidden]`` (with the router
        logits and token ids when given), then receive the FFN output, ``[n, hidden]`` like ``x``."""
        ctx = AFDTransferContext(metadata=AFDTransferMetadata.create_attention_metadata(
            layer_idx=layer_idx, stage_idx=stage, seq_len=x.shape[0]))
        kw = {k: v for k, v in (("router_logits", router_logits), ("input_ids", token_ids)) if v is not None}
        self.connector.send_attn_output(x, ctx, **kw)
        return self.connector.recv_ffn_output(ref_tensor=x, ubatch_idx=stage)

    def timed(self, layer_idx: int, device: torch.device) -> Any:
        """A context that records one exchange's latency when ``timing`` is on (no device sync)."""
        return contextlib.nullcontext() if self._timer is None else self._timer.measure(layer_idx, device)


class RemoteMLP(nn.Module):
    """Attention-side stand-in for one decoder layer's MLP / MoE block.

    ``forward(hidden_states)`` takes ``[..., hidden]`` (usually ``[batch, seq,
    hidden]``), picks the rows of the step's ``row_mask`` (all rows when
    none), sends them through the connector (with router logits computed by
    the kept ``gate`` when the gate runs on the attention side), and returns
    a tensor of the input's shape holding the FFN output in those rows and
    zeros elsewhere (padding rows never reach the FFN side). When the replaced
    block returned ``(hidden_states, router_logits)`` (transformers 4.x MoE
    blocks) the proxy does too.
    """

    def __init__(self, exchange: AttentionExchange, info: LayerInfo, *, gate: nn.Module | None = None,
                 returns_tuple: bool = False):
        super().__init__()
        self.exchange = exchange
        self.info = info
        self.layer_idx = info.index
        self.gate = gate
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states: torch.Tensor) -> Any:  # noqa: D102
        h = hidden_states.shape[-1]
        if h != self.info.hidden_size:
            raise AFDConfigError(f"layer {self.layer_idx}: hidden_states last dim is {h}, "
                                 f"expected {self.info.hidden_size}")
        flat = hidden_states.reshape(-1, h)
        mask = self.exchange._row_mask
        masked = mask is not None and tuple(mask.shape) == tuple(hidden_states.shape[:-1])
        idx = self.exchange.row_index(hidden_states.device) if masked else None
        rows = (flat.index_select(0, idx) if masked else flat).contiguous()
        logits = router_logits_from_gate(self.gate, rows) if self.gate is not None else None
        y = self.exchange.exchange(self.layer_idx, rows, logits)
        if masked:
            out = hidden_states.new_zeros(hidden_states.shape)
            out.view(-1, h).index_copy_(0, idx, y.to(out.dtype))
        else:
            out = y.reshape(hidden_states.shape)
        if not self.returns_tuple:
            return out
        full_logits = out.new_zeros(flat.shape[0], self.info.num_experts or 1, dtype=torch.float32)
        if logits is not None and masked:
            full_logits.index_copy_(0, idx, logits)
        elif logits is not None:
            full_logits.copy_(logits)
        return out, full_logits


def _returns_tuple(mlp: nn.Module, hidden_size: int) -> bool:
    """Whether ``mlp(x)`` returns a tuple (probe on one zero token, on CPU float32 copies)."""
    try:
        p = next(mlp.parameters())
    except StopIteration:
        return False
    try:
        with torch.no_grad():
            x = torch.zeros(1, 1, hidden_size, dtype=p.dtype, device=p.device)
            return isinstance(mlp(x), tuple)
    except Exception as e:  # noqa: BLE001 - a probe; a plain tensor is the 5.x convention
        logger.debug("MLP probe failed (%s); assuming it returns a tensor", e)
        return False


def split_attention_role(model: nn.Module, connector: Any, *, gate_on_attention: bool = False, num_stages: int = 1,
                         timing: bool = False) -> AttentionExchange:
    """Turn ``model`` into its attention role, in place.

    The MLP / MoE block of every remote layer (:func:`remote_layer_indices`)
    is replaced by a :class:`RemoteMLP`; the replaced blocks are dropped (their
    memory is freed unless referenced elsewhere). With ``gate_on_attention``
    the router of each MoE layer stays on this side, inside the proxy.

    Call it before moving the model to its device so the experts are never
    copied there.

    Args:
        model: a transformers decoder (``...ForCausalLM``) or alike.
        connector: the attention rank's connector (initialised before the
            first forward).
        gate_on_attention: compute router logits here and send them.
        num_stages: micro-batches per step.
        timing: record per-exchange latency.

    Returns:
        The :class:`AttentionExchange` that drives the proxies.

    Raises:
        AFDConfigError: the model's layout is not recognised; ``gate_on_attention``
            with a model that has no MoE layer.
    """
    infos = describe_layers(model)
    remote = remote_layer_indices(model, gate_on_attention=gate_on_attention)
    if gate_on_attention and not remote:
        raise AFDConfigError("gate_on_attention=True but the model has no MoE layer (no experts + router)")
    exchange = AttentionExchange(connector, hidden_size=_hidden_size(model), num_stages=num_stages, timing=timing)
    layers = decoder_layers(model)
    for i in remote:
        info = infos[i]
        mlp = getattr(layers[i], info.mlp_attr)
        if isinstance(mlp, RemoteMLP):
            raise AFDConfigError(f"layer {i} is already split (its MLP is a RemoteMLP)")
        gate = getattr(mlp, info.gate_attr) if (gate_on_attention and info.gate_attr) else None
        proxy = RemoteMLP(exchange, info, gate=gate, returns_tuple=_returns_tuple(mlp, info.hidden_size))
        setattr(layers[i], info.mlp_attr, proxy)
        exchange.proxies.append(proxy)
    return exchange


# ---------------------------------------------------------------------------
# FFN side
# ---------------------------------------------------------------------------


def _identity_router(gate: nn.Module) -> nn.Module:
    """A shallow copy of a router whose linear part is the identity.

    transformers 5.x routers begin with ``F.linear(hidden.view(-1, hidden_dim),
    weight)``; with ``weight = I`` and ``hidden_dim = num_experts`` they turn
    received logits into exactly the outputs (scores, top-k) the original
    router would give for those logits. Checked by :class:`ReceivedLogitsGate`.
    """
    e = int(gate.weight.shape[0])
    r = copy.copy(gate)
    r._parameters = dict(gate._parameters)
    r._buffers = dict(gate._buffers)
    r._modules = dict(gate._modules)
    r._parameters["weight"] = nn.Parameter(torch.eye(e, dtype=gate.weight.dtype, device=gate.weight.device),
                                           requires_grad=False)
    if "bias" in r._parameters:
        r._parameters["bias"] = None
    for attr in ("hidden_dim", "hidden_size", "in_features"):
        if isinstance(getattr(r, attr, None), int):
            setattr(r, attr, e)
    return r


class ReceivedLogitsGate(nn.Module):
    """FFN-side replacement of a router: routes with logits received from the attention side.

    Set :attr:`pending` to the received ``[n, num_experts]`` logits before
    calling the MoE block; the block then calls this module instead of its
    router and gets what its router would have returned for those logits
    (the logits themselves for an ``nn.Linear`` gate; ``(logits, scores,
    indices)`` via an identity-weight copy for 5.x router modules). The
    logits are cast to the router's weight dtype, as the router would have
    produced them.

    Raises:
        NotImplementedError: at construction, when a float32 probe shows that
            this router cannot be driven by received logits.
        AFDStateError: called with no :attr:`pending` logits.
        AFDProtocolError: the received logits' row count differs from the block's.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.original = original
        self.router = None if isinstance(original, nn.Linear) else _identity_router(original)
        self.pending: torch.Tensor | None = None
        _check_received_routing(original)

    def forward(self, hidden_states: torch.Tensor) -> Any:  # noqa: D102
        logits = self.pending
        if logits is None:
            raise AFDStateError("ReceivedLogitsGate called without received router logits: the FFN side must "
                                "set .pending (recv_attn_output with routing_spec) when the gate runs on attention")
        n = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]
        if logits.shape[0] != n:
            raise AFDProtocolError(f"received router logits have {logits.shape[0]} rows, the block has {n}")
        logits = logits.to(self.original.weight.dtype)
        return logits if self.router is None else self.router(logits)


def _check_received_routing(gate: nn.Module) -> None:
    """Probe, on float32 CPU copies, that routing from received logits gives the router's own outputs.

    Raises:
        NotImplementedError: the outputs differ (the router cannot be driven by received logits).
    """
    g32 = copy.deepcopy(gate).float().cpu()
    x = torch.randn(7, g32.weight.shape[1], generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        logits = router_logits_from_gate(g32, x)
        got = logits if isinstance(g32, nn.Linear) else _identity_router(g32)(logits)
        try:  # every output (tensors, nested tuples): same shapes, floats within 1e-5, integers (top-k) equal
            torch.testing.assert_close(got, g32(x), atol=1e-5, rtol=1e-5, check_dtype=False)
        except (AssertionError, TypeError, ValueError):
            raise NotImplementedError(f"router {type(gate).__name__} cannot be driven by received router logits (its "
                                      "outputs differ from the original's on a probe); run with the gate on the FFN "
                                      "side (gate_on_attention=False)") from None


def extract_ffn_modules(model: nn.Module, *, gate_on_attention: bool = False) -> dict[int, nn.Module]:
    """The FFN role of ``model``: ``{layer_idx: MLP / MoE block}`` of every remote layer.

    With ``gate_on_attention`` each block's router is replaced, in place, by a
    :class:`ReceivedLogitsGate`.

    Raises:
        NotImplementedError: a router cannot be driven by received logits.
    """
    infos = describe_layers(model)
    layers = decoder_layers(model)
    out = {}
    for i in remote_layer_indices(model, gate_on_attention=gate_on_attention):
        info = infos[i]
        mlp = getattr(layers[i], info.mlp_attr)
        if gate_on_attention:
            g = getattr(mlp, info.gate_attr)
            if not isinstance(g, ReceivedLogitsGate):
                setattr(mlp, info.gate_attr, ReceivedLogitsGate(g))
        out[i] = mlp
    return out


class FFNServer:
    """Serve the MLP / MoE blocks of every remote layer for the attention ranks.

    Args:
        connector: the FFN rank's initialised connector.
        modules: ``{layer_idx: block}`` (see :func:`extract_ffn_modules`), in
            exchange order when sorted by layer index.
        gate_on_attention: router logits arrive with the hidden states.
        num_experts: router width (required with ``gate_on_attention``).
        router_logits_dtype: dtype of the received logits (float32).
    """

    def __init__(self, connector: Any, modules: Mapping[int, nn.Module], *, gate_on_attention: bool = False,
                 num_experts: int | None = None, router_logits_dtype: torch.dtype = torch.float32):
        if not modules:
            raise AFDConfigError("FFNServer needs at least one layer's MLP")
        if gate_on_attention and not num_experts:
            raise AFDConfigError("gate_on_attention=True needs num_experts (the router logits width)")
        self.connector = connector
        self.modules = dict(sorted(modules.items()))
        self.gate_on_attention = gate_on_attention
        # Each block's ReceivedLogitsGate, found once (compute runs per layer and stage).
        self._gates = {i: next((g for g in m.children() if isinstance(g, ReceivedLogitsGate)), None)
                       for i, m in self.modules.items()} if gate_on_attention else {}
        if None in self._gates.values():
            raise AFDConfigError(f"layers {[i for i, g in self._gates.items() if g is None]}: block has no "
                                 "ReceivedLogitsGate; use extract_ffn_modules")
        self.routing_spec = AFDExpertRoutingSpec(int(num_experts), router_logits_dtype) if gate_on_attention else None
        self.steps = 0
        self.rows_served = 0

    @classmethod
    def from_model(cls, model: nn.Module, connector: Any, *, gate_on_attention: bool = False,
                   **kw: Any) -> "FFNServer":
        """Build from a whole model (its attention parts are not used and may be dropped).

        Raises:
            AFDConfigError: no MLP block found, or ``gate_on_attention`` without a MoE layer.
            NotImplementedError: a block class whose gate cannot move to the attention side.
        """
        modules = extract_ffn_modules(model, gate_on_attention=gate_on_attention)
        # None when no layer is MoE: the constructor then raises its AFDConfigError.
        num_experts = next((li.num_experts for li in describe_layers(model) if li.is_moe), None)
        return cls(connector, modules, gate_on_attention=gate_on_attention,
                   num_experts=num_experts if gate_on_attention else None, **kw)

    def compute(self, layer_idx: int, hidden_states: torch.Tensor,
                router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Run layer ``layer_idx``'s block on ``[n, hidden]`` rows and return ``[n, hidden]``.

        Zero rows return an empty tensor without calling the block.

        Raises:
            KeyError: ``layer_idx`` is not a remote layer.
            AFDConfigError: router logits missing while the gate runs on attention.
        """
        mlp = self.modules[layer_idx]
        n, h = hidden_states.shape
        if self.gate_on_attention and router_logits is None:
            raise AFDConfigError(f"layer {layer_idx}: the gate runs on attention but no router logits arrived")
        if n == 0:
            return hidden_states.new_empty(0, h)
        gate = self._gates.get(layer_idx)
        if gate is not None:
            gate.pending = router_logits
        try:
            with torch.no_grad():
                y = mlp(hidden_states.reshape(1, n, h))
        finally:
            if gate is not None:
                gate.pending = None
        return (y[0] if isinstance(y, tuple) else y).reshape(n, h)

    def serve_step(self, payload: AFDControlPayload) -> None:
        """Serve one step: every remote layer, every stage of ``payload`` in sorted order."""
        self.connector.control_plane.update_state_from_dp_metadata(payload)
        self.serve_exchanges(payload)
        self.steps += 1

    def serve_exchanges(self, payload: AFDControlPayload) -> None:
        """The step's exchanges only (payload already applied); what a CUDA graph of the step captures."""
        conn = self.connector
        stages = sorted(payload.dp_metadata_list)
        kwargs = {"routing_spec": self.routing_spec} if self.routing_spec is not None else {}
        for layer_idx in self.modules:
            for s in stages:
                p = conn.recv_attn_output(ubatch_idx=s, **kwargs)
                ctx = p.context
                ctx.metadata.layer_idx = layer_idx
                ctx.metadata.stage_idx = s
                y = self.compute(layer_idx, p.hidden_states, p.router_logits)
                self.rows_served += int(p.hidden_states.shape[0])
                conn.send_ffn_output(y, ctx)

    def serve(self, *, max_steps: int | None = None,
              step: Callable[[AFDControlPayload], Any] | None = None) -> int:
        """Serve steps until a shutdown payload (or ``max_steps``); return the steps served.

        Every wait is bounded by the connector's deadlines (``recv_dp_metadata_list``
        raises when no payload arrives in time).

        Args:
            max_steps: stop after this many steps (default: only at shutdown).
            step: serves one payload (default :meth:`serve_step`; the graph server passes its own).
        """
        step = step or self.serve_step
        served = 0
        while max_steps is None or served < max_steps:
            payload = self.connector.control_plane.recv_dp_metadata_list()
            if is_shutdown_payload(payload):
                break
            step(payload)
            served += 1
        return served
