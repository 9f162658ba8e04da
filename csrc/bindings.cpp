// Every afd_ext op schema, in one TORCH_LIBRARY block.
//
// Communication ops declare each tensor they touch as mutated (Tensor(a!),
// distinct alias sets) and return (): an op that returns nothing and mutates
// nothing is dead code to torch.compile, and a declared mutation also keeps
// the ops in program order. Dispatch-key impls are registered beside their
// code (cpu/, cuda/); the Python fakes are in afd_ext/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/control.h"
#include "ops.h"
#include "peer.h"

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

// The control plane (csrc/cpu/control_poll.cpp) as plain module functions, once per step on each end:
// the attention rank's put / send encodes the payload, the FFN rank's take waits (GIL released) and
// decodes it. Python objects are read and built here only, through the C API and the objects' public
// fields: the payload's, and each stage's counts (a tuple of ints) and max_tokens.
static PyObject* g_names[7];  // dp_metadata_list, the four flags, counts, max_tokens (interned at import)
static const char* const kNames[7] = {"dp_metadata_list", "is_graph_capturing", "is_warmup", "is_graph_replaying",
                                      "is_profile", "counts", "max_tokens"};

static std::string& ctrl_scratch(size_t cap) {
  static thread_local std::string buf;
  if (buf.size() < cap) buf.resize(cap);
  return buf;
}

// An exact int in [lo, hi] into *v, else false (no error set).
static bool ctrl_int_in(PyObject* o, long long lo, long long hi, long long* v) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  *v = PyLong_AsLongLongAndOverflow(o, &overflow);
  return !overflow && *v >= lo && *v <= hi;
}

// Encodes a control payload into out[off, off + size). 1: done; 0: not a payload this path takes as it is (a
// field missing or of another type, values to convert; no error set: Python converts it or names the fault);
// -1: an error set (a stage's counts refused: a tensor modified in place into something invalid).
static int ctrl_encode_into(PyObject* payload, std::string& out, size_t off, size_t* size) {
  struct Stage { long long s; PyObject* counts; PyObject* max; };
  std::vector<Stage> st;  // not shared: a counts property runs Python code
  unsigned flags = 0;
  for (int i = 1; i <= 4; ++i) {
    PyObject* f = PyObject_GetAttr(payload, g_names[i]);
    Py_XDECREF(f);  // only its address is compared below
    if (f != Py_True && f != Py_False) return PyErr_Clear(), 0;
    flags |= unsigned(f == Py_True) << (i - 1);
  }
  PyObject* dp = PyObject_GetAttr(payload, g_names[0]);
  int rc = dp != nullptr && PyDict_CheckExact(dp) && PyDict_GET_SIZE(dp) <= 0xFFFF;
  PyErr_Clear();
  Py_ssize_t pos = 0;
  PyObject *key, *md;
  size_t n = afd::ctrl::kPayloadHead;
  while (rc == 1 && PyDict_Next(dp, &pos, &key, &md)) {
    Stage g{0, nullptr, nullptr};
    if (!ctrl_int_in(key, 0, 0xFFFFFFFFLL, &g.s)) {
      rc = 0;
      break;
    }
    Py_INCREF(md);  // a counts property runs Python code, which may change the dict
    g.counts = PyObject_GetAttr(md, g_names[5]);
    g.max = g.counts ? PyObject_GetAttr(md, g_names[6]) : nullptr;
    Py_DECREF(md);
    st.push_back(g);
    if (g.max == nullptr) rc = PyErr_ExceptionMatches(PyExc_AttributeError) ? (PyErr_Clear(), 0) : -1;
    else if (!PyTuple_CheckExact(g.counts) || PyTuple_GET_SIZE(g.counts) > INT32_MAX) rc = 0;
    else n += afd::ctrl::kStageHead + 4 * size_t(PyTuple_GET_SIZE(g.counts));
  }
  Py_XDECREF(dp);
  if (rc == 1) {
    for (size_t i = 1; i < st.size(); ++i)  // increasing stage order (a few stages: insertion sort)
      for (size_t j = i; j > 0 && st[j - 1].s > st[j].s; --j) std::swap(st[j - 1], st[j]);
    if (out.size() < off + n) out.resize(off + n);
    auto* p = reinterpret_cast<uint8_t*>(out.data()) + off;
    const uint16_t ns = uint16_t(st.size());
    std::memcpy(p, "AFDb", 4), p[4] = afd::ctrl::kPayloadVersion, p[5] = uint8_t(flags), std::memcpy(p + 6, &ns, 2);
    p += afd::ctrl::kPayloadHead;
    for (size_t i = 0; rc == 1 && i < st.size(); ++i) {
      long long v = 0;
      const auto k = uint32_t(PyTuple_GET_SIZE(st[i].counts));
      rc = ctrl_int_in(st[i].max, 0, INT32_MAX, &v);
      const uint32_t head[3] = {uint32_t(st[i].s), k, uint32_t(v)};
      std::memcpy(p, head, afd::ctrl::kStageHead);
      p += afd::ctrl::kStageHead;
      for (uint32_t j = 0; rc == 1 && j < k; ++j, p += 4) {
        rc = ctrl_int_in(PyTuple_GET_ITEM(st[i].counts, j), 0, INT32_MAX, &v);
        const auto c = int32_t(v);
        std::memcpy(p, &c, 4);
      }
    }
  }
  for (auto& g : st) Py_XDECREF(g.counts), Py_XDECREF(g.max);
  *size = n;
  return rc;
}

