// Error macros and tensor checks shared by every op (torch's stable ABI: only std exceptions cross it).
//
// Caller errors use AFD_CHECK_VALUE (std::invalid_argument: Python's ValueError; AFD_CHECK_TYPE for a
// dtype, message "TypeError: afd_ext.<op>: ...") with a message that starts "afd_ext.<op>: " and names
// the tensor and what was expected; afd_ext/ops.py raises them as AFDConfigError (AFDTypeError).
// Library errors: AFD_CHECK_NCCL throws a RuntimeError "DistBackendError: afd_ext: NCCL error ..."
// (AFDPeerError in Python) and AFD_CHECK_CUDA one starting "afd_ext: CUDA error" (AFDDeviceError),
// carrying file, line, the failing expression, the error string and, for NCCL, ncclGetLastError.
// AFD_CHECK: any other check (RuntimeError). Nothing here calls exit() or printf.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef AFD_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/stable/accelerator.h>
#endif

namespace afd {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;

inline std::ostream& operator<<(std::ostream& os, IntList v) {
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os << "]";
}
inline std::ostream& operator<<(std::ostream& os, const torch::stable::Device& d) {
  return os << (d.is_cuda() ? "cuda:" + std::to_string(d.index()) : d.is_cpu() ? "cpu" : "a non-CPU, non-CUDA device");
}
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

// Rounds n up to a multiple of 16 bytes (the peer plane's region alignment).
inline int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// True for the dtypes allowed on the wire (NCCL moves them as bytes).
bool is_wire_dtype(ScalarType t);

// "bfloat16, float16, float32, float8_e4m3fn, float8_e5m2, int32, int64, uint8" (torch's names).
const std::string& wire_dtype_names();

// Bytes of one row (dim 0 index) of a tensor: prod(sizes[1:]) * element size.
int64_t row_bytes_of(const Tensor& t);

[[noreturn]] void throw_cuda_error(const char* expr, int err, const char* err_str,
                                   const char* file, int line);

// The one wording of "this data plane cannot run here" (CPU-key impls, CPU-only stubs):
// `unavailable` names the plane with its verb, e.g. "the NCCL ops are unavailable".
[[noreturn]] void throw_no_cuda(const char* op, const char* unavailable);

// CPU tensors given to an op of a plane that moves CUDA tensors (`moves`, e.g. "the NCCL ops
// move CUDA tensors on the communicator's device"); a CPU-only build says throw_no_cuda's text.
[[noreturn]] void throw_cpu_tensors(const char* op, const char* moves, const char* unavailable);

#ifdef AFD_WITH_CUDA
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// torch's current CUDA stream of `device` (the stable C shim).
inline cudaStream_t current_stream(int device) {
  void* s = nullptr;
  if (aoti_torch_get_current_cuda_stream(device, &s) != AOTI_TORCH_SUCCESS)
    throw std::runtime_error(cat("afd_ext: torch has no current CUDA stream for cuda:", device));
  return static_cast<cudaStream_t>(s);
}

[[noreturn]] void throw_nccl_error(const char* expr, ncclResult_t res, ncclComm_t comm,
                                   const char* file, int line);
#endif

}  // namespace afd

#define AFD_CHECK_VALUE(cond, ...) \
  if (!(cond)) throw std::invalid_argument(::afd::cat(__VA_ARGS__))
#define AFD_CHECK_TYPE(cond, ...) \
  if (!(cond)) throw std::invalid_argument(::afd::cat("TypeError: ", __VA_ARGS__))
#define AFD_CHECK(cond, ...) \
  if (!(cond)) throw std::runtime_error(::afd::cat(__VA_ARGS__))

#ifdef AFD_WITH_CUDA
#define AFD_CHECK_CUDA(expr)                                                                  \
  do {                                                                                        \
    cudaError_t afd_cuda_err_ = (expr);                                                       \
    if (afd_cuda_err_ != cudaSuccess) {                                                       \
      ::afd::throw_cuda_error(#expr, static_cast<int>(afd_cuda_err_),                        \
                              cudaGetErrorString(afd_cuda_err_), __FILE__, __LINE__);         \
    }                                                                                         \
  } while (0)

// `comm` may be nullptr (then ncclGetLastError reports the thread's last error).
#define AFD_CHECK_NCCL(expr, comm)                                                            \
  do {                                                                                        \
    ncclResult_t afd_nccl_res_ = (expr);                                                      \
    if (afd_nccl_res_ != ncclSuccess) {                                                       \
      ::afd::throw_nccl_error(#expr, afd_nccl_res_, (comm), __FILE__, __LINE__);              \
    }                                                                                         \
  } while (0)
#endif
