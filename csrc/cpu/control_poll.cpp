// The control plane's waiting loops, in native code so that a waiting FFN rank
// polls without holding the GIL. Python calls these through ctypes (which
// releases the GIL for the call), one bounded slice at a time, and does its
// liveness checks between slices (afd_ext/control_plane.py).
#include <poll.h>
#include <time.h>

#include <cerrno>
#include <cstdint>

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

}  // extern "C"
