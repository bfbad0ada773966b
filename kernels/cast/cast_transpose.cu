// Cast + transpose + amax in one pass. Each thread owns an 8x8 sub-tile: it loads 8 rows with
// 16-byte loads, writes the 8 row-major codes of each row as one 8-byte store, transposes the 64
// codes in registers with byte permutes, and writes 8 columns of the transposed output as 8-byte
// stores; no shared memory is needed. A warp covers RG x (32/RG) sub-tiles and the 8 warps of a
// block stack vertically, so a block writes whole 128-byte lines of both outputs: (32/RG)*8 codes
// per row of `out` from one warp, 8*RG*8 codes per row of `out_t` from the block.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Rows of four codes (a..d, one word each) -> columns of four codes (word k holds byte k of a..d).
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t out[4]) {
  const uint32_t ab01 = __byte_perm(a, b, 0x5140), cd01 = __byte_perm(c, d, 0x5140);
  const uint32_t ab23 = __byte_perm(a, b, 0x7362), cd23 = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab01, cd01, 0x5410);
  out[1] = __byte_perm(ab01, cd01, 0x7632);
  out[2] = __byte_perm(ab23, cd23, 0x5410);
  out[3] = __byte_perm(ab23, cd23, 0x7632);
}

template <fp8_dtype_t DT, bool E5M2, int RG>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const typename Wide<DT>::Raw* __restrict__ in, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, int64_t rows, int64_t cols, bool vec, ScalingHeader* state,
                          float* out_scale_inv, float* out_t_scale_inv) {
  constexpr int CG = 32 / RG;
  constexpr int kBlockRows = kWarps * RG * 8, kBlockCols = CG * 8;
  const float scale = state->scale;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rg = lane / CG, cg = lane % CG;
  const int64_t tiles_c = (cols + kBlockCols - 1) / kBlockCols;
  const int64_t tiles = ((rows + kBlockRows - 1) / kBlockRows) * tiles_c;
  uint32_t amax = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kBlockRows + (warp * RG + rg) * 8;
    const int64_t c0 = (t % tiles_c) * kBlockCols + cg * 8;
    if (r0 >= rows || c0 >= cols) continue;
    if (vec) {
      // rows and cols are multiples of 8 here, so the whole 8x8 sub-tile is inside.
      Vec8<DT> x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i].load(in + (r0 + i) * cols + c0);
      uint32_t lo[8], hi[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = max(amax, abs_bits(x[i].get(k)));
        lo[i] = cast4<E5M2>(x[i].get(0) * scale, x[i].get(1) * scale, x[i].get(2) * scale, x[i].get(3) * scale);
        hi[i] = cast4<E5M2>(x[i].get(4) * scale, x[i].get(5) * scale, x[i].get(6) * scale, x[i].get(7) * scale);
        *reinterpret_cast<uint2*>(out + (r0 + i) * cols + c0) = make_uint2(lo[i], hi[i]);
      }
      uint32_t top[4], bottom[4];
      transpose4x4(lo[0], lo[1], lo[2], lo[3], top);
      transpose4x4(lo[4], lo[5], lo[6], lo[7], bottom);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        *reinterpret_cast<uint2*>(out_t + (c0 + k) * rows + r0) = make_uint2(top[k], bottom[k]);
      transpose4x4(hi[0], hi[1], hi[2], hi[3], top);
      transpose4x4(hi[4], hi[5], hi[6], hi[7], bottom);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        *reinterpret_cast<uint2*>(out_t + (c0 + 4 + k) * rows + r0) = make_uint2(top[k], bottom[k]);
    } else {
      for (int64_t r = r0; r < min(r0 + 8, rows); ++r) {
        for (int64_t c = c0; c < min(c0 + 8, cols); ++c) {
          const float x = Wide<DT>::to_float(in[r * cols + c]);
          amax = max(amax, abs_bits(x));
          const uint8_t q = cast1<E5M2>(x * scale);
          out[r * cols + c] = q;
          out_t[c * rows + r] = q;
        }
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *out_scale_inv = state->scale_inv;
    *out_t_scale_inv = state->scale_inv;
  }
  block_amax_accumulate(amax, scaling_history(state), nullptr);
}

}  // namespace

// Rows of 8x8 sub-tiles per warp (2: a block tile is 128 x 128), set by CMake for tuning.
#ifndef FP8_CAST_TRANSPOSE_RG
#define FP8_CAST_TRANSPOSE_RG 2
#endif

void cast_transpose(const QuantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  constexpr int RG = FP8_CAST_TRANSPOSE_RG;
  const bool vec = j.rows % 8 == 0 && j.cols % 8 == 0 && aligned16(j.in) && aligned16(j.out) && aligned16(j.out_t);
  constexpr int64_t kBlockRows = kWarps * RG * 8, kBlockCols = (32 / RG) * 8;
  const int64_t tiles = ((j.rows + kBlockRows - 1) / kBlockRows) * ((j.cols + kBlockCols - 1) / kBlockCols);
  dispatch(j.in_dtype, j.e5m2, [&](auto dt, auto e5m2) {
    auto* kernel = cast_transpose_kernel<decltype(dt)::value, decltype(e5m2)::value, RG>;
    const int grid =
        grid_size(reinterpret_cast<const void*>(kernel), kThreads, tiles, lim.sm_count);
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.in), j.out,
                                          j.out_t, j.rows, j.cols, vec, j.state, j.out_scale_inv, j.out_t_scale_inv);
  });
  cuda_check(cudaGetLastError(), "cast_transpose kernel launch");
}

}  // namespace fp8::kernels
