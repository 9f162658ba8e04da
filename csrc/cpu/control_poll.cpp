// The control plane's per-message path in native code: the waiting loops (so
// that a waiting FFN rank polls without holding the GIL) and the shared-memory
// ring's single-slot publish and take with the binary payload's encode and
// parse (no interpreter between the seq word and the payload). Python calls
// _C.ctrl_send / _C.ctrl_take (CPython functions, registered in bindings.cpp)
// and afd_ctrl_spin_fd through ctypes, one bounded slice at a time, and does
// its liveness checks between slices. The ring layout is defined in afd_ext/control (package doc);
// the offsets below mirror it, and tests/test_control_plane.py checks that both
// sides read each other's slots.
#include <Python.h>
#include <poll.h>
#include <time.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace {

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Reading the clock costs ~20 ns; look at it once per this many polls.
constexpr int kPollsPerClockRead = 64;

// Ring layout (afd_ext/control_plane.py): u64 word indices in the 256-byte header,
// and the slot header: seq u64 | total_len u64 | frag_len u32 | sender u32 | crc u32 | pad u32.
constexpr int kReadCountWord = 8;
constexpr int kHeartbeatWord = 16;
constexpr int kWaitingWord = 24;
constexpr size_t kSlotHeader = 32;

// CRC-32 (IEEE 802.3, reflected, as zlib.crc32).
constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int j = 0; j < 8; ++j) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto kCrcTable = make_crc_table();

inline uint32_t crc32_update(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

// zlib.crc32(payload, zlib.crc32(struct.pack("<QQII", seq, total, frag, sender)))
inline uint32_t slot_crc(uint64_t seq, uint64_t total, uint32_t frag, uint32_t sender, const uint8_t* payload) {
  uint8_t fields[24];
  std::memcpy(fields, &seq, 8);  // little-endian hosts only (x86-64, aarch64)
  std::memcpy(fields + 8, &total, 8);
  std::memcpy(fields + 16, &frag, 4);
  std::memcpy(fields + 20, &sender, 4);
  return crc32_update(crc32_update(0, fields, sizeof fields), payload, frag);
}

// Spin until the shared 8-byte word at `word` equals `want` (acquire load) or
// `max_ns` nanoseconds passed. Returns 1 when it matched, 0 on timeout.
int spin_u64(const uint64_t* word, uint64_t want, int64_t max_ns) {
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return 1;
  const int64_t end = now_ns() + (max_ns > 0 ? max_ns : 0);
  for (;;) {
    for (int i = 0; i < kPollsPerClockRead; ++i) {
      if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return 1;
      cpu_relax();
    }
    if (now_ns() >= end) return __atomic_load_n(word, __ATOMIC_ACQUIRE) == want ? 1 : 0;
  }
}

}  // namespace

