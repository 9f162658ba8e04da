"""Typed wrappers over the ``torch.ops.afd_ext.*`` operators, and their fakes.

Importing this module loads the compiled core (``afd_ext._C``), which
registers every schema (see ``csrc/bindings.cpp``). Each wrapper below is
followed by exactly one ``torch.library.register_fake`` (the host-side handle
calls named in ``_HOST_CALLS`` share one refusing fake, registered in a loop),
so the ops trace under ``torch.compile``/FakeTensorMode and run on ``meta`` tensors.

Conventions shared by every communication op:

* Outputs are caller-owned tensors that the op mutates; ops return ``None``
  (``()`` in the schema). Every tensor a communication op touches is declared
  mutated, so ``torch.compile`` can neither drop nor reorder the calls.
* Communicators are ``int`` handles into a C++ table (``comm_create``).
* Tensors must be CUDA tensors on the communicator's device, with dense rows
  (``t.is_contiguous()``; row slices ``t[a:b]`` of a contiguous tensor are
  fine), of a wire dtype (:data:`WIRE_DTYPES`). Every check happens before
  the first NCCL call; a failed check raises :class:`~afd_ext.errors.AFDConfigError`
  (a ``ValueError``; :class:`~afd_ext.errors.AFDTypeError`, also a ``TypeError``,
  for a wrong dtype) naming the tensor, and the communicator stays usable.
  An NCCL failure raises :class:`~afd_ext.errors.AFDPeerError`, a CUDA failure
  :class:`~afd_ext.errors.AFDDeviceError`. Every one is an ``AFDError`` (and a
  ``RuntimeError``), eager or traced.
* Work is enqueued on the current CUDA stream of the communicator's device,
  with no allocation and no host synchronisation, so the ops can be captured
  in a CUDA graph (after one eager warm-up of every edge and direction).
* Peers with zero rows are skipped on both sides (no zero-byte NCCL call).
"""

from __future__ import annotations

import functools
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

    _core = importlib.util.find_spec(f"{__package__}._C")
    raise ExtensionConflictError(
        f"cannot load {_core.origin if _core else __package__ + '._C'}: another copy of the afd_ext compiled "
        f"core is already loaded in this process ({_other}); torch allows one per process. Two afd_ext "
        "installations (or a vendored copy) are on the path: keep one, or import only one of them.")

from . import _C  # noqa: F401,E402  (loads the library: registers torch.ops.afd_ext.*)
from . import spec as _spec  # noqa: E402
from .errors import AFDConfigError, AFDDeviceError, AFDError, AFDPeerError, AFDTypeError  # noqa: E402

__all__ = ["WIRE_DTYPES", "NCCL_UNIQUE_ID_BYTES", "build_info", "is_cuda_built", "nccl_version", "nccl_unique_id",
           "comm_create", "comm_destroy", "comm_abort", "comm_async_error", "send", "recv", "fan_in", "split_back",
           "PEER_IPC_HANDLE_BYTES", "PEER_MAX_PEERS", "PEER_MAX_GENERATION", "PEER_ERR_WORDS", "PEER_OK",
           "PEER_TIMEOUT", "PEER_PROTOCOL", "PEER_ABORTED", "peer_plane_create", "peer_plane_destroy",
           "peer_plane_error", "peer_plane_abort", "peer_region_alloc", "peer_region_export", "peer_region_open",
           "peer_region_close", "peer_region_view", "peer_put", "peer_wait"]

_ops = torch.ops.afd_ext


