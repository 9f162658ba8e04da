"""DP metadata, the control payload and the transfer types (their codecs: :mod:`afd_ext.control.codec`).

The names and fields follow the reference vLLM AFD plugin
(``afd_plugin.connectors.metadata``) so that runtimes written against it work
unchanged. Where the reference is limited, this module goes further: zero is a
valid token count everywhere (an idle attention rank, an empty stage, a
zero-row edge); negative counts are rejected.

:class:`StepCountAgreement` lets the attention ranks agree on each step's
per-rank token counts through an injected all-gather, for runtimes that do not
already gather DP metadata.
"""

from __future__ import annotations

import array
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from .errors import AFDConfigError, AFDProtocolError

__all__ = ["MAX_TOKEN_COUNT", "AFDDPMetadata", "AFDSingleDPMetadata", "AFDControlPayload", "AFDTransferMetadata",
           "AFDTransferState", "AFDTransferContext", "AFDA2FTransferPayload", "AFDF2ATransferPayload",
           "AFDExpertRoutingSpec", "StepCountAgreement"]

#: Counts travel as int32 (as in the reference); the largest representable count.
MAX_TOKEN_COUNT = 2**31 - 1

_FLAG_NAMES = ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile")


def _check_count(value: Any, what: str) -> int:
    """Return ``value`` as an int in ``[0, MAX_TOKEN_COUNT]`` or raise AFDConfigError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise AFDConfigError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise AFDConfigError(f"{what} must be >= 0, got {value}")
    if value > MAX_TOKEN_COUNT:
        raise AFDConfigError(f"{what} must fit in int32 (<= {MAX_TOKEN_COUNT}), got {value}")
    return int(value)


_INT_ONLY = frozenset((int,))


def _checked_counts(counts: Sequence[Any], what: str) -> tuple[int, ...]:
    """Validate counts and return them as a tuple of exact Python ints.

    The fast path (every entry an exact ``int``, all in range) costs well under
    a microsecond for a few ranks and formats no message.
    """
    if set(map(type, counts)) <= _INT_ONLY and (
        not counts or (min(counts) >= 0 and max(counts) <= MAX_TOKEN_COUNT)
    ):
        return tuple(counts)
    return tuple(_check_count(c, f"{what}[{i}]") for i, c in enumerate(counts))


def _count_tensor_from_ints(counts: Sequence[int]) -> torch.Tensor:
    # frombuffer: about 1.5 us less than torch.tensor on the per-step path
    if not counts:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(array.array("i", counts), dtype=torch.int32)


def _counts_from_tensor(value: torch.Tensor, what: str) -> tuple[tuple[int, ...], torch.Tensor]:
    """Validate an integer tensor of counts; return ``(counts, 1-D CPU int32 tensor)``.

    The returned tensor aliases ``value`` when it already is a CPU int32 tensor.
    """
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise AFDConfigError(f"{what} must hold integer token counts, got dtype {value.dtype}")
    t = value.detach().to(device="cpu").flatten()
    counts = t.tolist()
    if counts:
        lo, hi = min(counts), max(counts)
        if lo < 0:
            raise AFDConfigError(f"{what} must be >= 0, got {counts}")
        if hi > MAX_TOKEN_COUNT:
            raise AFDConfigError(f"{what} must fit in int32, got max {hi}")
    return tuple(counts), t.to(torch.int32)


def _version_of(t: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter; None for an inference tensor (it has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------
# DP metadata and the control payload
# ---------------------------------------------------------------------------


class AFDDPMetadata:
    """Token counts of every attention (DP) rank for one stage of one step.

    Mirrors the reference's ``AFDDPMetadata`` (same constructor, attribute names
    and types) and is duck-compatible with the parts of vLLM's ``DPMetadata``
    that MoE code reads on the FFN side.

    The counts are held as a tuple of Python ints (:attr:`counts`); the two
    tensors are built on first access only, so the per-step path (codec,
    schedule, connector) never pays for a tensor. A tensor handed out (or
    passed in) stays the source of truth: modifying it in place is seen by
    :attr:`counts`, the encoder and the schedule (through the tensor's version
    counter; an inference tensor, which has none, is re-read on each access).

    Args:
        num_tokens_across_dp_cpu: the token count of each DP rank (zero for an
            idle rank): a list/tuple of ints or an integer tensor of any shape
            and device (flattened, moved to the CPU, cast to int32; a CPU int32
            tensor is kept as is, not copied).
        max_tokens_across_dp_cpu: the largest count (an int, or a one-element
            integer tensor); ``None`` computes it (0 for an empty vector).
        local_sizes: per-rank chunk sizes, normally set by the context managers below.

    Attributes:
        num_tokens_across_dp_cpu: CPU int32 tensor ``[num_dp_ranks]`` (built lazily).
        max_tokens_across_dp_cpu: CPU int32 0-d tensor (built lazily).
        local_sizes: per-rank chunk sizes set by the context managers below, else ``None``.

    Raises:
        AFDConfigError: a count is negative, not an integer, or exceeds int32; the
            maximum is not one integer in ``[0, 2**31 - 1]``.
    """

    __slots__ = ("_counts", "_max", "_t", "_tv", "_mt", "_mtv", "local_sizes")
    __match_args__ = ("num_tokens_across_dp_cpu", "max_tokens_across_dp_cpu", "local_sizes")

    def __init__(
        self,
        num_tokens_across_dp_cpu: torch.Tensor | Sequence[int],
        max_tokens_across_dp_cpu: torch.Tensor | int | None = None,
        local_sizes: list[int] | None = None,
    ) -> None:
        self._t = self._mt = None
        self._tv = self._mtv = None
        self.local_sizes = local_sizes
        if max_tokens_across_dp_cpu is None and isinstance(num_tokens_across_dp_cpu, (list, tuple)):
            # the per-step path (a list of ints): one validation, no tensor
            counts = _checked_counts(num_tokens_across_dp_cpu, "num_tokens_across_dp_cpu")
            self._counts = counts
            self._max = max(counts) if counts else 0
            return
        self._set_counts(num_tokens_across_dp_cpu)
        self._set_max(max_tokens_across_dp_cpu)

    # -- counts -------------------------------------------------------------

    def _set_counts(self, value: Any) -> None:
        what = "num_tokens_across_dp_cpu"
        if isinstance(value, torch.Tensor):
            counts, t = _counts_from_tensor(value, what)
            self._t, self._tv = t, _version_of(t)
        elif isinstance(value, (list, tuple)):
            counts = _checked_counts(value, what)
            self._t = self._tv = None
        else:
            raise AFDConfigError(f"{what} must be a tensor or a list of ints, got {type(value).__name__}")
        self._counts = counts

    def _sync(self) -> None:
        """Pick up in-place modifications of the handed-out tensors (cheap when there are none)."""
        t = self._t
        if t is not None:
            v = _version_of(t)
            if v is None or v != self._tv:
                self._counts, _ = _counts_from_tensor(t, "num_tokens_across_dp_cpu (modified in place)")
                self._tv = v
        mt = self._mt
        if mt is not None:
            v = _version_of(mt)
            if v is None or v != self._mtv:
                self._max = _check_count(int(mt), "max_tokens_across_dp_cpu (modified in place)")
                self._mtv = v

    @property
    def counts(self) -> tuple[int, ...]:
        """The per-DP-rank counts as a tuple of Python ints (no tensor is built)."""
        if self._t is not None or self._mt is not None:
            self._sync()
        return self._counts

    @property
    def max_tokens(self) -> int:
        """``max_tokens_across_dp_cpu`` as a Python int (no tensor is built)."""
        if self._t is not None or self._mt is not None:
            self._sync()
        return self._max

    @property
    def num_tokens_across_dp_cpu(self) -> torch.Tensor:
        """CPU int32 tensor ``[num_dp_ranks]`` of the counts (built on first access)."""
        t = self._t
        if t is None:
            if torch.compiler.is_compiling():  # traceable, not cached (no side effect in a graph)
                return torch.tensor(self._counts, dtype=torch.int32)
            t = _count_tensor_from_ints(self._counts)
            self._t, self._tv = t, _version_of(t)
        return t

    @num_tokens_across_dp_cpu.setter
    def num_tokens_across_dp_cpu(self, value: torch.Tensor | Sequence[int]) -> None:
        self._set_counts(value)

    # -- max ----------------------------------------------------------------

    def _set_max(self, value: Any) -> None:
        what = "max_tokens_across_dp_cpu"
        self._mt = self._mtv = None
        if value is None:
            self._max = max(self._counts, default=0)
        elif isinstance(value, int) and not isinstance(value, bool):
            self._max = _check_count(value, what)
        else:
            try:
                m = torch.as_tensor(value).detach()
            except (TypeError, ValueError, RuntimeError) as e:
                raise AFDConfigError(f"{what} must be one integer, got {value!r} ({e})") from None
            if m.numel() != 1 or m.dtype.is_floating_point or m.dtype.is_complex or m.dtype == torch.bool:
                raise AFDConfigError(f"{what} must be one integer, got {m.tolist()!r}")
            self._max = _check_count(int(m.reshape(()).item()), what)
            if isinstance(value, torch.Tensor) and m.dtype == torch.int32 and m.device.type == "cpu":
                mt = m.reshape(())
                self._mt, self._mtv = mt, _version_of(mt)

    @property
    def max_tokens_across_dp_cpu(self) -> torch.Tensor:
        """CPU int32 0-d tensor, the largest count (built on first access)."""
        mt = self._mt
        if mt is None:
            if torch.compiler.is_compiling():
                return torch.tensor(self._max, dtype=torch.int32)
            mt = torch.scalar_tensor(self._max, dtype=torch.int32)
            self._mt, self._mtv = mt, _version_of(mt)
        return mt

    @max_tokens_across_dp_cpu.setter
    def max_tokens_across_dp_cpu(self, value: torch.Tensor | int | None) -> None:
        self._set_max(value)

    # -- object protocol ----------------------------------------------------

    def __repr__(self) -> str:
        return (f"AFDDPMetadata(num_tokens_across_dp_cpu={list(self.counts)}, "
                f"max_tokens_across_dp_cpu={self.max_tokens}, local_sizes={self.local_sizes!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AFDDPMetadata):
            return NotImplemented
        return (self.counts == other.counts and self.max_tokens == other.max_tokens
                and self.local_sizes == other.local_sizes)

    __hash__ = None  # type: ignore[assignment] - mutable, as the reference's dataclass

    def __reduce__(self) -> tuple:
        return (type(self), (list(self.counts), self.max_tokens, self.local_sizes))

    # -- vLLM DPMetadata-compatible helpers ---------------------------------

    @contextlib.contextmanager
    def sp_local_sizes(self, sequence_parallel_size: int, pcp_size: int = 1,
                       use_ep: bool = False) -> Iterator[list[int]]:
        """Set ``local_sizes`` to each sequence-parallel rank's token count, as vLLM's ``DPMetadata``.

        A DP rank's count ``n`` becomes, with prefill context parallelism
        (``pcp_size > 1``), ``pcp_size`` entries of ``n`` under expert
        parallelism (``use_ep``) or one entry of ``n * pcp_size`` otherwise;
        each entry is then ``ceil(entry / sp)`` repeated ``sp`` times. vLLM
        0.33's MoE runner passes ``pcp_size`` and ``use_ep``; older ones
        pass ``sp`` alone.

        Args:
            sequence_parallel_size: sequence-parallel degree, >= 1.
            pcp_size: prefill context-parallel degree, >= 1.
            use_ep: whether the MoE layer runs expert parallel.

        Yields:
            The local sizes (list of ints); ``local_sizes`` is reset to
            ``None`` on exit.

        Raises:
            AFDConfigError: a degree is not an int >= 1, or ``use_ep`` is not a bool.
        """
        self.local_sizes = self._sp_sizes(sequence_parallel_size, pcp_size, use_ep)
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    def _sp_sizes(self, sp: int, pcp: int = 1, use_ep: bool = False) -> list[int]:
        for what, v in (("sequence_parallel_size", sp), ("pcp_size", pcp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AFDConfigError(f"{what} must be an int >= 1, got {v!r}")
        if not isinstance(use_ep, bool):
            raise AFDConfigError(f"use_ep must be a bool, got {use_ep!r}")
        counts = [n for n in self.counts for _ in range(pcp)] if use_ep else [n * pcp for n in self.counts]
        return [-(-n // sp) for n in counts for _ in range(sp)]

    def get_chunk_sizes_across_dp_rank(self) -> list[int] | None:
        """Return ``local_sizes`` (set inside the context managers), else ``None``."""
        return self.local_sizes

    def cu_tokens_across_sp(self, sp_size: int) -> torch.Tensor:
        """Cumulative sum of the sequence-parallel local sizes (CPU int32 tensor)."""
        sizes = self._sp_sizes(sp_size)
        return torch.cumsum(torch.tensor(sizes, dtype=torch.int32), dim=0, dtype=torch.int32)

    @contextlib.contextmanager
    def chunked_sizes(
        self, sequence_parallel_size: int, max_chunk_size_per_rank: int, chunk_idx: int
    ) -> Iterator[list[int]]:
        """Set ``local_sizes`` to each rank's size in chunk ``chunk_idx``.

        As vLLM's helper: ``max(1, min(max_chunk, size - max_chunk * chunk_idx))``
        over the sequence-parallel sizes (vLLM's MoE code expects >= 1).

        Yields:
            The local sizes; ``local_sizes`` is reset to ``None`` on exit.
        """
        sizes = self._sp_sizes(sequence_parallel_size)
        self.local_sizes = [
            max(1, min(max_chunk_size_per_rank, s - max_chunk_size_per_rank * chunk_idx))
            for s in sizes
        ]
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None


#: Reference alias.
AFDSingleDPMetadata = AFDDPMetadata


def _to_dp_metadata(value: Any, stage: Any) -> AFDDPMetadata:
    if isinstance(value, AFDDPMetadata):
        return value
    counts = getattr(value, "num_tokens_across_dp_cpu", None)
    if counts is not None:  # vLLM DPMetadata: only the counts survive, as in the reference
        return AFDDPMetadata(num_tokens_across_dp_cpu=counts)
    if isinstance(value, (list, tuple, torch.Tensor)):
        return AFDDPMetadata(num_tokens_across_dp_cpu=value)
    raise AFDConfigError(
        f"dp_metadata_list[{stage!r}] must be AFDDPMetadata, a DPMetadata or a list of counts, "
        f"got {type(value).__name__}"
    )


@dataclass(slots=True)
class AFDControlPayload:
    """What the attention side tells the FFN side once per step.

    Attributes:
        dp_metadata_list: stage index (>= 0) -> DP metadata of that stage. The
            FFN side runs the stages in sorted order. vLLM ``DPMetadata``
            values and plain count lists are converted to :class:`AFDDPMetadata`.
        is_graph_capturing: this step is captured into a CUDA graph.
        is_warmup: this step is a warm-up run before capture.
        is_graph_replaying: this step replays a captured graph (the FFN side
            must replay only when this is set; reference issue #261).
        is_profile: this step is a profiling run.

    Raises:
        AFDConfigError: a stage key is not a non-negative int, a flag is not a
            bool, or a value cannot be converted.
    """

    dp_metadata_list: dict[int, AFDDPMetadata]
    is_graph_capturing: bool = False
    is_warmup: bool = False
    is_graph_replaying: bool = False
    is_profile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dp_metadata_list, Mapping):
            raise AFDConfigError(
                f"dp_metadata_list must be a dict stage -> AFDDPMetadata, "
                f"got {type(self.dp_metadata_list).__name__}"
            )
        converted: dict[int, AFDDPMetadata] = {}
        for stage, value in self.dp_metadata_list.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                raise AFDConfigError(f"dp_metadata_list keys must be stage ints >= 0, got {stage!r}")
            converted[int(stage)] = _to_dp_metadata(value, stage)
        self.dp_metadata_list = converted
        for name in _FLAG_NAMES:
            if not isinstance(getattr(self, name), bool):
                raise AFDConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_fields(cls, obj: Any) -> "AFDControlPayload":
        """Build from any object with the payload's fields (e.g. the reference plugin's own class).

        Reads ``dp_metadata_list`` (values with ``num_tokens_across_dp_cpu``,
        or count lists), ``is_graph_capturing`` and ``is_warmup``; the newer
        ``is_graph_replaying`` and ``is_profile`` default to False when absent.

        Raises:
            AFDConfigError: a field is missing or invalid (named).
        """
        if isinstance(obj, cls):
            return obj
        if not hasattr(obj, "dp_metadata_list"):
            raise AFDConfigError(f"expected an AFDControlPayload or an object with its fields (dp_metadata_list, "
                             f"is_graph_capturing, ...), got {type(obj).__name__}")
        flags = {}
        for name in _FLAG_NAMES:
            value = getattr(obj, name, False)
            flags[name] = bool(value) if isinstance(value, (bool, int)) else value
        return cls(dict(obj.dp_metadata_list), **flags)

    def stage_counts(self) -> dict[int, tuple[int, ...]]:
        """Return ``{stage: per-DP-rank counts}`` in sorted stage order."""
        return {s: self.dp_metadata_list[s].counts for s in sorted(self.dp_metadata_list)}


# ---------------------------------------------------------------------------
# Transfer types
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class AFDTransferMetadata:
    """Rows of one (layer, stage) exchange, one entry per peer.

    On the attention side ``seq_lens`` is ``[rows this rank sends]``; on the
    FFN side it is the rows received from each attention peer in fan-in order.
    Unlike the reference, a zero entry is valid (a zero-token peer); an empty
    list is not (every rank has at least one peer).

    Attributes:
        layer_idx: layer index (>= 0).
        stage_idx: stage index (>= 0).
        seq_lens: rows per peer, each >= 0. Symbolic ints (``torch.SymInt``,
            inside ``torch.compile``) pass through unchecked so that building a
            context does not add guards.

    Raises:
        AFDConfigError: ``seq_lens`` empty, an entry negative or not an int.
    """

    layer_idx: int
    stage_idx: int
    seq_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.seq_lens) == 0:
            raise AFDConfigError("seq_lens cannot be empty: give one entry per peer (0 for a zero-token peer)")
        for i, n in enumerate(self.seq_lens):
            if isinstance(n, int) and not isinstance(n, bool):
                if n < 0:
                    raise AFDConfigError(f"seq_lens[{i}] must be >= 0, got {n}")
            elif not isinstance(n, torch.SymInt):
                raise AFDConfigError(f"seq_lens[{i}] must be an int, got {type(n).__name__} {n!r}")

    @property
    def total_tokens(self) -> int:
        """Sum of ``seq_lens``: the rows of the (concatenated) tensor."""
        return sum(self.seq_lens)

    def validate_tensor_shape(self, tensor_shape: tuple[int, ...]) -> bool:
        """True when ``tensor_shape`` has a leading dimension equal to ``total_tokens``."""
        return len(tensor_shape) > 0 and tensor_shape[0] == sum(self.seq_lens)  # total_tokens, without its hop

    @classmethod
    def create_attention_metadata(
        cls, *, layer_idx: int, stage_idx: int, seq_len: int
    ) -> "AFDTransferMetadata":
        """Metadata of an attention rank sending ``seq_len`` rows (may be 0)."""
        return cls(layer_idx=layer_idx, stage_idx=stage_idx, seq_lens=[seq_len])

    @classmethod
    def create_ffn_metadata(
        cls, *, layer_idx: int, stage_idx: int, seq_lens: Sequence[int]
    ) -> "AFDTransferMetadata":
        """Metadata of an FFN rank that received ``seq_lens[i]`` rows from peer ``i``."""
        return cls(layer_idx=layer_idx, stage_idx=stage_idx, seq_lens=list(seq_lens))


@dataclass(slots=True)
class AFDTransferState:
    """Base class for backend state carried from a receive to its send (empty)."""


@dataclass(slots=True)
class AFDTransferContext:
    """Context of one exchange. ``states`` defaults to ``None`` (not a
    ``default_factory``) so that Dynamo can trace the generated ``__init__``."""

    metadata: AFDTransferMetadata
    states: AFDTransferState | None = None


@dataclass(slots=True)
class AFDA2FTransferPayload:
    """What an FFN rank receives for one (layer, stage).

    Attributes:
        hidden_states: ``[total_tokens, hidden]`` every peer's rows concatenated
            in fan-in order.
        context: the transfer context (pass it back to ``send_ffn_output``).
        router_logits: ``[total_tokens, num_experts]`` when the gate runs on the
            attention side, else ``None``.
        input_ids: ``[total_tokens]`` int32 token ids when they travel, else ``None``.
        hidden_scales: with FP8 on the wire and ``fp8_delivery: "fp8"`` (docs/fp8.md),
            ``hidden_states`` are ``float8_e4m3fn`` and these their float32 scales
            ``[total_tokens, hidden/128]``; else ``None``.
        parts: every received part by its name (:mod:`afd_ext.wire`), e.g. a declared
            ``"topk_ids"``; views of the same buffers as the fields above.
    """

    hidden_states: torch.Tensor
    context: AFDTransferContext
    router_logits: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    hidden_scales: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class AFDF2ATransferPayload:
    """FFN output for one exchange: ``routed_output`` ``[rows, hidden]`` and an
    optional ``shared_output`` of the same shape (asynchronous connectors)."""

    routed_output: torch.Tensor
    shared_output: torch.Tensor | None = None


class AFDExpertRoutingSpec(NamedTuple):
    """Receive contract for router logits: ``[tokens, router_logits_width]`` of
    ``router_logits_dtype``."""

    router_logits_width: int
    router_logits_dtype: torch.dtype


# ---------------------------------------------------------------------------
# Step count agreement
# ---------------------------------------------------------------------------


class StepCountAgreement:
    """Let the attention ranks agree on each step's per-rank token counts.

    For runtimes that do not already gather DP metadata: every attention rank
    calls :meth:`agree` once per step with its own per-stage counts; the
    injected ``all_gather`` exchanges them, and every rank gets the same
    :class:`AFDControlPayload` (counts in rank order). The step number and the
    flags are gathered too, so ranks that are out of step, disagree on the
    stages, or disagree on a flag get an ``AFDProtocolError`` naming the ranks
    instead of a mismatched data plane later.

    Args:
        num_ranks: number of participants (the attention ranks, or the DP
            ranks when the counts are expanded over TP later).
        rank: this participant's index in ``0..num_ranks-1``.
        all_gather: ``f(obj) -> list`` returning every participant's ``obj``
            in rank order; must be a collective with its own deadline. See
            :meth:`from_process_group`.

    Raises:
        AFDConfigError: ``num_ranks`` < 1, ``rank`` out of range, or
            ``all_gather`` not callable.

    Example:
        >>> agreement = StepCountAgreement.from_process_group(gloo_group)  # doctest: +SKIP
        >>> payload = agreement.agree({0: n0, 1: n1})                       # doctest: +SKIP
    """

    def __init__(self, num_ranks: int, rank: int, all_gather: Callable[[Any], list[Any]]):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise AFDConfigError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise AFDConfigError(f"rank must be in 0..{num_ranks - 1}, got {rank!r}")
        if not callable(all_gather):
            raise AFDConfigError("all_gather must be callable: f(obj) -> list of every rank's obj")
        self.num_ranks = num_ranks
        self.rank = rank
        self._all_gather = all_gather
        self._step = 0

    @classmethod
    def from_process_group(cls, group: Any = None) -> "StepCountAgreement":
        """Build one over ``torch.distributed.all_gather_object`` on ``group``.

        Use a gloo (CPU) group so no device sync happens; the group's timeout
        bounds the wait.
        """
        import torch.distributed as dist

        n = dist.get_world_size(group)
        r = dist.get_rank(group)

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * n
            dist.all_gather_object(out, obj, group=group)
            return out

        return cls(n, r, gather)

    @property
    def step(self) -> int:
        """Number of completed agreements."""
        return self._step

    def agree(
        self,
        local_counts: Mapping[int, int] | Sequence[int],
        *,
        is_graph_capturing: bool = False,
        is_warmup: bool = False,
        is_graph_replaying: bool = False,
        is_profile: bool = False,
    ) -> AFDControlPayload:
        """Exchange this rank's per-stage counts and build the step's payload.

        Args:
            local_counts: ``{stage: rows on this rank}``, or a sequence whose
                index is the stage. Zero is valid.
            is_graph_capturing, is_warmup, is_graph_replaying, is_profile:
                the step's flags; every rank must pass the same values.

        Returns:
            The same payload on every rank: stage -> counts of every rank.

        Raises:
            AFDConfigError: bad local counts, or ``all_gather`` returned the
                wrong number of entries.
            AFDProtocolError: the ranks disagree on the step number, the stages
                or a flag (the message names the ranks).
        """
        if isinstance(local_counts, Mapping):
            items = dict(local_counts)
        elif isinstance(local_counts, (list, tuple)):
            items = dict(enumerate(local_counts))
        else:
            raise AFDConfigError(
                f"local_counts must be a dict stage -> count or a list, "
                f"got {type(local_counts).__name__}"
            )
        for stage, n in items.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                raise AFDConfigError(f"stage keys must be ints >= 0, got {stage!r}")
            _check_count(n, f"local_counts[{stage}]")
        flags = (is_graph_capturing, is_warmup, is_graph_replaying, is_profile)
        mine = (self._step, tuple(sorted(items.items())), flags)
        gathered = self._all_gather(mine)
        if not isinstance(gathered, (list, tuple)) or len(gathered) != self.num_ranks:
            raise AFDConfigError(
                f"all_gather returned {len(gathered) if hasattr(gathered, '__len__') else gathered!r} "
                f"entries, expected {self.num_ranks}"
            )
        steps = [g[0] for g in gathered]
        if len(set(steps)) != 1:
            raise AFDProtocolError(f"attention ranks are out of step: step numbers by rank {steps}")
        stage_sets = [tuple(s for s, _ in g[1]) for g in gathered]
        if len(set(stage_sets)) != 1:
            detail = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(stage_sets))
            raise AFDProtocolError(f"attention ranks disagree on this step's stages ({detail})")
        flag_sets = [g[2] for g in gathered]
        if len(set(flag_sets)) != 1:
            bad = [r for r, f in enumerate(flag_sets) if f != flag_sets[0]]
            raise AFDProtocolError(
                f"attention ranks disagree on the step flags (capturing, warmup, replaying, "
                f"profile): rank 0 {flag_sets[0]}, ranks {bad} differ"
            )
        dp = {
            stage: AFDDPMetadata(
                num_tokens_across_dp_cpu=[dict(g[1])[stage] for g in gathered]
            )
            for stage in stage_sets[0]
        }
        self._step += 1
        return AFDControlPayload(
            dp_metadata_list=dp,
            is_graph_capturing=is_graph_capturing,
            is_warmup=is_warmup,
            is_graph_replaying=is_graph_replaying,
            is_profile=is_profile,
        )
