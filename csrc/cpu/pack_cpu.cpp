// CPU reference kernels for pack_rows / unpack_rows and their CPU-key impls.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../checks.h"
#include "../ops.h"

namespace afd {

namespace {

// Copies one row of one part between the tensor and the wire row.
template <bool kPack>
void copy_part_row(const WirePart& p, int64_t row, char* wire_row) {
  char* t_row = p.ptr + row * p.row_stride;
  char* w = wire_row + p.wire_offset;
  const int64_t data_bytes = p.cols * p.elem_size;
  if (p.col_stride == p.elem_size) {
    if (kPack) {
      std::memcpy(w, t_row, static_cast<size_t>(data_bytes));
    } else {
      std::memcpy(t_row, w, static_cast<size_t>(data_bytes));
    }
  } else {
    for (int64_t c = 0; c < p.cols; ++c) {
      char* t_el = t_row + c * p.col_stride;
      char* w_el = w + c * p.elem_size;
      if (kPack) {
        std::memcpy(w_el, t_el, static_cast<size_t>(p.elem_size));
      } else {
        std::memcpy(t_el, w_el, static_cast<size_t>(p.elem_size));
      }
    }
  }
  if (kPack && p.wire_bytes > data_bytes) {
    std::memset(w + data_bytes, 0, static_cast<size_t>(p.wire_bytes - data_bytes));
  }
}

template <bool kPack>
void run(const WireLayout& layout) {
  // Grain: enough rows per task that small batches stay on one thread.
  at::parallel_for(0, layout.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      char* wire_row = layout.wire + r * layout.wire_row_stride;
      for (int i = 0; i < layout.num_parts; ++i) copy_part_row<kPack>(layout.parts[i], r, wire_row);
    }
  });
}

}  // namespace

void pack_rows_cpu_kernel(const WireLayout& layout) { run<true>(layout); }
void unpack_rows_cpu_kernel(const WireLayout& layout) { run<false>(layout); }

void pack_rows_cpu(const at::Tensor& hidden_states, const OptTensor& router_logits,
                   const OptTensor& token_ids, const at::Tensor& wire) {
  TORCH_CHECK(wire.is_cpu(), "afd_ext.pack_rows: wire must be a CPU tensor here, got ",
              wire.device());
  pack_rows_cpu_kernel(
      make_wire_layout("pack_rows", hidden_states, router_logits, token_ids, wire, true));
}

void unpack_rows_cpu(const at::Tensor& wire, const at::Tensor& hidden_states,
                     const OptTensor& router_logits, const OptTensor& token_ids) {
  TORCH_CHECK(wire.is_cpu(), "afd_ext.unpack_rows: wire must be a CPU tensor here, got ",
              wire.device());
  unpack_rows_cpu_kernel(
      make_wire_layout("unpack_rows", hidden_states, router_logits, token_ids, wire, false));
}

TORCH_LIBRARY_IMPL(afd_ext, CPU, m) {
  m.impl("pack_rows", &pack_rows_cpu);
  m.impl("unpack_rows", &unpack_rows_cpu);
}

}  // namespace afd
