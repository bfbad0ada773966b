// Fused amax + quantize for the scaling recipes (core/recipe_scaling_rule.hpp), bit for bit the CPU
// reference (backend/cpu_recipe_quantize.cpp). Blocks walk the 128 x 128 tiles of the input (a
// tile holds every cell of the block modes whole), each tile loaded once into registers (16
// columns of 4 rows per thread, 16-byte loads where the tile is whole and aligned; the next tile's
// loads issued before this one is worked on, except in the per-column +T modes: kPrefetch), then
// reduced to the amax of each 128-wide row segment (1x128 cells of `out`) or of the tile (128x128
// cells, the same for both layouts), and cast with the scale of each value's cell into `out`
// row-major. The transposed copy `out_t` (quantised along its own K) is written through a shared
// tile of codes where both layouts share a scale; where each column has its own (per-row, and
// 1x128 whose cells are 128-high column segments), the input tile goes to shared memory and is
// cast from column strips (StripTile). The per-row and per-tensor modes need amaxes that span
// tiles: a first pass (line_amax_kernel, or the amax kernel) puts them into the job's workspace, so
// those modes read the input twice. Edge tiles load element by element (missing elements count as
// 0, which changes no amax) and store only what exists. The per-row mode without the transposed
// copy reads the input once where a row fits a block's registers (row_quantize_kernel: one row per
// block at a time, its amax reduced in the block).
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = 256, kTile = 128;

template <fp8_dtype_t DT>
using Tile = TileLoads128<DT, kThreads>;

// The same share of an edge tile (or one whose rows are not 16-byte aligned), element by element;
// elements outside the input are +0.
template <fp8_dtype_t DT>
__device__ __forceinline__ void load_edge(Tile<DT>& t, const typename Wide<DT>::Raw* in, int64_t rows, int64_t cols,
                                          int64_t R0, int64_t C0) {
  using Raw = typename Wide<DT>::Raw;
#pragma unroll
  for (int k = 0; k < Tile<DT>::kChunks; ++k) {
    const int ch = threadIdx.x + k * kThreads;
    const int64_t r = R0 + (ch >> 3), c0 = C0 + (ch & 7) * 16;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      reinterpret_cast<Raw*>(t.x[k][i >> 3].raw)[i & 7] = r < rows && c0 + i < cols ? in[r * cols + c0 + i] : Raw{};
  }
}

// The largest of m over the 8 lanes that hold one row of the tile (every one of them gets it).
__device__ __forceinline__ uint32_t row_max8(uint32_t m) {
  m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  return max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
}

// The amaxes compare magnitudes as raw bits, the sign bit cleared: a 16-bit input two values a
// word (bf16 and f16 bits order like their magnitudes, NaN above infinity, as float bits do, and
// widen monotonically, so the largest raw magnitude widens to the largest float one), F32 one a
// word. Half the instructions of widening every value first, and half the registers for the tile's
// 16 column maxima per thread.
template <fp8_dtype_t DT>
struct Magnitudes {
  static constexpr bool kPacked = sizeof(typename Wide<DT>::Raw) == 2;
  static constexpr int kWords = kPacked ? 8 : 16;  // per chunk of 16 values
  // A raw word with its values' signs cleared.
  static __device__ __forceinline__ uint32_t magnitude(uint32_t w) { return w & (kPacked ? 0x7FFF7FFFu : 0x7FFFFFFFu); }
  // Word j of chunk k of a thread's share of the tile, signs cleared.
  static __device__ __forceinline__ uint32_t word(const Tile<DT>& t, int k, int j) {
    return magnitude(reinterpret_cast<const uint32_t*>(t.x[k][j / (kWords / 2)].raw)[j % (kWords / 2)]);
  }
  static __device__ __forceinline__ uint32_t max(uint32_t a, uint32_t b) {
    if constexpr (kPacked)
      return __vmaxu2(a, b);  // (max.u16x2 on sm_90)
    else
      return ::max(a, b);
  }
  // Value `half` (0 or 1: the low and high 16 bits; F32: 0) of raw word w, widened.
  static __device__ __forceinline__ float value(uint32_t w, int half) {
    if constexpr (kPacked)
      return Wide<DT>::to_float(static_cast<typename Wide<DT>::Raw>(half ? w >> 16 : w & 0xFFFFu));
    else
      return bits_float(w);
  }
  // Its float abs bits.
  static __device__ __forceinline__ uint32_t value_bits(uint32_t w, int half) { return abs_bits(value(w, half)); }
  // The float abs bits of the larger of w's values.
  static __device__ __forceinline__ uint32_t amax_bits(uint32_t w) {
    if constexpr (kPacked)
      return value_bits(::max(w & 0xFFFFu, w >> 16), 0);
    else
      return w;
  }
  // The amax of chunk k (its 16 values, one row).
  static __device__ __forceinline__ uint32_t chunk_amax(const Tile<DT>& t, int k) {
    uint32_t m = word(t, k, 0);
#pragma unroll
    for (int j = 1; j < kWords; ++j) m = max(m, word(t, k, j));
    return amax_bits(m);
  }
};

