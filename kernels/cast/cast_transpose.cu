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

template <int SR>
__device__ __forceinline__ void store_column(uint8_t* p, const uint32_t (&w)[SR / 4]) {
  if constexpr (SR == 8) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// RG: lanes of a warp across row groups; SR: rows per thread (8 or 16, the transposed store width).
template <fp8_dtype_t DT, bool E5M2, int RG, int SR>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const typename Wide<DT>::Raw* __restrict__ in, uint8_t* __restrict__ out,
                          uint8_t* __restrict__ out_t, int64_t rows, int64_t cols, bool vec, ScalingHeader* state,
                          float* out_scale_inv, float* out_t_scale_inv) {
  constexpr int CG = 32 / RG;
  constexpr int kBlockRows = kWarps * RG * SR, kBlockCols = CG * 8;
  const float scale = state->scale;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rg = lane / CG, cg = lane % CG;
  const int64_t tiles_c = (cols + kBlockCols - 1) / kBlockCols;
  const int64_t tiles = ((rows + kBlockRows - 1) / kBlockRows) * tiles_c;
  uint32_t amax = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kBlockRows + (warp * RG + rg) * SR;
    const int64_t c0 = (t % tiles_c) * kBlockCols + cg * 8;
    if (r0 >= rows || c0 >= cols) continue;
    if (vec) {
      // rows % SR == 0 and cols % 8 == 0 here, so the whole SR x 8 sub-tile is inside.
      Vec8<DT> x[SR];
#pragma unroll
      for (int i = 0; i < SR; ++i) x[i].load(in + (r0 + i) * cols + c0);
      uint32_t lo[SR], hi[SR];  // codes of columns 0..3 and 4..7 of each row
#pragma unroll
      for (int i = 0; i < SR; ++i) {
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = max(amax, abs_bits(x[i].get(k)));
        lo[i] = cast4<E5M2>(x[i].get(0) * scale, x[i].get(1) * scale, x[i].get(2) * scale, x[i].get(3) * scale);
        hi[i] = cast4<E5M2>(x[i].get(4) * scale, x[i].get(5) * scale, x[i].get(6) * scale, x[i].get(7) * scale);
        *reinterpret_cast<uint2*>(out + (r0 + i) * cols + c0) = make_uint2(lo[i], hi[i]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t* w = half ? hi : lo;
        uint32_t col[4][SR / 4];  // col[k][b]: rows 4b..4b+3 of column 4*half+k
#pragma unroll
        for (int b = 0; b < SR / 4; ++b) {
          uint32_t t4[4];
          transpose4x4(w[4 * b], w[4 * b + 1], w[4 * b + 2], w[4 * b + 3], t4);
#pragma unroll
          for (int k = 0; k < 4; ++k) col[k][b] = t4[k];
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) store_column<SR>(out_t + (c0 + 4 * half + k) * rows + r0, col[k]);
      }
    } else {
      for (int64_t r = r0; r < min(r0 + SR, rows); ++r) {
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

// Shared-memory variant: a block quantizes 128 x 128 tiles. Phase 1 gives each thread 16
// consecutive columns of a row (16-byte codes to `out`, whole 128-byte lines per 8 lanes) and
// parks the codes in shared memory; phase 2 gives 8 lanes one transposed row, 16 input rows each,
// so `out_t` is written in whole 128-byte lines too. Rows of the shared tile are padded to 144
// bytes so phase 2's byte reads (8 rows x 4 columns per instruction) hit 8 different banks.
constexpr int kTile = 128, kTilePitch = 144;

template <fp8_dtype_t DT>
struct TileLoads {
  static constexpr int kChunks = kTile * kTile / 16 / kThreads;  // 16-column chunks per thread
  Vec8<DT> x[kChunks][2];
  // Issues all loads of this thread's chunks of the tile at (R0, C0).
  __device__ __forceinline__ void issue(const typename Wide<DT>::Raw* in, int64_t cols, int64_t R0, int64_t C0) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int ch = threadIdx.x + k * kThreads, r = ch >> 3, c = (ch & 7) * 16;
      const typename Wide<DT>::Raw* p = in + (R0 + r) * cols + C0 + c;
      x[k][0].load(p);
      x[k][1].load(p + 8);
    }
  }
};

template <fp8_dtype_t DT, bool E5M2>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_smem_kernel(const typename Wide<DT>::Raw* __restrict__ in, uint8_t* __restrict__ out,
                               uint8_t* __restrict__ out_t, int64_t rows, int64_t cols, bool aligned,
                               ScalingHeader* state, float* out_scale_inv, float* out_t_scale_inv) {
  __shared__ __align__(16) uint8_t tile[kTile * kTilePitch];
  const float scale = state->scale;
  const int tid = threadIdx.x;
  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t tiles = ((rows + kTile - 1) / kTile) * tiles_c;
  auto full = [&](int64_t t) {
    return aligned && (t / tiles_c + 1) * kTile <= rows && (t % tiles_c + 1) * kTile <= cols;
  };
  uint32_t amax = 0;
  // Software pipeline: the loads of a block's next tile are in flight while it writes the
  // transposed output of the current one.
  TileLoads<DT> next;
  if (blockIdx.x < tiles && full(blockIdx.x)) next.issue(in, cols, (blockIdx.x / tiles_c) * kTile, (blockIdx.x % tiles_c) * kTile);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t R0 = (t / tiles_c) * kTile, C0 = (t % tiles_c) * kTile;
    if (full(t)) {
      // Phase 1: 128 rows x 8 chunks of 16 columns; codes to `out` and to the shared tile.
      const TileLoads<DT> cur = next;
      const int64_t t_next = t + gridDim.x;
      if (t_next < tiles && full(t_next)) next.issue(in, cols, (t_next / tiles_c) * kTile, (t_next % tiles_c) * kTile);
#pragma unroll
      for (int k = 0; k < TileLoads<DT>::kChunks; ++k) {
        const int ch = tid + k * kThreads, r = ch >> 3, c = (ch & 7) * 16;
        uint32_t w[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const Vec8<DT>& v = cur.x[k][h];
#pragma unroll
          for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(v.get(i)));
          w[2 * h] = cast4<E5M2>(v.get(0) * scale, v.get(1) * scale, v.get(2) * scale, v.get(3) * scale);
          w[2 * h + 1] = cast4<E5M2>(v.get(4) * scale, v.get(5) * scale, v.get(6) * scale, v.get(7) * scale);
        }
        const uint4 codes = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(out + (R0 + r) * cols + C0 + c) = codes;
        *reinterpret_cast<uint4*>(tile + r * kTilePitch + c) = codes;
      }
      __syncthreads();
      // Phase 2: transposed row c (input column C0 + c), input rows r0..r0+15, 16-byte stores.
#pragma unroll
      for (int k = 0; k < kTile * kTile / 16 / kThreads; ++k) {
        const int task = tid + k * kThreads, c = task >> 3, r0 = (task & 7) * 16;
        uint32_t w[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          w[b] = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) w[b] |= static_cast<uint32_t>(tile[(r0 + 4 * b + i) * kTilePitch + c]) << (8 * i);
        }
        *reinterpret_cast<uint4*>(out_t + (C0 + c) * rows + R0 + r0) = make_uint4(w[0], w[1], w[2], w[3]);
      }
      __syncthreads();  // the tile is reused by the next iteration
    } else {
      // Edge or unaligned tile: element by element, rows spread over the threads.
      for (int64_t e = tid; e < int64_t{kTile} * kTile; e += kThreads) {
        const int64_t r = R0 + e / kTile, c = C0 + e % kTile;
        if (r >= rows || c >= cols) continue;
        const float x = Wide<DT>::to_float(in[r * cols + c]);
        amax = max(amax, abs_bits(x));
        const uint8_t q = cast1<E5M2>(x * scale);
        out[r * cols + c] = q;
        out_t[c * rows + r] = q;
      }
      const int64_t t_next = t + gridDim.x;
      if (t_next < tiles && full(t_next)) next.issue(in, cols, (t_next / tiles_c) * kTile, (t_next % tiles_c) * kTile);
    }
  }
  if (blockIdx.x == 0 && tid == 0) {
    *out_scale_inv = state->scale_inv;
    *out_t_scale_inv = state->scale_inv;
  }
  block_amax_accumulate(amax, scaling_history(state), nullptr);
}

}  // namespace

