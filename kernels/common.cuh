// Device helpers shared by the kernels: typed 16-byte loads and stores, the hardware FP8 cast, and
// the amax reduction. Numerics come from src/core/format.hpp.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/format.hpp"
#include "core/recipe_scaling_rule.hpp"
#include "fp8.h"

namespace fp8::kernels {

// Element access for each wide dtype: the raw storage type and exact widening/rounding.
template <fp8_dtype_t DT>
struct Wide;
template <>
struct Wide<FP8_DTYPE_F32> {
  using Raw = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <>
struct Wide<FP8_DTYPE_F16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t v) { return f16_to_float(v); }
  static __device__ __forceinline__ uint16_t from_float(float v) { return float_to_f16(v); }
};
template <>
struct Wide<FP8_DTYPE_BF16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t v) { return bf16_to_float(v); }
  static __device__ __forceinline__ uint16_t from_float(float v) { return float_to_bf16(v); }
};

// 8 consecutive elements = 16 bytes (2-byte types) or 32 bytes (f32), loaded with 16-byte accesses.
template <fp8_dtype_t DT>
struct Vec8 {
  static constexpr int kLoads = sizeof(typename Wide<DT>::Raw) * 8 / 16;
  uint4 raw[kLoads];
  __device__ __forceinline__ void load(const typename Wide<DT>::Raw* p) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) raw[k] = __ldg(reinterpret_cast<const uint4*>(p) + k);
  }
  __device__ __forceinline__ float get(int i) const {
    if constexpr (kLoads == 2) {
      return reinterpret_cast<const float*>(raw)[i];
    } else {
      return Wide<DT>::to_float(reinterpret_cast<const uint16_t*>(raw)[i]);
    }
  }
};

template <bool E5M2>
__device__ __forceinline__ uint8_t cast1(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

// Four scaled values -> four codes packed little-endian in one word (two cvt ...x2 instructions).
template <bool E5M2>
__device__ __forceinline__ uint32_t cast4(float a, float b, float c, float d) {
  const auto kind = E5M2 ? __NV_E5M2 : __NV_E4M3;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kind);
  return lo | (hi << 16);
}

// The largest of every thread's v in the block, in thread 0 (the other threads get their warp's).
// Every thread must call it; it starts with a barrier, so it may be called several times in a row.
__device__ __forceinline__ uint32_t block_max_to_thread0(uint32_t v) {
  __shared__ uint32_t warp_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  __syncthreads();
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>((blockDim.x + 31) >> 5) ? warp_max[lane] : 0u;
    v = __reduce_max_sync(0xFFFFFFFFu, v);
  }
  return v;
}

// Max-accumulates the block's largest v into *dst (an unsigned atomicMax; nothing for 0).
__device__ __forceinline__ void block_max_accumulate(uint32_t v, uint32_t* dst) {
  v = block_max_to_thread0(v);
  if (threadIdx.x == 0 && v != 0u) atomicMax(dst, v);
}

// The scale a cast of `state` multiplies by: the state's own (delayed scaling, current_max == 0),
// or under current scaling the one recipe_scale makes from the amax the launch put into history
// slot 0 before the kernel; block 0's thread 0 records it in the state (record_current_scale).
// Every block computes the same value; none reads the header's scale in that mode, and the amax the
// kernel accumulates into slot 0 at its end equals what is there, so nothing races.
// cast_scale_value is the same scale without recording it.
__device__ __forceinline__ float cast_scale_value(ScalingHeader* state, float current_max, bool current_pow2) {
  return current_max == 0.0f ? state->scale : recipe_scale(scaling_history(state)[0], current_max, current_pow2);
}
__device__ __forceinline__ float cast_scale(ScalingHeader* state, float current_max, bool current_pow2) {
  const float scale = cast_scale_value(state, current_max, current_pow2);
  if (current_max != 0.0f && blockIdx.x == 0 && threadIdx.x == 0)
    record_current_scale(state, scaling_history(state)[0], scale);
  return scale;
}

// Reduces each thread's amax bits over the block and max-accumulates the result into *dst (which
// holds non-negative float bits, so an unsigned atomicMax is a float max). Every thread must call it.
__device__ __forceinline__ void block_amax_accumulate(uint32_t v, float* dst0, float* dst1) {
  v = block_max_to_thread0(v);
  if (threadIdx.x == 0 && v != 0u) {
    if (dst0) atomicMax(reinterpret_cast<unsigned int*>(dst0), v);
    if (dst1) atomicMax(reinterpret_cast<unsigned int*>(dst1), v);
  }
}

