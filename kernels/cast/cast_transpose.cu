// Cast + transpose + amax in one pass over 128 x 128 tiles. Phase 1 gives each thread 16
// consecutive columns of a row: 16-byte loads, 16-byte stores of the codes to `out` (8 lanes write
// one whole 128-byte line) and to a shared tile. Phase 2 gives 8 lanes one row of `out_t` (an input
// column), 16 input rows each, so `out_t` is written in whole 128-byte lines too. The loads of a
// block's next tile are issued before it writes the current one. bench/RESULTS.md records the
// register-only designs this one beat. With DBIAS the pass also writes one partial column sum per
// tile (the Linear's bias gradient from the dy cast; see kBiasGradRows), in a fixed order.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

// Rows of the shared tile are padded to 144 bytes so that phase 2's byte reads (8 rows x 4 columns
// per warp instruction) fall in 8 different banks, and 16-byte stores stay aligned.
constexpr int kTile = 128, kTilePitch = 144;

template <fp8_dtype_t DT>
using TileLoads = TileLoads128<DT, kThreads>;

static_assert(kTile == kBiasGradRows, "one partial column sum per tile row");

// Phase 1's per-thread column sums (16 columns, 4 rows each) -> the tile's 128 column sums in
// partials[tile row][C0 ..], reduced over lanes and warps in a fixed order.
__device__ __forceinline__ void tile_column_sums(const float (&sums)[16], float* col_part, float* partials,
                                                 int64_t tile_row, int64_t C0, int64_t cols) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float s[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    s[i] = sums[i] + __shfl_xor_sync(0xFFFFFFFFu, sums[i], 8);
    s[i] += __shfl_xor_sync(0xFFFFFFFFu, s[i], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int i = 0; i < 16; ++i) col_part[warp * kTile + lane * 16 + i] = s[i];
  }
  __syncthreads();
  if (tid < kTile) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += col_part[w * kTile + tid];
    partials[tile_row * cols + C0 + tid] = total;
  }
}

template <fp8_dtype_t DT, bool E5M2, bool DBIAS>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const typename Wide<DT>::Raw* __restrict__ in, uint8_t* __restrict__ out,
                               uint8_t* __restrict__ out_t, int64_t rows, int64_t cols, bool rows_aligned,
                               bool cols_aligned,
                               ScalingHeader* state, float current_max, bool current_pow2,
                               float* out_scale_inv, float* out_t_scale_inv, float* out_scale,
                               float* __restrict__ dbias_partials) {
  __shared__ __align__(16) uint8_t tile[kTile * kTilePitch];
  __shared__ float col_part[DBIAS ? kThreads / 32 * kTile : 1];
  const float scale = cast_scale(state, current_max, current_pow2);
  const int tid = threadIdx.x;
  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t tiles = ((rows + kTile - 1) / kTile) * tiles_c;
  auto full = [&](int64_t t) {
    return cols_aligned && (t / tiles_c + 1) * kTile <= rows && (t % tiles_c + 1) * kTile <= cols;
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
      float sums[16] = {};
#pragma unroll
      for (int k = 0; k < TileLoads<DT>::kChunks; ++k) {
        const int ch = tid + k * kThreads, r = ch >> 3, c = (ch & 7) * 16;
        uint32_t w[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const Vec8<DT>& v = cur.x[k][h];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            amax = max(amax, abs_bits(v.get(i)));
            if constexpr (DBIAS) sums[8 * h + i] += v.get(i);
          }
          w[2 * h] = cast4<E5M2>(v.get(0) * scale, v.get(1) * scale, v.get(2) * scale, v.get(3) * scale);
          w[2 * h + 1] = cast4<E5M2>(v.get(4) * scale, v.get(5) * scale, v.get(6) * scale, v.get(7) * scale);
        }
        const uint4 codes = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(out + (R0 + r) * cols + C0 + c) = codes;
        *reinterpret_cast<uint4*>(tile + r * kTilePitch + c) = codes;
      }
      if constexpr (DBIAS) tile_column_sums(sums, col_part, dbias_partials, t / tiles_c, C0, cols);
      __syncthreads();
      // Phase 2: transposed row c (input column C0 + c), input rows r0..r0+15: one 16-byte store
      // when rows keeps the transposed rows 16-byte aligned, else 16 byte stores (e.g. a vocabulary
      // of 50257 rows still gets the vector loads and the row-major stores of phase 1).
      store_tile_transposed<kThreads, kTilePitch>(tile, out_t, rows, R0, C0, rows_aligned);
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
      if constexpr (DBIAS) {
        // One column per thread, rows in order (edge tiles are few; they read their input twice).
        if (tid < kTile && C0 + tid < cols) {
          float total = 0.0f;
          for (int64_t r = R0; r < R0 + kTile && r < rows; ++r) total += Wide<DT>::to_float(in[r * cols + C0 + tid]);
          dbias_partials[(t / tiles_c) * cols + C0 + tid] = total;
        }
      }
      const int64_t t_next = t + gridDim.x;
      if (t_next < tiles && full(t_next)) next.issue(in, cols, (t_next / tiles_c) * kTile, (t_next % tiles_c) * kTile);
    }
  }
  if (blockIdx.x == 0 && tid == 0) {
    *out_scale_inv = state->scale_inv;
    *out_t_scale_inv = state->scale_inv;
    if (out_scale) *out_scale = scale;
  }
  block_amax_accumulate(amax, scaling_history(state), nullptr);
}

}  // namespace

void cast_transpose(const QuantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  // Phase 1 (loads and row-major stores) needs 16-byte aligned rows of `in` and `out`; phase 2's
  // vector stores need 16-byte aligned rows of `out_t`.
  const bool cols_aligned = j.cols % 16 == 0 && aligned16(j.in) && aligned16(j.out);
  const bool rows_aligned = j.rows % 16 == 0 && aligned16(j.out_t);
  const int64_t tiles = ((j.rows + kTile - 1) / kTile) * ((j.cols + kTile - 1) / kTile);
  auto launch = [&](auto dt, auto e5m2, auto dbias) {
    auto* kernel = cast_transpose_kernel<decltype(dt)::value, decltype(e5m2)::value, decltype(dbias)::value>;
    // Every resident slot filled (not a balanced grid): the prefetch needs the occupancy more.
    const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, tiles, lim.sm_count, false);
    kernel<<<grid, kThreads, 0, stream>>>(
        static_cast<const typename Wide<decltype(dt)::value>::Raw*>(j.in), j.out, j.out_t, j.rows, j.cols, rows_aligned,
        cols_aligned, j.state, j.current ? j.current_fp8_max : 0.0f, j.current_pow2, j.out_scale_inv.ptr,
        j.out_t_scale_inv.ptr, j.out_scale.ptr, j.dbias_partials);
  };
  dispatch(j.in_dtype, j.e5m2, [&](auto dt, auto e5m2) {
    if (j.dbias) launch(dt, e5m2, std::true_type{});
    else launch(dt, e5m2, std::false_type{});
  });
  cuda_check(cudaGetLastError(), "cast_transpose kernel launch");
  if (j.dbias) bias_grad_finish(j.dbias_partials, j.rows, j.cols, j.dbias, lim, stream);
}

}  // namespace fp8::kernels
