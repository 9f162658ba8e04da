// The current CUDA device set for a management op's scope and restored after it, on a path that
// may still be running while the process exits: a communicator's abort or destroy (or an abandoned
// init) runs on a helper thread and, with a stalled peer, can return after the interpreter is gone
// and libtorch_cuda's static destructors have run. c10::cuda::CUDAGuard restores the device from a
// noexcept destructor through c10, which throws once those destructors ran ("Should never been
// called"), so the process died with SIGABRT at exit. This restores through c10 as well (no primary
// context made on a device that has none) and drops a failure there: the process is exiting.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

namespace afd {

class DeviceScope {
 public:
  // Sets `device` current. Raises c10::Error (a Python RuntimeError) when it cannot.
  explicit DeviceScope(int device) : prev_(c10::cuda::ExchangeDevice(static_cast<c10::DeviceIndex>(device))) {}
  ~DeviceScope() {
    try {
      c10::cuda::MaybeSetDevice(prev_);
    } catch (...) {  // exiting (c10's CUDA hooks are gone) or the device is lost: nothing to restore
    }
    cudaGetLastError();  // a failed restore must not surface as a later call's error
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex prev_;
};

}  // namespace afd
