// Declarations of every afd_ext op implementation (the schemas live in
// bindings.cpp). Naming: <op>_cpu / <op>_cuda for dispatch-key impls; the
// communicator-management ops have one impl each, registered as
// CompositeExplicitAutograd (their only tensor argument, if any, is on the CPU).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "checks.h"

namespace afd {

using OptTensor = std::optional<Tensor>;
// A list argument (Tensor[]): TORCH_BOX unboxes it as a std::vector.
using TensorList = const std::vector<Tensor>&;

// --- communicator table (cuda/comm_table.cpp, or cpu/no_cuda_stubs.cpp) ---
int64_t nccl_version();
void nccl_unique_id(const Tensor& out);
int64_t comm_create(const Tensor& unique_id, int64_t world_size, int64_t rank, int64_t device);
void comm_destroy(int64_t handle);
void comm_abort(int64_t handle);
int64_t comm_async_error(int64_t handle);

// --- point-to-point ops (cuda/p2p_cuda.cpp; CPU-key impls in cpu/comm_cpu.cpp raise) ---
void send_cuda(const Tensor& t, int64_t comm, int64_t peer);
void recv_cuda(const Tensor& t, int64_t comm, int64_t peer);
// `tensors`: the wire parts in order (afd_ext/wire.py states them; the ops never name one).
void fan_in_cuda(TensorList tensors, IntList comms, IntList peers, IntList rows);
void split_back_cuda(TensorList tensors, IntList comms, IntList peers,
                     IntList rows);
// FP8 hidden states (cuda/p2p_cuda.cpp; the CPU impls are afd_ext/fp8.py's torch rule)
void fp8_quantize_cuda(const Tensor& x, const Tensor& values, const Tensor& scales, bool ue8m0);
void fp8_dequantize_cuda(const Tensor& values, const Tensor& scales, const Tensor& out);

// --- peer-memory plane (cuda/peer_cuda.cpp, or cpu/peer_no_cuda.cpp; CPU-key
// impls of the data ops in cpu/peer_cpu.cpp raise) ---
int64_t peer_plane_create(int64_t device, int64_t generation, int64_t num_slots, int64_t max_peers);
void peer_plane_destroy(int64_t plane);
std::vector<int64_t> peer_plane_error(int64_t plane);
void peer_plane_abort(int64_t plane, int64_t op);
int64_t peer_region_alloc(int64_t plane, int64_t nbytes);
void peer_region_export(int64_t region, const Tensor& out);
int64_t peer_region_open(int64_t plane, const Tensor& ipc_handle, int64_t nbytes);
void peer_region_close(int64_t region);
Tensor peer_region_view(int64_t region, int64_t offset, int64_t nbytes);
void peer_put_cuda(TensorList tensors, int64_t plane, int64_t slot, IntList regions,
                   IntList rows, IntList dst_rows, IntList part_offsets,
                   IntList flag_offsets, bool quantize_first, bool ue8m0);
void peer_wait_cuda(TensorList tensors, const OptTensor& out, int64_t plane, int64_t slot, int64_t region,
                    IntList flag_offsets, IntList peers, int64_t op_code, int64_t layer,
                    int64_t stage, int64_t timeout_ns, bool dequantize);

}  // namespace afd
