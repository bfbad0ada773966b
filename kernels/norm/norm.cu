// LayerNorm / RMSNorm. Forward and backward give each block one row at a time (two-pass statistics
// in float, block sums in a fixed order). dgamma and dbeta are column sums over rows. Up to
// kFusedMaxCols columns, the backward reads x and dy once for dx and the column sums: each thread
// keeps its columns' sums in registers over its block's rows (r = b, b + G, ...), each block writes
// one partial row of each into the context's scratch, and a second kernel adds the G partials in a
// fixed order. Wider rows take two kernels: dx, then the partial sums over rows rc, rc + R, ... (R
// partial rows). G and R depend on the shape alone: deterministic on every device, no atomics.
// Rows of a multiple of 8 columns with 16-byte aligned buffers take the vector kernels (thread t
// holds the 8-column groups t, t + 256, ..., loaded and stored 16 bytes at a time; the forward
// holds the row in registers up to kVecMaxCols and loads the block's next row while it reduces this
// one); the others the element kernels (thread t: columns t, t + 256, ...).
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;
// Columns per thread a kernel keeps in registers: a row's values up to kHoldPerThread, the fused
// backward's column sums up to kFusedPerThread.
constexpr int kHoldPerThread = 8, kFusedPerThread = 32;
constexpr int64_t kFusedMaxCols = int64_t{kThreads} * kFusedPerThread;
constexpr int64_t kFusedPartials = 512;  // the fused backward's blocks, at most
// The vector kernels: 8-column groups per thread, at most kVecGroups (a row of up to kVecMaxCols).
constexpr int kVecGroups = 4;
constexpr int64_t kVecMaxCols = int64_t{kThreads} * 8 * kVecGroups;

// Eight consecutive floats of a 16-byte aligned array (gamma, beta).
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The forward with the row in registers, NV groups of 8 columns per thread (d <= NV * 8 * kThreads).
// The block's next row is loaded before this one's reductions, so its loads are in flight meanwhile.
template <fp8_dtype_t DT, fp8_dtype_t OUT, int NV>
__global__ void __launch_bounds__(kThreads)
    norm_forward_vec_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x, int64_t rows, int64_t d,
                            const float* __restrict__ gamma, const float* __restrict__ beta, float eps,
                            void* __restrict__ y, ScalingHeader* state, float* y_scale_inv, float* mean_out,
                            float* rstd_out) {
  __shared__ float scratch[32];
  const float scale = state ? state->scale : 1.0f;
  const int t = threadIdx.x;
  uint32_t amax = 0;
  Vec8<DT> next[NV];
  const auto issue = [&](int64_t r) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + t) * 8;
      if (c < d) next[k].load(x + r * d + c);
    }
  };
  if (blockIdx.x < rows) issue(blockIdx.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float v[NV][8];
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int i = 0; i < 8; ++i) v[k][i] = next[k].get(i);
    if (r + gridDim.x < rows) issue(r + gridDim.x);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if ((static_cast<int64_t>(k) * kThreads + t) * 8 < d)
#pragma unroll
        for (int i = 0; i < 8; ++i) s += v[k][i];
    const float mean = rms ? 0.0f : block_sum(s, scratch) / static_cast<float>(d);
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if ((static_cast<int64_t>(k) * kThreads + t) * 8 < d)
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += (v[k][i] - mean) * (v[k][i] - mean);
    const float rstd = 1.0f / sqrtf(block_sum(sq, scratch) / static_cast<float>(d) + eps);
    if (t == 0) {
      if (mean_out) mean_out[r] = mean;
      if (rstd_out) rstd_out[r] = rstd;
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + t) * 8;
      if (c >= d) continue;
      float g[8], b[8] = {};
      load8(gamma + c, g);
      if (beta) load8(beta + c, b);
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = (v[k][i] - mean) * rstd * g[i] + b[i];
      store8<OUT>(y, r * d + c, o, scale, amax);
    }
  }
  if (state) {
    if (blockIdx.x == 0 && t == 0) *y_scale_inv = state->scale_inv;
    block_amax_accumulate(amax, scaling_history(state), nullptr);
  }
}