// The column maxima of a tile in shared memory (tile_column_max) sit at column_slot(c): 16 columns a
// thread, each thread's group 20 words after the one before, so that the 8 threads of a row, each at
// its own 16 columns, reach 8 different sets of 4 banks (at 16 words apart, 4 of them shared a set:
// ncu counted 66% excess shared wavefronts where the 1x128 +T quantize used them).
constexpr int kColumnSlots = kTile / 16 * 20;
__device__ __forceinline__ int column_slot(int c) {
  return c + (c >> 4) * 4;
}

// The amax of each of the tile's 128 columns, from every thread's column maxima over its chunks
// (cm: Magnitudes words of its 16 columns): thread c < 128 gets column c's (the others 0), read
// from every warp's entries in col_part after a barrier. A caller that wrote col_part again would
// need another barrier first (line_amax_kernel takes one tile a block and does not).
template <fp8_dtype_t DT>
__device__ __forceinline__ uint32_t tile_column_max(uint32_t (&cm)[Magnitudes<DT>::kWords],
                                                    uint32_t (*col_part)[kColumnSlots]) {
  using M = Magnitudes<DT>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c0 = (tid & 7) * 16;
#pragma unroll
  for (int j = 0; j < M::kWords; ++j) {
    cm[j] = M::max(cm[j], __shfl_xor_sync(0xFFFFFFFFu, cm[j], 8));
    cm[j] = M::max(cm[j], __shfl_xor_sync(0xFFFFFFFFu, cm[j], 16));
  }
  if (lane < 8) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      col_part[warp][column_slot(c0) + i] = M::value_bits(cm[i * M::kWords / 16], i % (16 / M::kWords));
  }
  __syncthreads();
  uint32_t m = 0;
  if (tid < kTile) {
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, col_part[w][column_slot(tid)]);
  }
  return m;
}

// A thread's column maxima (Magnitudes words) over its chunks of the tile.
template <fp8_dtype_t DT>
__device__ __forceinline__ void column_maxima(const Tile<DT>& t, uint32_t (&cm)[Magnitudes<DT>::kWords]) {
  using M = Magnitudes<DT>;
#pragma unroll
  for (int j = 0; j < M::kWords; ++j) {
    cm[j] = M::word(t, 0, j);
#pragma unroll
    for (int k = 1; k < Tile<DT>::kChunks; ++k) cm[j] = M::max(cm[j], M::word(t, k, j));
  }
}

// Row and column amaxes (abs bits) for the per-row mode: atomic maxima of each tile's.
// (Three blocks per SM named: left to itself, ptxas picked 64 registers and spilled.)
template <fp8_dtype_t DT>
__global__ void __launch_bounds__(kThreads, 3)
    line_amax_kernel(const typename Wide<DT>::Raw* __restrict__ in, int64_t rows, int64_t cols, bool vec_ok,
                     uint32_t* row_amax, uint32_t* col_amax) {
  __shared__ uint32_t col_part[kThreads / 32][kColumnSlots];
  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t R0 = (blockIdx.x / tiles_c) * kTile, C0 = (blockIdx.x % tiles_c) * kTile;
  const int tid = threadIdx.x;
  Tile<DT> v;
  if (vec_ok && R0 + kTile <= rows && C0 + kTile <= cols) v.issue(in, cols, R0, C0);
  else
    load_edge<DT>(v, in, rows, cols, R0, C0);
#pragma unroll
  for (int k = 0; k < Tile<DT>::kChunks; ++k) {
    const uint32_t m = row_max8(Magnitudes<DT>::chunk_amax(v, k));
    const int64_t r = R0 + (tid >> 3) + 32 * k;
    if ((tid & 7) == 0 && r < rows && m != 0u) atomicMax(row_amax + r, m);
  }
  uint32_t cm[Magnitudes<DT>::kWords];
  column_maxima(v, cm);
  const uint32_t m = tile_column_max<DT>(cm, col_part);
  if (tid < kTile && C0 + tid < cols && m != 0u) atomicMax(col_amax + C0 + tid, m);
}

