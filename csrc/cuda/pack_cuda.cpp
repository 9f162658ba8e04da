// CUDA-key impls of pack_rows / unpack_rows: check, describe, launch on the
// current stream (no allocation, no sync).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

void run(const char* op, const at::Tensor& hidden_states, const OptTensor& router_logits,
         const OptTensor& token_ids, const at::Tensor& wire, bool pack) {
  TORCH_CHECK(wire.is_cuda(), "afd_ext.", op, ": wire must be a CUDA tensor here, got ",
              wire.device());
  WireLayout layout =
      make_wire_layout(op, hidden_states, router_logits, token_ids, wire, pack);
  // The kernel reads and writes wire elements at their natural alignment.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(layout.wire) % 16 == 0 &&
                  (layout.rows <= 1 || layout.wire_row_stride % 16 == 0),
              "afd_ext.", op, ": wire rows must start at 16-byte aligned addresses (got data_ptr ",
              layout.wire, ", row stride ", layout.wire_row_stride,
              " bytes); allocate the wire as its own [n, row_bytes] tensor or take row slices of one");
  if (layout.rows == 0) return;
  c10::cuda::CUDAGuard guard(wire.device());
  void* stream = c10::cuda::getCurrentCUDAStream(wire.get_device()).stream();
  const int err = pack ? pack_rows_cuda_kernel(layout, stream)
                       : unpack_rows_cuda_kernel(layout, stream);
  if (err != 0) {
    throw_cuda_error(pack ? "pack_rows_cuda_kernel" : "unpack_rows_cuda_kernel", err,
                     cudaGetErrorString(static_cast<cudaError_t>(err)), __FILE__, __LINE__);
  }
}

}  // namespace

void pack_rows_cuda(const at::Tensor& hidden_states, const OptTensor& router_logits,
                    const OptTensor& token_ids, const at::Tensor& wire) {
  run("pack_rows", hidden_states, router_logits, token_ids, wire, true);
}

void unpack_rows_cuda(const at::Tensor& wire, const at::Tensor& hidden_states,
                      const OptTensor& router_logits, const OptTensor& token_ids) {
  run("unpack_rows", hidden_states, router_logits, token_ids, wire, false);
}

TORCH_LIBRARY_IMPL(afd_ext, CUDA, m) {
  m.impl("pack_rows", &pack_rows_cuda);
  m.impl("unpack_rows", &unpack_rows_cuda);
}

}  // namespace afd
