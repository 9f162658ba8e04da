// Point-to-point ops over NCCL: send, recv, fan_in, split_back.
//
// Every argument is checked before the first NCCL call, so a bad input
// raises and leaves the communicators usable. Each op issues one NCCL group
// on the current stream of the communicators' device: no allocation, no host
// synchronisation, so a CUDA graph can capture it. Bytes move as ncclUint8
// (point-to-point needs no reduction type), which covers fp8 as well.
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "../peer.h"
#include "comm_table.h"

namespace afd {

namespace {

struct Edge {
  std::shared_ptr<Comm> comm;
  int peer;
  int64_t rows;
  int64_t first_row;
};

// Checks the per-peer lists and resolves the handles; all communicators
// must live on one device (returned through `device`).
std::vector<Edge> resolve_edges(const char* op, const char* comms_name, IntList comms,
                                IntList peers, IntList rows, int* device) {
  AFD_CHECK_VALUE(comms.size() == peers.size() && peers.size() == rows.size(), "afd_ext.", op, ": ",
              comms_name, ", peers and rows must have equal lengths (one entry per peer), got ",
              comms.size(), ", ", peers.size(), " and ", rows.size());
  std::vector<Edge> edges;
  edges.reserve(comms.size());
  int64_t first = 0;
  for (size_t i = 0; i < comms.size(); ++i) {
    auto c = comm_get(comms[i], op, comms_name);
    AFD_CHECK_VALUE(peers[i] >= 0 && peers[i] < c->size && peers[i] != c->rank, "afd_ext.", op,
                ": peers[", i, "]=", peers[i], " must be a rank of communicator ", comms[i],
                " in [0, ", c->size, ") other than this rank (", c->rank, ")");
    AFD_CHECK_VALUE(rows[i] >= 0 && rows[i] <= INT64_MAX - first, "afd_ext.", op, ": rows[", i, "]=", rows[i],
                    " must be >= 0 and the rows must add up to at most 2^63 - 1");  // no wrap to a tensor's rows
    if (*device < 0) *device = c->device;
    AFD_CHECK_VALUE(c->device == *device, "afd_ext.", op, ": ", comms_name, "[", i, "]=", comms[i],
                " is on cuda:", c->device, " but earlier communicators are on cuda:", *device,
                "; one call works on one device");
    edges.push_back(Edge{c, static_cast<int>(peers[i]), rows[i], first});
    first += rows[i];
  }
  return edges;
}

int64_t total_rows(const std::vector<Edge>& edges) {
  int64_t n = 0;
  for (const auto& e : edges) n += e.rows;
  return n;
}

void check_tensor(const char* op, const char* name, const Tensor& t, int device,
                  int64_t rows, bool need_rows) {
  AFD_CHECK_VALUE(t.defined(), "afd_ext.", op, ": ", name, " is undefined");
  AFD_CHECK_VALUE(t.is_cuda() && t.get_device() == device, "afd_ext.", op, ": ", name,
              " must be a CUDA tensor on cuda:", device, " (the communicator's device), got ",
              t.device(), "; move it with .to('cuda:", device, "')");
  AFD_CHECK_TYPE(is_wire_dtype(t.scalar_type()), "afd_ext.", op, ": ", name, " has dtype ",
              t.scalar_type(), ", expected one of ", wire_dtype_names());
  AFD_CHECK_VALUE(t.is_contiguous(), "afd_ext.", op, ": ", name,
              " must have contiguous rows (row-major; row slices t[a:b] are fine), got strides ",
              t.strides(), " for shape ", t.sizes(), "; pass .contiguous()");
  if (need_rows) {
    AFD_CHECK_VALUE(t.dim() >= 1, "afd_ext.", op, ": ", name,
                " must have a row dimension, got a 0-d tensor");
    AFD_CHECK_VALUE(t.size(0) == rows, "afd_ext.", op, ": ", name, " has ", t.size(0),
                " rows but rows add up to ", rows, " (one row range per peer, in peer order)");
  }
}

// The wire parts of fan_in / split_back, in the order they travel: device, dtype class and layout
// here (afd_ext/wire.py states which parts there are; the schedule checks their rows and dtypes).
void check_parts(const char* op, TensorList ts, int device, int64_t rows) {
  for (size_t k = 0; k < ts.size(); ++k) {
    const std::string name = "tensors[" + std::to_string(k) + "]";
    check_tensor(op, name.c_str(), ts[k], device, rows, true);
  }
}

enum class Dir { kSend, kRecv };

struct P2p {
  Dir dir;
  char* ptr;
  size_t bytes;
  ncclComm_t comm;
  int peer;
};

// Appends one message per (edge, tensor) with bytes > 0, in edge order.
void plan(std::vector<P2p>& out, Dir dir, const std::vector<Edge>& edges, TensorList ts) {
  for (const auto& e : edges) {
    if (e.rows == 0) continue;
    for (const auto& t : ts) {
      const int64_t rb = row_bytes_of(t);
      const size_t bytes = static_cast<size_t>(e.rows * rb);
      if (bytes == 0) continue;
      out.push_back(P2p{dir, static_cast<char*>(t.data_ptr()) + e.first_row * rb, bytes,
                        e.comm->comm, e.peer});
    }
  }
}

// Issues the messages in one NCCL group on the current stream of `device`.
// The group is always closed, even when a call inside it fails.
void launch(const char* op, int device, const std::vector<P2p>& msgs) {
  if (msgs.empty()) return;
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  AFD_CHECK_NCCL(ncclGroupStart(), nullptr);
  ncclResult_t first_err = ncclSuccess;
  ncclComm_t err_comm = nullptr;
  for (const auto& m : msgs) {
    ncclResult_t r = m.dir == Dir::kSend
                         ? ncclSend(m.ptr, m.bytes, ncclUint8, m.peer, m.comm, stream)
                         : ncclRecv(m.ptr, m.bytes, ncclUint8, m.peer, m.comm, stream);
    if (r != ncclSuccess) {
      first_err = r;
      err_comm = m.comm;
      break;
    }
  }
  ncclResult_t end = ncclGroupEnd();
  if (first_err != ncclSuccess) {
    throw_nccl_error(op, first_err, err_comm, __FILE__, __LINE__);
  }
  if (end != ncclSuccess) throw_nccl_error(op, end, msgs.front().comm, __FILE__, __LINE__);
}

}  // namespace

void send_cuda(const Tensor& t, int64_t comm, int64_t peer) {
  int device = -1;
  const int64_t rows = 1;
  auto edges = resolve_edges("send", "comm", {comm}, {peer}, {rows}, &device);
  check_tensor("send", "t", t, device, 0, false);
  if (t.numel() == 0) return;  // the matching recv skips too
  std::vector<P2p> msgs{P2p{Dir::kSend, static_cast<char*>(t.data_ptr()),
                            static_cast<size_t>(t.numel()) * t.element_size(),
                            edges[0].comm->comm, edges[0].peer}};
  launch("send", device, msgs);
}

void recv_cuda(const Tensor& t, int64_t comm, int64_t peer) {
  int device = -1;
  const int64_t rows = 1;
  auto edges = resolve_edges("recv", "comm", {comm}, {peer}, {rows}, &device);
  check_tensor("recv", "t", t, device, 0, false);
  if (t.numel() == 0) return;
  std::vector<P2p> msgs{P2p{Dir::kRecv, static_cast<char*>(t.data_ptr()),
                            static_cast<size_t>(t.numel()) * t.element_size(),
                            edges[0].comm->comm, edges[0].peer}};
  launch("recv", device, msgs);
}

namespace {

void grouped(const char* op, Dir dir, TensorList tensors, IntList comms, IntList peers,
             IntList rows) {
  int device = -1;
  auto edges = resolve_edges(op, "comms", comms, peers, rows, &device);
  if (edges.empty()) {
    // No peer: nothing to move, but the tensors must still be empty.
    for (size_t k = 0; k < tensors.size(); ++k) {
      AFD_CHECK_VALUE(tensors[k].dim() >= 1 && tensors[k].size(0) == 0, "afd_ext.", op,
                        ": no peers given but tensors[", k, "] has shape ", tensors[k].sizes(), " (expected 0 rows)");
    }
    return;
  }
  check_parts(op, tensors, device, total_rows(edges));
  std::vector<P2p> msgs;
  msgs.reserve(edges.size() * tensors.size());
  plan(msgs, dir, edges, tensors);
  launch(op, device, msgs);
}

}  // namespace

void fan_in_cuda(TensorList tensors, IntList comms, IntList peers, IntList rows) {
  grouped("fan_in", Dir::kRecv, tensors, comms, peers, rows);
}

void split_back_cuda(TensorList tensors, IntList comms, IntList peers,
                     IntList rows) {
  grouped("split_back", Dir::kSend, tensors, comms, peers, rows);
}

namespace {

// The FP8 ops' checks: bf16 [rows, H] with H % 128 == 0, e4m3 values of that shape, float32
// scales [rows, H / 128]; contiguous, aligned for the kernels' vector accesses, one device.
void check_fp8(const char* op, const Tensor& x, const Tensor& values, const Tensor& scales,
               int x_align) {
  AFD_CHECK_VALUE(x.is_cuda() && values.device() == x.device() && scales.device() == x.device(),
                    "afd_ext.", op, ": every tensor must be on one CUDA device, got ", x.device(), ", ",
                    values.device(), " and ", scales.device());
  AFD_CHECK_TYPE(x.scalar_type() == ScalarType::BFloat16 && values.scalar_type() == ScalarType::Float8_e4m3fn &&
                       scales.scalar_type() == ScalarType::Float,
                   "afd_ext.", op, ": expected bfloat16 hidden states, float8_e4m3fn values and float32 "
                   "scales, got ", x.scalar_type(), ", ", values.scalar_type(), " and ", scales.scalar_type());
  AFD_CHECK_VALUE(x.dim() == 2 && x.size(1) % kFp8Group == 0 && values.sizes().equals(x.sizes()) &&
                        scales.dim() == 2 && scales.size(0) == x.size(0) &&
                        scales.size(1) == x.size(1) / kFp8Group,
                    "afd_ext.", op, ": expected hidden states and values [T, H] with H a multiple of ",
                    kFp8Group, " and scales [T, H/", kFp8Group, "], got ", x.sizes(), ", ",
                    values.sizes(), " and ", scales.sizes());
  AFD_CHECK_VALUE(x.is_contiguous() && values.is_contiguous() && scales.is_contiguous(), "afd_ext.", op,
                    ": the tensors must be contiguous");
  AFD_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % x_align == 0 &&
                        reinterpret_cast<uintptr_t>(values.data_ptr()) % 8 == 0,
                    "afd_ext.", op, ": the bf16 tensor must be ", x_align, "-byte aligned and the values "
                    "8-byte aligned (row slices t[a:b] of an allocation are)");
}

int max_blocks(int device) {
  int sms = 0;
  AFD_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return 2 * sms;
}

}  // namespace

