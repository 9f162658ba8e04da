"""Graph mode for a serving loop over the connector, on both roles (``afd-ext demo --graph``).

:class:`AttentionGraphRunner` drives an attention rank whose model runs eagerly
between its layer exchanges (the :class:`~afd_ext.integrations.transformers.AttentionExchange`
of the transformers integration): it pads each step to a capture size, warms up,
captures one graph per layer and replays. :class:`FFNGraphServer` wraps an
``FFNServer`` and follows the control payload's flags. Both build on
:mod:`afd_ext.graphs` (key, arena, cache, controller).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch

from ..errors import AFDConfigError, GraphError, GraphModeError
from ..graphs import (
    DEFAULT_CAPTURE_SIZES,
    GraphController,
    GraphKey,
    StaticArena,
    StepMode,
    graph_key_from_schedule,
    pad_rows_into,
)
from ..schedule import stage_buffers

logger = logging.getLogger(__name__)

__all__ = ["padded_payload", "AttentionGraphRunner", "FFNGraphServer"]

def padded_payload(payload: Any, pad: Mapping[int, int], **flags: bool) -> Any:
    """``payload`` with every DP rank's count of stage ``s`` replaced by ``pad[s]`` (vLLM-style DP padding).

    The FFN side then derives every peer's rows from the padded counts; each
    attention rank carries its real rows first and padding rows after them.
    ``flags`` set the payload's graph flags (``is_warmup``, ...).
    """
    from ..metadata import AFDControlPayload

    return AFDControlPayload(
        dp_metadata_list={s: [int(pad[s])] * len(md.counts) for s, md in payload.dp_metadata_list.items()},
        **flags,
    )


def _cache_size(connector: Any, cache_size: int | None) -> int:
    """``cache_size``, else the connector's ``connector_extra_config.graph_cache_size`` (0 = graphs disabled)."""
    if cache_size is not None:
        return cache_size
    n = connector.extra.graph_cache_size
    if n < 1:
        raise GraphModeError(
            "graph mode asked for but connector_extra_config.graph_cache_size is 0 (graphs disabled); "
            "set it to the number of graphs to keep, e.g. 8"
        )
    return n


def _step_key(connector: Any, payload: Any) -> tuple[GraphKey, Any]:
    from ..schedule import build_step_schedule

    sched = build_step_schedule(connector.topology, payload, connector.schedule_config)
    return graph_key_from_schedule(sched), sched


