// The control plane's per-message path in native code: the waiting loops (so
// that a waiting FFN rank polls without holding the GIL), the shared-memory
// ring's single-slot publish and take, the tcp channel's one-frame send and
// read, the binary payload's encode from an AFDControlPayload's slots and the
// payload built from the bytes (no interpreter between the wire and the objects
// the caller hands on). Python calls the _C.ctrl_* functions (CPython functions,
// registered in bindings.cpp) one bounded slice at a time and does its liveness
// checks between slices. The ring layout is defined in afd_ext/control (package
// doc); the offsets below mirror it, and tests/test_control_plane.py checks that
// both sides read each other's slots.
#include <Python.h>
#include <structmember.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <pthread.h>
#include <sched.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
#include <cerrno>
#include <cstdint>
#include <cstring>

// The attention end's per-step send path (the SendFront call, the encode, the CRC, the publish)
// lives in one section of its own: a few pages, which the sender's keeper (below) reads whole.
#define AFD_SEND_PATH __attribute__((section("afd_ctrl_send")))

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

// CRC-32 (IEEE 802.3, reflected, as zlib.crc32). Whole 16-byte blocks fold with carry-less
// multiplies where the CPU has them (x86-64 PCLMULQDQ: ~30 ns for a 96-byte payload, where the
// table below takes ~0.5 us); the rest goes four bits at a time through a 64-byte table, one cache
// line (a byte table is sixteen, all cold after a long gap between steps).
constexpr std::array<uint32_t, 16> make_crc_table() {
  std::array<uint32_t, 16> t{};
  for (uint32_t i = 0; i < 16; ++i) {
    uint32_t c = i;
    for (int j = 0; j < 4; ++j) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}
alignas(64) constexpr auto kCrcTable = make_crc_table();

#if defined(__x86_64__)
// The register state `c` (inverted CRC) advanced over n bytes, n a nonzero multiple of 16: each
// block is folded into a 128-bit remainder, which is then reduced to 32 bits (Barrett). Constants:
// the bit-reflected folding and reduction constants of the IEEE polynomial from Gopal et al., "Fast
// CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction" (Intel, 2009).
AFD_SEND_PATH __attribute__((target("pclmul,sse4.1"))) uint32_t crc_fold_clmul(uint32_t c, const uint8_t* p, size_t n) {
  const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);  // fold by 128 bits
  const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124LL);                // 64 -> 32 bits
  const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);  // mu, P (Barrett)
  const __m128i mask32 = _mm_set_epi32(0, ~0, 0, ~0);
  __m128i x = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_cvtsi32_si128(static_cast<int>(c)));
  for (size_t off = 16; off < n; off += 16) {
    const __m128i lo = _mm_clmulepi64_si128(x, k3k4, 0x00);
    x = _mm_clmulepi64_si128(x, k3k4, 0x11);
    x = _mm_xor_si128(_mm_xor_si128(x, lo), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + off)));
  }
  x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, k3k4, 0x10));  // 128 -> 64 bits
  x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, mask32), k5, 0x00));
  __m128i t = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x, mask32), poly, 0x10), mask32);
  x = _mm_xor_si128(x, _mm_clmulepi64_si128(t, poly, 0x00));
  return static_cast<uint32_t>(_mm_extract_epi32(x, 1));
}

const bool kHaveClmul = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}();
#endif

// zlib.crc32(p[:n], crc)
inline uint32_t crc32_update(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
#if defined(__x86_64__)
  if (n >= 16 && kHaveClmul) {
    const size_t whole = n & ~static_cast<size_t>(15);
    crc = crc_fold_clmul(crc, p, whole);
    p += whole;
    n -= whole;
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    crc = kCrcTable[crc & 0xF] ^ (crc >> 4);
    crc = kCrcTable[crc & 0xF] ^ (crc >> 4);
  }
  return ~crc;
}

// zlib.crc32(payload, zlib.crc32(struct.pack("<QQII", seq, total, frag, sender)))
// (the fields and a payload of up to 1000 bytes in one buffer: whole blocks fold, where 24 bytes
// of fields alone would go through the table)
AFD_SEND_PATH inline uint32_t slot_crc(uint64_t seq, uint64_t total, uint32_t frag, uint32_t sender, const uint8_t* payload) {
  uint8_t buf[24 + 1000];
  std::memcpy(buf, &seq, 8);  // little-endian hosts only (x86-64, aarch64)
  std::memcpy(buf + 8, &total, 8);
  std::memcpy(buf + 16, &frag, 4);
  std::memcpy(buf + 20, &sender, 4);
  if (frag > sizeof buf - 24) return crc32_update(crc32_update(0, buf, 24), payload, frag);
  std::memcpy(buf + 24, payload, frag);
  return crc32_update(0, buf, 24 + static_cast<size_t>(frag));
}

// Spin until the shared 8-byte word at `word` equals `want` (acquire load), `max_ns`
// nanoseconds passed, or `*open_` became zero (the channel is being closed: its memory is
// about to go). Returns 1 when it matched, 0 on timeout, -1 when closing.
template <typename T>
int spin_u64(const uint64_t* word, uint64_t want, int64_t max_ns, T* const* open_) {
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return 1;
  const int64_t end = now_ns() + (max_ns > 0 ? max_ns : 0);
  for (;;) {
    for (int i = 0; i < kPollsPerClockRead; ++i) {
      if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return 1;
      if (__atomic_load_n(open_, __ATOMIC_RELAXED) == nullptr) return -1;
      cpu_relax();
    }
    if (now_ns() >= end) return __atomic_load_n(word, __ATOMIC_ACQUIRE) == want ? 1 : 0;
  }
}

// A native call in flight on a channel end: close() (another thread) clears the end's
// open marker, then waits until none is in flight before it unmaps or closes anything. The
// count is raised before the marker is read (both sequentially consistent, as close() does
// the reverse behind a full fence), so a call either sees the marker cleared or is waited for.
struct InFlight {
  uint32_t* n;
  explicit InFlight(uint32_t* count) : n(count) { __atomic_add_fetch(n, 1, __ATOMIC_SEQ_CST); }
  ~InFlight() { __atomic_sub_fetch(n, 1, __ATOMIC_SEQ_CST); }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
};

}  // namespace

extern "C" {

// A waiting receiver's rehearsal (warm_s): between slices of its native wait it checks and builds
// the last message it took again, with the GIL, and drops the result, so that a payload after a
// long gap finds that path's code and data in cache. Filled by Python (`WarmState`).
struct afd_ctrl_warm {
  int64_t warm_ns;      // the rehearsal period; 0: none
  uint8_t* last;        // the last message taken natively (in the end's copy or read buffer)
  uint64_t last_len;    // its length; 0: none kept (the buffer holds something else)
  uint64_t rehearsals;  // rehearsals done (tests read it)
  uint32_t sender;      // nonzero: also rehearse the attention end's send (encode and publish)
  uint32_t pad_;
  uint64_t sends;       // sender rehearsals that encoded and published (tests read it)
};

// One end of one ring, filled once by Python (afd_ext/control/channel.py, `RingState`).
// Python passes its address and plain ints. hdr is null once the channel is closed
// (every call then declines with -2 and the Python path names the state).
struct afd_ctrl_ring {
  uint64_t* hdr;        // the segment (its 256-byte header); null: closed
  uint64_t nslots;
  uint64_t stride;      // bytes from one slot to the next; slot i starts at hdr + 256 + i * stride
  uint64_t slot_bytes;  // payload capacity of a slot
  uint8_t* out;         // receiver: copy buffer of slot_bytes
  uint64_t k;           // the next message number (sent or taken); advanced on success (the one count)
  uint32_t local_rank;  // sender: the sender field it writes
  uint32_t pad0_;
  int64_t t_ns;         // CLOCK_MONOTONIC ns: sender, when the last publish began;
                        // receiver, when the poll saw the last message taken (the bench's phases)
  uint32_t expect_sender;  // receiver: the sender's world rank (another: -2, the Python path names it)
  int32_t bell_fd;         // sender: the doorbell socket, -1 none
  uint64_t max_msg;        // receiver: the largest message it takes (a longer one: -2)
  uint32_t bell_len;       // sender: length of bell_addr
  uint32_t stamps;         // nonzero: also stamp t_mark (the bench's finer phases)
  uint8_t bell_addr[112];  // sender: the receiver doorbell's sockaddr_un (abstract name)
  int64_t t_mark;          // with stamps: sender, when the native send was entered; receiver,
                           // when the GIL was back after a take (before the payload is built)
  uint32_t busy;           // native calls in flight on this end (InFlight; close() waits for 0)
  uint32_t pad_;
  afd_ctrl_warm warm;      // receiver: the rehearsal (last = out)
  int64_t t_built;         // with stamps, receiver: when the last payload taken was built
};

// One end of one TCP channel, filled once by Python (afd_ext/control/tcp.py, `TcpState`).
struct afd_ctrl_tcp {
  int32_t fd;              // the connected socket (non-blocking); -1: closed
  uint32_t local_rank;     // sender: the sender field it writes
  uint32_t expect_sender;  // receiver: the sender's world rank (another: the bytes go to Python)
  uint32_t busy;           // native calls in flight on this end (InFlight; close() waits for 0)
  uint64_t max_msg;        // the largest message body either end handles natively
  uint8_t* buf;            // receiver: read buffer of cap bytes
  uint64_t cap;
  int64_t t_ns;            // receiver: CLOCK_MONOTONIC ns when the poll saw the socket readable
  afd_ctrl_warm warm;      // receiver: the rehearsal (last: the last data frame's body in buf)
  void* proxy;             // sender: its send proxy (a Keeper, the mailbox in it) while one runs (set and cleared in C)
  int32_t warm_tx;         // receiver: a private loopback TCP pair the rehearsal sends a frame over
  int32_t warm_rx;         //   (-1: none)
  uint64_t warm_rounds;    // receiver: rehearsal rounds over that pair (tests read it)
  uint32_t send_lock;      // sender: 1 while a frame goes out (every frame takes it, the heartbeat's too)
  int32_t send_err;        // sender: errno of the last native send that failed part-way through a frame
  int64_t send_timeout_ns; // sender: the bound on a send's wait for the lock or for buffer space
  uint64_t send_rests;     // sender: frames the socket took in part whose rest the native send sent (tests)
  uint32_t pending;        // receiver: 1 while the Python path holds bytes of a started frame
  uint32_t pad_;
  int64_t msg_ns;          // receiver: CLOCK_MONOTONIC ns when the poll saw the last payload built natively
};

// Wake a receiver blocked on the doorbell (a datagram; a full queue means one is pending).
AFD_SEND_PATH inline void ring_bell(const afd_ctrl_ring* r) {
  if (r->bell_fd < 0) return;
  const char one = 1;
  (void)::sendto(r->bell_fd, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(r->bell_addr),
                 r->bell_len);
}

inline uint8_t* slot_of(const afd_ctrl_ring* r, uint64_t k) {
  return reinterpret_cast<uint8_t*>(r->hdr) + 256 + (k % r->nslots) * r->stride;
}

// Sender: publish a message of `n` <= slot_bytes bytes as message number r->k
// (the seqlock protocol of the package doc), stamp the heartbeat, advance r->k,
// and ring the doorbell when the receiver is blocked on it.
// Returns 0 when sent, -1 when the ring is full (nothing written; the caller
// waits for space), -2 when closed or too long (nothing written).
AFD_SEND_PATH __attribute__((visibility("default"))) int afd_ctrl_shm_publish(afd_ctrl_ring* r, const uint8_t* data, int n) {
  InFlight in_flight(&r->busy);
  uint64_t* hdr = __atomic_load_n(&r->hdr, __ATOMIC_SEQ_CST);
  const uint64_t k = r->k;
  if (hdr == nullptr || n < 0 || static_cast<uint64_t>(n) > r->slot_bytes) return -2;
  if (k - __atomic_load_n(&hdr[kReadCountWord], __ATOMIC_ACQUIRE) >= r->nslots) return -1;
  uint8_t* slot = slot_of(r, k);
  const uint32_t sender = r->local_rank;
  const int64_t t = now_ns();
  __atomic_store_n(&hdr[kHeartbeatWord], static_cast<uint64_t>(t), __ATOMIC_RELAXED);
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
  r->t_ns = t;
  __atomic_store_n(seq, want, __ATOMIC_RELEASE);
  r->k = k + 1;
  // Full fence: the publish is ordered before the read of the receiver's waiting flag.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(&hdr[kWaitingWord], __ATOMIC_RELAXED)) ring_bell(r);
  return 0;
}

// Receiver: wait up to `max_ns` for message number r->k, then copy a
// single-slot message into r->out, check it (seq unchanged, CRC), mark it
// consumed (read_count = k + 1) and advance r->k. Returns its length; -1 when
// nothing was published in time; -2
// when closed, or the slot is published but not a whole consistent single-slot
// message from the expected sender within max_msg (torn, corrupt, one fragment
// of a larger message, another sender: the caller reads it the slow way, which
// names the problem; r->k is unchanged).
__attribute__((visibility("default"))) int64_t afd_ctrl_shm_take(afd_ctrl_ring* r, int max_ns) {
  InFlight in_flight(&r->busy);
  uint64_t* hdr = __atomic_load_n(&r->hdr, __ATOMIC_SEQ_CST);
  if (hdr == nullptr) return -2;
  const uint64_t k = r->k;
  const uint8_t* slot = slot_of(r, k);
  uint8_t* out = r->out;
  const uint64_t slot_bytes = r->slot_bytes < r->max_msg ? r->slot_bytes : r->max_msg;
  const auto* seq = reinterpret_cast<const uint64_t*>(slot);
  const uint64_t want = 2 * k + 2;
  const int got = spin_u64(seq, want, max_ns, &r->hdr);
  if (got <= 0) return got == 0 ? -1 : -2;
  const int64_t seen = now_ns();
  for (int attempt = 0; attempt < 64; ++attempt) {
    uint64_t total;
    uint32_t frag, snd, crc;
    std::memcpy(&total, slot + 8, 8);
    std::memcpy(&frag, slot + 16, 4);
    std::memcpy(&snd, slot + 20, 4);
    std::memcpy(&crc, slot + 24, 4);
    if (frag > slot_bytes || total != frag || snd != r->expect_sender) return -2;
    r->warm.last_len = 0;  // out is overwritten
    std::memcpy(out, slot + kSlotHeader, frag);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(seq, __ATOMIC_RELAXED) == want && slot_crc(want, total, frag, snd, out) == crc) {
      r->t_ns = seen;
      r->k = k + 1;
      __atomic_store_n(&hdr[kReadCountWord], k + 1, __ATOMIC_RELEASE);
      r->warm.last = out;
      r->warm.last_len = frag;
      return static_cast<int64_t>(frag);
    }
    cpu_relax();
  }
  return -2;
}

}  // extern "C"

