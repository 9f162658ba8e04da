// The peer-memory plane: a table of planes and regions (int handles, never
// raw pointers to Python), their management ops, and the CUDA-key impls of
// peer_put / peer_wait.
//
// A plane is one rank's device state: sequence counters, block counters, a
// `failed` word (device memory) and an error record (host-mapped memory the
// watchdog reads without touching the device). A region is device memory
// allocated here with cudaMalloc, outside torch's caching allocator (legacy
// CUDA IPC cannot export memory of expandable segments), or a peer's region
// opened from its 64-byte CUDA IPC handle. Data ops check everything first,
// then launch one kernel on the current stream: no allocation, no sync.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "../peer.h"

namespace afd {

static_assert(sizeof(cudaIpcMemHandle_t) == kPeerIpcHandleBytes, "peer.h: kPeerIpcHandleBytes is stale");

namespace {

// Memory whose last reference went away, freed at the next management op.
// The last reference may be a tensor view dropped at any time (inside a
// CUDA-graph capture, where cudaFree is not allowed), so no destructor frees.
struct Freed {
  char* ptr;
  int device;
  bool own;
};

std::mutex& graveyard_mu() {
  static std::mutex* m = new std::mutex();  // leaked on purpose (exit order)
  return *m;
}

std::vector<Freed>& graveyard() {
  static std::vector<Freed>* g = new std::vector<Freed>();
  return *g;
}

// Frees (own: cudaFree, which synchronises the device) or unmaps (opened)
// everything in the graveyard. Called by management ops only, outside capture.
void drain_graveyard() {
  std::vector<Freed> todo;
  {
    std::lock_guard<std::mutex> lock(graveyard_mu());
    todo.swap(graveyard());
  }
  if (todo.empty()) return;
  int prev = -1;
  cudaGetDevice(&prev);
  for (const Freed& f : todo) {
    cudaSetDevice(f.device);
    // Errors are dropped: the memory is gone either way, and a failed free must not
    // fail the unrelated op that drains.
    if (f.own) {
      cudaFree(f.ptr);
    } else {
      cudaIpcCloseMemHandle(f.ptr);
    }
  }
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
}

// One device allocation: this process's own (cudaMalloc) or a peer's (opened).
struct PeerMem {
  char* ptr = nullptr;
  int64_t bytes = 0;
  int device = 0;
  bool own = false;
  std::string ipc;  // the exported handle bytes (own memory, once exported)

  ~PeerMem() {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(graveyard_mu());
    graveyard().push_back(Freed{ptr, device, own});
  }
};

struct PeerPlane {
  int device = 0;
  int generation = 0;
  int num_slots = 0;
  int max_peers = 0;
  int sm_count = 1;
  void* dev_block = nullptr;  // counters | done | failed
  long long* host_err = nullptr;
  cudaStream_t init_stream = nullptr;  // zeroing new memory without touching other streams
  PeerPlaneDev dev{};

