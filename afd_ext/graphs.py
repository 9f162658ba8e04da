"""CUDA graphs across the whole AFD exchange, on both roles.

What this module gives the runtime (the attention runner and the FFN loop):

* :class:`GraphKey` — what a captured graph depends on: the full per-stage,
  per-attention-rank row-count vector, the wire layout (every part that travels,
  its columns and dtype), the layer count and the topology. Never a
  total: per-peer counts ``[4, 4]`` and ``[7, 1]`` give different keys (the
  reference keyed FFN graphs so that both collided and replayed the wrong graph
  during an eager prefill, its issue #261).
* :func:`decide_step_mode` — one rule per control-payload flag, identical on
  both roles: ``is_warmup`` → eager with real traffic on every edge;
  ``is_graph_capturing`` → capture on both sides at once;
  ``is_graph_replaying`` → replay on both sides (a key that was not captured is
  refused with :class:`GraphKeyMismatchError`, never replayed); otherwise eager.
* Padding: :func:`capture_size_for` / :func:`afd_ext.schedule.pad_sizes` pick, per stage,
  the smallest capture size (vLLM style list) that holds every peer's count;
  in graph mode the attention side pads every peer to it. :func:`pad_rows_into`
  copies real rows into a static buffer and zeroes the padding rows;
  the reply's padding rows are dropped by slicing ``[:n]``. The FFN side treats
  padding rows as ordinary rows (its compute is row-independent), so the
  padding is carried and dropped consistently.
* :class:`StaticArena` — every buffer a captured graph touches (fan-in targets,
  reply buffers, static inputs) is allocated here, before
  capture, at the captured capacity. After :meth:`StaticArena.freeze` no buffer
  can be added, and :meth:`StaticArena.check_stable` asserts the addresses,
  shapes and storage sizes did not change. Eager steps use their own buffers.
* :class:`GraphCache` — a bounded LRU of :class:`CapturedGraph` entries; an
  entry owns its graphs *and* its arena, so eviction drops both together, after
  the device finished every launched replay.
* :class:`GraphController` — the per-rank driver: ``decide`` (flags + warm-up
  bookkeeping), ``new_arena``, ``capture`` (one graph per key around a user
  callable: the attention-side layer loop, or the FFN-side per-step loop over
  all layers x all stages), ``capture_parts`` (one graph per layer, for an
  attention side whose model runs eagerly between exchanges), ``replay``.
* Graph mode for a serving loop over the connector (``afd-ext demo --graph``)
  builds on these: :mod:`afd_ext.integrations.graph_runners`.

The reference saw illegal memory accesses inside FFN graph replay (its issue
#290): a graph keeps raw device addresses, so any buffer it touches that is
reallocated (an eager step of another size growing a shared fan-in buffer) or
freed (a ``torch.cat`` output) turns the next replay into a write to freed
memory. Here a graph only ever touches its own arena's buffers, which eager
steps never see, and the arena is checked before each replay.

Why capture works at all: every ``afd_ext`` op runs on the current CUDA stream,
and ``torch.cuda.graph`` makes its capture stream current, so the NCCL kernels
of fan-in, split-back and exchange are recorded. Capture moves no data; both
roles must therefore capture the same step (same key) and replay in lockstep,
which the control payload's flags arrange. NCCL connects an edge lazily on its
first use, which must not happen inside a capture: :meth:`GraphController.decide`
refuses a capture before a warm-up step with rows on every peer.

Control-plane traffic is host-side and never captured; the attention side
sends each step's payload (with the replay flag) before replaying.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "GraphError",
    "GraphKeyMismatchError",
    "GraphModeError",
    "GraphBufferError",
    "GraphKey",
    "make_graph_key",
    "graph_key_from_schedule",
    "cold_edges",
    "StepMode",
    "decide_step_mode",
    "capture_size_for",
    "pad_rows_into",
    "StaticArena",
    "CapturedGraph",
    "GraphCache",
    "CudaGraphBackend",
    "EagerRecordingBackend",
    "GraphController",
]

from .schedule import DEFAULT_CAPTURE_SIZES, capture_size_for, check_capture_sizes  # noqa: E402
from .spec import dtype_name  # noqa: E402  the one dtype table
from .wire import layout  # noqa: E402


from .errors import (  # noqa: E402,F401  defined once, in errors.py
    AFDConfigError,
    GraphBufferError,
    GraphError,
    GraphKeyMismatchError,
    GraphModeError,
)


# ---------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphKey:
    """Everything a captured exchange graph depends on (hashable, comparable).

    Attributes:
        stage_counts: per stage, sorted by stage id: ``(stage_id, counts)`` where
            ``counts[a]`` is the number of rows attention rank ``a`` sends in that
            stage (after graph padding). The full vector, never a total.
        num_layers: exchanges per stage per step (layer loop length).
        parts: the wire of both directions, ``(direction, name, cols, dtype name, encoding)`` per part in
            wire order (:func:`afd_ext.wire.layout`): the hidden size and dtypes, which optional tensors
            travel, and any part declared through :func:`afd_ext.wire.declare_part`.
        topology: ``(num_attention_ranks, num_ffn_ranks, tp_size)`` or ``()``.
        hidden_wire: ``"fp8_e4m3"`` when hidden states travel as FP8 (docs/fp8.md), else None.
    """

    stage_counts: tuple[tuple[int, tuple[int, ...]], ...]
    num_layers: int
    parts: tuple[tuple[Any, ...], ...]
    topology: tuple[int, ...] = ()
    hidden_wire: str | None = None

    @property
    def stages(self) -> tuple[int, ...]:
        """Stage ids, ascending."""
        return tuple(s for s, _ in self.stage_counts)

    def counts(self, stage: int) -> tuple[int, ...]:
        """Per-attention-rank row counts of ``stage``; ``AFDConfigError`` if the key has no such stage."""
        for s, c in self.stage_counts:
            if s == stage:
                return c
        raise AFDConfigError(f"graph key has no stage {stage}; stages are {self.stages}")

    def differences(self, other: "GraphKey") -> list[str]:
        """Human-readable list of the fields in which ``other`` differs from this key."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out

    def describe(self) -> str:
        """Short one-line description for logs and errors (the fields that are set)."""
        stages = ", ".join(f"stage {s}: {list(c)}" for s, c in self.stage_counts)
        rest = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)[1:]
                         if getattr(self, f.name) not in (None, ()))
        return f"GraphKey({stages}; {rest})"