namespace {

// The payload classes (afd_ext.metadata), bound once by _C.ctrl_bind_types: the sends read
// them, the takes build them. g_md_none: the AFDDPMetadata slots a built one holds as None
// (all but _counts and _max, from the class's own __slots__, as AFDDPMetadata._trusted).
PyObject* g_payload_type = nullptr;
PyObject* g_md_type = nullptr;
PyObject* g_md_none = nullptr;
PyObject* g_names[9] = {};
enum { kDp, kCapturing, kWarmup, kReplaying, kProfile, kCounts, kMax, kTensor, kMaxTensor };
constexpr int kFlagName[4] = {kCapturing, kWarmup, kReplaying, kProfile};  // flag bit i
constexpr int kMaxNativeStages = 64;
constexpr size_t kMaxNativeBytes = 2048;  // the native encoders' stack buffer

// Where each bound attribute lives: the byte offset of its __slots__ member in an instance of
// its exact class (read and written in place: no attribute lookup touching the type's caches,
// since a step after a long gap runs on cold caches), or -1 (go through getattr/setattr).
Py_ssize_t g_off[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
std::vector<Py_ssize_t> g_none_off;  // per g_md_none name

Py_ssize_t member_offset(PyObject* type, PyObject* name) {
  PyObject* d = PyObject_GetAttr(type, name);  // on the class: the member descriptor itself
  Py_ssize_t off = -1;
  if (d != nullptr && PyObject_TypeCheck(d, &PyMemberDescr_Type)) {
    const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
    if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) off = m->offset;
  }
  if (d == nullptr) PyErr_Clear();
  Py_XDECREF(d);
  return off;
}

// getattr (a new reference; nullptr, error cleared, when unset) / setattr (0 on success) of a bound
// attribute on an instance of its exact class.
AFD_SEND_PATH PyObject* get_field(PyObject* o, Py_ssize_t off, PyObject* name) {
  if (off >= 0) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
    Py_XINCREF(v);
    return v;
  }
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

int set_field(PyObject* o, Py_ssize_t off, PyObject* name, PyObject* v) {
  if (off < 0) return PyObject_SetAttr(o, name, v);
  PyObject** at = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
  PyObject* old = *at;
  Py_INCREF(v);
  *at = v;
  Py_XDECREF(old);
  return 0;
}

inline PyObject* get_bound(PyObject* o, int name) { return get_field(o, g_off[name], g_names[name]); }
inline int set_bound(PyObject* o, int name, PyObject* v) { return set_field(o, g_off[name], g_names[name], v); }

// A new AFDDPMetadata holding `counts` (stolen) and `max_tokens`; nullptr with an error set.
PyObject* new_dp_metadata(PyObject* counts, uint32_t max_tokens) {
  auto* type = reinterpret_cast<PyTypeObject*>(g_md_type);
  PyObject* md = type->tp_alloc(type, 0);
  PyObject* mx = md == nullptr ? nullptr : PyLong_FromUnsignedLong(max_tokens);
  bool ok = mx != nullptr && set_bound(md, kCounts, counts) == 0 && set_bound(md, kMax, mx) == 0;
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(g_md_none); ++i)
    ok = set_field(md, g_none_off[i], PyTuple_GET_ITEM(g_md_none, i), Py_None) == 0;
  Py_XDECREF(mx);
  Py_DECREF(counts);
  if (!ok) {
    Py_XDECREF(md);
    return nullptr;
  }
  return md;
}

// Build an AFDControlPayload from a binary control payload (afd_ext.metadata.encode_control_binary)
// as afd_ext.metadata.control_payload_from_parts does, while the bytes are hot. Returns a new
// reference; Py_None (new reference) when it is not well formed (the Python decoder then names
// the problem); nullptr with an error set when Python failed (memory).
PyObject* build_payload(const uint8_t* d, int64_t n, long max_stages, long max_ranks) {
  if (g_payload_type == nullptr || n < 8 || std::memcmp(d, "AFDb", 4) != 0 || d[4] != 1 || d[5] > 0xF)
    Py_RETURN_NONE;
  uint16_t nstages;
  std::memcpy(&nstages, d + 6, 2);
  if (nstages > max_stages) Py_RETURN_NONE;
  PyObject* dp = PyDict_New();
  if (dp == nullptr) return nullptr;
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
      PyObject* md = new_dp_metadata(counts, mx);
      PyObject* key = md == nullptr ? nullptr : PyLong_FromUnsignedLong(st);
      const int rc = key == nullptr ? -1 : PyDict_SetItem(dp, key, md);
      Py_XDECREF(key);
      Py_XDECREF(md);
      if (rc != 0) goto fail;
    }
    off += 4 * static_cast<int64_t>(cnt);
    prev = st;
  }
  if (off != n) goto bad;
  {
    auto* type = reinterpret_cast<PyTypeObject*>(g_payload_type);
    PyObject* payload = type->tp_alloc(type, 0);
    bool ok = payload != nullptr && set_bound(payload, kDp, dp) == 0;
    for (int b = 0; ok && b < 4; ++b) ok = set_bound(payload, kFlagName[b], (d[5] >> b) & 1 ? Py_True : Py_False) == 0;
    Py_DECREF(dp);
    if (!ok) {
      Py_XDECREF(payload);
      return nullptr;
    }
    return payload;
  }
bad:
  Py_DECREF(dp);
  Py_RETURN_NONE;
fail:
  Py_DECREF(dp);
  return nullptr;
}

// The taken message `out[:n]` as Python returns it: the built payload when it parses (and
// max_stages >= 0), else its bytes.
PyObject* taken_message(const uint8_t* out, int64_t n, long max_stages, long max_ranks) {
  if (max_stages >= 0) {
    PyObject* built = build_payload(out, n, max_stages, max_ranks);
    if (built != Py_None) return built;  // a payload, or nullptr (error set)
    Py_DECREF(built);
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out), n);
}

volatile uint32_t g_rehearsal_sink;  // the rehearsal's CRC goes here, so that it is computed

int shm_send_payload(afd_ctrl_ring* r, PyObject* payload);  // below, with the sends

// The attention end's send (encode_payload, the CRC, the publish) of `payload`, on a ring private
// to this process that no one reads. On one host the two ends run the same compiled core, whose code
// pages are shared, so this keeps the sender's code in the last-level cache the cores share while the
// attention rank's thread runs its model (it cannot rehearse itself). GIL held (the one scratch ring).
bool rehearse_send(PyObject* payload) {
  constexpr uint64_t kScratchSlot = kSlotHeader + kMaxNativeBytes;
  alignas(64) static uint64_t seg[(256 + kScratchSlot) / 8];
  static afd_ctrl_ring ring = [] {
    afd_ctrl_ring r{};
    r.hdr = seg;
    r.nslots = 1;
    r.stride = kScratchSlot;
    r.slot_bytes = kMaxNativeBytes;
    r.bell_fd = -1;
    return r;
  }();
  seg[kReadCountWord] = ring.k;  // never full
  return shm_send_payload(&ring, payload) == 0;
}

