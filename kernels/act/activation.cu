// Activations forward and backward, element by element in a grid-stride loop (coalesced scalar
// accesses), with the formulas of core/activation.hpp. An FP8 output is cast with the hardware
// instruction and its amax reduced per block into the scaling state.
#include "core/activation.hpp"
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

template <fp8_dtype_t DT, fp8_dtype_t OUT>
__global__ void __launch_bounds__(kThreads) activation_kernel(fp8_activation_t act, bool backward,
                                                              const typename Wide<DT>::Raw* __restrict__ x,
                                                              const typename Wide<DT>::Raw* __restrict__ dy,
                                                              int64_t rows, int64_t cols, void* __restrict__ out,
                                                              ScalingHeader* state, float* out_scale_inv) {
  const float scale = state ? state->scale : 1.0f;
  uint32_t amax = 0;
  const bool glu = act == FP8_ACTIVATION_SWIGLU;
  const int64_t half = cols / 2, items = rows * (glu ? half : cols);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    if (glu) {
      const int64_t r = i / half, c = i % half;
      const float a = Wide<DT>::to_float(x[r * cols + c]), b = Wide<DT>::to_float(x[r * cols + half + c]);
      if (!backward) {
        store_output<OUT>(out, i, swiglu(a, b), scale, amax);
      } else {
        const float g = Wide<DT>::to_float(dy[i]);
        store_output<OUT>(out, r * cols + c, swiglu_grad_a(a, b, g), scale, amax);
        store_output<OUT>(out, r * cols + half + c, swiglu_grad_b(a, g), scale, amax);
      }
    } else {
      const float v = Wide<DT>::to_float(x[i]);
      float y;
      if (!backward) y = act == FP8_ACTIVATION_RELU ? relu(v) : gelu(v);
      else y = act == FP8_ACTIVATION_RELU ? relu_grad(v, Wide<DT>::to_float(dy[i])) : gelu_grad(v, Wide<DT>::to_float(dy[i]));
      store_output<OUT>(out, i, y, scale, amax);
    }
  }
  if (state) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *out_scale_inv = state->scale_inv;
    block_amax_accumulate(amax, scaling_history(state), nullptr);
  }
}

template <fp8_dtype_t DT>
void launch_for_output(const ActivationJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  auto go = [&](auto out_dt) {
    auto* kernel = activation_kernel<DT, decltype(out_dt)::value>;
    const int64_t items = j.rows * (j.act == FP8_ACTIVATION_SWIGLU ? j.cols / 2 : j.cols);
    const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, (items + kThreads - 1) / kThreads, lim.sm_count);
    using Raw = typename Wide<DT>::Raw;
    kernel<<<grid, kThreads, 0, stream>>>(j.act, j.backward, static_cast<const Raw*>(j.x), static_cast<const Raw*>(j.dy),
                                          j.rows, j.cols, j.out, j.out_state, j.out_scale_inv);
  };
  dispatch_any(j.out_dtype, go);
}

}  // namespace

void activation(const ActivationJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  dispatch_wide(j.x_dtype, [&](auto dt) { launch_for_output<decltype(dt)::value>(j, lim, stream); });
  cuda_check(cudaGetLastError(), "activation kernel launch");
}

}  // namespace fp8::kernels
