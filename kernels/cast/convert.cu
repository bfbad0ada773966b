// Conversions that move no FP8 scale: wide -> wide (the bf16 copies of FP32 master weights) and the
// byte transpose of an FP8 tensor that arrived already quantised (its K-major copy for a GEMM).
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

template <fp8_dtype_t IN, fp8_dtype_t OUT>
__global__ void __launch_bounds__(kThreads) convert_kernel(const typename Wide<IN>::Raw* __restrict__ in,
                                                           typename Wide<OUT>::Raw* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = Wide<OUT>::from_float(Wide<IN>::to_float(in[i]));
}

// 128 x 128 byte tiles through shared memory with 16-byte accesses on both sides (the layout of
// cast_transpose.cu without the cast): a thread loads 16 codes of a row into the tile, then
// store_tile_transposed writes them turned around. Edge tiles and unaligned tensors go element by
// element.
constexpr int kT = 128;

__global__ void __launch_bounds__(kThreads) transpose_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                                                             bool vec, uint8_t* __restrict__ out,
                                                             const float* in_scale_inv, float* out_scale_inv) {
  __shared__ __align__(16) uint8_t tile[kCodeTileBytes];
  const int tid = threadIdx.x;
  const int64_t tiles_c = (cols + kT - 1) / kT;
  const int64_t tiles = (rows + kT - 1) / kT * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t R0 = t / tiles_c * kT, C0 = t % tiles_c * kT;
    if (vec && R0 + kT <= rows && C0 + kT <= cols) {
#pragma unroll
      for (int k = 0; k < kT * kT / 16 / kThreads; ++k) {
        const int ch = tid + k * kThreads, r = ch >> 3, c = (ch & 7) * 16;
        *reinterpret_cast<uint4*>(tile + tile_at(r, c)) =
            __ldg(reinterpret_cast<const uint4*>(in + (R0 + r) * cols + C0 + c));
      }
      __syncthreads();
      store_tile_transposed<kThreads>(tile, out, rows, R0, C0, true);
      __syncthreads();
    } else {
      for (int e = tid; e < kT * kT; e += kThreads) {
        const int64_t r = R0 + e % kT, c = C0 + e / kT;  // consecutive threads write consecutive bytes of out
        if (r < rows && c < cols) out[c * rows + r] = in[r * cols + c];
      }
    }
  }
  if (blockIdx.x == 0 && tid == 0) *out_scale_inv = *in_scale_inv;
}

}  // namespace

void convert(const ConvertJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  if (j.n == 0) return;
  dispatch_wide(j.in_dtype, [&](auto in_dt) {
    dispatch_wide(j.out_dtype, [&](auto out_dt) {
      auto* kernel = convert_kernel<decltype(in_dt)::value, decltype(out_dt)::value>;
      const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, (j.n + kThreads - 1) / kThreads,
                                 lim.sm_count);
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename Wide<decltype(in_dt)::value>::Raw*>(j.in),
                                            static_cast<typename Wide<decltype(out_dt)::value>::Raw*>(j.out), j.n);
    });
  });
  cuda_check(cudaGetLastError(), "convert kernel launch");
}

void transpose(const TransposeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  const int64_t tiles = (j.rows + kT - 1) / kT * ((j.cols + kT - 1) / kT);
  const int grid = grid_size(reinterpret_cast<const void*>(transpose_kernel), kThreads, tiles > 0 ? tiles : 1, lim.sm_count);
  const bool vec = j.rows % 16 == 0 && j.cols % 16 == 0 && aligned16(j.in) && aligned16(j.out);
  transpose_kernel<<<grid, kThreads, 0, stream>>>(j.in, j.rows, j.cols, vec, j.out, j.in_scale_inv.ptr,
                                                  j.out_scale_inv.ptr);
  cuda_check(cudaGetLastError(), "transpose kernel launch");
}

}  // namespace fp8::kernels