struct Params {
  int64_t rows, cols;
  bool vec_ok;            // 16-byte loads and stores of whole tiles (cols % 16, aligned buffers)
  bool rows_aligned;      // 16-byte stores of out_t rows
  uint8_t* out;
  uint8_t* out_t;         // nullptr: no transposed copy
  float* si;              // out's grid: cell (i, j) at i * ld + j, or j * ld + i when cm
  int64_t ld;
  bool cm;
  float* si_t;            // out_t's grid, likewise
  int64_t ld_t;
  bool cm_t;
  float fp8_max;          // scaled_fp8_max(e5m2, margin)
  bool pow2;
  const uint32_t* ws;     // per-row: row amaxes then column amaxes; per-tensor: the amax
  unsigned long long* nonfinite;  // nullptr: not counted
};

// Writes cell (i, j) of out's grid and counts it when its amax is not finite.
__device__ __forceinline__ void put_cell(const Params& p, int64_t i, int64_t j, float scale, uint32_t amax) {
  p.si[p.cm ? j * p.ld + i : i * p.ld + j] = recipe_scale_inv(scale);
  if (p.nonfinite && !is_finite_bits(amax)) atomicAdd(p.nonfinite, 1ull);
}
// Writes cell (i, j) of the transposed copy's grid.
__device__ __forceinline__ void put_cell_t(const Params& p, int64_t i, int64_t j, float scale) {
  p.si_t[p.cm_t ? j * p.ld_t + i : i * p.ld_t + j] = recipe_scale_inv(scale);
}

// The cells an empty operand still has, each with the scale of amax 0: the per-tensor mode's one,
// and in the per-row mode one per row of the operand and of its transposed copy.
__global__ void empty_operand_kernel(const Params p, bool per_tensor) {
  const float s = recipe_scale(0.0f, p.fp8_max, p.pow2);
  const int64_t lines = per_tensor ? 1 : max(p.rows, p.cols);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < lines;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (per_tensor || i < p.rows) put_cell(p, i, 0, s, 0u);
    if (p.out_t && (per_tensor || i < p.cols)) put_cell_t(p, i, 0, s);
  }
}

// The per-row mode without the transposed copy in one read: one row per block at a time (the next
// row's loads issued before this one is reduced), thread t holding its 8-column groups t, t + 256,
// ... (NV of them: cols <= NV * 8 * kThreads, cols % 8 == 0, 16-byte aligned input and output);
// the row's amax reduced over the block, then its codes and its grid cell written.
constexpr int kRowGroups = 8;  // at most: rows of up to 16384 columns
template <fp8_dtype_t DT, bool E5M2, int NV>
__global__ void __launch_bounds__(kThreads)
    row_quantize_kernel(const typename Wide<DT>::Raw* __restrict__ in, const Params p) {
  __shared__ uint32_t warp_max[kThreads / 32];
  const int t = threadIdx.x;
  const auto has = [&](int k) { return (static_cast<int64_t>(k) * kThreads + t) * 8 < p.cols; };
  Vec8<DT> next[NV];
  const auto issue = [&](int64_t r) {
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (has(k)) next[k].load(in + r * p.cols + (static_cast<int64_t>(k) * kThreads + t) * 8);
  };
  if (blockIdx.x < p.rows) issue(blockIdx.x);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    Vec8<DT> cur[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) cur[k] = next[k];
    if (r + gridDim.x < p.rows) issue(r + gridDim.x);
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (has(k))
#pragma unroll
        for (int i = 0; i < 8; ++i) m = max(m, abs_bits(cur[k].get(i)));
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((t & 31) == 0) warp_max[t >> 5] = m;
    __syncthreads();
    uint32_t amax = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) amax = max(amax, warp_max[w]);
    const float scale = recipe_scale(bits_float(amax), p.fp8_max, p.pow2);
    if (t == 0) put_cell(p, r, 0, scale, amax);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!has(k)) continue;
      const auto v = [&](int i) { return cur[k].get(i) * scale; };
      *reinterpret_cast<uint2*>(p.out + r * p.cols + (static_cast<int64_t>(k) * kThreads + t) * 8) =
          make_uint2(cast4<E5M2>(v(0), v(1), v(2), v(3)), cast4<E5M2>(v(4), v(5), v(6), v(7)));
    }
    __syncthreads();  // warp_max is written again for the next row
  }
}

