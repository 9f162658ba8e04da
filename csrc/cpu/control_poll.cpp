// The control plane's waits: an FFN rank waits here for the step's payload with the GIL
// released (bindings.cpp binds these). Spinning while the engine serves, because waking a
// sleeping thread costs ~110 us on a server host (docs/internals.md); sleeping once idle.
#include "control.h"

#include <linux/futex.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <climits>
#include <cstring>

namespace afd::ctrl {
namespace {

constexpr size_t kWaiting = 192, kBell = 196, kStop = 200;  // u32 header words
constexpr int64_t kCorruptAfterNs = 1000000000;

uint32_t* word(uint8_t* ring, size_t off) { return reinterpret_cast<uint32_t*>(ring + off); }

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

constexpr std::array<uint32_t, 256> kCrcTable = [] {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int j = 0; j < 8; ++j) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}();

// zlib's CRC-32, continued from `crc`.
uint32_t crc32(const uint8_t* p, size_t n, uint32_t crc = 0) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

// Over the published seq, the slot's fields (total, frag, sender) and the payload.
uint32_t slot_crc(uint64_t seq, const uint8_t* fields, const uint8_t* payload, uint32_t n) {
  return crc32(payload, n, crc32(fields, 16, crc32(reinterpret_cast<const uint8_t*>(&seq), 8)));
}

uint8_t* slot_of(uint8_t* ring, uint64_t nslots, uint64_t stride, uint64_t k) {
  return ring + kHeaderBytes + (k % nslots) * stride;
}

void ring_bell(uint8_t* ring) {
  __atomic_fetch_add(word(ring, kBell), 1, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, word(ring, kBell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

bool shm_put(uint8_t* ring, uint64_t nslots, uint64_t stride, uint64_t k, uint64_t total,
             uint32_t sender, const uint8_t* data, uint32_t n) {
  if (k - __atomic_load_n(reinterpret_cast<uint64_t*>(ring + kReadCount), __ATOMIC_ACQUIRE) >= nslots) return false;
  uint8_t* s = slot_of(ring, nslots, stride, k);
  auto* seq = reinterpret_cast<uint64_t*>(s);
  __atomic_store_n(seq, 2 * k + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);  // odd before the fields change
  std::memcpy(s + 8, &total, 8);
  std::memcpy(s + 16, &n, 4);
  std::memcpy(s + 20, &sender, 4);
  std::memcpy(s + kSlotHeader, data, n);
  const uint32_t c = slot_crc(2 * k + 2, s + 8, data, n);
  std::memcpy(s + 24, &c, 4);
  __atomic_store_n(seq, 2 * k + 2, __ATOMIC_RELEASE);
  // A full fence orders the publish before the waiting flag's read (the receiver's mirror image).
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(word(ring, kWaiting), __ATOMIC_RELAXED)) ring_bell(ring);
  return true;
}

void shm_stop(uint8_t* ring) {
  __atomic_store_n(word(ring, kStop), 1, __ATOMIC_SEQ_CST);
  ring_bell(ring);
}

int64_t shm_take(uint8_t* ring, uint64_t nslots, uint64_t stride, uint64_t k, uint8_t* out,
                 uint64_t cap, uint64_t* total, uint32_t* sender, int64_t spin_until, int64_t deadline) {
  uint8_t* s = slot_of(ring, nslots, stride, k);
  auto* seq = reinterpret_cast<uint64_t*>(s);
  const uint64_t want = 2 * k + 2;
  int64_t bad_since = 0, r = kSlice;
  for (uint32_t i = 1;; ++i) {
    if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) == want) {
      uint32_t n, c;
      std::memcpy(&n, s + 16, 4);
      if (n <= cap) {
        std::memcpy(out, s + kSlotHeader, n);
        std::memcpy(&c, s + 24, 4);
        std::memcpy(total, s + 8, 8);
        std::memcpy(sender, s + 20, 4);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);  // the copies before seq's second read
        if (__atomic_load_n(seq, __ATOMIC_RELAXED) == want && slot_crc(want, s + 8, out, n) == c) {
          __atomic_store_n(reinterpret_cast<uint64_t*>(ring + kReadCount), k + 1, __ATOMIC_RELEASE);
          r = n;
          break;
        }
      }
      // Published but inconsistent: no writer is in this slot (its seq would be odd), so corrupt.
      const int64_t now = now_ns();
      if (bad_since == 0) bad_since = now;
      if (now - bad_since > kCorruptAfterNs) { r = kCorrupt; break; }
      continue;
    }
    if (__atomic_load_n(word(ring, kStop), __ATOMIC_ACQUIRE)) { r = kStopped; break; }
    // One pause and one clock read (~20 ns) per 64 polls: a pause in every poll is the tight
    // pause loop a KVM host intercepts (pause-loop exiting), adding a VM exit to the wake-up.
    if (i % 64) continue;
    relax();
    const int64_t now = now_ns();
    if (now >= deadline) break;
    if (now < spin_until) continue;
    // Idle: raise the flag, look once more, sleep on the doorbell (the sender rings it).
    __atomic_store_n(word(ring, kWaiting), 1, __ATOMIC_SEQ_CST);
    const uint32_t bell = __atomic_load_n(word(ring, kBell), __ATOMIC_SEQ_CST);
    if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) == want || __atomic_load_n(word(ring, kStop), __ATOMIC_ACQUIRE)) continue;
    const int64_t left = deadline - now;
    timespec ts{time_t(left / 1000000000LL), long(left % 1000000000LL)};
    if (syscall(SYS_futex, word(ring, kBell), FUTEX_WAIT, bell, &ts, nullptr, 0) != 0 && errno == EINTR) break;
  }
  __atomic_store_n(word(ring, kWaiting), 0, __ATOMIC_RELAXED);
  return r;
}

int64_t tcp_read(int fd, uint8_t* buf, uint64_t cap, int64_t spin_until, int64_t deadline) {
  int64_t acks_delayed = 0;
  for (;;) {
    const ssize_t n = recv(fd, buf, cap, MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -errno;
    const int64_t now = now_ns();
    if (now >= deadline) return kSlice;
    if (now < spin_until) {
      // Delayed ACKs, or the payload's recv() sends one on the critical path (45 -> 5 us at 50 ms
      // gaps, GPU runs 22-23); the kernel turns quick ACKs back on when a delayed one fires.
      if (now - acks_delayed > 5000000) {
        const int off = 0;
        setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &off, sizeof off);
        acks_delayed = now;
      }
      relax();
      continue;
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, int((deadline - now + 999999) / 1000000)) < 0 && errno == EINTR) return kSlice;
  }
}

}  // namespace afd::ctrl
