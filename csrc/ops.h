// Declarations of every afd_ext op implementation (the schemas live in
// bindings.cpp). Naming: <op>_cpu / <op>_cuda for dispatch-key impls; the
// communicator-management ops have one impl each, registered as
// CompositeExplicitAutograd (their only tensor argument, if any, is on the CPU).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>

#include "wire.h"

namespace afd {

using OptTensor = std::optional<at::Tensor>;

// --- communicator table (cuda/comm_table.cpp, or cpu/no_cuda_stubs.cpp) ---
int64_t nccl_version();
void nccl_unique_id(const at::Tensor& out);
int64_t comm_create(const at::Tensor& unique_id, int64_t world_size, int64_t rank, int64_t device);
void comm_destroy(int64_t handle);
void comm_abort(int64_t handle);
int64_t comm_async_error(int64_t handle);

// --- point-to-point ops (cuda/p2p_cuda.cpp; CPU-key impls in cpu/comm_cpu.cpp raise) ---
void send_cuda(const at::Tensor& t, int64_t comm, int64_t peer);
void recv_cuda(const at::Tensor& t, int64_t comm, int64_t peer);
void fan_in_cuda(const at::Tensor& hidden_states, const OptTensor& router_logits,
                 const OptTensor& token_ids, c10::IntArrayRef comms, c10::IntArrayRef peers,
                 c10::IntArrayRef rows);
void split_back_cuda(const at::Tensor& hidden_states, const OptTensor& router_logits,
                     const OptTensor& token_ids, c10::IntArrayRef comms,
                     c10::IntArrayRef peers, c10::IntArrayRef rows);

// --- pack / unpack (cpu/pack_cpu.cpp, cuda/pack_cuda.cpp) ---
void pack_rows_cpu(const at::Tensor& hidden_states, const OptTensor& router_logits,
                   const OptTensor& token_ids, const at::Tensor& wire);
void unpack_rows_cpu(const at::Tensor& wire, const at::Tensor& hidden_states,
                     const OptTensor& router_logits, const OptTensor& token_ids);
void pack_rows_cuda(const at::Tensor& hidden_states, const OptTensor& router_logits,
                    const OptTensor& token_ids, const at::Tensor& wire);
void unpack_rows_cuda(const at::Tensor& wire, const at::Tensor& hidden_states,
                      const OptTensor& router_logits, const OptTensor& token_ids);

// Binding-layer helper (wire.cpp): checks the tensors of pack_rows (pack=true)
// or unpack_rows (pack=false) and describes them for the kernels. Every tensor
// must be on `device_type`; raises a TORCH_CHECK error naming the tensor.
WireLayout make_wire_layout(const char* op, const at::Tensor& hidden_states,
                            const OptTensor& router_logits, const OptTensor& token_ids,
                            const at::Tensor& wire, bool pack);

}  // namespace afd
