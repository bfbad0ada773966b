// Cast + transpose + amax in one pass over 128 x 128 tiles. Phase 1 gives each thread 16
// consecutive columns of a row: 16-byte loads, 16-byte stores of the codes to `out` (8 lanes write
// one whole 128-byte line) and to a shared tile. Phase 2 (store_tile_transposed) turns 16 x 4 blocks
// of the tile around in registers and writes `out_t` 16 bytes a lane. The loads of a block's next
// tile are issued before it writes the current one. bench/RESULTS.md records the
// register-only designs this one beat. With DBIAS the pass also writes one partial column sum per
// tile (the Linear's bias gradient from the dy cast; see kBiasGradRows), in a fixed order. One
// launch may cast several tensors (the model's weight copies, cast_transpose_group): the tiles of
// all of them form one range, each block's amax going to the state of the tensor its tiles are in.
// With FOLD the values cast are an activation of the input, act(in) (the x cast of a Linear after
// ReLU or GELU: the activation's output never written), or its gradient, act_grad(act_x, in) (the
// dy cast of a Linear followed by one: the activation's dx never written).
#include "core/activation.hpp"
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256;

constexpr int kTile = 128;

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

// One tensor of a cast: the tiles [first_tile, first_tile + its tile count) of the group's range.
struct CastItem {
  const void* in;
  const void* act_x;  // a folded gradient: the activation's input
  uint8_t* out;
  uint8_t* out_t;
  int64_t rows, cols, tiles_c, first_tile;
  bool rows_aligned, cols_aligned;
  ScalingHeader* state;
  float* out_scale_inv;
  float* out_t_scale_inv;
  float* out_scale;
};

// N tensors cast in one launch (N = 1: one cast; larger N: a group of weight copies, whose tensors
// are each too small to fill the GPU alone). __grid_constant__ lets the kernel index the items.
template <int N>
struct CastItems {
  CastItem item[N];
  int count;
  int64_t tiles;  // over all items
};
constexpr int kMaxGroup = 64;  // items per launch: 64 x 104 bytes of kernel parameters
// (More than the 4 KiB of kernel parameters before CUDA 12.1; sm_70+ with CUDA >= 12.1 take 32 KiB.)
static_assert(sizeof(CastItems<kMaxGroup>) <= 32764, "a group's items must fit the kernel parameters");

// FOLD: kNoFold, an activation's gradient (FP8_ACTIVATION_RELU or _GELU) or the activation itself
// (kForward + it).
constexpr int kNoFold = -1, kForward = 16;
constexpr bool folds_grad(int fold) {
  return fold >= 0 && fold < kForward;
}

// What is cast of input value v (with the activation's input h for a gradient).
template <int FOLD>
__device__ __forceinline__ float folded(float v, float h) {
  if constexpr (FOLD == kNoFold)
    return v;
  else if constexpr (FOLD >= kForward)
    return act_value(static_cast<fp8_activation_t>(FOLD - kForward), v);
  else
    return act_grad(static_cast<fp8_activation_t>(FOLD), h, v);
}

// Element i of what an edge tile casts.
template <fp8_dtype_t DT, int FOLD>
__device__ __forceinline__ float value(const typename Wide<DT>::Raw* in, const void* act_x, int64_t i) {
  using Raw = typename Wide<DT>::Raw;
  const float h = folds_grad(FOLD) ? Wide<DT>::to_float(static_cast<const Raw*>(act_x)[i]) : 0.0f;
  return folded<FOLD>(Wide<DT>::to_float(in[i]), h);
}

// A folded gradient's activation input goes through shared memory: the next tile's is copied in
// with cp.async (16 bytes a copy, this thread's chunks only, so no barrier) while the block works on
// the current one, and read into registers just before. Holding it in registers in flight instead
// would cost the occupancy the prefetch of the input lives on. The copies go through L1 (.ca): a
// thread's two 16-byte copies of a chunk fall in the same 32-byte sectors, and with .cg (L2 only)
// each sector was fetched from L2 twice (ncu: 12.6M L2 read sectors where 8.4M are the data; the
// dGELU fold's cast ran 8% faster on an H200 with .ca, 50% -> 55% of copy).
template <fp8_dtype_t DT>
constexpr int kStagedCopies = TileLoads<DT>::kChunks * 2 * Vec8<DT>::kLoads;  // per thread
template <fp8_dtype_t DT>
constexpr size_t kStagedBytes = size_t{kStagedCopies<DT>} * 16 * kThreads;