// One rehearsal (GIL held): the take's CRC (shm) and the payload built from the kept message, then
// (w->sender) that payload sent as the attention end sends it (rehearse_send), and dropped. A message
// that does not build (raw bytes wanted: max_stages < 0) is not rehearsed.
void rehearse(afd_ctrl_warm* w, bool crc, long max_stages, long max_ranks) {
  if (crc) g_rehearsal_sink = crc32_update(0, w->last, w->last_len);
  PyObject* p = build_payload(w->last, static_cast<int64_t>(w->last_len), max_stages, max_ranks);
  if (p == nullptr) {
    PyErr_Clear();  // out of memory: the real take will say so
  } else {
    if (w->sender && p != Py_None && rehearse_send(p)) ++w->sends;
    Py_DECREF(p);
  }
  ++w->rehearsals;
}

constexpr int64_t kSignalled = -3;  // wait_rehearsing: a signal handler raised (error set)

// Wait up to max_ns: `slice(ns)` (called with the GIL released) returns -1 while nothing came, and
// between slices of at most warm_ns the last message is rehearsed with the GIL, after the signal
// handlers ran (as time.sleep does: Ctrl-C ends a long wait at once). Returns the last slice's
// result, or kSignalled when a handler raised (nothing was taken). Called and returns with the GIL held.
template <typename Slice>
int64_t wait_rehearsing(afd_ctrl_warm* w, bool crc, long max_ns, long max_stages, long max_ranks, Slice slice) {
  const int64_t end = now_ns() + max_ns;
  for (;;) {
    int64_t left = end - now_ns();
    if (left < 0) left = 0;
    const bool warm = max_stages >= 0 && w->warm_ns > 0 && w->last_len > 0 && w->warm_ns < left;
    const int64_t ns = warm ? w->warm_ns : left;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS r = slice(ns);
    Py_END_ALLOW_THREADS if (r != -1 || !warm) return r;
    if (PyErr_CheckSignals() != 0) return kSignalled;
    rehearse(w, crc, max_stages, max_ranks);
  }
}

// The end's state address, the first of a _C.ctrl_* call's `want` arguments (`sig` names them);
// false with a TypeError (another count) or the conversion's error set.
bool end_arg(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, const char* sig, void** end) {
  if (nargs != want) {
    PyErr_SetString(PyExc_TypeError, sig);
    return false;
  }
  *end = PyLong_AsVoidPtr(args[0]);
  return PyErr_Occurred() == nullptr;
}

bool take_args(PyObject* const* args, Py_ssize_t nargs, const char* sig, void** ptr, long* max_ns, long* ms, long* mr) {
  if (!end_arg(args, nargs, 4, sig, ptr)) return false;
  *max_ns = PyLong_AsLong(args[1]);
  *ms = PyLong_AsLong(args[2]);
  *mr = PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) return false;
  if (*ptr == nullptr) {
    PyErr_SetString(PyExc_ValueError, sig);
    return false;
  }
  *max_ns = *max_ns < 0 ? 0 : (*max_ns > 0x7FFFFFFFL ? 0x7FFFFFFFL : *max_ns);
  return true;
}

}  // namespace

namespace {

// The shm take: wait up to max_ns (GIL released, rehearsing), then the message built (see ctrl_take).
PyObject* shm_take(afd_ctrl_ring* r, long max_ns, long max_stages, long max_ranks) {
  const int64_t n = wait_rehearsing(&r->warm, true, max_ns, max_stages, max_ranks,
                                    [r](int64_t ns) { return afd_ctrl_shm_take(r, static_cast<int>(ns)); });
  if (n == kSignalled) return nullptr;
  if (n < 0) return PyLong_FromLongLong(n);
  if (r->stamps) r->t_mark = now_ns();
  PyObject* got = taken_message(r->out, n, max_stages, max_ranks);
  if (got == nullptr || PyBytes_CheckExact(got)) {
    r->warm.last_len = 0;  // only a built payload is rehearsed
  } else if (r->stamps) {
    r->t_built = now_ns();
  }
  return got;
}

}  // namespace

// _C.ctrl_take(ring_address, max_ns, max_stages, max_ranks): afd_ctrl_shm_take with the GIL
// released (rehearsing every warm_ns meanwhile), then the payload built while the bytes are hot. Returns -1 (nothing published in
// time) or -2 (read the slot the slow way) as an int; for a message taken, the AFDControlPayload
// when it parses, else (or with max_stages < 0: raw bytes wanted) the message bytes.
PyObject* afd_ctrl_take_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* p;
  long max_ns, max_stages, max_ranks;
  if (!take_args(args, nargs, "ctrl_take(ring_address, max_ns, max_stages, max_ranks)", &p, &max_ns, &max_stages,
                 &max_ranks))
    return nullptr;
  return shm_take(static_cast<afd_ctrl_ring*>(p), max_ns, max_stages, max_ranks);
}

// _C.ctrl_crc32(data, value): zlib.crc32(data, value) as the ring's native paths compute it.
PyObject* afd_ctrl_crc32_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyBytes_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "ctrl_crc32(data: bytes, value: int)");
    return nullptr;
  }
  const unsigned long v = PyLong_AsUnsignedLongMask(args[1]);
  if (PyErr_Occurred()) return nullptr;
  return PyLong_FromUnsignedLong(crc32_update(static_cast<uint32_t>(v),
                                              reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(args[0])),
                                              static_cast<size_t>(PyBytes_GET_SIZE(args[0]))));
}

// _C.ctrl_parse(data, max_stages, max_ranks): a binary control payload built as the takes build
// it (an AFDControlPayload), or None when it is not well formed.
PyObject* afd_ctrl_parse_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyBytes_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "ctrl_parse(data: bytes, max_stages, max_ranks)");
    return nullptr;
  }
  const long ms = PyLong_AsLong(args[1]), mr = PyLong_AsLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  return build_payload(reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(args[0])), PyBytes_GET_SIZE(args[0]), ms,
                       mr);
}

namespace {

// Append v as 4 little-endian bytes; false when it is not an int in [lo, hi].
AFD_SEND_PATH bool put_u32(PyObject* o, int64_t lo, int64_t hi, uint8_t* at) {
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
AFD_SEND_PATH bool put_stage(uint8_t* buf, uint64_t& off, uint64_t cap, PyObject* stage, PyObject* max_tokens, PyObject* counts) {
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

AFD_SEND_PATH void put_head(uint8_t* buf, long flags, Py_ssize_t nstages) {
  std::memcpy(buf, "AFDb", 4);
  buf[4] = 1;
  buf[5] = static_cast<uint8_t>(flags);
  const uint16_t ns = static_cast<uint16_t>(nstages);
  std::memcpy(buf + 6, &ns, 2);
}

// Encode control_payload_parts output (flags, ((stage, max_tokens, counts), ...)) into
// buf[:cap]; its length, or -1 when it does not fit or a value is out of range.
int64_t encode_parts(PyObject* flags_obj, PyObject* stages, uint8_t* buf, uint64_t cap) {
  const long flags = PyLong_AsLong(flags_obj);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  if (!PyTuple_CheckExact(stages)) return -1;
  const Py_ssize_t nstages = PyTuple_GET_SIZE(stages);
  if (flags < 0 || flags > 0xF || nstages > 0xFFFF || cap < 8) return -1;
  uint64_t off = 8;
  put_head(buf, flags, nstages);
  for (Py_ssize_t i = 0; i < nstages; ++i) {
    PyObject* st = PyTuple_GET_ITEM(stages, i);
    if (!PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 3 ||
        !put_stage(buf, off, cap, PyTuple_GET_ITEM(st, 0), PyTuple_GET_ITEM(st, 1), PyTuple_GET_ITEM(st, 2)))
      return -1;
  }
  return static_cast<int64_t>(off);
}

// Flag bit of a payload attribute that must be exactly True or False; -1 otherwise.
AFD_SEND_PATH int flag_bit(PyObject* payload, int bit) {
  PyObject* v = get_bound(payload, kFlagName[bit]);
  if (v == nullptr) return -1;
  const int r = v == Py_True ? (1 << bit) : (v == Py_False ? 0 : -1);
  Py_DECREF(v);
  return r;
}

// Encode an AFDControlPayload straight from its fields into buf[:cap] (no Python objects made,
// so a send after a long gap, on cold caches, touches little memory). Its length, or -1 for
// anything but the plain case: another payload class, a non-bool flag, a stage key that is not
// an int, metadata holding tensors (their in-place changes are read by the Python path), more
// than 64 stages, or a payload larger than cap. The caller then takes the Python path, which
// names a bad value.
AFD_SEND_PATH int64_t encode_payload(PyObject* payload, uint8_t* buf, uint64_t cap) {
  if (g_payload_type == nullptr || Py_TYPE(payload) != reinterpret_cast<PyTypeObject*>(g_payload_type) || cap < 8)
    return -1;
  int flags = 0;
  for (int b = 0; b < 4; ++b) {
    const int f = flag_bit(payload, b);
    if (f < 0) return -1;
    flags |= f;
  }
  PyObject* dp = get_bound(payload, kDp);
  if (dp == nullptr) return -1;
  int64_t len = -1;
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
    uint64_t off = 8;
    for (Py_ssize_t i = 0; plain && i < n; ++i) {
      PyObject* t = get_bound(st[i].md, kTensor);
      PyObject* mt = t == nullptr ? nullptr : get_bound(st[i].md, kMaxTensor);
      PyObject* counts = mt == nullptr ? nullptr : get_bound(st[i].md, kCounts);
      PyObject* mx = counts == nullptr ? nullptr : get_bound(st[i].md, kMax);
      plain = mx != nullptr && t == Py_None && mt == Py_None && put_stage(buf, off, cap, st[i].key, mx, counts);
      Py_XDECREF(t);
      Py_XDECREF(mt);
      Py_XDECREF(counts);
      Py_XDECREF(mx);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (plain) {
      put_head(buf, flags, n);
      len = static_cast<int64_t>(off);
    }
  }
  Py_DECREF(dp);
  return len;
}

// The shm sends: publish an encoded message (ring full: -1; anything else declined: -2).
PyObject* shm_publish_result(afd_ctrl_ring* r, const uint8_t* buf, int64_t n) {
  if (n < 0) return PyLong_FromLong(-2);
  const int rc = afd_ctrl_shm_publish(r, buf, static_cast<int>(n));
  return PyLong_FromLong(rc == -1 ? -1 : (rc < 0 ? -2 : 0));
}

}  // namespace

// _C.ctrl_send(ring_address, flags, stages): encode afd_ext.metadata.control_payload_parts output in
// the binary layout and publish it (afd_ctrl_shm_publish, doorbell included). Returns 0 when sent,
// -1 when the ring is full, -2 when closed, it does not fit one slot or a value is out of range
// (nothing written: the caller encodes it in Python, which names a bad value).
PyObject* afd_ctrl_send_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* end;
  if (!end_arg(args, nargs, 3, "ctrl_send(ring_address, flags, stages)", &end)) return nullptr;
  auto* r = static_cast<afd_ctrl_ring*>(end);
  if (r == nullptr) return PyLong_FromLong(-2);
  uint8_t buf[kMaxNativeBytes];
  const uint64_t cap = r->slot_bytes < sizeof buf ? r->slot_bytes : sizeof buf;
  return shm_publish_result(r, buf, encode_parts(args[1], args[2], buf, cap));
}

// _C.ctrl_bind_types(AFDControlPayload, AFDDPMetadata, md_none_slots): the classes the native
// sends read and the takes build, and the AFDDPMetadata slots a built one holds as None.
PyObject* afd_ctrl_bind_types_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "ctrl_bind_types(payload_type, dp_metadata_type, md_none_slots: tuple)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[2]); ++i) {
    if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(args[2], i))) {
      PyErr_SetString(PyExc_TypeError, "ctrl_bind_types: md_none_slots must be a tuple of str");
      return nullptr;
    }
  }
  static const char* const names[9] = {"dp_metadata_list", "is_graph_capturing", "is_warmup",
                                       "is_graph_replaying", "is_profile", "_counts", "_max", "_t", "_mt"};
  for (int i = 0; i < 9; ++i) {
    if (g_names[i] == nullptr && (g_names[i] = PyUnicode_InternFromString(names[i])) == nullptr) return nullptr;
  }
  for (int i = 0; i < 9; ++i) g_off[i] = member_offset(i < kCounts ? args[0] : args[1], g_names[i]);
  g_none_off.clear();
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[2]); ++i)
    g_none_off.push_back(member_offset(args[1], PyTuple_GET_ITEM(args[2], i)));
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_INCREF(args[2]);
  Py_XSETREF(g_payload_type, args[0]);
  Py_XSETREF(g_md_type, args[1]);
  Py_XSETREF(g_md_none, args[2]);
  Py_RETURN_NONE;
}

