// Shared checks and error helpers (checks.h).
#include "checks.h"

namespace afd {

// The one table of wire dtypes (exported as _C.WIRE_DTYPES; afd_ext/spec.py's mirror is tested against it).
// torch's Python names (toString says "BFloat16").
constexpr std::pair<ScalarType, const char*> kWireDtypes[] = {
    {ScalarType::BFloat16, "bfloat16"},         {ScalarType::Half, "float16"},
    {ScalarType::Float, "float32"},             {ScalarType::Float8_e4m3fn, "float8_e4m3fn"},
    {ScalarType::Float8_e5m2, "float8_e5m2"},   {ScalarType::Int, "int32"},
    {ScalarType::Long, "int64"},                {ScalarType::Byte, "uint8"}};

bool is_wire_dtype(ScalarType t) {
  for (const auto& w : kWireDtypes) {
    if (w.first == t) return true;
  }
  return false;
}

const std::string& wire_dtype_names() {
  static const std::string names = [] {
    std::string out;
    for (const auto& w : kWireDtypes) out += std::string(out.empty() ? "" : ", ") + w.second;
    return out;
  }();
  return names;
}

int64_t row_bytes_of(const Tensor& t) {
  int64_t n = static_cast<int64_t>(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

void throw_cuda_error(const char* expr, int err, const char* err_str, const char* file,
                      int line) {
  throw std::runtime_error(cat("afd_ext: CUDA error ", err, " (", err_str, ") from `", expr, "` at ", file, ":", line));
}

void throw_no_cuda(const char* op, const char* unavailable) {
  AFD_CHECK_VALUE(false, "afd_ext.", op, ": afd_ext was built without CUDA, so ", unavailable,
              "; rebuild with a CUDA build of torch and a CUDA toolkit (AFD_USE_CUDA=1, CUDA_HOME) "
              "or use the gloo transport for CPU tensors");
}

void throw_cpu_tensors(const char* op, const char* moves, const char* unavailable) {
#ifdef AFD_WITH_CUDA
  (void)unavailable;
  AFD_CHECK_VALUE(false, "afd_ext.", op, ": got CPU tensors, but ", moves,
              "; move them with .to(device) or use the gloo transport for CPU tensors");
#else
  (void)moves;
  throw_no_cuda(op, unavailable);
#endif
}

}  // namespace afd