// The transposed copy of the per-column modes (per-row and 1x128: a scale per column of the tile)
// is cast from a copy of the input tile in shared memory, read back in column strips. A warp's
// quarter (8 lanes) takes one 32-bit column of words (two columns of a 16-bit input, one of F32),
// lane j its rows 16j .. 16j + 15, so a column's amax over the tile's 128 rows is reduced inside
// the quarter with three shuffles (no barrier, no shared partials), and each lane stores 16
// contiguous codes of a transposed row. Within each 32-word span of a row, the 16-byte pieces are
// XOR-permuted by ((r / 16) ^ (w / 32)) % 8, so that a strip read (8 lanes at rows 16 apart, 4 word
// columns) reaches 32 different banks, and so do 8 lanes' 16-byte stores of one row's chunks
// (served 8 lanes at a time). The permutation is the same for the 16 rows of a lane's strip, so its
// words lie kRowWords apart: one address a strip, the rows as immediate offsets (a term in r % 8,
// here before, cost 16 address computations a strip, about 8% of the 1x128 +T kernel's
// instructions). Two buffers, alternate tiles, so one barrier a tile suffices.
template <fp8_dtype_t DT>
struct StripTile {
  static constexpr int kRowWords = kTile * static_cast<int>(sizeof(typename Wide<DT>::Raw)) / 4;  // 64 or 128
  static constexpr size_t kBytes = size_t{kTile} * kRowWords * 4;                                 // one buffer
  static __device__ __forceinline__ int at(int r, int w) {
    return r * kRowWords + (w ^ ((((r >> 4) ^ (w >> 5)) & 7) << 2));
  }
  // Strip j of word column w (rows 16j .. 16j + 15): its row i is strip(buf, j, w)[i * kRowWords].
  static __device__ __forceinline__ const uint32_t* strip(const uint32_t* buf, int j, int w) {
    return buf + at(16 * j, w);
  }
  // Copies a thread's share of the tile (Tile<DT>'s chunks, 16-byte pieces) into buffer `buf`.
  static __device__ __forceinline__ void put(uint32_t* buf, const Tile<DT>& t) {
    constexpr int kPieces = 2 * Vec8<DT>::kLoads;  // 16-byte pieces per chunk of 16 values: 2 or 4
#pragma unroll
    for (int k = 0; k < Tile<DT>::kChunks; ++k) {
      const int r = (threadIdx.x >> 3) + k * (kThreads / 8), w0 = (threadIdx.x & 7) * kPieces * 4;
#pragma unroll
      for (int q = 0; q < kPieces; ++q)
        *reinterpret_cast<uint4*>(buf + at(r, w0 + 4 * q)) = t.x[k][q / Vec8<DT>::kLoads].raw[q % Vec8<DT>::kLoads];
    }
  }
};

// The modes with a scale per column of the tile, whose transposed copy is cast from the strips, and
// the dynamic shared memory a launch of the kernel takes for them (the strips' two buffers).
template <ScaleMode MODE>
constexpr bool kPerColumn = MODE == ScaleMode::kRow || MODE == ScaleMode::kBlock1x128;
template <fp8_dtype_t DT, ScaleMode MODE, bool WITH_T>
constexpr size_t kStripBytes = kPerColumn<MODE>&& WITH_T ? 2 * StripTile<DT>::kBytes : 0;

