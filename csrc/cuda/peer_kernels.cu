// Peer-memory plane kernels: peer_put (rows into peers' memory, then a flag
// per peer) and peer_wait (flags in this rank's memory, then an optional copy).
//
// Memory ordering (PTX memory model, written out in docs/peer-memory.md):
//   writer: every thread stores its data; bar.sync; thread 0 runs fence.sc.sys
//           and arrives on the launch's block counter (atom.acq_rel.gpu); the
//           last block to arrive runs fence.sc.sys again and publishes each
//           peer's flag with st.release.sys (NVSHMEM's put-with-signal order).
//   reader: one thread per flag spins with ld.relaxed.sys, then runs
//           fence.acq_rel.sys; bar.sync hands the acquire to the whole block;
//           later kernels on the stream see the data (kernel boundary).
// Includes no torch header, so it compiles in seconds.
#include <cuda_runtime.h>

#include <cstdint>

#include "../peer.h"

namespace afd {

namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ unsigned long long ld_relaxed_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
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

// Host-mapped word: a volatile load goes over the bus every time.
__device__ __forceinline__ long long ld_volatile_host(const long long* p) {
  return *reinterpret_cast<const volatile long long*>(p);
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Copies n bytes from src to dst with all `nthreads` threads of the grid
// (thread index `t`): 16-byte vectors (4 in flight per thread) when both ends
// are 16-byte aligned, 4-byte words when 4-byte aligned, bytes otherwise.
__device__ void copy_range(char* dst, const char* src, long long n, long long t, long long nthreads) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  long long done = 0;
  if ((align & 15) == 0) {
    const long long nv = n >> 4;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    long long v = t;
    for (; v + 3 * nthreads < nv; v += 4 * nthreads) {
      const uint4 a = s[v], b = s[v + nthreads], c = s[v + 2 * nthreads], e = s[v + 3 * nthreads];
      d[v] = a;
      d[v + nthreads] = b;
      d[v + 2 * nthreads] = c;
      d[v + 3 * nthreads] = e;
    }
    for (; v < nv; v += nthreads) d[v] = s[v];
    done = nv << 4;
  } else if ((align & 3) == 0) {
    const long long nw = n >> 2;
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (long long w = t; w < nw; w += nthreads) d[w] = s[w];
    done = nw << 2;
  }
  for (long long b = done + t; b < n; b += nthreads) dst[b] = src[b];
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

// Spins until *flag == gen_bits | want_seq (then acquire, true) or the plane
// fails / the deadline passes (false). Checks the failure words and the clock
// every 64 polls: the host word costs a bus read.
__device__ bool wait_flag(const PeerWaitArgs& a, int i, unsigned long long want_seq) {
  const PeerPlaneDev& p = a.plane;
  const unsigned long long want = p.gen_bits | want_seq;
  unsigned long long v = ld_relaxed_sys(a.flag[i]);
  if (v == want) {
    fence_acq_rel_sys();
    return true;
  }
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
      const long long host_code = ld_volatile_host(p.host_err + kPeerErrCode);
      if (host_code != 0) {
        atomicCAS(p.failed, 0, static_cast<int>(host_code));
        return false;
      }
      const unsigned long long waited = globaltimer_ns() - t0;
      if (static_cast<long long>(waited) > a.timeout_ns) {
        record_failure(p, kPeerTimeout, a.op, a.peer_id[i], a.layer, a.stage, want_seq, v, waited);
        return false;
      }
    }
    v = ld_relaxed_sys(a.flag[i]);
    if (v == want) {
      fence_acq_rel_sys();
      return true;
    }
  }
}