extern "C" {

// One end of one ring, filled once by Python (afd_ext/control/shm.py, `_RingState`).
// Python passes its address and plain ints.
struct afd_ctrl_ring {
  uint64_t* hdr;        // the segment (its 256-byte header)
  uint64_t nslots;
  uint64_t stride;      // bytes from one slot to the next; slot i starts at hdr + 256 + i * stride
  uint64_t slot_bytes;  // payload capacity of a slot
  uint8_t* out;         // receiver: copy buffer of slot_bytes
  uint64_t k;           // the next message number (sent or taken); advanced on success
  uint32_t local_rank;  // sender: the sender field it writes
  uint32_t got_sender;  // receiver: the sender field of the last message taken
  int64_t t_ns;         // CLOCK_MONOTONIC ns: sender, when the last message was published;
                        // receiver, when the poll saw the last message taken (the bench's phases)
};

inline uint8_t* slot_of(const afd_ctrl_ring* r, uint64_t k) {
  return reinterpret_cast<uint8_t*>(r->hdr) + 256 + (k % r->nslots) * r->stride;
}

// Spin until `fd` is readable (or hung up / in error) or `max_ns` passed.
// Returns 1 when readable, 0 on timeout, -errno when poll() failed.
__attribute__((visibility("default"))) int afd_ctrl_spin_fd(int fd, int max_ns) {
  pollfd p{fd, POLLIN, 0};
  const int64_t end = now_ns() + (max_ns > 0 ? max_ns : 0);
  for (;;) {
    p.revents = 0;
    const int r = ::poll(&p, 1, 0);
    if (r > 0) return 1;
    if (r < 0 && errno != EINTR) return -errno;
    if (now_ns() >= end) return 0;
    cpu_relax();
  }
}

// Sender: publish a message of `n` <= slot_bytes bytes as message number r->k
// (the seqlock protocol of the package doc), stamp the heartbeat, advance r->k.
// Returns 1 when the receiver is blocked on the doorbell (ring it), 0 when not,
// -1 when the ring is full (nothing written; the caller waits for space).
__attribute__((visibility("default"))) int afd_ctrl_shm_publish(afd_ctrl_ring* r, const uint8_t* data, int n) {
  uint64_t* hdr = r->hdr;
  const uint64_t k = r->k;
  if (n < 0 || static_cast<uint64_t>(n) > r->slot_bytes) return -2;
  if (k - __atomic_load_n(&hdr[kReadCountWord], __ATOMIC_ACQUIRE) >= r->nslots) return -1;
  uint8_t* slot = slot_of(r, k);
  const uint32_t sender = r->local_rank;
  __atomic_store_n(&hdr[kHeartbeatWord], static_cast<uint64_t>(now_ns()), __ATOMIC_RELAXED);
  auto* seq = reinterpret_cast<uint64_t*>(slot);
  const uint64_t want = 2 * k + 2;
  __atomic_store_n(seq, want - 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);  // the odd seq is visible before any field changes
  const uint64_t total = static_cast<uint64_t>(n);
  const uint32_t frag = static_cast<uint32_t>(n);
  const uint32_t crc = slot_crc(want, total, frag, sender, data);
  std::memcpy(slot + 8, &total, 8);
  std::memcpy(slot + 16, &frag, 4);
  std::memcpy(slot + 20, &sender, 4);
  std::memcpy(slot + 24, &crc, 4);
  std::memcpy(slot + kSlotHeader, data, frag);
  r->t_ns = now_ns();
  __atomic_store_n(seq, want, __ATOMIC_RELEASE);
  r->k = k + 1;
  // Full fence: the publish is ordered before the read of the receiver's waiting flag.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  return __atomic_load_n(&hdr[kWaitingWord], __ATOMIC_RELAXED) ? 1 : 0;
}

// Receiver: wait up to `max_ns` for message number r->k, then copy a
// single-slot message into r->out, check it (seq unchanged, CRC), mark it
// consumed (read_count = k + 1) and advance r->k; r->got_sender gets its
// sender field. Returns its length; -1 when nothing was published in time; -2
// when the slot is published but not a whole consistent single-slot message
// (torn, corrupt, or one fragment of a larger message: the caller reads it the
// slow way; r->k is unchanged).
__attribute__((visibility("default"))) int64_t afd_ctrl_shm_take(afd_ctrl_ring* r, int max_ns) {
  uint64_t* hdr = r->hdr;
  const uint64_t k = r->k;
  const uint8_t* slot = slot_of(r, k);
  uint8_t* out = r->out;
  const uint64_t slot_bytes = r->slot_bytes;
  const auto* seq = reinterpret_cast<const uint64_t*>(slot);
  const uint64_t want = 2 * k + 2;
  if (!spin_u64(seq, want, max_ns)) return -1;
  const int64_t seen = now_ns();
  for (int attempt = 0; attempt < 64; ++attempt) {
    uint64_t total;
    uint32_t frag, snd, crc;
    std::memcpy(&total, slot + 8, 8);
    std::memcpy(&frag, slot + 16, 4);
    std::memcpy(&snd, slot + 20, 4);
    std::memcpy(&crc, slot + 24, 4);
    if (frag > slot_bytes || total != frag) return -2;
    std::memcpy(out, slot + kSlotHeader, frag);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(seq, __ATOMIC_RELAXED) == want && slot_crc(want, total, frag, snd, out) == crc) {
      r->got_sender = snd;
      r->t_ns = seen;
      r->k = k + 1;
      __atomic_store_n(&hdr[kReadCountWord], k + 1, __ATOMIC_RELEASE);
      return static_cast<int64_t>(frag);
    }
    cpu_relax();
  }
  return -2;
}

}  // extern "C"

