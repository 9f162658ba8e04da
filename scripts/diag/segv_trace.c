// LD_PRELOAD helper: on SIGSEGV/SIGABRT print the faulting address and a
// glibc backtrace (with the shared object of every frame) to stderr, then exit.
// Build: gcc -shared -fPIC -O0 -g -o /tmp/segv_trace.so segv_trace.c
// Use:   LD_PRELOAD=/tmp/segv_trace.so python3 -c '...'   (PYTHONFAULTHANDLER unset)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  void* frames[64];
  char line[512];
  int n = backtrace(frames, 64);
  int len = snprintf(line, sizeof line, "segv_trace: signal %d at address %p, %d frames\n", sig,
                     info ? info->si_addr : NULL, n);
  write(2, line, len);
  for (int i = 0; i < n; ++i) {
    Dl_info d;
    memset(&d, 0, sizeof d);
    dladdr(frames[i], &d);
    len = snprintf(line, sizeof line, "  #%02d %p %s(%s+0x%lx)\n", i, frames[i],
                   d.dli_fname ? d.dli_fname : "?", d.dli_sname ? d.dli_sname : "?",
                   d.dli_saddr ? (unsigned long)((char*)frames[i] - (char*)d.dli_saddr)
                               : (unsigned long)((char*)frames[i] - (char*)d.dli_fbase));
    write(2, line, len);
  }
  _exit(128 + sig);
}

__attribute__((constructor)) static void install(void) {
  static char stack[1 << 16];
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
