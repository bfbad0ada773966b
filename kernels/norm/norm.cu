// LayerNorm / RMSNorm. Forward and the dx half of the backward give each block one row at a time
// (two-pass statistics in float, block sums in a fixed order). dgamma and dbeta are column sums
// over rows: a first kernel sums rows rc, rc+R, rc+2R, ... for each column into the context's
// scratch (R partial rows), a second adds the R partials in order: deterministic, no atomics.
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

template <fp8_dtype_t DT, fp8_dtype_t OUT>
__global__ void __launch_bounds__(kThreads)
    norm_forward_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x, int64_t rows, int64_t d,
                        const float* __restrict__ gamma, const float* __restrict__ beta, float eps, void* __restrict__ y,
                        ScalingHeader* state, float* y_scale_inv, float* mean_out, float* rstd_out) {
  __shared__ float scratch[32];
  const float scale = state ? state->scale : 1.0f;
  uint32_t amax = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const typename Wide<DT>::Raw* row = x + r * d;
    float s = 0.0f;
    if (!rms)
      for (int64_t c = threadIdx.x; c < d; c += kThreads) s += Wide<DT>::to_float(row[c]);
    const float mean = rms ? 0.0f : block_sum(s, scratch) / static_cast<float>(d);
    float sq = 0.0f;
    for (int64_t c = threadIdx.x; c < d; c += kThreads) {
      const float v = Wide<DT>::to_float(row[c]) - mean;
      sq += v * v;
    }
    const float rstd = 1.0f / sqrtf(block_sum(sq, scratch) / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) {
      if (mean_out) mean_out[r] = mean;
      if (rstd_out) rstd_out[r] = rstd;
    }
    for (int64_t c = threadIdx.x; c < d; c += kThreads) {
      const float v = (Wide<DT>::to_float(row[c]) - mean) * rstd * gamma[c] + (beta ? beta[c] : 0.0f);
      store_output<OUT>(y, r * d + c, v, scale, amax);
    }
  }
  if (state) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *y_scale_inv = state->scale_inv;
    block_amax_accumulate(amax, scaling_history(state), nullptr);
  }
}

template <fp8_dtype_t DT, fp8_dtype_t DY, fp8_dtype_t DX>
__global__ void __launch_bounds__(kThreads)
    norm_backward_dx_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x,
                            const typename Wide<DY>::Raw* __restrict__ dy, int64_t rows, int64_t d,
                            const float* __restrict__ gamma, const float* __restrict__ mean_in,
                            const float* __restrict__ rstd_in, bool accumulate,
                            typename Wide<DX>::Raw* __restrict__ dx) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float mean = rms ? 0.0f : mean_in[r], rstd = rstd_in[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t c = threadIdx.x; c < d; c += kThreads) {
      const float xhat = (Wide<DT>::to_float(x[r * d + c]) - mean) * rstd;
      const float g = Wide<DY>::to_float(dy[r * d + c]) * gamma[c];
      sg += g;
      sgx += g * xhat;
    }
    const float mean_g = rms ? 0.0f : block_sum(sg, scratch) / static_cast<float>(d);
    const float mean_gx = block_sum(sgx, scratch) / static_cast<float>(d);
    for (int64_t c = threadIdx.x; c < d; c += kThreads) {
      const float xhat = (Wide<DT>::to_float(x[r * d + c]) - mean) * rstd;
      const float g = Wide<DY>::to_float(dy[r * d + c]) * gamma[c];
      const float v = rstd * (g - mean_g - xhat * mean_gx);
      // (__fadd_rn: one rounding of the sum, as on the CPU; a contraction into an FMA would differ)
      dx[r * d + c] = Wide<DX>::from_float(accumulate ? __fadd_rn(Wide<DX>::to_float(dx[r * d + c]), v) : v);
    }
  }
}

