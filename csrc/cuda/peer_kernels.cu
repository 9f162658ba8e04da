// Peer-memory plane kernels: peer_put (rows into peers' memory, then a flag
// per peer) and peer_wait (flags in this rank's memory, then an optional copy).
//
// Memory ordering (PTX memory model, written out in docs/peer-memory.md):
//   writer: every thread stores its data; bar.sync; with several blocks, thread 0
//           runs fence.acq_rel.sys and arrives on the launch's block counter
//           (atom.acq_rel.gpu); the last block (or the only one) runs one
//           fence.acq_rel.sys and stores each peer's flag with st.relaxed.sys
//           (fence + store: a release; NVSHMEM's put-with-signal order).
//   reader: one thread per flag spins with ld.acquire.sys; bar.sync hands the
//           acquire to the whole block; later kernels on the stream see the
//           data (kernel boundary).
// No fence.sc.sys outside the failure record: under a concurrent copy on the
// GPU, one per block made the put ~10x slower (issue #35's profile).
// Includes no torch header, so it compiles in seconds.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "../peer.h"

namespace afd {

namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The same without a memory clobber: plain loads may be issued around it.
__device__ __forceinline__ int ld_relaxed_gpu_nomem(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Host-mapped word: a volatile load goes over the bus every time.
__device__ __forceinline__ long long ld_volatile_host(const long long* p) {
  return *reinterpret_cast<const volatile long long*>(p);
}

// Programmatic dependent launch (Hopper+; no-ops when the launch did not ask
// for it). Both kernels run griddepcontrol.wait before any memory access, so
// only the launch and block scheduling overlap the kernel before; they trigger
// their dependents after their copy (put) or their spin (wait).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Copies n bytes from src to dst with all `nthreads` threads of the grid
// (thread index `t`): 16-byte vectors (4 in flight per thread) when both ends
// are 16-byte aligned, 4-byte words when 4-byte aligned, bytes otherwise.
// Stores nothing when `dead` (tested after the first loads are in flight).
__device__ __forceinline__ void copy_range(char* dst, const char* src, long long n, long long t,
                                           long long nthreads, int dead) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  long long done = 0;
  if ((align & 15) == 0) {
    const long long nv = n >> 4;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    long long v = t;
    for (; v + 3 * nthreads < nv; v += 4 * nthreads) {
      const uint4 a = s[v], b = s[v + nthreads], c = s[v + 2 * nthreads], e = s[v + 3 * nthreads];
      if (dead) return;
      d[v] = a;
      d[v + nthreads] = b;
      d[v + 2 * nthreads] = c;
      d[v + 3 * nthreads] = e;
    }
    if (dead) return;
    for (; v < nv; v += nthreads) d[v] = s[v];
    done = nv << 4;
  } else if (dead) {
    return;
  } else if ((align & 3) == 0) {
    const long long nw = n >> 2;
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (long long w = t; w < nw; w += nthreads) d[w] = s[w];
    done = nw << 2;
  }
  for (long long b = done + t; b < n; b += nthreads) dst[b] = src[b];
}

// FP8 hidden states (docs/fp8.md): per row and 128 channels, scale = amax / 448 over the finite
// x (1 when that is 0), values = x / scale rounded to nearest even, saturated to +-448; an inf or
// NaN x is the NaN byte 0x7F with x's sign; UE8M0 scales are rounded up to a power of two, at least
// 2^-22 (DeepEP's round_scale with its 1e-4 amax floor). Bit-exact with the torch rule in afd_ext/fp8.py, so
// no float operation the build's --use_fast_math (-ftz=true) can flush: amax compares bf16 bit
// patterns (|x| as integers orders like the floats), the divisions and the product are PTX .rn
// without .ftz, and the zero test reads the scale's bits (a float `s == 0` compiles to
// setp.eq.ftz, true for a subnormal scale).
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// |x| of the bf16 in the low half of `h` as an integer (orders like the floats); 0 for an inf or
// NaN, which do not set their group's scale.
__device__ __forceinline__ unsigned finite_abs_bf16(unsigned h) {
  const unsigned a = h & 0x7fffu;
  return a < 0x7f80u ? a : 0u;
}

// The scale of a group whose largest finite |x| has float32 bits `amax`: amax / 448, 1 when that is
// +0; with `ue8m0`, 2^ceil(log2(amax / 448)) from the quotient's bits (exponent up where any
// mantissa bit is set), exponent at least 105 (2^-22 = 2^ceil(log2(1e-4 / 448)), the floor's).
__device__ __forceinline__ float group_scale(unsigned amax, int ue8m0) {
  const float s = div_rn(__uint_as_float(amax), 448.0f);
  const unsigned b = __float_as_uint(s);
  if (!ue8m0) return b == 0u ? 1.0f : s;
  return __uint_as_float(max((b >> 23) + ((b & 0x7fffffu) != 0u), 105u) << 23);
}

// One warp per 128-channel group (lane l: channels 4l..4l+3); groups are consecutive in a
// row-major [rows, H] tensor (H a multiple of 128), so group g is elements [128 g, 128 g + 128)
// and its scale is scales[g]. `t`/`nthreads`: the grid's thread index and size (multiples of
// 32). Stores nothing when `dead`.
__device__ __forceinline__ void quantize_groups(unsigned char* values, float* scales, const char* x,
                                                long long groups, long long t, long long nthreads,
                                                int dead, int ue8m0) {
  const int lane = threadIdx.x & 31;
  for (long long g = t >> 5; g < groups; g += nthreads >> 5) {
    const uint2 raw = reinterpret_cast<const uint2*>(x + g * (kFp8Group * 2))[lane];
    unsigned m = max(max(finite_abs_bf16(raw.x), finite_abs_bf16(raw.x >> 16)),
                     max(finite_abs_bf16(raw.y), finite_abs_bf16(raw.y >> 16)));
    m = __reduce_max_sync(0xffffffffu, m);
    const float s = group_scale(m << 16, ue8m0);
    const unsigned w[4] = {raw.x << 16, raw.x & 0xffff0000u, raw.y << 16, raw.y & 0xffff0000u};
    unsigned packed = 0;
    for (int j = 0; j < 4; ++j) {
      // satfinite: +-448 for larger magnitudes (the reference clamps, then rounds: the same bytes);
      // an inf would saturate too, so non-finite x take the NaN byte here, with their sign
      const unsigned q = (w[j] & 0x7fffffffu) >= 0x7f800000u
                             ? 0x7fu | ((w[j] >> 24) & 0x80u)
                             : __nv_cvt_float_to_fp8(div_rn(__uint_as_float(w[j]), s), __NV_SATFINITE, __NV_E4M3);
      packed |= q << (8 * j);
    }
    if (dead) return;
    reinterpret_cast<unsigned*>(values + g * kFp8Group)[lane] = packed;
    if (lane == 0) scales[g] = s;
  }
}

// out[i] = bf16(float(values[i]) * scales[i / 128]), 8 elements per step (numel % 128 == 0).
__device__ __forceinline__ void dequantize_range(char* out, const char* values, const float* scales,
                                                 long long numel, long long t, long long nthreads) {
  for (long long v = t; v < (numel >> 3); v += nthreads) {
    const uint2 raw = reinterpret_cast<const uint2*>(values)[v];
    const float s = scales[v >> 4];
    unsigned o[4];
    for (int j = 0; j < 4; ++j) {
      const unsigned word = j < 2 ? raw.x : raw.y;
      const int sh = 16 * (j & 1);
      const float lo = __half2float(__half(__nv_cvt_fp8_to_halfraw(
          static_cast<__nv_fp8_storage_t>((word >> sh) & 0xff), __NV_E4M3)));
      const float hi = __half2float(__half(__nv_cvt_fp8_to_halfraw(
          static_cast<__nv_fp8_storage_t>((word >> (sh + 8)) & 0xff), __NV_E4M3)));
      const __nv_bfloat162 b = __floats2bfloat162_rn(mul_rn(lo, s), mul_rn(hi, s));
      o[j] = *reinterpret_cast<const unsigned*>(&b);
    }
    reinterpret_cast<uint4*>(out)[v] = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Records the plane's first failure: the device word first (so every later
// wait returns at once), then the host record, its code word last.
__device__ void record_failure(const PeerPlaneDev& p, int code, int op, int peer, int layer, int stage,
                               unsigned long long want, unsigned long long seen,
                               unsigned long long waited_ns) {
  if (atomicCAS(p.failed, 0, code) != 0) return;
  long long* h = p.host_err;
  if (ld_volatile_host(h + kPeerErrCode) != 0) return;  // the host aborted first: keep its record
  volatile long long* vh = h;
  vh[kPeerErrOp] = op;
  vh[kPeerErrPeer] = peer;
  vh[kPeerErrLayer] = layer;
  vh[kPeerErrStage] = stage;
  vh[kPeerErrWant] = static_cast<long long>(want);
  vh[kPeerErrSeen] = static_cast<long long>(seen);
  vh[kPeerErrWaitedNs] = static_cast<long long>(waited_ns);
  fence_sc_sys();
  vh[kPeerErrCode] = code;
  fence_sc_sys();
}

// Spins until *flag == gen_bits | want_seq (acquired, true) or the plane fails
// / the deadline passes (false). Polls with ld.acquire.sys (no fence after the
// hit, like the minimal wait). Every 64 polls: the device `failed` word and
// the clock; block 0 only also reads the host-mapped abort word (a bus read;
// other blocks see an abort through `failed`, which block 0 sets).
template <class A>
__device__ bool wait_flag(const A& a, int i, unsigned long long want_seq) {
  const PeerPlaneDev& p = a.plane;
  const unsigned long long want = p.gen_bits | want_seq;
  unsigned long long v = ld_acquire_sys(a.flag[i]);
  if (v == want) return true;
  if (ld_relaxed_gpu(p.failed) != 0) return false;
  const unsigned long long t0 = globaltimer_ns();
  for (unsigned it = 1;; ++it) {
    if ((v & ~kPeerSeqMask) == p.gen_bits && (v & kPeerSeqMask) > want_seq) {
      record_failure(p, kPeerProtocol, a.op, a.peer_id[i], a.layer, a.stage, want_seq, v,
                     globaltimer_ns() - t0);
      return false;
    }
    if ((it & 63) == 0) {
      if (ld_relaxed_gpu(p.failed) != 0) return false;
      if (blockIdx.x == 0) {
        const long long host_code = ld_volatile_host(p.host_err + kPeerErrCode);
        if (host_code != 0) {
          atomicCAS(p.failed, 0, static_cast<int>(host_code));
          return false;
        }
      }
      const unsigned long long waited = globaltimer_ns() - t0;
      if (static_cast<long long>(waited) > a.timeout_ns) {
        record_failure(p, kPeerTimeout, a.op, a.peer_id[i], a.layer, a.stage, want_seq, v, waited);
        return false;
      }
    }
    v = ld_acquire_sys(a.flag[i]);
    if (v == want) return true;
  }
}

// Kernel arguments sized on the call's peer count (P = 1, 8 or kPeerMaxPeers):
// a one-peer put passes ~300 bytes, not PeerPutArgs' 2.9 KB (launch cost).
template <int P>
struct PutArgs {
  PeerPlaneDev plane;
  int slot;
  int npeers;
  int nparts;
  const char* src[kPeerMaxParts];
  long long row_bytes[kPeerMaxParts];
  long long part_off[kPeerMaxParts];
  char* dst_base[P];
  unsigned long long* flag[P];
  long long rows[P];
  long long src_row[P];
  long long dst_row[P];
  int quant;
  long long scales_off;
};

template <int P>
struct WaitArgs {
  PeerPlaneDev plane;
  int slot;
  int npeers;
  int op;
  int layer;
  int stage;
  long long timeout_ns;
  const char* copy_src;
  char* copy_dst;
  long long copy_bytes;
  const float* dq_scales;
  unsigned long long* flag[P];
  int peer_id[P];
};

// Writer: rows, bar.sync, then thread 0 of each block fence.acq_rel.sys + arrive
// (atom.acq_rel.gpu); the last block (or the only one: bar.sync suffices) checks
// `failed` again and publishes every flag after one fence.acq_rel.sys.
template <int P>
__global__ void __launch_bounds__(kThreads) peer_put_kernel(const __grid_constant__ PutArgs<P> a) {
  const PeerPlaneDev& p = a.plane;
  pdl_wait();  // the rows may come from the kernel before
  // A failed plane writes nothing: a peer must never take data put after a
  // failure. Read by every thread (one broadcast load per warp, no barrier);
  // the copy issues its first loads before it needs the answer.
  const int dead = ld_relaxed_gpu_nomem(p.failed);
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long nt = static_cast<long long>(gridDim.x) * blockDim.x;
  const int np = a.npeers < P ? a.npeers : P;  // lets the compiler drop the loops for P = 1
  for (int i = 0; i < np; ++i) {
    if (a.rows[i] == 0) continue;  // zero-token peers move no bytes (their flag still advances)
    for (int k = 0; k < a.nparts; ++k) {
      const long long rb = a.row_bytes[k];
      if (k == 0 && a.quant) {  // bf16 rows -> e4m3 values + scales, straight into the peer's part
        const long long h = rb >> 1, groups = h / kFp8Group;
        quantize_groups(reinterpret_cast<unsigned char*>(a.dst_base[i] + a.part_off[0]) + a.dst_row[i] * h,
                        reinterpret_cast<float*>(a.dst_base[i] + a.scales_off) + a.dst_row[i] * groups,
                        a.src[0] + a.src_row[i] * rb, a.rows[i] * groups, t, nt, dead, a.quant == 2);
        continue;
      }
      copy_range(a.dst_base[i] + a.part_off[k] + a.dst_row[i] * rb, a.src[k] + a.src_row[i] * rb,
                 a.rows[i] * rb, t, nt, dead);
    }
  }
  pdl_trigger();  // the next kernel (a wait) may start spinning while the flags go out
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (gridDim.x > 1) {
    fence_acq_rel_sys();
    unsigned* done = p.done + a.slot;
    if (atom_add_acq_rel_gpu(done, 1u) != gridDim.x - 1) return;
    *done = 0;  // the next launch of this slot is stream-ordered after this one
  }
  // Both loads are in flight while the fence drains this thread's memory operations.
  unsigned long long* c = p.counters + static_cast<long long>(a.slot) * p.max_peers;
  const int late = ld_relaxed_gpu(p.failed);
  const unsigned long long first = np > 0 ? c[0] : 0;
  fence_acq_rel_sys();  // one fence + relaxed stores: a release for every flag
  if (late != 0) return;  // failed meanwhile: publish nothing
  for (int i = 0; i < np; ++i) {
    const unsigned long long seq = (i == 0 ? first : c[i]) + 1;
    c[i] = seq;
    st_relaxed_sys(a.flag[i], p.gen_bits | seq);
  }
}

// Reader: threads < npeers read their wait counter and spin on their flag (in
// every block); meanwhile the block's last thread arrives on the slot's block
// counter, and the last block to arrive advances the counters (every block has
// read them: bar.sync before the arrive). No system fence: a wait writes nothing
// a peer reads.
template <int P>
__global__ void __launch_bounds__(kThreads) peer_wait_kernel(const __grid_constant__ WaitArgs<P> a) {
  const PeerPlaneDev& p = a.plane;
  pdl_wait();  // with PDL only the launch overlaps the kernel before, never a memory access
  unsigned long long* c = p.counters + static_cast<long long>(a.slot) * p.max_peers;
  unsigned long long want_seq = 0;
  if (threadIdx.x < a.npeers) want_seq = c[threadIdx.x] + 1;
  __syncthreads();
  int ok = 1;
  if (threadIdx.x < a.npeers) {
    ok = wait_flag(a, threadIdx.x, want_seq);
  } else if (threadIdx.x == blockDim.x - 1) {
    if (gridDim.x == 1 || atom_add_acq_rel_gpu(p.done + a.slot, 1u) == gridDim.x - 1) {
      if (gridDim.x > 1) p.done[a.slot] = 0;
      for (int i = 0; i < a.npeers; ++i) c[i] += 1;
    }
  }
  if (!__syncthreads_and(ok)) return;
  // Not before the spin: the next kernel's blocks would hold SMs the peer's put
  // may need (both roles on one GPU).
  pdl_trigger();
  if (a.copy_bytes > 0) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nt = static_cast<long long>(gridDim.x) * blockDim.x;
    if (a.dq_scales != nullptr) {
      dequantize_range(a.copy_dst, a.copy_src, a.dq_scales, a.copy_bytes, t, nt);
    } else {
      copy_range(a.copy_dst, a.copy_src, a.copy_bytes, t, nt, 0);
    }
  }
}

__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(const char* x, unsigned char* values,
                                                                float* scales, long long groups, int ue8m0) {
  quantize_groups(values, scales, x, groups, static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<long long>(gridDim.x) * blockDim.x, 0, ue8m0);
}

__global__ void __launch_bounds__(kThreads) fp8_dequantize_kernel(const char* values, const float* scales,
                                                                  char* out, long long numel) {
  dequantize_range(out, values, scales, numel, static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x,
                   static_cast<long long>(gridDim.x) * blockDim.x);
}

int blocks_for(long long bytes, int max_blocks) {
  // About 64 KiB per block: one block for a decode step, every SM for a prefill.
  long long b = (bytes + (64 << 10) - 1) >> 16;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<int>(b);
}

// Programmatic stream serialization (see pdl_wait/pdl_trigger) overlaps a kernel's launch with the
// end of the one before it. AFD_PEER_PDL (read at each launch, so at capture time for a graph) forces
// it on or off; unset, it is on for grids of at most half the SMs on Hopper+: there it took the
// one-GPU round trip from 1.17x / 1.18x to 1.05x / 1.10x the minimal kernels at 1 / 128 tokens, while
// larger grids (1024, 8192 tokens) lost 4-8% with it (runs 58 and 64, docs/peer-memory.md).
bool pdl_enabled(int grid) {
  const char* e = std::getenv("AFD_PEER_PDL");  // afd_ext.envs.parse_bool's true values
  if (e == nullptr || e[0] == '\0') {
    int dev = 0, major = 0, sms = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 &&
           cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && 2 * grid <= sms;
  }
  const char c = e[0] | 0x20;
  return e[0] == '1' || c == 't' || c == 'y' || (c == 'o' && (e[1] | 0x20) == 'n');
}

template <class Args>
int launch(void (*kernel)(Args), const Args& a, int grid, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled(grid) ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, a);
  return static_cast<int>(e != cudaSuccess ? e : cudaGetLastError());
}

template <int P>
int launch_put(const PeerPutArgs& in, int grid, cudaStream_t stream) {
  PutArgs<P> a;
  a.plane = in.plane;
  a.slot = in.slot;
  a.npeers = in.npeers;
  a.nparts = in.nparts;
  for (int k = 0; k < kPeerMaxParts; ++k) {
    a.src[k] = in.src[k];
    a.row_bytes[k] = in.row_bytes[k];
    a.part_off[k] = in.part_off[k];
  }
  for (int i = 0; i < P; ++i) {
    const bool on = i < in.npeers;
    a.dst_base[i] = on ? in.dst_base[i] : nullptr;
    a.flag[i] = on ? in.flag[i] : nullptr;
    a.rows[i] = on ? in.rows[i] : 0;
    a.src_row[i] = on ? in.src_row[i] : 0;
    a.dst_row[i] = on ? in.dst_row[i] : 0;
  }
  a.quant = in.quant;
  a.scales_off = in.scales_off;
  return launch(&peer_put_kernel<P>, a, grid, stream);
}

template <int P>
int launch_wait(const PeerWaitArgs& in, int grid, cudaStream_t stream) {
  WaitArgs<P> a;
  a.plane = in.plane;
  a.slot = in.slot;
  a.npeers = in.npeers;
  a.op = in.op;
  a.layer = in.layer;
  a.stage = in.stage;
  a.timeout_ns = in.timeout_ns;
  a.copy_src = in.copy_src;
  a.copy_dst = in.copy_dst;
  a.copy_bytes = in.copy_bytes;
  a.dq_scales = in.dq_scales;
  for (int i = 0; i < P; ++i) {
    const bool on = i < in.npeers;
    a.flag[i] = on ? in.flag[i] : nullptr;
    a.peer_id[i] = on ? in.peer_id[i] : 0;
  }
  return launch(&peer_wait_kernel<P>, a, grid, stream);
}

}  // namespace

