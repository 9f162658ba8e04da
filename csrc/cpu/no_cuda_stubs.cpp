// CPU-only build: the communicator-management ops and the CUDA-key impls
// exist (so every schema is callable and fakes/tests work) but say clearly
// that the library was built without CUDA.
#include <torch/csrc/stable/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void no_cuda(const char* op) { throw_no_cuda(op, "the NCCL ops are unavailable"); }

void send_no_cuda(const Tensor&, int64_t, int64_t) { no_cuda("send"); }
void recv_no_cuda(const Tensor&, int64_t, int64_t) { no_cuda("recv"); }
void fan_in_no_cuda(TensorList, IntList, IntList, IntList) { no_cuda("fan_in"); }
void split_back_no_cuda(TensorList, IntList, IntList, IntList) {
  no_cuda("split_back");
}

void fp8_quantize_no_cuda(const Tensor&, const Tensor&, const Tensor&, bool) {
  no_cuda("fp8_quantize");
}
void fp8_dequantize_no_cuda(const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("fp8_dequantize");
}

}  // namespace

int64_t nccl_version() { return 0; }
void nccl_unique_id(const Tensor&) { no_cuda("nccl_unique_id"); }
int64_t comm_create(const Tensor&, int64_t, int64_t, int64_t) { no_cuda("comm_create"); }
void comm_destroy(int64_t) { no_cuda("comm_destroy"); }
void comm_abort(int64_t) { no_cuda("comm_abort"); }
int64_t comm_async_error(int64_t) { no_cuda("comm_async_error"); }

STABLE_TORCH_LIBRARY_IMPL(afd_ext, CUDA, m) {
  m.impl("send", TORCH_BOX(&send_no_cuda));
  m.impl("recv", TORCH_BOX(&recv_no_cuda));
  m.impl("fan_in", TORCH_BOX(&fan_in_no_cuda));
  m.impl("split_back", TORCH_BOX(&split_back_no_cuda));
  m.impl("fp8_quantize", TORCH_BOX(&fp8_quantize_no_cuda));
  m.impl("fp8_dequantize", TORCH_BOX(&fp8_dequantize_no_cuda));
}

}  // namespace afd
