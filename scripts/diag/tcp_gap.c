// Issue 16 probe: where a loopback TCP control message's cost after a long gap goes, and what keeps
// it down. One process, three threads on three CPUs: the receiver (the FFN rank: polls its socket
// with poll(fd, 0) as ctrl_tcp_take does), the sender (the attention rank: spins through the gap,
// then sends one 100-byte frame), and a helper (the attention process's second CPU). Each step's
// variant is chosen in turn, so that every variant sees the same host:
//   plain   nothing else
//   helper  the helper sends and reads 100 bytes on a private loopback pair every --period-us
//           during the gap (the kernel's TCP code and shared data kept in the last-level cache)
//   ffn     the receiver does the same between its polls (a waiting FFN rank's rehearsal)
//   both    helper and ffn
//   handoff the helper, warmed as in `helper`, does the send itself: the sender writes the frame
//           to a shared line and the helper (spinning on it) calls send() on its warm CPU
//   self    the sender warms itself just before its send (not a design: the bound of warmth)
// Prints per gap and variant: end to end (sender's call -> receiver's recv() done), the send()
// (or handoff) and the recv() durations, p50 / p99 in us.
//
//   gcc -O2 -pthread -o /tmp/tcp_gap scripts/diag/tcp_gap.c
//   /tmp/tcp_gap [--steps 400] [--period-us 500] [--cpus 1,2,3] [gap_ms ...]
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { HELPER = 1, FFN = 2, HANDOFF = 4, SELF = 8, DELACK = 16 };
static const int kVariants[] = {0, DELACK, FFN, FFN | DELACK, HELPER | FFN | DELACK, HANDOFF | FFN | DELACK,
                                HANDOFF | FFN, SELF | FFN | DELACK};
#define NV ((int)(sizeof kVariants / sizeof kVariants[0]))

static const char* name_of(int m) {
  static char buf[NV][64];
  static int next = 0;
  char* b = buf[next++ % NV];
  b[0] = 0;
  if (!m) strcpy(b, "plain");
  if (m & HELPER) strcat(b, "helper+");
  if (m & FFN) strcat(b, "ffn+");
  if (m & HANDOFF) strcat(b, "handoff+");
  if (m & SELF) strcat(b, "self+");
  if (m & DELACK) strcat(b, "delack+");
  if (m) b[strlen(b) - 1] = 0;
  return b;
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s)) perror("sched_setaffinity");
}

static void die(const char* what) {
  perror(what);
  exit(1);
}

