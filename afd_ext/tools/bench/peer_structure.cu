// Bench-only minimal put/wait kernels (afd_ext/tools/bench/peer_structure.py). Flags are
// 64-bit sequence numbers in the receiver's memory; each side keeps one device
// counter `seq` (its puts so far), advanced only by its put's last block. A
// spin that outlives ~10 s traps (the process fails instead of hanging).
#include <cuda_runtime.h>
#include <stdint.h>

#define THREADS 512
#define MAXP 3

struct Parts {
  const char* src[MAXP];
  char* dst[MAXP];
  long long bytes[MAXP];
  int n;
};

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// One thread spins until *flag >= want (acquire).
__device__ __forceinline__ void spin(const unsigned long long* flag, unsigned long long want) {
  if (ld_acquire_sys(flag) >= want) return;
  const unsigned long long t0 = now_ns();
  for (unsigned it = 1; ld_acquire_sys(flag) < want; ++it) {
    if ((it & 1023) == 0 && now_ns() - t0 > 10000000000ull) asm volatile("trap;");
  }
}

// n bytes, all threads of the grid (thread t of nt); 16-byte vectors, 4 in flight; byte tail.
__device__ __forceinline__ void copy(char* __restrict__ dst, const char* __restrict__ src, long long n,
                                     long long t, long long nt) {
  const long long nv = n >> 4;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  long long v = t;
  for (; v + 3 * nt < nv; v += 4 * nt) {
    const uint4 a = s[v], b = s[v + nt], c = s[v + 2 * nt], e = s[v + 3 * nt];
    d[v] = a; d[v + nt] = b; d[v + 2 * nt] = c; d[v + 3 * nt] = e;
  }
  for (; v < nv; v += nt) d[v] = s[v];
  for (long long i = (nv << 4) + t; i < n; i += nt) dst[i] = src[i];
}

// After the block's stores: true in thread 0 of the last block to arrive (the
// block's stores released at system scope, every other block's acquired).
__device__ __forceinline__ bool last_block(unsigned* done) {
  __syncthreads();
  if (threadIdx.x != 0) return false;
  if (gridDim.x == 1) return true;  // bar.sync + the caller's st.release.sys cover the block
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  if (atom_add_acq_rel_gpu(done, 1u) != gridDim.x - 1) return false;
  *done = 0;  // next launch is stream-ordered after this one
  return true;
}

__global__ void __launch_bounds__(THREADS) min_put(const __grid_constant__ Parts p, unsigned* done,
                                                   unsigned long long* seq, unsigned long long* flag) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x, nt = (long long)gridDim.x * blockDim.x;
  for (int k = 0; k < p.n; ++k) copy(p.dst[k], p.src[k], p.bytes[k], t, nt);
  if (last_block(done)) {
    const unsigned long long s = *seq + 1;
    *seq = s;
    st_release_sys(flag, s);
  }
}

// Every block waits for *flag >= *seq + add, then copies its share of n bytes (n may be 0).
__global__ void __launch_bounds__(THREADS) min_wait(const unsigned long long* flag, const unsigned long long* seq,
                                                    unsigned long long add, const char* src, char* dst,
                                                    long long n) {
  if (threadIdx.x == 0) spin(flag, *seq + add);
  __syncthreads();
  if (n) copy(dst, src, n, (long long)blockIdx.x * blockDim.x + threadIdx.x, (long long)gridDim.x * blockDim.x);
}

// put + wait + copy-out in one kernel (grid <= SMs: every block stays resident while it spins).
__global__ void __launch_bounds__(THREADS) min_fused(const __grid_constant__ Parts p, unsigned* done,
                                                     unsigned long long* seq, unsigned long long* flag_out,
                                                     const unsigned long long* flag_in, const char* src,
                                                     char* dst, long long n) {
  __shared__ unsigned long long want;
  if (threadIdx.x == 0) want = *seq + 1;  // read before this block arrives: the last block bumps it
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x, nt = (long long)gridDim.x * blockDim.x;
  for (int k = 0; k < p.n; ++k) copy(p.dst[k], p.src[k], p.bytes[k], t, nt);
  if (last_block(done)) {
    *seq = want;
    st_release_sys(flag_out, want);
  }
  if (threadIdx.x == 0) spin(flag_in, want);
  __syncthreads();
  copy(dst, src, n, t, nt);
}

