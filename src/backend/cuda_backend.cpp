// The CUDA backend: memory and copies through the CUDA runtime, work queued on the context's
// stream through the launchers in kernels/. Every call makes the context's device current for its
// own duration and restores the caller's.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <new>
#include <thread>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu_recipe_quantize.hpp"  // (check_recipe_quantize)
#include "backend/cublaslt_gemm.hpp"
#include "backend/device_scope.hpp"
#include "core/error.hpp"
#include "kernels/launch.hpp"

namespace fp8 {

namespace {

using kernels::cuda_check;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int32_t device) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
    if (device < 0 || device >= count)
      fail(FP8_ERR_NO_DEVICE, "device ", device, " does not exist; ", count,
           " CUDA device(s) visible, so expected FP8_DEVICE_CPU (-1) or 0..", count - 1);
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    if (prop.major * 10 + prop.minor < 89)
      fail(FP8_ERR_UNSUPPORTED, "device ", device, " (", prop.name, ") has compute capability ", prop.major, ".",
           prop.minor, "; FP8 needs 8.9 or newer (Ada, Hopper, Blackwell)");
    limits_ = {device, prop.multiProcessorCount};
    DeviceScope scope(device);
    gemm_ = std::make_unique<CublasLtGemm>(device);
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&scratch_), kScratchFloats * sizeof(float)),
               "cudaMalloc of the scratch buffer");
  }
  ~CudaBackend() override {
    DeviceScope scope(limits_.device, std::nothrow);
    for (Fork* f : {&lane_, &side_})
      if (f->stream) {
        cudaStreamSynchronize(f->stream);
        cudaStreamDestroy(f->stream);
        cudaEventDestroy(f->forked);
        cudaEventDestroy(f->done);
      }
    gemm_.reset();
    cudaFree(scratch_);
    cudaFree(recipe_workspace_);
    for (void* p : retired_workspaces_) cudaFree(p);
  }

  int32_t device() const override { return limits_.device; }

  uint64_t capture_id() const override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (!stream_ || cudaStreamGetCaptureInfo(stream_, &status, &id) != cudaSuccess) return 0;
    return status == cudaStreamCaptureStatusActive ? id : 0;
  }

  void* native_allocate(size_t bytes) override {
    DeviceScope scope(limits_.device);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky; do not report it again later
      fail(err == cudaErrorMemoryAllocation ? FP8_ERR_OUT_OF_MEMORY : FP8_ERR_CUDA, "cudaMalloc of ", bytes,
           " bytes on device ", limits_.device, " failed: ", cudaGetErrorName(err));
    }
    return p;
  }
  void native_release(void* p) noexcept override {
    DeviceScope scope(limits_.device, std::nothrow);
    cudaFree(p);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    DeviceScope scope(limits_.device);
    join_side();  // (the memory may be the communication stream's)
    wait_queued("copy to device");
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "copy to device");
    wait(stream_, "copy to device (synchronize)");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    DeviceScope scope(limits_.device);
    join_side();
    wait_queued("copy to host");
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "copy to host");
    wait(stream_, "copy to host (synchronize)");
  }
  void check_device_pointer(const void* p, const char* what) const override {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();
      attr.type = cudaMemoryTypeUnregistered;
    }
    const bool device_memory = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    if (!device_memory || attr.device != limits_.device)
      fail(FP8_ERR_INVALID_ARGUMENT, what, " is not device memory of device ", limits_.device,
           device_memory ? " (it belongs to another device)" : " (it is host memory)");
  }

  // Work already queued on the old stream (and the communication stream) comes before anything
  // queued on the new one.
  void set_stream(CUstream_st* stream) override {
    if (stream == stream_) return;
    if (in_side_) fail(FP8_ERR_INTERNAL, "set_stream inside the communication stream's scope");
    DeviceScope scope(limits_.device);
    join_side();
    // A stream being captured into a CUDA graph cannot wait for work outside the capture (nor the
    // other way round): the capture's owner orders them (torch.cuda.graph synchronises before it
    // begins), so the switch into or out of a capture adds no dependency.
    cudaStreamCaptureStatus old_capture = cudaStreamCaptureStatusNone, new_capture = cudaStreamCaptureStatusNone;
    cuda_check(cudaStreamIsCapturing(stream_, &old_capture), "cudaStreamIsCapturing (the old stream)");
    cuda_check(cudaStreamIsCapturing(stream, &new_capture), "cudaStreamIsCapturing (the new stream)");
    if (old_capture != cudaStreamCaptureStatusNone || new_capture != cudaStreamCaptureStatusNone) {
      stream_ = stream;
      return;
    }
    cudaEvent_t done = nullptr;
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    const cudaError_t recorded = cudaEventRecord(done, stream_);
    const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(stream, done, 0) : recorded;
    cudaEventDestroy(done);
    cuda_check(waited, "ordering the new stream after the old one");
    stream_ = stream;
  }
  CUstream_st* stream() const override { return stream_; }

  void begin_side() override {
    if (in_side_) fail(FP8_ERR_INTERNAL, "the communication stream's scope does not nest");
    DeviceScope scope(limits_.device);
    fork(side_, stream_, true, "the communication stream");
    main_ = stream_;
    stream_ = side_.stream;
    in_side_ = true;
  }
  void end_side() override {
    if (!in_side_) return;
    // The scope closes whatever fails below; the communication stream's end then covers the lane.
    const bool lane_open = in_lane_;
    in_lane_ = in_side_ = false;
    stream_ = main_;
    side_queued_ = true;
    DeviceScope scope(limits_.device);
    cudaError_t err = lane_open ? cudaEventRecord(lane_.done, lane_.stream) : cudaSuccess;
    if (err == cudaSuccess && (lane_open || lane_queued_)) err = cudaStreamWaitEvent(side_.stream, lane_.done, 0);
    lane_queued_ = false;
    if (err == cudaSuccess) err = cudaEventRecord(side_.done, side_.stream);
    cuda_check(err, "closing the communication stream's scope");
  }
  void join_side() override {
    if (in_side_ || !side_queued_) return;
    DeviceScope scope(limits_.device);
    cuda_check(cudaStreamWaitEvent(stream_, side_.done, 0), "cudaStreamWaitEvent (join the communication stream)");
    side_queued_ = false;
  }
  void begin_lane() override {
    if (!in_side_ || in_lane_) fail(FP8_ERR_INTERNAL, "the lane opens once inside the communication stream's scope");
    DeviceScope scope(limits_.device);
    fork(lane_, side_.stream, false, "the communication stream's lane");
    stream_ = lane_.stream;
    in_lane_ = true;
  }
  void end_lane() override {
    if (!in_lane_) return;
    DeviceScope scope(limits_.device);
    cuda_check(cudaEventRecord(lane_.done, lane_.stream), "cudaEventRecord (the lane's work)");
    stream_ = side_.stream;
    in_lane_ = false;
    lane_queued_ = true;
  }
  void join_lane() override {
    if (!in_side_ || in_lane_ || !lane_queued_) return;
    DeviceScope scope(limits_.device);
    cuda_check(cudaStreamWaitEvent(side_.stream, lane_.done, 0), "cudaStreamWaitEvent (join the lane)");
    lane_queued_ = false;
  }
  void synchronize() override {
    DeviceScope scope(limits_.device);
    join_side();
    wait(stream_, "cudaStreamSynchronize");
    cuda_check(cudaGetLastError(), "an earlier asynchronous operation");
  }

  void quantize(const QuantizeJob& job) override {
    require_tensor_scales(job, "CUDA");
    DeviceScope scope(limits_.device);
    if (job.current)  // slot 0 := amax(in), which the cast kernel turns into its scale
      kernels::amax({job.in, job.in_dtype, job.rows * job.cols, scaling_history(job.state), nullptr}, limits_, stream_);
    if (job.out_t_scale_inv.ptr) {
      kernels::cast_transpose(job, limits_, stream_);  // column sums fused in
    } else {
      kernels::quantize(job, limits_, stream_);
      if (job.dbias)
        kernels::bias_grad({job.in, job.in_dtype, job.rows, job.cols, job.dbias, job.dbias_partials}, limits_, stream_);
    }
  }
  void quantize_group(const QuantizeJob* jobs, size_t count) override {
    // The casts it can take together (each a transposed copy under delayed scaling, no column sums,
    // no activation gradient)
    // in one launch per input dtype and format (and per 64 casts), the others alone.
    std::vector<QuantizeJob> together;
    for (size_t i = 0; i < count; ++i) {
      require_tensor_scales(jobs[i], "CUDA");
      if (jobs[i].out_t_scale_inv.ptr && !jobs[i].current && !jobs[i].dbias && !jobs[i].folds_activation())
        together.push_back(jobs[i]);
      else
        quantize(jobs[i]);
    }
    std::stable_sort(together.begin(), together.end(), [](const QuantizeJob& a, const QuantizeJob& b) {
      return std::make_pair(a.in_dtype, a.e5m2) < std::make_pair(b.in_dtype, b.e5m2);
    });
    DeviceScope scope(limits_.device);
    for (size_t first = 0; first < together.size();) {
      size_t end = first + 1;
      while (end < together.size() && together[end].in_dtype == together[first].in_dtype &&
             together[end].e5m2 == together[first].e5m2)
        ++end;
      kernels::cast_transpose_group(together.data() + first, end - first, limits_, stream_);
      first = end;
    }
  }
  void recipe_quantize(const RecipeQuantizeJob& job) override {
    check_recipe_quantize(job);
    DeviceScope scope(limits_.device);
    const size_t ws = recipe_quantize_workspace(job.out_scale_inv.mode, job.rows, job.cols);
    // (An empty operand's cells need no amaxes.)
    if (ws == 0 || job.workspace || job.rows * job.cols == 0) return kernels::recipe_quantize(job, limits_, stream_);
    // A caller without a workspace (fp8_quantize_scaled) gets the context's, grown on demand. A
    // smaller one is kept until the context goes, not freed: work queued before, or a CUDA graph
    // captured with it, may still use it. Growing allocates, which a graph capture cannot.
    if (ws > recipe_workspace_bytes_) {
      if (capture_id() != 0)
        fail(FP8_ERR_INVALID_STATE, "the per-row mode of ", job.rows, " x ", job.cols, " needs ", ws,
             " bytes of the context's workspace, which has ", recipe_workspace_bytes_,
             "; growing it allocates, which a CUDA graph capture cannot: run the call once before capturing");
      void* fresh = native_allocate(ws);
      if (recipe_workspace_) retired_workspaces_.push_back(recipe_workspace_);
      recipe_workspace_ = fresh;
      recipe_workspace_bytes_ = ws;
    }
    RecipeQuantizeJob j = job;
    j.workspace = static_cast<uint32_t*>(recipe_workspace_);
    kernels::recipe_quantize(j, limits_, stream_);
  }
  void bias_grad(const BiasGradJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::bias_grad(job, limits_, stream_);
  }
  void convert(const ConvertJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::convert(job, limits_, stream_);
  }
  void transpose(const TransposeJob& job) override {
    require_tensor_scales(job, "CUDA");
    DeviceScope scope(limits_.device);
    kernels::transpose(job, limits_, stream_);
  }
  void optimizer_norm(const OptimizerStepJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::optimizer_norm(job, stream_);
  }
  void optimizer_update(const OptimizerStepJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::optimizer_update(job, stream_);
  }
  void optimizer_promote(const OptimizerStepJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::optimizer_promote(job, stream_);
  }
  void grad_accumulate(const GradAccumulateJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::grad_accumulate(job, limits_, stream_);
  }
  void grad_exchange(const GradExchangeJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::grad_exchange(job, stream_);
  }
  void gather_peer_scales(const PeerScalesJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::gather_peer_scales(job, stream_);
  }
  void divide(const DivideJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::divide(job, limits_, stream_);
  }
  void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) override {
    if (!width || !height) return;
    DeviceScope scope(limits_.device);
    cuda_check(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpy2DAsync");
  }
  void zero(void* p, size_t bytes) override {
    if (!bytes) return;
    DeviceScope scope(limits_.device);
    cuda_check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    DeviceScope scope(limits_.device);
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
  }
  void dequantize(const DequantizeJob& job) override {
    require_tensor_scales(job, "CUDA");
    DeviceScope scope(limits_.device);
    kernels::dequantize(job, limits_, stream_);
  }
  void amax(const AmaxJob& job) override {
    DeviceScope scope(limits_.device);
    kernels::amax(job, limits_, stream_);
  }
  void scaling_update(const ScalingUpdateJob& job) override {
    DeviceScope scope(limits_.device);
    for (int32_t first = 0; first < job.count; first += kernels::kScalingBatch) {
      ScalingUpdateJob part = job;
      part.items = job.items + first;
      part.count = std::min(job.count - first, kernels::kScalingBatch);
      kernels::scaling_update(part, stream_);
    }
  }
  void activation(const ActivationJob& job) override {
    require_tensor_scales(job, "CUDA");
    DeviceScope scope(limits_.device);
    kernels::activation(job, limits_, stream_);
  }
  void norm(const NormJob& job) override {
    require_tensor_scales(job, "CUDA");
    DeviceScope scope(limits_.device);
    kernels::norm(job, limits_, scratch_, kScratchFloats, stream_);
  }
  bool scaled_gemms() const override { return gemm_->scaled_modes(); }
  std::string describe() const override { return gemm_->describe(); }

  void gemm(const GemmJob& job) override {
    check_gemm_scales(job, "CUDA");
    DeviceScope scope(limits_.device);
    gemm_->run(job, stream_);
  }

 private:
  // Waits until `s` has done its work. With a wait poll (a communicator on this context), by
  // querying instead of blocking in the runtime, so that a collective that never ends (a rank gone)
  // can end the wait: the poll aborts the communicator, whose kernels then return, and throws.
  void wait(cudaStream_t s, const char* what) {
    if (!wait_poll_) {
      cuda_check(cudaStreamSynchronize(s), what);
      return;
    }
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    Clock::time_point next_poll = start + std::chrono::milliseconds(10);
    for (;;) {
      const cudaError_t done = cudaStreamQuery(s);
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) cuda_check(done, what);
      const Clock::time_point now = Clock::now();
      if (now >= next_poll) {
        wait_poll_(std::chrono::duration<double>(now - start).count());
        next_poll = now + std::chrono::milliseconds(10);
      }
      // Spin for the first millisecond (short waits keep their latency), then sleep a little.
      if (now - start < std::chrono::milliseconds(1))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // A copy with pageable host memory waits inside the runtime for the work queued before it: with a
  // wait poll, that work is waited for first, where the poll can end the wait.
  void wait_queued(const char* what) {
    if (wait_poll_) wait(stream_, what);
  }

  kernels::LaunchLimits limits_{};
  cudaStream_t stream_ = nullptr;
  // A stream beside another: made at first use, non-blocking (it never waits for the legacy default
  // stream), of the highest priority (the communication stream: its kernels get SMs while the
  // backward's GEMMs run) or the next one down (the lane: NCCL's kernels get SMs before its pass).
  struct Fork {
    cudaStream_t stream = nullptr;
    cudaEvent_t forked = nullptr, done = nullptr;
  };
  // Makes f if needed and orders it after what `from` has so far.
  static void fork(Fork& f, cudaStream_t from, bool highest, const char* what) {
    if (!f.stream) {
      int least = 0, greatest = 0;
      cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
      Fork made;
      const int priority = highest || greatest == least ? greatest : greatest + 1;  // (greater is lower)
      cuda_check(cudaStreamCreateWithPriority(&made.stream, cudaStreamNonBlocking, priority), what);
      cudaError_t err = cudaEventCreateWithFlags(&made.forked, cudaEventDisableTiming);
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&made.done, cudaEventDisableTiming);
      if (err != cudaSuccess) {
        if (made.forked) cudaEventDestroy(made.forked);
        cudaStreamDestroy(made.stream);
        cuda_check(err, what);
      }
      f = made;
    }
    cuda_check(cudaEventRecord(f.forked, from), "cudaEventRecord (fork)");
    cuda_check(cudaStreamWaitEvent(f.stream, f.forked, 0), "cudaStreamWaitEvent (fork)");
  }
  // The communication stream (begin_side) and its lane (begin_lane); main_ is the stream while the
  // communication stream is in use.
  Fork side_, lane_;
  cudaStream_t main_ = nullptr;
  bool in_side_ = false, side_queued_ = false, in_lane_ = false, lane_queued_ = false;
  std::unique_ptr<CublasLtGemm> gemm_;
  // Scratch for reductions in several passes (the norm backward's partial column sums, which set its
  // size: see kMaxNormBackwardDim): 16 MiB, allocated once so that no call allocates.
  static constexpr size_t kScratchFloats = kNormScratchFloats;
  float* scratch_ = nullptr;
  void* recipe_workspace_ = nullptr;  // recipe_quantize's amaxes for callers without a workspace
  size_t recipe_workspace_bytes_ = 0;
  std::vector<void*> retired_workspaces_;  // smaller ones, kept for work and graphs that used them
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int32_t device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace fp8
