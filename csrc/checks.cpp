// Shared checks and error helpers (checks.h).
#include <c10/core/ScalarType.h>

#include <sstream>
#include <string>

#include "checks.h"

namespace afd {

// The one table of wire dtypes (exported as _C.WIRE_DTYPES; afd_ext/spec.py's mirror is tested against it).
constexpr c10::ScalarType kWireDtypes[] = {
    c10::ScalarType::BFloat16,      c10::ScalarType::Half, c10::ScalarType::Float,
    c10::ScalarType::Float8_e4m3fn, c10::ScalarType::Float8_e5m2, c10::ScalarType::Int,
    c10::ScalarType::Long,          c10::ScalarType::Byte};

bool is_wire_dtype(c10::ScalarType t) {
  for (c10::ScalarType w : kWireDtypes) {
    if (w == t) return true;
  }
  return false;
}

const std::string& wire_dtype_names() {
  static const std::string names = [] {
    std::string out;
    for (c10::ScalarType w : kWireDtypes) {
      // torch's Python names (c10::toString says "BFloat16"): bfloat16, float16, ...
      std::string n(c10::getDtypeNames(w).first);
      out += (out.empty() ? "" : ", ") + n;
    }
    return out;
  }();
  return names;
}

int64_t row_bytes_of(const at::Tensor& t) {
  int64_t n = static_cast<int64_t>(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

void throw_cuda_error(const char* expr, int err, const char* err_str, const char* file,
                      int line) {
  std::ostringstream os;
  os << "afd_ext: CUDA error " << err << " (" << err_str << ") from `" << expr << "` at "
     << file << ":" << line;
  TORCH_CHECK(false, os.str());
}

void throw_no_cuda(const char* op, const char* unavailable) {
  TORCH_CHECK_VALUE(false, "afd_ext.", op, ": afd_ext was built without CUDA, so ", unavailable,
              "; rebuild with a CUDA build of torch and a CUDA toolkit (AFD_USE_CUDA=1, CUDA_HOME) "
              "or use the gloo transport for CPU tensors");
}

void throw_cpu_tensors(const char* op, const char* moves, const char* unavailable) {
#ifdef AFD_WITH_CUDA
  (void)unavailable;
  TORCH_CHECK_VALUE(false, "afd_ext.", op, ": got CPU tensors, but ", moves,
              "; move them with .to(device) or use the gloo transport for CPU tensors");
#else
  (void)moves;
  throw_no_cuda(op, unavailable);
#endif
}

}  // namespace afd
