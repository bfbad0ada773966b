// The device interface. Every operation exists twice: the CPU reference (cpu_backend.cpp, the
// definition of the right answer) and the CUDA path (cuda_backend.cpp and kernels/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "backend/jobs.hpp"

struct CUstream_st;

namespace fp8 {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual int32_t device() const = 0;

  // Memory of this backend's device, from the application's allocator when one is set
  // (fp8_context_set_allocator), else the backend's own. allocate() throws FP8_ERR_OUT_OF_MEMORY;
  // size 0 gives nullptr. release() hands each block back to whichever allocator gave it.
  void* allocate(size_t bytes);
  void release(void* p) noexcept;
  // Later allocations come from `alloc`/`free_fn` (both null: the backend's own again).
  void set_allocator(fp8_alloc_fn alloc, fp8_free_fn free_fn, void* user);
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
  // Called about every 10 ms while synchronize() or a host copy waits for the GPU, with the seconds
  // waited so far; it may throw to end the wait (a communicator's timeout, NCCL's asynchronous
  // errors: fp8_comm_set_timeout). Without one the waits block in the CUDA runtime. Set by the
  // communicators of this backend (src/dist), under the context's external synchronisation.
  void set_wait_poll(std::function<void(double)> poll) { wait_poll_ = std::move(poll); }
  // The communication stream (fp8.h, "Data parallelism"): between begin_side() and end_side() the
  // backend's work goes to a stream of its own (stream() returns it), ordered after everything
  // queued on the stream before begin_side() and running beside what the stream gets after
  // end_side(), until join_side() makes the stream wait for all of it. Every collective issued
  // outside a begin/end pair joins first, so a communicator's collectives run in the order they were
  // issued. set_stream(), synchronize() and the host copies join too. The CPU runs everything in order: nothing to do.
  virtual void begin_side() {}
  virtual void end_side() {}
  virtual void join_side() {}
  // Inside the communication stream's scope, a second stream (the lane) for kernels that run beside
  // the next transfers: begin_lane() orders the lane after what the communication stream has so far
  // and makes stream() the lane; end_lane() makes it the communication stream again. join_lane()
  // makes the communication stream wait for everything the lane has so far, as end_side() does.
  virtual void begin_lane() {}
  virtual void end_lane() {}
  virtual void join_lane() {}

  // Whether GEMMs with per-row and block scales run here (check_gemm_scales' pairs), and the device
  // in words, for messages ("NVIDIA H100 ... with cuBLASLt 130100", "the CPU backend").
  virtual bool scaled_gemms() const { return true; }
  virtual std::string describe() const { return "the CPU backend"; }

  virtual void quantize(const QuantizeJob& job) = 0;
  // The same as quantize() of each job in turn; a backend may run them together (the CUDA backend
  // does, one launch per input dtype and format, for casts with a transposed copy under delayed
  // scaling).
  virtual void quantize_group(const QuantizeJob* jobs, size_t count) {
    for (size_t i = 0; i < count; ++i) quantize(jobs[i]);
  }
  virtual void recipe_quantize(const RecipeQuantizeJob& job) = 0;
  virtual void dequantize(const DequantizeJob& job) = 0;
  virtual void amax(const AmaxJob& job) = 0;
  virtual void scaling_update(const ScalingUpdateJob& job) = 0;
  virtual void gemm(const GemmJob& job) = 0;
  virtual void activation(const ActivationJob& job) = 0;
  virtual void norm(const NormJob& job) = 0;
  virtual void bias_grad(const BiasGradJob& job) = 0;
  virtual void convert(const ConvertJob& job) = 0;
  virtual void transpose(const TransposeJob& job) = 0;
  // An optimizer step in three parts, with a reduce point after each of the first two: the squared
  // norm's per-chunk partials (job.partials); their sum in the fixed order, the step scalars and the
  // element updates (with each compact tensor's largest codes written); promote_compact. Across
  // ranks that shard the elements, the partials and the compact scales are what one max all-reduce
  // each combines (each rank's chunks hold values, its others zeros).
  virtual void optimizer_norm(const OptimizerStepJob& job) = 0;
  virtual void optimizer_update(const OptimizerStepJob& job) = 0;
  virtual void optimizer_promote(const OptimizerStepJob& job) = 0;
  virtual void grad_accumulate(const GradAccumulateJob& job) = 0;
  // The FP8 gradient exchange's local pass (core/exchange_rule.hpp) and the FP32 gradients' mean.
  virtual void grad_exchange(const GradExchangeJob& job) = 0;
  virtual void gather_peer_scales(const PeerScalesJob& job) = 0;
  virtual void divide(const DivideJob& job) = 0;
  // `height` rows of `width` bytes from src (rows `spitch` bytes apart) to dst (`dpitch` apart):
  // how one slot of every scaling state is gathered and scattered (asynchronously on the GPU).
  virtual void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) = 0;
  // Sets `bytes` bytes at p to zero (asynchronously on the GPU).
  virtual void zero(void* p, size_t bytes) = 0;
  // Copies `bytes` bytes between two places of this device's memory (asynchronously on the GPU).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;

 protected:
  virtual void* native_allocate(size_t bytes) = 0;
  virtual void native_release(void* p) noexcept = 0;
  std::function<void(double)> wait_poll_;

 private:
  std::mutex allocator_mutex_;  // release() may come from any thread (destroy calls)
  fp8_alloc_fn alloc_ = nullptr;
  fp8_free_fn free_ = nullptr;
  void* allocator_user_ = nullptr;
  std::unordered_map<void*, std::pair<fp8_free_fn, void*>> hooked_;  // blocks from an application's allocator
};

std::unique_ptr<Backend> make_cpu_backend();
// The CPU reference of Backend::optimizer_norm / optimizer_update (src/backend/cpu_optimizer.cpp).
void cpu_optimizer_norm(const OptimizerStepJob& job);
void cpu_optimizer_update(const OptimizerStepJob& job);
void cpu_optimizer_promote(const OptimizerStepJob& job);
void cpu_grad_accumulate(const GradAccumulateJob& job);
void cpu_grad_exchange(const GradExchangeJob& job);
void cpu_gather_peer_scales(const PeerScalesJob& job);
// Throws FP8_ERR_NO_DEVICE / FP8_ERR_UNSUPPORTED when `device` cannot run libfp8.
std::unique_ptr<Backend> make_cuda_backend(int32_t device);

}  // namespace fp8
