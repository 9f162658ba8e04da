// NCCL communicator table and the communicator-management ops.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "../checks.h"
#include "../ops.h"
#include "comm_table.h"

namespace afd {

void throw_nccl_error(const char* expr, ncclResult_t res, ncclComm_t comm, const char* file,
                      int line) {
  const char* last = ncclGetLastError(comm);
  throw std::runtime_error(cat("DistBackendError: afd_ext: NCCL error ", static_cast<int>(res), " (",
                               ncclGetErrorString(res), ") from `", expr, "` at ", file, ":", line,
                               last != nullptr && last[0] != '\0' ? "; ncclGetLastError: " : "", last ? last : ""));
}

namespace {

struct Table {
  std::mutex mu;
  std::unordered_map<int64_t, std::shared_ptr<Comm>> live;
  int64_t next_handle = 1;  // handles are never reused; 0 is never valid
};

Table& table() {
  static Table* t = new Table();  // leaked on purpose: no destruction-order races at exit
  return *t;
}

// Removes `handle` from the table; nullptr when it is not live. A ValueError
// when it was never issued (a typo, not a double destroy).
std::shared_ptr<Comm> take(int64_t handle, const char* op) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  AFD_CHECK_VALUE(handle >= 1 && handle < t.next_handle, "afd_ext.", op, ": handle ", handle,
              " was never issued by comm_create in this process");
  auto it = t.live.find(handle);
  if (it == t.live.end()) return nullptr;
  auto c = it->second;
  t.live.erase(it);
  return c;
}

void check_version() {
  int runtime = 0;
  AFD_CHECK_NCCL(ncclGetVersion(&runtime), nullptr);
  // Codes: major*10000 + minor*100 + patch for NCCL >= 2.9.
  const int compiled = NCCL_VERSION_CODE;
  AFD_CHECK_VALUE(runtime / 10000 == compiled / 10000, "afd_ext: compiled against NCCL ", compiled,
              " but the loaded libnccl.so.2 is ", runtime,
              " (major versions differ); reinstall the nvidia-nccl-cu* wheel torch uses and "
              "rebuild afd_ext");
}

// Seconds the eager connect of a new 2-rank communicator may take before it
// is aborted (both ranks have just left a successful blocking init).
constexpr double kConnectTimeoutS = 120.0;

// Opens both directions of a 2-rank communicator now, with one 1-byte send
// and one 1-byte receive to the other rank in one NCCL group, identical on
// both ranks. NCCL connects point-to-point channels lazily, at the first
// group that uses them, and for a 2-rank communicator it swaps the send-side
// and receive-side connect info in one bootstrap message that assumes the
// peer opened the mirror-image directions (NVIDIA/nccl PR #2407). A first
// group that differs between the ranks (say, send+receive in one group on one
// side, receive only on the other) then reads the wrong connect info: on 2x
// H200 with NCCL 2.28.9 the receiving process died with SIGSEGV. Connected
// here, no later grouping on this communicator can trip that. Bounded: polls
// the stream and the async error, aborts after kConnectTimeoutS.
void connect_both_ways(ncclComm_t comm, int rank, int device) {
  std::optional<Tensor> buf;  // outlives the abort below: the 1-byte kernels may still run on the pool stream
  try {
    void* pool = nullptr;
    AFD_CHECK(torch_get_cuda_stream_from_pool(false, device, &pool) == AOTI_TORCH_SUCCESS,
              "afd_ext.comm_create: torch gave no pool stream for cuda:", device);
    const auto stream = static_cast<cudaStream_t>(pool);
    buf = torch::stable::empty({2}, ScalarType::Byte, std::nullopt,
                               torch::stable::Device(torch::headeronly::DeviceType::CUDA, device));
    torch::stable::zero_(*buf);
    const int peer = 1 - rank;
    char* p = static_cast<char*>(buf->data_ptr());
    AFD_CHECK_NCCL(ncclGroupStart(), comm);
    ncclResult_t r1 = ncclSend(p, 1, ncclUint8, peer, comm, stream);
    ncclResult_t r2 = ncclRecv(p + 1, 1, ncclUint8, peer, comm, stream);
    ncclResult_t end = ncclGroupEnd();
    if (r1 != ncclSuccess) throw_nccl_error("ncclSend (connect)", r1, comm, __FILE__, __LINE__);
    if (r2 != ncclSuccess) throw_nccl_error("ncclRecv (connect)", r2, comm, __FILE__, __LINE__);
    if (end != ncclSuccess) throw_nccl_error("ncclGroupEnd (connect)", end, comm, __FILE__, __LINE__);
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) AFD_CHECK_CUDA(q);
      ncclResult_t async = ncclSuccess;
      AFD_CHECK_NCCL(ncclCommGetAsyncError(comm, &async), comm);
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (async != ncclSuccess || waited > kConnectTimeoutS) {
        throw std::runtime_error(cat("DistBackendError: afd_ext.comm_create: connecting rank ", rank, " with peer rank ",
                    peer, " on cuda:", device, " failed (", async != ncclSuccess
                        ? std::string("NCCL async error: ") + ncclGetErrorString(async)
                        : std::string("no reply within ") + std::to_string(kConnectTimeoutS) + " s",
                    "); the communicator was aborted"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  } catch (...) {
    // Every failure aborts the communicator (no handle names it yet), `buf` still alive; was: only the
    // timeout and async-error paths did, a failed group or CUDA check leaked it with its proxy threads.
    ncclCommAbort(comm);
    throw;
  }
}

}  // namespace

namespace {
// The live communicator behind `handle` (t.mu held); comm_get's ValueError when it is not live.
const std::shared_ptr<Comm>& live_locked(Table& t, int64_t handle, const char* op, const char* arg_name) {
  auto it = t.live.find(handle);
  if (it != t.live.end()) return it->second;
  AFD_CHECK_VALUE(false, "afd_ext.", op, ": ", arg_name, "=", handle, " is not a live communicator ",
              handle >= 1 && handle < t.next_handle ? "(it was destroyed or aborted)"
                                                     : "(never issued by comm_create)",
              "; create one with afd_ext.ops.comm_create");
}
}  // namespace

std::shared_ptr<Comm> comm_get(int64_t handle, const char* op, const char* arg_name) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  return live_locked(t, handle, op, arg_name);
}

int64_t nccl_version() {
  int v = 0;
  AFD_CHECK_NCCL(ncclGetVersion(&v), nullptr);
  return v;
}

void nccl_unique_id(const Tensor& out) {
  AFD_CHECK_VALUE(out.is_cpu() && out.scalar_type() == ScalarType::Byte &&
                  out.numel() == NCCL_UNIQUE_ID_BYTES && out.is_contiguous(),
              "afd_ext.nccl_unique_id: out must be a contiguous CPU uint8 tensor of ",
              NCCL_UNIQUE_ID_BYTES, " elements, got ", out.scalar_type(), " ", out.sizes(),
              " on ", out.device());
  ncclUniqueId id;
  AFD_CHECK_NCCL(ncclGetUniqueId(&id), nullptr);
  std::memcpy(out.data_ptr(), id.internal, NCCL_UNIQUE_ID_BYTES);
}

int64_t comm_create(const Tensor& unique_id, int64_t world_size, int64_t rank,
                    int64_t device) {
  AFD_CHECK_VALUE(unique_id.is_cpu() && unique_id.scalar_type() == ScalarType::Byte &&
                  unique_id.numel() == NCCL_UNIQUE_ID_BYTES && unique_id.is_contiguous(),
              "afd_ext.comm_create: unique_id must be a contiguous CPU uint8 tensor of ",
              NCCL_UNIQUE_ID_BYTES, " elements (from nccl_unique_id), got ",
              unique_id.scalar_type(), " ", unique_id.sizes(), " on ", unique_id.device());
  AFD_CHECK_VALUE(world_size >= 1, "afd_ext.comm_create: world_size must be >= 1, got ", world_size);
  AFD_CHECK_VALUE(rank >= 0 && rank < world_size, "afd_ext.comm_create: rank must be in [0, ",
              world_size, "), got ", rank);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) {  // no driver, no device: as torch counts
    cudaGetLastError();  // not sticky: clear it, or the next launch check reports it
    ndev = 0;
  }
  AFD_CHECK_VALUE(device >= 0 && device < ndev, "afd_ext.comm_create: device must be in [0, ", ndev,
              ") (visible CUDA devices), got ", device);
  check_version();

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data_ptr(), NCCL_UNIQUE_ID_BYTES);
  DeviceGuard guard(static_cast<int32_t>(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Blocking init: returns once every rank joined. Callers rendezvous first
  // (a store exchange with a deadline) so all ranks reach this call.
  config.blocking = 1;
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRankConfig(&comm, static_cast<int>(world_size), id,
                                                   static_cast<int>(rank), &config);
  if (init != ncclSuccess) {  // a failed blocking init may leave the communicator allocated: abort it
    try {
      throw_nccl_error("ncclCommInitRankConfig", init, comm, __FILE__, __LINE__);  // the error text first
    } catch (...) {
      if (comm != nullptr) ncclCommAbort(comm);
      throw;
    }
  }
  if (world_size == 2) connect_both_ways(comm, static_cast<int>(rank), static_cast<int>(device));  // aborts on failure

  auto c = std::make_shared<Comm>();
  c->comm = comm;
  c->device = static_cast<int>(device);
  c->size = static_cast<int>(world_size);
  c->rank = static_cast<int>(rank);
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  c->handle = t.next_handle++;
  t.live.emplace(c->handle, c);
  return c->handle;
}

void comm_destroy(int64_t handle) {
  auto c = take(handle, "comm_destroy");
  if (!c) return;  // already destroyed or aborted
  DeviceGuard guard(c->device);
  AFD_CHECK_NCCL(ncclCommDestroy(c->comm), nullptr);
}

void comm_abort(int64_t handle) {
  auto c = take(handle, "comm_abort");
  if (!c) return;
  DeviceGuard guard(c->device);
  AFD_CHECK_NCCL(ncclCommAbort(c->comm), nullptr);
}

int64_t comm_async_error(int64_t handle) {
  // Under the table lock: the watchdog thread polls this while another thread may comm_abort /
  // comm_destroy the same handle, which frees the ncclComm once take() has removed it (a shared_ptr
  // to the Comm does not keep the ncclComm alive). ncclCommGetAsyncError only reads two atomics.
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  const ncclComm_t comm = live_locked(t, handle, "comm_async_error", "handle")->comm;
  ncclResult_t state = ncclSuccess;
  AFD_CHECK_NCCL(ncclCommGetAsyncError(comm, &state), comm);
  return static_cast<int64_t>(state);
}

}  // namespace afd
