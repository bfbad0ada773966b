// Quantize without transpose: one pass, 16 elements per thread per step (16-byte FP8 stores),
// amax reduced per block and folded into the scaling state with one atomic per block.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

template <fp8_dtype_t DT, bool E5M2>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const typename Wide<DT>::Raw* __restrict__ in,
                                                            uint8_t* __restrict__ out, int64_t n, bool vec,
                                                            ScalingHeader* state, float current_max,
                                                            bool current_pow2, float* out_scale_inv,
                                                            float* out_scale) {
  const float scale = cast_scale(state, current_max, current_pow2);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t amax = 0;
  const int64_t n_vec = vec ? n / 16 : 0;
  for (int64_t v = tid; v < n_vec; v += stride) {
    Vec8<DT> a, b;
    a.load(in + v * 16);
    b.load(in + v * 16 + 8);
    float x[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = a.get(i);
      x[i + 8] = b.get(i);
    }
    uint4 q;
    uint32_t* w = &q.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = max(amax, abs_bits(x[4 * k + i]));
      w[k] = cast4<E5M2>(x[4 * k] * scale, x[4 * k + 1] * scale, x[4 * k + 2] * scale, x[4 * k + 3] * scale);
    }
    reinterpret_cast<uint4*>(out)[v] = q;
  }
  for (int64_t i = n_vec * 16 + tid; i < n; i += stride) {
    const float x = Wide<DT>::to_float(in[i]);
    amax = max(amax, abs_bits(x));
    out[i] = cast1<E5M2>(x * scale);
  }
  if (tid == 0) {
    *out_scale_inv = state->scale_inv;
    if (out_scale) *out_scale = scale;
  }
  block_amax_accumulate(amax, scaling_history(state), nullptr);
}

}  // namespace

void quantize(const QuantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  const int64_t n = j.rows * j.cols;
  const bool vec = aligned16(j.in) && aligned16(j.out);
  dispatch(j.in_dtype, j.e5m2, [&](auto dt, auto e5m2) {
    auto* kernel = quantize_kernel<decltype(dt)::value, decltype(e5m2)::value>;
    const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, (n / 16 + kThreads - 1) / kThreads + 1,
                               lim.sm_count);
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.in), j.out, n,
                                          vec, j.state, j.current ? j.current_fp8_max : 0.0f, j.current_pow2,
                                          j.out_scale_inv.ptr, j.out_scale.ptr);
  });
  cuda_check(cudaGetLastError(), "quantize kernel launch");
}

}  // namespace fp8::kernels
