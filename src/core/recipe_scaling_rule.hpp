// The scaling rules of the recipes beyond delayed scaling (issue 14): current per-tensor scaling,
// per-row scaling, 1x128 / 128x128 block scaling, and power-of-two scales. One definition each,
// shared by the CPU reference (backend/cpu_recipe_quantize.cpp) and the CUDA kernels (FP8_HD).
//
// Every mode computes its scales the same way, from the amax of the elements one scale covers
// (a "cell" of the grid that core/scale_desc.hpp defines):
//   amax   = max |x| over the cell's elements, as the numerics contract defines it (abs_bits: any NaN
//            makes it NaN, any inf makes it inf);
//   scale  = recipe_scale(amax, scaled_fp8_max(e5m2, margin), pow2_scales);
//   codes  = encode_fp8(x * scale), scale_inv = 1 / scale (what the grid stores: value = code * scale_inv).
// The cells of each mode, for an operand viewed as a row-major [rows, cols] matrix scaled along its
// columns (K), are scale_block() below:
//   per-tensor   the whole operand (current scaling: the amax of the tensor being cast, in the same call);
//   per-row      one row (torchao's "rowwise": amax per row along K, then the rule per row);
//   1x128        128 consecutive elements of a row (activations, gradients); the last tile of a row
//                with cols % 128 != 0 is partial and uses the amax of its own elements;
//   128x128      a 128x128 block (weights); blocks on the bottom/right edges are partial likewise.
// Transposed copies (the K-major operands of dgrad and wgrad): the copy of a [rows, cols] operand is
// the [cols, rows] operand quantised afresh along its own K with the same mode, from the
// high-precision source (TransformerEngine's rule for 1-D blocks). For 128x128 blocks that is the
// same thing as transposing the codes and the scale grid (a block's amax does not depend on its
// orientation), which is how a kernel may make it; for per-tensor it is the same scale.
#pragma once

#include <cfloat>
#include <cstdint>

#include "core/format.hpp"
#include "core/scale_desc.hpp"
#include "core/scaling_rule.hpp"  // (round_scale_pow2, scaled_fp8_max)

namespace fp8 {

// The smallest scale of the recipes: 2^-127 (subnormal), so that 1 / scale = 2^127 is finite.
constexpr float kMinRecipeScale = 0x1p-127f;

// The current-scaling rule, as TransformerEngine defines it for Float8CurrentScaling:
// compute_scale_from_amax() in transformer_engine/common/recipe/recipe_common.cuh, which
// nvte_compute_scale_from_amax (transformer_engine/common/recipe/current_scaling.cu) calls with
// FLT_MAX as the value for an infinite quotient. In short:
//   - amax 0, amax +inf and amax NaN all give scale 1 (nothing to scale by; libfp8 also counts the
//     non-finite ones, as delayed scaling counts its non-finite updates);
//   - otherwise scale = fp8_max_scaled / amax, rounded to nearest (IEEE division, never fast-math);
//   - an amax so small that the quotient overflows to inf gives FLT_MAX instead;
//   - (libfp8 only) a quotient below 2^-127 gives 2^-127, the smallest power of two whose inverse
//     (2^127) is finite: only a margin and an amax near FLT_MAX get there (448 * 2^-32 / FLT_MAX
//     would round to 0, and any scale below about 2^-128 has an infinite scale_inv). TE has no
//     margin and never meets it. Values then land below fp8_max, just not 2^margin below it.
// Differences from TE, on purpose: TE floors amax at an optional epsilon (amax_epsilon, 0 by
// default), which libfp8's recipes do not have (epsilon 0); TE's amax kernel uses fmaxf, which drops
// NaNs, where libfp8's amax propagates them (so a NaN in a cell gives that cell scale 1, and the cell
// is counted); TE's block-scaling kernels use the largest finite value of the *input* type for an
// infinite quotient (65504 for fp16 inputs), where libfp8 uses FLT_MAX in every mode.
// `fp8_max_scaled` is scaled_fp8_max(e5m2, margin) (core/scaling_rule.hpp: fp8_max * 2^-margin,
// exact). A negative amax (impossible from abs_bits) is treated like 0.
FP8_HD float current_scale(float amax, float fp8_max_scaled) {
  if (!(amax > 0.0f) || !is_finite_bits(abs_bits(amax))) return 1.0f;
  const float s = fp8_max_scaled / amax;
  if (s > FLT_MAX) return FLT_MAX;
  return s < kMinRecipeScale ? kMinRecipeScale : s;
}

// Whether an amax makes its cell non-finite (counted): NaN or infinite.
FP8_HD bool amax_is_nonfinite(float amax) {
  return !is_finite_bits(abs_bits(amax));
}

// The scale of one cell: the current rule, then power-of-two rounding when asked. The rounding
// keeps every |x| * scale <= fp8_max_scaled (up to the multiply's rounding), so it never saturates.
FP8_HD float recipe_scale(float amax, float fp8_max_scaled, bool pow2_scales) {
  const float s = current_scale(amax, fp8_max_scaled);
  return pow2_scales ? round_scale_pow2(s) : s;
}

// What the scale grid stores: the dequantisation factor, 1 / scale rounded to nearest (as delayed
// scaling's scale_inv). Exact for power-of-two scales (2^-127 for 2^127 is subnormal, still exact).
FP8_HD float recipe_scale_inv(float scale) {
  return 1.0f / scale;
}

// Current per-tensor scaling through a delayed-scaling state's memory (fp8.h, "Current scaling"):
// with `amax` already in history slot 0, records the cast's scale in the state (scale, scale_inv,
// one more update, and a non-finite amax counted). Both backends call it once per cast.
FP8_HD void record_current_scale(ScalingHeader* h, float amax, float scale) {
  h->scale = scale;
  h->scale_inv = recipe_scale_inv(scale);
  h->update_count += 1;
  if (amax_is_nonfinite(amax)) h->nonfinite_count += 1;
}

// The extent of one cell of `mode` in an operand of [rows, cols] scaled along its columns, before
// clipping at the bottom and right edges. Element (r, c) belongs to cell (r / rows, c / cols) of
// the grid that scale_grid() sizes (per-tensor and per-row cells span the whole operand / row; an
// empty dimension counts as 1 so that the division is defined).
struct ScaleBlock {
  int64_t rows, cols;
};
FP8_HD ScaleBlock scale_block(ScaleMode mode, int64_t rows, int64_t cols) {
  const int64_t r = rows > 0 ? rows : 1, c = cols > 0 ? cols : 1;
  switch (mode) {
    case ScaleMode::kRow:
      return {1, c};
    case ScaleMode::kBlock1x128:
      return {1, kScaleBlock};
    case ScaleMode::kBlock128x128:
      return {kScaleBlock, kScaleBlock};
    default:
      return {r, c};
  }
}

// Offset, in floats from the grid's start, of the scale of element (r, c): ptr[cell_row * ld + cell_col].
FP8_HD int64_t scale_offset(ScaleBlock b, int64_t ld, int64_t r, int64_t c) {
  return (r / b.rows) * ld + c / b.cols;
}

}  // namespace fp8