__device__ __forceinline__ void cp_async16(uint4* smem, const void* gmem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// Two blocks per SM for 16-bit inputs (128 registers: the prefetch needs the occupancy, and on the
// H200 1 block per SM ran 14-20% slower); F32 tiles hold twice the registers in flight and spill at 128.
template <fp8_dtype_t DT, bool E5M2, bool DBIAS, int N, int FOLD>
__global__ void __launch_bounds__(kThreads, DT != FP8_DTYPE_F32 ? 2 : 1)
    cast_transpose_kernel(const __grid_constant__ CastItems<N> g, float current_max, bool current_pow2,
                          float* __restrict__ dbias_partials) {
  using Raw = typename Wide<DT>::Raw;
  // Two code tiles, alternate whole tiles using alternate ones, so that no barrier is needed between
  // one tile's transposed stores and the next one's codes (a tile is written again two whole tiles
  // later, after a barrier that every thread reaches only once done reading it; edge tiles use none).
  __shared__ __align__(16) uint8_t code_tiles[2][kCodeTileBytes];
  int parity = 0;
  __shared__ float col_part[DBIAS ? kThreads / 32 * kTile : 1];
  extern __shared__ uint4 staged[];  // folds_grad(FOLD): the next tile's act_x, [copy][thread]
  const int tid = threadIdx.x;
  // The item of tile t, searched from `from` on (a block's tiles ascend).
  auto item_of = [&](int64_t t, int from) {
    int k = from;
    while (k + 1 < g.count && t >= g.item[k + 1].first_tile) ++k;
    return k;
  };
  auto full = [&](const CastItem& it, int64_t t) {
    return it.cols_aligned && (t / it.tiles_c + 1) * kTile <= it.rows && (t % it.tiles_c + 1) * kTile <= it.cols;
  };
  auto origin = [&](const CastItem& it, int64_t t, int64_t& R0, int64_t& C0) {
    R0 = (t / it.tiles_c) * kTile;
    C0 = (t % it.tiles_c) * kTile;
  };
  uint32_t amax = 0;
  int k = 0;  // the item of the tiles whose amax `amax` holds
  // Its scale, recorded in its state once (cast_scale: block 0, item 0; only a single cast runs under
  // current scaling).
  float scale = cast_scale(g.item[0].state, current_max, current_pow2);
  // Software pipeline: the loads of a block's next tile are in flight while it writes the
  // transposed output of the current one.
  TileLoads<DT> next;
  auto prefetch = [&](int64_t t, int from) {
    if (t >= g.tiles) return;
    const CastItem& it = g.item[item_of(t, from)];
    const int64_t lt = t - it.first_tile;
    int64_t R0, C0;
    origin(it, lt, R0, C0);
    if (!full(it, lt)) return;
    next.issue(static_cast<const Raw*>(it.in), it.cols, R0, C0);
    if constexpr (folds_grad(FOLD)) {
#pragma unroll
      for (int c8 = 0; c8 < TileLoads<DT>::kChunks; ++c8) {
        const int ch = tid + c8 * kThreads, r = ch >> 3, c = (ch & 7) * 16;
        const auto* p = reinterpret_cast<const uint4*>(static_cast<const Raw*>(it.act_x) + (R0 + r) * it.cols + C0 + c);
#pragma unroll
        for (int q = 0; q < 2 * Vec8<DT>::kLoads; ++q)
          cp_async16(&staged[(c8 * 2 * Vec8<DT>::kLoads + q) * kThreads + tid], p + q);
      }
      asm volatile("cp.async.commit_group;\n" ::);
    }
  };
  prefetch(blockIdx.x, 0);
  for (int64_t t = blockIdx.x; t < g.tiles; t += gridDim.x) {
    const int kt = item_of(t, k);
    if (N > 1 && kt != k) {  // the block moves to another tensor: its amax so far goes to the last one
      block_amax_accumulate(amax, scaling_history(g.item[k].state), nullptr);
      amax = 0;
      k = kt;
      scale = cast_scale_value(g.item[k].state, current_max, current_pow2);
    }
    const CastItem& it = g.item[k];
    const Raw* in = static_cast<const Raw*>(it.in);
    const int64_t lt = t - it.first_tile, rows = it.rows, cols = it.cols;
    int64_t R0, C0;
    origin(it, lt, R0, C0);
    if (full(it, lt)) {
      uint8_t* tile = code_tiles[parity];
      // Phase 1: 128 rows x 8 chunks of 16 columns; codes to `out` and to the shared tile.
      Vec8<DT> ax[TileLoads<DT>::kChunks][2];  // a folded gradient's activation input, from `staged`
      if constexpr (folds_grad(FOLD)) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#pragma unroll
        for (int c8 = 0; c8 < TileLoads<DT>::kChunks; ++c8)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int l = 0; l < Vec8<DT>::kLoads; ++l)
              ax[c8][h].raw[l] = staged[((c8 * 2 + h) * Vec8<DT>::kLoads + l) * kThreads + tid];
      }
      const TileLoads<DT> cur = next;
      prefetch(t + gridDim.x, k);
      float sums[16] = {};
#pragma unroll
      for (int c8 = 0; c8 < TileLoads<DT>::kChunks; ++c8) {
        const int ch = tid + c8 * kThreads, r = ch >> 3, c = (ch & 7) * 16;
        uint32_t w[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float f[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            f[i] = folded<FOLD>(cur.x[c8][h].get(i), folds_grad(FOLD) ? ax[c8][h].get(i) : 0.0f);
            amax = max(amax, abs_bits(f[i]));
            if constexpr (DBIAS) sums[8 * h + i] += f[i];
          }
          w[2 * h] = cast4<E5M2>(f[0] * scale, f[1] * scale, f[2] * scale, f[3] * scale);
          w[2 * h + 1] = cast4<E5M2>(f[4] * scale, f[5] * scale, f[6] * scale, f[7] * scale);
        }
        const uint4 codes = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(it.out + (R0 + r) * cols + C0 + c) = codes;
        *reinterpret_cast<uint4*>(tile + tile_at(r, c)) = codes;
      }
      if constexpr (DBIAS) tile_column_sums(sums, col_part, dbias_partials, lt / it.tiles_c, C0, cols);
      __syncthreads();
      // Phase 2: transposed row c (input column C0 + c), input rows r0..r0+15: one 16-byte store
      // when rows keeps the transposed rows 16-byte aligned, else 16 byte stores (e.g. a vocabulary
      // of 50257 rows still gets the vector loads and the row-major stores of phase 1).
      store_tile_transposed<kThreads>(tile, it.out_t, rows, R0, C0, it.rows_aligned);
      parity ^= 1;
    } else {
      // Edge or unaligned tile: element by element, rows spread over the threads.
      for (int64_t e = tid; e < int64_t{kTile} * kTile; e += kThreads) {
        const int64_t r = R0 + e / kTile, c = C0 + e % kTile;
        if (r >= rows || c >= cols) continue;
        const float x = value<DT, FOLD>(in, it.act_x, r * cols + c);
        amax = max(amax, abs_bits(x));
        const uint8_t q = cast1<E5M2>(x * scale);
        it.out[r * cols + c] = q;
        it.out_t[c * rows + r] = q;
      }
      if constexpr (DBIAS) {
        // One column per thread, rows in order (edge tiles are few; they read their input twice).
        if (tid < kTile && C0 + tid < cols) {
          float total = 0.0f;
          for (int64_t r = R0; r < R0 + kTile && r < rows; ++r)
            total += value<DT, FOLD>(in, it.act_x, r * cols + C0 + tid);
          dbias_partials[(lt / it.tiles_c) * cols + C0 + tid] = total;
        }
      }
      prefetch(t + gridDim.x, k);
    }
  }
  // Each item's scale_inv and scale, written by the block that takes its first tile.
  for (int i = 0; i < g.count; ++i) {
    const CastItem& it = g.item[i];
    if (tid == 0 && it.first_tile % gridDim.x == blockIdx.x) {
      *it.out_scale_inv = it.state->scale_inv;
      *it.out_t_scale_inv = it.state->scale_inv;
      if (it.out_scale) *it.out_scale = cast_scale_value(it.state, current_max, current_pow2);
    }
  }
  block_amax_accumulate(amax, scaling_history(g.item[k].state), nullptr);
}

}  // namespace

