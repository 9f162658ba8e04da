// CPU-key impls of the communication ops: NCCL moves CUDA tensors only, so a
// CPU tensor gets a clear error before anything moves.
#include <torch/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void reject_cpu(const char* op) {
#ifdef AFD_WITH_CUDA
  TORCH_CHECK(false, "afd_ext.", op,
              ": got CPU tensors, but the NCCL ops move CUDA tensors on the communicator's "
              "device; move them with .to(device) or use the gloo transport for CPU tensors");
#else
  TORCH_CHECK(false, "afd_ext.", op,
              ": afd_ext was built without CUDA, so the NCCL ops are unavailable; rebuild "
              "with a CUDA build of torch and a CUDA toolkit (AFD_USE_CUDA=1) or use the gloo "
              "transport for CPU tensors");
#endif
}

void send_cpu(const at::Tensor&, int64_t, int64_t) { reject_cpu("send"); }
void recv_cpu(const at::Tensor&, int64_t, int64_t) { reject_cpu("recv"); }
void fan_in_cpu(const at::Tensor&, const OptTensor&, const OptTensor&, c10::IntArrayRef,
                c10::IntArrayRef, c10::IntArrayRef) {
  reject_cpu("fan_in");
}
void split_back_cpu(const at::Tensor&, const OptTensor&, const OptTensor&, c10::IntArrayRef,
                    c10::IntArrayRef, c10::IntArrayRef) {
  reject_cpu("split_back");
}

}  // namespace

TORCH_LIBRARY_IMPL(afd_ext, CPU, m) {
  m.impl("send", &send_cpu);
  m.impl("recv", &recv_cpu);
  m.impl("fan_in", &fan_in_cpu);
  m.impl("split_back", &split_back_cpu);
}

}  // namespace afd