namespace {

// Encode an AFDControlPayload straight from its fields (encode_payload) and publish it, doorbell
// included: 0 sent, -1 ring full, -2 declined (closed, or anything but the plain case).
AFD_SEND_PATH int shm_send_payload(afd_ctrl_ring* r, PyObject* payload) {
  if (r == nullptr) return -2;
  if (r->stamps) r->t_mark = now_ns();
  // The header lines the publish reads (the receiver's count: written by it at every take, so a
  // miss) and writes (the heartbeat), fetched while the payload is encoded. A prefetch never faults.
  if (const uint64_t* hdr = __atomic_load_n(&r->hdr, __ATOMIC_RELAXED)) {
    __builtin_prefetch(&hdr[kReadCountWord], 0);
    __builtin_prefetch(&hdr[kHeartbeatWord], 1);
  }
  uint8_t buf[kMaxNativeBytes];
  const uint64_t cap = r->slot_bytes < sizeof buf ? r->slot_bytes : sizeof buf;
  const int64_t n = encode_payload(payload, buf, cap);
  if (n < 0) return -2;
  const int rc = afd_ctrl_shm_publish(r, buf, static_cast<int>(n));
  return rc == -1 ? -1 : (rc < 0 ? -2 : 0);
}

}  // namespace

// _C.ctrl_send_payload(ring_address, payload): encode an AFDControlPayload straight from its
// fields (encode_payload) and publish it, doorbell included: one call. Returns as ctrl_send.
PyObject* afd_ctrl_send_payload_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* end;
  if (!end_arg(args, nargs, 2, "ctrl_send_payload(ring_address, payload)", &end)) return nullptr;
  return PyLong_FromLong(shm_send_payload(static_cast<afd_ctrl_ring*>(end), args[1]));
}

// ---------------------------------------------------------------------------
// The per-step fronts: callables a caller binds as its own per-step send / receive (the control
// plane binds them on its instance). One object holds the ring and the callbacks, so that a step
// after a long gap, on cold caches, touches one object's lines on its way into C (a
// functools.partial touched itself, its argument tuple, the ints in it and the function).
// ---------------------------------------------------------------------------

namespace {

struct Front {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  void* end;            // the end's RingState / TcpState (kept alive by owner)
  long max_stages;      // take: the builds' bounds
  long max_ranks;
  PyObject* first;     // send: check (or None); take: prepare
  PyObject* fallback;  // the caller's checked path
  PyObject* owner;     // the channel: holds the RingState and its mapping while the front lives
};

int front_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* f = reinterpret_cast<Front*>(self);
  Py_VISIT(f->first);
  Py_VISIT(f->fallback);
  Py_VISIT(f->owner);
  return 0;
}

int front_clear(PyObject* self) {
  auto* f = reinterpret_cast<Front*>(self);
  Py_CLEAR(f->first);
  Py_CLEAR(f->fallback);
  Py_CLEAR(f->owner);
  return 0;
}

void front_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  front_clear(self);
  Py_TYPE(self)->tp_free(self);
}

// (ring_address, first, fallback, owner[, max_stages, max_ranks]) into a new front of `type`.
PyObject* front_new(PyTypeObject* type, PyObject* args, PyObject* kwds, vectorcallfunc call, int nargs,
                    const char* sig) {
  if ((kwds != nullptr && PyDict_GET_SIZE(kwds) != 0) || PyTuple_GET_SIZE(args) != nargs) {
    PyErr_SetString(PyExc_TypeError, sig);
    return nullptr;
  }
  void* end = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, 0));
  long ms = 0, mr = 0;
  if (nargs == 6) {
    ms = PyLong_AsLong(PyTuple_GET_ITEM(args, 4));
    mr = PyLong_AsLong(PyTuple_GET_ITEM(args, 5));
  }
  if (PyErr_Occurred()) return nullptr;
  if (end == nullptr) {
    PyErr_SetString(PyExc_ValueError, sig);
    return nullptr;
  }
  auto* f = reinterpret_cast<Front*>(type->tp_alloc(type, 0));
  if (f == nullptr) return nullptr;
  f->vectorcall = call;
  f->end = end;
  f->max_stages = ms;
  f->max_ranks = mr;
  f->first = Py_NewRef(PyTuple_GET_ITEM(args, 1));
  f->fallback = Py_NewRef(PyTuple_GET_ITEM(args, 2));
  f->owner = Py_NewRef(PyTuple_GET_ITEM(args, 3));
  return reinterpret_cast<PyObject*>(f);
}

// send_front(payload): first(payload) unless first is None (its error is raised, nothing sent),
// then the payload published as ctrl_send_payload does; whatever that declines (ring full, closed,
// not the plain case) goes to fallback(payload), whose result is returned (else None).
// The send fronts' first step (shm and tcp): one positional payload, check(payload) unless None.
// The payload (borrowed), or nullptr with the error set.
AFD_SEND_PATH PyObject* send_front_checked(Front* f, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != nullptr) {
    PyErr_SetString(PyExc_TypeError, "send_front(payload)");
    return nullptr;
  }
  if (f->first != Py_None) {
    PyObject* ok = PyObject_CallOneArg(f->first, args[0]);
    if (ok == nullptr) return nullptr;
    Py_DECREF(ok);
  }
  return args[0];
}

// The take fronts' first step (shm and tcp): no arguments; prepare()'s slice in ns (0: none), or
// -1 with the error set.
long take_front_ns(Front* f, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 0 || kwnames != nullptr) {
    PyErr_SetString(PyExc_TypeError, "take_front() takes no arguments");
    return -1;
  }
  PyObject* ns_obj = PyObject_CallNoArgs(f->first);
  if (ns_obj == nullptr) return -1;
  const long ns = PyLong_AsLong(ns_obj);
  Py_DECREF(ns_obj);
  if (ns == -1 && PyErr_Occurred()) return -1;
  return ns > 0x7FFFFFFFL ? 0x7FFFFFFFL : (ns < 0 ? 0 : ns);
}

// The take fronts' last step: fallback(got) (got released), its result.
PyObject* take_front_fallback(Front* f, PyObject* got) {
  PyObject* res = PyObject_CallOneArg(f->fallback, got);
  Py_DECREF(got);
  return res;
}

AFD_SEND_PATH PyObject* send_front_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* f = reinterpret_cast<Front*>(self);
  PyObject* payload = send_front_checked(f, args, nargsf, kwnames);
  if (payload == nullptr) return nullptr;
  if (shm_send_payload(static_cast<afd_ctrl_ring*>(f->end), payload) == 0) Py_RETURN_NONE;
  return PyObject_CallOneArg(f->fallback, payload);
}

// take_front(): ns = first() (prepare: an int, how long the first slice may wait; 0: none); then,
// as ctrl_take, the payload built within it is returned; whatever else the slice took (an int:
// nothing; bytes: a message it could not build, consumed) is handed to fallback(taken) (None when
// there was no slice), whose result is returned: the caller's checked path, which waits on and
// names every error.
PyObject* take_front_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* f = reinterpret_cast<Front*>(self);
  (void)args;
  const long ns = take_front_ns(f, nargsf, kwnames);
  if (ns < 0) return nullptr;
  PyObject* got = Py_NewRef(Py_None);
  if (ns > 0) {
    Py_DECREF(got);
    got = shm_take(static_cast<afd_ctrl_ring*>(f->end), ns, f->max_stages, f->max_ranks);
    if (got == nullptr || !(PyLong_CheckExact(got) || PyBytes_CheckExact(got))) return got;  // built, or an error
  }
  return take_front_fallback(f, got);
}

constexpr const char* kSendSig = "SendFront(ring_address, check, fallback, owner)";
constexpr const char* kTakeSig = "TakeFront(ring_address, prepare, fallback, owner, max_stages, max_ranks)";

PyObject* send_front_new(PyTypeObject* t, PyObject* a, PyObject* k) { return front_new(t, a, k, send_front_call, 4, kSendSig); }
PyObject* take_front_new(PyTypeObject* t, PyObject* a, PyObject* k) { return front_new(t, a, k, take_front_call, 6, kTakeSig); }

