// The CPU reference of the recipes' fused amax + quantize (backend/cpu_recipe_quantize.hpp). Two
// plain passes per layout: the amax of every cell, then the codes with the cell's scale.
#include "backend/cpu_recipe_quantize.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "core/format.hpp"
#include "core/recipe_scaling_rule.hpp"
#include "core/scaling_rule.hpp"

namespace fp8 {

namespace {

float load_input(const void* p, fp8_dtype_t dt, int64_t i) {
  switch (dt) {
    case FP8_DTYPE_F32:
      return static_cast<const float*>(p)[i];
    case FP8_DTYPE_F16:
      return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// Quantises the [rows, cols] view of `in` (the source itself, or its transpose when `transposed`:
// view (r, c) is source element (c, r) of a [cols, rows] source) into out with d's grid.
// Returns the number of cells whose amax is non-finite.
int64_t quantize_view(const RecipeQuantizeJob& j, bool transposed, int64_t rows, int64_t cols, uint8_t* out,
                      const ScaleDesc& d) {
  const auto at = [&](int64_t r, int64_t c) {
    return load_input(j.in, j.in_dtype, transposed ? c * rows + r : r * cols + c);
  };
  const ScaleGrid g = scale_grid(d.mode, rows, cols);
  const ScaleBlock b = scale_block(d.mode, rows, cols);
  // Amaxes in a dense [g.rows, g.cols] buffer (ld = g.cols), as abs bits.
  std::vector<uint32_t> amax(static_cast<size_t>(g.rows * g.cols), 0u);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t& a = amax[static_cast<size_t>(scale_offset(b, g.cols, r, c))];
      a = std::max(a, abs_bits(at(r, c)));
    }
  const float fp8_max_scaled = scaled_fp8_max(j.e5m2, j.margin);
  std::vector<float> scale(amax.size());
  int64_t nonfinite = 0;
  for (int64_t i = 0; i < g.rows; ++i)
    for (int64_t k = 0; k < g.cols; ++k) {
      const float a = bits_float(amax[static_cast<size_t>(i * g.cols + k)]);
      if (amax_is_nonfinite(a)) ++nonfinite;
      const float s = recipe_scale(a, fp8_max_scaled, j.pow2_scales);
      scale[static_cast<size_t>(i * g.cols + k)] = s;
      d.ptr[d.at(i, k)] = recipe_scale_inv(s);
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = encode_fp8(at(r, c) * scale[static_cast<size_t>(scale_offset(b, g.cols, r, c))], j.e5m2);
  return nonfinite;
}

bool grid_empty(const ScaleDesc& d) {
  return d.rows == 0 || d.cols == 0;
}

}  // namespace

void check_recipe_quantize(const RecipeQuantizeJob& j) {
  if (j.in_dtype != FP8_DTYPE_F32 && j.in_dtype != FP8_DTYPE_F16 && j.in_dtype != FP8_DTYPE_BF16)
    fail(FP8_ERR_DTYPE, "recipe quantize takes F32, F16 or BF16 input, not dtype ", static_cast<int32_t>(j.in_dtype));
  if (j.margin < 0 || j.margin > 32)
    fail(FP8_ERR_INVALID_ARGUMENT, "recipe quantize's margin ", j.margin, " is outside 0..32");
  if (j.rows < 0 || j.cols < 0) fail(FP8_ERR_SHAPE, "recipe quantize's input is [", j.rows, ", ", j.cols, "]");
  check_scale_desc(j.out_scale_inv, j.rows, j.cols, "recipe quantize's out_scale_inv");
  const bool with_t = j.out_t_scale_inv.ptr != nullptr;
  if (with_t) {
    if (j.out_t_scale_inv.mode != j.out_scale_inv.mode)
      fail(FP8_ERR_INVALID_ARGUMENT, "recipe quantize's out_t_scale_inv has ", scale_mode_name(j.out_t_scale_inv.mode),
           " scales, out_scale_inv ", scale_mode_name(j.out_scale_inv.mode), "; a transposed copy keeps the mode");
    check_scale_desc(j.out_t_scale_inv, j.cols, j.rows, "recipe quantize's out_t_scale_inv");
  }
  const int64_t n = j.rows * j.cols;
  if (n > 0) {
    require_arg(j.in, "in");
    require_arg(j.out, "out");
    if (with_t) require_arg(j.out_t, "out_t");
  }
  if (!grid_empty(j.out_scale_inv)) require_arg(j.out_scale_inv.ptr, "out_scale_inv.ptr");
}

void cpu_recipe_quantize(const RecipeQuantizeJob& j) {
  check_recipe_quantize(j);
  const bool with_t = j.out_t_scale_inv.ptr != nullptr;
  const int64_t nonfinite = quantize_view(j, false, j.rows, j.cols, j.out, j.out_scale_inv);
  if (with_t) quantize_view(j, true, j.cols, j.rows, j.out_t, j.out_t_scale_inv);
  if (j.nonfinite_cells) *j.nonfinite_cells += nonfinite;
}

}  // namespace fp8
