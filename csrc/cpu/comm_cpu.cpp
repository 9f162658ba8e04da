// CPU-key impls of the communication ops: NCCL moves CUDA tensors only, so a
// CPU tensor gets a clear error before anything moves.
#include <torch/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void reject_cpu(const char* op) {
  throw_cpu_tensors(op, "the NCCL ops move CUDA tensors on the communicator's device",
                    "the NCCL ops are unavailable");
}

void send_cpu(const at::Tensor&, int64_t, int64_t) { reject_cpu("send"); }
void recv_cpu(const at::Tensor&, int64_t, int64_t) { reject_cpu("recv"); }
void fan_in_cpu(at::TensorList, c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef) { reject_cpu("fan_in"); }
void split_back_cpu(at::TensorList, c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef) {
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