// PT > 0: each thread holds its PT columns (t + j * kThreads) of the row in registers, so x is read
// once (d <= PT * kThreads); PT = 0: any d, the row read three times (RMSNorm: twice).
template <fp8_dtype_t DT, fp8_dtype_t OUT, int PT>
__global__ void __launch_bounds__(kThreads)
    norm_forward_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x, int64_t rows, int64_t d,
                        const float* __restrict__ gamma, const float* __restrict__ beta, float eps,
                        void* __restrict__ y, ScalingHeader* state, float* y_scale_inv, float* mean_out,
                        float* rstd_out) {
  constexpr int kHeld = PT > 0 ? PT : 1;
  __shared__ float scratch[32];
  const float scale = state ? state->scale : 1.0f;
  const int t = threadIdx.x;
  uint32_t amax = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const typename Wide<DT>::Raw* row = x + r * d;
    float v[kHeld];
    float s = 0.0f;
    if constexpr (PT > 0) {
#pragma unroll
      for (int j = 0; j < PT; ++j) {
        const int64_t c = t + j * kThreads;
        v[j] = c < d ? Wide<DT>::to_float(row[c]) : 0.0f;
        s += v[j];
      }
    } else if (!rms) {
      for (int64_t c = t; c < d; c += kThreads) s += Wide<DT>::to_float(row[c]);
    }
    const float mean = rms ? 0.0f : block_sum(s, scratch) / static_cast<float>(d);
    float sq = 0.0f;
    if constexpr (PT > 0) {
#pragma unroll
      for (int j = 0; j < PT; ++j) {
        const float u = v[j] - mean;
        if (t + j * kThreads < d) sq += u * u;
      }
    } else {
      for (int64_t c = t; c < d; c += kThreads) {
        const float u = Wide<DT>::to_float(row[c]) - mean;
        sq += u * u;
      }
    }
    const float rstd = 1.0f / sqrtf(block_sum(sq, scratch) / static_cast<float>(d) + eps);
    if (t == 0) {
      if (mean_out) mean_out[r] = mean;
      if (rstd_out) rstd_out[r] = rstd;
    }
    if constexpr (PT > 0) {
#pragma unroll
      for (int j = 0; j < PT; ++j) {
        const int64_t c = t + j * kThreads;
        if (c < d)
          store_output<OUT>(y, r * d + c, (v[j] - mean) * rstd * gamma[c] + (beta ? beta[c] : 0.0f), scale, amax);
      }
    } else {
      for (int64_t c = t; c < d; c += kThreads) {
        const float u = (Wide<DT>::to_float(row[c]) - mean) * rstd * gamma[c] + (beta ? beta[c] : 0.0f);
        store_output<OUT>(y, r * d + c, u, scale, amax);
      }
    }
  }
  if (state) {
    if (blockIdx.x == 0 && t == 0) *y_scale_inv = state->scale_inv;
    block_amax_accumulate(amax, scaling_history(state), nullptr);
  }
}

// dx[i] = (base[i] +) rstd * (g - mean(g) - xhat * mean(g xhat)), g = dy * gamma; base is nullptr,
// dx itself (accumulate) or a residual's gradient (so dx is not marked __restrict__).
template <fp8_dtype_t DX>
__device__ __forceinline__ void put_dx(typename Wide<DX>::Raw* dx, const typename Wide<DX>::Raw* base, int64_t i,
                                       float rstd, float g, float xhat, float mean_g, float mean_gx) {
  const float v = rstd * (g - mean_g - xhat * mean_gx);
  // (__fadd_rn: one rounding of the sum, as on the CPU; a contraction into an FMA would differ)
  dx[i] = Wide<DX>::from_float(base ? __fadd_rn(Wide<DX>::to_float(base[i]), v) : v);
}

template <fp8_dtype_t DT, fp8_dtype_t DY, fp8_dtype_t DX>
__global__ void __launch_bounds__(kThreads)
    norm_backward_dx_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x,
                            const typename Wide<DY>::Raw* __restrict__ dy, int64_t rows, int64_t d,
                            const float* __restrict__ gamma, const float* __restrict__ mean_in,
                            const float* __restrict__ rstd_in, const typename Wide<DX>::Raw* base,
                            typename Wide<DX>::Raw* dx) {
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
      put_dx<DX>(dx, base, r * d + c, rstd, g, xhat, mean_g, mean_gx);
    }
  }
}

