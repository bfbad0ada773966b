// Activations forward and backward in a grid-stride loop, with the formulas of
// core/activation.hpp: 8 elements per thread through 16-byte loads and stores where the tensors
// allow (ReLU, GELU), element by element otherwise (SwiGLU's two halves, odd sizes). An FP8 output is cast with the hardware
// instruction and its amax reduced per block into the scaling state.
#include "core/activation.hpp"
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

constexpr bool is_fp8(fp8_dtype_t t) {
  return t == FP8_DTYPE_E4M3 || t == FP8_DTYPE_E5M2;
}

// A residual's sum: v + base[i], base of the wide output's dtype (out itself to accumulate; never
// set for FP8).
template <fp8_dtype_t OUT>
__device__ __forceinline__ float plus_base(const void* base, int64_t i, float v) {
  if constexpr (is_fp8(OUT))
    return v;
  else
    return __fadd_rn(v, Wide<OUT>::to_float(static_cast<const typename Wide<OUT>::Raw*>(base)[i]));  // no FMA
}

template <fp8_dtype_t DT, fp8_dtype_t OUT>
__global__ void __launch_bounds__(kThreads)
    activation_kernel(fp8_activation_t act, bool backward, const void* base,
                      const typename Wide<DT>::Raw* __restrict__ x, const typename Wide<DT>::Raw* __restrict__ dy,
                      int64_t rows, int64_t cols, bool vec, void* out, ScalingHeader* state, float* out_scale_inv) {
  const float scale = state ? state->scale : 1.0f;
  uint32_t amax = 0;
  const bool glu = act == FP8_ACTIVATION_SWIGLU;
  const int64_t half = cols / 2, items = rows * (glu ? half : cols);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vec_items = vec ? items / 8 * 8 : 0;
  for (int64_t i8 = first; i8 * 8 < vec_items; i8 += stride) {
    Vec8<DT> xv, gv;
    xv.load(x + i8 * 8);
    if (backward) gv.load(dy + i8 * 8);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float a = xv.get(k);
      if (!backward) v[k] = act == FP8_ACTIVATION_RELU ? relu(a) : gelu(a);
      else v[k] = act == FP8_ACTIVATION_RELU ? relu_grad(a, gv.get(k)) : gelu_grad(a, gv.get(k));
    }
    if constexpr (!is_fp8(OUT)) {
      if (base) {
        Vec8<OUT> old;
        old.load(static_cast<const typename Wide<OUT>::Raw*>(base) + i8 * 8);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __fadd_rn(v[k], old.get(k));  // one rounding, as on the CPU
      }
    }
    store8<OUT>(out, i8 * 8, v, scale, amax);
  }
  for (int64_t i = vec_items + first; i < items; i += stride) {
    if (glu) {
      const int64_t r = i / half, c = i % half;
      const float a = Wide<DT>::to_float(x[r * cols + c]), b = Wide<DT>::to_float(x[r * cols + half + c]);
      if (!backward) {
        store_output<OUT>(out, i, swiglu(a, b), scale, amax);
      } else {
        const float g = Wide<DT>::to_float(dy[i]);
        const int64_t ia = r * cols + c, ib = r * cols + half + c;
        const float da = swiglu_grad_a(a, b, g), db = swiglu_grad_b(a, g);
        store_output<OUT>(out, ia, base ? plus_base<OUT>(base, ia, da) : da, scale, amax);
        store_output<OUT>(out, ib, base ? plus_base<OUT>(base, ib, db) : db, scale, amax);
      }
    } else {
      const float v = Wide<DT>::to_float(x[i]);
      float y;
      if (!backward) y = act == FP8_ACTIVATION_RELU ? relu(v) : gelu(v);
      else y = act == FP8_ACTIVATION_RELU ? relu_grad(v, Wide<DT>::to_float(dy[i])) : gelu_grad(v, Wide<DT>::to_float(dy[i]));
      store_output<OUT>(out, i, base ? plus_base<OUT>(base, i, y) : y, scale, amax);
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
    const bool vec = j.act != FP8_ACTIVATION_SWIGLU && aligned16(j.x) && aligned16(j.out) &&
                     (!j.backward || aligned16(j.dy)) && (!j.base || aligned16(j.base));
    kernel<<<grid, kThreads, 0, stream>>>(j.act, j.backward, j.base, static_cast<const Raw*>(j.x),
                                          static_cast<const Raw*>(j.dy), j.rows, j.cols, vec, j.out, j.out_state,
                                          j.out_scale_inv.ptr);
  };
  dispatch_any(j.out_dtype, go);
}

}  // namespace

void activation(const ActivationJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  dispatch_wide(j.x_dtype, [&](auto dt) { launch_for_output<decltype(dt)::value>(j, lim, stream); });
  cuda_check(cudaGetLastError(), "activation kernel launch");
}

}  // namespace fp8::kernels
