// The control plane's waits (control_poll.cpp), bound in bindings.cpp. No Python here.
#pragma once
#include <cstddef>
#include <cstdint>

namespace afd::ctrl {

// Shared-memory ring: a header, then slots of `stride` bytes; a slot is
// seq u64 | total u64 | frag u32 | sender u32 | crc u32 | pad u32 | payload.
// The header's bytes [192, 256) are this side's (waiting flag, doorbell, stop), and the
// receiver's read count (u64 at byte 64); the rest is afd_ext/control/shm.py's. Python reads
// these constants through _C.
constexpr int64_t kHeaderBytes = 256;
constexpr int64_t kReadCount = 64;
constexpr int64_t kSlotHeader = 32;

// What a take returns when it has no message (a message: its length, >= 0).
constexpr int64_t kSlice = -1;    // the slice's deadline passed
constexpr int64_t kStopped = -2;  // an end set the ring's stop word (close)
constexpr int64_t kCorrupt = -3;  // a published slot stayed inconsistent for a second

// Writes message k (a fragment of `total` bytes from world rank `sender`) into its slot and
// publishes it (seqlock: seq 2k+1 while written, 2k+2 once done); wakes a blocked receiver.
// Returns false, writing nothing, while the ring is full (the receiver has not taken k - nslots).
bool shm_put(uint8_t* ring, uint64_t nslots, uint64_t stride, uint64_t k, uint64_t total,
             uint32_t sender, const uint8_t* data, uint32_t n);
// Waits for message k: spins until `spin_until`, then sleeps on the doorbell (a futex) until
// `deadline` (CLOCK_MONOTONIC ns). Copies a consistent fragment (CRC-checked) into `out` and
// advances the read count to k + 1.
int64_t shm_take(uint8_t* ring, uint64_t nslots, uint64_t stride, uint64_t k, uint8_t* out,
                 uint64_t cap, uint64_t* total, uint32_t* sender, int64_t spin_until, int64_t deadline);
// Sets the stop word and rings the doorbell: a waiting take returns kStopped.
void shm_stop(uint8_t* ring);
// Reads what socket `fd` holds (up to cap bytes): spins on a non-blocking recv() until
// `spin_until`, then waits in poll() until `deadline`. Returns bytes read, 0 at EOF, kSlice, or -errno.
int64_t tcp_read(int fd, uint8_t* buf, uint64_t cap, int64_t spin_until, int64_t deadline);

}  // namespace afd::ctrl