def op_error(op: str, e: BaseException) -> AFDError:
    """The package error for a failure of ``torch.ops.afd_ext.<op>`` (the ops boundary's one mapping).

    csrc (torch's stable ABI: std exceptions only) raises a caller error as ``ValueError``
    (``AFD_CHECK_VALUE``; a dtype's, ``AFD_CHECK_TYPE``, says ``"TypeError: "`` first), an NCCL
    failure as a ``RuntimeError`` that says ``"DistBackendError: "`` first and a CUDA failure as
    one that says "CUDA error"; any other check of an op names the op (``"afd_ext.<op>: ..."``)
    and is a caller error too. The leading class names are dropped from the message.

    Returns:
        ``e`` itself when it is already an ``AFDError``; else :class:`AFDTypeError`,
        :class:`AFDPeerError`, :class:`AFDDeviceError` or :class:`AFDConfigError`
        with ``e``'s message and ``op="afd_ext.<op>"``.
    """
    if isinstance(e, AFDError):
        return e
    msg = str(e)
    kind, _, rest = msg.partition(": ")
    if kind in ("TypeError", "DistBackendError") and rest.startswith("afd_ext"):
        msg = rest
    if isinstance(e, TypeError) or kind == "TypeError":
        cls = AFDTypeError
    elif isinstance(e, torch.distributed.DistBackendError) or kind == "DistBackendError":
        cls = AFDPeerError
    elif not isinstance(e, (ValueError, IndexError, NotImplementedError)) and "CUDA error" in msg:
        cls = AFDDeviceError
    else:
        cls = AFDConfigError
    if not msg.startswith("afd_ext"):  # a torch or Python message: say which op refused it
        msg = f"afd_ext.{op}: {msg}"
    return cls(msg, op=f"afd_ext.{op}")


