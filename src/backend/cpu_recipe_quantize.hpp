// The CPU reference of fused amax + quantize for the scaling recipes of issue 14 (current
// per-tensor, per-row, 1x128 and 128x128 blocks): the rules of core/recipe_scaling_rule.hpp over
// plain loops. The CUDA kernels to come must reproduce it bit for bit. Internal; not yet reachable
// through a backend or fp8.h.
#pragma once

#include <cstdint>

#include "core/scale_desc.hpp"
#include "fp8.h"

namespace fp8 {

// in: a row-major [rows, cols] matrix of F32, F16 or BF16 (widened exactly to float).
// out[r][c] = encode_fp8(in[r][c] * scale of (r, c)); out_scale_inv receives 1 / scale of every
// cell of its grid, whose mode is the recipe's mode (the grid and ld as core/scale_desc.hpp
// defines them for a [rows, cols] operand; check_scale_desc is applied).
// With out_t_scale_inv.ptr set: out_t ([cols][rows]) is the transposed copy, quantised along its
// own K from `in` (core/recipe_scaling_rule.hpp), with out_t_scale_inv's grid for a [cols, rows]
// operand of the same mode.
// nonfinite_cells, when set, is increased by the number of cells of out's grid whose amax is NaN or
// infinite (each such cell has scale 1).
struct RecipeQuantizeJob {
  const void* in;
  fp8_dtype_t in_dtype;  // F32, F16 or BF16
  int64_t rows, cols;
  bool e5m2;
  int32_t margin;    // 0..32: scale = fp8_max * 2^-margin / amax
  bool pow2_scales;  // round every scale down to a power of two
  uint8_t* out;
  ScaleDesc out_scale_inv;
  uint8_t* out_t = nullptr;
  ScaleDesc out_t_scale_inv = {};
  int64_t* nonfinite_cells = nullptr;
};

// Throws FP8_ERR_DTYPE for another input dtype, FP8_ERR_INVALID_ARGUMENT for a margin outside
// 0..32, a missing pointer or differing modes of out and out_t, FP8_ERR_SHAPE for a grid that does
// not fit (before any work).
void cpu_recipe_quantize(const RecipeQuantizeJob& j);

}  // namespace fp8