// The fused backward: dx as norm_backward_dx_kernel, and the block's partial row of dgamma (in
// partial[blockIdx.x]) and of dbeta (in partial[gridDim.x + blockIdx.x]). Thread t holds columns
// t + j * kThreads, j < PT (unrolled, so the sums stay in registers); up to kHoldPerThread columns
// per thread it also keeps the row's values between the two halves, wider rows read them again.
template <fp8_dtype_t DT, fp8_dtype_t DY, fp8_dtype_t DX, int PT>
__global__ void __launch_bounds__(kThreads, PT <= kHoldPerThread ? 4 : 2)
    norm_backward_fused_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x,
                               const typename Wide<DY>::Raw* __restrict__ dy, int64_t rows, int64_t d,
                               const float* __restrict__ gamma, const float* __restrict__ mean_in,
                               const float* __restrict__ rstd_in, const typename Wide<DX>::Raw* base,
                               typename Wide<DX>::Raw* dx, float* __restrict__ partial) {
  constexpr bool kHold = PT <= kHoldPerThread;
  constexpr int kHeld = kHold ? PT : 1;
  __shared__ float scratch[32];
  const int t = threadIdx.x;
  float dg[PT], db[PT];
#pragma unroll
  for (int j = 0; j < PT; ++j) dg[j] = db[j] = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float mean = rms ? 0.0f : mean_in[r], rstd = rstd_in[r];
    const typename Wide<DT>::Raw* xr = x + r * d;
    const typename Wide<DY>::Raw* dyr = dy + r * d;
    float xh[kHeld], g[kHeld];
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int j = 0; j < PT; ++j) {
      const int64_t c = t + j * kThreads;
      if (c < d) {
        const float dyv = Wide<DY>::to_float(dyr[c]);
        const float xhat = (Wide<DT>::to_float(xr[c]) - mean) * rstd;
        const float gv = dyv * gamma[c];
        sg += gv;
        sgx += gv * xhat;
        dg[j] += dyv * xhat;
        db[j] += dyv;
        if constexpr (kHold) xh[j] = xhat, g[j] = gv;
      }
    }
    const float mean_g = rms ? 0.0f : block_sum(sg, scratch) / static_cast<float>(d);
    const float mean_gx = block_sum(sgx, scratch) / static_cast<float>(d);
#pragma unroll
    for (int j = 0; j < PT; ++j) {
      const int64_t c = t + j * kThreads;
      if (c < d) {
        float xhat, gv;
        if constexpr (kHold) {
          xhat = xh[j], gv = g[j];
        } else {
          xhat = (Wide<DT>::to_float(xr[c]) - mean) * rstd;
          gv = Wide<DY>::to_float(dyr[c]) * gamma[c];
        }
        put_dx<DX>(dx, base, r * d + c, rstd, gv, xhat, mean_g, mean_gx);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < PT; ++j) {
    const int64_t c = t + j * kThreads;
    if (c < d) {
      partial[static_cast<int64_t>(blockIdx.x) * d + c] = dg[j];
      partial[static_cast<int64_t>(gridDim.x + blockIdx.x) * d + c] = db[j];
    }
  }
}