// The fields of a checked payload: (is_graph_capturing, is_warmup, is_graph_replaying, is_profile,
// ((stage, max_tokens, (count, ...)), ...)); a str saying what is wrong when it is malformed.
static PyObject* ctrl_decode_from(const uint8_t* p, uint64_t size, long long max_stages, long long max_ranks) {
  const std::string err = afd::ctrl::check_payload(p, size, uint64_t(max_stages), uint64_t(max_ranks));
  if (!err.empty()) return PyUnicode_FromStringAndSize(err.data(), Py_ssize_t(err.size()));
  // A copy: a collection run by the allocations below may run finalizers that reuse the caller's buffer.
  const std::string copy(reinterpret_cast<const char*>(p), size_t(size));
  p = reinterpret_cast<const uint8_t*>(copy.data());
  const Py_ssize_t ns = p[6] | Py_ssize_t(p[7]) << 8;
  PyObject* out = PyTuple_New(5);
  PyObject* stages = out ? PyTuple_New(ns) : nullptr;
  if (stages == nullptr) {
    Py_XDECREF(out);
    return nullptr;
  }
  for (int i = 0; i < 4; ++i) PyTuple_SET_ITEM(out, i, PyBool_FromLong(p[5] >> i & 1));
  PyTuple_SET_ITEM(out, 4, stages);
  p += afd::ctrl::kPayloadHead;
  for (Py_ssize_t i = 0; i < ns; ++i) {
    uint32_t h[3];
    std::memcpy(h, p, 12);
    p += afd::ctrl::kStageHead;
    PyObject* counts = PyTuple_New(h[1]);
    PyObject* stage = counts ? PyTuple_New(3) : nullptr;
    if (stage == nullptr) {
      Py_XDECREF(counts);
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(stages, i, stage);
    PyTuple_SET_ITEM(stage, 2, counts);
    for (uint32_t j = 0; j < h[1]; ++j, p += 4) {
      int32_t c;
      std::memcpy(&c, p, 4);
      PyTuple_SET_ITEM(counts, j, PyLong_FromLong(c));
    }
    PyTuple_SET_ITEM(stage, 0, PyLong_FromUnsignedLong(h[0]));
    PyTuple_SET_ITEM(stage, 1, PyLong_FromUnsignedLong(h[2]));
    if (PyErr_Occurred()) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// ctrl_encode(payload) -> bytes | None (a payload the encoder does not take as it is: Python converts it).
static PyObject* ctrl_encode_py(PyObject*, PyObject* payload) {
  std::string& buf = ctrl_scratch(4096);
  size_t n = 0;
  const int rc = ctrl_encode_into(payload, buf, 0, &n);
  if (rc < 0) return nullptr;
  if (rc == 0) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(buf.data(), Py_ssize_t(n));
}

// ctrl_decode(data, max_stages, max_ranks) -> the fields (ctrl_decode_from) | str (malformed).
static PyObject* ctrl_decode_py(PyObject*, PyObject* args) {
  Py_buffer b;
  long long max_stages, max_ranks;
  if (!PyArg_ParseTuple(args, "y*LL", &b, &max_stages, &max_ranks)) return nullptr;
  PyObject* r = ctrl_decode_from(static_cast<const uint8_t*>(b.buf), uint64_t(b.len), max_stages, max_ranks);
  PyBuffer_Release(&b);
  return r;
}

// The ring behind the parsed writable buffer `b` (the mapping), geometry from its header; releases `b` on failure.
static bool ctrl_ring(Py_buffer* b, afd::ctrl::Ring* r) {
  if (afd::ctrl::ring_of(static_cast<uint8_t*>(b->buf), uint64_t(b->len), r)) return true;
  PyBuffer_Release(b);
  PyErr_SetString(PyExc_ValueError, "control ring: the header's geometry does not fit the mapping");
  return false;
}

// ctrl_shm_put(ring, sender, data, total) -> True | False (the ring is full, nothing written) | None.
// data: bytes-like, one fragment of a `total`-byte message; or a control payload, encoded here (None: not
// one the encoder takes as it is, or larger than a slot or `total`: Python encodes it, or refuses it).
static PyObject* ctrl_shm_put_py(PyObject*, PyObject* args) {
  Py_buffer b, data;
  PyObject *obj, *res = nullptr;
  unsigned int sender;
  long long total;
  afd::ctrl::Ring r;
  if (!PyArg_ParseTuple(args, "w*IOL", &b, &sender, &obj, &total) || !ctrl_ring(&b, &r)) return nullptr;
  if (PyObject_CheckBuffer(obj)) {
    if (PyObject_GetBuffer(obj, &data, PyBUF_SIMPLE) == 0) {
      if (uint64_t(data.len) > r.slot_bytes)
        PyErr_SetString(PyExc_ValueError, "ctrl_shm_put: a fragment larger than a slot");
      else
        res = PyBool_FromLong(afd::ctrl::shm_put(r, uint64_t(total), sender, static_cast<const uint8_t*>(data.buf),
                                                 uint32_t(data.len)));
      PyBuffer_Release(&data);
    }
  } else {
    std::string& buf = ctrl_scratch(4096);
    size_t n = 0;
    const int rc = ctrl_encode_into(obj, buf, 0, &n);
    if (rc == 1 && n <= r.slot_bytes && int64_t(n) <= total)
      res = PyBool_FromLong(afd::ctrl::shm_put(r, n, sender, reinterpret_cast<const uint8_t*>(buf.data()), uint32_t(n)));
    else if (rc >= 0)
      res = Py_NewRef(Py_None);
  }
  PyBuffer_Release(&b);
  return res;
}

// ctrl_shm_take(ring, spin_until_ns, deadline_ns, max_stages, max_ranks) -> (total, sender, body) | int
// (-1 the slice passed, -2 stopped, -3 corrupt). body: the decoded fields (ctrl_decode_from) of a
// message whole in its slot when max_stages >= 0; else the fragment's bytes.
static PyObject* ctrl_shm_take_py(PyObject*, PyObject* args) {
  Py_buffer b;
  long long spin_until, deadline, max_stages, max_ranks;
  afd::ctrl::Ring r;
  if (!PyArg_ParseTuple(args, "w*LLLL", &b, &spin_until, &deadline, &max_stages, &max_ranks) || !ctrl_ring(&b, &r))
    return nullptr;
  auto* out = reinterpret_cast<uint8_t*>(ctrl_scratch(r.slot_bytes).data());
  uint64_t total = 0;
  uint32_t sender = 0;
  int64_t n;
  Py_BEGIN_ALLOW_THREADS
  n = afd::ctrl::shm_take(r, out, &total, &sender, spin_until, deadline);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&b);
  if (n < 0) return PyErr_CheckSignals() < 0 ? nullptr : PyLong_FromLongLong(n);
  PyObject* body = max_stages >= 0 && uint64_t(n) == total
                       ? ctrl_decode_from(out, uint64_t(n), max_stages, max_ranks)
                       : PyBytes_FromStringAndSize(reinterpret_cast<char*>(out), Py_ssize_t(n));
  return body ? Py_BuildValue("(KkN)", (unsigned long long)total, (unsigned long)sender, body) : nullptr;
}

// ctrl_shm_stop(ring, sender) -> None: the close of the sending (True) or receiving end.
static PyObject* ctrl_shm_stop_py(PyObject*, PyObject* args) {
  Py_buffer b;
  int sender;
  afd::ctrl::Ring r;
  if (!PyArg_ParseTuple(args, "w*p", &b, &sender) || !ctrl_ring(&b, &r)) return nullptr;
  afd::ctrl::shm_stop(r.base, sender);
  PyBuffer_Release(&b);
  Py_RETURN_NONE;
}

// ctrl_shm_ends(ring) -> (sender state, receiver state, slots put and not yet taken), in one ordered read.
static PyObject* ctrl_shm_ends_py(PyObject*, PyObject* args) {
  Py_buffer b;
  uint64_t s, rs, unread;
  afd::ctrl::Ring r;
  if (!PyArg_ParseTuple(args, "w*", &b) || !ctrl_ring(&b, &r)) return nullptr;
  afd::ctrl::shm_ends(r.base, &s, &rs, &unread);
  PyBuffer_Release(&b);
  return Py_BuildValue("(KKK)", (unsigned long long)s, (unsigned long long)rs, (unsigned long long)unread);
}

// ctrl_tcp_send(fd, type, sender, data, max_bytes) -> True (sent) | bytes (the rest of the frame, which
// the socket did not take at once) | None (nothing sent: a payload the encoder does not take as it is, or
// over max_bytes). data: bytes-like, or a control payload encoded here. OSError: the connection failed.
static PyObject* ctrl_tcp_send_py(PyObject*, PyObject* args) {
  constexpr size_t kHdr = afd::ctrl::kFrameHeader;
  int fd;
  unsigned int type, sender;
  PyObject* obj;
  long long max_bytes;
  if (!PyArg_ParseTuple(args, "iIIOL", &fd, &type, &sender, &obj, &max_bytes)) return nullptr;
  std::string& buf = ctrl_scratch(4096);
  size_t n = 0;
  if (PyObject_CheckBuffer(obj)) {
    Py_buffer d;
    if (PyObject_GetBuffer(obj, &d, PyBUF_SIMPLE) < 0) return nullptr;
    n = size_t(d.len);
    if (buf.size() < kHdr + n) buf.resize(kHdr + n);
    std::memcpy(buf.data() + kHdr, d.buf, n);
    PyBuffer_Release(&d);
  } else if (const int rc = ctrl_encode_into(obj, buf, kHdr, &n); rc <= 0 || int64_t(n) > max_bytes) {
    return rc < 0 ? nullptr : Py_NewRef(Py_None);
  }
  const uint32_t head[3] = {afd::ctrl::kTcpMagic, type, sender};
  const uint64_t len = n;
  std::memcpy(buf.data(), head, 12), std::memcpy(buf.data() + 12, &len, 8);
  n += kHdr;
  ssize_t sent = send(fd, buf.data(), n, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return PyErr_SetFromErrno(PyExc_OSError);
  if (sent == ssize_t(n)) Py_RETURN_TRUE;
  sent = sent < 0 ? 0 : sent;
  return PyBytes_FromStringAndSize(buf.data() + sent, Py_ssize_t(n) - sent);
}

// ctrl_tcp_take(fd, rbuf, max_bytes, spin_until_ns, deadline_ns, max_stages, max_ranks) -> the next whole
// frame from socket fd as (type, sender, length, body): body None, nothing more read, when the length
// exceeds max_bytes; the decoded fields (ctrl_decode_from) of a non-empty body when max_stages >= 0;
// else bytes. A str: the frame's magic is wrong. None: the deadline passed; 0: end of stream. Bytes
// past the frame stay in the bytearray rbuf.
static PyObject* ctrl_tcp_take_py(PyObject*, PyObject* args) {
  constexpr Py_ssize_t kHdr = afd::ctrl::kFrameHeader, kRead = 65536;
  int fd;
  PyObject* rbuf;
  long long max_bytes, spin_until, deadline, max_stages, max_ranks;
  if (!PyArg_ParseTuple(args, "iYLLLLL", &fd, &rbuf, &max_bytes, &spin_until, &deadline, &max_stages, &max_ranks))
    return nullptr;
  auto* tmp = reinterpret_cast<uint8_t*>(ctrl_scratch(kRead).data());
  for (;;) {
    const Py_ssize_t len = PyByteArray_GET_SIZE(rbuf);
    const uint8_t* p = reinterpret_cast<const uint8_t*>(PyByteArray_AS_STRING(rbuf));
    if (len >= kHdr) {
      uint32_t h[3];
      uint64_t n;
      std::memcpy(h, p, 12), std::memcpy(&n, p + 12, 8);
      if (h[0] != afd::ctrl::kTcpMagic) return PyUnicode_FromFormat("bad magic %#x", h[0]);
      if (n > uint64_t(max_bytes))
        return Py_BuildValue("(kkKO)", (unsigned long)h[1], (unsigned long)h[2], (unsigned long long)n, Py_None);
      if (uint64_t(len - kHdr) >= n) {
        PyObject* body = max_stages >= 0 && n > 0
                             ? ctrl_decode_from(p + kHdr, n, max_stages, max_ranks)
                             : PyBytes_FromStringAndSize(reinterpret_cast<const char*>(p + kHdr), Py_ssize_t(n));
        if (body == nullptr) return nullptr;
        const Py_ssize_t rest = len - kHdr - Py_ssize_t(n);
        std::memmove(PyByteArray_AS_STRING(rbuf), p + kHdr + n, size_t(rest));
        if (PyByteArray_Resize(rbuf, rest) < 0) {
          Py_DECREF(body);
          return nullptr;
        }
        return Py_BuildValue("(kkKN)", (unsigned long)h[1], (unsigned long)h[2], (unsigned long long)n, body);
      }
    }
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = afd::ctrl::tcp_read(fd, tmp, kRead, spin_until, deadline);
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
    {"ctrl_encode", ctrl_encode_py, METH_O, "Control plane: encode a control payload (afd_ext/metadata.py)."},
    {"ctrl_decode", ctrl_decode_py, METH_VARARGS, "Control plane: check and decode a binary control payload."},
    {"ctrl_shm_put", ctrl_shm_put_py, METH_VARARGS, "Control plane: publish a message in a shared-memory ring."},
    {"ctrl_shm_take", ctrl_shm_take_py, METH_VARARGS, "Control plane: wait for a ring's next message (control/shm.py)."},
    {"ctrl_shm_stop", ctrl_shm_stop_py, METH_VARARGS, "Control plane: end a shared-memory ring's waits (close)."},
    {"ctrl_shm_ends", ctrl_shm_ends_py, METH_VARARGS, "Control plane: a ring's end states and unread slots."},
    {"ctrl_tcp_send", ctrl_tcp_send_py, METH_VARARGS, "Control plane: send one frame on a TCP control socket."},
    {"ctrl_tcp_take", ctrl_tcp_take_py, METH_VARARGS, "Control plane: wait for a TCP control socket's next frame."},
    {nullptr, nullptr, 0, nullptr}};

// `import afd_ext._C` loads the library (running the registrations above) and
// exposes the build facts that no op can report.
static struct PyModuleDef afd_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "afd_ext compiled core: registers the torch.ops.afd_ext.* operators.", -1, afd_methods,
    nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  for (int i = 0; i < 7; ++i)
    if (g_names[i] == nullptr && (g_names[i] = PyUnicode_InternFromString(kNames[i])) == nullptr) return nullptr;
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
      PyModule_AddStringConstant(mod, "WIRE_DTYPES", afd::wire_dtype_names().c_str()) < 0 ||
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