// Sum of v over the block, returned to every thread, in a fixed order (deterministic). `scratch`
// is 32 floats of shared memory. The call starts with a barrier, so consecutive calls may share
// `scratch`; anything else written to it right after a call needs a barrier of its own first.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// A thread's share of a 128 x 128 tile of a row-major input, loaded 16 bytes at a time: chunk k is
// the 16 columns from (tid & 7) * 16 of row tid / 8 + k * THREADS / 8. Every load is issued before
// any is used, so a kernel can have the next tile's loads in flight while it works on this one.
template <fp8_dtype_t DT, int THREADS>
struct TileLoads128 {
  static constexpr int kChunks = 128 * 128 / 16 / THREADS;  // 16-column chunks per thread
  Vec8<DT> x[kChunks][2];
  // Issues all loads of this thread's chunks of the tile at (R0, C0) (a whole tile, 16-byte aligned rows).
  __device__ __forceinline__ void issue(const typename Wide<DT>::Raw* in, int64_t cols, int64_t R0, int64_t C0) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int ch = threadIdx.x + k * THREADS, r = ch >> 3, c = (ch & 7) * 16;
      const typename Wide<DT>::Raw* p = in + (R0 + r) * cols + C0 + c;
      x[k][0].load(p);
      x[k][1].load(p + 8);
    }
  }
  // Element i (0..15) of chunk k.
  __device__ __forceinline__ float get(int k, int i) const { return x[k][i >> 3].get(i & 7); }
};

// The 128 x 128 tile of FP8 codes through which the transposing casts turn a tile around in shared
// memory: rows of 128 bytes, the eight 16-byte chunks of row r permuted (chunk XOR 2 * ((r / 16) % 4))
// so that store_tile_transposed's reads fall in 32 different banks (with any pitch that keeps rows
// 16-byte aligned, rows 16 apart share banks). tile_at(r, c) is the byte offset of code (r, c); a
// 16-byte chunk (c a multiple of 16) stays contiguous.
constexpr int kCodeTileBytes = 128 * 128;
__device__ __forceinline__ int tile_at(int r, int c) {
  return r * 128 + (((c >> 4) ^ ((r >> 3) & 6)) << 4) + (c & 15);
}

// The write half of a 128 x 128 byte-tile transpose (codes written at tile_at): each thread reads a
// block of 16 rows x 4 columns as 16 words (a warp: 4 row blocks x 8 column words, no bank
// conflict), turns it around with byte permutes, and writes 4 rows of out_t (tile columns) of 16
// codes each: one 16-byte store when rows_aligned, else byte by byte. Used by cast_transpose,
// recipe_quantize and the plain FP8 transpose.
template <int THREADS>
__device__ __forceinline__ void store_tile_transposed(const uint8_t* tile, uint8_t* out_t, int64_t rows, int64_t R0,
                                                      int64_t C0, bool rows_aligned) {
  static_assert(THREADS == 256, "one 16 x 4 block of the tile per thread");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = 8 * (warp & 3) + (lane & 7);     // tile columns 4q .. 4q + 3
  const int rb = 4 * (warp >> 2) + (lane >> 3);  // tile rows 16 rb .. 16 rb + 15
  uint32_t w[16];
#pragma unroll
  for (int s = 0; s < 16; ++s) w[s] = *reinterpret_cast<const uint32_t*>(tile + tile_at(16 * rb + s, 4 * q));
  uint32_t o[4][4];  // o[j][k]: codes of tile column 4q + j, rows 16 rb + 4k .. + 3
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // a 4 x 4 byte transpose of rows 4k .. 4k + 3
    const uint32_t t0 = __byte_perm(w[4 * k], w[4 * k + 1], 0x5140), t1 = __byte_perm(w[4 * k], w[4 * k + 1], 0x7362);
    const uint32_t t2 = __byte_perm(w[4 * k + 2], w[4 * k + 3], 0x5140),
                   t3 = __byte_perm(w[4 * k + 2], w[4 * k + 3], 0x7362);
    o[0][k] = __byte_perm(t0, t2, 0x5410);
    o[1][k] = __byte_perm(t0, t2, 0x7632);
    o[2][k] = __byte_perm(t1, t3, 0x5410);
    o[3][k] = __byte_perm(t1, t3, 0x7632);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint8_t* dst = out_t + (C0 + 4 * q + j) * rows + R0 + 16 * rb;
    if (rows_aligned) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) dst[i] = static_cast<uint8_t>(o[j][i / 4] >> (8 * (i % 4)));
    }
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Calls f(dtype constant) for a runtime wide dtype (F32, F16, BF16), so each launcher names its
// kernel template once.
template <typename F>
void dispatch_wide(fp8_dtype_t dt, F&& f) {
  switch (dt) {
    case FP8_DTYPE_F32: f(std::integral_constant<fp8_dtype_t, FP8_DTYPE_F32>{}); break;
    case FP8_DTYPE_F16: f(std::integral_constant<fp8_dtype_t, FP8_DTYPE_F16>{}); break;
    default: f(std::integral_constant<fp8_dtype_t, FP8_DTYPE_BF16>{}); break;
  }
}