  ~PeerPlane() {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    if (init_stream != nullptr) cudaStreamDestroy(init_stream);
    if (dev_block != nullptr) cudaFree(dev_block);  // synchronises: no kernel of this plane runs after
    if (host_err != nullptr) cudaFreeHost(host_err);
    if (prev >= 0) cudaSetDevice(prev);
  }
};

// A region handle: the memory, and the device that uses it through this handle
// (the owner's; or, for memory of another GPU of this process, the opener's).
struct RegionRef {
  std::shared_ptr<PeerMem> mem;
  int device;
};

struct Table {
  std::mutex mu;
  std::unordered_map<int64_t, std::shared_ptr<PeerPlane>> planes;
  std::unordered_map<int64_t, RegionRef> regions;
  // Handles this process exported: opening one of them here aliases the
  // memory (cudaIpcOpenMemHandle refuses handles of its own process).
  std::unordered_map<std::string, std::weak_ptr<PeerMem>> exported;
  int64_t next_plane = 1;  // handles are never reused; 0 is never valid
  int64_t next_region = 1;
};

Table& table() {
  static Table* t = new Table();  // leaked on purpose: no destruction-order races at exit
  return *t;
}

std::shared_ptr<PeerPlane> get_plane_locked(Table& t, int64_t handle, const char* op) {
  AFD_CHECK(handle >= 1 && handle < t.next_plane, "afd_ext.", op, ": plane handle ", handle,
              " was never issued by peer_plane_create in this process");
  auto it = t.planes.find(handle);
  AFD_CHECK(it != t.planes.end(), "afd_ext.", op, ": plane ", handle,
              " was destroyed; re-initialise the peer-memory plane");
  return it->second;
}

std::shared_ptr<PeerPlane> get_plane(int64_t handle, const char* op) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  return get_plane_locked(t, handle, op);
}

RegionRef get_region_locked(Table& t, int64_t handle, const char* op, const char* what) {
  AFD_CHECK(handle >= 1 && handle < t.next_region, "afd_ext.", op, ": ", what, " ", handle,
              " was never issued by peer_region_alloc/peer_region_open in this process");
  auto it = t.regions.find(handle);
  AFD_CHECK(it != t.regions.end(), "afd_ext.", op, ": ", what, " ", handle, " was closed");
  return it->second;
}

void zero_device(const PeerPlane& pl, void* p, int64_t bytes) {
  AFD_CHECK_CUDA(cudaMemsetAsync(p, 0, static_cast<size_t>(bytes), pl.init_stream));
  AFD_CHECK_CUDA(cudaStreamSynchronize(pl.init_stream));
}

const char* const kNoCudaTensor =
    " must be a CUDA tensor on the plane's device; the peer-memory plane moves CUDA tensors";

void check_on(const char* op, const char* name, const Tensor& t, int device) {
  AFD_CHECK(t.defined(), "afd_ext.", op, ": ", name, " is undefined");
  AFD_CHECK(t.is_cuda() && t.get_device() == device, "afd_ext.", op, ": ", name, kNoCudaTensor,
              " (cuda:", device, "), got ", t.device());
}

void check_wire(const char* op, const char* name, const Tensor& t, int device, int64_t rows) {
  check_on(op, name, t, device);
  AFD_CHECK(is_wire_dtype(t.scalar_type()), "afd_ext.", op, ": ", name, " has dtype ",
              t.scalar_type(), ", expected one of ", wire_dtype_names());
  AFD_CHECK(t.is_contiguous(), "afd_ext.", op, ": ", name,
              " must have contiguous rows (row slices t[a:b] are fine), got strides ", t.strides(),
              " for shape ", t.sizes());
  AFD_CHECK(t.dim() >= 1 && t.size(0) == rows, "afd_ext.", op, ": ", name, " has shape ",
              t.sizes(), " but rows add up to ", rows, " (one row range per peer, in peer order)");
}

// Marks the plane failed from the host. Spinning waits read the code word
// every 64 polls (block 0 of each; the others see `failed`) and return; the
// record of an earlier failure is kept.
void abort_plane(PeerPlane& pl, int64_t op) {
  volatile long long* h = pl.host_err;
  if (h[kPeerErrCode] != 0) return;
  h[kPeerErrOp] = op;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  h[kPeerErrCode] = kPeerAborted;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// Op code recorded when a plane is aborted because it is being destroyed.
constexpr int64_t kPeerOpDestroy = -1;

}  // namespace

// ------------------------------------------------------------------ management

int64_t peer_plane_create(int64_t device, int64_t generation, int64_t num_slots, int64_t max_peers) {
  int count = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&count);
  if (count_err != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not sticky, clear it
    count = 0;
  }
  AFD_CHECK(device >= 0 && device < count, "afd_ext.peer_plane_create: device ", device,
              " is not a CUDA device of this process (", count, " visible",
              count_err != cudaSuccess ? std::string(": ") + cudaGetErrorString(count_err) : "", ")");
  AFD_CHECK(generation >= 1 && generation <= kPeerMaxGeneration, "afd_ext.peer_plane_create: generation ",
              generation, " must be in [1, ", kPeerMaxGeneration, "] (16 bits of every flag word)");
  AFD_CHECK(num_slots >= 1 && num_slots <= 4096, "afd_ext.peer_plane_create: num_slots ",
              num_slots, " must be in [1, 4096]");
  AFD_CHECK(max_peers >= 1 && max_peers <= kPeerMaxPeers, "afd_ext.peer_plane_create: max_peers ",
              max_peers, " must be in [1, ", kPeerMaxPeers, "]");
  drain_graveyard();
  DeviceGuard guard(device);
  auto pl = std::make_shared<PeerPlane>();
  pl->device = static_cast<int>(device);
  pl->generation = static_cast<int>(generation);
  pl->num_slots = static_cast<int>(num_slots);
  pl->max_peers = static_cast<int>(max_peers);
  AFD_CHECK_CUDA(cudaDeviceGetAttribute(&pl->sm_count, cudaDevAttrMultiProcessorCount, pl->device));
  AFD_CHECK_CUDA(cudaStreamCreateWithFlags(&pl->init_stream, cudaStreamNonBlocking));
  const int64_t counter_bytes = num_slots * max_peers * 8;
  const int64_t done_bytes = round_up16(num_slots * 4);
  const int64_t block_bytes = counter_bytes + done_bytes + 16;
  AFD_CHECK_CUDA(cudaMalloc(&pl->dev_block, static_cast<size_t>(block_bytes)));
  zero_device(*pl, pl->dev_block, block_bytes);
  void* host = nullptr;
  AFD_CHECK_CUDA(cudaHostAlloc(&host, kPeerErrWords * sizeof(long long),
                               cudaHostAllocMapped | cudaHostAllocPortable));
  pl->host_err = static_cast<long long*>(host);
  std::memset(host, 0, kPeerErrWords * sizeof(long long));
  void* host_dev = nullptr;
  AFD_CHECK_CUDA(cudaHostGetDevicePointer(&host_dev, host, 0));
  char* base = static_cast<char*>(pl->dev_block);
  pl->dev.counters = reinterpret_cast<unsigned long long*>(base);
  pl->dev.done = reinterpret_cast<unsigned int*>(base + counter_bytes);
  pl->dev.failed = reinterpret_cast<int*>(base + counter_bytes + done_bytes);
  pl->dev.host_err = static_cast<long long*>(host_dev);
  pl->dev.gen_bits = static_cast<unsigned long long>(generation) << kPeerGenShift;
  pl->dev.max_peers = pl->max_peers;
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  const int64_t h = t.next_plane++;
  t.planes[h] = std::move(pl);
  return h;
}