// Tile shape, set by CMake for tuning (bench/RESULTS.md has the measurements behind the defaults).
#ifndef FP8_CAST_TRANSPOSE_RG
#define FP8_CAST_TRANSPOSE_RG 4
#endif
#ifndef FP8_CAST_TRANSPOSE_SR
#define FP8_CAST_TRANSPOSE_SR 16
#endif

#ifndef FP8_CAST_TRANSPOSE_SMEM
#define FP8_CAST_TRANSPOSE_SMEM 1
#endif
#ifndef FP8_CAST_TRANSPOSE_BALANCED
#define FP8_CAST_TRANSPOSE_BALANCED 0
#endif

void cast_transpose(const QuantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  if (FP8_CAST_TRANSPOSE_SMEM) {
    const bool aligned = j.rows % 16 == 0 && j.cols % 16 == 0 && aligned16(j.in) && aligned16(j.out) && aligned16(j.out_t);
    const int64_t tiles = ((j.rows + kTile - 1) / kTile) * ((j.cols + kTile - 1) / kTile);
    dispatch(j.in_dtype, j.e5m2, [&](auto dt, auto e5m2) {
      auto* kernel = cast_transpose_smem_kernel<decltype(dt)::value, decltype(e5m2)::value>;
      const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, tiles, lim.sm_count, FP8_CAST_TRANSPOSE_BALANCED);
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.in), j.out,
                                            j.out_t, j.rows, j.cols, aligned, j.state, j.out_scale_inv,
                                            j.out_t_scale_inv);
    });
    cuda_check(cudaGetLastError(), "cast_transpose kernel launch");
    return;
  }
  constexpr int RG = FP8_CAST_TRANSPOSE_RG, SR = FP8_CAST_TRANSPOSE_SR;
  const bool vec = j.rows % SR == 0 && j.cols % 8 == 0 && aligned16(j.in) && aligned16(j.out) && aligned16(j.out_t);
  constexpr int64_t kBlockRows = kWarps * RG * SR, kBlockCols = (32 / RG) * 8;
  const int64_t tiles = ((j.rows + kBlockRows - 1) / kBlockRows) * ((j.cols + kBlockCols - 1) / kBlockCols);
  dispatch(j.in_dtype, j.e5m2, [&](auto dt, auto e5m2) {
    auto* kernel = cast_transpose_kernel<decltype(dt)::value, decltype(e5m2)::value, RG, SR>;
    const int grid =
        grid_size(reinterpret_cast<const void*>(kernel), kThreads, tiles, lim.sm_count);
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.in), j.out,
                                          j.out_t, j.rows, j.cols, vec, j.state, j.out_scale_inv, j.out_t_scale_inv);
  });
  cuda_check(cudaGetLastError(), "cast_transpose kernel launch");
}

}  // namespace fp8::kernels