// The transposed copy of a per-column mode's tile from its strips (after the barrier that follows
// StripTile::put): each lane's column(s), rows 16j .. 16j + 15, their amax (1x128: over the quarter;
// per-row: the column's, from the workspace), scale, grid cell and 16 codes. WHOLE: the tile is
// whole and out_t's rows take 16-byte stores, so no column or row is checked (a separate instance:
// the checks and their branches were about a tenth of the strips' instructions).
template <fp8_dtype_t DT, bool E5M2, ScaleMode MODE, bool WHOLE>
__device__ __forceinline__ void cast_column_strips(const uint32_t* strips, const Params& p, int64_t R0, int64_t C0,
                                                   int64_t tr) {
  using M = Magnitudes<DT>;
  constexpr int kHalves = M::kPacked ? 2 : 1;  // columns per word
  const int lane = threadIdx.x & 31, j = lane & 7;
#pragma unroll
  for (int it = 0; it < StripTile<DT>::kRowWords / (kThreads / 8); ++it) {
    const int wc = it * (kThreads / 8) + (threadIdx.x >> 3);  // this quarter's word column
    uint32_t amax[kHalves];                                   // the columns' amaxes (abs bits)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int64_t col = C0 + wc * kHalves + h;
      amax[h] = MODE == ScaleMode::kRow && (WHOLE || col < p.cols) ? p.ws[p.rows + col] : 0u;
    }
    const uint32_t* strip = StripTile<DT>::strip(strips, j, wc);
    uint32_t v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = strip[i * StripTile<DT>::kRowWords];
    if constexpr (MODE == ScaleMode::kBlock1x128) {  // over the quarter's 128 rows
      uint32_t m;
      m = M::magnitude(v[0]);
#pragma unroll
      for (int i = 1; i < 16; ++i) m = M::max(m, M::magnitude(v[i]));
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) m = M::max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
#pragma unroll
      for (int h = 0; h < kHalves; ++h) amax[h] = M::value_bits(m, h);  // (0 for missing columns)
    }
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int64_t col = C0 + wc * kHalves + h;
      const float scale = recipe_scale(bits_float(amax[h]), p.fp8_max, p.pow2);
      if (j == 0 && (WHOLE || col < p.cols) && (MODE != ScaleMode::kRow || tr == 0))
        put_cell_t(p, col, MODE == ScaleMode::kRow ? 0 : tr, scale);
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const auto x = [&](int i) { return M::value(v[4 * q + i], h) * scale; };
        w[q] = cast4<E5M2>(x(0), x(1), x(2), x(3));
      }
      uint8_t* dst = p.out_t + col * p.rows + R0 + 16 * j;
      if constexpr (WHOLE) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      } else if (col < p.cols) {  // (an edge tile's missing columns)
        for (int i = 0; i < 16 && R0 + 16 * j + i < p.rows; ++i)
          dst[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
      }
    }
  }
}

// The next whole tile's loads in flight while this one is reduced, cast and stored (as
// cast_transpose does), two blocks an SM (16-bit inputs: 128 registers) -- except per-row and 1x128
// with the transposed copy: no prefetch, three blocks an SM (<= 80 registers, no spills). Those
// kernels stall on their own dependency chains (the strips' shared reads, the scales) more than on
// the loads, and 24 warps an SM hide them better than 16 with a tile in flight. Same-call A/B on an
// H200: per-row +T 73-74 -> 77% of copy at 8192x8192 and 79-80 -> 82-83% at 16384x8192, 1x128 +T
// +0.5-1 point; per-tensor +T and 128x128 +T lost 1-2 points without the prefetch, and the modes
// without +T nothing clear, so they keep it. F32 tiles take more registers (and +T, shared memory):
// one block an SM, with the prefetch.
template <fp8_dtype_t DT, ScaleMode MODE, bool WITH_T>
constexpr bool kPrefetch = DT == FP8_DTYPE_F32 || !kPerColumn<MODE> || !WITH_T;
template <fp8_dtype_t DT, ScaleMode MODE, bool WITH_T>
constexpr int kMinBlocks = DT == FP8_DTYPE_F32 ? 1 : (kPrefetch<DT, MODE, WITH_T> ? 2 : 3);