def _boundary(fn):
    """Wraps a public op wrapper so that any failure, from the wrapper's own conversions or from the op,
    leaves as :func:`op_error`'s class (``except AFDError`` catches every bad argument of every op)."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced: the fakes raise AFDConfigError themselves
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except AFDError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves as the package's error
            raise op_error(name, e) from None

    return call
_NCCL_RUNTIME_VERSION = int(_ops.nccl_version())
# comm_create refuses another NCCL major; an older minor works but may lack what the build expects.
if 0 < _NCCL_RUNTIME_VERSION // 100 < int(_C.NCCL_VERSION_CODE) // 100:
    warnings.warn(f"afd_ext: compiled against NCCL {_C.NCCL_VERSION_CODE} but the loaded libnccl.so.2 is older "
                  f"({_NCCL_RUNTIME_VERSION}); rebuild afd_ext against the NCCL that torch loads", stacklevel=2)

#: Bytes of an ``ncclUniqueId``.
NCCL_UNIQUE_ID_BYTES = 128
#: Dtypes the ops move (NCCL moves them as bytes; fp8 included): the one table, in spec.py.
WIRE_DTYPES = _spec.WIRE_DTYPES


def is_cuda_built() -> bool:
    """True when the compiled core has the CUDA kernels and the NCCL ops."""
    return bool(_C.CUDA_BUILT)


def build_info() -> dict:
    """Facts about the compiled core (what was built, not what this machine can run), for logs and bug reports.

    Returns:
        ``{"cuda_built": bool, "nccl_compiled": int | None, "nccl_runtime": int | None,
        "torch": str, "torch_cuda": str | None, "arch_list": str}``.
        ``cuda_built`` says the core was compiled with its CUDA kernels and
        NCCL ops; it is true on a machine without a GPU too (whether a GPU is
        visible is ``torch.cuda.device_count()``; ``afd-ext info`` prints
        both). ``nccl_compiled`` is the ``NCCL_VERSION_CODE`` of the headers
        compiled against (e.g. ``22809``), ``nccl_runtime`` what
        ``ncclGetVersion()`` reports for the loaded ``libnccl.so.2``; both
        ``None`` in a CPU-only build. ``torch_cuda`` is the CUDA version of
        the torch build (``None`` for a CPU build of torch). ``arch_list`` is
        the ``TORCH_CUDA_ARCH_LIST`` of the build (``""`` without CUDA).
    """
    cuda = is_cuda_built()
    return {
        "cuda_built": cuda,
        "nccl_compiled": int(_C.NCCL_VERSION_CODE) if cuda else None,
        "nccl_runtime": int(_ops.nccl_version()) if cuda else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "arch_list": str(_C.ARCH_LIST).replace(";", " "),
    }


# ---------------------------------------------------------------------------
# Fake-side checks: the same rules as the C++ checks, on shapes only, so a
# traced program fails at compile time. SymInts are left to the C++ side.
# ---------------------------------------------------------------------------


def _concrete(xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def _fake_check_rows(op: str, tensors: Sequence[Tensor], lists: dict) -> None:
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) > 1:
        raise AFDConfigError(f"afd_ext.{op}: {', '.join(lengths)} must have equal lengths, got {lengths}")
    rows = lists["rows"]
    if not _concrete(rows):
        return
    total = sum(rows)
    for k, t in enumerate(tensors):
        if t.dim() < 1:
            raise AFDConfigError(f"afd_ext.{op}: tensors[{k}] must have a row dimension, got shape {tuple(t.shape)}")
        if isinstance(t.shape[0], int) and t.shape[0] != total:
            raise AFDConfigError(
                f"afd_ext.{op}: tensors[{k}] has {t.shape[0]} rows but rows={list(rows)} add up to {total}"
            )


# ---------------------------------------------------------------------------
# Communicator table
# ---------------------------------------------------------------------------


@_boundary
def nccl_version() -> int:
    """``ncclGetVersion()`` of the loaded NCCL (e.g. ``22809`` for 2.28.9); 0 in a CPU-only build."""
    return int(_ops.nccl_version())


@torch.library.register_fake("afd_ext::nccl_version")
def _nccl_version_fake() -> int:
    # A process constant: the traced value is the one a real call returns.
    return _NCCL_RUNTIME_VERSION


def _not_traceable(op: str, *args, **kwargs):
    raise AFDConfigError(
        f"afd_ext.{op} is a host-side communicator call and cannot be traced "
        "(torch.compile would drop or misplace it); call it outside compiled code "
        "and pass the int handle into the compiled function"
    )


# The host-side handle calls: their fakes refuse tracing, naming the op.
_HOST_CALLS = ("comm_create", "comm_destroy", "comm_abort", "comm_async_error", "peer_plane_create",
               "peer_plane_destroy", "peer_plane_error", "peer_plane_abort", "peer_region_alloc",
               "peer_region_export", "peer_region_open", "peer_region_close", "peer_region_view")
for _op in _HOST_CALLS:
    torch.library.register_fake(f"afd_ext::{_op}")(functools.partial(_not_traceable, _op))


@_boundary
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
        raise AFDConfigError(f"afd_ext.nccl_unique_id: out must be uint8 [128], got {out.dtype} {tuple(out.shape)}")


def _cuda_index(device: int | torch.device) -> int:
    """The CUDA device index the management ops take: an int as is, a ``torch.device("cuda"[, i])``'s index
    (the current device when it has none).

    Raises:
        AFDConfigError: a ``torch.device`` that is not CUDA.
    """
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise AFDConfigError(f"device must be a CUDA device, got {device}")
        return torch.cuda.current_device() if device.index is None else device.index
    return int(device)


@_boundary
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
    grouped send and receive on one side against a ``fan_in`` on the other
    crashed the receiver. Any later grouping is then safe. The connect is bounded
    (120 s, then the communicator is aborted and ``RuntimeError`` raised).

    Args:
        unique_id: CPU ``uint8`` ``[128]`` from :func:`nccl_unique_id` (the same bytes on every rank).
        world_size: ranks in the communicator, >= 1.
        rank: this process's rank in it, ``0 <= rank < world_size``.
        device: CUDA device index (or ``torch.device("cuda", i)``) the communicator works on.

    Returns:
        An ``int`` handle >= 1, valid until :func:`comm_destroy` / :func:`comm_abort`.

    Raises:
        AFDConfigError: ``device`` is a ``torch.device`` that is not CUDA.
        RuntimeError: bad arguments, NCCL version mismatch, NCCL init failure, CPU-only build
            (from the C++ checks).
    """
    return int(_ops.comm_create(unique_id, int(world_size), int(rank), _cuda_index(device)))



@_boundary
def comm_destroy(handle: int) -> None:
    """Destroy a communicator: waits for its queued work, then frees it.

    Idempotent for every handle this process was issued (destroying twice,
    or after :func:`comm_abort`, is a no-op). Use :func:`comm_abort` instead
    when a peer may be dead (destroy would wait for it).

    Raises:
        RuntimeError: ``handle`` was never issued; NCCL failed.
    """
    _ops.comm_destroy(int(handle))