// The fused backward of the vector layout (d <= NV * 8 * kThreads): per row, x and dy loaded 16
// bytes at a time for the two sums, then again (from L1: the row was just read) for dx, so that
// only the column sums stay in registers; partial rows as norm_backward_fused_kernel writes them.
// (Four blocks per SM, as kFusedPartials assumes, up to 2 groups per thread; wider rows' column
// sums need two.)
template <fp8_dtype_t DT, fp8_dtype_t DY, fp8_dtype_t DX, int NV>
__global__ void __launch_bounds__(kThreads, NV <= 2 ? 4 : 2)
    norm_backward_vec_kernel(bool rms, const typename Wide<DT>::Raw* __restrict__ x,
                             const typename Wide<DY>::Raw* __restrict__ dy, int64_t rows, int64_t d,
                             const float* __restrict__ gamma, const float* __restrict__ mean_in,
                             const float* __restrict__ rstd_in, const typename Wide<DX>::Raw* base,
                             typename Wide<DX>::Raw* dx, float* __restrict__ partial) {
  __shared__ float scratch[32];
  const int t = threadIdx.x;
  float dg[NV][8], db[NV][8];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < 8; ++i) dg[k][i] = db[k][i] = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float mean = rms ? 0.0f : mean_in[r], rstd = rstd_in[r];
    // x-hat, dy and gamma of the 8 columns from c of row r.
    const auto load_group = [&](int64_t row, int64_t c, float(&xhat)[8], float(&dyv)[8], float(&g)[8]) {
      Vec8<DT> xv;
      Vec8<DY> yv;
      xv.load(x + row * d + c);
      yv.load(dy + row * d + c);
      load8(gamma + c, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) xhat[i] = (xv.get(i) - mean) * rstd, dyv[i] = yv.get(i);
    };
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + t) * 8;
      if (c >= d) continue;
      float xhat[8], dyv[8], g[8];
      load_group(r, c, xhat, dyv, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float dyi = dyv[i], gv = dyi * g[i];
        sg += gv;
        sgx += gv * xhat[i];
        dg[k][i] += dyi * xhat[i];
        db[k][i] += dyi;
      }
    }
    const float mean_g = rms ? 0.0f : block_sum(sg, scratch) / static_cast<float>(d);
    const float mean_gx = block_sum(sgx, scratch) / static_cast<float>(d);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + t) * 8;
      if (c >= d) continue;
      float xhat[8], dyv[8], g[8], o[8];
      load_group(r, c, xhat, dyv, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = rstd * (dyv[i] * g[i] - mean_g - xhat[i] * mean_gx);
      if (base) {  // (__fadd_rn: one rounding of the sum, as put_dx)
        Vec8<DX> bv;
        bv.load(base + r * d + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = __fadd_rn(bv.get(i), o[i]);
      }
      uint32_t unused = 0;
      store8<DX>(dx, r * d + c, o, 1.0f, unused);
    }
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = (static_cast<int64_t>(k) * kThreads + t) * 8;
    if (c >= d) continue;
    uint32_t unused = 0;
    store8<FP8_DTYPE_F32>(partial + static_cast<int64_t>(blockIdx.x) * d, c, dg[k], 1.0f, unused);
    store8<FP8_DTYPE_F32>(partial + static_cast<int64_t>(gridDim.x + blockIdx.x) * d, c, db[k], 1.0f, unused);
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

// dgamma[c] (+)= sum of the R partial rows of dgamma, dbeta alike. A block takes 32 columns; its 8
// warps sum the partial rows w, w + 8, ... (lane = column), then one warp adds the 8 sums in order.
constexpr int kReduceCols = 32, kReduceLanes = kThreads / kReduceCols;
__global__ void __launch_bounds__(kThreads) norm_backward_reduce_kernel(const float* __restrict__ partial, int64_t d,
                                                                        int R, float* dgamma, float* dbeta,
                                                                        bool accumulate) {
  __shared__ float sums[2][kReduceLanes][kReduceCols];
  const int col = threadIdx.x % kReduceCols, lane = threadIdx.x / kReduceCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kReduceCols + col;
  float g = 0.0f, b = 0.0f;
  if (c < d) {
    for (int rc = lane; rc < R; rc += kReduceLanes) {
      g += partial[static_cast<int64_t>(rc) * d + c];
      b += partial[static_cast<int64_t>(R) * d + static_cast<int64_t>(rc) * d + c];
    }
  }
  sums[0][lane][col] = g;
  sums[1][lane][col] = b;
  __syncthreads();
  if (lane != 0 || c >= d) return;
  g = b = 0.0f;
  for (int l = 0; l < kReduceLanes; ++l) {
    g += sums[0][l][col];
    b += sums[1][l][col];
  }
  dgamma[c] = accumulate ? dgamma[c] + g : g;
  if (dbeta) dbeta[c] = accumulate ? dbeta[c] + b : b;
}

// The 8-column groups per thread a row of `cols` columns takes in the vector kernels.
int64_t row_groups(int64_t cols) {
  return (cols / 8 + kThreads - 1) / kThreads;
}

// Whether a job takes the vector kernels: rows of a multiple of 8 columns, at most kVecMaxCols, and
// x, gamma, beta and `other` (y forward, dy backward) 16-byte aligned.
bool vector_rows(const NormJob& j, const void* other) {
  return j.cols % 8 == 0 && j.cols <= kVecMaxCols && aligned16(j.x) && aligned16(j.gamma) &&
         (!j.beta || aligned16(j.beta)) && aligned16(other);
}

}  // namespace

