// The device interface. Every operation exists twice: the CPU reference (cpu_backend.cpp, the
// definition of the right answer) and the CUDA path (cuda_backend.cpp and kernels/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/jobs.hpp"

struct CUstream_st;

namespace fp8 {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual int32_t device() const = 0;

  // Memory of this backend's device. allocate() throws FP8_ERR_OUT_OF_MEMORY; size 0 gives nullptr.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) noexcept = 0;
  // Synchronous copies between host memory and this device's memory.
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  // Throws FP8_ERR_INVALID_ARGUMENT naming `what` unless p is memory this device can address.
  virtual void check_device_pointer(const void* p, const char* what) const = 0;

  virtual void set_stream(CUstream_st* stream) = 0;
  virtual CUstream_st* stream() const = 0;
  // The id of the CUDA graph capture under way on the stream, 0 when none (always 0 on the CPU).
  virtual uint64_t capture_id() const { return 0; }
  virtual void synchronize() = 0;

  virtual void quantize(const QuantizeJob& job) = 0;
  virtual void dequantize(const DequantizeJob& job) = 0;
  virtual void amax(const AmaxJob& job) = 0;
  virtual void scaling_update(const ScalingUpdateJob& job) = 0;
  virtual void gemm(const GemmJob& job) = 0;
  virtual void activation(const ActivationJob& job) = 0;
  virtual void norm(const NormJob& job) = 0;
  virtual void bias_grad(const BiasGradJob& job) = 0;
  virtual void convert(const ConvertJob& job) = 0;
  virtual void transpose(const TransposeJob& job) = 0;
  virtual void optimizer_step(const OptimizerStepJob& job) = 0;
  virtual void grad_accumulate(const GradAccumulateJob& job) = 0;
  // Sets `bytes` bytes at p to zero (asynchronously on the GPU).
  virtual void zero(void* p, size_t bytes) = 0;
  // Copies `bytes` bytes between two places of this device's memory (asynchronously on the GPU).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// The CPU reference of Backend::optimizer_step (its own file: src/backend/cpu_optimizer.cpp).
void cpu_optimizer_step(const OptimizerStepJob& job);
void cpu_grad_accumulate(const GradAccumulateJob& job);
// Throws FP8_ERR_NO_DEVICE / FP8_ERR_UNSUPPORTED when `device` cannot run libfp8.
std::unique_ptr<Backend> make_cuda_backend(int32_t device);

}  // namespace fp8
