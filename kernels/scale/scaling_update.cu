// Batched delayed-scaling update: one block per state, all states of a batch in one launch (their
// pointers travel as kernel parameters, so nothing is copied from the host and the launch can be
// captured in a CUDA graph). The rule is core/scaling_rule.hpp's, as on the CPU.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

struct ScalingBatch {
  ScalingHeader* state[kScalingBatch];
  float fp8_max_scaled[kScalingBatch];
};

__global__ void __launch_bounds__(kThreads) scaling_update_kernel(const __grid_constant__ ScalingBatch batch,
                                                                  int32_t history_len, int64_t interval, bool algo_max,
                                                                  bool pow2_scales) {
  __shared__ uint32_t warp_max[kThreads / 32];
  ScalingHeader* h = batch.state[blockIdx.x];
  float* hist = scaling_history(h);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // 1. A non-finite amax is counted and never enters the history.
  if (tid == 0 && !is_finite_bits(abs_bits(hist[0]))) {
    ++h->nonfinite_count;
    hist[0] = 0.0f;
  }
  __syncthreads();

  // 2. a = max(history) or the most recent amax (all values are finite and >= 0 here).
  uint32_t a = 0;
  if (algo_max) {
    for (int k = tid; k < history_len; k += kThreads) a = max(a, float_bits(hist[k]));
    a = __reduce_max_sync(0xFFFFFFFFu, a);
    if (lane == 0) warp_max[warp] = a;
    __syncthreads();
    a = 0;
    for (int w = 0; w < kThreads / 32; ++w) a = max(a, warp_max[w]);
  } else {
    a = float_bits(hist[0]);
  }

  // 3. The new scale on recompute steps.
  if (tid == 0) {
    if (scaling_recomputes(h->update_count, interval)) {
      h->scale = next_scale(bits_float(a), batch.fp8_max_scaled[blockIdx.x], h->scale, pow2_scales);
      h->scale_inv = 1.0f / h->scale;
    }
    ++h->update_count;
  }
  __syncthreads();

  // 4. Roll by one slot, chunk by chunk from the end, each chunk read before it is written.
  for (int base = ((history_len - 1) / kThreads) * kThreads; base >= 0; base -= kThreads) {
    const int k = base + tid;
    const float v = k < history_len - 1 ? hist[k] : 0.0f;
    __syncthreads();
    if (k < history_len - 1) hist[k + 1] = v;
    __syncthreads();
  }
  if (tid == 0) hist[0] = 0.0f;
}

}  // namespace

void scaling_update(const ScalingUpdateJob& j, cudaStream_t stream) {
  if (j.count == 0) return;
  ScalingBatch batch;
  for (int32_t i = 0; i < j.count; ++i) {
    batch.state[i] = j.items[i].state;
    batch.fp8_max_scaled[i] = j.items[i].fp8_max_scaled;
  }
  scaling_update_kernel<<<j.count, kThreads, 0, stream>>>(batch, j.history_len, j.interval, j.algo_max,
                                                          j.pow2_scales);
  cuda_check(cudaGetLastError(), "scaling_update kernel launch");
}

}  // namespace fp8::kernels
