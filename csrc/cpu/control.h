// The control plane's native part (control_poll.cpp): the shm ring, the waits, the payload's
// layout check. Bound in control_bindings.cpp (the one place that touches Python objects).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace afd::ctrl {

// Shared-memory ring: a header of kHeaderBytes, then nslots slots of `stride` bytes (32 + slot_bytes
// rounded up to 64); a slot is seq u64 | total u64 | frag u32 | sender u32 | crc u32 | pad u32 | payload.
// Header, u64 words: [0] magic, [1] version u32 | nslots u32, [2] slot_bytes, [3..6] the ends' pids and
// start times (afd_ext/control/shm.py writes these); [8] read count (receiver: slots taken), [9] receiver
// state; [16] heartbeat ns, [17] sender state, [18] write count (sender: slots put); bytes [192, 204)
// waiting flag | doorbell | stop word (u32, this file's). Python reads the sizes through _C.
// An end's state: 0 new, 1 attached (sender), 2 closed; the ordering rule is docs/internals.md's "How a
// channel ends".
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

constexpr uint64_t kClosed = 2;  // an end's state word after its close

// Writes the next message (a fragment of `total` bytes from world rank `sender`) into its slot and
// publishes it (seqlock: seq 2k+1 while written, 2k+2 once done); wakes a blocked receiver.
// Returns false, writing nothing, while the ring is full (the receiver has not taken k - nslots) or
// after the receiver closed (shm_ends tells which).
bool shm_put(const Ring& r, uint64_t total, uint32_t sender, const uint8_t* data, uint32_t n);
// Waits for the next message: spins until `spin_until`, then sleeps on the doorbell (a futex) until
// `deadline` (CLOCK_MONOTONIC ns). Copies a consistent fragment (CRC-checked) into `out` (slot_bytes)
// and advances the read count.
int64_t shm_take(const Ring& r, uint8_t* out, uint64_t* total, uint32_t* sender, int64_t spin_until,
                 int64_t deadline);
// An end's close: stores kClosed in its state word, sets the stop word and rings the doorbell (a waiting
// take returns kStopped).
void shm_stop(uint8_t* ring, bool sender);
// Both ends' states and the slots put but not yet taken, read in that order (see the state words above).
void shm_ends(uint8_t* ring, uint64_t* sender_state, uint64_t* receiver_state, uint64_t* unread);

// TCP frames: magic u32 | type u32 | sender world rank u32 | length u64 | body.
constexpr uint32_t kTcpMagic = 0xAFDC7C01;
constexpr size_t kFrameHeader = 20;
// Reads what socket `fd` holds (up to cap bytes): spins on a non-blocking recv() until
// `spin_until`, then waits in poll() until `deadline`. Returns bytes read, 0 at EOF, kSlice, or -errno.
int64_t tcp_read(int fd, uint8_t* buf, uint64_t cap, int64_t spin_until, int64_t deadline);

// The binary control payload, little-endian (afd_ext.control.codec.encode_control_binary documents it):
// "AFDb" | version u8 | flags u8 | stages u16 | per stage, increasing: stage u32 | n u32 | max u32 | i32[n].
constexpr size_t kPayloadHead = 8, kStageHead = 12;
constexpr uint8_t kPayloadVersion = 1;
// Checks a whole payload: "" when it is valid, else what is wrong.
std::string check_payload(const uint8_t* p, uint64_t size, uint64_t max_stages, uint64_t max_ranks);

}  // namespace afd::ctrl
