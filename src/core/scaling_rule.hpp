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

// Step 3 of the rule: the new scale for amax `a` (already sanitised: finite, >= 0).
// a == 0 keeps the old scale; a tiny a would give inf, which is clamped to FLT_MAX.
FP8_HD float next_scale(float a, float fp8_max_scaled, float old_scale) {
  if (!(a > 0.0f)) return old_scale;
  const float s = fp8_max_scaled / a;
  return s > FLT_MAX ? FLT_MAX : s;
}

}  // namespace fp8