// Grid-stride over the tiles. (Staged into shared memory with cp.async instead, at three blocks per
// SM and 80 registers, it ran at 60-70% of copy where this runs at 75-89%: the L2's throughput, not
// the DRAM's, became the limit.)
template <fp8_dtype_t DT, bool E5M2, ScaleMode MODE, bool WITH_T>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<DT, MODE, WITH_T>))
    recipe_quantize_kernel(const typename Wide<DT>::Raw* __restrict__ in, const Params p) {
  constexpr int kChunks = Tile<DT>::kChunks;
  constexpr bool per_column = kPerColumn<MODE>, prefetch = kPrefetch<DT, MODE, WITH_T>;
  // The transposed copy's codes: through the shared code tile (one scale for both layouts), or cast
  // from column strips (per_column: the launch gives kStripBytes of dynamic memory).
  // Everything shared comes twice, alternate tiles using alternate copies, so that no barrier is
  // needed between one tile's last reads and the next tile's writes: a copy is written again two
  // tiles later, after a barrier that every thread reaches only once done with it.
  // (WITH_T, the transposed copy, is a template parameter: each path gets its own registers.)
  __shared__ __align__(16) uint8_t code_tiles[2][per_column || !WITH_T ? 16 : kCodeTileBytes];
  extern __shared__ uint4 strip_buffers[];
  __shared__ uint32_t warp_maxima[2][kThreads / 32];  // 128x128: each warp's maximum
  const int64_t tiles_c = (p.cols + kTile - 1) / kTile, tiles = ((p.rows + kTile - 1) / kTile) * tiles_c;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c0 = (tid & 7) * 16;
  int parity = 0;  // which copy this tile uses
  auto whole = [&](int64_t t) {
    return p.vec_ok && (t / tiles_c + 1) * kTile <= p.rows && (t % tiles_c + 1) * kTile <= p.cols;
  };
  // The per-tensor mode's amax and scale, once (the compiler cannot hoist the load: the kernel's
  // stores might alias it).
  const uint32_t tensor_amax = MODE == ScaleMode::kTensor ? p.ws[0] : 0u;
  const float tensor_scale = recipe_scale(bits_float(tensor_amax), p.fp8_max, p.pow2);
  Tile<DT> next;  // (prefetch: the next whole tile's loads)
  if (prefetch && blockIdx.x < tiles && whole(blockIdx.x))
    next.issue(in, p.cols, (blockIdx.x / tiles_c) * kTile, (blockIdx.x % tiles_c) * kTile);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t tr = t / tiles_c, tc = t % tiles_c, R0 = tr * kTile, C0 = tc * kTile;
    const bool vector = whole(t);
    uint8_t* tile = code_tiles[parity];
    uint32_t* warp_max = warp_maxima[parity];
    Tile<DT> cur;
    if (vector) {
      if constexpr (prefetch)
        cur = next;
      else
        cur.issue(in, p.cols, R0, C0);
    } else {
      load_edge<DT>(cur, in, p.rows, p.cols, R0, C0);
    }
    const int64_t t_next = t + gridDim.x;
    if (prefetch && t_next < tiles && whole(t_next))
      next.issue(in, p.cols, (t_next / tiles_c) * kTile, (t_next % tiles_c) * kTile);

    // Scales of this thread's rows (the out layout) ... Chunk k is row tid / 8 + 32 k for all 8
    // lanes of a row group. Spread: lane k of the group computes chunk k's scale (one division a
    // lane, not one a chunk) and writes its grid cell; the others take the scales by shuffles. (Not
    // in the 1x128 +T kernel: it ran 2-4 points of copy slower there on H200s, at 128 registers
    // and again at 119, both with the prefetch at two blocks an SM; not measured since at three.)
    constexpr bool spread = per_column && !(MODE == ScaleMode::kBlock1x128 && WITH_T);
    static_assert(kChunks <= 8, "a chunk per lane of the row group");
    const int group_lane = tid & 7;
    uint32_t row_amax[kChunks] = {};  // 1x128: each chunk's row
    uint32_t my_amax = 0;             // spread: chunk group_lane's row
    if constexpr (MODE == ScaleMode::kBlock1x128) {
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        row_amax[k] = row_max8(Magnitudes<DT>::chunk_amax(cur, k));
        if (group_lane == k) my_amax = row_amax[k];
      }
    } else if constexpr (MODE == ScaleMode::kRow) {
      const int64_t r = R0 + (tid >> 3) + 32 * group_lane;
      if (group_lane < kChunks && r < p.rows) my_amax = p.ws[r];
    }
    // ... or of the whole tile (128x128: each thread's maximum, then the warps', through shared memory).
    uint32_t cell_amax = tensor_amax;  // per-tensor and 128x128: the one cell's
    if constexpr (MODE == ScaleMode::kBlock128x128) {
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) m = max(m, Magnitudes<DT>::chunk_amax(cur, k));
      m = __reduce_max_sync(0xFFFFFFFFu, m);
      if (lane == 0) warp_max[warp] = m;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kThreads / 32; ++i) cell_amax = max(cell_amax, warp_max[i]);
    }
    const float cell_scale =
        MODE == ScaleMode::kTensor ? tensor_scale : recipe_scale(bits_float(cell_amax), p.fp8_max, p.pow2);
    const float my_scale = spread ? recipe_scale(bits_float(my_amax), p.fp8_max, p.pow2) : 0.f;
    float row_scale[kChunks];
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
      row_scale[k] = !per_column ? cell_scale
                     : spread    ? __shfl_sync(0xFFFFFFFFu, my_scale, (lane & ~7) | k)
                                 : recipe_scale(bits_float(row_amax[k]), p.fp8_max, p.pow2);
    uint32_t* strips = reinterpret_cast<uint32_t*>(strip_buffers) + parity * (StripTile<DT>::kBytes / 4);
    if (per_column && WITH_T) StripTile<DT>::put(strips, cur);

    // The grid cells of out (each written, and counted, once).
    if constexpr (spread) {
      const int64_t r = R0 + (tid >> 3) + 32 * group_lane;
      if (group_lane < kChunks && r < p.rows && (MODE == ScaleMode::kBlock1x128 || tc == 0))
        put_cell(p, r, MODE == ScaleMode::kRow ? 0 : tc, my_scale, my_amax);
    } else if constexpr (per_column) {  // (1x128 +T)
      if ((tid & 7) == 0) {
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          const int64_t r = R0 + (tid >> 3) + 32 * k;
          if (r < p.rows) put_cell(p, r, tc, row_scale[k], row_amax[k]);
        }
      }
    } else if (tid == 0 && (MODE == ScaleMode::kBlock128x128 || t == 0)) {
      put_cell(p, MODE == ScaleMode::kTensor ? 0 : tr, MODE == ScaleMode::kTensor ? 0 : tc, cell_scale, cell_amax);
      if (WITH_T) put_cell_t(p, MODE == ScaleMode::kTensor ? 0 : tc, MODE == ScaleMode::kTensor ? 0 : tr, cell_scale);
    }

    // The codes: out row-major; the transposed copy's codes into the shared tile.
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int r = (tid >> 3) + 32 * k;
      const float s = row_scale[k];
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        w[q] = cast4<E5M2>(cur.get(k, 4 * q) * s, cur.get(k, 4 * q + 1) * s, cur.get(k, 4 * q + 2) * s,
                           cur.get(k, 4 * q + 3) * s);
      uint8_t* dst = p.out + (R0 + r) * p.cols + C0 + c0;
      if (vector) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      } else if (R0 + r < p.rows) {
        for (int i = 0; i < 16 && C0 + c0 + i < p.cols; ++i) dst[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
      }
      if (!per_column && WITH_T) *reinterpret_cast<uint4*>(tile + tile_at(r, c0)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (per_column && WITH_T) {
      __syncthreads();  // the strips are in shared memory
      if (vector && p.rows_aligned)
        cast_column_strips<DT, E5M2, MODE, true>(strips, p, R0, C0, tr);
      else
        cast_column_strips<DT, E5M2, MODE, false>(strips, p, R0, C0, tr);
    } else if (WITH_T) {
      __syncthreads();
      if (vector) {
        store_tile_transposed<kThreads>(tile, p.out_t, p.rows, R0, C0, p.rows_aligned);
      } else {
        for (int e = tid; e < kTile * kTile; e += kThreads) {
          const int c = e / kTile, r = e % kTile;
          if (R0 + r < p.rows && C0 + c < p.cols) p.out_t[(C0 + c) * p.rows + R0 + r] = tile[tile_at(r, c)];
        }
      }
    }
    parity ^= 1;
  }
}

}  // namespace