// partial[rc][c] = sum over rows r = rc (mod R) of dy * xhat (and of dy, after R*d floats).
template <fp8_dtype_t DT, fp8_dtype_t DY>
__global__ void __launch_bounds__(kThreads)
    norm_backward_partial_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x,
                                 const typename Wide<DY>::Raw* __restrict__ dy, int64_t rows, int64_t d,
                                 const float* __restrict__ mean_in, const float* __restrict__ rstd_in, int R,
                                 float* __restrict__ partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int rc = blockIdx.y;
  if (c >= d) return;
  float sg = 0.0f, sb = 0.0f;
  for (int64_t r = rc; r < rows; r += R) {
    const float mean = rms ? 0.0f : mean_in[r];
    const float g = Wide<DY>::to_float(dy[r * d + c]);
    sg += g * (Wide<DT>::to_float(x[r * d + c]) - mean) * rstd_in[r];
    sb += g;
  }
  partial[static_cast<int64_t>(rc) * d + c] = sg;
  partial[static_cast<int64_t>(R) * d + static_cast<int64_t>(rc) * d + c] = sb;
}

__global__ void __launch_bounds__(kThreads) norm_backward_reduce_kernel(const float* __restrict__ partial, int64_t d,
                                                                        int R, float* dgamma, float* dbeta,
                                                                        bool accumulate) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= d) return;
  float g = 0.0f, b = 0.0f;
  for (int rc = 0; rc < R; ++rc) {
    g += partial[static_cast<int64_t>(rc) * d + c];
    b += partial[static_cast<int64_t>(R) * d + static_cast<int64_t>(rc) * d + c];
  }
  dgamma[c] = accumulate ? dgamma[c] + g : g;
  if (dbeta) dbeta[c] = accumulate ? dbeta[c] + b : b;
}

}  // namespace

void norm(const NormJob& j, const LaunchLimits& lim, float* scratch, size_t scratch_floats, cudaStream_t stream) {
  if (!j.backward) {
    dispatch_wide(j.x_dtype, [&](auto dt) {
      auto go = [&](auto out) {
        using Raw = typename Wide<decltype(dt)::value>::Raw;
        auto* kernel = norm_forward_kernel<decltype(dt)::value, decltype(out)::value>;
        const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, j.rows, lim.sm_count);
        kernel<<<grid, kThreads, 0, stream>>>(j.rms, static_cast<const Raw*>(j.x), j.rows, j.cols, j.gamma, j.beta,
                                              j.eps, j.y, j.y_state, j.y_scale_inv.ptr, j.mean, j.rstd);
      };
      dispatch_any(j.y_dtype, go);
    });
    cuda_check(cudaGetLastError(), "norm forward kernel launch");
    return;
  }
  dispatch_wide(j.x_dtype, [&](auto dt) {
    dispatch_wide(j.dy_dtype, [&](auto dyt) {
      using RawX = typename Wide<decltype(dt)::value>::Raw;
      using RawDy = typename Wide<decltype(dyt)::value>::Raw;
      dispatch_wide(j.dx_dtype, [&](auto dxt) {
        auto* kernel = norm_backward_dx_kernel<decltype(dt)::value, decltype(dyt)::value, decltype(dxt)::value>;
        const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, j.rows, lim.sm_count);
        kernel<<<grid, kThreads, 0, stream>>>(j.rms, static_cast<const RawX*>(j.x), static_cast<const RawDy*>(j.dy),
                                              j.rows, j.cols, j.gamma, j.mean, j.rstd, j.accumulate_dx,
                                              static_cast<typename Wide<decltype(dxt)::value>::Raw*>(j.dx));
      });
      // R partial rows of dgamma and dbeta fit the scratch; more rows per partial when they do not.
      const int64_t fit = static_cast<int64_t>(scratch_floats) / (2 * j.cols);
      const int R = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(fit, j.rows), 256)));
      const dim3 grid(static_cast<unsigned>((j.cols + kThreads - 1) / kThreads), static_cast<unsigned>(R));
      norm_backward_partial_kernel<decltype(dt)::value, decltype(dyt)::value><<<grid, kThreads, 0, stream>>>(
          j.rms, static_cast<const RawX*>(j.x), static_cast<const RawDy*>(j.dy), j.rows, j.cols, j.mean, j.rstd, R, scratch);
      norm_backward_reduce_kernel<<<grid.x, kThreads, 0, stream>>>(scratch, j.cols, R, j.dgamma, j.dbeta,
                                                                   j.accumulate_params);
    });
  });
  cuda_check(cudaGetLastError(), "norm backward kernel launch");
}

}  // namespace fp8::kernels
