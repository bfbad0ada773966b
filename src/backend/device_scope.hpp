// DeviceScope: the CUDA device current for a scope, the caller's restored afterwards. Every call
// into a CUDA backend, and every NCCL call, runs under one.
#pragma once

#include <cuda_runtime_api.h>

#include <new>

#include "kernels/launch.hpp"

namespace fp8 {

// Makes `device` current for the scope and restores the caller's device afterwards. The
// std::nothrow form ignores failures, for destructors and release().
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    // A non-sticky error left by earlier, unrelated calls on this thread would otherwise be
    // reported by our launch checks; sticky faults (a crashed kernel) still surface.
    (void)cudaGetLastError();
    kernels::cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) kernels::cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  DeviceScope(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace fp8