void peer_plane_destroy(int64_t plane) {
  std::shared_ptr<PeerPlane> pl;
  {
    Table& t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    AFD_CHECK(plane >= 1 && plane < t.next_plane, "afd_ext.peer_plane_destroy: plane handle ",
                plane, " was never issued by peer_plane_create in this process");
    auto it = t.planes.find(plane);
    if (it == t.planes.end()) return;  // idempotent
    pl = it->second;
    t.planes.erase(it);
  }
  // Spinning waits return within microseconds of the abort, so the
  // synchronising free in ~PeerPlane cannot wait out a deadline.
  abort_plane(*pl, kPeerOpDestroy);
  pl.reset();
  drain_graveyard();
}

std::vector<int64_t> peer_plane_error(int64_t plane) {
  auto pl = get_plane(plane, "peer_plane_error");
  const volatile long long* h = pl->host_err;
  std::vector<int64_t> out(kPeerErrWords, 0);
  out[kPeerErrCode] = h[kPeerErrCode];
  if (out[kPeerErrCode] == 0) return out;
  std::atomic_thread_fence(std::memory_order_acquire);  // the code word is written last
  for (int i = 1; i < kPeerErrWords; ++i) out[i] = h[i];
  return out;
}

void peer_plane_abort(int64_t plane, int64_t op) {
  abort_plane(*get_plane(plane, "peer_plane_abort"), op);
}

