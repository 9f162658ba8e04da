// Host probe for the control plane (issue 16): is the cost's growth with the
// step gap the host's or the package's? Two threads pinned to two CPUs; per
// step the sender waits `gap` (spinning on the clock, or sleeping), runs a
// fixed piece of work (touches a 64 KiB buffer, then 5000 dependent multiply-adds),
// and publishes a sequence word; the receiver spins on that word (pause loop,
// as csrc/cpu/control_poll.cpp) and runs the same work when it sees it.
// Prints p50/p99 per gap of: wake (publish -> seen), the sender's work and
// the receiver's work, in µs. No package code: only the host's caches,
// frequency and scheduling are in it.
// Build: gcc -O2 -pthread -o /tmp/host_wake scripts/diag/host_wake.c
// Use:   /tmp/host_wake FFN_CPU ATTENTION_CPU [spin|sleep] [pause|nopause]
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#define BUF (64 * 1024)
#define MAXN 2000
static volatile uint64_t seq __attribute__((aligned(64)));
static volatile int64_t t_pub __attribute__((aligned(64)));
static volatile uint64_t ack __attribute__((aligned(64)));  // receiver: steps done (the sender waits for it)
static int gap_us, iters, sleeping, nopause;
#define RELAX() do { if (!nopause) __builtin_ia32_pause(); } while (0)
static int64_t wake[MAXN], swork[MAXN], rwork[MAXN];

static uint64_t work(unsigned char* b) {
  uint64_t s = 0;
  for (int i = 0; i < BUF; i += 64) s += b[i];
  for (int i = 0; i < 5000; ++i) s = s * 3 + (uint64_t)i;
  return s;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static int cpus[2];
static volatile uint64_t sink;

static void* receiver(void* arg) {
  (void)arg;
  pin(cpus[0]);
  unsigned char* b = calloc(1, BUF);
  for (int k = 1; k <= iters; ++k) {
    while (__atomic_load_n(&seq, __ATOMIC_ACQUIRE) != (uint64_t)k) RELAX();
    int64_t t = now_ns();
    wake[k - 1] = t - t_pub;
    sink += work(b);
    rwork[k - 1] = now_ns() - t;
    __atomic_store_n(&ack, (uint64_t)k, __ATOMIC_RELEASE);
  }
  free(b);
  return NULL;
}

static void* sender(void* arg) {
  (void)arg;
  pin(cpus[1]);
  unsigned char* b = calloc(1, BUF);
  for (int k = 1; k <= iters; ++k) {
    while (__atomic_load_n(&ack, __ATOMIC_ACQUIRE) != (uint64_t)(k - 1)) RELAX();
    int64_t end = now_ns() + (int64_t)gap_us * 1000;
    if (sleeping) {
      struct timespec ts = {gap_us / 1000000, (gap_us % 1000000) * 1000L};
      nanosleep(&ts, NULL);
    } else {
      while (now_ns() < end) RELAX();
    }
    int64_t t = now_ns();
    sink += work(b);
    swork[k - 1] = now_ns() - t;
    t_pub = now_ns();
    __atomic_store_n(&seq, (uint64_t)k, __ATOMIC_RELEASE);
  }
  free(b);
  return NULL;
}

static int cmp(const void* a, const void* b) {
  int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return (x > y) - (x < y);
}

static void report(const char* name, int64_t* v, int n) {
  qsort(v, n, sizeof *v, cmp);
  printf(" %s p50 %.2f p99 %.2f |", name, v[n / 2] / 1e3, v[(n * 99) / 100] / 1e3);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s FFN_CPU ATTENTION_CPU [spin|sleep] [pause|nopause]\n", argv[0]);
    return 2;
  }
  cpus[0] = atoi(argv[1]);
  cpus[1] = atoi(argv[2]);
  sleeping = argc > 3 && strcmp(argv[3], "sleep") == 0;
  nopause = argc > 4 && strcmp(argv[4], "nopause") == 0;
  const int gaps[] = {50, 1000, 5000, 20000, 50000};
  for (unsigned g = 0; g < sizeof gaps / sizeof gaps[0]; ++g) {
    gap_us = gaps[g];
    iters = gap_us >= 20000 ? 150 : 400;
    seq = 0;
    ack = 0;
    pthread_t r, s;
    pthread_create(&r, NULL, receiver, NULL);
    pthread_create(&s, NULL, sender, NULL);
    pthread_join(s, NULL);
    pthread_join(r, NULL);
    printf("cpus %d/%d %s sender %s gap %6.2f ms:", cpus[0], cpus[1], nopause ? "no pause" : "pause", sleeping ? "sleeps" : "spins", gap_us / 1e3);
    report("wake", wake + 10, iters - 10);
    report("sender work", swork + 10, iters - 10);
    report("receiver work", rwork + 10, iters - 10);
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