int peer_put_launch(const PeerPutArgs& args, int max_blocks, void* stream) {
  long long bytes = 0;
  for (int i = 0; i < args.npeers; ++i) {
    for (int k = 0; k < args.nparts; ++k) bytes += args.rows[i] * args.row_bytes[k];
  }
  const int grid = blocks_for(bytes, max_blocks);
  const auto s = static_cast<cudaStream_t>(stream);
  if (args.npeers <= 1) return launch_put<1>(args, grid, s);
  if (args.npeers <= 8) return launch_put<8>(args, grid, s);
  return launch_put<kPeerMaxPeers>(args, grid, s);
}

int peer_wait_launch(const PeerWaitArgs& args, int max_blocks, void* stream) {
  // A dequantizing wait writes twice the bytes it reads: size the grid on the writes.
  const int grid = blocks_for(args.copy_bytes * (args.dq_scales != nullptr ? 2 : 1), max_blocks);
  const auto s = static_cast<cudaStream_t>(stream);
  if (args.npeers <= 1) return launch_wait<1>(args, grid, s);
  if (args.npeers <= 8) return launch_wait<8>(args, grid, s);
  return launch_wait<kPeerMaxPeers>(args, grid, s);
}

int fp8_quantize_launch(const void* x, void* values, float* scales, long long groups, int ue8m0,
                        int max_blocks, void* stream) {
  if (groups == 0) return 0;
  const int grid = blocks_for(groups * kFp8Group * 2, max_blocks);
  fp8_quantize_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const char*>(x), static_cast<unsigned char*>(values), scales, groups, ue8m0);
  return static_cast<int>(cudaGetLastError());
}

int fp8_dequantize_launch(const void* values, const float* scales, void* out, long long numel,
                          int max_blocks, void* stream) {
  if (numel == 0) return 0;
  const int grid = blocks_for(numel * 2, max_blocks);
  fp8_dequantize_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const char*>(values), scales, static_cast<char*>(out), numel);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace afd