PyMemberDef front_members[] = {
    {"channel", T_OBJECT, offsetof(Front, owner), READONLY, "the channel whose ring this front uses"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject make_front_type(const char* name, const char* doc, newfunc make) {
  PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = name;
  t.tp_basicsize = sizeof(Front);
  t.tp_dealloc = front_dealloc;
  t.tp_vectorcall_offset = offsetof(Front, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_doc = doc;
  t.tp_traverse = front_traverse;
  t.tp_clear = front_clear;
  t.tp_members = front_members;
  t.tp_new = make;
  return t;
}

PyTypeObject g_send_front_type = make_front_type(
    "afd_ext._C.SendFront",
    "SendFront(ring_address, check, fallback, owner): a shared-memory end's per-step send, "
    "front(payload) (see afd_ext/control/shm.py).",
    send_front_new);
PyTypeObject g_take_front_type = make_front_type(
    "afd_ext._C.TakeFront",
    "TakeFront(ring_address, prepare, fallback, owner, max_stages, max_ranks): a shared-memory end's "
    "per-step receive, front() (see afd_ext/control/shm.py).",
    take_front_new);

}  // namespace

// ---------------------------------------------------------------------------
// The sender's keeper: the attention rank's thread runs its model between two steps, so it cannot
// rehearse its send; after a long gap the send's code, the tables and the ring's lines have left the
// last-level cache on a busy host (issue 16: 6.8 us for the send with the LLC evicted, 2.5 us with
// only the core's own caches cold; scripts/diag/control_cold.py). A native thread of the attention
// process, on another CPU than the sending thread and holding no GIL, reads every cache line of the
// send path every period while sends come (and rests after idle_ns without one), which keeps those
// lines and their page-table lines in the shared cache. It reads, never writes.
// ---------------------------------------------------------------------------

extern "C" const char __start_afd_ctrl_send[] __attribute__((weak, visibility("hidden")));
extern "C" const char __stop_afd_ctrl_send[] __attribute__((weak, visibility("hidden")));

namespace {

constexpr const char* kKeeperCapsule = "afd_ext.control.keeper";
constexpr int64_t kKeeperRestNs = 50'000'000;  // while idle: how often the keeper looks for a send

constexpr size_t kTcpHdr = 20;  // a TCP frame's header (afd_ext/control/tcp.py)

// A tcp sender's mailbox to its proxy: one frame at a time (the caller holds the channel's send
// lock). state: empty -> posted (caller) -> taken (proxy, CAS) -> done (proxy) -> empty (caller); a
// posted frame not yet taken may be withdrawn (CAS back to empty) and sent by the caller itself.
enum : uint32_t { kMailEmpty = 0, kMailPosted = 1, kMailTaken = 2, kMailDone = 3 };
struct TcpMail {
  alignas(64) std::atomic<uint32_t> state{kMailEmpty};
  std::atomic<uint32_t> spinning{0};  // 1 while the proxy spins on the mailbox (it takes at once)
  std::atomic<int> cpu{-1};           // the CPU the proxy last ran on (a caller there sends itself)
  std::atomic<int64_t> last_ns{0};    // when the last send came (the proxy's activity clock)
  int64_t sent = 0;                   // proxy: send()'s return for the frame taken
  int err = 0;                        //        and its errno
  uint32_t len = 0;
  std::atomic<uint64_t> served{0};    // frames the proxy sent (tests read it)
  uint8_t frame[kTcpHdr + kMaxNativeBytes];
};

// A native thread of the attention process on another CPU than the one that started it, holding
// no GIL. shm (ring): the keeper; tcp (tcp, mail): the send proxy (below, with the TCP code).
struct Keeper {
  afd_ctrl_ring* ring = nullptr;
  afd_ctrl_tcp* tcp = nullptr;      // the proxy's end (valid while hold is held)
  TcpMail* mail = nullptr;
  int warm_tx = -1, warm_rx = -1;  // proxy: its private loopback pair
  PyObject* hold = nullptr;  // what keeps the end and its memory alive (released after the join)
  int64_t period_ns = 0, idle_ns = 0;
  int creator_cpu = -1;
  std::vector<int> cpus;     // given: the CPUs it runs on (else any allowed but creator_cpu)
  uint64_t fork_gen = 0;     // g_fork_gen when started (a forked child has no thread)
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> passes{0};  // -1: not started (no CPU but the sending thread's)
  std::thread th;
  ~Keeper() { delete mail; }
};

std::atomic<uint64_t> g_fork_gen{0};  // bumped in a forked child (pthread_atfork)

volatile uint64_t g_keeper_sink;

void read_lines(const void* p, size_t n, uint64_t& sink) {
  const auto* b = static_cast<const volatile uint8_t*>(p);
  for (size_t o = 0; o < n; o += 64) sink += b[o];
}

// The send path's code and tables and the libpython entry points it calls (both kinds).
void read_send_path(uint64_t& sink) {
  if (__start_afd_ctrl_send != nullptr && __stop_afd_ctrl_send > __start_afd_ctrl_send)
    read_lines(__start_afd_ctrl_send, static_cast<size_t>(__stop_afd_ctrl_send - __start_afd_ctrl_send), sink);
  const void* entries[] = {reinterpret_cast<const void*>(&PyDict_Next),
                           reinterpret_cast<const void*>(&PyLong_AsLongLongAndOverflow),
                           reinterpret_cast<const void*>(&PyLong_AsLongLong),
                           reinterpret_cast<const void*>(&PyErr_Occurred),
                           reinterpret_cast<const void*>(&PyObject_CallOneArg),
                           reinterpret_cast<const void*>(&clock_gettime)};
  for (const void* e : entries) read_lines(e, 256, sink);
  read_lines(kCrcTable.data(), sizeof kCrcTable, sink);
  read_lines(g_off, sizeof g_off, sink);
  read_lines(&g_payload_type, sizeof g_payload_type, sink);
}

// One pass: the send path, the ring's state and its segment (under InFlight, as every native
// call: close() waits for it, then unmaps).
void keeper_pass(afd_ctrl_ring* r) {
  uint64_t sink = 0;
  read_send_path(sink);
  read_lines(r, sizeof *r, sink);
  {
    InFlight in_flight(&r->busy);
    if (const uint64_t* hdr = __atomic_load_n(&r->hdr, __ATOMIC_SEQ_CST))
      read_lines(hdr, 256 + r->nslots * r->stride, sink);
  }
  g_keeper_sink = sink;
}

// Move the calling (keeper) thread to its given CPUs, or off the creator's CPU; false (passes -1)
// when no CPU is left or the given ones are not allowed.
bool keeper_pin(Keeper* k) {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (!k->cpus.empty()) {
    for (int c : k->cpus)
      if (c < CPU_SETSIZE) CPU_SET(c, &cpus);
  } else if (sched_getaffinity(0, sizeof cpus, &cpus) != 0) {
    CPU_ZERO(&cpus);
  }
  if (k->cpus.empty() && k->creator_cpu >= 0) CPU_CLR(k->creator_cpu, &cpus);  // never the sending thread's CPU
  if (CPU_COUNT(&cpus) == 0 || sched_setaffinity(0, sizeof cpus, &cpus) != 0) {
    k->passes.store(-1);
    return false;
  }
  return true;
}

void keeper_run(Keeper* k) {
  if (!keeper_pin(k)) return;
  uint64_t seen = __atomic_load_n(&k->ring->k, __ATOMIC_RELAXED);
  int64_t last_send = now_ns();
  std::unique_lock<std::mutex> lock(k->mu);
  while (!k->stop) {
    const uint64_t now_k = __atomic_load_n(&k->ring->k, __ATOMIC_RELAXED);
    const int64_t t = now_ns();
    if (now_k != seen) {
      seen = now_k;
      last_send = t;
    }
    const bool active = t - last_send < k->idle_ns;
    if (active) {
      lock.unlock();
      keeper_pass(k->ring);
      k->passes.fetch_add(1, std::memory_order_relaxed);
      lock.lock();
    }
    k->cv.wait_for(lock, std::chrono::nanoseconds(active ? k->period_ns : kKeeperRestNs), [k] { return k->stop.load(); });
  }
}

// Stop and join, then let go of what it held (idempotent); GIL held: the thread never takes it.
// A tcp sender's calls stop using the proxy first (they run with the GIL, as this does).
void keeper_stop(Keeper* k) {
  // Once: after the first stop the end's memory may be gone (hold released).
  if (k->tcp != nullptr && k->hold != nullptr) __atomic_store_n(&k->tcp->proxy, nullptr, __ATOMIC_SEQ_CST);
  {
    std::lock_guard<std::mutex> lock(k->mu);
    k->stop = true;
  }
  k->cv.notify_all();
  if (k->th.joinable() && k->fork_gen != g_fork_gen.load()) {
    // A forked child's copy: the thread is the parent's, and the child's libc has reclaimed its
    // descriptor, which a thread of the child's may reuse (same handle): neither join nor detach it,
    // leak the handle.
    new std::thread(std::move(k->th));
  } else if (k->th.joinable()) {
    Py_BEGIN_ALLOW_THREADS k->th.join();
    Py_END_ALLOW_THREADS
  }
  Py_CLEAR(k->hold);  // the end's memory may go now, whoever still holds the capsule
}

void keeper_capsule_free(PyObject* cap) {
  auto* k = static_cast<Keeper*>(PyCapsule_GetPointer(cap, kKeeperCapsule));
  if (k == nullptr) {
    PyErr_Clear();
    return;
  }
  keeper_stop(k);
  delete k;
}

Keeper* keeper_of(PyObject* cap) {
  return PyCapsule_IsValid(cap, kKeeperCapsule) ? static_cast<Keeper*>(PyCapsule_GetPointer(cap, kKeeperCapsule))
                                                : nullptr;
}

// The optional CPUs argument of the start functions: None, or a tuple of ints >= 0 (false with a
// TypeError / ValueError set otherwise).
bool parse_cpus(PyObject* o, std::vector<int>& out) {
  if (o == Py_None) return true;
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) == 0) {
    PyErr_SetString(PyExc_TypeError, "keeper cpus: None or a non-empty tuple of CPU numbers");
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) {
    const long c = PyLong_AsLong(PyTuple_GET_ITEM(o, i));
    if (c == -1 && PyErr_Occurred()) return false;
    if (c < 0 || c >= CPU_SETSIZE) {
      PyErr_Format(PyExc_ValueError, "keeper cpus: %ld is not a CPU number", c);
      return false;
    }
    out.push_back(static_cast<int>(c));
  }
  return true;
}

// Start `run` on a thread for `k` (filled but for the thread); a capsule (freed: stopped), or
// nullptr with an error set (k freed, its hold released).
PyObject* keeper_launch(Keeper* k, void (*run)(Keeper*)) {
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { g_fork_gen.fetch_add(1); }); });
  k->creator_cpu = sched_getcpu();
  k->fork_gen = g_fork_gen.load();
  PyObject* cap = PyCapsule_New(k, kKeeperCapsule, keeper_capsule_free);
  if (cap == nullptr) {
    Py_CLEAR(k->hold);
    delete k;
    return nullptr;
  }
  try {
    k->th = std::thread(run, k);
  } catch (const std::exception& e) {
    Py_DECREF(cap);
    PyErr_Format(PyExc_RuntimeError, "afd_ext control plane: no keeper thread (%s)", e.what());
    return nullptr;
  }
  return cap;
}

}  // namespace

