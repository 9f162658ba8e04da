// The control plane (csrc/cpu/control_poll.cpp) as plain module functions, once per step on each end:
// the attention rank's put / send encodes the payload, the FFN rank's take waits (GIL released) and
// decodes it. Python objects are read and built here only, through the C API and the objects' public
// fields: the payload's, and each stage's counts (a tuple of ints) and max_tokens.
// bindings.cpp, which holds the op schemas, adds them to the module _C (afd::ctrl_methods, ctrl_module_init).
#undef Py_LIMITED_API  // as bindings.cpp: the limited API of Python 3.11
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "cpu/control.h"

static PyObject* g_names[7];  // dp_metadata_list, the four flags, counts, max_tokens (interned at import)
static const char* const kNames[7] = {"dp_metadata_list", "is_graph_capturing", "is_warmup", "is_graph_replaying",
                                      "is_profile", "counts", "max_tokens"};

// A buffer a function holds (PyArg_ParseTuple's w* / y*), released on every way out, a C++ exception's too.
struct HeldBuffer {
  Py_buffer view;
  bool held = false;
  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() {
    if (held) PyBuffer_Release(&view);
  }
};

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
  int rc = dp != nullptr && PyDict_CheckExact(dp) && PyDict_Size(dp) <= 0xFFFF;
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
    else if (!PyTuple_CheckExact(g.counts) || PyTuple_Size(g.counts) > INT32_MAX) rc = 0;
    else n += afd::ctrl::kStageHead + 4 * size_t(PyTuple_Size(g.counts));
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
      const auto k = uint32_t(PyTuple_Size(st[i].counts));
      rc = ctrl_int_in(st[i].max, 0, INT32_MAX, &v);
      const uint32_t head[3] = {uint32_t(st[i].s), k, uint32_t(v)};
      std::memcpy(p, head, afd::ctrl::kStageHead);
      p += afd::ctrl::kStageHead;
      for (uint32_t j = 0; rc == 1 && j < k; ++j, p += 4) {
        rc = ctrl_int_in(PyTuple_GetItem(st[i].counts, j), 0, INT32_MAX, &v);
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
  for (int i = 0; i < 4; ++i) PyTuple_SetItem(out, i, PyBool_FromLong(p[5] >> i & 1));
  PyTuple_SetItem(out, 4, stages);
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
    PyTuple_SetItem(stages, i, stage);
    PyTuple_SetItem(stage, 2, counts);
    for (uint32_t j = 0; j < h[1]; ++j, p += 4) {
      int32_t c;
      std::memcpy(&c, p, 4);
      PyTuple_SetItem(counts, j, PyLong_FromLong(c));
    }
    PyTuple_SetItem(stage, 0, PyLong_FromUnsignedLong(h[0]));
    PyTuple_SetItem(stage, 1, PyLong_FromUnsignedLong(h[2]));
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
  HeldBuffer b;
  long long max_stages, max_ranks;
  if (!(b.held = PyArg_ParseTuple(args, "y*LL", &b.view, &max_stages, &max_ranks))) return nullptr;
  return ctrl_decode_from(static_cast<const uint8_t*>(b.view.buf), uint64_t(b.view.len), max_stages, max_ranks);
}

// The ring behind the parsed writable buffer `b` (the mapping), geometry from its header.
static bool ctrl_ring(const HeldBuffer& b, afd::ctrl::Ring* r) {
  if (afd::ctrl::ring_of(static_cast<uint8_t*>(b.view.buf), uint64_t(b.view.len), r)) return true;
  PyErr_SetString(PyExc_ValueError, "control ring: the header's geometry does not fit the mapping");
  return false;
}

