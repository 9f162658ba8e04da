// Issue 16 probe helper (scripts/diag/control_warm.py): a loop, run from a ctypes call (which
// releases the GIL) on a thread of its own CPU, that reads one byte per cache line of the given
// address ranges every `period_ns`, until *stop. It asks whether keeping a sender's memory warm in
// the shared last-level cache (and its page-table lines) from another core cuts the send's cost
// after a long gap. Build: gcc -O2 -shared -fPIC -o /tmp/touch_loop.so scripts/diag/touch_loop.c
#include <stdint.h>
#include <time.h>

struct range {
  const volatile uint8_t* p;
  uint64_t n;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

volatile uint64_t touch_sink;

// Returns the passes made; *pass_ns gets the last pass's duration.
uint64_t touch_loop(const struct range* r, int nr, int64_t period_ns, volatile int* stop, volatile int64_t* pass_ns) {
  uint64_t passes = 0, sink = 0;
  while (!*stop) {
    const int64_t t0 = now_ns();
    for (int i = 0; i < nr; ++i)
      for (uint64_t o = 0; o < r[i].n; o += 64) sink += r[i].p[o];
    *pass_ns = now_ns() - t0;
    ++passes;
    struct timespec d = {0, (long)period_ns};
    nanosleep(&d, 0);
  }
  touch_sink = sink;
  return passes;
}