// The start functions' common arguments: args[1] hold, args[2] period_ns (> 0), args[3] idle_ns
// (>= 0), args[cpus_at] cpus when nargs > cpus_at. A new Keeper holding them, or nullptr with a
// TypeError / ValueError set (`what` names the rest of the call's contract).
static Keeper* keeper_new(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t cpus_at, const char* what) {
  std::vector<int> cpus;
  if (nargs > cpus_at && !parse_cpus(args[cpus_at], cpus)) return nullptr;
  const long long period = PyLong_AsLongLong(args[2]);
  const long long idle = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  if (period <= 0 || idle < 0) {
    PyErr_Format(PyExc_ValueError, "%s, period_ns > 0 and idle_ns >= 0", what);
    return nullptr;
  }
  auto* k = new Keeper();
  k->cpus = std::move(cpus);
  k->hold = Py_NewRef(args[1]);
  k->period_ns = period;
  k->idle_ns = idle;
  return k;
}

// Passes as the Python functions report them: -1 for a forked child's copy (no thread here).
static long long keeper_passes_here(const Keeper* k) {
  return k->fork_gen != g_fork_gen.load() ? -1 : k->passes.load();
}

// _C.ctrl_keeper_start(ring_address, hold, period_ns, idle_ns[, cpus]): start the sender's keeper of
// the ring (a sender's RingState) on a thread of its own, on `cpus` (a tuple; None or left out: any
// allowed CPU but the calling thread's);
// `hold` is kept alive until it is stopped (what owns the ring and its segment). Returns a capsule
// (freed: stopped). TypeError / ValueError on bad arguments, before anything starts.
PyObject* afd_ctrl_keeper_start_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 && nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "ctrl_keeper_start(ring_address, hold, period_ns, idle_ns[, cpus])");
    return nullptr;
  }
  auto* r = static_cast<afd_ctrl_ring*>(PyLong_AsVoidPtr(args[0]));
  if (PyErr_Occurred()) return nullptr;
  if (r == nullptr) {
    PyErr_SetString(PyExc_ValueError, "ctrl_keeper_start: a ring address, period_ns > 0 and idle_ns >= 0");
    return nullptr;
  }
  Keeper* k = keeper_new(args, nargs, 4, "ctrl_keeper_start: a ring address");
  if (k == nullptr) return nullptr;
  k->ring = r;
  return keeper_launch(k, keeper_run);
}

// _C.ctrl_keeper_passes(keeper): the passes made so far; -1 when it is not running in this process
// (no allowed CPU but the one that started it, or the given CPUs not allowed; a forked child's copy).
PyObject* afd_ctrl_keeper_passes_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Keeper* k = nargs == 1 ? keeper_of(args[0]) : nullptr;
  if (k == nullptr) {
    PyErr_SetString(PyExc_TypeError, "ctrl_keeper_passes(keeper)");
    return nullptr;
  }
  return PyLong_FromLongLong(keeper_passes_here(k));
}

// _C.ctrl_keeper_stop(keeper): stop and join it (idempotent); returns its passes (as ctrl_keeper_passes).
PyObject* afd_ctrl_keeper_stop_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Keeper* k = nargs == 1 ? keeper_of(args[0]) : nullptr;
  if (k == nullptr) {
    PyErr_SetString(PyExc_TypeError, "ctrl_keeper_stop(keeper)");
    return nullptr;
  }
  keeper_stop(k);
  return PyLong_FromLongLong(keeper_passes_here(k));
}

// ---------------------------------------------------------------------------
// TCP: one frame per call (afd_ext/control/tcp.py: magic u32 | type u32 | sender u32 | length u64, body)
// ---------------------------------------------------------------------------


namespace {

constexpr uint32_t kTcpMagic = 0xAFDC7C01u;
constexpr uint32_t kTcpData = 2;
constexpr uint32_t kTcpHeartbeat = 3;
constexpr int kClosed = -(1 << 30);  // tcp_wait_readable: the end is being closed

// Poll the end's socket until it is readable (or hung up / in error), `max_ns` passed, or the end
// is being closed (fd -1). Returns 1 readable, 0 timeout, kClosed, or -errno when poll() failed.
// The caller holds an InFlight on it.
int tcp_wait_readable(const afd_ctrl_tcp* t, long max_ns) {
  const int64_t end = now_ns() + (max_ns > 0 ? max_ns : 0);
  for (;;) {
    const int fd = __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST);
    if (fd < 0) return kClosed;
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, 0);
    if (r > 0) return 1;
    if (r < 0 && errno != EINTR) return -errno;
    if (now_ns() >= end) return 0;
    cpu_relax();
  }
}

void put_tcp_header(uint8_t* at, uint32_t sender, uint64_t len) {
  const uint32_t magic = kTcpMagic, type = kTcpData;
  std::memcpy(at, &magic, 4);
  std::memcpy(at + 4, &type, 4);
  std::memcpy(at + 8, &sender, 4);
  std::memcpy(at + 12, &len, 8);
}

// After a long gap the kernel's TCP path is what is cold, on the CPU that runs it: on the H200 host
// a loopback frame's send() took 29-39 us p50 and its recv() 27-32 us at 20-50 ms gaps, 5-7 us and
// 2-3 us on a CPU that ran a round like this every 0.5 ms meanwhile (scripts/diag/tcp_gap.c).
alignas(64) const uint8_t kZeroFrame[kTcpHdr + kMaxNativeBytes] = {};

// One round over a private loopback pair: the first n bytes of kZeroFrame sent on tx and read back
// on rx (loopback delivers them within the send), dropped.
void loopback_round(int tx, int rx, size_t n) {
  ssize_t s;
  do {
    s = ::send(tx, kZeroFrame, n, MSG_DONTWAIT | MSG_NOSIGNAL);
  } while (s < 0 && errno == EINTR);
  uint8_t sink[4096];
  for (int i = 0; i < 8; ++i) {  // drain what is there
    const ssize_t r = ::recv(rx, sink, sizeof sink, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EINTR)) break;
  }
}

// A waiting receiver's round (between two slices of its wait, as the rehearsal): its recv() path,
// with a frame of the last one's size. The caller holds an InFlight.
void tcp_warm_round(afd_ctrl_tcp* t) {
  if (t->warm.warm_ns <= 0 || t->warm_tx < 0 || t->warm_rx < 0 || __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST) < 0)
    return;
  const uint64_t n = kTcpHdr + (t->warm.last_len ? t->warm.last_len : 64);  // a frame built natively may be
  loopback_round(t->warm_tx, t->warm_rx, n < sizeof kZeroFrame ? n : sizeof kZeroFrame);  // larger than the encoder's
  ++t->warm_rounds;
}

constexpr int64_t kProxyTakeNs = 1'000'000;      // a posted frame not taken by then: sent by the caller
constexpr int64_t kProxyStallNs = 5'000'000'000;  // a taken frame not sent by then: an error

// Proxy: send the posted frame (when it is still posted) on the end's socket, as the caller would.
void proxy_serve(Keeper* k, uint32_t& round_len) {
  TcpMail* m = k->mail;
  uint32_t want = kMailPosted;
  if (!m->state.compare_exchange_strong(want, kMailTaken)) return;  // withdrawn by the caller
  afd_ctrl_tcp* t = k->tcp;
  ssize_t sent = -1;
  int err = EBADF;
  {
    InFlight in_flight(&t->busy);
    const int fd = __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST);
    if (fd >= 0) {
      do {
        sent = ::send(fd, m->frame, m->len, MSG_DONTWAIT | MSG_NOSIGNAL);
      } while (sent < 0 && errno == EINTR);
      err = sent < 0 ? errno : 0;
    }
  }
  round_len = m->len;
  m->sent = sent;
  m->err = err;
  m->served.fetch_add(1, std::memory_order_relaxed);
  m->state.store(kMailDone, std::memory_order_release);
}

// The tcp sender's proxy: a frame's send() from the attention rank's own thread after a long gap
// costs what the kernel's cold TCP path costs there (above), so while sends come (one less than
// idle_ns ago) the proxy spins on its mailbox on another CPU, sends each posted frame itself, and
// every period_ns runs a loopback round on its private pair and reads the send path; then it rests
// (the caller sends itself, and its send's stamp wakes the proxy within kKeeperRestNs).
void proxy_run(Keeper* k) {
  if (!keeper_pin(k)) return;
  TcpMail* m = k->mail;
  uint32_t round_len = kTcpHdr + 64;
  int64_t next_warm = 0;
  while (!k->stop.load()) {
    if (now_ns() - m->last_ns.load(std::memory_order_relaxed) >= k->idle_ns) {
      std::unique_lock<std::mutex> lock(k->mu);
      k->cv.wait_for(lock, std::chrono::nanoseconds(kKeeperRestNs), [k] { return k->stop.load(); });
      continue;
    }
    m->cpu.store(sched_getcpu(), std::memory_order_relaxed);
    m->spinning.store(1);
    for (int polls = 0;;) {
      if (m->state.load(std::memory_order_acquire) == kMailPosted) {
        proxy_serve(k, round_len);
        continue;
      }
      if (++polls < kPollsPerClockRead) {
        cpu_relax();
        continue;
      }
      polls = 0;
      if (k->stop.load(std::memory_order_relaxed)) break;
      const int64_t t = now_ns();
      if (t - m->last_ns.load(std::memory_order_relaxed) >= k->idle_ns) break;
      if (t >= next_warm) {
        uint64_t sink = 0;
        read_send_path(sink);
        read_lines(k->tcp, sizeof *k->tcp, sink);
        g_keeper_sink = sink;
        loopback_round(k->warm_tx, k->warm_rx, round_len);
        m->cpu.store(sched_getcpu(), std::memory_order_relaxed);
        k->passes.fetch_add(1, std::memory_order_relaxed);
        next_warm = now_ns() + k->period_ns;
      }
    }
    // Cleared, then the mailbox read once more (both sequentially consistent): a caller that posted
    // after reading spinning == 1 is served here, one that reads 0 after posting withdraws.
    m->spinning.store(0);
    if (m->state.load() == kMailPosted) proxy_serve(k, round_len);
  }
}

