// Packed wire rows: the plain-data description the pack/unpack kernels work on.
//
// One wire row per token, bytes laid out as
//   [hidden bytes | pad to 16][router-logits bytes | pad to 16][token id 4 bytes | pad to 16]
// (absent parts take no bytes). This header is free of torch and CUDA headers
// so the CUDA kernel file compiles quickly; only the binding layer (wire.cpp,
// cpu/pack_cpu.cpp, cuda/pack_cuda.cpp) touches at::Tensor.
#pragma once

#include <cstdint>

namespace afd {

constexpr int kMaxWireParts = 3;

// One tensor's view in the packed row.
struct WirePart {
  char* ptr;            // byte address of element [0, 0]
  int64_t row_stride;   // bytes between consecutive rows
  int64_t col_stride;   // bytes between consecutive elements of one row
  int64_t cols;         // elements per row
  int64_t elem_size;    // bytes per element: 1, 2, 4 or 8
  int64_t wire_offset;  // byte offset of this part in the wire row (multiple of 16)
  int64_t wire_bytes;   // bytes reserved in the wire row: cols * elem_size rounded up to 16
  int vectorized;       // 1: rows are dense and every row start is 16-byte aligned on both sides
};

struct WireLayout {
  WirePart parts[kMaxWireParts];
  int num_parts;
  char* wire;               // byte address of wire row 0
  int64_t wire_row_stride;  // bytes between wire rows
  int64_t row_bytes;        // used bytes of one wire row (sum of wire_bytes)
  int64_t rows;             // tokens
};

// CPU reference kernels (cpu/pack_cpu.cpp). Pack writes every byte of each
// wire row, padding as zeros; unpack reads only the data bytes.
void pack_rows_cpu_kernel(const WireLayout& layout);
void unpack_rows_cpu_kernel(const WireLayout& layout);

// CUDA kernels (cuda/pack_kernels.cu), launched on `stream` (a cudaStream_t);
// they return the launch error code (0 = cudaSuccess) and never synchronise.
int pack_rows_cuda_kernel(const WireLayout& layout, void* stream);
int unpack_rows_cuda_kernel(const WireLayout& layout, void* stream);

}  // namespace afd
