// The peer-memory plane: plain-data descriptions the kernels work on.
//
// Rules the kernels (cuda/peer_kernels.cu) implement and docs/peer-memory.md
// explains:
// * A flag is a 64-bit word in the *receiver's* memory: generation << 48 | seq.
//   The writer publishes it with fence.acq_rel.sys + st.relaxed.sys (a release)
//   after all of its data stores (several blocks: each block's fence.acq_rel.sys
//   and arrival, the last block publishes); the reader spins with
//   ld.acquire.sys. A value with another generation is stale (never taken); one
//   of this generation but a later seq is a protocol error.
// * Sequence numbers live in device memory (PeerPlaneDev::counters) and advance
//   inside the kernels, so a captured CUDA graph replays with no host update.
// * Every spin has a deadline measured with %globaltimer; on expiry the first
//   failing wait records an error in host-mapped memory (kPeerErr* words) and
//   sets the device word `failed`; from then on every wait returns at once and
//   every put writes nothing, until the plane is destroyed.
//
// Free of torch and CUDA headers so the .cu file compiles quickly.
#pragma once

#include <cstdint>

namespace afd {

// Most peers one call may name (the launcher passes the kernels arguments sized
// for 1, 8 or this many peers).
constexpr int kPeerMaxPeers = 64;
// Most wire parts (destination parts, FP8's values and scales counting two) one put moves.
constexpr int kPeerMaxParts = 8;
// Bytes of a CUDA IPC memory handle (sizeof(cudaIpcMemHandle_t), asserted where the CUDA header is seen).
constexpr int kPeerIpcHandleBytes = 64;
// FP8 hidden states (e4m3, DeepEP/DeepGEMM format): one float32 scale per row and this many channels.
constexpr int kFp8Group = 128;

// Error record words (int64, host-mapped).
enum PeerErrWord : int {
  kPeerErrCode = 0,      // PeerErrCode; written last, so a nonzero code means the rest is valid
  kPeerErrOp = 1,        // the op code the caller passed (Python maps it to a name)
  kPeerErrPeer = 2,      // role rank of the peer whose flag was missing
  kPeerErrLayer = 3,     // layer the caller passed
  kPeerErrStage = 4,     // stage the caller passed
  kPeerErrWant = 5,      // the sequence number waited for
  kPeerErrSeen = 6,      // the flag word last seen (generation << 48 | seq)
  kPeerErrWaitedNs = 7,  // how long the wait spun, ns (device clock)
  kPeerErrWords = 8,
};

enum PeerErrCode : int {
  kPeerOk = 0,
  kPeerTimeout = 1,   // the deadline passed before the flag arrived
  kPeerProtocol = 2,  // the flag showed this generation but a later sequence number
  kPeerAborted = 3,   // the host aborted the plane (peer_plane_abort)
};

// Names of the error record's words in PeerErrWord order (exported to Python as _C.PEER_ERR_WORDS).
constexpr const char* kPeerErrWordNames = "code,op,peer,layer,stage,want,seen,waited_ns";

constexpr int kPeerGenShift = 48;
constexpr uint64_t kPeerSeqMask = (uint64_t{1} << kPeerGenShift) - 1;
// Generations are the flag word's bits above the sequence number: 1..kPeerMaxGeneration.
constexpr int kPeerMaxGeneration = (1 << (64 - kPeerGenShift)) - 1;

// Device state of one plane (pointers valid on the plane's device).
struct PeerPlaneDev {
  unsigned long long* counters;  // [num_slots * max_peers] last sequence number put / taken
  unsigned int* done;            // [num_slots] blocks finished in the running launch (last-block pattern)
  int* failed;                   // nonzero once the plane failed (sticky)
  long long* host_err;           // [kPeerErrWords] host-mapped error record
  unsigned long long gen_bits;   // generation << kPeerGenShift
  int max_peers;
};

// One peer_put launch: nparts source tensors, rows of peer i go to dst_base[i].
struct PeerPutArgs {
  PeerPlaneDev plane;
  int slot;
  int npeers;
  int nparts;
  const char* src[kPeerMaxParts];      // row 0 of each source tensor (dense rows)
  long long row_bytes[kPeerMaxParts];  // bytes per row of each source tensor
  long long part_off[kPeerMaxParts];   // byte offset of each part's row 0 in a destination region
  char* dst_base[kPeerMaxPeers];       // destination region of peer i
  unsigned long long* flag[kPeerMaxPeers];
  long long rows[kPeerMaxPeers];
  long long src_row[kPeerMaxPeers];
  long long dst_row[kPeerMaxPeers];
  // Nonzero: src[0] is bf16, quantized in the put to e4m3 values (part_off[0],
  // one byte per channel) and float32 scales (scales_off); 2: UE8M0 scales.
  int quant;
  long long scales_off;
};

// One peer_wait launch: wait for npeers flags, then (optionally) copy bytes.
struct PeerWaitArgs {
  PeerPlaneDev plane;
  int slot;
  int npeers;
  int op;
  int layer;
  int stage;
  long long timeout_ns;
  unsigned long long* flag[kPeerMaxPeers];
  int peer_id[kPeerMaxPeers];
  const char* copy_src;  // nullptr: no copy
  char* copy_dst;
  long long copy_bytes;
  const float* dq_scales;  // non-null: copy_src is e4m3 values (copy_bytes of them), copy_dst bf16 (dequantized)
};

// Launchers (cuda/peer_kernels.cu) on `stream` (a cudaStream_t); `max_blocks`
// bounds the grid (the caller passes a multiple of the SM count). They return
// the launch error code (0 = cudaSuccess) and never synchronise.
int peer_put_launch(const PeerPutArgs& args, int max_blocks, void* stream);
int peer_wait_launch(const PeerWaitArgs& args, int max_blocks, void* stream);

// FP8 hidden states outside the plane (the NCCL path), same rule and device code as the put/wait:
// x bf16 [groups * 128] -> values e4m3 [groups * 128] and scales float32 [groups] (ue8m0: powers of
// two); and back to bf16.
int fp8_quantize_launch(const void* x, void* values, float* scales, long long groups, int ue8m0,
                        int max_blocks, void* stream);
int fp8_dequantize_launch(const void* values, const float* scales, void* out, long long numel,
                          int max_blocks, void* stream);

}  // namespace afd