// ctrl_shm_put(ring, sender, data, total) -> True | False (the ring is full, nothing written) | None.
// data: bytes-like, one fragment of a `total`-byte message; or a control payload, encoded here (None: not
// one the encoder takes as it is, or larger than a slot or `total`: Python encodes it, or refuses it).
static PyObject* ctrl_shm_put_py(PyObject*, PyObject* args) {
  HeldBuffer b, data;
  PyObject *obj, *res = nullptr;
  unsigned int sender;
  long long total;
  afd::ctrl::Ring r;
  if (!(b.held = PyArg_ParseTuple(args, "w*IOL", &b.view, &sender, &obj, &total)) || !ctrl_ring(b, &r)) return nullptr;
  if (PyObject_CheckBuffer(obj)) {
    if ((data.held = PyObject_GetBuffer(obj, &data.view, PyBUF_SIMPLE) == 0)) {
      if (uint64_t(data.view.len) > r.slot_bytes)
        PyErr_SetString(PyExc_ValueError, "ctrl_shm_put: a fragment larger than a slot");
      else
        res = PyBool_FromLong(afd::ctrl::shm_put(r, uint64_t(total), sender,
                                                 static_cast<const uint8_t*>(data.view.buf), uint32_t(data.view.len)));
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
  return res;
}

// ctrl_shm_take(ring, spin_until_ns, deadline_ns, max_stages, max_ranks) -> (total, sender, body) | int
// (-1 the slice passed, -2 stopped, -3 corrupt). body: the decoded fields (ctrl_decode_from) of a
// message whole in its slot when max_stages >= 0; else the fragment's bytes.
static PyObject* ctrl_shm_take_py(PyObject*, PyObject* args) {
  HeldBuffer b;
  long long spin_until, deadline, max_stages, max_ranks;
  afd::ctrl::Ring r;
  if (!(b.held = PyArg_ParseTuple(args, "w*LLLL", &b.view, &spin_until, &deadline, &max_stages, &max_ranks)) ||
      !ctrl_ring(b, &r))
    return nullptr;
  auto* out = reinterpret_cast<uint8_t*>(ctrl_scratch(r.slot_bytes).data());
  uint64_t total = 0;
  uint32_t sender = 0;
  int64_t n;
  Py_BEGIN_ALLOW_THREADS
  n = afd::ctrl::shm_take(r, out, &total, &sender, spin_until, deadline);
  Py_END_ALLOW_THREADS
  if (n < 0) return PyErr_CheckSignals() < 0 ? nullptr : PyLong_FromLongLong(n);
  PyObject* body = max_stages >= 0 && uint64_t(n) == total
                       ? ctrl_decode_from(out, uint64_t(n), max_stages, max_ranks)
                       : PyBytes_FromStringAndSize(reinterpret_cast<char*>(out), Py_ssize_t(n));
  return body ? Py_BuildValue("(KkN)", (unsigned long long)total, (unsigned long)sender, body) : nullptr;
}

// ctrl_shm_stop(ring, sender) -> None: the close of the sending (True) or receiving end.
static PyObject* ctrl_shm_stop_py(PyObject*, PyObject* args) {
  HeldBuffer b;
  int sender;
  afd::ctrl::Ring r;
  if (!(b.held = PyArg_ParseTuple(args, "w*p", &b.view, &sender)) || !ctrl_ring(b, &r)) return nullptr;
  afd::ctrl::shm_stop(r.base, sender);
  Py_RETURN_NONE;
}

// ctrl_shm_ends(ring) -> (sender state, receiver state, slots put and not yet taken), in one ordered read.
static PyObject* ctrl_shm_ends_py(PyObject*, PyObject* args) {
  HeldBuffer b;
  uint64_t s, rs, unread;
  afd::ctrl::Ring r;
  if (!(b.held = PyArg_ParseTuple(args, "w*", &b.view)) || !ctrl_ring(b, &r)) return nullptr;
  afd::ctrl::shm_ends(r.base, &s, &rs, &unread);
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
    HeldBuffer d;
    if (!(d.held = PyObject_GetBuffer(obj, &d.view, PyBUF_SIMPLE) == 0)) return nullptr;
    n = size_t(d.view.len);
    if (buf.size() < kHdr + n) buf.resize(kHdr + n);
    std::memcpy(buf.data() + kHdr, d.view.buf, n);
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
    const Py_ssize_t len = PyByteArray_Size(rbuf);
    const uint8_t* p = reinterpret_cast<const uint8_t*>(PyByteArray_AsString(rbuf));
    if (len >= kHdr) {
      uint32_t h[3];
      uint64_t n;
      std::memcpy(h, p, 12), std::memcpy(&n, p + 12, 8);
      if (h[0] != afd::ctrl::kTcpMagic) return PyUnicode_FromFormat("bad magic %#x", h[0]);
      if (n > uint64_t(max_bytes))
        return Py_BuildValue("(kkKO)", (unsigned long)h[1], (unsigned long)h[2], (unsigned long long)n, Py_None);
      if (uint64_t(len - kHdr) >= n) {
        // The frame leaves rbuf before the decode makes tuples: a collection those allocations run may run a
        // finalizer that resizes rbuf (p and len would then be stale). A bytes object is not collected.
        const bool decode = max_stages >= 0 && n > 0;
        const std::string frame(decode ? reinterpret_cast<const char*>(p + kHdr) : "", decode ? size_t(n) : 0);
        PyObject* body = decode ? nullptr : PyBytes_FromStringAndSize(reinterpret_cast<const char*>(p + kHdr), Py_ssize_t(n));
        if (!decode && body == nullptr) return nullptr;
        const Py_ssize_t rest = len - kHdr - Py_ssize_t(n);
        std::memmove(PyByteArray_AsString(rbuf), p + kHdr + n, size_t(rest));
        if (PyByteArray_Resize(rbuf, rest) < 0) {
          Py_XDECREF(body);
          return nullptr;
        }
        if (decode) body = ctrl_decode_from(reinterpret_cast<const uint8_t*>(frame.data()), n, max_stages, max_ranks);
        return body ? Py_BuildValue("(kkKN)", (unsigned long)h[1], (unsigned long)h[2], (unsigned long long)n, body)
                    : nullptr;
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
    std::memcpy(PyByteArray_AsString(rbuf) + len, tmp, size_t(r));
  }
}

// No C++ exception may unwind into CPython's C frames (std::terminate: the process aborts): a failed allocation
// (std::string, std::vector) is a MemoryError, any other a RuntimeError.
template <PyObject* (*F)(PyObject*, PyObject*)>
static PyObject* guarded(PyObject* self, PyObject* args) noexcept {
  try {
    return F(self, args);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

namespace afd {
PyMethodDef ctrl_methods[] = {
    {"ctrl_encode", guarded<ctrl_encode_py>, METH_O, "Control plane: encode a control payload (afd_ext/control/codec.py)."},
    {"ctrl_decode", guarded<ctrl_decode_py>, METH_VARARGS, "Control plane: check and decode a binary control payload."},
    {"ctrl_shm_put", guarded<ctrl_shm_put_py>, METH_VARARGS, "Control plane: publish a message in a shared-memory ring."},
    {"ctrl_shm_take", guarded<ctrl_shm_take_py>, METH_VARARGS, "Control plane: wait for a ring's next message (control/shm.py)."},
    {"ctrl_shm_stop", guarded<ctrl_shm_stop_py>, METH_VARARGS, "Control plane: end a shared-memory ring's waits (close)."},
    {"ctrl_shm_ends", guarded<ctrl_shm_ends_py>, METH_VARARGS, "Control plane: a ring's end states and unread slots."},
    {"ctrl_tcp_send", guarded<ctrl_tcp_send_py>, METH_VARARGS, "Control plane: send one frame on a TCP control socket."},
    {"ctrl_tcp_take", guarded<ctrl_tcp_take_py>, METH_VARARGS, "Control plane: wait for a TCP control socket's next frame."},
    {nullptr, nullptr, 0, nullptr}};

// Interns the field names above and adds the ring's layout constants to `mod`; -1 with an error set.
int ctrl_module_init(PyObject* mod) {
  for (int i = 0; i < 7; ++i)
    if (g_names[i] == nullptr && (g_names[i] = PyUnicode_InternFromString(kNames[i])) == nullptr) return -1;
  if (PyModule_AddIntConstant(mod, "CTRL_HEADER_BYTES", ctrl::kHeaderBytes) < 0) return -1;
  return PyModule_AddIntConstant(mod, "CTRL_SLOT_HEADER", ctrl::kSlotHeader);
}
}  // namespace afd
