// Every afd_ext op schema, in one STABLE_TORCH_LIBRARY block (torch's stable ABI: one build serves
// every torch from 2.11 on; README.md, Building).
//
// Communication ops declare each tensor they touch as mutated (Tensor(a!),
// distinct alias sets) and return (): an op that returns nothing and mutates
// nothing is dead code to torch.compile, and a declared mutation also keeps
// the ops in program order. Dispatch-key impls are registered beside their
// code (cpu/, cuda/); the Python fakes are in afd_ext/ops.py.
#undef Py_LIMITED_API  // Python's limited API from 3.11 (Py_buffer): one cp311-abi3 build; torch's flag says 3.10
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include "checks.h"
#include "ops.h"
#include "peer.h"

#ifdef AFD_WITH_CUDA
#include <nccl.h>
#endif

#ifndef AFD_ARCH_LIST
#define AFD_ARCH_LIST ""
#endif

STABLE_TORCH_LIBRARY(afd_ext, m) {
  // NCCL version loaded at run time (ncclGetVersion, e.g. 22807); 0 in a CPU-only build.
  m.def("nccl_version() -> int");
  // Fills `out` (CPU uint8 [128]) with a fresh ncclUniqueId; rank 0 makes it, the others receive it.
  m.def("nccl_unique_id(Tensor(a!) out) -> ()");
  // Creates an NCCL communicator on CUDA `device`; returns an int handle into the C++ table (>= 1).
  m.def("comm_create(Tensor unique_id, int world_size, int rank, int device) -> int");
  // Destroys a communicator (waits for its queued work); idempotent for handles once issued.
  m.def("comm_destroy(int handle) -> ()");
  // Aborts a communicator (in-flight NCCL work is cancelled); idempotent for handles once issued.
  m.def("comm_abort(int handle) -> ()");
  // ncclCommGetAsyncError of a live communicator: 0 ok, 7 in progress, other codes are errors.
  m.def("comm_async_error(int handle) -> int");
  // Sends all of `t` to `peer` on communicator `comm`, on the current CUDA stream.
  m.def("send(Tensor(a!) t, int comm, int peer) -> ()");
  // Receives all of `t` from `peer` on communicator `comm`, on the current CUDA stream.
  m.def("recv(Tensor(a!) t, int comm, int peer) -> ()");
  // One NCCL group: receives rows[i] rows from peers[i] on comms[i] into consecutive row ranges of each tensor (the wire parts, in order).
  m.def("fan_in(Tensor(a!)[] tensors, int[] comms, int[] peers, int[] rows) -> ()");
  // One NCCL group: sends consecutive row ranges of each tensor (the wire parts, in order), rows[i] rows to peers[i] on comms[i].
  m.def("split_back(Tensor(a!)[] tensors, int[] comms, int[] peers, int[] rows) -> ()");
  // FP8 hidden states (docs/fp8.md): bf16 x [T, H] -> e4m3 values [T, H] and float32 scales [T, H/128], one scale per 128 channels (ue8m0: powers of two).
  m.def("fp8_quantize(Tensor x, Tensor(a!) values, Tensor(b!) scales, bool ue8m0=False) -> ()");
  // The inverse: out[t, h] = bf16(float(values[t, h]) * scales[t, h / 128]).
  m.def("fp8_dequantize(Tensor values, Tensor scales, Tensor(a!) out) -> ()");
  // Peer-memory plane (docs/peer-memory.md): device counters and a host-mapped error record on CUDA `device`; returns a plane handle (>= 1).
  m.def("peer_plane_create(int device, int generation, int num_slots, int max_peers) -> int");
  // Aborts the plane (spinning waits return), waits for the device, frees it; idempotent for handles once issued.
  m.def("peer_plane_destroy(int plane) -> ()");
  // The plane's error record [code, op, peer, layer, stage, want seq, seen flag, waited ns]; code 0: no failure.
  m.def("peer_plane_error(int plane) -> int[]");
  // Marks the plane failed from the host (code 3): spinning waits return, later waits return at once, puts write nothing.
  m.def("peer_plane_abort(int plane, int op) -> ()");
  // Allocates `nbytes` of zeroed device memory outside torch's caching allocator (CUDA-IPC exportable); returns a region handle.
  m.def("peer_region_alloc(int plane, int nbytes) -> int");
  // Writes the 64-byte CUDA IPC handle of one of this process's regions into `out` (CPU uint8 [64]).
  m.def("peer_region_export(int region, Tensor(a!) out) -> ()");
  // Opens a peer's region (`nbytes` long) from its IPC handle bytes on the plane's device; returns a region handle.
  m.def("peer_region_open(int plane, Tensor ipc_handle, int nbytes) -> int");
  // Closes a region handle (frees/unmaps once no view of it is left); idempotent for handles once issued.
  m.def("peer_region_close(int region) -> ()");
  // A CUDA uint8 tensor over bytes [offset, offset + nbytes) of a region; it keeps the memory alive.
  m.def("peer_region_view(int region, int offset, int nbytes) -> Tensor");
  // Writes rows[i] consecutive rows of each tensor (the wire parts, in order) into regions[i] at row dst_rows[i] of the part at part_offsets[k], then publishes flag (generation, seq) at flag_offsets[i]; quantize_first: tensors[0] (bf16) goes as FP8 values + scales (two parts; ue8m0: power-of-two scales).
  m.def(
      "peer_put(Tensor(a!)[] tensors, int plane, int slot, int[] regions, int[] rows, int[] dst_rows, "
      "int[] part_offsets, int[] flag_offsets, bool quantize_first=False, bool ue8m0=False) -> ()");
  // Waits (bounded by timeout_ns on the device clock) for every flag at flag_offsets of `region`, then copies tensors[0] into `out` when given (dequantized with tensors[1] as its scales when dequantize).
  m.def(
      "peer_wait(Tensor(a!)[] tensors, Tensor(b!)? out, int plane, int slot, int region, int[] flag_offsets, "
      "int[] peers, int op, int layer, int stage, int timeout_ns, bool dequantize=False) -> ()");
}

