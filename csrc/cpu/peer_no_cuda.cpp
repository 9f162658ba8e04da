// CPU-only build: the peer-memory plane's management ops and the CUDA-key
// impls of its data ops exist (every schema is callable, fakes and tests
// work) but say clearly that the library was built without CUDA.
#include <torch/csrc/stable/library.h>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

[[noreturn]] void no_cuda(const char* op) {
  throw_no_cuda(op, "the peer-memory plane is unavailable");
}

void peer_put_no_cuda(TensorList, int64_t, int64_t, IntList, IntList, IntList,
                      IntList, IntList, bool, bool) {
  no_cuda("peer_put");
}

void peer_wait_no_cuda(TensorList, const OptTensor&, int64_t, int64_t, int64_t, IntList,
                       IntList, int64_t, int64_t, int64_t, int64_t, bool) {
  no_cuda("peer_wait");
}

}  // namespace

int64_t peer_plane_create(int64_t, int64_t, int64_t, int64_t) { no_cuda("peer_plane_create"); }
void peer_plane_destroy(int64_t) { no_cuda("peer_plane_destroy"); }
std::vector<int64_t> peer_plane_error(int64_t) { no_cuda("peer_plane_error"); }
void peer_plane_abort(int64_t, int64_t) { no_cuda("peer_plane_abort"); }
int64_t peer_region_alloc(int64_t, int64_t) { no_cuda("peer_region_alloc"); }
void peer_region_export(int64_t, const Tensor&) { no_cuda("peer_region_export"); }
int64_t peer_region_open(int64_t, const Tensor&, int64_t) { no_cuda("peer_region_open"); }
void peer_region_close(int64_t) { no_cuda("peer_region_close"); }
Tensor peer_region_view(int64_t, int64_t, int64_t) { no_cuda("peer_region_view"); }

STABLE_TORCH_LIBRARY_IMPL(afd_ext, CUDA, m) {
  m.impl("peer_put", TORCH_BOX(&peer_put_no_cuda));
  m.impl("peer_wait", TORCH_BOX(&peer_wait_no_cuda));
}

}  // namespace afd