int64_t peer_region_alloc(int64_t plane, int64_t nbytes) {
  drain_graveyard();
  auto pl = get_plane(plane, "peer_region_alloc");
  AFD_CHECK(nbytes > 0, "afd_ext.peer_region_alloc: nbytes must be > 0, got ", nbytes);
  DeviceGuard guard(pl->device);
  auto mem = std::make_shared<PeerMem>();
  mem->device = pl->device;
  mem->own = true;
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, static_cast<size_t>(nbytes));
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed allocation
    AFD_CHECK(false, "afd_ext.peer_region_alloc: cudaMalloc of ", nbytes, " bytes on cuda:",
                pl->device, " failed (", cudaGetErrorString(err),
                "); lower max_tokens_per_step or the number of stages (see docs/peer-memory.md "
                "for the memory formula)");
  }
  mem->ptr = static_cast<char*>(p);
  mem->bytes = nbytes;
  zero_device(*pl, p, nbytes);  // flags start at 0: no generation is 0
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  const int64_t h = t.next_region++;
  t.regions[h] = RegionRef{std::move(mem), pl->device};
  return h;
}

void peer_region_export(int64_t region, const Tensor& out) {
  AFD_CHECK(out.device().is_cpu() && out.scalar_type() == ScalarType::Byte && out.dim() == 1 &&
                  out.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)) &&
                  out.is_contiguous(),
              "afd_ext.peer_region_export: out must be a contiguous CPU uint8 tensor [",
              sizeof(cudaIpcMemHandle_t), "], got ", out.scalar_type(), " ", out.sizes(), " on ",
              out.device());
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto mem = get_region_locked(t, region, "peer_region_export", "region").mem;
  AFD_CHECK(mem->own, "afd_ext.peer_region_export: region ", region,
              " was opened from a peer; only this process's own regions can be exported");
  if (mem->ipc.empty()) {
    DeviceGuard guard(mem->device);
    cudaIpcMemHandle_t h;
    AFD_CHECK_CUDA(cudaIpcGetMemHandle(&h, mem->ptr));
    mem->ipc.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    t.exported[mem->ipc] = mem;
  }
  std::memcpy(out.data_ptr(), mem->ipc.data(), mem->ipc.size());
}

