// The control plane's native part (control_poll.cpp): the shm ring, the waits, the payload's
// layout check. Bound in bindings.cpp (the one place that touches Python objects).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace afd::ctrl {

// Shared-memory ring: a header of kHeaderBytes, then nslots slots of `stride` bytes (32 + slot_bytes
// rounded up to 64); a slot is seq u64 | total u64 | frag u32 | sender u32 | crc u32 | pad u32 | payload.
// Header, u64 words: [0] magic, [1] version u32 | nslots u32, [2] slot_bytes, [3..6] the ends' pids and
// start times (afd_ext/control/shm.py writes these); [8] read count (receiver: slots taken);
// [16] heartbeat ns, [17] sender state, [18] write count (sender: slots put); bytes [192, 204) waiting
// flag | doorbell | stop word (u32, this file's). Python reads the sizes through _C.
constexpr int64_t kHeaderBytes = 256;
constexpr int64_t kSlotHeader = 32;

// A ring's geometry, read from its header and checked against the mapping's length.
struct Ring {
  uint8_t* base;
  uint64_t nslots, stride, slot_bytes;
};
bool ring_of(uint8_t* buf, uint64_t len, Ring* r);

// What a take returns when it has no message (a message: its length, >= 0).
constexpr int64_t kSlice = -1;    // the slice's deadline passed
constexpr int64_t kStopped = -2;  // an end set the ring's stop word (close)
constexpr int64_t kCorrupt = -3;  // a published slot stayed inconsistent for a second

// Writes the next message (a fragment of `total` bytes from world rank `sender`) into its slot and
// publishes it (seqlock: seq 2k+1 while written, 2k+2 once done); wakes a blocked receiver.
// Returns false, writing nothing, while the ring is full (the receiver has not taken k - nslots).
bool shm_put(const Ring& r, uint64_t total, uint32_t sender, const uint8_t* data, uint32_t n);
// Waits for the next message: spins until `spin_until`, then sleeps on the doorbell (a futex) until
// `deadline` (CLOCK_MONOTONIC ns). Copies a consistent fragment (CRC-checked) into `out` (slot_bytes)
// and advances the read count.
int64_t shm_take(const Ring& r, uint8_t* out, uint64_t* total, uint32_t* sender, int64_t spin_until,
                 int64_t deadline);
// Sets the stop word and rings the doorbell: a waiting take returns kStopped.
void shm_stop(uint8_t* ring);

// TCP frames: magic u32 | type u32 | sender world rank u32 | length u64 | body.
constexpr uint32_t kTcpMagic = 0xAFDC7C01;
constexpr size_t kFrameHeader = 20;
// Reads what socket `fd` holds (up to cap bytes): spins on a non-blocking recv() until
// `spin_until`, then waits in poll() until `deadline`. Returns bytes read, 0 at EOF, kSlice, or -errno.
int64_t tcp_read(int fd, uint8_t* buf, uint64_t cap, int64_t spin_until, int64_t deadline);

// The binary control payload, little-endian (afd_ext.metadata.encode_control_binary documents it):
// "AFDb" | version u8 | flags u8 | stages u16 | per stage, increasing: stage u32 | n u32 | max u32 | i32[n].
constexpr size_t kPayloadHead = 8, kStageHead = 12;
constexpr uint8_t kPayloadVersion = 1;
// Checks a whole payload: "" when it is valid, else what is wrong.
std::string check_payload(const uint8_t* p, uint64_t size, uint64_t max_stages, uint64_t max_ranks);

}  // namespace afd::ctrl
