// CPU-key impls of the communication ops: NCCL moves CUDA tensors only, so a
// CPU tensor gets a clear error before anything moves.
#include <torch/csrc/stable/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void reject_cpu(const char* op) {
  throw_cpu_tensors(op, "the NCCL ops move CUDA tensors on the communicator's device",
                    "the NCCL ops are unavailable");
}

void send_cpu(const Tensor&, int64_t, int64_t) { reject_cpu("send"); }
void recv_cpu(const Tensor&, int64_t, int64_t) { reject_cpu("recv"); }
void fan_in_cpu(TensorList, IntList, IntList, IntList) { reject_cpu("fan_in"); }
void split_back_cpu(TensorList, IntList, IntList, IntList) {
  reject_cpu("split_back");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(afd_ext, CPU, m) {
  m.impl("send", TORCH_BOX(&send_cpu));
  m.impl("recv", TORCH_BOX(&recv_cpu));
  m.impl("fan_in", TORCH_BOX(&fan_in_cpu));
  m.impl("split_back", TORCH_BOX(&split_back_cpu));
}

}  // namespace afd
