// Dequantize: 16 codes per thread per step (one 16-byte load), decoded and rounded to the output
// type with the shared software conversions, so the CPU reference gives the same bits.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

template <fp8_dtype_t DT, bool E5M2>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ in,
                                                              typename Wide<DT>::Raw* __restrict__ out, int64_t n,
                                                              bool vec, const float* scale_inv_ptr) {
  using Raw = typename Wide<DT>::Raw;
  const float scale_inv = *scale_inv_ptr;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n_vec = vec ? n / 16 : 0;
  constexpr int kStores = 16 * sizeof(Raw) / 16;
  for (int64_t v = tid; v < n_vec; v += stride) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(in) + v);
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(&q);
    uint4 o[kStores];
    Raw* vals = reinterpret_cast<Raw*>(o);
#pragma unroll
    for (int i = 0; i < 16; ++i) vals[i] = Wide<DT>::from_float(dequantize_fp8(codes[i], E5M2, scale_inv));
#pragma unroll
    for (int k = 0; k < kStores; ++k) reinterpret_cast<uint4*>(out + v * 16)[k] = o[k];
  }
  for (int64_t i = n_vec * 16 + tid; i < n; i += stride) out[i] = Wide<DT>::from_float(dequantize_fp8(in[i], E5M2, scale_inv));
}

}  // namespace

void dequantize(const DequantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  const bool vec = aligned16(j.in) && aligned16(j.out);
  dispatch(j.out_dtype, j.e5m2, [&](auto dt, auto e5m2) {
    auto* kernel = dequantize_kernel<decltype(dt)::value, decltype(e5m2)::value>;
    const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, (j.n / 16 + kThreads - 1) / kThreads + 1,
                               lim.sm_count);
    kernel<<<grid, kThreads, 0, stream>>>(j.in, static_cast<typename Wide<decltype(dt)::value>::Raw*>(j.out), j.n, vec,
                                          j.scale_inv.ptr);
  });
  cuda_check(cudaGetLastError(), "dequantize kernel launch");
}

}  // namespace fp8::kernels