// The launch-free floor: one block per side loops over `rounds` round trips.
__global__ void __launch_bounds__(THREADS) floor_attn(const __grid_constant__ Parts p, int rounds,
                                                      unsigned long long* seq, unsigned long long* flag_out,
                                                      const unsigned long long* flag_in, const char* src,
                                                      char* dst, long long n) {
  const unsigned long long base = *seq;
  for (int r = 1; r <= rounds; ++r) {
    for (int k = 0; k < p.n; ++k) copy(p.dst[k], p.src[k], p.bytes[k], threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      st_release_sys(flag_out, base + r);
      spin(flag_in, base + r);
    }
    __syncthreads();
    copy(dst, src, n, threadIdx.x, blockDim.x);
  }
  __syncthreads();
  if (threadIdx.x == 0) *seq = base + rounds;
}

__global__ void __launch_bounds__(THREADS) floor_ffn(int rounds, unsigned long long* seq,
                                                     unsigned long long* flag_out,
                                                     const unsigned long long* flag_in, const char* src,
                                                     char* dst, long long n) {
  const unsigned long long base = *seq;
  for (int r = 1; r <= rounds; ++r) {
    if (threadIdx.x == 0) spin(flag_in, base + r);
    __syncthreads();
    copy(dst, src, n, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(flag_out, base + r);
  }
  if (threadIdx.x == 0) *seq = base + rounds;
}

static Parts parts_of(int n, void** src, void** dst, const long long* bytes) {
  Parts p{};
  p.n = n;
  for (int k = 0; k < n && k < MAXP; ++k) {
    p.src[k] = (const char*)src[k];
    p.dst[k] = (char*)dst[k];
    p.bytes[k] = bytes[k];
  }
  return p;
}

extern "C" {
int ps_put(void* stream, int grid, int n, void** src, void** dst, const long long* bytes, void* done, void* seq,
           void* flag) {
  min_put<<<grid, THREADS, 0, (cudaStream_t)stream>>>(parts_of(n, src, dst, bytes), (unsigned*)done,
                                                      (unsigned long long*)seq, (unsigned long long*)flag);
  return (int)cudaGetLastError();
}
int ps_wait(void* stream, int grid, void* flag, void* seq, unsigned long long add, void* src, void* dst,
            long long n) {
  min_wait<<<grid, THREADS, 0, (cudaStream_t)stream>>>((const unsigned long long*)flag,
                                                       (const unsigned long long*)seq, add, (const char*)src,
                                                       (char*)dst, n);
  return (int)cudaGetLastError();
}
int ps_fused(void* stream, int grid, int n, void** src, void** dst, const long long* bytes, void* done,
             void* seq, void* flag_out, void* flag_in, void* csrc, void* cdst, long long cn) {
  min_fused<<<grid, THREADS, 0, (cudaStream_t)stream>>>(
      parts_of(n, src, dst, bytes), (unsigned*)done, (unsigned long long*)seq, (unsigned long long*)flag_out,
      (const unsigned long long*)flag_in, (const char*)csrc, (char*)cdst, cn);
  return (int)cudaGetLastError();
}
int ps_floor_attn(void* stream, int rounds, int n, void** src, void** dst, const long long* bytes, void* seq,
                  void* flag_out, void* flag_in, void* csrc, void* cdst, long long cn) {
  floor_attn<<<1, THREADS, 0, (cudaStream_t)stream>>>(parts_of(n, src, dst, bytes), rounds,
                                                      (unsigned long long*)seq, (unsigned long long*)flag_out,
                                                      (const unsigned long long*)flag_in, (const char*)csrc,
                                                      (char*)cdst, cn);
  return (int)cudaGetLastError();
}
int ps_floor_ffn(void* stream, int rounds, void* seq, void* flag_out, void* flag_in, void* csrc, void* cdst,
                 long long cn) {
  floor_ffn<<<1, THREADS, 0, (cudaStream_t)stream>>>(rounds, (unsigned long long*)seq,
                                                     (unsigned long long*)flag_out,
                                                     (const unsigned long long*)flag_in, (const char*)csrc,
                                                     (char*)cdst, cn);
  return (int)cudaGetLastError();
}
int ps_enable_peer(int dev, int peer) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(dev);
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) e = cudaSuccess;
  cudaGetLastError();
  cudaSetDevice(prev);
  return (int)e;
}
}