def make_graph_key(stage_counts: Mapping[int, Sequence[int]], *, num_layers: int, parts: Sequence[Sequence[Any]],
                   topology: Sequence[int] = (), hidden_wire: str | None = None) -> GraphKey:
    """Build a :class:`GraphKey` from plain values (stages sorted; ``parts`` as :attr:`GraphKey.parts`).

    The values are checked where they come from: :class:`~afd_ext.schedule.ScheduleConfig`
    and the step's schedule (:func:`graph_key_from_schedule`); the key only compares them.
    ``stage_counts``: stage id -> per-attention-rank row counts (the ones that travel, after graph padding).
    """
    return GraphKey(tuple((s, tuple(int(c) for c in stage_counts[s])) for s in sorted(stage_counts)),
                    int(num_layers), tuple(tuple(p) for p in parts), tuple(int(t) for t in topology), hidden_wire)


def graph_key_from_schedule(schedule: Any) -> GraphKey:
    """The :class:`GraphKey` of a :class:`~afd_ext.schedule.StepSchedule`.

    Uses the wire row vector of every stage (padded under ``pad_to``; never a
    total), the layer count, the wire layout of both directions (every declared
    part present under the config, with its columns and dtype), and ``(A, F, tp)``.
    Both roles get the same key from the same payload and config. Real counts under
    padding are not part of it: a padded graph serves any real counts up to the padded size.
    """
    cfg, topo = schedule.config, schedule.topology
    parts = [(d, p.name, p.cols, dtype_name(p.dtype), p.encoding)
             for d, ps in (("a2f", cfg.wire_parts), ("f2a", layout(cfg, "f2a"))) for p in ps]
    return make_graph_key({s: schedule.rows_vector(s) for s in schedule.stages}, num_layers=cfg.num_layers,
                          parts=parts, topology=(topo.num_attention_ranks, topo.num_ffn_ranks, topo.tp_size),
                          hidden_wire=cfg.hidden_wire)


