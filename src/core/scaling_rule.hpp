// The delayed-scaling rule (documented in fp8.h) and the device-memory layout of one scaling state.
// Both backends include this header: the CPU reference loops over the history, the CUDA kernel
// reduces it in parallel, and both finish with next_scale().
#pragma once

#include <cfloat>
#include <cstdint>

#include "core/format.hpp"

namespace fp8 {

// One state in device memory: this header, then amax_history_len floats (slot 0 first).
// Keeping scale, scale_inv and the counters next to the history lets one pointer serve every
// kernel, and keeps the whole rule on the device, so a captured CUDA graph replays it correctly.
struct ScalingHeader {
  float scale;
  float scale_inv;
  uint32_t reserved[2];
  uint64_t nonfinite_count;  // updates whose amax was NaN or infinite
  uint64_t update_count;     // updates so far; the interval rule counts these
};
static_assert(sizeof(ScalingHeader) == 32, "history must start 16-byte aligned");

// Step 3 happens on updates number 0, interval, 2*interval, ...
FP8_HD bool scaling_recomputes(uint64_t update_count, int64_t interval) {
  return update_count % static_cast<uint64_t>(interval) == 0;
}

FP8_HD float* scaling_history(ScalingHeader* h) { return reinterpret_cast<float*>(h + 1); }

// Largest finite value of the state's format, scaled down by 2^margin (exact: a power of two).
FP8_HD float scaled_fp8_max(bool e5m2, int margin) {
  const float max = fp8_spec(e5m2).max_value;
  return max * bits_float(static_cast<uint32_t>(127 - margin) << 23);
}

// Rounds a scale down (towards zero) to a power of two, exactly, by bit manipulation: the
// power_2_scales option (TE's force_pow_2_scales; DeepSeek-V3's block scales). A power of two stays
// as it is. Scales from current_scale() (core/recipe_scaling_rule.hpp) and next_scale() are
// >= 2^-127 or 1, so their rounding stays >= 2^-127 too.
//   normal s      the mantissa bits are cleared (TE's `bits & 0xFF800000`): 2^floor(log2 s);
//   subnormal s   only the highest set mantissa bit is kept: the largest (subnormal) power of two
//                 <= s. TE's mask would give 0 here (TE never sees one: no margin); libfp8's current
//                 scale can be subnormal (in [2^-127, 2^-126), with a margin) and must not become 0;
//   +-0           unchanged;
//   +-inf, NaN    unchanged (the mask would turn a NaN into inf). No rule returns these; the
//                 rounding is defined for every float all the same.
FP8_HD float round_scale_pow2(float s) {
  const uint32_t bits = float_bits(s);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u || abs == 0u) return s;
  if (abs >= 0x00800000u) return bits_float(bits & 0xFF800000u);
  uint32_t top = abs;  // smear the highest set bit downwards, then keep it alone
  top |= top >> 1;
  top |= top >> 2;
  top |= top >> 4;
  top |= top >> 8;
  top |= top >> 16;
  return bits_float((bits & 0x80000000u) | (top - (top >> 1)));
}

// Step 3 of the rule: the new scale for amax `a` (already sanitised: finite, >= 0).
// a == 0 keeps the old scale; a tiny a would give inf, which is clamped to FLT_MAX; with
// power_2_scales the quotient is rounded down to a power of two (FLT_MAX to 2^127).
FP8_HD float next_scale(float a, float fp8_max_scaled, float old_scale, bool pow2_scales) {
  if (!(a > 0.0f)) return old_scale;
  const float q = fp8_max_scaled / a;
  const float s = q > FLT_MAX ? FLT_MAX : q;
  return pow2_scales ? round_scale_pow2(s) : s;
}

}  // namespace fp8
