// Fused pack/unpack of wire rows: one thread block per token (grid-stride),
// each part copied with 16-byte vector accesses when both sides are aligned
// and dense, element by element otherwise. Includes no torch header, so it
// compiles in seconds.
#include <cuda_runtime.h>

#include <cstdint>

#include "../wire.h"

namespace afd {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;

template <typename T, bool kPack>
__device__ __forceinline__ void copy_elems(const WirePart& p, char* t_row, char* w, int tid) {
  for (int64_t c = tid; c < p.cols; c += blockDim.x) {
    T* t_el = reinterpret_cast<T*>(t_row + c * p.col_stride);
    T* w_el = reinterpret_cast<T*>(w) + c;
    if (kPack) {
      *w_el = *t_el;
    } else {
      *t_el = *w_el;
    }
  }
}

template <bool kPack>
__device__ __forceinline__ void copy_part(const WirePart& p, int64_t row, char* wire_row) {
  const int tid = threadIdx.x;
  char* t_row = p.ptr + row * p.row_stride;
  char* w = wire_row + p.wire_offset;
  const int64_t data_bytes = p.cols * p.elem_size;
  if (p.vectorized) {
    const int64_t vecs = data_bytes / 16;
    uint4* tv = reinterpret_cast<uint4*>(t_row);
    uint4* wv = reinterpret_cast<uint4*>(w);
    for (int64_t i = tid; i < vecs; i += blockDim.x) {
      if (kPack) {
        wv[i] = tv[i];
      } else {
        tv[i] = wv[i];
      }
    }
    for (int64_t b = vecs * 16 + tid; b < data_bytes; b += blockDim.x) {
      if (kPack) {
        w[b] = t_row[b];
      } else {
        t_row[b] = w[b];
      }
    }
  } else {
    switch (p.elem_size) {
      case 1: copy_elems<uint8_t, kPack>(p, t_row, w, tid); break;
      case 2: copy_elems<uint16_t, kPack>(p, t_row, w, tid); break;
      case 4: copy_elems<uint32_t, kPack>(p, t_row, w, tid); break;
      default: copy_elems<uint64_t, kPack>(p, t_row, w, tid); break;
    }
  }
  if (kPack) {
    // Zero the padding so wire rows are fully defined (bit-exact comparisons).
    for (int64_t b = data_bytes + tid; b < p.wire_bytes; b += blockDim.x) w[b] = 0;
  }
}

template <bool kPack>
__global__ void __launch_bounds__(kThreads) wire_rows_kernel(WireLayout layout) {
  for (int64_t row = blockIdx.x; row < layout.rows; row += gridDim.x) {
    char* wire_row = layout.wire + row * layout.wire_row_stride;
    for (int i = 0; i < layout.num_parts; ++i) copy_part<kPack>(layout.parts[i], row, wire_row);
  }
}

template <bool kPack>
int launch(const WireLayout& layout, void* stream) {
  if (layout.rows <= 0) return 0;
  const int blocks = static_cast<int>(layout.rows < kMaxBlocks ? layout.rows : kMaxBlocks);
  wire_rows_kernel<kPack><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(layout);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int pack_rows_cuda_kernel(const WireLayout& layout, void* stream) {
  return launch<true>(layout, stream);
}

int unpack_rows_cuda_kernel(const WireLayout& layout, void* stream) {
  return launch<false>(layout, stream);
}

}  // namespace afd