def cold_edges(schedule: Any, role: str, role_rank: int) -> list[tuple[int, int]]:
    """Edges of ``role_rank`` that carry no row in any stage of ``schedule``.

    A warm-up step must leave this empty: NCCL connects an edge on its first
    message, which must not happen inside a capture.

    Returns:
        ``(attention rank, FFN rank)`` pairs, empty when every edge of the rank has rows.
    """
    topo = schedule.topology
    if role == "attention":
        edges = [(role_rank, f) for f in topo.attention_peers(role_rank)]
    elif role == "ffn":
        edges = [(a, role_rank) for a in topo.ffn_peers(role_rank)]
    else:
        raise AFDConfigError(f"role must be 'attention' or 'ffn', got {role!r}")
    return [e for e in edges if all(schedule.edge_rows(s, *e) == 0 for s in schedule.stages)]


# ---------------------------------------------------------------------------
# The decision rule
# ---------------------------------------------------------------------------


class StepMode(str, enum.Enum):
    """What a rank does with one step, decided from the control payload's flags."""

    EAGER = "eager"
    WARMUP = "warmup"
    CAPTURE = "capture"
    REPLAY = "replay"


_FLAG_MODES = {"is_warmup": StepMode.WARMUP, "is_graph_capturing": StepMode.CAPTURE,
               "is_graph_replaying": StepMode.REPLAY}


def decide_step_mode(payload: Any) -> StepMode:
    """Map a control payload's flags to a :class:`StepMode` — the same rule on both roles.

    ``is_warmup`` → WARMUP (eager, real traffic on every edge);
    ``is_graph_capturing`` → CAPTURE; ``is_graph_replaying`` → REPLAY; none → EAGER.
    ``is_profile`` does not change the mode.

    Args:
        payload: an ``AFDControlPayload`` (or anything with the three bool flags).

    Returns:
        The step mode.

    Raises:
        GraphModeError: more than one of the three flags is set.
    """
    on = [name for name in _FLAG_MODES if getattr(payload, name, False)]
    if len(on) > 1:
        raise GraphModeError(f"control payload sets conflicting flags {on}; at most one may be set per step")
    return _FLAG_MODES[on[0]] if on else StepMode.EAGER


# ---------------------------------------------------------------------------
# Padding
# ---------------------------------------------------------------------------


