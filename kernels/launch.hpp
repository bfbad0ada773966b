// Host-side entry points of the CUDA kernels, called by src/backend/cuda_backend.cpp. Each one only
// queues work on `stream`; launch errors come back as FP8_ERR_CUDA through cuda_check.
#pragma once

#include <cuda_runtime_api.h>

#include "backend/jobs.hpp"

namespace fp8::kernels {

// What the launchers need to know about the device to size their grids.
struct LaunchLimits {
  int device;
  int sm_count;
};

// Largest batch one scaling-update launch takes (kernel parameters carry the pointers).
constexpr int kScalingBatch = 1024;

void quantize(const QuantizeJob& job, const LaunchLimits& lim, cudaStream_t stream);        // no transpose
void cast_transpose(const QuantizeJob& job, const LaunchLimits& lim, cudaStream_t stream);  // job.out_t set
// Several casts with transposed copies, one launch per 64 (delayed scaling, one input dtype and
// format, no column sums: the CUDA backend's quantize_group sorted them so).
void cast_transpose_group(const QuantizeJob* jobs, size_t count, const LaunchLimits& lim, cudaStream_t stream);
// Fused amax + quantize under a recipe's scale grid (job checked by check_recipe_quantize).
void recipe_quantize(const RecipeQuantizeJob& job, const LaunchLimits& lim, cudaStream_t stream);
void dequantize(const DequantizeJob& job, const LaunchLimits& lim, cudaStream_t stream);
void amax(const AmaxJob& job, const LaunchLimits& lim, cudaStream_t stream);
// job.count <= kScalingBatch
void scaling_update(const ScalingUpdateJob& job, cudaStream_t stream);

void activation(const ActivationJob& job, const LaunchLimits& lim, cudaStream_t stream);
// `scratch` holds at least 2 * job.cols floats (the backward's partial column sums).
void norm(const NormJob& job, const LaunchLimits& lim, float* scratch, size_t scratch_floats, cudaStream_t stream);

// dbias += column sums of job.dy (two stages through job.partials).
void bias_grad(const BiasGradJob& job, const LaunchLimits& lim, cudaStream_t stream);
// Stage 2 alone, for partials written by the fused dy cast (cast_transpose with job.dbias).
void bias_grad_finish(const float* partials, int64_t rows, int64_t cols, float* dbias, const LaunchLimits& lim,
                      cudaStream_t stream);
void convert(const ConvertJob& job, const LaunchLimits& lim, cudaStream_t stream);
void transpose(const TransposeJob& job, const LaunchLimits& lim, cudaStream_t stream);
void optimizer_norm(const OptimizerStepJob& job, cudaStream_t stream);
void optimizer_update(const OptimizerStepJob& job, cudaStream_t stream);
void optimizer_promote(const OptimizerStepJob& job, cudaStream_t stream);
void grad_accumulate(const GradAccumulateJob& job, const LaunchLimits& lim, cudaStream_t stream);
// The FP8 gradient exchange's local pass (kernels/dist/exchange.cu) and the FP32 gradients' mean.
void grad_exchange(const GradExchangeJob& job, cudaStream_t stream);
void gather_peer_scales(const PeerScalesJob& job, cudaStream_t stream);
// The peer exchange's barrier (dist::PeerWindows::barrier), one block on `stream`: with epoch =
// *epochs + 1, this rank writes epoch into slot `rank` of every rank's signals (signals: a device
// table of nranks pointers to nranks uint32 slots each), waits until every slot of its own holds
// epoch or later, and stores epoch in *epochs. *abort (mapped host memory) set ends the wait and
// sets *poisoned, after which no barrier signals (PeerWindows::poisoned). Work before it on the
// stream is visible to every rank's work after their own barrier.
void peer_barrier(uint32_t* const* signals, int32_t rank, int32_t nranks, uint32_t* epochs, uint32_t* poisoned,
                  const volatile uint32_t* abort, cudaStream_t stream);
void divide(const DivideJob& job, const LaunchLimits& lim, cudaStream_t stream);

// Folds the amax cuBLASLt wrote for an FP8 GEMM output into `state` and sets D's scale_inv.
void gemm_fp8_output_epilogue(const float* gemm_amax, ScalingHeader* state, float* d_scale_inv, cudaStream_t stream);

// Throws fp8::Error(FP8_ERR_CUDA or FP8_ERR_OUT_OF_MEMORY) naming `what` unless err is cudaSuccess.
void cuda_check(cudaError_t err, const char* what);

}  // namespace fp8::kernels
