"""Who exchanges rows with whom: edges for any ``A`` attention and ``F`` FFN ranks.

Pure Python, no torch. Both roles build the same :class:`Topology` from
``(A, F, tp_size)`` and derive everything from it, never from their tensors.

AFD world order is FFN first, as in the reference: world rank = role rank for
an FFN rank, ``F + role_rank`` for an attention rank.

Data-plane edges:

* ``A >= F``: FFN rank ``k`` owns the contiguous block of attention ranks
  ``range(ceil(k*A/F), ceil((k+1)*A/F))``; block sizes differ by at most one,
  and the blocks are exactly the reference's when ``A % F == 0`` (and its
  relaxed blocks of PR #309 otherwise). Attention rank ``a`` has one FFN peer,
  ``floor(a*F/A)``. The FFN rank receives its peers in attention role-rank
  order (fan-in order) and concatenates their rows.
* ``A < F`` (the reference refuses it): attention rank ``a`` owns the
  contiguous block of FFN ranks ``range(ceil(a*F/A), ceil((a+1)*F/A))`` and
  splits its rows evenly over them in contiguous ranges (:meth:`Topology.split_rows`;
  the first FFN ranks get the remainder). Each FFN rank has one attention peer.

Control plane (the reference's exact pairing, kept for drop-in
compatibility): with ``m = min(A, F)``, attention role rank ``d < m`` sends the
step's payload to FFN ranks ``d, d+m, d+2m, ...``; other attention ranks send
nothing. Every FFN rank therefore receives exactly one payload per step, from
attention rank ``f % m``, and the payload holds the whole count vector, so
each FFN rank learns every peer's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import AFDConfigError

ATTENTION = "attention"
FFN = "ffn"
ROLES = (ATTENTION, FFN)


def step_words(n: int) -> str:
    """How every message names a step: ``"step N"`` (N >= 1: the caller's N-th step since init),
    ``"warm-up step"`` (0: the connector's own warm-up, not counted), ``"no step"`` (< 0: none yet)."""
    if n < 0:
        return "no step"
    return "warm-up step" if n == 0 else f"step {n}"


def rank_label(world_rank: int, num_ffn_ranks: int | None = None) -> str:
    """The one name of an AFD world rank in messages, e.g. ``"attention rank 1 (world rank 3)"``.

    Args:
        world_rank: rank in the AFD world (FFN ranks first).
        num_ffn_ranks: ``F``; when unknown only the world rank is named.
    """
    if num_ffn_ranks is None:
        return f"world rank {world_rank}"
    if world_rank < num_ffn_ranks:
        return f"FFN rank {world_rank} (world rank {world_rank})"
    return f"attention rank {world_rank - num_ffn_ranks} (world rank {world_rank})"


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AFDConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def validate_role_rank(role: str, role_rank: int, num_attention_ranks: int, num_ffn_ranks: int) -> None:
    """Check ``role_rank`` against its role's size, with the reference's messages.

    Raises:
        AFDConfigError: unknown role, negative rank, or rank not below the role's size.
    """
    if role not in ROLES:
        raise AFDConfigError(f"unknown AFD role {role!r}; expected 'attention' or 'ffn'")
    if isinstance(role_rank, bool) or not isinstance(role_rank, int):
        raise AFDConfigError(f"AFD role rank must be an int, got {role_rank!r}")
    if role_rank < 0:
        raise AFDConfigError(f"AFD role rank must be non-negative, got {role_rank}")
    if role == ATTENTION and role_rank >= num_attention_ranks:
        raise AFDConfigError(f"Attention role rank must be within attention size {num_attention_ranks}, got {role_rank}")
    if role == FFN and role_rank >= num_ffn_ranks:
        raise AFDConfigError(f"FFN role rank must be within FFN size {num_ffn_ranks}, got {role_rank}")


def _block(k: int, n_owned: int, n_owners: int) -> range:
    """Contiguous block ``k`` of ``n_owned`` items over ``n_owners`` owners (sizes differ by <= 1)."""
    return range((k * n_owned + n_owners - 1) // n_owners, ((k + 1) * n_owned + n_owners - 1) // n_owners)


@dataclass(frozen=True, slots=True)
class Topology:
    """Edges, world order and control routing for ``A`` attention and ``F`` FFN ranks.

    Args:
        num_attention_ranks: ``A >= 1``, attention worker processes (DP x TP).
        num_ffn_ranks: ``F >= 1``.
        tp_size: attention workers per DP rank (TP x PCP), ``A % tp_size == 0``.
            Only used to check per-DP count vectors in :meth:`expand_counts`;
            1 means "not declared" (the reference's rule then applies: any
            vector length that divides ``A``).

    Raises:
        AFDConfigError: a size is not a positive int, or ``A`` is not a multiple
            of ``tp_size``.
    """

    num_attention_ranks: int
    num_ffn_ranks: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        _positive_int(self.num_attention_ranks, "num_attention_ranks")
        _positive_int(self.num_ffn_ranks, "num_ffn_ranks")
        _positive_int(self.tp_size, "tp_size")
        if self.num_attention_ranks % self.tp_size:
            raise AFDConfigError(
                f"num_attention_ranks ({self.num_attention_ranks}) must be a multiple of "
                f"tp_size ({self.tp_size})"
            )

    # -- sizes and world order ------------------------------------------------

    @property
    def A(self) -> int:  # noqa: N802 - the field's notation
        return self.num_attention_ranks

    @property
    def F(self) -> int:  # noqa: N802
        return self.num_ffn_ranks

    @property
    def world_size(self) -> int:
        """``A + F``."""
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def min_size(self) -> int:
        """``min(A, F)``: the number of control senders."""
        return min(self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def dp_size(self) -> int:
        """``A // tp_size``."""
        return self.num_attention_ranks // self.tp_size

    def check_role_rank(self, role: str, role_rank: int) -> None:
        """Raise ``AFDConfigError`` (reference messages) unless ``role_rank`` is valid for ``role``."""
        validate_role_rank(role, role_rank, self.num_attention_ranks, self.num_ffn_ranks)

    def world_rank(self, role: str, role_rank: int) -> int:
        """AFD world rank: ``role_rank`` for FFN, ``F + role_rank`` for attention."""
        self.check_role_rank(role, role_rank)
        return role_rank if role == FFN else self.num_ffn_ranks + role_rank

    def role_of(self, world_rank: int) -> tuple[str, int]:
        """Inverse of :meth:`world_rank`: ``(role, role_rank)``.

        Raises:
            AFDConfigError: ``world_rank`` outside ``0..A+F-1``.
        """
        if isinstance(world_rank, bool) or not isinstance(world_rank, int) or not 0 <= world_rank < self.world_size:
            raise AFDConfigError(f"AFD world rank must be in 0..{self.world_size - 1}, got {world_rank!r}")
        if world_rank < self.num_ffn_ranks:
            return FFN, world_rank
        return ATTENTION, world_rank - self.num_ffn_ranks

    # -- edges -----------------------------------------------------------------

    def ffn_peers(self, f: int) -> tuple[int, ...]:
        """Attention role ranks that FFN rank ``f`` exchanges with, in fan-in order."""
        self.check_role_rank(FFN, f)
        A, F = self.num_attention_ranks, self.num_ffn_ranks
        if A >= F:
            return tuple(_block(f, A, F))
        return (f * A // F,)

    def attention_peers(self, a: int) -> tuple[int, ...]:
        """FFN role ranks that attention rank ``a`` exchanges with (ascending)."""
        self.check_role_rank(ATTENTION, a)
        A, F = self.num_attention_ranks, self.num_ffn_ranks
        if A >= F:
            return (a * F // A,)
        return tuple(_block(a, F, A))

    def edges(self) -> tuple[tuple[int, int], ...]:
        """Every ``(attention rank, FFN rank)`` edge, sorted by attention rank then FFN rank."""
        return tuple((a, f) for a in range(self.num_attention_ranks) for f in self.attention_peers(a))

    def split_rows(self, a: int, n: int) -> tuple[tuple[int, int, int], ...]:
        """How attention rank ``a``'s ``n`` rows go over its FFN peers.

        Args:
            a: attention role rank.
            n: rows of the attention rank (>= 0).

        Returns:
            ``((f, start, count), ...)`` over ``attention_peers(a)`` in order:
            contiguous ranges covering ``[0, n)``; with ``k`` peers each gets
            ``n // k`` rows and the first ``n % k`` one more. A single peer
            (``A >= F``) gets ``(f, 0, n)``. Counts may be zero.

        Raises:
            AFDConfigError: ``a`` out of range or ``n`` negative.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AFDConfigError(f"row count must be an int >= 0, got {n!r}")
        peers = self.attention_peers(a)
        base, rem = divmod(n, len(peers))
        out = []
        start = 0
        for i, f in enumerate(peers):
            c = base + (1 if i < rem else 0)
            out.append((f, start, c))
            start += c
        return tuple(out)

    # -- control plane -----------------------------------------------------------

    def control_destinations(self, a: int) -> tuple[int, ...]:
        """FFN role ranks attention rank ``a`` sends each step's payload to (may be empty)."""
        self.check_role_rank(ATTENTION, a)
        m = self.min_size
        if a >= m:
            return ()
        return tuple(range(a, self.num_ffn_ranks, m))

    def control_source(self, f: int) -> int:
        """The attention role rank FFN rank ``f`` receives each step's payload from."""
        self.check_role_rank(FFN, f)
        return f % self.min_size

    # -- counts -------------------------------------------------------------------

    def expand_counts(
        self, per_dp_counts: Sequence[int], *, clamp_idle_to_one: bool = False
    ) -> tuple[int, ...]:
        """Expand a per-DP count vector to one count per attention rank.

        As the reference: when the vector is shorter than ``A`` and ``A`` is a
        multiple of its length, each DP count is repeated over that DP rank's
        ``A // len`` TP workers (role rank ``a`` gets ``counts[a // tp]``).
        Unlike the reference, zero stays zero; ``clamp_idle_to_one=True`` gives
        the reference's ``max(1, n)`` for runtimes that run a one-token dummy
        batch on idle ranks.

        Args:
            per_dp_counts: counts (ints >= 0), length ``A`` or a divisor of ``A``
                (exactly ``A // tp_size`` when ``tp_size > 1`` was declared).
            clamp_idle_to_one: reference compatibility switch.

        Returns:
            Counts per attention role rank, length ``A``.

        Raises:
            AFDConfigError: empty vector, length that does not divide ``A``, length
                other than ``A`` or ``A // tp_size`` when ``tp_size > 1``, or a
                negative / non-int count.
        """
        counts = list(per_dp_counts)
        A = self.num_attention_ranks
        n = len(counts)
        for i, c in enumerate(counts):
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise AFDConfigError(f"token count [{i}] must be an int >= 0, got {c!r}")
        if n == 0:
            raise AFDConfigError(
                f"count vector is empty; expected {A} counts (one per attention rank)"
                + (f" or {self.dp_size} (one per DP rank)" if self.tp_size > 1 else "")
            )
        if n != A:
            if n > A or A % n:
                raise AFDConfigError(
                    f"count vector has {n} entries; expected {A} (one per attention rank) or a "
                    f"divisor of {A} (one per DP rank, replicated over its TP workers)"
                )
            if self.tp_size > 1 and n != self.dp_size:
                raise AFDConfigError(
                    f"count vector has {n} entries; expected {A} (per attention rank) or "
                    f"{self.dp_size} (per DP rank, tp_size={self.tp_size})"
                )
            tp = A // n
            counts = [counts[i // tp] for i in range(A)]
        if clamp_idle_to_one:
            counts = [max(1, c) for c in counts]
        return tuple(counts)