void recipe_quantize(const RecipeQuantizeJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  const ScaleMode mode = j.out_scale_inv.mode;
  const int64_t n = j.rows * j.cols;
  const int64_t tiles = ((j.rows + kTile - 1) / kTile) * ((j.cols + kTile - 1) / kTile);
  Params p{};
  p.rows = j.rows;
  p.cols = j.cols;
  p.vec_ok = j.cols % 16 == 0 && aligned16(j.in) && aligned16(j.out);
  p.rows_aligned = j.rows % 16 == 0 && aligned16(j.out_t);
  p.out = j.out;
  p.out_t = j.out_t_scale_inv.ptr ? j.out_t : nullptr;
  p.si = j.out_scale_inv.ptr;
  p.ld = j.out_scale_inv.ld;
  p.cm = j.out_scale_inv.col_major;
  p.si_t = j.out_t_scale_inv.ptr;
  p.ld_t = j.out_t_scale_inv.ld;
  p.cm_t = j.out_t_scale_inv.col_major;
  p.fp8_max = scaled_fp8_max(j.e5m2, j.margin);
  p.pow2 = j.pow2_scales;
  p.ws = j.workspace;
  p.nonfinite = reinterpret_cast<unsigned long long*>(j.nonfinite_cells);
  if (n == 0) {  // no values: only the per-tensor and per-row modes have cells
    if (mode == ScaleMode::kTensor || mode == ScaleMode::kRow) {
      const int64_t lines = std::max<int64_t>(std::max(j.rows, j.cols), 1);
      empty_operand_kernel<<<static_cast<unsigned>(std::min<int64_t>((lines + kThreads - 1) / kThreads, 1024)), kThreads,
                             0, stream>>>(p, mode == ScaleMode::kTensor);
      cuda_check(cudaGetLastError(), "recipe quantize kernel launch");
    }
    return;
  }
  const bool one_read_rows = mode == ScaleMode::kRow && !p.out_t && j.cols % 8 == 0 &&
                             j.cols <= int64_t{kThreads} * 8 * kRowGroups && aligned16(j.in) && aligned16(j.out);
  dispatch_wide(j.in_dtype, [&](auto dt) {
    using Raw = typename Wide<decltype(dt)::value>::Raw;
    const Raw* in = static_cast<const Raw*>(j.in);
    if (one_read_rows) {
      const auto launch_rows = [&](auto e5m2, auto groups) {
        auto* kernel = row_quantize_kernel<decltype(dt)::value, decltype(e5m2)::value, decltype(groups)::value>;
        const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, j.rows, lim.sm_count);
        kernel<<<grid, kThreads, 0, stream>>>(in, p);
      };
      const auto by_width = [&](auto e5m2) {
        dispatch_groups<kRowGroups>((j.cols / 8 + kThreads - 1) / kThreads, [&](auto g) { launch_rows(e5m2, g); });
      };
      if (j.e5m2)
        by_width(std::true_type{});
      else
        by_width(std::false_type{});
      return;
    }
    if (mode == ScaleMode::kTensor) {
      amax({j.in, j.in_dtype, n, reinterpret_cast<float*>(j.workspace), nullptr}, lim, stream);
    } else if (mode == ScaleMode::kRow) {
      cuda_check(cudaMemsetAsync(j.workspace, 0, recipe_quantize_workspace(mode, j.rows, j.cols), stream),
                 "recipe quantize: clearing the row and column amaxes");
      line_amax_kernel<decltype(dt)::value><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(
          in, j.rows, j.cols, p.vec_ok, j.workspace, j.workspace + j.rows);
    }
    const auto launch_t = [&](auto e5m2, auto m, auto with_t) {
      auto* kernel = recipe_quantize_kernel<decltype(dt)::value, decltype(e5m2)::value, decltype(m)::value,
                                            decltype(with_t)::value>;
      constexpr size_t smem = kStripBytes<decltype(dt)::value, decltype(m)::value, decltype(with_t)::value>;
      // Every resident slot filled (not a balanced grid): the prefetch and the modes without it both
      // want every warp they can get.
      const int grid = grid_size(reinterpret_cast<const void*>(kernel), kThreads, tiles, lim.sm_count, false, smem);
      kernel<<<grid, kThreads, smem, stream>>>(in, p);
    };
    const auto launch = [&](auto e5m2, auto m) {
      if (p.out_t)
        launch_t(e5m2, m, std::true_type{});
      else
        launch_t(e5m2, m, std::false_type{});
    };
    const auto by_mode = [&](auto e5m2) {
      switch (mode) {
        case ScaleMode::kTensor: launch(e5m2, std::integral_constant<ScaleMode, ScaleMode::kTensor>{}); break;
        case ScaleMode::kRow: launch(e5m2, std::integral_constant<ScaleMode, ScaleMode::kRow>{}); break;
        case ScaleMode::kBlock1x128: launch(e5m2, std::integral_constant<ScaleMode, ScaleMode::kBlock1x128>{}); break;
        default: launch(e5m2, std::integral_constant<ScaleMode, ScaleMode::kBlock128x128>{}); break;
      }
    };
    if (j.e5m2) by_mode(std::true_type{});
    else by_mode(std::false_type{});
  });
  cuda_check(cudaGetLastError(), "recipe quantize kernel launch");
}

}  // namespace fp8::kernels
