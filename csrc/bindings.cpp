// Every afd_ext op schema, in one TORCH_LIBRARY block.
//
// Communication ops declare each tensor they touch as mutated (Tensor(a!),
// distinct alias sets) and return (): an op that returns nothing and mutates
// nothing is dead code to torch.compile, and a declared mutation also keeps
// the ops in program order. Dispatch-key impls are registered beside their
// code (cpu/, cuda/); the Python fakes are in afd_ext/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "checks.h"
#include "cpu/control.h"
#include "ops.h"

#ifdef AFD_WITH_CUDA
#include <nccl.h>
#endif

#ifndef AFD_ARCH_LIST
#define AFD_ARCH_LIST ""
#endif

TORCH_LIBRARY(afd_ext, m) {
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
  // One NCCL group: receives rows[i] rows from peers[i] on comms[i] into consecutive row ranges of each given tensor.
  m.def(
      "fan_in(Tensor(a!) hidden_states, Tensor(b!)? router_logits, Tensor(c!)? token_ids, "
      "int[] comms, int[] peers, int[] rows, Tensor(d!)? hidden_scales=None) -> ()");
  // One NCCL group: sends consecutive row ranges of each given tensor, rows[i] rows to peers[i] on comms[i].
  m.def(
      "split_back(Tensor(a!) hidden_states, Tensor(b!)? router_logits, Tensor(c!)? token_ids, "
      "int[] comms, int[] peers, int[] rows, Tensor(d!)? hidden_scales=None) -> ()");
  // FP8 hidden states (docs/fp8.md): bf16 x [T, H] -> e4m3 values [T, H] and float32 scales [T, H/128], one scale per 128 channels.
  m.def("fp8_quantize(Tensor x, Tensor(a!) values, Tensor(b!) scales) -> ()");
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
  // Writes rows[i] consecutive rows of each given tensor into regions[i] at row dst_rows[i] of the part at part_offsets[k], then publishes flag (generation, seq) at flag_offsets[i]; quantize_hidden: bf16 hidden states go as FP8 values + scales (two parts).
  m.def(
      "peer_put(Tensor(a!) hidden_states, Tensor(b!)? router_logits, Tensor(c!)? token_ids, "
      "int plane, int slot, int[] regions, int[] rows, int[] dst_rows, int[] part_offsets, "
      "int[] flag_offsets, bool quantize_hidden=False) -> ()");
  // Waits (bounded by timeout_ns on the device clock) for every flag at flag_offsets of `region`, then copies hidden_states into `out` when given (dequantized with hidden_scales when given).
  m.def(
      "peer_wait(Tensor(a!) hidden_states, Tensor(b!)? router_logits, Tensor(c!)? token_ids, "
      "Tensor(d!)? out, int plane, int slot, int region, int[] flag_offsets, int[] peers, int op, "
      "int layer, int stage, int timeout_ns, Tensor(e!)? hidden_scales=None) -> ()");
}

// The communicator- and plane-management ops take no CUDA tensor (unique ids
// and IPC handles live on the CPU), so one kernel serves every dispatch key.
TORCH_LIBRARY_IMPL(afd_ext, CompositeExplicitAutograd, m) {
  m.impl("nccl_version", &afd::nccl_version);
  m.impl("nccl_unique_id", &afd::nccl_unique_id);
  m.impl("comm_create", &afd::comm_create);
  m.impl("comm_destroy", &afd::comm_destroy);
  m.impl("comm_abort", &afd::comm_abort);
  m.impl("comm_async_error", &afd::comm_async_error);
  m.impl("peer_plane_create", &afd::peer_plane_create);
  m.impl("peer_plane_destroy", &afd::peer_plane_destroy);
  m.impl("peer_plane_error", &afd::peer_plane_error);
  m.impl("peer_plane_abort", &afd::peer_plane_abort);
  m.impl("peer_region_alloc", &afd::peer_region_alloc);
  m.impl("peer_region_export", &afd::peer_region_export);
  m.impl("peer_region_open", &afd::peer_region_open);
  m.impl("peer_region_close", &afd::peer_region_close);
  m.impl("peer_region_view", &afd::peer_region_view);
}

