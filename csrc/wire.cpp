// Shared checks (checks.h) and the binding-layer description of packed wire
// rows (make_wire_layout) used by the CPU and CUDA pack/unpack impls.
#include <ATen/MemoryOverlap.h>
#include <c10/core/ScalarType.h>

#include <sstream>

#include "checks.h"
#include "ops.h"

namespace afd {

bool is_wire_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Float8_e4m3fn:
    case c10::ScalarType::Float8_e5m2:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Byte:
      return true;
    default:
      return false;
  }
}

const char* wire_dtype_names() {
  return "bfloat16, float16, float32, float8_e4m3fn, float8_e5m2, int32, int64, uint8";
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

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

WirePart describe(const at::Tensor& t, int64_t wire_offset) {
  WirePart p{};
  p.ptr = static_cast<char*>(t.data_ptr());
  p.elem_size = static_cast<int64_t>(t.element_size());
  p.row_stride = t.stride(0) * p.elem_size;
  p.cols = t.dim() == 2 ? t.size(1) : 1;
  p.col_stride = t.dim() == 2 ? t.stride(1) * p.elem_size : p.elem_size;
  if (p.cols <= 1) p.col_stride = p.elem_size;  // stride of a size-1 dim is arbitrary
  p.wire_offset = wire_offset;
  p.wire_bytes = round_up16(p.cols * p.elem_size);
  p.vectorized = (p.col_stride == p.elem_size && aligned16(p.ptr) &&
                  (t.size(0) <= 1 || p.row_stride % 16 == 0))
                     ? 1
                     : 0;
  return p;
}

void check_part(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                int64_t rows, const at::Tensor& wire, bool is_output) {
  TORCH_CHECK(t.dim() == dim, "afd_ext.", op, ": ", name, " must be ", dim, "-D (",
              dim == 2 ? "[num_tokens, width]" : "[num_tokens]", "), got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == rows, "afd_ext.", op, ": ", name, " has ", t.size(0),
              " rows but wire has ", rows, " (one wire row per token; they must match), got ",
              name, " shape ", t.sizes(), " and wire shape ", wire.sizes());
  TORCH_CHECK(t.device() == wire.device(), "afd_ext.", op, ": ", name,
              " must be on the wire tensor's device ", wire.device(), ", got ", t.device());
  TORCH_CHECK(is_wire_dtype(t.scalar_type()), "afd_ext.", op, ": ", name, " has dtype ",
              t.scalar_type(), ", expected one of ", wire_dtype_names());
  if (is_output) {
    TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "afd_ext.", op, ": ", name,
                " is written but has overlapping elements (an expanded view?); pass a "
                "tensor with distinct memory per element, e.g. .clone()");
  }
}

}  // namespace

WireLayout make_wire_layout(const char* op, const at::Tensor& hidden_states,
                            const OptTensor& router_logits, const OptTensor& token_ids,
                            const at::Tensor& wire, bool pack) {
  TORCH_CHECK(wire.scalar_type() == c10::ScalarType::Byte, "afd_ext.", op,
              ": wire must be uint8, got ", wire.scalar_type());
  TORCH_CHECK(wire.dim() == 2, "afd_ext.", op,
              ": wire must be 2-D [num_tokens, row_bytes], got shape ", wire.sizes());
  const int64_t rows = wire.size(0);
  TORCH_CHECK(wire.size(1) <= 1 || wire.stride(1) == 1, "afd_ext.", op,
              ": each wire row must be dense (wire.stride(1) == 1), got strides ",
              wire.strides(), "; slice rows only (wire[a:b]), or pass .contiguous()");
  check_part(op, "hidden_states", hidden_states, 2, rows, wire, !pack);
  if (router_logits.has_value()) {
    check_part(op, "router_logits", *router_logits, 2, rows, wire, !pack);
  }
  if (token_ids.has_value()) {
    check_part(op, "token_ids", *token_ids, 1, rows, wire, !pack);
    TORCH_CHECK(token_ids->scalar_type() == c10::ScalarType::Int, "afd_ext.", op,
                ": token_ids must be int32 (4 bytes on the wire), got ",
                token_ids->scalar_type(), "; cast with .to(torch.int32)");
  }
  if (pack) {
    TORCH_CHECK(at::has_internal_overlap(wire) != at::MemOverlap::Yes, "afd_ext.", op,
                ": wire is written but has overlapping rows; pass a freshly allocated tensor");
  }

  WireLayout layout{};
  layout.rows = rows;
  layout.wire = static_cast<char*>(wire.data_ptr());
  layout.wire_row_stride = wire.stride(0);
  int64_t offset = 0;
  int n = 0;
  layout.parts[n] = describe(hidden_states, offset);
  offset += layout.parts[n++].wire_bytes;
  if (router_logits.has_value()) {
    layout.parts[n] = describe(*router_logits, offset);
    offset += layout.parts[n++].wire_bytes;
  }
  if (token_ids.has_value()) {
    layout.parts[n] = describe(*token_ids, offset);
    offset += layout.parts[n++].wire_bytes;
  }
  layout.num_parts = n;
  layout.row_bytes = offset;
  TORCH_CHECK(wire.size(1) == offset, "afd_ext.", op, ": wire must have ", offset,
              " bytes per row (hidden_states", router_logits.has_value() ? " + router_logits" : "",
              token_ids.has_value() ? " + token_ids" : "",
              ", each padded to 16; see afd_ext.ops.wire_row_bytes), got shape ", wire.sizes());
  const bool wire_vec =
      aligned16(layout.wire) && (rows <= 1 || layout.wire_row_stride % 16 == 0);
  for (int i = 0; i < n; ++i) layout.parts[i].vectorized &= wire_vec ? 1 : 0;
  return layout;
}

}  // namespace afd