// A connected loopback TCP pair, TCP_NODELAY on both ends.
static void tcp_pair(int* a, int* b) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  if (ls < 0 || bind(ls, (struct sockaddr*)&sa, sizeof sa) || listen(ls, 1) ||
      getsockname(ls, (struct sockaddr*)&sa, &len))
    die("listen");
  *a = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(*a, (struct sockaddr*)&sa, sizeof sa)) die("connect");
  *b = accept(ls, NULL, NULL);
  if (*b < 0) die("accept");
  close(ls);
  int one = 1;
  setsockopt(*a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(*b, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static char g_frame[100];

// One private round: 100 bytes sent on a, read on b (loopback delivers them within the send).
static void warm_once(int a, int b) {
  char buf[256];
  if (send(a, g_frame, sizeof g_frame, MSG_NOSIGNAL) != sizeof g_frame) die("warm send");
  size_t got = 0;
  while (got < sizeof g_frame) {
    ssize_t n = recv(b, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) got += (size_t)n;
    else if (n < 0 && errno != EAGAIN) die("warm recv");
  }
}

static volatile int g_mode = 0;           // the variant of the gap in progress
static volatile uint64_t g_gap = 0;       // gaps begun (the receiver sets its ACK mode once per gap)
static volatile int g_stop = 0;
static volatile uint64_t g_handoff = 0;   // sender -> helper: send frame number g_handoff
static volatile int64_t g_handoff_ns = 0; // helper: send() duration of the last handoff
static volatile uint64_t g_got = 0;       // receiver -> sender: frames received
static volatile int64_t g_recv_done = 0, g_recv_ns = 0;
static int g_tx, g_rx;                    // the measured connection's ends
static int64_t g_period_ns = 500000;

static void* receiver(void* arg) {
  pin(((int*)arg)[0]);
  int wa, wb;
  tcp_pair(&wa, &wb);
  char buf[65536];
  int64_t next_warm = now_ns();
  uint64_t got = 0, gap_seen = 0;
  while (!g_stop) {
    if (g_gap != gap_seen) {
      gap_seen = g_gap;
      int q = (g_mode & DELACK) ? 0 : 1;
      setsockopt(g_rx, IPPROTO_TCP, TCP_QUICKACK, &q, sizeof q);
    }
    struct pollfd p = {g_rx, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) {
      int64_t t = now_ns();
      ssize_t n = recv(g_rx, buf, sizeof buf, MSG_DONTWAIT);
      int64_t t2 = now_ns();
      if (n <= 0) continue;
      g_recv_ns = t2 - t;
      g_recv_done = t2;
      __atomic_store_n(&g_got, ++got, __ATOMIC_RELEASE);
      continue;
    }
    int m = g_mode;
    if ((m & FFN) && now_ns() >= next_warm) {
      warm_once(wa, wb);
      next_warm = now_ns() + g_period_ns;
    }
  }
  return NULL;
}

static void* helper(void* arg) {
  pin(((int*)arg)[2]);
  int wa, wb;
  tcp_pair(&wa, &wb);
  int64_t next_warm = now_ns();
  uint64_t done = 0;
  while (!g_stop) {
    if (__atomic_load_n(&g_handoff, __ATOMIC_ACQUIRE) != done) {
      int64_t t = now_ns();
      if (send(g_tx, g_frame, sizeof g_frame, MSG_DONTWAIT | MSG_NOSIGNAL) != sizeof g_frame) die("handoff send");
      g_handoff_ns = now_ns() - t;
      ++done;
      continue;
    }
    int m = g_mode;
    if ((m & (HELPER | HANDOFF)) && now_ns() >= next_warm) {
      warm_once(wa, wb);
      next_warm = now_ns() + g_period_ns;
    }
  }
  return NULL;
}

static int cmp64(const void* a, const void* b) {
  int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return (x > y) - (x < y);
}

static double pct(int64_t* v, int n, double q) {
  qsort(v, n, sizeof *v, cmp64);
  return v[(int)(q * (n - 1))] / 1000.0;
}

int main(int argc, char** argv) {
  int steps = 400, cpus[3] = {1, 2, 3};
  double gaps[16];
  int ngaps = 0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--period-us") && i + 1 < argc) g_period_ns = atoll(argv[++i]) * 1000;
    else if (!strcmp(argv[i], "--cpus") && i + 1 < argc) sscanf(argv[++i], "%d,%d,%d", &cpus[0], &cpus[1], &cpus[2]);
    else if (ngaps < 16) gaps[ngaps++] = atof(argv[i]);
  }
  if (!ngaps) {
    double d[] = {1, 5, 20, 50};
    memcpy(gaps, d, sizeof d);
    ngaps = 4;
  }
  memset(g_frame, 7, sizeof g_frame);
  tcp_pair(&g_tx, &g_rx);
  pin(cpus[1]);
  int sa, sb;
  tcp_pair(&sa, &sb);
  pthread_t rt, ht;
  pthread_create(&rt, NULL, receiver, cpus);
  pthread_create(&ht, NULL, helper, cpus);
  printf("tcp_gap: receiver CPU %d, sender CPU %d, helper CPU %d, %d steps per variant and gap, warm period %lld us\n",
         cpus[0], cpus[1], cpus[2], steps, (long long)(g_period_ns / 1000));
  printf("%7s %-24s %16s %16s %16s\n", "gap ms", "variant", "e2e p50/p99", "send p50/p99", "recv p50/p99");
  int64_t* e2e[NV];
  int64_t* snd[NV];
  int64_t* rcv[NV];
  for (int v = 0; v < NV; ++v) {
    e2e[v] = malloc(sizeof(int64_t) * steps);
    snd[v] = malloc(sizeof(int64_t) * steps);
    rcv[v] = malloc(sizeof(int64_t) * steps);
  }
  uint64_t sent = 0;
  for (int g = 0; g < ngaps; ++g) {
    const int64_t gap = (int64_t)(gaps[g] * 1e6);
    for (int i = -NV * 5; i < NV * steps; ++i) {  // a few unrecorded steps first
      const int v = ((i % NV) + NV) % NV, m = kVariants[v];
      g_mode = m;
      ++g_gap;
      const int64_t end = now_ns() + gap;
      while (now_ns() < end) {
      }
      if (m & SELF) warm_once(sa, sb);
      const int64_t t0 = now_ns();
      int64_t t1;
      if (m & HANDOFF) {
        __atomic_store_n(&g_handoff, g_handoff + 1, __ATOMIC_RELEASE);
        t1 = t0;
      } else {
        if (send(g_tx, g_frame, sizeof g_frame, MSG_DONTWAIT | MSG_NOSIGNAL) != sizeof g_frame) die("send");
        t1 = now_ns();
      }
      ++sent;
      while (__atomic_load_n(&g_got, __ATOMIC_ACQUIRE) != sent) {
      }
      if (i < 0) continue;
      const int k = i / NV;
      e2e[v][k] = g_recv_done - t0;
      snd[v][k] = (m & HANDOFF) ? g_handoff_ns : t1 - t0;
      rcv[v][k] = g_recv_ns;
    }
    for (int v = 0; v < NV; ++v) {
      double e50 = pct(e2e[v], steps, 0.5), e99 = pct(e2e[v], steps, 0.99);
      double s50 = pct(snd[v], steps, 0.5), s99 = pct(snd[v], steps, 0.99);
      double r50 = pct(rcv[v], steps, 0.5), r99 = pct(rcv[v], steps, 0.99);
      printf("%7g %-24s %7.1f / %6.1f %7.1f / %6.1f %7.1f / %6.1f\n", gaps[g], name_of(kVariants[v]), e50, e99, s50, s99, r50, r99);
    }
    fflush(stdout);
  }
  g_stop = 1;
  pthread_join(rt, NULL);
  pthread_join(ht, NULL);
  return 0;
}
