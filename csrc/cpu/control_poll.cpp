// The control plane's waits: an FFN rank waits here for the step's payload with the GIL
// released (control_bindings.cpp binds these). Spinning while the engine serves, because waking a
// sleeping thread costs ~110 us on a server host (docs/internals.md); sleeping once idle.
// Also the payload's layout check: the bytes are untrusted, so every length is bounded first.
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
#include <cstdio>
#include <cstring>

namespace afd::ctrl {
namespace {

constexpr size_t kWaiting = 192, kBell = 196, kStop = 200;  // u32 header words
constexpr size_t kReadCount = 64, kReceiverState = 72, kSenderState = 136, kWriteCount = 144;  // u64 words
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the ring and the payload are little-endian");
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

uint64_t* u64(uint8_t* ring, size_t off) { return reinterpret_cast<uint64_t*>(ring + off); }

uint8_t* slot_of(const Ring& r, uint64_t k) { return r.base + kHeaderBytes + (k % r.nslots) * r.stride; }

void ring_bell(uint8_t* ring) {
  __atomic_fetch_add(word(ring, kBell), 1, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, word(ring, kBell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

bool ring_of(uint8_t* buf, uint64_t len, Ring* r) {
  if (len < uint64_t(kHeaderBytes)) return false;
  r->base = buf;
  r->nslots = *u64(buf, 8) >> 32;
  r->slot_bytes = *u64(buf, 16);
  r->stride = (kSlotHeader + r->slot_bytes + 63) / 64 * 64;
  return r->nslots >= 1 && r->nslots <= (1u << 20) && r->slot_bytes >= 1 && r->slot_bytes <= (1u << 30) &&
         uint64_t(kHeaderBytes) + r->nslots * r->stride <= len;
}

bool shm_put(const Ring& r, uint64_t total, uint32_t sender, const uint8_t* data, uint32_t n) {
  const uint64_t k = *u64(r.base, kWriteCount);  // this end's own word
  if (__atomic_load_n(u64(r.base, kReceiverState), __ATOMIC_ACQUIRE) == kClosed ||
      k - __atomic_load_n(u64(r.base, kReadCount), __ATOMIC_ACQUIRE) >= r.nslots)
    return false;
  uint8_t* s = slot_of(r, k);
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
  __atomic_store_n(u64(r.base, kWriteCount), k + 1, __ATOMIC_RELEASE);
  // A full fence orders the publish before the waiting flag's read (the receiver's mirror image).
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(word(r.base, kWaiting), __ATOMIC_RELAXED)) ring_bell(r.base);
  return true;
}

void shm_stop(uint8_t* ring, bool sender) {
  __atomic_store_n(u64(ring, sender ? kSenderState : kReceiverState), kClosed, __ATOMIC_RELEASE);
  __atomic_store_n(word(ring, kStop), 1, __ATOMIC_SEQ_CST);
  ring_bell(ring);
}

void shm_ends(uint8_t* ring, uint64_t* sender_state, uint64_t* receiver_state, uint64_t* unread) {
  *sender_state = __atomic_load_n(u64(ring, kSenderState), __ATOMIC_ACQUIRE);
  *receiver_state = __atomic_load_n(u64(ring, kReceiverState), __ATOMIC_ACQUIRE);
  *unread = __atomic_load_n(u64(ring, kWriteCount), __ATOMIC_ACQUIRE) -
            __atomic_load_n(u64(ring, kReadCount), __ATOMIC_ACQUIRE);
}

int64_t shm_take(const Ring& r, uint8_t* out, uint64_t* total, uint32_t* sender, int64_t spin_until,
                 int64_t deadline) {
  uint8_t* ring = r.base;
  const uint64_t k = *u64(ring, kReadCount);  // this end's own word
  uint8_t* s = slot_of(r, k);
  auto* seq = reinterpret_cast<uint64_t*>(s);
  const uint64_t want = 2 * k + 2;
  int64_t bad_since = 0, got = kSlice;
  for (uint32_t i = 1;; ++i) {
    if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) == want) {
      uint32_t n, c;
      std::memcpy(&n, s + 16, 4);
      if (n <= r.slot_bytes) {
        std::memcpy(out, s + kSlotHeader, n);
        std::memcpy(&c, s + 24, 4);
        std::memcpy(total, s + 8, 8);
        std::memcpy(sender, s + 20, 4);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);  // the copies before seq's second read
        if (__atomic_load_n(seq, __ATOMIC_RELAXED) == want && slot_crc(want, s + 8, out, n) == c) {
          __atomic_store_n(u64(ring, kReadCount), k + 1, __ATOMIC_RELEASE);
          got = n;
          break;
        }
      }
      // Published but inconsistent: no writer is in this slot (its seq would be odd), so corrupt.
      const int64_t now = now_ns();
      if (bad_since == 0) bad_since = now;
      if (now - bad_since > kCorruptAfterNs) { got = kCorrupt; break; }
      continue;
    }
    if (__atomic_load_n(word(ring, kStop), __ATOMIC_ACQUIRE)) { got = kStopped; break; }
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
  return got;
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

std::string check_payload(const uint8_t* p, uint64_t size, uint64_t max_stages, uint64_t max_ranks) {
  char e[200];
  auto u32 = [p](uint64_t off) { uint32_t v; std::memcpy(&v, p + off, 4); return v; };
  auto fail = [&e](const char* fmt, auto... a) { std::snprintf(e, sizeof e, fmt, a...); return std::string(e); };
  if (size < kPayloadHead)
    return fail("binary control payload of %llu bytes is shorter than its header", (unsigned long long)size);
  if (std::memcmp(p, "AFDb", 4) != 0) return fail("binary control payload: bad magic %#010x", u32(0));
  if (p[4] != kPayloadVersion)
    return fail("binary control payload version %u is not supported (this afd_ext reads %u); run the same "
                "afd_ext version on every rank", unsigned(p[4]), unsigned(kPayloadVersion));
  if (p[5] & ~0xFu) return fail("binary control payload: unknown flag bits %#x", unsigned(p[5]));
  const uint32_t nstages = p[6] | uint32_t(p[7]) << 8;
  if (nstages > max_stages)
    return fail("control payload: %u stages exceed max_stages=%llu", nstages, (unsigned long long)max_stages);
  uint64_t off = kPayloadHead;
  int64_t prev = -1;
  for (uint32_t i = 0; i < nstages; ++i) {
    if (size - off < kStageHead) return fail("binary control payload is truncated (stage header)");
    const uint32_t s = u32(off), n = u32(off + 4), mx = u32(off + 8);
    if (int64_t(s) <= prev)
      return fail("binary control payload: stage %u after stage %lld (not increasing)", s, (long long)prev);
    if (n > max_ranks)
      return fail("control payload: stage %u has %u ranks, exceeding max_ranks=%llu", s, n,
                  (unsigned long long)max_ranks);
    if (mx > uint32_t(INT32_MAX))
      return fail("control payload: stage %u max_tokens_across_dp_cpu %u exceeds int32", s, mx);
    off += kStageHead;
    if ((size - off) / 4 < n) return fail("binary control payload is truncated (stage %u counts)", s);
    for (uint32_t j = 0; j < n; ++j)
      if (u32(off + 4 * j) > uint32_t(INT32_MAX))
        return fail("control payload: stage %u has a negative count (rank %u: %d)", s, j, int32_t(u32(off + 4 * j)));
    off += 4ull * n;
    prev = s;
  }
  if (off != size) return fail("binary control payload has %llu trailing bytes", (unsigned long long)(size - off));
  return {};
}

}  // namespace afd::ctrl