int64_t peer_region_open(int64_t plane, const Tensor& ipc_handle, int64_t nbytes) {
  AFD_CHECK(ipc_handle.device().is_cpu() && ipc_handle.scalar_type() == ScalarType::Byte &&
                  ipc_handle.dim() == 1 &&
                  ipc_handle.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
              "afd_ext.peer_region_open: ipc_handle must be a CPU uint8 tensor [",
              sizeof(cudaIpcMemHandle_t), "] from peer_region_export, got ",
              ipc_handle.scalar_type(), " ", ipc_handle.sizes(), " on ", ipc_handle.device());
  AFD_CHECK(nbytes > 0, "afd_ext.peer_region_open: nbytes must be > 0, got ", nbytes);
  auto pl = get_plane(plane, "peer_region_open");
  Tensor h = torch::stable::contiguous(ipc_handle);
  std::string key(static_cast<const char*>(h.data_ptr()), sizeof(cudaIpcMemHandle_t));
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    auto it = t.exported.find(key);
    if (it != t.exported.end()) {
      if (auto mem = it->second.lock()) {
        AFD_CHECK(nbytes <= mem->bytes, "afd_ext.peer_region_open: nbytes ", nbytes,
                    " exceeds the region's ", mem->bytes, " bytes");
        if (mem->device != pl->device) {
          // Another GPU of this process (both roles in one process, e.g. the stress
          // test on two GPUs): the plane's device reaches it through peer access.
          int can = 0;
          AFD_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, pl->device, mem->device));
          AFD_CHECK(can, "afd_ext.peer_region_open: cuda:", pl->device, " cannot access cuda:",
                      mem->device, " (no peer access between the GPUs)");
          DeviceGuard guard(pl->device);
          const cudaError_t e = cudaDeviceEnablePeerAccess(mem->device, 0);
          if (e == cudaErrorPeerAccessAlreadyEnabled) {
            cudaGetLastError();
          } else {
            AFD_CHECK_CUDA(e);
          }
        }
        const int64_t r = t.next_region++;
        t.regions[r] = RegionRef{mem, pl->device};  // an alias of this process's own memory
        return r;
      }
      t.exported.erase(it);
    }
  }
  DeviceGuard guard(pl->device);
  cudaIpcMemHandle_t ipc;
  std::memcpy(&ipc, key.data(), sizeof(ipc));
  void* p = nullptr;
  cudaError_t err = cudaIpcOpenMemHandle(&p, ipc, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls do not report it
    AFD_CHECK(false, "afd_ext.peer_region_open: cudaIpcOpenMemHandle on cuda:", pl->device,
                " failed: ", cudaGetErrorString(err), " (error ", static_cast<int>(err),
                "); the peer is on another host, in another container without a shared IPC "
                "namespace, or its GPU cannot be reached by peer access from this one");
  }
  auto mem = std::make_shared<PeerMem>();
  mem->ptr = static_cast<char*>(p);
  mem->bytes = nbytes;
  mem->device = pl->device;
  mem->own = false;
  std::lock_guard<std::mutex> lock(t.mu);
  const int64_t r = t.next_region++;
  t.regions[r] = RegionRef{std::move(mem), pl->device};
  return r;
}

void peer_region_close(int64_t region) {
  {
    std::shared_ptr<PeerMem> mem;  // dropped after the table lock is released
    Table& t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    AFD_CHECK(region >= 1 && region < t.next_region, "afd_ext.peer_region_close: region ", region,
                " was never issued by peer_region_alloc/peer_region_open in this process");
    auto it = t.regions.find(region);
    if (it == t.regions.end()) return;  // idempotent
    mem = std::move(it->second.mem);
    t.regions.erase(it);
  }
  // Frees it now unless a tensor view still holds it (then at a later management op).
  drain_graveyard();
}

Tensor peer_region_view(int64_t region, int64_t offset, int64_t nbytes) {
  std::shared_ptr<PeerMem> mem;
  {
    Table& t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    mem = get_region_locked(t, region, "peer_region_view", "region").mem;
  }
  AFD_CHECK(offset >= 0 && nbytes >= 0 && offset <= mem->bytes && nbytes <= mem->bytes - offset,
              "afd_ext.peer_region_view: bytes [", offset, ", ", offset + nbytes,
              ") are outside the region's ", mem->bytes, " bytes");
  // The deleter holds the memory: a view outlives peer_region_close safely.
  const int64_t stride = 1;
  return torch::stable::from_blob(mem->ptr + offset, {nbytes}, {&stride, 1},
                                  torch::stable::Device(torch::headeronly::DeviceType::CUDA, mem->device),
                                  ScalarType::Byte, [mem](void*) {});
}

// ------------------------------------------------------------------ data ops

