// The optimizer step on the GPU in three launches and no host round trip:
//   1. one block per chunk sums its g^2 in double in core/optim_rule.hpp's order -> partials;
//   2. one block sums the partials in the same order and runs finish_step (skip, clip, bias
//      corrections) into the device-resident scalars;
//   3. one block per chunk updates its elements unless the scalars say skip.
// Every step follows the CPU reference (src/backend/cpu_optimizer.cpp) bit for bit.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

static_assert(kOptimChunk == 16 * kSumThreads, "each thread of a chunk block takes 16 elements");

// Lane t holds its running sum; the block combines lanes as ordered_sum does.
__device__ double block_ordered_sum(double acc, double* s) {
  const int t = threadIdx.x;
  s[t] = acc;
  __syncthreads();
  for (int h = kSumThreads / 2; h > 0; h /= 2) {
    if (t < h) s[t] += s[t + h];
    __syncthreads();
  }
  return s[0];
}

__global__ void __launch_bounds__(kSumThreads)
    chunk_sumsq_kernel(const OptimTensor* tensors, const OptimChunk* chunks, double* partials) {
  __shared__ double s[kSumThreads];
  const OptimChunk ch = chunks[blockIdx.x];
  const float* g = tensors[ch.tensor].grad + ch.offset;
  double acc = 0.0;
  for (int i = threadIdx.x; i < ch.len; i += kSumThreads) {
    const double v = g[i];
    acc = __dadd_rn(acc, __dmul_rn(v, v));
  }
  const double total = block_ordered_sum(acc, s);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kSumThreads)
    finish_kernel(const double* partials, int64_t count, OptimScalars* scalars, OptimHyper hyper) {
  __shared__ double s[kSumThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kSumThreads) acc = __dadd_rn(acc, partials[i]);
  const double total = block_ordered_sum(acc, s);
  if (threadIdx.x == 0) finish_step(*scalars, total, hyper);
}

__global__ void __launch_bounds__(kSumThreads)
    update_kernel(const OptimTensor* tensors, const OptimChunk* chunks, const OptimScalars* scalars,
                  OptimElementArgs a) {
  const OptimScalars s = *scalars;
  if (s.skip) return;
  const OptimChunk ch = chunks[blockIdx.x];
  const OptimTensor t = tensors[ch.tensor];
  const bool momentum = a.momentum > 0.0f;
  for (int64_t i = ch.offset + threadIdx.x; i < ch.offset + ch.len; i += kSumThreads) {
    float p = t.param[i];
    if (a.kind == FP8_OPTIMIZER_SGD) {
      sgd_update(p, t.grad[i], momentum ? t.m + i : nullptr, a, s);
    } else {
      float m = t.m[i], v = t.v[i];
      adam_update(p, t.grad[i], m, v, a, s);
      t.m[i] = m;
      t.v[i] = v;
    }
    t.param[i] = p;
  }
}

}  // namespace

void optimizer_step(const OptimizerStepJob& job, cudaStream_t stream) {
  if (job.chunk_count <= 0) return;
  const unsigned blocks = static_cast<unsigned>(job.chunk_count);
  chunk_sumsq_kernel<<<blocks, kSumThreads, 0, stream>>>(job.tensors, job.chunks, job.partials);
  cuda_check(cudaGetLastError(), "optimizer norm kernel launch");
  finish_kernel<<<1, kSumThreads, 0, stream>>>(job.partials, job.chunk_count, job.scalars, job.hyper);
  cuda_check(cudaGetLastError(), "optimizer finish kernel launch");
  update_kernel<<<blocks, kSumThreads, 0, stream>>>(job.tensors, job.chunks, job.scalars, element_args(job.hyper));
  cuda_check(cudaGetLastError(), "optimizer update kernel launch");
}

}  // namespace fp8::kernels