def pad_rows_into(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into the first rows of the static buffer ``dst``; zero the rest.

    The padding rows are zeroed so that they are finite and deterministic.

    Args:
        src: ``[n, ...]`` real rows, any device; ``n <= dst.shape[0]``.
        dst: ``[capacity, ...]`` static buffer (mutated), same trailing shape and dtype.

    Returns:
        ``dst[:n]``, a view of the real rows.

    Raises:
        AFDConfigError: trailing shape or dtype differ, or ``n`` exceeds the capacity.
    """
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise AFDConfigError(
            f"src {tuple(src.shape)}:{src.dtype} does not fit static buffer {tuple(dst.shape)}:{dst.dtype}; "
            "trailing shape and dtype must match"
        )
    n = src.shape[0]
    if n > dst.shape[0]:
        raise AFDConfigError(f"src has {n} rows but the static buffer holds {dst.shape[0]}; pick a larger capture size")
    if n:
        dst[:n].copy_(src)
    if n < dst.shape[0]:
        dst[n:].zero_()
    return dst[:n]


# ---------------------------------------------------------------------------
# Static buffers
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    tensor: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_nbytes: int


class StaticArena:
    """The static buffers of one captured graph, allocated before capture and never moved.

    Buffers are named by any hashable (e.g. ``("hidden", stage)``). Before
    :meth:`freeze`, :meth:`buffer` allocates on first request and returns the same
    tensor afterwards; after it, only existing buffers are returned (a request for
    a new name or a different shape raises), which is how a connector asked for a
    buffer inside a capture learns it forgot to reserve it.

    Args:
        device: device of every buffer (``torch.device`` or string).
        label: text used in error messages (e.g. the graph key's description).
    """

    def __init__(self, device: torch.device | str, label: str = ""):
        self.device = torch.device(device)
        self.label = label
        self._slots: dict[Hashable, _Slot] = {}
        self._frozen = False

    def freeze(self) -> None:
        """Forbid new buffers (called right before capture)."""
        self._frozen = True

    def buffer(self, name: Hashable, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Return the static buffer ``name``, allocating it (zeroed) on first request.

        Args:
            name: any hashable identifying the buffer in this arena.
            shape: its shape at the captured capacity.
            dtype: its dtype.

        Returns:
            A contiguous tensor on the arena's device, the same object on every call.

        Raises:
            GraphBufferError: the name exists with another shape or dtype, or the
                arena is frozen and the name is unknown.
        """
        shape = tuple(int(s) for s in shape)
        slot = self._slots.get(name)
        if slot is not None:
            if slot.shape != shape or slot.dtype != dtype:
                raise GraphBufferError(
                    f"static buffer {name!r} of {self.label or 'this arena'} is {slot.shape}:{slot.dtype}, "
                    f"asked for {shape}:{dtype}; a captured graph's buffers cannot change shape"
                )
            return slot.tensor
        if self._frozen:
            raise GraphBufferError(
                f"static buffer {name!r} {shape}:{dtype} was not reserved before capture of "
                f"{self.label or 'this graph'}; allocate every buffer the graph touches before capturing"
            )
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        self._slots[name] = _Slot(t, t.data_ptr(), shape, dtype, t.untyped_storage().nbytes())
        return t

    def addresses(self) -> dict[Hashable, int]:
        """Name -> ``data_ptr()`` recorded at allocation."""
        return {n: s.data_ptr for n, s in self._slots.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers' storages."""
        return sum(s.storage_nbytes for s in self._slots.values())

    def check_stable(self) -> None:
        """Assert every buffer still has its address, shape, dtype and storage size.

        Raises:
            GraphBufferError: naming the buffer that moved or changed.
        """
        for name, s in self._slots.items():
            t = s.tensor
            if (
                t.data_ptr() != s.data_ptr
                or tuple(t.shape) != s.shape
                or t.dtype != s.dtype
                or t.untyped_storage().nbytes() != s.storage_nbytes
            ):
                raise GraphBufferError(
                    f"static buffer {name!r} of {self.label or 'this arena'} moved or changed "
                    f"(ptr {s.data_ptr:#x} -> {t.data_ptr():#x}, shape {s.shape} -> {tuple(t.shape)}); "
                    "a captured graph would read or write freed memory"
                )

    def release(self) -> None:
        """Drop every buffer (only the owning :class:`CapturedGraph` calls this)."""
        self._slots.clear()


# ---------------------------------------------------------------------------
# Graph backends: real CUDA graphs, or an eager stand-in on CPU
# ---------------------------------------------------------------------------


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` capture, one shared memory pool per controller.

    A backend has ``new_pool()``, ``capture(body, pool) -> (graph, body's return value)``,
    ``replay(graph)`` (None, or fresh outputs for a stand-in), ``release(graph)`` and
    ``synchronize()``; :class:`EagerRecordingBackend` is the CPU stand-in.

    Capture uses ``capture_error_mode="thread_local"`` so a watchdog thread that
    queries events during a capture does not invalidate it.

    Args:
        device: the CUDA device the graphs run on.

    Raises:
        GraphError: no CUDA device is available.
        AFDConfigError: ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device | str | int | None = None):
        if not torch.cuda.is_available():
            raise GraphError("CUDA graphs need a CUDA device; none is available (use eager mode)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise AFDConfigError(f"CudaGraphBackend needs a cuda device, got {self.device}")

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, body, pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = body()
        return graph, out

    def replay(self, graph):
        graph.replay()

    def release(self, graph):
        graph.reset()

    def synchronize(self):
        torch.cuda.synchronize(self.device)


class EagerRecordingBackend:
    """The CPU stand-in (``afd-ext demo --graph`` on gloo, CPU tests): "capture" records the callable, "replay" re-runs it.

    It exercises every decision, cache and buffer rule of :class:`GraphController`
    without a GPU (and, over gloo, with real traffic on replay), but it is not a
    CUDA graph: capture runs nothing and moves no data, exactly like a real capture.
    """

    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.released = 0

    def new_pool(self):
        return None

    def capture(self, body, pool):
        self.captures += 1
        return body, None

    def replay(self, graph):
        self.replays += 1
        return graph()

    def release(self, graph):
        self.released += 1

    def synchronize(self):
        pass


# ---------------------------------------------------------------------------
# Captured graphs and the cache
# ---------------------------------------------------------------------------


class CapturedGraph:
    """The graphs captured for one key and the arena they read and write, owned together.

    Attributes:
        key: the :class:`GraphKey` they were captured for.
        graphs: the captured graphs, replayed one at a time by index (one, or one per
            attention layer); empty once released.
        arena: their :class:`StaticArena` (frozen).
        outputs: the static outputs (what a single captured callable returned).
        replays: how many graphs were replayed.
    """

    def __init__(self, key: GraphKey, graphs: Sequence[Any], arena: StaticArena, outputs: Any, backend: Any):
        self.key = key
        self.graphs = tuple(graphs)
        self.arena = arena
        self.outputs = outputs
        self.replays = 0
        self.released = False
        self._backend = backend

    def replay(self, part: int | None = None) -> Any:
        """Replay graph ``part`` on the current stream and return the static outputs.

        ``part`` may be omitted for an entry of one graph; an entry captured in parts needs it (replaying
        part 0 alone would run only the first layer). The arena's addresses are checked before part 0
        (a cheap host check).

        Raises:
            GraphError: the entry was released, or ``part`` is missing or out of range.
            GraphBufferError: a static buffer moved (checked before launching).
        """
        if self.released:
            raise GraphError(f"graph for {self.key.describe()} was released; capture it again")
        if part is None and len(self.graphs) == 1:
            part = 0
        if type(part) is not int or not 0 <= part < len(self.graphs):
            raise GraphError(f"graph for {self.key.describe()} has {len(self.graphs)} parts: pass "
                             f"part=0..{len(self.graphs) - 1}, got part={part!r}")
        if part == 0:
            self.arena.check_stable()
        fresh = self._backend.replay(self.graphs[part])
        self.replays += 1
        return self.outputs if fresh is None else fresh

    def release(self) -> None:
        """Free the graphs, then their buffers, after every launched replay finished."""
        if self.released:
            return
        # The GPU may still be running an earlier replay; freeing its buffers or
        # graph-pool memory now could let the next allocation overwrite them.
        self._backend.synchronize()
        for g in self.graphs:
            self._backend.release(g)
        self.graphs = ()
        self.outputs = None
        self.arena.release()
        self.released = True


class GraphCache:
    """A bounded LRU of :class:`CapturedGraph` entries.

    Args:
        max_entries: the most graphs held at once (>= 1).

    Eviction releases the least recently used entry, graphs and buffers together.

    Raises:
        AFDConfigError: ``max_entries`` is not an int >= 1.
    """

    def __init__(self, max_entries: int):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise AFDConfigError(f"graph cache size must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[GraphKey, CapturedGraph] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._entries

    def keys(self) -> list[GraphKey]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key: GraphKey) -> CapturedGraph | None:
        """The entry for ``key`` (marked most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, entry: CapturedGraph) -> list[GraphKey]:
        """Insert ``entry`` (replacing and releasing an older entry of the same key).

        Returns:
            The keys evicted to stay within ``max_entries``.
        """
        old = self._entries.pop(entry.key, None)
        if old is not None and old is not entry:
            old.release()
        self._entries[entry.key] = entry
        evicted = []
        while len(self._entries) > self.max_entries:
            victim, e = self._entries.popitem(last=False)
            e.release()
            self.evictions += 1
            evicted.append(victim)
            logger.info("evicted CUDA graph %s", victim.describe())
        return evicted

    def evict(self, key: GraphKey) -> bool:
        """Release and drop ``key``; False when absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        entry.release()
        self.evictions += 1
        return True

    def clear(self) -> None:
        """Release every entry (e.g. in the connector's ``close``)."""
        while self._entries:
            self._entries.popitem(last=False)[1].release()


# ---------------------------------------------------------------------------
# The per-rank driver
# ---------------------------------------------------------------------------


class GraphController:
    """Graph mode for one rank (attention or FFN): decisions, arenas, capture, replay.

    Typical FFN-side step::

        payload = connector.control_plane.recv_dp_metadata_list()
        mode = ctl.decide(payload, key)              # key from the step's schedule
        if mode is StepMode.REPLAY:
            ctl.replay(key)                          # raises GraphKeyMismatchError if not captured
        elif mode is StepMode.CAPTURE:
            arena = ctl.new_arena(key)
            ...apply the payload with buffers taken from ``arena``...
            ctl.capture(key, arena, ffn_step_loop)   # all layers x all stages, one graph
        else:                                        # EAGER or WARMUP: eager buffers, real traffic
            ffn_step_loop()
            ctl.note_eager_step(mode, schedule, role_rank)

    The attention side runs the same rule on the same payload (it built it), with
    the layer loop over static inputs as the captured callable.

    Args:
        role: ``"attention"`` or ``"ffn"`` (for messages).
        cache_size: most graphs held (``graph_cache_size``), >= 1.
        backend: :class:`CudaGraphBackend` (the default, on ``device``) or :class:`EagerRecordingBackend`.
        device: device of the static buffers (default: the backend's, or the current CUDA device).
        capture_sizes: strictly increasing per-peer capture sizes (vLLM style).

    A capture is refused until a warm-up step has put rows on every edge of this
    rank (:meth:`note_eager_step`; or set :attr:`warmed_up`): NCCL connects edges
    lazily, and a first connection inside a capture fails or hangs.

    Raises:
        AFDConfigError: a bad role, cache size or capture-size list.
    """

    def __init__(
        self,
        *,
        role: str,
        cache_size: int,
        backend: Any = None,
        device: torch.device | str | None = None,
        capture_sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES,
    ):
        if role not in ("attention", "ffn"):
            raise AFDConfigError(f"role must be 'attention' or 'ffn', got {role!r}")
        self.role = role
        self.capture_sizes = check_capture_sizes(capture_sizes)
        if backend is None:
            backend = CudaGraphBackend(device)
        self.backend = backend
        if device is None:
            device = getattr(backend, "device", None) or "cpu"
        self.device = torch.device(device)
        self._pool = backend.new_pool()
        self.cache = GraphCache(cache_size)
        self.warmed_up = False
        self.links: Hashable = None

    def follow(self, links: Hashable, warmed_up: bool) -> None:
        """Drop every graph when the connector's links changed (``AFDConnector.links_id``: a re-init, e.g.
        to meet a restarted peer): a graph holds the communicators and peer buffers it was captured with,
        and must never replay against another generation's. ``warmed_up``: whether the new links were
        warmed (``warmup_on_init``). Call before :meth:`decide` every step."""
        if links != self.links:
            if self.links is not None and len(self.cache):
                logger.info("%s rank: the connector was re-initialised; dropping %d graph(s) of its old links",
                            self.role, len(self.cache))
            self.cache.clear()
            self.links, self.warmed_up = links, warmed_up

    # -- decisions --------------------------------------------------------

    def decide(self, payload: Any, key: GraphKey | None = None) -> StepMode:
        """Decide this step's mode from the payload's flags; validate it against the cache.

        Args:
            payload: the step's control payload.
            key: the step's :class:`GraphKey` (required for CAPTURE and REPLAY).

        Returns:
            The mode (the same on every rank that saw the same payload).

        Raises:
            GraphModeError: conflicting flags; capture/replay without a key; a capture
                before any warm-up step.
            GraphKeyMismatchError: a replay whose key was never captured (or was
                evicted); the message lists the captured keys and the closest one's
                differences. Nothing is replayed.
        """
        mode = decide_step_mode(payload)
        if mode in (StepMode.CAPTURE, StepMode.REPLAY) and key is None:
            raise GraphModeError(f"{self.role} rank: a {mode.value} step needs the step's graph key")
        if mode is StepMode.CAPTURE and not self.warmed_up:
            raise GraphModeError(
                f"{self.role} rank: capture of {key.describe()} before any warm-up step; send a payload "
                "with is_warmup=True and rows on every peer first (NCCL connects edges lazily)"
            )
        if mode is StepMode.REPLAY and key not in self.cache:
            raise GraphKeyMismatchError(self._mismatch_message(key))
        return mode

    def _mismatch_message(self, key: GraphKey) -> str:
        keys = self.cache.keys()
        msg = f"{self.role} rank: refusing to replay {key.describe()}: no graph was captured for it"
        if not keys:
            return msg + " (no graph captured yet; send a capture step first)"
        closest = min(keys, key=lambda k: len(k.differences(key)))
        return (
            msg
            + f"; {len(keys)} captured, closest {closest.describe()} differs in "
            + "; ".join(closest.differences(key))
        )

    def note_eager_step(self, mode: StepMode, schedule: Any, role_rank: int) -> None:
        """Record an eager step; a WARMUP step with rows on every edge of this rank warms the edges.

        Args:
            mode: the step's mode (EAGER or WARMUP).
            schedule: the step's schedule; the step warms up when every edge of
                ``role_rank`` carried rows (:func:`cold_edges`).
            role_rank: this rank's role rank.
        """
        if mode is not StepMode.WARMUP:
            return
        cold = cold_edges(schedule, self.role, role_rank)
        if not cold:
            self.warmed_up = True
        else:
            logger.warning("%s rank %d: warm-up step left edges %s cold", self.role, role_rank, cold)

    # -- buffers, capture, replay ----------------------------------------

    def new_arena(self, key: GraphKey) -> StaticArena:
        """A fresh arena for ``key`` on this controller's device (fill it before :meth:`capture`)."""
        return StaticArena(self.device, label=f"{self.role} graph {key.describe()}")

    def capture(self, key: GraphKey, arena: StaticArena, body: Callable[[], Any]) -> CapturedGraph:
        """Capture ``body()`` into one graph for ``key`` and cache it with ``arena``.

        ``body`` is the attention-side layer loop (sends and receives on the current
        stream, reading and writing only ``arena``'s buffers) or the FFN-side whole
        step (all layers x all stages: fan-in, compute, split-back). It runs once,
        under capture: nothing executes and no data moves. The arena is frozen
        first; after capture its addresses are checked.

        Returns:
            The cached :class:`CapturedGraph` (``outputs`` = body's return value).

        Raises:
            GraphBufferError: ``body`` asked the arena for an unreserved buffer, or a
                buffer moved during capture.
            GraphError: the capture failed (the backend's error is chained).
        """
        return self.capture_parts(key, arena, [body], outputs=None)

    def capture_parts(
        self, key: GraphKey, arena: StaticArena, bodies: Sequence[Callable[[], Any]], *, outputs: Any = None
    ) -> CapturedGraph:
        """Capture each of ``bodies`` into its own graph, all cached together under ``key``.

        For the attention side, whose model runs eagerly between its layer
        exchanges: one graph per layer, replayed in layer order with
        ``replay(key, part=layer)``. The graphs share ``arena`` and the pool.
        :meth:`capture` is the one-body case.

        Returns:
            The cached entry (``outputs`` as given; for one body and None, the body's return value).

        Raises:
            AFDConfigError: no bodies.
            GraphBufferError, GraphError: as :meth:`capture`.
        """
        if not bodies:
            raise AFDConfigError("capture_parts needs at least one body")
        if arena.device != self.device:
            raise GraphBufferError(f"arena is on {arena.device}, graphs of this rank run on {self.device}")
        arena.freeze()  # a body asking for a buffer not reserved before capture raises
        graphs_, outs = [], []
        try:
            for body in bodies:
                g, out = self.backend.capture(body, self._pool)
                graphs_.append(g)
                outs.append(out)
        except BaseException:
            for g in graphs_:
                self.backend.release(g)
            raise
        arena.check_stable()
        if outputs is None and len(outs) == 1:
            outputs = outs[0]
        entry = CapturedGraph(key, graphs_, arena, outputs, self.backend)
        evicted = self.cache.put(entry)
        logger.debug("%s rank: captured %s (%d static bytes, evicted %d)", self.role, key.describe(),
                     arena.nbytes, len(evicted))
        return entry

    def replay(self, key: GraphKey, *, part: int | None = None) -> Any:
        """Replay the graph captured for ``key`` (its ``part``, for an entry captured in parts) on the current stream.

        Returns:
            The entry's static outputs.

        Raises:
            GraphKeyMismatchError: no graph for ``key`` (refused, nothing launched).
            GraphBufferError: one of its buffers moved.
            GraphError: ``part`` is missing (an entry captured in parts) or out of range.
        """
        entry = self.cache.get(key)
        if entry is None:
            raise GraphKeyMismatchError(self._mismatch_message(key))
        return entry.replay(part)

    def entry(self, key: GraphKey) -> CapturedGraph | None:
        """The cached entry for ``key`` or None."""
        return self.cache.get(key)

    def close(self) -> None:
        """Release every graph and its buffers (safe to call twice)."""
        self.cache.clear()
