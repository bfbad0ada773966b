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

// 64 x 64 byte tiles through shared memory: reads and writes are both row-contiguous. The pitch of
// 68 bytes keeps the column reads of a warp in distinct banks.
constexpr int kT = 64, kPitch = 68;

__global__ void __launch_bounds__(kThreads) transpose_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                                                             uint8_t* __restrict__ out, const float* in_scale_inv,
                                                             float* out_scale_inv) {
  __shared__ uint8_t tile[kT * kPitch];
  const int64_t tiles_c = (cols + kT - 1) / kT;
  const int64_t tiles = (rows + kT - 1) / kT * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t R0 = t / tiles_c * kT, C0 = t % tiles_c * kT;
    for (int e = threadIdx.x; e < kT * kT; e += kThreads) {
      const int r = e / kT, c = e % kT;
      if (R0 + r < rows && C0 + c < cols) tile[r * kPitch + c] = in[(R0 + r) * cols + C0 + c];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kT * kT; e += kThreads) {
      const int c = e / kT, r = e % kT;
      if (R0 + r < rows && C0 + c < cols) out[(C0 + c) * rows + R0 + r] = tile[r * kPitch + c];
    }
    __syncthreads();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *out_scale_inv = *in_scale_inv;
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
  transpose_kernel<<<grid, kThreads, 0, stream>>>(j.in, j.rows, j.cols, j.out, j.in_scale_inv, j.out_scale_inv);
  cuda_check(cudaGetLastError(), "transpose kernel launch");
}

}  // namespace fp8::kernels