@_boundary
def comm_abort(handle: int) -> None:
    """Abort a communicator: cancels its in-flight NCCL work and frees it, without waiting for peers.

    Idempotent for every handle this process was issued. Meant for a
    watchdog thread while another thread waits on NCCL work already enqueued
    on that communicator (NCCL's ``ncclCommAbort`` contract); an op still
    being enqueued on another thread is not serialised against it.

    Raises:
        RuntimeError: ``handle`` was never issued.
    """
    _ops.comm_abort(int(handle))



@_boundary
def comm_async_error(handle: int) -> int:
    """``ncclCommGetAsyncError`` of a live communicator.

    Returns:
        The ``ncclResult_t`` code: 0 ok, 7 (``ncclInProgress``) in progress,
        anything else is an error (the communicator should be aborted).

    Raises:
        RuntimeError: the handle is not live (never issued, destroyed or aborted).
    """
    return int(_ops.comm_async_error(int(handle)))



# ---------------------------------------------------------------------------
# Point-to-point
# ---------------------------------------------------------------------------


@_boundary
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


@_boundary
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


@_boundary
def fan_in(tensors: Sequence[Tensor], comms: Sequence[int], peers: Sequence[int], rows: Sequence[int]) -> None:
    """FFN side: receive every peer's rows, in one NCCL group, into consecutive row ranges.

    Peer ``i`` (rank ``peers[i]`` on communicator ``comms[i]``) fills rows
    ``[sum(rows[:i]), sum(rows[:i+1]))`` of every tensor, so the
    concatenation costs no copy and all peers are in flight at once. Peers
    with ``rows[i] == 0`` are skipped.

    Args:
        tensors: the wire parts in wire order (:mod:`afd_ext.wire`; e.g. ``[hidden [T, H] bf16,
            router logits [T, E] fp32]``), each ``[sum(rows), ...]`` (mutated); one message per
            tensor and peer, in list order.
        comms: communicator handle per peer (one communicator per edge), all on one device.
        peers: the peer's rank in its communicator.
        rows: rows per peer, >= 0.

    All tensors: CUDA on the communicators' device, contiguous rows, a wire dtype.

    Raises:
        AFDConfigError: lengths differ, a row count does not add up, a tensor on the wrong
            device or not contiguous, a peer out of range, a dead handle (all before any NCCL
            call); AFDTypeError: a tensor not of a wire dtype; AFDPeerError: NCCL failed.
    """
    _ops.fan_in(tensors, _ints(comms), _ints(peers), _ints(rows))


@torch.library.register_fake("afd_ext::fan_in")
def _fan_in_fake(tensors, comms, peers, rows) -> None:
    _fake_check_rows("fan_in", tensors, {"comms": comms, "peers": peers, "rows": rows})


@_boundary
def split_back(tensors: Sequence[Tensor], comms: Sequence[int], peers: Sequence[int], rows: Sequence[int]) -> None:
    """Send each peer its consecutive row range of every tensor, in one NCCL group.

    The FFN side returns each attention rank exactly its rows; the attention
    side uses it to send its rows (one peer when A >= F, several when A < F).
    Peers with ``rows[i] == 0`` are skipped. Arguments as in :func:`fan_in`;
    the tensors are only read (declared mutated so compiled code keeps the call).

    Raises:
        As :func:`fan_in`.
    """
    _ops.split_back(tensors, _ints(comms), _ints(peers), _ints(rows))


@torch.library.register_fake("afd_ext::split_back")
def _split_back_fake(tensors, comms, peers, rows) -> None:
    _fake_check_rows("split_back", tensors, {"comms": comms, "peers": peers, "rows": rows})


