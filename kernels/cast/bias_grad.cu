// Column sums of a wide matrix (the bias gradient), deterministic: stage 1 writes one partial sum per
// kBiasGradRows rows and column; stage 2 adds the partials of each column in order to dbias. The
// fused dy cast (cast_transpose.cu) writes the same partials and shares stage 2.
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kWarps = 8;
constexpr int kColsPerBlock = 32 * 8;  // a lane sums 8 consecutive columns

// grid.y is at most 65535, so a block takes row tiles blockIdx.y, blockIdx.y + gridDim.y, ... Each
// tile's partial is summed the same way whichever block takes it, so the result does not depend on
// the grid.
constexpr int64_t kMaxRowBlocks = 65535;

// Block (blockIdx.x, blockIdx.y): columns [256 x, 256 x + 256) of its row tiles; for each tile, warp
// w sums rows w, w + 8, ... of it, and the warps' sums are then added in warp order.
template <fp8_dtype_t DT>
__global__ void __launch_bounds__(kWarps * 32)
    column_partials_kernel(const typename Wide<DT>::Raw* __restrict__ dy, int64_t rows, int64_t cols, bool vec,
                           float* __restrict__ partials) {
  __shared__ float part[kWarps][kColsPerBlock];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + lane * 8;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + threadIdx.x;
  const int64_t tiles = (rows + kBiasGradRows - 1) / kBiasGradRows;
  for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {  // uniform over the block
    const int64_t r0 = tile * kBiasGradRows;
    const int64_t r1 = min(r0 + kBiasGradRows, rows);
    float sum[8] = {};
    for (int64_t r = r0 + warp; r < r1; r += kWarps) {
      const typename Wide<DT>::Raw* row = dy + r * cols;
      if (vec && c0 + 8 <= cols) {
        Vec8<DT> v;
        v.load(row + c0);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] += v.get(i);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (c0 + i < cols) sum[i] += Wide<DT>::to_float(row[c0 + i]);
      }
    }
    __syncthreads();  // the previous tile's reads of `part` are done
#pragma unroll
    for (int i = 0; i < 8; ++i) part[warp][lane * 8 + i] = sum[i];
    __syncthreads();
    if (c < cols) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += part[w][threadIdx.x];
      partials[tile * cols + c] = total;
    }
  }
}

// One thread per column adds its partials in tile order. The loads of 16 partials are issued
// before their adds (which stay in order), so the thread is not one load latency per partial.
constexpr int kFinishThreads = 64, kFinishBatch = 16;
__global__ void __launch_bounds__(kFinishThreads)
    column_finish_kernel(const float* __restrict__ partials, int64_t tiles, int64_t cols, float* __restrict__ dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float total = 0.0f;
  int64_t t = 0;
  for (; t + kFinishBatch <= tiles; t += kFinishBatch) {
    float v[kFinishBatch];
#pragma unroll
    for (int i = 0; i < kFinishBatch; ++i) v[i] = partials[(t + i) * cols + c];
#pragma unroll
    for (int i = 0; i < kFinishBatch; ++i) total += v[i];
  }
  for (; t < tiles; ++t) total += partials[t * cols + c];
  dbias[c] += total;
}

}  // namespace

void bias_grad_finish(const float* partials, int64_t rows, int64_t cols, float* dbias, const LaunchLimits&,
                      cudaStream_t stream) {
  const int64_t tiles = (rows + kBiasGradRows - 1) / kBiasGradRows;
  if (tiles == 0 || cols == 0) return;
  column_finish_kernel<<<static_cast<unsigned>((cols + kFinishThreads - 1) / kFinishThreads), kFinishThreads, 0,
                         stream>>>(partials, tiles, cols, dbias);
  cuda_check(cudaGetLastError(), "bias gradient kernel launch");
}

void bias_grad(const BiasGradJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  const int64_t tiles = (j.rows + kBiasGradRows - 1) / kBiasGradRows;
  if (tiles == 0 || j.cols == 0) return;
  const bool vec = j.cols % 8 == 0 && aligned16(j.dy);
  const dim3 grid(static_cast<unsigned>((j.cols + kColsPerBlock - 1) / kColsPerBlock),
                  static_cast<unsigned>(std::min(tiles, kMaxRowBlocks)));
  dispatch_wide(j.dtype, [&](auto dt) {
    column_partials_kernel<decltype(dt)::value><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.dy), j.rows, j.cols, vec, j.partials);
  });
  cuda_check(cudaGetLastError(), "bias gradient kernel launch");
  bias_grad_finish(j.partials, j.rows, j.cols, j.dbias, lim, stream);
}

}  // namespace fp8::kernels