class AttentionGraphRunner:
    """Graph mode for an attention rank whose model runs eagerly between its layer exchanges.

    Every step whose per-stage counts fit the capture sizes is padded (every
    DP rank of stage ``s`` to one capture size ``S_s``) and replayed: the
    exchanges of each layer (every stage: send the padded wire tensors, receive
    the reply in place) are one captured graph over static buffers, replayed in
    layer order from the model's forward. The first time a padded shape is
    seen, every attention rank (they all see the same agreed payload, so they
    decide alike) runs two dummy steps first: a warm-up step (``is_warmup``,
    eager, zeros, real traffic on every edge) and a capture step
    (``is_graph_capturing``: the connector's buffers come from the graph's
    arena, each layer's exchanges are captured, no data moves). Steps that do
    not fit run eagerly through the connector, unchanged.

    Both roles must keep the same number of graphs (the same
    ``graph_cache_size``): their caches then see the same captures and replays
    in the same order and evict the same keys, so the FFN side never lacks a
    graph the attention side replays (and if it did, it refuses the replay).

    Use with ``afd_ext.integrations.transformers.AttentionExchange``: set
    ``exchange.graph_runner = AttentionGraphRunner(exchange, connector, ...)``;
    ``begin_step`` and ``exchange`` then go through this runner.

    Args:
        exchange: the rank's ``AttentionExchange`` (rows per stage, row mask, stats).
        connector: its initialised connector (``topology``, ``schedule_config``,
            ``control_plane``, ``use_static_arena``, ``send_attn_output``,
            ``recv_ffn_output``, ``device``, ``dtype``).
        capture_sizes: per-peer capture sizes (strictly increasing).
        cache_size: graphs kept (default: the connector's ``graph_cache_size``).
        backend: graph backend (default: CUDA graphs on the connector's device).

    Raises:
        GraphModeError: the connector's ``graph_cache_size`` is 0 and no ``cache_size`` was given.
    """

    def __init__(self, exchange: Any, connector: Any, *, capture_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                 cache_size: int | None = None, backend: Any = None):
        self.exchange = exchange
        self.connector = connector
        self.ctl = GraphController(role="attention", cache_size=_cache_size(connector, cache_size), backend=backend,
                                   device=connector.device, capture_sizes=capture_sizes)
        # init_afd_connector warms every edge and direction unless told not to.
        self.ctl.warmed_up = connector.warmup_on_init
        self.active = False
        self._key: GraphKey | None = None
        self._layer = 0

    def begin_step(self, payload: Any, *, dp_rank: int, row_mask: torch.Tensor | None = None,
                   send: bool = True) -> list[int]:
        """Start a step (same contract as ``AttentionExchange.begin_step``), in graph mode when it fits."""
        from ..schedule import pad_sizes

        pad = pad_sizes(self.connector.topology, payload, self.ctl.capture_sizes)
        if pad is None or not send:
            self.active = False
            return self.exchange.begin_eager_step(payload, dp_rank=dp_rank, row_mask=row_mask, send=send)
        rows = self.exchange.step_rows(payload, dp_rank, row_mask)
        key, _ = _step_key(self.connector, padded_payload(payload, pad))
        self.ctl.follow(self.connector.links_id, self.connector.warmup_on_init)
        if key not in self.ctl.cache:
            self._warmup_and_capture(payload, pad, key)
        replay = padded_payload(payload, pad, is_graph_replaying=True)
        self.ctl.decide(replay, key)
        cp = self.connector.control_plane
        cp.update_state_from_dp_metadata(replay)
        cp.send_dp_metadata_list(replay)
        self.active, self._key, self._layer = True, key, 0
        self.exchange.set_step_rows(rows, row_mask)
        return rows

    def _alloc_static(self, arena: StaticArena, pad: Mapping[int, int]) -> dict[int, dict[str, torch.Tensor | None]]:
        cfg = self.connector.schedule_config
        return {s: stage_buffers(arena.buffer, cfg, s, n) for s, n in sorted(pad.items())}

    def _warmup_and_capture(self, payload: Any, pad: Mapping[int, int], key: GraphKey) -> None:
        conn, cp = self.connector, self.connector.control_plane
        layers = conn.schedule_config.num_layers
        # 1. warm-up step: eager, zeros, real traffic on every edge of the padded shape.
        warm = padded_payload(payload, pad, is_warmup=True)
        mode = self.ctl.decide(warm, key)
        cp.update_state_from_dp_metadata(warm)
        cp.send_dp_metadata_list(warm)
        warm_static = self._alloc_static(StaticArena(conn.device, label="warm-up"), pad)
        for layer in range(layers):
            self._dummy_layer(warm_static, layer)
        self.ctl.note_eager_step(mode, conn.step_schedule, conn.role_rank)
        # 2. capture step: buffers from the graph's arena, one graph per layer.
        cap = padded_payload(payload, pad, is_graph_capturing=True)
        self.ctl.decide(cap, key)
        arena = self.ctl.new_arena(key)
        static = self._alloc_static(arena, pad)
        conn.use_static_arena(arena)
        try:
            cp.update_state_from_dp_metadata(cap)
            cp.send_dp_metadata_list(cap)
            bodies = [lambda layer=layer: self._dummy_layer(static, layer) for layer in range(layers)]
            with conn.watchdog_suspended():
                self.ctl.capture_parts(key, arena, bodies, outputs=static)
        finally:
            conn.use_static_arena(None)

    def _dummy_layer(self, static, layer: int) -> None:
        for s in sorted(static):
            b = static[s]
            self.exchange.send_recv(layer, s, b["hidden"], b.get("router_logits"), b.get("token_ids"))

    def exchange_rows(self, layer_idx: int, rows: torch.Tensor, router_logits: torch.Tensor | None,
                      token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay this layer's exchange graph on ``rows`` (real rows, ``[n, hidden]``); return the FFN output.

        The real rows of each stage are copied into the stage's static buffer,
        the padding rows zeroed, the layer's graph replayed, and the real rows of
        the reply (which lands in the same buffer) copied out.
        """
        if not self.active or self._key is None:
            raise GraphError("AttentionGraphRunner.exchange_rows outside a graph step; call begin_step first")
        layers = self.connector.schedule_config.num_layers
        part = self._layer % layers
        self._layer += 1
        stage_rows = self.exchange.rows_for(rows.shape[0])
        static = self.ctl.entry(self._key).outputs
        start = 0
        for s, n in zip(sorted(static), stage_rows):
            b = static[s]
            pad_rows_into(rows[start:start + n], b["hidden"])
            if "router_logits" in b:
                if router_logits is None:
                    raise AFDConfigError(f"layer {layer_idx}: router logits are configured but none were given")
                pad_rows_into(router_logits[start:start + n].to(b["router_logits"].dtype), b["router_logits"])
            if "token_ids" in b:
                if token_ids is None:
                    raise AFDConfigError(f"layer {layer_idx}: token ids are configured but none were given")
                pad_rows_into(token_ids[start:start + n].to(torch.int32), b["token_ids"])
            start += n
        with self.exchange.timed(layer_idx, rows.device):
            self.ctl.replay(self._key, part=part)
            self.connector.track_graph_replay(f"CUDA-graph replay of layer {layer_idx}")
        outs = [static[s]["hidden"][:n].clone() for s, n in zip(sorted(static), stage_rows)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def end_step(self) -> None:
        """Leave graph mode for this step."""
        self.active = False
        self._key = None

    def close(self) -> None:
        """Release every captured graph and its buffers."""
        self.ctl.close()


class FFNGraphServer:
    """Graph mode for an FFN rank's serving loop (wraps an ``FFNServer``).

    Per step it acts on the payload's flags through :meth:`GraphController.decide`:
    REPLAY replays the step's graph (refused with :class:`GraphKeyMismatchError`
    when its key was never captured); CAPTURE applies the payload with the
    connector's buffers taken from the graph's arena and captures the whole
    step — every layer x every stage: fan-in, the MLP / MoE block, split-back
    — into one graph; WARMUP and EAGER serve eagerly with the connector's own
    buffers.

    Args:
        server: an ``FFNServer`` (``connector``, ``serve_exchanges(payload)``,
            ``serve_step(payload)``, counters ``steps`` and ``rows_served``).
        cache_size: graphs kept (default: the connector's ``graph_cache_size``).
        capture_sizes: only used to report; the attention side picks the sizes.
        backend: graph backend (default: CUDA graphs on the connector's device).
    """

    def __init__(self, server: Any, *, cache_size: int | None = None,
                 capture_sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES, backend: Any = None):
        self.server = server
        conn = server.connector
        self.ctl = GraphController(role="ffn", cache_size=_cache_size(conn, cache_size), backend=backend,
                                   device=conn.device,
                                   capture_sizes=capture_sizes)
        self.ctl.warmed_up = conn.warmup_on_init
        self.modes: dict[str, int] = {m.value: 0 for m in StepMode}

    def serve_step(self, payload: Any) -> StepMode:
        """Serve one step in the mode its flags ask for; return the mode."""
        srv, conn = self.server, self.server.connector
        key, sched = _step_key(conn, payload)
        self.ctl.follow(conn.links_id, conn.warmup_on_init)
        mode = self.ctl.decide(payload, key)
        self.modes[mode.value] += 1
        if mode is StepMode.REPLAY:
            # Applying the payload keeps the connector's step bookkeeping in step
            # with the attention side; the graph itself reads only its arena.
            conn.control_plane.update_state_from_dp_metadata(payload)
            self.ctl.replay(key)
            conn.track_graph_replay(f"CUDA-graph replay of step {srv.steps} ({conn.schedule_config.num_layers} layers)")
            srv.steps += 1
            srv.rows_served += conn.schedule_config.num_layers * sum(
                sched.ffn_rows(s, conn.role_rank) for s in sched.stages)
        elif mode is StepMode.CAPTURE:
            arena = self.ctl.new_arena(key)
            conn.use_static_arena(arena)
            rows_before = srv.rows_served
            try:
                conn.control_plane.update_state_from_dp_metadata(payload)
                with conn.watchdog_suspended():
                    self.ctl.capture(key, arena, lambda: srv.serve_exchanges(payload))
            finally:
                conn.use_static_arena(None)
                srv.rows_served = rows_before  # a capture moves nothing
        else:
            srv.serve_step(payload)
            self.ctl.note_eager_step(mode, sched, conn.role_rank)
        return mode

    def serve(self, *, max_steps: int | None = None) -> int:
        """Serve steps until a shutdown payload (no stages) or ``max_steps``; return the steps served."""
        return self.server.serve(max_steps=max_steps, step=self.serve_step)

    def close(self) -> None:
        """Release every captured graph and its buffers."""
        self.ctl.close()
