// CPU-key impls of the peer-memory data ops: the plane moves CUDA tensors
// through CUDA IPC, so a CPU tensor gets a clear error before anything moves.
#include <torch/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void reject_cpu(const char* op) {
  throw_cpu_tensors(op, "the peer-memory plane moves CUDA tensors on the plane's device",
                    "the peer-memory plane is unavailable");
}

void peer_put_cpu(at::TensorList, int64_t, int64_t, c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef,
                  c10::IntArrayRef, c10::IntArrayRef, bool, bool) {
  reject_cpu("peer_put");
}

void peer_wait_cpu(at::TensorList, const OptTensor&, int64_t, int64_t, int64_t, c10::IntArrayRef,
                   c10::IntArrayRef, int64_t, int64_t, int64_t, int64_t, bool) {
  reject_cpu("peer_wait");
}

}  // namespace

TORCH_LIBRARY_IMPL(afd_ext, CPU, m) {
  m.impl("peer_put", &peer_put_cpu);
  m.impl("peer_wait", &peer_wait_cpu);
}

}  // namespace afd
