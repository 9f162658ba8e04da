"""Typed wrappers over the ``torch.ops.afd_ext.*`` operators, and their fakes.

Importing this module loads the compiled core (``afd_ext._C``), which
registers every schema (see ``csrc/bindings.cpp``). Each wrapper below is
followed by exactly one ``torch.library.register_fake``, so the ops trace
under ``torch.compile``/FakeTensorMode and run on ``meta`` tensors.

Conventions shared by every communication op:

* Outputs are caller-owned tensors that the op mutates; ops return ``None``
  (``()`` in the schema). Every tensor a communication op touches is declared
  mutated, so ``torch.compile`` can neither drop nor reorder the calls.
* Communicators are ``int`` handles into a C++ table (``comm_create``).
* Tensors must be CUDA tensors on the communicator's device, with dense rows
  (``t.is_contiguous()``; row slices ``t[a:b]`` of a contiguous tensor are
  fine), of a wire dtype (:data:`WIRE_DTYPES`). Every check happens before
  the first NCCL call; a failed check raises ``RuntimeError`` naming the
  tensor, and the communicator stays usable.
* Work is enqueued on the current CUDA stream of the communicator's device,
  with no allocation and no host synchronisation, so the ops can be captured
  in a CUDA graph (after one eager warm-up of every edge and direction).
* Peers with zero rows are skipped on both sides (no zero-byte NCCL call).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Optional, Sequence

import torch
from torch import Tensor


def _other_loaded_core() -> str | None:
    """Path of another copy of the compiled core already loaded into this process, or None.

    A second ``TORCH_LIBRARY(afd_ext, ...)`` aborts the process while it loads
    (two installed versions, a vendored copy), so look before loading ours.
    """
    import os

    spec = importlib.util.find_spec(f"{__package__}._C")
    mine = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
    if f"{__package__}._C" in sys.modules or not _schema_registered():
        return None
    loaded = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if name.endswith("._C") and name.split(".")[-2] == "afd_ext" and f:
            loaded.append(os.path.realpath(f))
    try:  # also a copy loaded without Python's import system: the process's mapped files
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if "/afd_ext/_C" in path and path.endswith(".so"):
                    loaded.append(os.path.realpath(path))
    except OSError:
        pass
    others = [p for p in loaded if p != mine]
    if others:
        return others[0]
    return None if mine in loaded else "an unknown location"


def _schema_registered() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw("afd_ext::nccl_version", "")
        return True
    except RuntimeError:
        return False


_other = _other_loaded_core()
if _other is not None:
    from .errors import ExtensionConflictError

    _spec = importlib.util.find_spec(f"{__package__}._C")
    raise ExtensionConflictError(
        f"cannot load {_spec.origin if _spec else __package__ + '._C'}: another copy of the afd_ext compiled "
        f"core is already loaded in this process ({_other}); torch allows one per process. Two afd_ext "
        "installations (or a vendored copy) are on the path: keep one, or import only one of them.")

from . import _C  # noqa: F401,E402  (loads the library: registers torch.ops.afd_ext.*)

__all__ = [
    "WIRE_ALIGN",
    "WIRE_DTYPES",
    "NCCL_UNIQUE_ID_BYTES",
    "build_info",
    "is_cuda_built",
    "wire_row_bytes",
    "nccl_version",
    "nccl_unique_id",
    "comm_create",
    "comm_destroy",
    "comm_abort",
    "comm_async_error",
    "send",
    "recv",
    "fan_in",
    "split_back",
    "exchange",
    "pack_rows",
    "unpack_rows",
]

_ops = torch.ops.afd_ext
_NCCL_RUNTIME_VERSION = int(_ops.nccl_version())

#: Byte alignment of every part of a packed wire row.
WIRE_ALIGN = 16
#: Bytes of an ``ncclUniqueId``.
NCCL_UNIQUE_ID_BYTES = 128
#: Dtypes the ops move (NCCL moves them as bytes; fp8 included).
WIRE_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int32,
    torch.int64,
    torch.uint8,
)


def is_cuda_built() -> bool:
    """True when the compiled core has the CUDA kernels and the NCCL ops."""
    return bool(_C.CUDA_BUILT)


def build_info() -> dict:
    """Facts about the compiled core, for logs and bug reports.

    Returns:
        ``{"cuda": bool, "nccl_compiled": int | None, "nccl_runtime": int | None,
        "torch": str, "arch_list": str}``. ``nccl_compiled`` is the
        ``NCCL_VERSION_CODE`` of the headers compiled against (e.g. ``22809``),
        ``nccl_runtime`` what ``ncclGetVersion()`` reports for the loaded
        ``libnccl.so.2``; both ``None`` in a CPU-only build. ``arch_list`` is
        the ``TORCH_CUDA_ARCH_LIST`` of the build (``""`` without CUDA).
    """
    cuda = is_cuda_built()
    return {
        "cuda": cuda,
        "nccl_compiled": int(_C.NCCL_VERSION_CODE) if cuda else None,
        "nccl_runtime": int(_ops.nccl_version()) if cuda else None,
        "torch": torch.__version__,
        "arch_list": str(_C.ARCH_LIST).replace(";", " "),
    }


def _round16(n: int) -> int:
    return (n + WIRE_ALIGN - 1) // WIRE_ALIGN * WIRE_ALIGN


def wire_row_bytes(
    hidden_size: int,
    hidden_dtype: torch.dtype,
    logits_width: Optional[int] = None,
    logits_dtype: torch.dtype = torch.float32,
    has_token_ids: bool = False,
) -> int:
    """Bytes of one packed wire row (see :func:`pack_rows`).

    Layout per token: ``[hidden | pad to 16][logits | pad to 16][int32 id | pad to 16]``;
    absent parts take no bytes.

    Args:
        hidden_size: hidden-state width (elements).
        hidden_dtype: dtype of the hidden states.
        logits_width: router-logits width (number of experts); ``None`` or 0: no logits.
        logits_dtype: dtype of the router logits.
        has_token_ids: whether an int32 token id travels with each row.

    Returns:
        The row size in bytes, a multiple of 16.

    Raises:
        ValueError: a negative width.
    """
    if hidden_size < 0 or (logits_width is not None and logits_width < 0):
        raise ValueError(f"widths must be >= 0, got hidden_size={hidden_size}, logits_width={logits_width}")
    n = _round16(hidden_size * hidden_dtype.itemsize)
    if logits_width:
        n += _round16(logits_width * logits_dtype.itemsize)
    if has_token_ids:
        n += _round16(4)
    return n


# ---------------------------------------------------------------------------
# Fake-side checks: the same rules as the C++ checks, on shapes only, so a
# traced program fails at compile time. SymInts are left to the C++ side.
# ---------------------------------------------------------------------------


def _concrete(xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def _fake_check_rows(op: str, named: Sequence[tuple[str, Optional[Tensor]]], lists: dict) -> None:
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) > 1:
        raise RuntimeError(f"afd_ext.{op}: {', '.join(lengths)} must have equal lengths, got {lengths}")
    rows = lists["rows"]
    if not _concrete(rows):
        return
    total = sum(rows)
    for name, t in named:
        if t is None:
            continue
        if t.dim() < 1:
            raise RuntimeError(f"afd_ext.{op}: {name} must have a row dimension, got shape {tuple(t.shape)}")
        if isinstance(t.shape[0], int) and t.shape[0] != total:
            raise RuntimeError(
                f"afd_ext.{op}: {name} has {t.shape[0]} rows but rows={list(rows)} add up to {total}"
            )


# ---------------------------------------------------------------------------
# Communicator table
# ---------------------------------------------------------------------------


def nccl_version() -> int:
    """``ncclGetVersion()`` of the loaded NCCL (e.g. ``22809`` for 2.28.9); 0 in a CPU-only build."""
    return int(_ops.nccl_version())


@torch.library.register_fake("afd_ext::nccl_version")
def _nccl_version_fake() -> int:
    # A process constant: the traced value is the one a real call returns.
    return _NCCL_RUNTIME_VERSION


def _not_traceable(op: str):
    raise RuntimeError(
        f"afd_ext.{op} is a host-side communicator call and cannot be traced "
        "(torch.compile would drop or misplace it); call it outside compiled code "
        "and pass the int handle into the compiled function"
    )


def nccl_unique_id(out: Optional[Tensor] = None) -> Tensor:
    """Make a fresh NCCL unique id (rank 0 of a communicator makes it, the others receive it).

    Args:
        out: optional CPU ``uint8`` tensor ``[128]`` (contiguous), mutated.

    Returns:
        ``out`` (allocated if not given), holding the id's 128 bytes.

    Raises:
        RuntimeError: ``out`` has the wrong shape/dtype/device; NCCL failed; CPU-only build.
    """
    if out is None:
        out = torch.empty(NCCL_UNIQUE_ID_BYTES, dtype=torch.uint8)
    _ops.nccl_unique_id(out)
    return out


@torch.library.register_fake("afd_ext::nccl_unique_id")
def _nccl_unique_id_fake(out: Tensor) -> None:
    if tuple(out.shape) != (NCCL_UNIQUE_ID_BYTES,) or out.dtype != torch.uint8:
        raise RuntimeError(f"afd_ext.nccl_unique_id: out must be uint8 [128], got {out.dtype} {tuple(out.shape)}")


def comm_create(unique_id: Tensor, world_size: int, rank: int, device: int | torch.device) -> int:
    """Create an NCCL communicator and return its handle.

    Blocks until all ``world_size`` ranks have called it with the same
    ``unique_id`` (NCCL's own rendezvous): make every rank reach this call
    (e.g. after a store exchange with a deadline). The compile-time and
    run-time NCCL versions are compared first: a different major version
    raises, an older run-time minor version warns.

    A 2-rank communicator (one per edge, as the connector uses) is connected
    both ways before this returns: one 1-byte send and receive with the other
    rank in one group, the same on both ranks. NCCL connects point-to-point
    channels lazily and, for two ranks, assumes the peer's first group opened
    the mirror-image directions (NVIDIA/nccl PR #2407); without this, a first
    ``exchange`` on one side against a ``fan_in`` on the other crashed the
    receiver. Any later grouping is then safe. The connect is bounded
    (120 s, then the communicator is aborted and ``RuntimeError`` raised).

    Args:
        unique_id: CPU ``uint8`` ``[128]`` from :func:`nccl_unique_id` (the same bytes on every rank).
        world_size: ranks in the communicator, >= 1.
        rank: this process's rank in it, ``0 <= rank < world_size``.
        device: CUDA device index (or ``torch.device("cuda", i)``) the communicator works on.

    Returns:
        An ``int`` handle >= 1, valid until :func:`comm_destroy` / :func:`comm_abort`.

    Raises:
        RuntimeError: bad arguments, NCCL version mismatch, NCCL init failure, CPU-only build.
    """
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        device = torch.cuda.current_device() if device.index is None else device.index
    return int(_ops.comm_create(unique_id, int(world_size), int(rank), int(device)))


@torch.library.register_fake("afd_ext::comm_create")
def _comm_create_fake(unique_id: Tensor, world_size: int, rank: int, device: int) -> int:
    _not_traceable("comm_create")


def comm_destroy(handle: int) -> None:
    """Destroy a communicator: waits for its queued work, then frees it.

    Idempotent for every handle this process was issued (destroying twice,
    or after :func:`comm_abort`, is a no-op). Use :func:`comm_abort` instead
    when a peer may be dead (destroy would wait for it).

    Raises:
        RuntimeError: ``handle`` was never issued; NCCL failed.
    """
    _ops.comm_destroy(int(handle))


@torch.library.register_fake("afd_ext::comm_destroy")
def _comm_destroy_fake(handle: int) -> None:
    _not_traceable("comm_destroy")


def comm_abort(handle: int) -> None:
    """Abort a communicator: cancels its in-flight NCCL work and frees it, without waiting for peers.

    Idempotent for every handle this process was issued. Safe to call from a
    watchdog thread while another thread is blocked in NCCL work of that
    communicator.

    Raises:
        RuntimeError: ``handle`` was never issued.
    """
    _ops.comm_abort(int(handle))


@torch.library.register_fake("afd_ext::comm_abort")
def _comm_abort_fake(handle: int) -> None:
    _not_traceable("comm_abort")


def comm_async_error(handle: int) -> int:
    """``ncclCommGetAsyncError`` of a live communicator.

    Returns:
        The ``ncclResult_t`` code: 0 ok, 7 (``ncclInProgress``) in progress,
        anything else is an error (the communicator should be aborted).

    Raises:
        RuntimeError: the handle is not live (never issued, destroyed or aborted).
    """
    return int(_ops.comm_async_error(int(handle)))


@torch.library.register_fake("afd_ext::comm_async_error")
def _comm_async_error_fake(handle: int) -> int:
    _not_traceable("comm_async_error")


# ---------------------------------------------------------------------------
# Point-to-point
# ---------------------------------------------------------------------------


def send(t: Tensor, comm: int, peer: int) -> None:
    """Send all of ``t`` to ``peer`` on communicator ``comm``, on the current CUDA stream.

    Args:
        t: any shape, a wire dtype, contiguous, CUDA on the communicator's device.
            Declared mutated (so compiled code keeps the call); its data is only read.
        comm: communicator handle.
        peer: the receiver's rank in ``comm`` (not this rank).

    A zero-element ``t`` is not sent (the receiver's matching ``recv`` of a
    zero-element tensor is skipped too). The receiver must post a ``recv`` of
    the same number of bytes.

    Raises:
        RuntimeError: bad tensor/handle/peer (before anything is sent); NCCL error.
    """
    _ops.send(t, int(comm), int(peer))


@torch.library.register_fake("afd_ext::send")
def _send_fake(t: Tensor, comm: int, peer: int) -> None:
    return None


def recv(t: Tensor, comm: int, peer: int) -> None:
    """Receive into all of ``t`` from ``peer`` on communicator ``comm``, on the current CUDA stream.

    Args:
        t: caller-sized output (mutated), a wire dtype, contiguous, CUDA on the communicator's device.
        comm: communicator handle.
        peer: the sender's rank in ``comm``.

    Raises:
        RuntimeError: bad tensor/handle/peer (before anything is received); NCCL error.
    """
    _ops.recv(t, int(comm), int(peer))


@torch.library.register_fake("afd_ext::recv")
def _recv_fake(t: Tensor, comm: int, peer: int) -> None:
    return None


def _ints(xs: Sequence[int]) -> list[int]:
    return [int(x) for x in xs]


def fan_in(
    hidden_states: Tensor,
    router_logits: Optional[Tensor],
    token_ids: Optional[Tensor],
    comms: Sequence[int],
    peers: Sequence[int],
    rows: Sequence[int],
) -> None:
    """FFN side: receive every peer's rows, in one NCCL group, into consecutive row ranges.

    Peer ``i`` (rank ``peers[i]`` on communicator ``comms[i]``) fills rows
    ``[sum(rows[:i]), sum(rows[:i+1]))`` of every given tensor, so the
    concatenation costs no copy and all peers are in flight at once. Peers
    with ``rows[i] == 0`` are skipped.

    Args:
        hidden_states: ``[sum(rows), hidden]`` output (mutated), e.g. bf16.
        router_logits: optional ``[sum(rows), num_experts]`` output (mutated), e.g. fp32.
        token_ids: optional ``[sum(rows)]`` output (mutated), int32.
        comms: communicator handle per peer (one communicator per edge), all on one device.
        peers: the peer's rank in its communicator.
        rows: rows per peer, >= 0.

    All tensors: CUDA on the communicators' device, contiguous rows, a wire dtype.

    Raises:
        RuntimeError: lengths differ, a row count does not add up, a tensor on the
            wrong device/dtype/layout, a peer out of range, a dead handle (all before
            any NCCL call); NCCL error.
    """
    _ops.fan_in(hidden_states, router_logits, token_ids, _ints(comms), _ints(peers), _ints(rows))


@torch.library.register_fake("afd_ext::fan_in")
def _fan_in_fake(hidden_states, router_logits, token_ids, comms, peers, rows) -> None:
    _fake_check_rows(
        "fan_in",
        [("hidden_states", hidden_states), ("router_logits", router_logits), ("token_ids", token_ids)],
        {"comms": comms, "peers": peers, "rows": rows},
    )


def split_back(
    hidden_states: Tensor,
    router_logits: Optional[Tensor],
    token_ids: Optional[Tensor],
    comms: Sequence[int],
    peers: Sequence[int],
    rows: Sequence[int],
) -> None:
    """Send each peer its consecutive row range of every given tensor, in one NCCL group.

    The FFN side returns each attention rank exactly its rows; the attention
    side uses it to send its rows (one peer when A >= F, several when A < F).
    Peers with ``rows[i] == 0`` are skipped. Arguments as in :func:`fan_in`;
    the tensors are only read (declared mutated so compiled code keeps the call).

    Raises:
        RuntimeError: as :func:`fan_in`.
    """
    _ops.split_back(hidden_states, router_logits, token_ids, _ints(comms), _ints(peers), _ints(rows))


@torch.library.register_fake("afd_ext::split_back")
def _split_back_fake(hidden_states, router_logits, token_ids, comms, peers, rows) -> None:
    _fake_check_rows(
        "split_back",
        [("hidden_states", hidden_states), ("router_logits", router_logits), ("token_ids", token_ids)],
        {"comms": comms, "peers": peers, "rows": rows},
    )


def exchange(
    hidden_states: Tensor,
    router_logits: Optional[Tensor],
    token_ids: Optional[Tensor],
    reply: Tensor,
    send_comms: Sequence[int],
    recv_comms: Sequence[int],
    peers: Sequence[int],
    rows: Sequence[int],
) -> None:
    """Attention side's half of a layer exchange.

    Sends ``rows[i]`` consecutive rows of each wire tensor to ``peers[i]`` on
    ``send_comms[i]`` (as :func:`split_back`) and receives the same rows of
    ``reply`` from ``peers[i]`` on ``recv_comms[i]`` (as :func:`fan_in`).
    ``peers[i]`` is the FFN rank's rank in both communicators (they may be
    the same communicator). Usable inside a CUDA graph.

    The sends are one NCCL group and the reply receive a second one on the
    same stream (two launches, one op call): inside one group NCCL pairs the
    k-th send and receive of a peer, so a reply receive grouped with several
    sends waited beside the first send while the FFN rank still waited for the
    later ones (a hang seen on 2x H200 with NCCL 2.28.9).

    Args:
        hidden_states: ``[sum(rows), hidden]`` to send.
        router_logits: optional ``[sum(rows), num_experts]`` to send.
        token_ids: optional ``[sum(rows)]`` int32 to send.
        reply: ``[sum(rows), hidden]`` output (mutated), the FFN output.
        send_comms, recv_comms, peers, rows: one entry per FFN peer.

    Raises:
        RuntimeError: as :func:`fan_in`.
    """
    _ops.exchange(
        hidden_states, router_logits, token_ids, reply,
        _ints(send_comms), _ints(recv_comms), _ints(peers), _ints(rows),
    )


@torch.library.register_fake("afd_ext::exchange")
def _exchange_fake(hidden_states, router_logits, token_ids, reply, send_comms, recv_comms, peers, rows) -> None:
    _fake_check_rows(
        "exchange",
        [("hidden_states", hidden_states), ("router_logits", router_logits), ("token_ids", token_ids),
         ("reply", reply)],
        {"send_comms": send_comms, "recv_comms": recv_comms, "peers": peers, "rows": rows},
    )


# ---------------------------------------------------------------------------
# Packed wire rows
# ---------------------------------------------------------------------------


def _expected_wire_shape(hidden_states, router_logits, token_ids) -> tuple:
    width = wire_row_bytes(
        hidden_states.shape[1],
        hidden_states.dtype,
        router_logits.shape[1] if router_logits is not None else None,
        router_logits.dtype if router_logits is not None else torch.float32,
        token_ids is not None,
    )
    return (hidden_states.shape[0], width)


def _fake_check_wire(op, hidden_states, router_logits, token_ids, wire) -> None:
    for name, t in (("hidden_states", hidden_states), ("router_logits", router_logits), ("token_ids", token_ids)):
        if t is not None and t.device != wire.device:
            raise RuntimeError(f"afd_ext.{op}: {name} must be on the wire tensor's device {wire.device}, got {t.device}")
    if hidden_states.dim() != 2:
        raise RuntimeError(f"afd_ext.{op}: hidden_states must be 2-D [num_tokens, hidden], got {tuple(hidden_states.shape)}")
    if router_logits is not None and router_logits.dim() != 2:
        raise RuntimeError(f"afd_ext.{op}: router_logits must be 2-D [num_tokens, num_experts], got {tuple(router_logits.shape)}")
    if token_ids is not None and token_ids.dtype != torch.int32:
        raise RuntimeError(f"afd_ext.{op}: token_ids must be int32, got {token_ids.dtype}")
    if wire.dtype != torch.uint8 or wire.dim() != 2:
        raise RuntimeError(f"afd_ext.{op}: wire must be uint8 [num_tokens, row_bytes], got {wire.dtype} {tuple(wire.shape)}")
    expected = _expected_wire_shape(hidden_states, router_logits, token_ids)
    if tuple(wire.shape) != expected:
        raise RuntimeError(f"afd_ext.{op}: wire must have shape {expected}, got {tuple(wire.shape)}")


def pack_rows(
    hidden_states: Tensor,
    router_logits: Optional[Tensor],
    token_ids: Optional[Tensor],
    wire: Tensor,
) -> None:
    """Pack each token's wire tensors into one uint8 wire row (fused; one kernel launch).

    Row ``i`` of ``wire`` becomes ``[hidden_states[i] | pad][router_logits[i] | pad][token_ids[i] | pad]``,
    each part starting at a 16-byte offset; padding bytes are written as zeros.

    Args:
        hidden_states: ``[n, hidden]``, a wire dtype; any strides (non-contiguous rows allowed).
        router_logits: optional ``[n, num_experts]``, a wire dtype; any strides.
        token_ids: optional ``[n]`` int32; any stride.
        wire: ``[n, wire_row_bytes(...)]`` uint8 output (mutated), dense rows
            (``wire.stride(1) == 1``); row slices of a bigger buffer are fine.

    All tensors on one device (CPU reference kernel, or the CUDA kernel on the
    current stream, 16-byte vectorised where aligned).

    Raises:
        RuntimeError: a shape, dtype, device or row-size mismatch, naming the tensor.
    """
    _ops.pack_rows(hidden_states, router_logits, token_ids, wire)


@torch.library.register_fake("afd_ext::pack_rows")
def _pack_rows_fake(hidden_states, router_logits, token_ids, wire) -> None:
    _fake_check_wire("pack_rows", hidden_states, router_logits, token_ids, wire)


def unpack_rows(
    wire: Tensor,
    hidden_states: Tensor,
    router_logits: Optional[Tensor],
    token_ids: Optional[Tensor],
) -> None:
    """Inverse of :func:`pack_rows`: scatter each wire row into the given outputs.

    Args:
        wire: ``[n, wire_row_bytes(...)]`` uint8, dense rows.
        hidden_states: ``[n, hidden]`` output (mutated); any non-overlapping strides.
        router_logits: optional ``[n, num_experts]`` output (mutated).
        token_ids: optional ``[n]`` int32 output (mutated).

    Raises:
        RuntimeError: as :func:`pack_rows`, or an output with overlapping memory.
    """
    _ops.unpack_rows(wire, hidden_states, router_logits, token_ids)


@torch.library.register_fake("afd_ext::unpack_rows")
def _unpack_rows_fake(wire, hidden_states, router_logits, token_ids) -> None:
    _fake_check_wire("unpack_rows", hidden_states, router_logits, token_ids, wire)


# ---------------------------------------------------------------------------
# Keeping the communication ops in program order under Inductor.
#
# The declared mutations keep every call (nothing is dead code) and order the
# calls that touch the same tensor, but two calls on different tensors (e.g.
# stage 0's split_back and stage 1's fan_in) are independent to Inductor's
# scheduler, and its reorder_for_peak_memory pass did reorder them (measured
# with torch 2.14.1). Reordered NCCL calls can deadlock against the peer's
# order, so each comm op gets an Inductor lowering that is torch's own
# fallback plus a scheduler dependency (StarDep) on the previous side-effecting
# op, the same chain torch builds for ordered effectful ops (with_effects).
# torch._inductor.lowering costs ~3 s to import, so the lowerings are
# registered when Inductor itself is imported (an import hook), not here.
# ---------------------------------------------------------------------------

_COMM_OPS = ("send", "recv", "fan_in", "split_back", "exchange")
_ordering_registered = False

# A comm op on a temporary that nothing reads afterwards (``send(h * 3, ...)``)
# becomes an auto_functionalized node with unused outputs; FX dead-code
# elimination keeps such a node only when its op is registered as side-effectful.
for _name in _COMM_OPS:
    torch.fx.node.has_side_effect(getattr(_ops, _name).default)


def _register_inductor_ordering() -> bool:
    """Register the ordered lowerings; True when done (idempotent)."""
    global _ordering_registered
    if _ordering_registered:
        return True
    try:
        from torch._inductor import lowering as L
        from torch._inductor.virtualized import V

    except Exception as e:  # pragma: no cover - depends on the torch version
        warnings.warn(f"afd_ext: cannot order communication ops under Inductor ({e!r})")
        return False
    key = "afd_ext.comm_order"  # our own chain in graph.effectful_ops

    def order_deps(prev) -> list:
        # The previous comm op returns nothing; the buffers that carry it in
        # the scheduler are its mutation outputs.
        names = [m.get_name() for m in getattr(prev, "mutation_outputs", ()) or ()]
        return names or [prev.get_name()]

    def ordered(op):
        fallback = L.fallback_handler(op)

        def lower(*args, **kwargs):
            graph = V.graph
            n0 = len(graph.operations)
            result = fallback(*args, **kwargs)
            try:
                new_ops = graph.operations[n0:]
                prev = graph.effectful_ops.get(key)
                for node in new_ops:
                    node.has_side_effects = lambda: True  # never eliminated
                    if prev is not None and prev is not node:
                        graph.additional_star_deps[node.get_operation_name()].update(order_deps(prev))
                if new_ops:
                    graph.effectful_ops[key] = new_ops[-1]
            except AttributeError as e:  # pragma: no cover - Inductor internals of another torch
                warnings.warn(f"afd_ext: cannot order {op} under Inductor on torch {torch.__version__} ({e!r})")
            return result

        return lower

    for name in _COMM_OPS:
        op = getattr(_ops, name).default
        L.register_lowering(op, type_promotion_kind=None)(ordered(op))
    _ordering_registered = True
    return True


class _InductorImportHook(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_inductor_ordering` right after ``torch._inductor.lowering`` loads."""

    target = "torch._inductor.lowering"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_inductor_ordering()

        spec.loader.exec_module = exec_then_register
        return spec


if _InductorImportHook.target in sys.modules:
    _register_inductor_ordering()
elif not any(isinstance(f, _InductorImportHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _InductorImportHook())