void norm(const NormJob& j, const LaunchLimits& lim, float* scratch, size_t scratch_floats, cudaStream_t stream) {
  if (!j.backward) {
    dispatch_wide(j.x_dtype, [&](auto dt) {
      auto go = [&](auto out) {
        using Raw = typename Wide<decltype(dt)::value>::Raw;
        constexpr fp8_dtype_t DT = decltype(dt)::value, OUT = decltype(out)::value;
        auto launch = [&](auto* kernel) {  // (the vector and element kernels take the same arguments)
          const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, j.rows, lim.sm_count);
          kernel<<<grid, kThreads, 0, stream>>>(j.rms, static_cast<const Raw*>(j.x), j.rows, j.cols, j.gamma, j.beta,
                                                j.eps, j.y, j.y_state, j.y_scale_inv.ptr, j.mean, j.rstd);
        };
        if (vector_rows(j, j.y))
          dispatch_groups<kVecGroups>(row_groups(j.cols),
                                      [&](auto g) { launch(norm_forward_vec_kernel<DT, OUT, decltype(g)::value>); });
        else if (j.cols <= kThreads * kHoldPerThread)
          launch(norm_forward_kernel<DT, OUT, kHoldPerThread>);
        else
          launch(norm_forward_kernel<DT, OUT, 0>);
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
      // R partial rows of dgamma and dbeta, as many as fit the scratch (more rows per partial when few
      // do) up to a number that depends on the shape alone, not on the device, so dgamma and dbeta
      // have the same bits on every GPU. The fused kernel runs one block per partial row
      // (kFusedPartials fills an H100 at 4 blocks per SM).
      const bool fused = j.cols <= kFusedMaxCols;
      const int64_t fit = static_cast<int64_t>(scratch_floats) / (2 * j.cols);
      const int R =
          static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({j.rows, fit, fused ? kFusedPartials : 256})));
      dispatch_wide(j.dx_dtype, [&](auto dxt) {
        using RawDx = typename Wide<decltype(dxt)::value>::Raw;
        constexpr fp8_dtype_t DT = decltype(dt)::value, DY = decltype(dyt)::value, DX = decltype(dxt)::value;
        auto launch_fused = [&](auto* kernel) {  // one block per partial row (vector or element kernel)
          kernel<<<R, kThreads, 0, stream>>>(j.rms, static_cast<const RawX*>(j.x), static_cast<const RawDy*>(j.dy),
                                             j.rows, j.cols, j.gamma, j.mean, j.rstd,
                                             static_cast<const RawDx*>(j.dx_base), static_cast<RawDx*>(j.dx), scratch);
        };
        if (vector_rows(j, j.dy) && aligned16(j.dx) && (!j.dx_base || aligned16(j.dx_base)))
          return dispatch_groups<kVecGroups>(row_groups(j.cols), [&](auto g) {
            launch_fused(norm_backward_vec_kernel<DT, DY, DX, decltype(g)::value>);
          });
        if (j.cols <= kThreads * kHoldPerThread)
          return launch_fused(norm_backward_fused_kernel<DT, DY, DX, kHoldPerThread>);
        if (fused) return launch_fused(norm_backward_fused_kernel<DT, DY, DX, kFusedPerThread>);
        auto* kernel = norm_backward_dx_kernel<decltype(dt)::value, decltype(dyt)::value, decltype(dxt)::value>;
        const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, j.rows, lim.sm_count);
        kernel<<<grid, kThreads, 0, stream>>>(j.rms, static_cast<const RawX*>(j.x), static_cast<const RawDy*>(j.dy),
                                              j.rows, j.cols, j.gamma, j.mean, j.rstd,
                                              static_cast<const RawDx*>(j.dx_base), static_cast<RawDx*>(j.dx));
      });
      if (!fused) {
        const dim3 grid(static_cast<unsigned>((j.cols + kThreads - 1) / kThreads), static_cast<unsigned>(R));
        norm_backward_partial_kernel<decltype(dt)::value, decltype(dyt)::value>
            <<<grid, kThreads, 0, stream>>>(j.rms, static_cast<const RawX*>(j.x), static_cast<const RawDy*>(j.dy),
                                            j.rows, j.cols, j.mean, j.rstd, R, scratch);
      }
      norm_backward_reduce_kernel<<<static_cast<unsigned>((j.cols + kReduceCols - 1) / kReduceCols), kThreads, 0,
                                    stream>>>(scratch, j.cols, R, j.dgamma, j.dbeta, j.accumulate_params);
    });
  });
  cuda_check(cudaGetLastError(), "norm backward kernel launch");
}

}  // namespace fp8::kernels
