"""What a benchmark run measures: cases, sweeps, process layout, repetition policy.

Pure Python (no torch import), so the CLI can validate a request and print
the plan before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from afd_ext.errors import AFDConfigError
from afd_ext.tools.testing import GpuPlacement, place_processes


MODES = ("eager", "graph")
#: Variant names, in the order they are alternated inside a case.
ALL_VARIANTS = ("ours_per_tensor", "connector", "reference", "raw", "peer", "connector_peer")
#: Accepted by ``--variants`` but not run by default: FP8 hidden states on the wire (docs/fp8.md).
FP8_VARIANTS = ("ours_fp8", "peer_fp8")
DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
ROUTER_LOGITS_WIDTH = 256


@dataclass(frozen=True, order=True)
class Case:
    """One payload shape of a layer exchange, per attention rank.

    Attributes:
        hidden: hidden size (bf16 elements per token).
        tokens: tokens per attention rank.
        extras: True when fp32 router logits ``[tokens, logits_width]`` and
            int32 token ids ``[tokens]`` travel with the hidden states.
        logits_width: router-logits width (experts).
    """

    hidden: int
    tokens: int
    extras: bool
    logits_width: int = ROUTER_LOGITS_WIDTH

    def __post_init__(self) -> None:
        for name in ("hidden", "tokens", "logits_width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AFDConfigError(f"Case.{name} must be a positive int, got {v!r}")

    def a2f_row_bytes(self) -> int:
        """Unpadded bytes per token attention -> FFN (hidden bf16, plus logits fp32 and id int32)."""
        n = 2 * self.hidden
        if self.extras:
            n += 4 * self.logits_width + 4
        return n

    def f2a_row_bytes(self) -> int:
        """Bytes per token FFN -> attention (the bf16 FFN output)."""
        return 2 * self.hidden

    def a2f_bytes(self, rows: int | None = None) -> int:
        """Bytes attention -> FFN for ``rows`` tokens (default: ``tokens``)."""
        return (self.tokens if rows is None else rows) * self.a2f_row_bytes()

    def f2a_bytes(self, rows: int | None = None) -> int:
        """Bytes FFN -> attention for ``rows`` tokens (default: ``tokens``)."""
        return (self.tokens if rows is None else rows) * self.f2a_row_bytes()

    def key(self) -> str:
        """Stable label, e.g. ``h7168-t128-extras``."""
        return f"h{self.hidden}-t{self.tokens}-{'extras' if self.extras else 'hidden'}"


def default_cases() -> list[Case]:
    """The default sweep: 1..8192 tokens at hidden 7168, three sizes at 2048 and 4096; with and without extras."""
    sizes = [(7168, DEFAULT_TOKENS), (2048, (1, 128, 2048)), (4096, (1, 128, 2048))]
    return [Case(h, t, e) for h, tokens in sizes for t in tokens for e in (True, False)]


def quick_cases() -> list[Case]:
    """``--quick`` on GPUs: 1, 128 and 8192 tokens at hidden 7168 with extras."""
    return [Case(7168, t, True) for t in (1, 128, 8192)]


def gloo_cases() -> list[Case]:
    """The CPU/gloo smoke sweep: tiny sizes (hidden 64, 16 experts)."""
    return [Case(64, t, e, logits_width=16) for t in (1, 5) for e in (True, False)]


def check_cases(cuda: bool) -> list[Case]:
    """Sizes for ``--check``: odd row counts and a multi-MB message, with and without extras."""
    if not cuda:
        return [Case(128, t, e, logits_width=8) for t in (1, 7) for e in (True, False)]  # 128: FP8's group
    return [Case(7168, t, e) for t in (1, 127, 1000) for e in (True, False)] + [Case(2048, 3, True)]


def parse_int_list(text: str, what: str, *, least: int = 1) -> tuple[int, ...]:
    """Parse ``"1,8,32"`` into ints of at least ``least`` (1: sizes; 0: GPU indices).

    Raises:
        AFDConfigError: an entry is not an integer of at least ``least`` (names ``what``).
    """
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise AFDConfigError(f"{what}: {text!r} is not a comma list of integers (e.g. 1,8,128)") from None
    if not out or min(out) < least:
        kind = "positive integers" if least == 1 else f"integers >= {least}"
        raise AFDConfigError(f"{what}: expected {kind}, got {text!r}")
    return tuple(out)


def parse_names(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    """Parse ``"a,b"`` into names out of ``allowed``.

    Raises:
        AFDConfigError: an unknown name, or none (names ``what``).
    """
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise AFDConfigError(f"{what}: {bad or 'empty'} not in {', '.join(allowed)}")
    return items


def make_layout(num_attention_ranks: int, num_ffn_ranks: int, num_gpus: int,
                gpu_map: Sequence[int] | None = None) -> GpuPlacement:
    """Assign GPUs to processes (:func:`afd_ext.tools.testing.place_processes` decides; no GPU: arrangement ``cpu``).

    With enough GPUs every process gets its own: attention ranks on the first
    GPUs, FFN ranks on the next (1A1F: attention on GPU 0, FFN on GPU 1).
    With too few but at least two, the FFN ranks take the last GPUs and the
    attention ranks share the remaining ones round-robin (2A1F on two GPUs:
    both attention ranks on GPU 0). On one GPU (or with
    ``AFD_TEST_SHARE_GPU=1``) every process shares GPU 0 and gets its own
    ``NCCL_HOSTID`` (NCCL over sockets). The last two are marked shared.

    Args:
        num_attention_ranks, num_ffn_ranks: ``A``, ``F`` >= 1.
        num_gpus: GPUs visible to this process (0: the CPU/gloo path).
        gpu_map: optional explicit GPU index per process, attention ranks
            first then FFN ranks (indices into the visible GPUs).

    Raises:
        AFDConfigError: a bad size, or a ``gpu_map`` of the wrong length or with
            an index not below ``num_gpus``.
    """
    A, F = num_attention_ranks, num_ffn_ranks
    if A < 1 or F < 1:
        raise AFDConfigError(f"need at least one attention and one FFN rank, got A={A}, F={F}")
    if num_gpus <= 0:
        if gpu_map:
            raise AFDConfigError("--gpu-map given but no GPU is visible")
        return GpuPlacement(A, F, (), "cpu")
    return place_processes(A, F, num_gpus, gpu_map=gpu_map)


@dataclass(frozen=True)
class Reps:
    """Repetition policy: how many timed iterations for a message of a given size.

    The count aims at ``target_s`` seconds of timed work per measurement,
    estimated from a simple model (``base_us`` plus bytes at ``model_gbps``),
    clamped to ``[min_iters, max_iters]``; both processes compute it from the
    same inputs, so they agree without talking.

    Attributes:
        target_s: timed seconds per (variant, mode) measurement.
        min_iters, max_iters: clamp of the sample count.
        warmup: untimed iterations (eager) or replays (graph) before each block.
        rounds: each measurement is split into this many blocks, and the
            variants are alternated block by block (drift hits all alike).
        graph_iters: iterations captured per graph (reduced for big messages
            so one replay stays near 2 ms).
    """

    target_s: float = 0.05
    min_iters: int = 20
    max_iters: int = 400
    warmup: int = 3
    rounds: int = 2
    graph_iters: int = 10
    base_us: float = 30.0
    model_gbps: float = 250.0

    def estimate_us(self, nbytes: int, eager: bool) -> float:
        """Model time of one iteration moving ``nbytes`` in total, µs."""
        return self.base_us + (40.0 if eager else 0.0) + nbytes / (self.model_gbps * 1e3)

    def iters(self, nbytes: int, eager: bool) -> int:
        """Timed samples per measurement (all rounds together)."""
        est = self.estimate_us(nbytes, eager)
        n = int(self.target_s * 1e6 / est)
        return max(self.min_iters, min(self.max_iters, n))

    def per_round(self, nbytes: int, eager: bool) -> int:
        """Timed samples per round (>= 2)."""
        return max(2, self.iters(nbytes, eager) // max(1, self.rounds))

    def graph_k(self, nbytes: int) -> int:
        """Iterations per captured graph."""
        est = self.estimate_us(nbytes, eager=False)
        return max(2, min(self.graph_iters, int(2000.0 / est)))

    def graph_replays_per_round(self, nbytes: int) -> int:
        """Timed replays per round (>= 3)."""
        k = self.graph_k(nbytes)
        return max(3, self.iters(nbytes, eager=False) // (k * max(1, self.rounds)))


@dataclass
class RunConfig:
    """Everything a worker needs (picklable)."""

    backend: str                     # "nccl" or "gloo"
    layout: GpuPlacement
    cases: list[Case]
    variants: tuple[str, ...]
    modes: tuple[str, ...]
    reps: Reps
    master_port: int
    check: bool = False
    progress: bool = True
    #: The FP8 variants' scales (``--fp8-scale-format``; docs/fp8.md).
    fp8_scale_format: str = "fp32"
    #: Deadline of every wait on the device or a peer within a case, seconds.
    case_timeout_s: float = 60.0

    @property
    def peer_wait_s(self) -> float:
        """Deadline of waits on peers (store, gloo barrier): past a stuck peer's own deadline, so it names itself."""
        return self.case_timeout_s + 10.0
