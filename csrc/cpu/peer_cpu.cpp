// CPU-key impls of the peer-memory data ops: the plane moves CUDA tensors
// through CUDA IPC, so a CPU tensor gets a clear error before anything moves.
#include <torch/csrc/stable/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void reject_cpu(const char* op) {
  throw_cpu_tensors(op, "the peer-memory plane moves CUDA tensors on the plane's device",
                    "the peer-memory plane is unavailable");
}

void peer_put_cpu(TensorList, int64_t, int64_t, IntList, IntList, IntList,
                  IntList, IntList, bool, bool) {
  reject_cpu("peer_put");
}

void peer_wait_cpu(TensorList, const OptTensor&, int64_t, int64_t, int64_t, IntList,
                   IntList, int64_t, int64_t, int64_t, int64_t, bool) {
  reject_cpu("peer_wait");
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(afd_ext, CPU, m) {
  m.impl("peer_put", TORCH_BOX(&peer_put_cpu));
  m.impl("peer_wait", TORCH_BOX(&peer_wait_cpu));
}

}  // namespace afd
