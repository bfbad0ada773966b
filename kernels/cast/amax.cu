// amax = max |x| as an integer max over the magnitude bits (NaN and inf propagate), 16-byte loads.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

template <fp8_dtype_t DT>
__global__ void __launch_bounds__(kThreads) amax_kernel(const typename Wide<DT>::Raw* __restrict__ in, int64_t n,
                                                        bool vec, float* out, float* accumulate) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t amax = 0;
  const int64_t n_vec = vec ? n / 16 : 0;
  for (int64_t v = tid; v < n_vec; v += stride) {
    Vec8<DT> a, b;
    a.load(in + v * 16);
    b.load(in + v * 16 + 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = max(amax, max(abs_bits(a.get(i)), abs_bits(b.get(i))));
  }
  for (int64_t i = n_vec * 16 + tid; i < n; i += stride) amax = max(amax, abs_bits(Wide<DT>::to_float(in[i])));
  block_amax_accumulate(amax, out, accumulate);
}

}  // namespace

void amax(const AmaxJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  // The kernel max-accumulates into *out, so it starts from +0.
  cuda_check(cudaMemsetAsync(j.out, 0, sizeof(float), stream), "amax: clearing the output");
  if (j.n == 0) return;
  const bool vec = aligned16(j.in);
  dispatch_wide(j.dtype, [&](auto dt) {
    auto* kernel = amax_kernel<decltype(dt)::value>;
    const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, (j.n / 16 + kThreads - 1) / kThreads + 1,
                               lim.sm_count);
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.in), j.n, vec,
                                          j.out, j.accumulate);
  });
  cuda_check(cudaGetLastError(), "amax kernel launch");
}

}  // namespace fp8::kernels