// True in every thread of the block that arrived last on the launch's block
// counter (which it resets for the next launch of this slot: stream order).
// Call after the block's work; it orders that work before the caller's next
// stores at system scope.
__device__ bool arrive_last(unsigned* done) {
  __shared__ int last;
  __syncthreads();
  if (gridDim.x == 1) {
    // One block (a decode step): no counter, only the system fence.
    if (threadIdx.x == 0) fence_sc_sys();
    __syncthreads();
    return true;
  }
  if (threadIdx.x == 0) {
    fence_sc_sys();
    const unsigned prev = atom_add_acq_rel_gpu(done, 1u);
    last = (prev == gridDim.x - 1);
    if (last) {
      *done = 0;
      fence_sc_sys();
    }
  }
  __syncthreads();
  return last != 0;
}

__global__ void __launch_bounds__(kThreads) peer_put_kernel(const __grid_constant__ PeerPutArgs a) {
  const PeerPlaneDev& p = a.plane;
  __shared__ int skip;
  if (threadIdx.x == 0) skip = ld_relaxed_gpu(p.failed);
  __syncthreads();
  // A failed plane writes nothing: a peer must never take data put after a failure.
  if (skip != 0) return;
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long nt = static_cast<long long>(gridDim.x) * blockDim.x;
  for (int i = 0; i < a.npeers; ++i) {
    if (a.rows[i] == 0) continue;  // zero-token peers move no bytes (their flag still advances)
    for (int k = 0; k < a.nparts; ++k) {
      const long long rb = a.row_bytes[k];
      copy_range(a.dst_base[i] + a.part_off[k] + a.dst_row[i] * rb, a.src[k] + a.src_row[i] * rb,
                 a.rows[i] * rb, t, nt);
    }
  }
  if (!arrive_last(p.done + a.slot)) return;
  // The thread that ran the fences publishes every flag (few peers).
  if (threadIdx.x == 0) {
    unsigned long long* c = p.counters + static_cast<long long>(a.slot) * p.max_peers;
    for (int i = 0; i < a.npeers; ++i) {
      const unsigned long long seq = c[i] + 1;
      c[i] = seq;
      st_release_sys(a.flag[i], p.gen_bits | seq);
    }
  }
}

__global__ void __launch_bounds__(kThreads) peer_wait_kernel(const __grid_constant__ PeerWaitArgs a) {
  const PeerPlaneDev& p = a.plane;
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  unsigned long long want_seq = 0;
  // Every block reads the counters before any block arrives below, and only
  // the last block to arrive advances them, so all blocks wait for one seq.
  if (threadIdx.x < a.npeers) {
    want_seq = p.counters[static_cast<long long>(a.slot) * p.max_peers + threadIdx.x] + 1;
    if (!wait_flag(a, threadIdx.x, want_seq)) ok = 0;
  }
  __syncthreads();
  if (ok && a.copy_bytes > 0) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nt = static_cast<long long>(gridDim.x) * blockDim.x;
    copy_range(a.copy_dst, a.copy_src, a.copy_bytes, t, nt);
  }
  if (gridDim.x == 1) {
    __syncthreads();
  } else if (!arrive_last(p.done + a.slot)) {
    return;
  }
  if (threadIdx.x < a.npeers) {
    p.counters[static_cast<long long>(a.slot) * p.max_peers + threadIdx.x] = want_seq;
  }
}

int blocks_for(long long bytes, int max_blocks) {
  // About 64 KiB per block: one block for a decode step, every SM for a prefill.
  long long b = (bytes + (64 << 10) - 1) >> 16;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<int>(b);
}

}  // namespace

int peer_put_launch(const PeerPutArgs& args, int max_blocks, void* stream) {
  long long bytes = 0;
  for (int i = 0; i < args.npeers; ++i) {
    for (int k = 0; k < args.nparts; ++k) bytes += args.rows[i] * args.row_bytes[k];
  }
  peer_put_kernel<<<blocks_for(bytes, max_blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

int peer_wait_launch(const PeerWaitArgs& args, int max_blocks, void* stream) {
  peer_wait_kernel<<<blocks_for(args.copy_bytes, max_blocks), kThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace afd