def _fp8_check(op: str, x: Tensor, values: Tensor, scales: Tensor) -> None:
    from .fp8 import GROUP

    t, h = (tuple(x.shape) + (0,))[:2] if x.dim() == 2 else (-1, -1)
    if x.dim() != 2 or h % GROUP or tuple(values.shape) != (t, h) or tuple(scales.shape) != (t, h // GROUP):
        raise AFDConfigError(f"afd_ext.{op}: expected hidden states and values [T, H] (H a multiple of {GROUP}) "
                             f"and scales [T, H/{GROUP}], got {tuple(x.shape)}, {tuple(values.shape)} and "
                             f"{tuple(scales.shape)}")
    if (x.dtype, values.dtype, scales.dtype) != (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        raise AFDTypeError(f"afd_ext.{op}: expected bfloat16 hidden states, float8_e4m3fn values and float32 "
                           f"scales, got {x.dtype}, {values.dtype} and {scales.dtype}")


@_boundary
def fp8_quantize(x: Tensor, values: Tensor, scales: Tensor, ue8m0: bool = False) -> None:
    """Quantize bf16 hidden states ``x`` ``[T, H]`` into ``values`` (e4m3 ``[T, H]``) and ``scales`` (fp32 ``[T, H/128]``).

    The rule of :mod:`afd_ext.fp8` (the CPU kernel *is* :func:`afd_ext.fp8.quantize`; the CUDA
    kernel matches it bit for bit); ``ue8m0``: scales rounded up to powers of two. Same device, contiguous; ``values``/``scales`` mutated; on the
    current stream, no allocation (capturable).

    Raises:
        AFDConfigError / AFDTypeError: shapes (H not a multiple of 128) or dtypes.
    """
    _fp8_check("fp8_quantize", x, values, scales)
    _ops.fp8_quantize(x, values, scales, bool(ue8m0))


@torch.library.register_fake("afd_ext::fp8_quantize")
def _fp8_quantize_fake(x, values, scales, ue8m0=False) -> None:
    _fp8_check("fp8_quantize", x, values, scales)


@_boundary
def fp8_dequantize(values: Tensor, scales: Tensor, out: Tensor) -> None:
    """``out`` (bf16 ``[T, H]``, mutated) = ``values`` (e4m3) times their group's scale, rounded once.

    Raises:
        AFDConfigError / AFDTypeError: as :func:`fp8_quantize`.
    """
    _fp8_check("fp8_dequantize", out, values, scales)
    _ops.fp8_dequantize(values, scales, out)


@torch.library.register_fake("afd_ext::fp8_dequantize")
def _fp8_dequantize_fake(values, scales, out) -> None:
    _fp8_check("fp8_dequantize", out, values, scales)


@torch.library.impl("afd_ext::fp8_quantize", "CPU")
def _fp8_quantize_cpu(x, values, scales, ue8m0=False) -> None:
    from . import fp8

    fp8.quantize(x, values, scales, ue8m0)


@torch.library.impl("afd_ext::fp8_dequantize", "CPU")
def _fp8_dequantize_cpu(values, scales, out) -> None:
    from . import fp8

    fp8.dequantize(values, scales, out)


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

_COMM_OPS = ("send", "recv", "fan_in", "split_back", "peer_put", "peer_wait")
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


# ---------------------------------------------------------------------------
# Peer-memory plane (docs/peer-memory.md): ranks on one node write rows
# straight into each other's memory through CUDA IPC, then publish a flag.
# Planes and regions are int handles into a C++ table (never raw pointers).
# The constants come from the compiled core (csrc/peer.h states them once).
# ---------------------------------------------------------------------------

#: Bytes of a CUDA IPC memory handle (``cudaIpcMemHandle_t``).
PEER_IPC_HANDLE_BYTES: int = _C.PEER_IPC_HANDLE_BYTES
#: Most peers one ``peer_put`` / ``peer_wait`` may name.
PEER_MAX_PEERS: int = _C.PEER_MAX_PEERS
#: Generations are 16 bits of every flag word: ``1..PEER_MAX_GENERATION``.
PEER_MAX_GENERATION: int = _C.PEER_MAX_GENERATION
#: Names of the words of :func:`peer_plane_error`'s record, in order.
PEER_ERR_WORDS: tuple[str, ...] = tuple(_C.PEER_ERR_WORDS.split(","))
#: Error codes of the record's ``code`` word.
PEER_OK, PEER_TIMEOUT, PEER_PROTOCOL, PEER_ABORTED = _C.PEER_OK, _C.PEER_TIMEOUT, _C.PEER_PROTOCOL, _C.PEER_ABORTED


@_boundary
def peer_plane_create(device: int | torch.device, generation: int, num_slots: int, max_peers: int) -> int:
    """Create this rank's peer-memory plane on a CUDA device.

    The plane holds, in device memory, ``num_slots * max_peers`` sequence
    counters (one per (slot, peer): a slot is one direction of one stage),
    ``num_slots`` block counters and a ``failed`` word, and in host-mapped
    memory an error record that :func:`peer_plane_error` reads without
    touching the device. Every flag word the plane's kernels write or wait for
    is ``generation << 48 | seq``.

    Args:
        device: CUDA device index (or ``torch.device("cuda", i)``).
        generation: ``1..65535``; the same value on every rank of one AFD world
            generation, a different one after re-initialisation.
        num_slots: counter slots, ``1..4096``.
        max_peers: most peers of one call, ``1..PEER_MAX_PEERS``.

    Returns:
        A plane handle ``>= 1``.

    Raises:
        AFDConfigError: ``device`` is a ``torch.device`` that is not CUDA.
        RuntimeError: bad arguments, a CUDA error, or a CPU-only build (from the C++ checks).
    """
    return int(_ops.peer_plane_create(_cuda_index(device), int(generation), int(num_slots), int(max_peers)))



@_boundary
def peer_plane_destroy(plane: int) -> None:
    """Abort the plane (spinning waits return within microseconds), wait for the device, free it.

    Idempotent for every handle this process was issued. Synchronises the
    plane's device (``cudaFree``): call it outside any CUDA-graph capture.

    Raises:
        RuntimeError: ``plane`` was never issued.
    """
    _ops.peer_plane_destroy(int(plane))



@_boundary
def peer_plane_error(plane: int) -> list[int]:
    """The plane's error record, read from host-mapped memory (no device sync; any thread).

    Returns:
        Eight ints named by :data:`PEER_ERR_WORDS`: ``code`` (:data:`PEER_OK`,
        :data:`PEER_TIMEOUT`, :data:`PEER_PROTOCOL`, :data:`PEER_ABORTED`),
        ``op`` (the caller's op code), ``peer`` (role rank), ``layer``,
        ``stage``, ``want`` (sequence number waited for), ``seen`` (flag word
        last seen), ``waited_ns`` (device clock). All zero while ``code`` is 0.

    Raises:
        RuntimeError: the plane is not live.
    """
    return [int(x) for x in _ops.peer_plane_error(int(plane))]



@_boundary
def peer_plane_abort(plane: int, op: int = 0) -> None:
    """Mark the plane failed from the host (code :data:`PEER_ABORTED`, ``op`` recorded).

    Spinning waits notice within 64 polls and return; later waits return at
    once and later puts write nothing. The record of an earlier failure is
    kept. Safe from a watchdog thread; never blocks.

    Raises:
        RuntimeError: the plane is not live.
    """
    _ops.peer_plane_abort(int(plane), int(op))



@_boundary
def peer_region_alloc(plane: int, nbytes: int) -> int:
    """Allocate ``nbytes`` of zeroed device memory on the plane's device, outside torch's caching allocator.

    The memory comes from ``cudaMalloc``, so :func:`peer_region_export` can
    export it through legacy CUDA IPC whatever ``PYTORCH_CUDA_ALLOC_CONF``
    says. Synchronous (init-time only).

    Returns:
        A region handle ``>= 1``.

    Raises:
        RuntimeError: ``nbytes <= 0``; out of memory (the message names the memory formula).
    """
    return int(_ops.peer_region_alloc(int(plane), int(nbytes)))



@_boundary
def peer_region_export(region: int, out: Optional[Tensor] = None) -> Tensor:
    """The 64-byte CUDA IPC handle of one of this process's regions (bytes for the rendezvous store).

    Args:
        region: a handle from :func:`peer_region_alloc`.
        out: optional contiguous CPU ``uint8 [64]`` (mutated).

    Returns:
        ``out`` (allocated if not given).

    Raises:
        RuntimeError: a region opened from a peer; a bad ``out``; a CUDA error.
    """
    if out is None:
        out = torch.empty(PEER_IPC_HANDLE_BYTES, dtype=torch.uint8)
    _ops.peer_region_export(int(region), out)
    return out



@_boundary
def peer_region_open(plane: int, ipc_handle: Tensor | bytes, nbytes: int) -> int:
    """Open a peer's region from its IPC handle, mapped on the plane's device.

    A handle this process exported itself is aliased (CUDA refuses to open
    those), so one process can play both roles in tests.

    Args:
        plane: the plane whose device maps the memory.
        ipc_handle: the 64 bytes from the peer's :func:`peer_region_export`
            (``bytes`` or CPU ``uint8 [64]``).
        nbytes: the region's size as its owner published it.

    Returns:
        A region handle ``>= 1``.

    Raises:
        RuntimeError: the handle cannot be opened here (another host, another
            IPC namespace, no peer access between the GPUs); bad arguments.
    """
    if isinstance(ipc_handle, (bytes, bytearray, memoryview)):
        ipc_handle = torch.frombuffer(bytearray(ipc_handle), dtype=torch.uint8)
    return int(_ops.peer_region_open(int(plane), ipc_handle, int(nbytes)))



@_boundary
def peer_region_close(region: int) -> None:
    """Close a region handle; the memory is freed (own) or unmapped (opened) once no view of it is left.

    Idempotent for every handle this process was issued. Freeing own memory
    synchronises the device.

    Raises:
        RuntimeError: ``region`` was never issued.
    """
    _ops.peer_region_close(int(region))



@_boundary
def peer_region_view(region: int, offset: int, nbytes: int) -> Tensor:
    """A CUDA ``uint8 [nbytes]`` tensor over bytes ``[offset, offset + nbytes)`` of a region.

    The tensor keeps the memory alive after :func:`peer_region_close`. Use
    ``.view(dtype).view(shape)`` for typed views (``offset`` aligned to the dtype).

    Raises:
        RuntimeError: the range is outside the region; the region is not live.
    """
    return _ops.peer_region_view(int(region), int(offset), int(nbytes))



@_boundary
def peer_put(tensors: Sequence[Tensor], plane: int, slot: int, regions: Sequence[int], rows: Sequence[int],
             dst_rows: Sequence[int], part_offsets: Sequence[int], flag_offsets: Sequence[int],
             quantize_first: bool = False, ue8m0: bool = False) -> None:
    """Write rows straight into peers' memory, then publish one flag per peer (one kernel).

    Peer ``i`` gets rows ``[sum(rows[:i]), sum(rows[:i+1]))`` of every
    tensor, written at row ``dst_rows[i]`` of the part that starts at byte
    ``part_offsets[k]`` of region ``regions[i]`` (dense rows of the source's
    row size). After all data stores (fence at system scope), flag word
    ``generation << 48 | seq`` is stored with release semantics at byte
    ``flag_offsets[i]`` of that region, ``seq`` being the plane's device
    counter ``(slot, i)`` plus one. Peers with zero rows move no bytes but
    their flag still advances. A failed plane writes nothing.

    Args:
        tensors: the wire parts in wire order (:mod:`afd_ext.wire`), each ``[sum(rows), ...]``,
            a wire dtype, contiguous, on the plane's device; at most 8 parts (``kPeerMaxParts``, csrc/peer.h; FP8 values and scales count two).
        plane: plane handle; slot: counter slot (one per direction and stage).
        regions: opened peer regions (or own ones), one per peer.
        rows, dst_rows: rows per peer and their first row in the peer's part.
        part_offsets: byte offset of each part in every destination region.
        flag_offsets: byte offset (8-aligned) of this rank's flag in each destination region.
        quantize_first: ``tensors[0]`` (bf16 ``[T, H]``, H a multiple of 128) is written as FP8
            values and float32 scales (:mod:`afd_ext.fp8`), two parts: ``part_offsets`` then
            has one entry more (values, scales, then the other tensors'); ``ue8m0``: its scales are
            rounded up to powers of two.

    The tensors are only read (declared mutated so compiled code keeps the
    call). Enqueued on the current stream; no allocation, no sync: capturable
    in a CUDA graph, and replays advance the device counters.

    Raises:
        AFDConfigError / AFDTypeError: lengths differ, rows do not add up, a write past a
            region's end (capacity), a bad tensor/handle/slot (all before the launch).
    """
    _ops.peer_put(tensors, int(plane), int(slot), _ints(regions), _ints(rows), _ints(dst_rows),
                  _ints(part_offsets), _ints(flag_offsets), bool(quantize_first), bool(ue8m0))


@torch.library.register_fake("afd_ext::peer_put")
def _peer_put_fake(tensors, plane, slot, regions, rows, dst_rows, part_offsets, flag_offsets,
                   quantize_first=False, ue8m0=False) -> None:
    _fake_check_rows("peer_put", tensors,
                     {"regions": regions, "rows": rows, "dst_rows": dst_rows, "flag_offsets": flag_offsets})
    if len(part_offsets) != len(tensors) + bool(quantize_first):
        raise AFDConfigError(f"afd_ext.peer_put: part_offsets has {len(part_offsets)} entries but "
                             f"{len(tensors) + bool(quantize_first)} wire parts travel")


@_boundary
def peer_wait(tensors: Sequence[Tensor], out: Optional[Tensor], plane: int, slot: int, region: int,
              flag_offsets: Sequence[int], peers: Sequence[int], op: int, layer: int, stage: int,
              timeout_ns: int, dequantize: bool = False) -> None:
    """Wait for every peer's flag in this rank's region, then optionally copy ``tensors[0]`` into ``out``.

    Flag ``i`` (byte ``flag_offsets[i]`` of ``region``) must reach
    ``generation << 48 | seq`` with ``seq`` the plane's device counter
    ``(slot, i)`` plus one; the counters advance when the wait completes.
    Each spin has a deadline of ``timeout_ns`` on the device clock: on expiry
    (or on a flag of this generation that is ahead: a protocol error) the
    first failure is recorded (``op``, ``peers[i]``, ``layer``, ``stage``) for
    :func:`peer_plane_error`, and from then on every wait of the plane returns
    at once. A wait never blocks the host.

    Args:
        tensors: the views of ``region`` the flags guard, in wire order; ``tensors[0]`` is the
            copy source when ``out`` is given. Declared mutated, so compiled code orders later
            reads after the wait.
        out: optional contiguous copy target (``tensors[0]``'s dtype and shape),
            written after the flags (the reply copied into ``ref_tensor``).
        plane, slot: plane handle and counter slot.
        region: this rank's region holding the flags.
        flag_offsets: byte offset (8-aligned) of each peer's flag.
        peers: role rank of each peer (for the error record).
        op, layer, stage: recorded on failure.
        timeout_ns: deadline of each spin, ns (> 0).
        dequantize: ``tensors[0]`` are FP8 values ``[T, H]``, ``tensors[1]`` their float32
            scales ``[T, H/128]`` and ``out`` bf16: the copy dequantizes (docs/fp8.md).

    Raises:
        AFDConfigError / AFDTypeError: bad arguments, tensors on another device (before the launch).
    """
    _ops.peer_wait(tensors, out, int(plane), int(slot), int(region), _ints(flag_offsets), _ints(peers), int(op),
                   int(layer), int(stage), int(timeout_ns), bool(dequantize))


@torch.library.register_fake("afd_ext::peer_wait")
def _peer_wait_fake(tensors, out, plane, slot, region, flag_offsets, peers, op, layer, stage, timeout_ns,
                    dequantize=False) -> None:
    if len(flag_offsets) != len(peers):
        raise AFDConfigError(f"afd_ext.peer_wait: flag_offsets and peers must have equal lengths, got "
                             f"{len(flag_offsets)} and {len(peers)}")
    if dequantize:
        if out is None or len(tensors) < 2:
            raise AFDConfigError("afd_ext.peer_wait: dequantize needs out and tensors [values, scales, ...]")
        _fp8_check("peer_wait", out, tensors[0], tensors[1])
    elif out is not None and (out.dtype != tensors[0].dtype or tuple(out.shape) != tuple(tensors[0].shape)):
        raise AFDConfigError(f"afd_ext.peer_wait: out must match tensors[0] ({tensors[0].dtype} "
                             f"{tuple(tensors[0].shape)}), got {out.dtype} {tuple(out.shape)}")