void peer_put_cuda(TensorList ts, int64_t plane, int64_t slot, IntList regions,
                   IntList rows, IntList dst_rows, IntList part_offsets,
                   IntList flag_offsets, bool quantize_first, bool ue8m0) {
  const char* op = "peer_put";
  const size_t n = regions.size();
  AFD_CHECK(rows.size() == n && dst_rows.size() == n && flag_offsets.size() == n, "afd_ext.", op,
              ": regions, rows, dst_rows and flag_offsets must have equal lengths (one per peer), "
              "got ", n, ", ", rows.size(), ", ", dst_rows.size(), ", ", flag_offsets.size());
  Table& t = table();
  std::shared_ptr<PeerPlane> pl;
  std::vector<RegionRef> mems;
  mems.reserve(n);
  {
    std::lock_guard<std::mutex> lock(t.mu);
    pl = get_plane_locked(t, plane, op);
    for (size_t i = 0; i < n; ++i) mems.push_back(get_region_locked(t, regions[i], op, "region"));
  }
  AFD_CHECK(static_cast<int>(n) <= pl->max_peers, "afd_ext.", op, ": ", n,
              " peers but the plane was created for at most ", pl->max_peers);
  AFD_CHECK(slot >= 0 && slot < pl->num_slots, "afd_ext.", op, ": slot ", slot,
              " must be in [0, ", pl->num_slots, ")");
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    AFD_CHECK(rows[i] >= 0 && dst_rows[i] >= 0 && rows[i] <= INT64_MAX - total, "afd_ext.", op, ": rows[", i,
                "]=", rows[i], " and dst_rows[", i, "]=", dst_rows[i], " must be >= 0 (rows adding up to < 2^63)");
    total += rows[i];
  }
  // Quantizing: the first tensor takes two parts (values, then scales).
  const size_t q = quantize_first ? 1 : 0;
  AFD_CHECK(!ts.empty() && ts.size() + q <= static_cast<size_t>(kPeerMaxParts), "afd_ext.", op, ": ", ts.size(),
              " tensors given; a put moves 1 to ", kPeerMaxParts, " parts (FP8 values and scales count two)");
  AFD_CHECK(part_offsets.size() == ts.size() + q, "afd_ext.", op, ": part_offsets has ",
              part_offsets.size(), " entries but ", ts.size() + q,
              " wire parts travel (one byte offset per part, in order; FP8 scales right after their values)");
  const Tensor& first = ts[0];
  if (quantize_first) {
    AFD_CHECK(first.scalar_type() == ScalarType::BFloat16 && first.dim() == 2 && first.size(1) % kFp8Group == 0 &&
                    reinterpret_cast<uintptr_t>(first.data_ptr()) % 8 == 0,
                "afd_ext.", op, ": quantize_first needs an 8-byte aligned bfloat16 tensors[0] [T, H] "
                "with H a multiple of ", kFp8Group, ", got ", first.scalar_type(), " ", first.sizes());
  }
  PeerPutArgs a{};
  a.plane = pl->dev;
  a.slot = static_cast<int>(slot);
  a.npeers = static_cast<int>(n);
  a.nparts = static_cast<int>(ts.size());
  a.quant = quantize_first ? 1 + ue8m0 : 0;
  a.scales_off = quantize_first ? part_offsets[1] : 0;
  // Destination bytes per row of each part (values: 1 byte per channel; scales: 4 per group).
  std::vector<int64_t> dst_rb;
  std::vector<int64_t> dst_off;
  for (size_t k = 0; k < ts.size(); ++k) {
    const std::string name = "tensors[" + std::to_string(k) + "]";
    check_wire(op, name.c_str(), ts[k], pl->device, total);
    a.src[k] = static_cast<const char*>(ts[k].data_ptr());
    a.row_bytes[k] = row_bytes_of(ts[k]);
    a.part_off[k] = part_offsets[k == 0 ? 0 : k + q];
    dst_rb.push_back(k == 0 && q ? first.size(1) : a.row_bytes[k]);
    dst_off.push_back(a.part_off[k]);
    if (k == 0 && q) {
      dst_rb.push_back(first.size(1) / kFp8Group * 4);
      dst_off.push_back(a.scales_off);
    }
  }
  for (size_t k = 0; k < part_offsets.size(); ++k) {
    AFD_CHECK(part_offsets[k] >= 0, "afd_ext.", op, ": part_offsets[", k, "] must be >= 0");
  }
  for (size_t i = 0; i < n; ++i) {
    AFD_CHECK(mems[i].device == pl->device, "afd_ext.", op, ": regions[", i, "] is mapped for cuda:",
                mems[i].device, " but the plane is on cuda:", pl->device);
    const PeerMem& m = *mems[i].mem;
    for (size_t k = 0; k < dst_rb.size(); ++k) {
      // end = dst_off + (dst_rows + rows) * row bytes, refused (not wrapped) past int64.
      int64_t end = 0;
      const bool wraps = __builtin_add_overflow(dst_rows[i], rows[i], &end) ||
                         __builtin_mul_overflow(end, dst_rb[k], &end) || __builtin_add_overflow(end, dst_off[k], &end);
      AFD_CHECK(!wraps && end <= m.bytes, "afd_ext.", op, ": part ", k, " rows [", dst_rows[i], ", ",
                  dst_rows[i], " + ", rows[i], ") for peer ", i, " end at byte ", wraps ? std::string("> 2^63") :
                  std::to_string(end), ", past the peer region's ", m.bytes, " bytes (capacity exceeded)");
    }
    AFD_CHECK(flag_offsets[i] >= 0 && flag_offsets[i] % 8 == 0 && flag_offsets[i] <= m.bytes - 8,
                "afd_ext.", op, ": flag_offsets[", i, "]=", flag_offsets[i],
                " must be 8-byte aligned inside the region's ", m.bytes, " bytes");
    a.dst_base[i] = m.ptr;
    a.flag[i] = reinterpret_cast<unsigned long long*>(m.ptr + flag_offsets[i]);
    a.rows[i] = rows[i];
    a.src_row[i] = 0;
    a.dst_row[i] = dst_rows[i];
  }
  int64_t src_row = 0;
  for (size_t i = 0; i < n; ++i) a.src_row[i] = src_row, src_row += rows[i];
  const auto dev = pl->device;
  DeviceGuard guard(dev);
  const int err = peer_put_launch(a, 2 * pl->sm_count, current_stream(dev));
  if (err != 0) {
    throw_cuda_error("peer_put_launch", err, cudaGetErrorString(static_cast<cudaError_t>(err)),
                     __FILE__, __LINE__);
  }
}