namespace {

// Parse a binary control payload (afd_ext.metadata.encode_control_binary) into
// (sender, flags, ((stage, max_tokens, counts), ...)); None when it is not
// well formed, so that the Python decoder names the problem.
PyObject* parse_payload(const uint8_t* d, int64_t n, uint32_t sender, long max_stages, long max_ranks) {
  if (n < 8 || std::memcmp(d, "AFDb", 4) != 0 || d[4] != 1 || d[5] > 0xF) Py_RETURN_NONE;
  uint16_t nstages;
  std::memcpy(&nstages, d + 6, 2);
  if (nstages > max_stages) Py_RETURN_NONE;
  PyObject* stages = PyTuple_New(nstages);
  if (stages == nullptr) return nullptr;
  int64_t off = 8;
  int64_t prev = -1;
  for (uint16_t i = 0; i < nstages; ++i) {
    uint32_t st, cnt, mx;
    if (off + 12 > n) goto bad;
    std::memcpy(&st, d + off, 4);
    std::memcpy(&cnt, d + off + 4, 4);
    std::memcpy(&mx, d + off + 8, 4);
    off += 12;
    if (static_cast<int64_t>(st) <= prev || cnt > static_cast<uint64_t>(max_ranks) || mx > 0x7FFFFFFFu ||
        off + 4 * static_cast<int64_t>(cnt) > n)
      goto bad;
    {
      PyObject* counts = PyTuple_New(cnt);
      if (counts == nullptr) goto fail;
      for (uint32_t j = 0; j < cnt; ++j) {
        int32_t v;
        std::memcpy(&v, d + off + 4 * static_cast<int64_t>(j), 4);
        if (v < 0) {
          Py_DECREF(counts);
          goto bad;
        }
        PyObject* o = PyLong_FromLong(v);
        if (o == nullptr) {
          Py_DECREF(counts);
          goto fail;
        }
        PyTuple_SET_ITEM(counts, j, o);
      }
      PyObject* item = Py_BuildValue("(kkN)", static_cast<unsigned long>(st), static_cast<unsigned long>(mx), counts);
      if (item == nullptr) goto fail;
      PyTuple_SET_ITEM(stages, i, item);
    }
    off += 4 * static_cast<int64_t>(cnt);
    prev = st;
  }
  if (off != n) goto bad;
  return Py_BuildValue("(kkN)", static_cast<unsigned long>(sender), static_cast<unsigned long>(d[5]), stages);
bad:
  Py_DECREF(stages);
  Py_RETURN_NONE;
fail:
  Py_DECREF(stages);
  return nullptr;
}

}  // namespace

// _C.ctrl_take(ring_address, max_ns, max_stages, max_ranks): afd_ctrl_shm_take
// with the GIL released, then the payload parsed while the bytes are hot.
// Returns -1 (nothing published in time) or -2 (read the slot the slow way)
// as an int; for a message taken, (sender, flags, stages) when it parses,
// else (or with max_stages < 0: raw bytes wanted) the message bytes.
PyObject* afd_ctrl_take_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "ctrl_take(ring_address, max_ns, max_stages, max_ranks)");
    return nullptr;
  }
  auto* r = static_cast<afd_ctrl_ring*>(PyLong_AsVoidPtr(args[0]));
  const long max_ns = PyLong_AsLong(args[1]);
  const long max_stages = PyLong_AsLong(args[2]);
  const long max_ranks = PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  if (r == nullptr) {
    PyErr_SetString(PyExc_ValueError, "ctrl_take: null ring");
    return nullptr;
  }
  const int wait = static_cast<int>(max_ns < 0 ? 0 : (max_ns > 0x7FFFFFFFL ? 0x7FFFFFFFL : max_ns));
  int64_t n;
  Py_BEGIN_ALLOW_THREADS n = afd_ctrl_shm_take(r, wait);
  Py_END_ALLOW_THREADS if (n < 0) return PyLong_FromLongLong(n);
  if (max_stages < 0) return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(r->out), n);
  PyObject* parsed = parse_payload(r->out, n, r->got_sender, max_stages, max_ranks);
  if (parsed != Py_None) return parsed;
  Py_DECREF(parsed);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(r->out), n);
}


namespace {

// Append v as 4 little-endian bytes; false when it is not an int in [lo, hi].
bool put_u32(PyObject* o, int64_t lo, int64_t hi, uint8_t* at) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || v < lo || v > hi) return false;
  const uint32_t u = static_cast<uint32_t>(v);
  std::memcpy(at, &u, 4);
  return true;
}