// Caller (GIL held, the channel's send lock held): hand the frame to the end's proxy when it spins.
// close() stops the proxy with the GIL held, so it cannot free the mailbox under this wait (which
// keeps the GIL); a build without the GIL would need the send lock in close() first.
// 1: the proxy sent it (*sent, *err as send() left them); 0: not handed over (the caller sends it);
// -1: the proxy took it and has not sent it within kProxyStallNs.
int proxy_send(Keeper* k, const uint8_t* frame, size_t len, ssize_t* sent, int* err) {
  TcpMail* m = k->mail;
  m->last_ns.store(now_ns(), std::memory_order_relaxed);
  if (k->fork_gen != g_fork_gen.load(std::memory_order_relaxed) || m->spinning.load(std::memory_order_relaxed) == 0 ||
      m->state.load(std::memory_order_relaxed) != kMailEmpty || sched_getcpu() == m->cpu.load(std::memory_order_relaxed))
    return 0;  // a forked child (no thread), a resting proxy, one still holding a stalled frame, or one on
               // this thread's CPU (it could not run while this waits)
  std::memcpy(m->frame, frame, len);
  m->len = static_cast<uint32_t>(len);
  m->state.store(kMailPosted);
  uint32_t want = kMailPosted;
  if (m->spinning.load() == 0 && m->state.compare_exchange_strong(want, kMailEmpty)) return 0;
  const int64_t t0 = now_ns();
  for (int polls = 0;;) {
    const uint32_t st = m->state.load(std::memory_order_acquire);
    if (st == kMailDone) break;
    if (++polls < kPollsPerClockRead) {
      cpu_relax();
      continue;
    }
    polls = 0;
    const int64_t waited = now_ns() - t0;
    want = kMailPosted;
    if (st == kMailPosted && waited > kProxyTakeNs && m->state.compare_exchange_strong(want, kMailEmpty)) return 0;
    if (waited > kProxyStallNs) return -1;
  }
  *sent = static_cast<ssize_t>(m->sent);
  *err = m->err;
  m->state.store(kMailEmpty, std::memory_order_release);
  return 1;
}

// TCP send results (ctrl_tcp_send_payload, TcpSendFront; afd_ext/control/tcp.py names them).
constexpr int kTcpSent = 0;
constexpr int kTcpDeclined = -2;  // nothing sent: closed, not the plain case, no room at all, an error
constexpr int kTcpStalled = -3;   // the proxy took the frame and did not send it within kProxyStallNs
constexpr int kTcpBlocked = -4;   // the lock or buffer space not had within send_timeout_ns
constexpr int kTcpLost = -5;      // the connection failed part-way through the frame (send_err)

constexpr long kTcpWaitSliceNs = 10'000'000;  // a send's waits look at the end's close this often

// Take the end's send lock (GIL held on entry and return; released while it waits): every frame
// goes out under it, so no frame's bytes are interleaved with another's (the heartbeat thread's, a
// second caller's). false: not had within max_ns, or (native sends, `closing`) the end was closed
// meanwhile (Python's own frames go out on its socket after that: close()'s goodbye).
bool tcp_lock(afd_ctrl_tcp* t, int64_t max_ns, bool closing) {
  uint32_t free_ = 0;
  if (__atomic_compare_exchange_n(&t->send_lock, &free_, 1u, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return true;
  bool got = false;
  Py_BEGIN_ALLOW_THREADS
  const int64_t end = now_ns() + max_ns;
  for (;;) {
    free_ = 0;
    if (__atomic_compare_exchange_n(&t->send_lock, &free_, 1u, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
      got = true;
      break;
    }
    if (now_ns() >= end || (closing && __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST) < 0)) break;
    const timespec nap{0, 20'000};  // the holder is in a send() of its own (a heartbeat): microseconds
    nanosleep(&nap, nullptr);
  }
  Py_END_ALLOW_THREADS
  return got;
}

void tcp_unlock(afd_ctrl_tcp* t) { __atomic_store_n(&t->send_lock, 0u, __ATOMIC_RELEASE); }

// The rest of a frame the socket took in part (the lock held, an InFlight on the end): it must go
// out before any other frame, so wait for buffer space (GIL released) up to send_timeout_ns.
int tcp_send_rest(afd_ctrl_tcp* t, int fd, const uint8_t* p, size_t n) {
  int rc = kTcpSent;
  ++t->send_rests;
  Py_BEGIN_ALLOW_THREADS
  const int64_t end = now_ns() + t->send_timeout_ns;
  while (n > 0) {
    const ssize_t s = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (s > 0) {
      p += s;
      n -= static_cast<size_t>(s);
      continue;
    }
    if (s < 0 && errno == EINTR) continue;
    if (s < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      t->send_err = errno;
      rc = kTcpLost;
      break;
    }
    const int64_t left = end - now_ns();
    if (left <= 0) {
      rc = kTcpBlocked;
      break;
    }
    if (__atomic_load_n(&t->fd, __ATOMIC_SEQ_CST) < 0) {  // closed here meanwhile
      t->send_err = EBADF;
      rc = kTcpLost;
      break;
    }
    pollfd pf{fd, POLLOUT, 0};
    (void)::poll(&pf, 1, static_cast<int>((left < kTcpWaitSliceNs ? left : kTcpWaitSliceNs) / 1'000'000 + 1));
  }
  Py_END_ALLOW_THREADS
  return rc;
}

// One plain AFDControlPayload (encode_payload) as one data frame, under the end's send lock: one
// send() (the end's proxy's, when it spins), and the rest of a frame taken in part. A kTcp* result.
AFD_SEND_PATH int tcp_send(afd_ctrl_tcp* t, PyObject* payload) {
  InFlight in_flight(&t->busy);
  if (__atomic_load_n(&t->fd, __ATOMIC_SEQ_CST) < 0) return kTcpDeclined;
  uint8_t buf[kTcpHdr + kMaxNativeBytes];
  const uint64_t cap = t->max_msg < kMaxNativeBytes ? t->max_msg : kMaxNativeBytes;
  const int64_t n = encode_payload(payload, buf + kTcpHdr, cap);
  if (n < 0) return kTcpDeclined;
  put_tcp_header(buf, t->local_rank, static_cast<uint64_t>(n));
  const size_t len = kTcpHdr + static_cast<size_t>(n);
  if (!tcp_lock(t, t->send_timeout_ns, true))
    return __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST) < 0 ? kTcpDeclined : kTcpBlocked;
  const int fd = __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST);
  if (fd < 0) {  // closed while it waited
    tcp_unlock(t);
    return kTcpDeclined;
  }
  ssize_t sent = -1;
  int err = 0;
  auto* proxy = static_cast<Keeper*>(__atomic_load_n(&t->proxy, __ATOMIC_ACQUIRE));
  const int handed = proxy != nullptr ? proxy_send(proxy, buf, len, &sent, &err) : 0;
  if (handed == 0) {
    do {
      sent = ::send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
  }
  int rc;
  if (handed < 0) {
    rc = kTcpStalled;
  } else if (sent <= 0) {
    rc = kTcpDeclined;  // nothing went out: the Python path sends it (it waits for room) or names the error
  } else if (static_cast<size_t>(sent) == len) {
    rc = kTcpSent;
  } else {
    rc = tcp_send_rest(t, fd, buf + sent, len - static_cast<size_t>(sent));
  }
  tcp_unlock(t);
  return rc;
}

// Whether buf[:n] is whole heartbeat frames from the expected sender, nothing else.
bool heartbeats_only(const afd_ctrl_tcp* t, const uint8_t* b, size_t n) {
  if (n == 0 || n % kTcpHdr != 0) return false;
  for (size_t off = 0; off < n; off += kTcpHdr) {
    uint32_t magic, type, sender;
    uint64_t len;
    std::memcpy(&magic, b + off, 4);
    std::memcpy(&type, b + off + 4, 4);
    std::memcpy(&sender, b + off + 8, 4);
    std::memcpy(&len, b + off + 12, 8);
    if (magic != kTcpMagic || type != kTcpHeartbeat || sender != t->expect_sender || len != 0) return false;
  }
  return true;
}

// The tcp take (ctrl_tcp_take, TcpTakeFront): poll up to max_ns (GIL released, rehearsing; each
// slice after TCP_QUICKACK is cleared), then read once. Heartbeat frames read alone are
// consumed (liveness: t_ns) and the wait goes on. A read lands in the half of the buffer that does
// not hold the rehearsed message. Returns -2 (closed), -1 (nothing in time), the payload built when
// the read is one whole data frame from the expected sender that parses (max_stages >= 0, no
// pending bytes), after any heartbeat frames, else the bytes read (b"": the peer closed); nullptr
// with *err set (no exception) when poll or recv failed, or with an exception (a signal handler).
PyObject* tcp_take(afd_ctrl_tcp* t, long max_ns, long max_stages, long max_ranks, int* err) {
  if (__atomic_load_n(&t->pending, __ATOMIC_RELAXED) != 0) max_stages = -1;  // raw bytes: Python frames them
  int ready = 0;
  ssize_t n = -1;
  uint8_t* into = t->buf;
  bool first = true;
  const int64_t waited = wait_rehearsing(&t->warm, false, max_ns, max_stages, max_ranks, [&](int64_t ns) -> int64_t {
    InFlight in_flight(&t->busy);
    const int fd = __atomic_load_n(&t->fd, __ATOMIC_SEQ_CST);
    if (fd < 0) {
      ready = kClosed;
      return 0;
    }
    if (!first) tcp_warm_round(t);  // between two slices, as the rehearsal (never before the first poll)
    first = false;
    if (max_ns > 0) {
      // Delayed ACKs: otherwise the segment's ACK goes out at once from its receive (on one host,
      // in the sender's send() too), on the FFN's critical path. The kernel leaves this mode when a
      // delayed ACK fires (>= 40 ms after a segment: within a 50 ms gap), so it is set again at
      // every slice of the wait, not once before it.
      const int zero = 0;
      (void)::setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &zero, sizeof zero);
    }
    const int64_t end = now_ns() + ns;
    for (;;) {
      ready = tcp_wait_readable(t, static_cast<long>(end - now_ns()));
      if (ready <= 0) return ready == 0 ? -1 : 0;
      t->t_ns = now_ns();
      const uint64_t half = t->cap / 2;
      into = t->warm.last_len > 0 && t->warm.last < t->buf + half ? t->buf + half : t->buf;
      do {
        n = ::recv(fd, into, half, MSG_DONTWAIT);
      } while (n < 0 && errno == EINTR);
      *err = n < 0 ? errno : 0;
      if (n > 0 && max_stages >= 0 && heartbeats_only(t, into, static_cast<size_t>(n))) {
        n = -1;  // liveness only: wait on within this slice
        continue;
      }
      return 0;
    }
  });
  if (waited == kSignalled) return nullptr;  // after a slice that read nothing
  if (ready == kClosed) {
    *err = 0;
    return PyLong_FromLong(-2);
  }
  if (ready < 0) {
    *err = -ready;
    return nullptr;
  }
  if (ready == 0 || (n < 0 && (*err == EAGAIN || *err == EWOULDBLOCK))) {
    *err = 0;
    return PyLong_FromLong(-1);
  }
  if (n < 0) return nullptr;  // *err set
  const uint8_t* b = into;
  size_t off = 0;  // past the heartbeat frames in front (the sender's thread sends one a second)
  for (;;) {
    if (max_stages < 0 || static_cast<size_t>(n) - off < kTcpHdr) break;
    uint32_t magic, type, sender;
    uint64_t len;
    std::memcpy(&magic, b + off, 4);
    std::memcpy(&type, b + off + 4, 4);
    std::memcpy(&sender, b + off + 8, 4);
    std::memcpy(&len, b + off + 12, 8);
    if (magic != kTcpMagic || sender != t->expect_sender) break;
    if (type == kTcpHeartbeat && len == 0) {
      off += kTcpHdr;
      continue;
    }
    if (type == kTcpData && len <= t->max_msg && len == static_cast<uint64_t>(n) - off - kTcpHdr) {
      PyObject* built = build_payload(b + off + kTcpHdr, static_cast<int64_t>(len), max_stages, max_ranks);
      if (built != Py_None) {
        if (built != nullptr) {
          t->warm.last = into + off + kTcpHdr;
          t->warm.last_len = len;
          t->msg_ns = t->t_ns;
        }
        return built;
      }
      Py_DECREF(built);
    }
    break;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(b), n);
}

// The tcp fronts' Python-side helpers on the channel (TcpControlChannel._send_failed and
// friends), looked up by name on the rare paths only.
PyObject* call_owner(PyObject* owner, const char* name, PyObject* arg) {
  PyObject* meth = PyObject_GetAttrString(owner, name);
  if (meth == nullptr) return nullptr;
  PyObject* res = PyObject_CallOneArg(meth, arg);
  Py_DECREF(meth);
  return res;
}

PyObject* call_owner_int(PyObject* owner, const char* name, long v) {
  PyObject* arg = PyLong_FromLong(v);
  if (arg == nullptr) return nullptr;
  PyObject* res = call_owner(owner, name, arg);
  Py_DECREF(arg);
  return res;
}

// tcp_send_front(payload): check(payload) unless check is None (its error raised, nothing sent),
// then tcp_send; what it declines goes to fallback(payload) (the caller's checked path, whose
// result is returned), its failures to owner._send_failed(code), which raises the named error.
AFD_SEND_PATH PyObject* tcp_send_front_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* f = reinterpret_cast<Front*>(self);
  PyObject* payload = send_front_checked(f, args, nargsf, kwnames);
  if (payload == nullptr) return nullptr;
  const int rc = tcp_send(static_cast<afd_ctrl_tcp*>(f->end), payload);
  if (rc == kTcpSent) Py_RETURN_NONE;
  if (rc == kTcpDeclined) return PyObject_CallOneArg(f->fallback, payload);
  return call_owner_int(f->owner, "_send_failed", rc);
}