// The control plane's waits (csrc/cpu/control_poll.cpp) as plain module functions: the ring is
// any writable buffer over the mapping (held for the call), and the GIL is released while they wait.
// Vectorcall (METH_FASTCALL) arguments and a per-thread receive buffer: these run once per step
// on cold caches, so they touch as little as they can (no format strings, no zeroed buffers).
static bool ctrl_ring(PyObject* ring, uint64_t nslots, uint64_t stride, uint64_t cap, Py_buffer* b) {
  if (PyObject_GetBuffer(ring, b, PyBUF_WRITABLE) < 0) return false;
  if (nslots == 0 || stride < afd::ctrl::kSlotHeader + cap || stride > (1ULL << 32) || nslots > (1ULL << 20) ||
      uint64_t(b->len) < afd::ctrl::kHeaderBytes + nslots * stride) {
    PyBuffer_Release(b);
    PyErr_SetString(PyExc_ValueError, "control ring: the geometry does not fit the buffer");
    return false;
  }
  return true;
}

// Integer arguments args[first .. first + n) as u64 (the deadlines as i64 bit patterns).
static bool ctrl_ints(const char* fn, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t first,
                      uint64_t* out, Py_ssize_t n) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(args[first + i]);
    if (v == -1 && PyErr_Occurred()) return false;
    out[i] = uint64_t(v);
  }
  return true;
}

// A receive buffer of at least `cap` bytes, kept per thread (grown, never zeroed per call).
static uint8_t* ctrl_scratch(uint64_t cap) {
  static thread_local std::string buf;
  if (buf.size() < cap) buf.resize(cap);
  return reinterpret_cast<uint8_t*>(buf.data());
}

// ctrl_shm_take(ring, nslots, stride, k, cap, spin_until_ns, deadline_ns) -> (total, sender, bytes) | int
static PyObject* ctrl_shm_take_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  uint64_t v[6];
  Py_buffer b;
  if (!ctrl_ints("ctrl_shm_take", args, nargs, 7, 1, v, 6) || !ctrl_ring(args[0], v[0], v[1], v[3], &b)) return nullptr;
  uint8_t* out = ctrl_scratch(v[3]);
  uint64_t total = 0;
  uint32_t sender = 0;
  int64_t r;
  Py_BEGIN_ALLOW_THREADS
  r = afd::ctrl::shm_take(static_cast<uint8_t*>(b.buf), v[0], v[1], v[2], out, v[3], &total, &sender,
                          int64_t(v[4]), int64_t(v[5]));
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&b);
  if (r >= 0) {
    PyObject* t = PyTuple_New(3);
    PyObject* data = PyBytes_FromStringAndSize(reinterpret_cast<char*>(out), Py_ssize_t(r));
    PyObject* tot = PyLong_FromUnsignedLongLong(total);
    PyObject* snd = PyLong_FromUnsignedLong(sender);
    if (!t || !data || !tot || !snd) {
      Py_XDECREF(t);
      Py_XDECREF(data);
      Py_XDECREF(tot);
      Py_XDECREF(snd);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, 0, tot);
    PyTuple_SET_ITEM(t, 1, snd);
    PyTuple_SET_ITEM(t, 2, data);
    return t;
  }
  if (PyErr_CheckSignals() < 0) return nullptr;
  return PyLong_FromLongLong(r);
}

// ctrl_shm_put(ring, nslots, stride, k, total, sender, data) -> bool (False, nothing written: the ring is full)
static PyObject* ctrl_shm_put_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  uint64_t v[5];
  Py_buffer data, b;
  if (!ctrl_ints("ctrl_shm_put", args, nargs, 7, 1, v, 5) || PyObject_GetBuffer(args[6], &data, PyBUF_SIMPLE) < 0)
    return nullptr;
  bool put = false;
  const bool ok = ctrl_ring(args[0], v[0], v[1], uint64_t(data.len), &b);
  if (ok) {
    put = afd::ctrl::shm_put(static_cast<uint8_t*>(b.buf), v[0], v[1], v[2], v[3], uint32_t(v[4]),
                             static_cast<const uint8_t*>(data.buf), uint32_t(data.len));
    PyBuffer_Release(&b);
  }
  PyBuffer_Release(&data);
  if (!ok) return nullptr;
  return PyBool_FromLong(put);
}

// ctrl_shm_stop(ring) -> None
static PyObject* ctrl_shm_stop_py(PyObject*, PyObject* ring) {
  Py_buffer b;
  if (!ctrl_ring(ring, 1, afd::ctrl::kSlotHeader, 0, &b)) return nullptr;
  afd::ctrl::shm_stop(static_cast<uint8_t*>(b.buf));
  PyBuffer_Release(&b);
  Py_RETURN_NONE;
}