namespace {

CastItem cast_item(const QuantizeJob& j, int64_t first_tile) {
  CastItem it{};
  it.in = j.in;
  it.act_x = j.act_x;
  it.out = j.out;
  it.out_t = j.out_t;
  it.rows = j.rows;
  it.cols = j.cols;
  it.tiles_c = (j.cols + kTile - 1) / kTile;
  it.first_tile = first_tile;
  // Phase 1 (loads and row-major stores) needs 16-byte aligned rows of `in` and `out`; phase 2's
  // vector stores need 16-byte aligned rows of `out_t`.
  it.cols_aligned = j.cols % 16 == 0 && aligned16(j.in) && aligned16(j.out) && (!j.act_x || aligned16(j.act_x));
  it.rows_aligned = j.rows % 16 == 0 && aligned16(j.out_t);
  it.state = j.state;
  it.out_scale_inv = j.out_scale_inv.ptr;
  it.out_t_scale_inv = j.out_t_scale_inv.ptr;
  it.out_scale = j.out_scale.ptr;
  return it;
}

int64_t tile_count(const QuantizeJob& j) {
  return ((j.rows + kTile - 1) / kTile) * ((j.cols + kTile - 1) / kTile);
}

template <int N>
void launch_items(const CastItems<N>& g, fp8_dtype_t dtype, bool e5m2, bool dbias, const QuantizeJob& first,
                  const LaunchLimits& lim, cudaStream_t stream) {
  auto launch = [&](auto dt, auto e5, auto db, auto fold) {
    auto* kernel =
        cast_transpose_kernel<decltype(dt)::value, decltype(e5)::value, decltype(db)::value, N, decltype(fold)::value>;
    constexpr size_t staged = folds_grad(decltype(fold)::value) ? kStagedBytes<decltype(dt)::value> : 0;
    // Every resident slot filled (not a balanced grid): the prefetch needs the occupancy more.
    const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, g.tiles, lim.sm_count, false, staged);
    kernel<<<grid, kThreads, staged, stream>>>(g, first.current ? first.current_fp8_max : 0.0f, first.current_pow2,
                                               first.dbias_partials);
  };
  using None = std::integral_constant<int, kNoFold>;
  const bool relu = first.act == FP8_ACTIVATION_RELU;
  dispatch(dtype, e5m2, [&](auto dt, auto e5) {
    if constexpr (N == 1) {  // a single cast: column sums, a folded activation
      auto with_fold = [&](auto db) {
        if (first.act_x) {  // (a gradient: the dy cast, E5M2 under HYBRID, with or without column sums)
          if (relu) return launch(dt, e5, db, std::integral_constant<int, FP8_ACTIVATION_RELU>{});
          return launch(dt, e5, db, std::integral_constant<int, FP8_ACTIVATION_GELU>{});
        }
        if (first.act_forward) {  // (forward: x's E4M3 cast, no column sums)
          if constexpr (!std::decay_t<decltype(db)>::value && !std::decay_t<decltype(e5)>::value) {
            if (relu) return launch(dt, e5, db, std::integral_constant<int, kForward + FP8_ACTIVATION_RELU>{});
            return launch(dt, e5, db, std::integral_constant<int, kForward + FP8_ACTIVATION_GELU>{});
          } else {
            fail(FP8_ERR_INTERNAL, "an activation folds forward only into an E4M3 cast without column sums");
          }
        }
        launch(dt, e5, db, None{});
      };
      if (dbias) return with_fold(std::true_type{});
      return with_fold(std::false_type{});
    } else {
      launch(dt, e5, std::false_type{}, None{});
    }
  });
  cuda_check(cudaGetLastError(), "cast_transpose kernel launch");
}

}  // namespace

void cast_transpose(const QuantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  CastItems<1> g{};
  g.item[0] = cast_item(j, 0);
  g.count = 1;
  g.tiles = tile_count(j);
  launch_items(g, j.in_dtype, j.e5m2, j.dbias != nullptr, j, lim, stream);
  if (j.dbias) bias_grad_finish(j.dbias_partials, j.rows, j.cols, j.dbias, lim, stream);
}

void cast_transpose_group(const QuantizeJob* jobs, size_t count, const LaunchLimits& lim, cudaStream_t stream) {
  for (size_t at = 0; at < count; at += kMaxGroup) {
    CastItems<kMaxGroup> g{};
    for (size_t i = at; i < count && i < at + kMaxGroup; ++i) {
      g.item[g.count++] = cast_item(jobs[i], g.tiles);
      g.tiles += tile_count(jobs[i]);
    }
    launch_items(g, jobs[at].in_dtype, jobs[at].e5m2, false, jobs[at], lim, stream);
  }
}

}  // namespace fp8::kernels