// Append one stage (stage u32, count u32, max_tokens u32, counts i32...) at `off`;
// false when it does not fit `cap` or a value is not an int in range.
bool put_stage(uint8_t* buf, uint64_t& off, uint64_t cap, PyObject* stage, PyObject* max_tokens, PyObject* counts) {
  if (!PyTuple_CheckExact(counts)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(counts);
  if (off + 12 + 4 * static_cast<uint64_t>(n) > cap) return false;
  const uint32_t n32 = static_cast<uint32_t>(n);
  if (!put_u32(stage, 0, 0xFFFFFFFFLL, buf + off) || !put_u32(max_tokens, 0, 0x7FFFFFFFLL, buf + off + 8)) return false;
  std::memcpy(buf + off + 4, &n32, 4);
  off += 12;
  for (Py_ssize_t j = 0; j < n; ++j) {
    if (!put_u32(PyTuple_GET_ITEM(counts, j), 0, 0x7FFFFFFFLL, buf + off)) return false;
    off += 4;
  }
  return true;
}

void put_head(uint8_t* buf, long flags, Py_ssize_t nstages) {
  std::memcpy(buf, "AFDb", 4);
  buf[4] = 1;
  buf[5] = static_cast<uint8_t>(flags);
  const uint16_t ns = static_cast<uint16_t>(nstages);
  std::memcpy(buf + 6, &ns, 2);
}

}  // namespace

// _C.ctrl_send(ring_address, flags, stages): encode afd_ext.metadata.control_payload_parts
// output (flags, ((stage, max_tokens, counts), ...)) in the binary layout and publish it
// (afd_ctrl_shm_publish). Returns 1 (ring the doorbell) or 0 when sent; -1 when the ring
// is full; -2 when it does not fit one slot or a value is out of range (nothing written:
// the caller encodes it in Python, which names a bad value).
PyObject* afd_ctrl_send_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "ctrl_send(ring_address, flags, stages)");
    return nullptr;
  }
  auto* r = static_cast<afd_ctrl_ring*>(PyLong_AsVoidPtr(args[0]));
  const long flags = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (r == nullptr || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "ctrl_send: a ring address and a tuple of stages");
    return nullptr;
  }
  PyObject* stages = args[2];
  const Py_ssize_t nstages = PyTuple_GET_SIZE(stages);
  const uint64_t cap = r->slot_bytes;
  if (flags < 0 || flags > 0xF || nstages > 0xFFFF || cap < 8 || cap > (1u << 30)) return PyLong_FromLong(-2);
  uint8_t stack[2048];
  uint8_t* buf = cap <= sizeof stack ? stack : static_cast<uint8_t*>(PyMem_Malloc(cap));
  if (buf == nullptr) return PyErr_NoMemory();
  uint64_t off = 8;
  bool ok = true;
  put_head(buf, flags, nstages);
  for (Py_ssize_t i = 0; ok && i < nstages; ++i) {
    PyObject* st = PyTuple_GET_ITEM(stages, i);
    ok = PyTuple_CheckExact(st) && PyTuple_GET_SIZE(st) == 3 &&
         put_stage(buf, off, cap, PyTuple_GET_ITEM(st, 0), PyTuple_GET_ITEM(st, 1), PyTuple_GET_ITEM(st, 2));
  }
  int rc = -2;
  if (ok) rc = afd_ctrl_shm_publish(r, buf, static_cast<int>(off));
  if (buf != stack) PyMem_Free(buf);
  return PyLong_FromLong(rc < -1 ? -2 : rc);
}

namespace {

// The payload classes the whole-payload send reads (afd_ext.metadata), bound once by
// _C.ctrl_bind_types, and the attribute names it reads, interned once.
PyObject* g_payload_type = nullptr;
PyObject* g_md_type = nullptr;
PyObject* g_names[9] = {};
enum { kDp, kCapturing, kWarmup, kReplaying, kProfile, kCounts, kMax, kTensor, kMaxTensor };
constexpr int kMaxNativeStages = 64;

// Flag bit of a payload attribute that must be exactly True or False; -1 otherwise.
int flag_bit(PyObject* payload, int name, int bit) {
  PyObject* v = PyObject_GetAttr(payload, g_names[name]);
  if (v == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const int r = v == Py_True ? (1 << bit) : (v == Py_False ? 0 : -1);
  Py_DECREF(v);
  return r;
}

}  // namespace

// _C.ctrl_bind_types(AFDControlPayload, AFDDPMetadata): the classes ctrl_send_payload reads.
PyObject* afd_ctrl_bind_types_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "ctrl_bind_types(payload_type, dp_metadata_type)");
    return nullptr;
  }
  static const char* const names[9] = {"dp_metadata_list", "is_graph_capturing", "is_warmup",
                                       "is_graph_replaying", "is_profile", "_counts", "_max", "_t", "_mt"};
  for (int i = 0; i < 9; ++i) {
    if (g_names[i] == nullptr && (g_names[i] = PyUnicode_InternFromString(names[i])) == nullptr) return nullptr;
  }
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_XSETREF(g_payload_type, args[0]);
  Py_XSETREF(g_md_type, args[1]);
  Py_RETURN_NONE;
}