// tcp_take_front(): as take_front_call, over tcp_take (no slice while the Python path holds bytes of
// a started frame: pending). Bytes the slice read (part of the stream, not one message) go to
// owner._stash(bytes) and fallback(None) goes on from them; a failed read goes to
// owner._read_failed(errno), which raises the named error.
PyObject* tcp_take_front_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* f = reinterpret_cast<Front*>(self);
  (void)args;
  const long ns = take_front_ns(f, nargsf, kwnames);
  if (ns < 0) return nullptr;
  auto* t = static_cast<afd_ctrl_tcp*>(f->end);
  PyObject* got = Py_NewRef(Py_None);
  if (ns > 0 && __atomic_load_n(&t->pending, __ATOMIC_RELAXED) == 0) {  // else its rest may be buffered already
    Py_DECREF(got);
    int err = 0;
    got = tcp_take(t, ns, f->max_stages, f->max_ranks, &err);
    if (got == nullptr) return err != 0 ? call_owner_int(f->owner, "_read_failed", err) : nullptr;
    if (PyBytes_CheckExact(got)) {
      PyObject* kept = call_owner(f->owner, "_stash", got);
      Py_DECREF(got);
      if (kept == nullptr) return nullptr;
      Py_DECREF(kept);
      got = Py_NewRef(Py_None);
    } else if (!PyLong_CheckExact(got)) {
      return got;  // built
    }
  }
  return take_front_fallback(f, got);
}

constexpr const char* kTcpSendSig = "TcpSendFront(state_address, check, fallback, owner)";
constexpr const char* kTcpTakeSig = "TcpTakeFront(state_address, prepare, fallback, owner, max_stages, max_ranks)";

PyObject* tcp_send_front_new(PyTypeObject* t, PyObject* a, PyObject* k) {
  return front_new(t, a, k, tcp_send_front_call, 4, kTcpSendSig);
}
PyObject* tcp_take_front_new(PyTypeObject* t, PyObject* a, PyObject* k) {
  return front_new(t, a, k, tcp_take_front_call, 6, kTcpTakeSig);
}

PyTypeObject g_tcp_send_front_type = make_front_type(
    "afd_ext._C.TcpSendFront",
    "TcpSendFront(state_address, check, fallback, owner): a tcp end's per-step send, front(payload) "
    "(see afd_ext/control/tcp.py).",
    tcp_send_front_new);
PyTypeObject g_tcp_take_front_type = make_front_type(
    "afd_ext._C.TcpTakeFront",
    "TcpTakeFront(state_address, prepare, fallback, owner, max_stages, max_ranks): a tcp end's per-step "
    "receive, front() (see afd_ext/control/tcp.py).",
    tcp_take_front_new);

}  // namespace

// _C.ctrl_tcp_send_payload(state_address, payload): send an AFDControlPayload as tcp_send does
// (one data frame, under the end's send lock). Returns 0 sent, -2 nothing sent (closed, declined,
// no room, an error: the caller's Python path sends it and names an error), -3 the proxy stalled,
// -4 the lock or buffer space not had within send_timeout_ns, -5 the connection failed part-way
// (send_err).
PyObject* afd_ctrl_tcp_send_payload_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* end;
  if (!end_arg(args, nargs, 2, "ctrl_tcp_send_payload(state_address, payload)", &end)) return nullptr;
  auto* t = static_cast<afd_ctrl_tcp*>(end);
  return PyLong_FromLong(t == nullptr ? kTcpDeclined : tcp_send(t, args[1]));
}

// _C.ctrl_tcp_lock(state_address, max_ns) -> bool: take the end's send lock (the GIL released while
// it waits), for a frame Python sends on its socket; False when not had within max_ns.
// _C.ctrl_tcp_unlock(state_address): release it.
PyObject* afd_ctrl_tcp_lock_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* kSig = "ctrl_tcp_lock(state_address, max_ns)";
  void* end;
  if (!end_arg(args, nargs, 2, kSig, &end)) return nullptr;
  const long long max_ns = PyLong_AsLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (end == nullptr) {
    PyErr_SetString(PyExc_ValueError, kSig);
    return nullptr;
  }
  return PyBool_FromLong(tcp_lock(static_cast<afd_ctrl_tcp*>(end), max_ns > 0 ? max_ns : 0, false));
}

PyObject* afd_ctrl_tcp_unlock_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* end;
  if (!end_arg(args, nargs, 1, "ctrl_tcp_unlock(state_address)", &end)) return nullptr;
  if (end == nullptr) {
    PyErr_SetString(PyExc_ValueError, "ctrl_tcp_unlock(state_address)");
    return nullptr;
  }
  tcp_unlock(static_cast<afd_ctrl_tcp*>(end));
  Py_RETURN_NONE;
}

// _C.ctrl_tcp_take(state_address, max_ns, max_stages, max_ranks): tcp_take (above). Raises OSError
// when the poll or the read failed.
PyObject* afd_ctrl_tcp_take_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* p;
  long max_ns, max_stages, max_ranks;
  if (!take_args(args, nargs, "ctrl_tcp_take(state_address, max_ns, max_stages, max_ranks)", &p, &max_ns,
                 &max_stages, &max_ranks))
    return nullptr;
  int err = 0;
  PyObject* got = tcp_take(static_cast<afd_ctrl_tcp*>(p), max_ns, max_stages, max_ranks, &err);
  if (got == nullptr && err != 0) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  return got;
}

// _C.ctrl_tcp_proxy_start(state_address, hold, period_ns, idle_ns, warm_tx, warm_rx[, cpus]): start a
// tcp sender's proxy (above) on a thread of its own, on `cpus` as ctrl_keeper_start's, with
// the private loopback pair (warm_tx, warm_rx); `hold` is kept alive until it is stopped (what owns
// the end and the pair). Returns a keeper capsule (ctrl_keeper_passes / ctrl_keeper_stop; freed:
// stopped). TypeError / ValueError on bad arguments or an end that has one, before anything starts.
PyObject* afd_ctrl_tcp_proxy_start_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 && nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "ctrl_tcp_proxy_start(state_address, hold, period_ns, idle_ns, warm_tx, warm_rx[, cpus])");
    return nullptr;
  }
  constexpr const char* kWhat = "ctrl_tcp_proxy_start: a tcp end without a proxy, two descriptors";
  auto* t = static_cast<afd_ctrl_tcp*>(PyLong_AsVoidPtr(args[0]));
  const long tx = PyLong_AsLong(args[4]);
  const long rx = PyLong_AsLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  if (t == nullptr || tx < 0 || rx < 0 || t->proxy != nullptr) {
    PyErr_Format(PyExc_ValueError, "%s, period_ns > 0 and idle_ns >= 0", kWhat);
    return nullptr;
  }
  Keeper* k = keeper_new(args, nargs, 6, kWhat);
  if (k == nullptr) return nullptr;
  k->tcp = t;
  k->mail = new TcpMail();
  k->warm_tx = static_cast<int>(tx);
  k->warm_rx = static_cast<int>(rx);
  PyObject* cap = keeper_launch(k, proxy_run);
  if (cap != nullptr) __atomic_store_n(&t->proxy, static_cast<void*>(k), __ATOMIC_SEQ_CST);
  return cap;
}

// _C.ctrl_tcp_proxy_served(keeper): the frames a tcp sender's proxy sent so far.
PyObject* afd_ctrl_tcp_proxy_served_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Keeper* k = nargs == 1 ? keeper_of(args[0]) : nullptr;
  if (k == nullptr || k->mail == nullptr) {
    PyErr_SetString(PyExc_TypeError, "ctrl_tcp_proxy_served(proxy)");
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(k->mail->served.load());
}

// Adds the fronts' types (SendFront, TakeFront, TcpSendFront, TcpTakeFront) to the module (PyInit__C); -1 with an error set.
int afd_ctrl_add_types(PyObject* mod) {
  for (PyTypeObject* t : {&g_send_front_type, &g_take_front_type, &g_tcp_send_front_type, &g_tcp_take_front_type}) {
    if (PyType_Ready(t) < 0) return -1;
    const char* dot = std::strrchr(t->tp_name, '.');
    Py_INCREF(t);
    if (PyModule_AddObject(mod, dot + 1, reinterpret_cast<PyObject*>(t)) < 0) {
      Py_DECREF(t);
      return -1;
    }
  }
  return 0;
}