void peer_wait_cuda(TensorList ts, const OptTensor& out, int64_t plane, int64_t slot, int64_t region,
                    IntList flag_offsets, IntList peers, int64_t op_code, int64_t layer,
                    int64_t stage, int64_t timeout_ns, bool dequantize) {
  const char* op = "peer_wait";
  const size_t n = flag_offsets.size();
  AFD_CHECK(peers.size() == n, "afd_ext.", op,
              ": flag_offsets and peers must have equal lengths (one per peer), got ", n, " and ",
              peers.size());
  Table& t = table();
  std::shared_ptr<PeerPlane> pl;
  RegionRef ref;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    pl = get_plane_locked(t, plane, op);
    ref = get_region_locked(t, region, op, "region");
  }
  const std::shared_ptr<PeerMem>& mem = ref.mem;
  AFD_CHECK(static_cast<int>(n) <= pl->max_peers, "afd_ext.", op, ": ", n,
              " peers but the plane was created for at most ", pl->max_peers);
  AFD_CHECK(slot >= 0 && slot < pl->num_slots, "afd_ext.", op, ": slot ", slot,
              " must be in [0, ", pl->num_slots, ")");
  AFD_CHECK(timeout_ns > 0, "afd_ext.", op, ": timeout_ns must be > 0, got ", timeout_ns);
  AFD_CHECK(mem->device == pl->device, "afd_ext.", op, ": the flags' region is on cuda:", mem->device,
              " but the plane is on cuda:", pl->device, "; a plane waits in its own region");
  AFD_CHECK(!ts.empty() && (!dequantize || (ts.size() >= 2 && out.has_value())), "afd_ext.", op,
              ": give the guarded tensors (", ts.size(), " given), and with dequantize values, scales and out");
  for (size_t k = 0; k < ts.size(); ++k) {
    check_on(op, ("tensors[" + std::to_string(k) + "]").c_str(), ts[k], pl->device);
  }
  const Tensor& src = ts[0];
  PeerWaitArgs a{};
  a.plane = pl->dev;
  a.slot = static_cast<int>(slot);
  a.npeers = static_cast<int>(n);
  a.op = static_cast<int>(op_code);
  a.layer = static_cast<int>(layer);
  a.stage = static_cast<int>(stage);
  a.timeout_ns = timeout_ns;
  for (size_t i = 0; i < n; ++i) {
    AFD_CHECK(flag_offsets[i] >= 0 && flag_offsets[i] % 8 == 0 && flag_offsets[i] <= mem->bytes - 8,
                "afd_ext.", op, ": flag_offsets[", i, "]=", flag_offsets[i],
                " must be 8-byte aligned inside the region's ", mem->bytes, " bytes");
    a.flag[i] = reinterpret_cast<unsigned long long*>(mem->ptr + flag_offsets[i]);
    a.peer_id[i] = static_cast<int>(peers[i]);
  }
  if (dequantize) {  // FP8 values (tensors[0]) and their scales (tensors[1]) delivered as bf16
    const Tensor& scales = ts[1];
    check_on(op, "out", *out, pl->device);
    const int64_t h = src.dim() == 2 ? src.size(1) : 0;
    AFD_CHECK(src.scalar_type() == ScalarType::Float8_e4m3fn && out->scalar_type() == ScalarType::BFloat16 &&
                    scales.scalar_type() == ScalarType::Float && h % kFp8Group == 0 &&
                    out->sizes().equals(src.sizes()) && scales.dim() == 2 && scales.size(0) == src.size(0) && scales.size(1) == h / kFp8Group &&
                    out->is_contiguous() && src.is_contiguous() && scales.is_contiguous() &&
                    reinterpret_cast<uintptr_t>(out->data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(src.data_ptr()) % 8 == 0,
                "afd_ext.", op, ": dequantizing needs float8_e4m3fn values tensors[0] [T, H] (H a multiple of ",
                kFp8Group, "), float32 scales tensors[1] [T, H/", kFp8Group, "] and a bfloat16 out [T, H], "
                "contiguous and aligned; got ", src.scalar_type(), " ", src.sizes(), ", ", scales.scalar_type(),
                " ", scales.sizes(), ", ", out->scalar_type(), " ", out->sizes());
    a.copy_src = static_cast<const char*>(src.data_ptr());
    a.copy_dst = static_cast<char*>(out->data_ptr());
    a.copy_bytes = src.numel();
    a.dq_scales = static_cast<float*>(scales.data_ptr());
  } else if (out.has_value()) {
    check_on(op, "out", *out, pl->device);
    AFD_CHECK(out->scalar_type() == src.scalar_type() && out->sizes().equals(src.sizes()) && out->is_contiguous() &&
                    src.is_contiguous(),
                "afd_ext.", op, ": out must be a contiguous tensor of tensors[0]'s dtype and shape (",
                src.scalar_type(), " ", src.sizes(), "), got ", out->scalar_type(), " ", out->sizes(),
                out->is_contiguous() ? "" : " (not contiguous)");
    a.copy_src = static_cast<const char*>(src.data_ptr());
    a.copy_dst = static_cast<char*>(out->data_ptr());
    a.copy_bytes = src.numel() * static_cast<int64_t>(src.element_size());
  }
  const auto dev = pl->device;
  DeviceGuard guard(dev);
  // At most one block per SM: spinning blocks never fill the GPU, so the
  // peer's put (maybe on another stream of this process) always finds room.
  const int err = peer_wait_launch(a, pl->sm_count, current_stream(dev));
  if (err != 0) {
    throw_cuda_error("peer_wait_launch", err, cudaGetErrorString(static_cast<cudaError_t>(err)),
                     __FILE__, __LINE__);
  }
}

STABLE_TORCH_LIBRARY_IMPL(afd_ext, CUDA, m) {
  m.impl("peer_put", TORCH_BOX(&peer_put_cuda));
  m.impl("peer_wait", TORCH_BOX(&peer_wait_cuda));
}

}  // namespace afd