// The communicator- and plane-management ops take no CUDA tensor (unique ids
// and IPC handles live on the CPU), so one kernel serves every dispatch key.
STABLE_TORCH_LIBRARY_IMPL(afd_ext, CompositeExplicitAutograd, m) {
  m.impl("nccl_version", TORCH_BOX(&afd::nccl_version));
  m.impl("nccl_unique_id", TORCH_BOX(&afd::nccl_unique_id));
  m.impl("comm_create", TORCH_BOX(&afd::comm_create));
  m.impl("comm_destroy", TORCH_BOX(&afd::comm_destroy));
  m.impl("comm_abort", TORCH_BOX(&afd::comm_abort));
  m.impl("comm_async_error", TORCH_BOX(&afd::comm_async_error));
  m.impl("peer_plane_create", TORCH_BOX(&afd::peer_plane_create));
  m.impl("peer_plane_destroy", TORCH_BOX(&afd::peer_plane_destroy));
  m.impl("peer_plane_error", TORCH_BOX(&afd::peer_plane_error));
  m.impl("peer_plane_abort", TORCH_BOX(&afd::peer_plane_abort));
  m.impl("peer_region_alloc", TORCH_BOX(&afd::peer_region_alloc));
  m.impl("peer_region_export", TORCH_BOX(&afd::peer_region_export));
  m.impl("peer_region_open", TORCH_BOX(&afd::peer_region_open));
  m.impl("peer_region_close", TORCH_BOX(&afd::peer_region_close));
  m.impl("peer_region_view", TORCH_BOX(&afd::peer_region_view));
}

namespace afd {  // the control plane's module functions (csrc/control_bindings.cpp)
extern PyMethodDef ctrl_methods[];
int ctrl_module_init(PyObject* mod);  // -1 with an error set
}  // namespace afd

// `import afd_ext._C` loads the library (running the registrations above) and
// exposes the build facts that no op can report.
static struct PyModuleDef afd_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "afd_ext compiled core: registers the torch.ops.afd_ext.* operators.", -1, afd::ctrl_methods,
    nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&afd_module);
  if (mod == nullptr) return nullptr;
#ifdef AFD_WITH_CUDA
  const long cuda_built = 1;
  const long nccl_compiled = NCCL_VERSION_CODE;
#else
  const long cuda_built = 0;
  const long nccl_compiled = 0;
#endif
  if (afd::ctrl_module_init(mod) < 0 || PyModule_AddIntConstant(mod, "CUDA_BUILT", cuda_built) < 0 ||
      PyModule_AddIntConstant(mod, "NCCL_VERSION_CODE", nccl_compiled) < 0 ||
      PyModule_AddStringConstant(mod, "ARCH_LIST", AFD_ARCH_LIST) < 0 ||
      PyModule_AddStringConstant(mod, "WIRE_DTYPES", afd::wire_dtype_names().c_str()) < 0 ||
      PyModule_AddIntConstant(mod, "FP8_GROUP", afd::kFp8Group) < 0 ||  // afd_ext.fp8.GROUP, tested equal
      // The peer plane's facts, read by afd_ext.ops (one statement: csrc/peer.h).
      PyModule_AddIntConstant(mod, "PEER_IPC_HANDLE_BYTES", afd::kPeerIpcHandleBytes) < 0 ||
      PyModule_AddIntConstant(mod, "PEER_MAX_PEERS", afd::kPeerMaxPeers) < 0 ||
      PyModule_AddIntConstant(mod, "PEER_MAX_GENERATION", afd::kPeerMaxGeneration) < 0 ||
      PyModule_AddStringConstant(mod, "PEER_ERR_WORDS", afd::kPeerErrWordNames) < 0 ||
      PyModule_AddIntConstant(mod, "PEER_OK", afd::kPeerOk) < 0 ||
      PyModule_AddIntConstant(mod, "PEER_TIMEOUT", afd::kPeerTimeout) < 0 ||
      PyModule_AddIntConstant(mod, "PEER_PROTOCOL", afd::kPeerProtocol) < 0 ||
      PyModule_AddIntConstant(mod, "PEER_ABORTED", afd::kPeerAborted) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