void fp8_quantize_cuda(const Tensor& x, const Tensor& values, const Tensor& scales, bool ue8m0) {
  check_fp8("fp8_quantize", x, values, scales, 8);
  const auto dev = x.device().index();
  DeviceGuard guard(dev);
  const int err = fp8_quantize_launch(x.data_ptr(), values.data_ptr(), static_cast<float*>(scales.data_ptr()),
                                      scales.numel(), ue8m0, max_blocks(dev),
                                      current_stream(dev));
  if (err != 0) {
    throw_cuda_error("fp8_quantize_launch", err, cudaGetErrorString(static_cast<cudaError_t>(err)),
                     __FILE__, __LINE__);
  }
}

void fp8_dequantize_cuda(const Tensor& values, const Tensor& scales, const Tensor& out) {
  check_fp8("fp8_dequantize", out, values, scales, 16);
  const auto dev = out.device().index();
  DeviceGuard guard(dev);
  const int err = fp8_dequantize_launch(values.data_ptr(), static_cast<float*>(scales.data_ptr()), out.data_ptr(),
                                        values.numel(), max_blocks(dev),
                                        current_stream(dev));
  if (err != 0) {
    throw_cuda_error("fp8_dequantize_launch", err, cudaGetErrorString(static_cast<cudaError_t>(err)),
                     __FILE__, __LINE__);
  }
}

STABLE_TORCH_LIBRARY_IMPL(afd_ext, CUDA, m) {
  m.impl("send", TORCH_BOX(&send_cuda));
  m.impl("recv", TORCH_BOX(&recv_cuda));
  m.impl("fan_in", TORCH_BOX(&fan_in_cuda));
  m.impl("split_back", TORCH_BOX(&split_back_cuda));
  m.impl("fp8_quantize", TORCH_BOX(&fp8_quantize_cuda));
  m.impl("fp8_dequantize", TORCH_BOX(&fp8_dequantize_cuda));
}

}  // namespace afd
