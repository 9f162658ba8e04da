// The NCCL communicator table: int handles (never raw pointers) to live
// communicators, guarded by one mutex.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <memory>

namespace afd {

struct Comm {
  ncclComm_t comm;
  int device;  // CUDA device index the communicator was created on
  int size;    // ranks in the communicator
  int rank;    // this process's rank in it
  int64_t handle;
};

// The live communicator behind `handle`; a ValueError naming the op and
// argument when it is not live (never issued, destroyed or aborted).
std::shared_ptr<Comm> comm_get(int64_t handle, const char* op, const char* arg_name);

}  // namespace afd
