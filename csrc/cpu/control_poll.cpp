// The control plane's per-message path in native code: the waiting loops (so
// that a waiting FFN rank polls without holding the GIL) and the shared-memory
// ring's single-slot publish and read (no interpreter between the seq word and
// the payload). Python calls these through ctypes (which releases the GIL for
// the call), one bounded slice at a time, and does its liveness checks between
// slices. The ring layout is defined in afd_ext/control_plane.py (module doc);
// the offsets below mirror it, and tests/test_control_plane.py checks that both
// sides read each other's slots.
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

}  // namespace

extern "C" {

// Spin until the shared 8-byte word at `word` equals `want` (acquire load) or
// `max_ns` nanoseconds passed. Returns 1 when it matched, 0 on timeout.
__attribute__((visibility("default"))) int afd_ctrl_spin_u64(const uint64_t* word, uint64_t want,
                                                             int64_t max_ns) {
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

// Spin until `fd` is readable (or hung up / in error) or `max_ns` passed.
// Returns 1 when readable, 0 on timeout, -errno when poll() failed.
__attribute__((visibility("default"))) int afd_ctrl_spin_fd(int fd, int64_t max_ns) {
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

// Sender: publish a message of `n` <= slot_bytes bytes as message number `k` in
// `slot` (the seqlock protocol of the module doc) and stamp the heartbeat.
// Returns 1 when the receiver is blocked on the doorbell (ring it), 0 when not,
// -1 when the ring is full (nothing written; the caller waits for space).
__attribute__((visibility("default"))) int afd_ctrl_shm_publish(uint64_t* hdr, uint8_t* slot, uint64_t k,
                                                                uint64_t nslots, const uint8_t* data,
                                                                uint32_t n, uint32_t sender) {
  if (k - __atomic_load_n(&hdr[kReadCountWord], __ATOMIC_ACQUIRE) >= nslots) return -1;
  __atomic_store_n(&hdr[kHeartbeatWord], static_cast<uint64_t>(now_ns()), __ATOMIC_RELAXED);
  auto* seq = reinterpret_cast<uint64_t*>(slot);
  const uint64_t want = 2 * k + 2;
  __atomic_store_n(seq, want - 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);  // the odd seq is visible before any field changes
  const uint64_t total = n;
  const uint32_t crc = slot_crc(want, total, n, sender, data);
  std::memcpy(slot + 8, &total, 8);
  std::memcpy(slot + 16, &n, 4);
  std::memcpy(slot + 20, &sender, 4);
  std::memcpy(slot + 24, &crc, 4);
  std::memcpy(slot + kSlotHeader, data, n);
  __atomic_store_n(seq, want, __ATOMIC_RELEASE);
  // Full fence: the publish is ordered before the read of the receiver's waiting flag.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  return __atomic_load_n(&hdr[kWaitingWord], __ATOMIC_RELAXED) ? 1 : 0;
}

// Receiver: wait up to `max_ns` for message number `k` in `slot`, then copy a
// single-slot message into `out` (capacity `cap`), check it (seq unchanged,
// CRC) and mark it consumed (read_count = k + 1). Returns its length; -1 when
// nothing was published in time; -2 when the slot is published but not a whole
// consistent single-slot message yet (torn, corrupt or one fragment of a larger
// message: the caller reads it the slow way). `*sender` gets the sender field.
__attribute__((visibility("default"))) int64_t afd_ctrl_shm_take(uint64_t* hdr, const uint8_t* slot, uint64_t k,
                                                                 uint64_t slot_bytes, uint8_t* out, uint64_t cap,
                                                                 int64_t max_ns, uint32_t* sender) {
  const auto* seq = reinterpret_cast<const uint64_t*>(slot);
  const uint64_t want = 2 * k + 2;
  if (!afd_ctrl_spin_u64(seq, want, max_ns)) return -1;
  for (int attempt = 0; attempt < 64; ++attempt) {
    uint64_t total;
    uint32_t frag, snd, crc;
    std::memcpy(&total, slot + 8, 8);
    std::memcpy(&frag, slot + 16, 4);
    std::memcpy(&snd, slot + 20, 4);
    std::memcpy(&crc, slot + 24, 4);
    if (frag > slot_bytes || frag > cap || total != frag) return -2;
    std::memcpy(out, slot + kSlotHeader, frag);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(seq, __ATOMIC_RELAXED) == want && slot_crc(want, total, frag, snd, out) == crc) {
      *sender = snd;
      __atomic_store_n(&hdr[kReadCountWord], k + 1, __ATOMIC_RELEASE);
      return static_cast<int64_t>(frag);
    }
    cpu_relax();
  }
  return -2;
}

}  // extern "C"