// The same for any dtype, FP8 ones included (an output that may be wide or FP8).
template <typename F>
void dispatch_any(fp8_dtype_t dt, F&& f) {
  switch (dt) {
    case FP8_DTYPE_E4M3: f(std::integral_constant<fp8_dtype_t, FP8_DTYPE_E4M3>{}); break;
    case FP8_DTYPE_E5M2: f(std::integral_constant<fp8_dtype_t, FP8_DTYPE_E5M2>{}); break;
    default: dispatch_wide(dt, f); break;
  }
}

// f(dtype constant, format constant) for a wide dtype and an FP8 format.
template <typename F>
void dispatch(fp8_dtype_t dt, bool e5m2, F&& f) {
  dispatch_wide(dt, [&](auto dtc) {
    if (e5m2) f(dtc, std::true_type{});
    else f(dtc, std::false_type{});
  });
}

// f(G) for the smallest G of 1, 2, 4, ..., MAX with G >= groups (groups <= MAX), G a constant: the
// kernels that keep a row's 8-column groups in registers are instantiated for a few widths.
template <int MAX, typename F>
void dispatch_groups(int64_t groups, F&& f) {
  if constexpr (MAX > 1) {
    if (groups > MAX / 2) return f(std::integral_constant<int, MAX>{});
    return dispatch_groups<MAX / 2>(groups, f);
  } else {
    return f(std::integral_constant<int, 1>{});
  }
}

// Stores element i of an output that is wide (rounded) or FP8 (scaled, cast, its amax tracked).
template <fp8_dtype_t OUT>
__device__ __forceinline__ void store_output(void* out, int64_t i, float v, float scale, uint32_t& amax) {
  if constexpr (OUT == FP8_DTYPE_E4M3 || OUT == FP8_DTYPE_E5M2) {
    amax = max(amax, abs_bits(v));
    static_cast<uint8_t*>(out)[i] = cast1<OUT == FP8_DTYPE_E5M2>(v * scale);
  } else {
    static_cast<typename Wide<OUT>::Raw*>(out)[i] = Wide<OUT>::from_float(v);
  }
}

// Elements i .. i+7 (i a multiple of 8, 16-byte aligned buffer) of an output that is wide (rounded,
// 16-byte stores) or FP8 (scaled, cast, amax tracked; one 8-byte store).
template <fp8_dtype_t OUT>
__device__ __forceinline__ void store8(void* out, int64_t i, const float (&v)[8], float scale, uint32_t& amax) {
  if constexpr (OUT == FP8_DTYPE_E4M3 || OUT == FP8_DTYPE_E5M2) {
    constexpr bool e5m2 = OUT == FP8_DTYPE_E5M2;
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = max(amax, abs_bits(v[k]));
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(out) + i) =
        make_uint2(cast4<e5m2>(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale),
                   cast4<e5m2>(v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale));
  } else {
    using Raw = typename Wide<OUT>::Raw;
    constexpr int kStores = sizeof(Raw) * 8 / 16;
    uint4 o[kStores];
    Raw* r = reinterpret_cast<Raw*>(o);
#pragma unroll
    for (int k = 0; k < 8; ++k) r[k] = Wide<OUT>::from_float(v[k]);
#pragma unroll
    for (int k = 0; k < kStores; ++k) reinterpret_cast<uint4*>(static_cast<Raw*>(out) + i)[k] = o[k];
  }
}

// Grid size for a grid-stride kernel over `work_blocks` items of one block each: at most one
// resident wave; `balanced` sizes it so that every block loops over the same number of items,
// otherwise it fills every resident slot (better for kernels that prefetch their next item).
// `dynamic_smem`: the launch's dynamic shared memory per block, which may limit the blocks per SM;
// where it exceeds what the kernel may take without asking (48 KiB less its static memory), the
// kernel's limit is raised, so a launch with the grid returned may use it.
int grid_size(const void* kernel, int threads, int64_t work_blocks, int sm_count, bool balanced = true,
              size_t dynamic_smem = 0);

}  // namespace fp8::kernels