// ctrl_tcp_take(fd, rbuf, magic, max_bytes, spin_until_ns, deadline_ns) -> the next whole frame
// from socket fd, as (magic, type, sender, length, body): body is None, nothing more read, when
// the magic differs or the length exceeds max_bytes. Bytes past the frame stay in the bytearray rbuf. None: the
// deadline passed; 0: end of stream before a whole frame. Frames: magic u32 | type u32 |
// sender u32 | length u64 | body (afd_ext/control/tcp.py writes them).
static PyObject* ctrl_tcp_take_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr Py_ssize_t kHdr = 20, kRead = 65536;
  uint64_t v[4];  // magic, max_bytes, spin_until_ns, deadline_ns
  if (!ctrl_ints("ctrl_tcp_take", args, nargs, 6, 2, v, 4)) return nullptr;
  const int fd = int(PyLong_AsLong(args[0]));
  if (fd == -1 && PyErr_Occurred()) return nullptr;
  PyObject* rbuf = args[1];
  if (!PyByteArray_Check(rbuf)) {
    PyErr_SetString(PyExc_TypeError, "ctrl_tcp_take: rbuf must be a bytearray");
    return nullptr;
  }
  uint8_t* tmp = ctrl_scratch(kRead);
  for (;;) {
    const Py_ssize_t len = PyByteArray_GET_SIZE(rbuf);
    const uint8_t* p = reinterpret_cast<const uint8_t*>(PyByteArray_AS_STRING(rbuf));
    if (len >= kHdr) {
      uint32_t magic, typ, sender;
      uint64_t n;
      std::memcpy(&magic, p, 4), std::memcpy(&typ, p + 4, 4), std::memcpy(&sender, p + 8, 4), std::memcpy(&n, p + 12, 8);
      if (magic != uint32_t(v[0]) || n > v[1]) return Py_BuildValue("(IIIKO)", magic, typ, sender, (unsigned long long)n, Py_None);
      if (uint64_t(len - kHdr) >= n) {
        PyObject* body = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(p + kHdr), Py_ssize_t(n));
        if (body == nullptr) return nullptr;
        const Py_ssize_t rest = len - kHdr - Py_ssize_t(n);
        std::memmove(PyByteArray_AS_STRING(rbuf), p + kHdr + n, size_t(rest));
        if (PyByteArray_Resize(rbuf, rest) < 0) {
          Py_DECREF(body);
          return nullptr;
        }
        return Py_BuildValue("(IIIKN)", magic, typ, sender, (unsigned long long)n, body);
      }
    }
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = afd::ctrl::tcp_read(fd, tmp, kRead, int64_t(v[2]), int64_t(v[3]));
    Py_END_ALLOW_THREADS
    if (r == afd::ctrl::kSlice) {
      if (PyErr_CheckSignals() < 0) return nullptr;
      Py_RETURN_NONE;
    }
    if (r < 0) {
      errno = int(-r);
      return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (r == 0) return PyLong_FromLong(0);
    if (PyByteArray_Resize(rbuf, len + r) < 0) return nullptr;
    std::memcpy(PyByteArray_AS_STRING(rbuf) + len, tmp, size_t(r));
  }
}

static PyMethodDef afd_methods[] = {
    {"ctrl_shm_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ctrl_shm_take_py)), METH_FASTCALL,
     "Control plane: wait for a shared-memory ring's next message (afd_ext/control/shm.py)."},
    {"ctrl_shm_put", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ctrl_shm_put_py)), METH_FASTCALL,
     "Control plane: publish a message in a shared-memory ring."},
    {"ctrl_shm_stop", ctrl_shm_stop_py, METH_O, "Control plane: end a shared-memory ring's waits (close)."},
    {"ctrl_tcp_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ctrl_tcp_take_py)), METH_FASTCALL,
     "Control plane: wait for and read a TCP control socket's next frame (afd_ext/control/tcp.py)."},
    {nullptr, nullptr, 0, nullptr}};

// `import afd_ext._C` loads the library (running the registrations above) and
// exposes the build facts that no op can report.
static struct PyModuleDef afd_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "afd_ext compiled core: registers the torch.ops.afd_ext.* operators.", -1, afd_methods,
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
  if (PyModule_AddIntConstant(mod, "CUDA_BUILT", cuda_built) < 0 ||
      PyModule_AddIntConstant(mod, "NCCL_VERSION_CODE", nccl_compiled) < 0 ||
      PyModule_AddStringConstant(mod, "ARCH_LIST", AFD_ARCH_LIST) < 0 ||
      PyModule_AddIntConstant(mod, "CTRL_HEADER_BYTES", afd::ctrl::kHeaderBytes) < 0 ||
      PyModule_AddIntConstant(mod, "CTRL_SLOT_HEADER", afd::ctrl::kSlotHeader) < 0 ||
      PyModule_AddStringConstant(mod, "WIRE_DTYPES", afd::wire_dtype_names().c_str()) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