// _C.ctrl_send_payload(ring_address, payload): encode an AFDControlPayload straight from
// its fields and publish it (afd_ctrl_shm_publish): one call and no Python objects made,
// so a send after a long gap (cold caches) touches little memory. Returns as ctrl_send;
// -2 (nothing written) for anything but the plain case: another payload class, a
// non-bool flag, a stage key that is not an int, metadata holding tensors (their
// in-place changes are read by the Python path), more than 64 stages, or a payload
// larger than a slot. The caller then takes the Python path, which names a bad value.
PyObject* afd_ctrl_send_payload_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "ctrl_send_payload(ring_address, payload)");
    return nullptr;
  }
  auto* r = static_cast<afd_ctrl_ring*>(PyLong_AsVoidPtr(args[0]));
  if (PyErr_Occurred()) return nullptr;
  PyObject* payload = args[1];
  if (r == nullptr || g_payload_type == nullptr ||
      Py_TYPE(payload) != reinterpret_cast<PyTypeObject*>(g_payload_type))
    return PyLong_FromLong(-2);
  const int f0 = flag_bit(payload, kCapturing, 0), f1 = flag_bit(payload, kWarmup, 1),
            f2 = flag_bit(payload, kReplaying, 2), f3 = flag_bit(payload, kProfile, 3);
  if ((f0 | f1 | f2 | f3) < 0) return PyLong_FromLong(-2);
  PyObject* dp = PyObject_GetAttr(payload, g_names[kDp]);
  if (dp == nullptr) {
    PyErr_Clear();
    return PyLong_FromLong(-2);
  }
  long rc = -2;
  struct Stage {
    PyObject* key;
    PyObject* md;
  } st[kMaxNativeStages];
  Py_ssize_t n = 0;
  if (PyDict_CheckExact(dp) && PyDict_GET_SIZE(dp) <= kMaxNativeStages) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    bool plain = true;
    while (plain && PyDict_Next(dp, &pos, &k, &v)) {  // borrowed; dp is held
      plain = PyLong_CheckExact(k) && Py_TYPE(v) == reinterpret_cast<PyTypeObject*>(g_md_type);
      if (!plain) break;
      int overflow = 0;
      const long long key = PyLong_AsLongLongAndOverflow(k, &overflow);
      plain = overflow == 0 && key >= 0 && key <= 0xFFFFFFFFLL;
      // insertion sort by stage (a handful of stages)
      Py_ssize_t i = n++;
      while (plain && i > 0 && PyLong_AsLongLong(st[i - 1].key) > key) {
        st[i] = st[i - 1];
        --i;
      }
      st[i] = Stage{k, v};
    }
    uint8_t buf[2048];
    const uint64_t cap = r->slot_bytes < sizeof buf ? r->slot_bytes : sizeof buf;
    uint64_t off = 8;
    for (Py_ssize_t i = 0; plain && i < n; ++i) {
      PyObject* t = PyObject_GetAttr(st[i].md, g_names[kTensor]);
      PyObject* mt = t == nullptr ? nullptr : PyObject_GetAttr(st[i].md, g_names[kMaxTensor]);
      PyObject* counts = mt == nullptr ? nullptr : PyObject_GetAttr(st[i].md, g_names[kCounts]);
      PyObject* mx = counts == nullptr ? nullptr : PyObject_GetAttr(st[i].md, g_names[kMax]);
      plain = mx != nullptr && t == Py_None && mt == Py_None &&
              put_stage(buf, off, cap, st[i].key, mx, counts);
      Py_XDECREF(t);
      Py_XDECREF(mt);
      Py_XDECREF(counts);
      Py_XDECREF(mx);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (plain && cap >= 8) {
      put_head(buf, f0 | f1 | f2 | f3, n);
      rc = afd_ctrl_shm_publish(r, buf, static_cast<int>(off));
      if (rc < -1) rc = -2;
    }
  }
  Py_DECREF(dp);
  return PyLong_FromLong(rc);
}
