// The CPU reference of fused amax + quantize for the scaling recipes of issue 14 (current
// per-tensor, per-row, 1x128 and 128x128 blocks; RecipeQuantizeJob in backend/jobs.hpp): the rules
// of core/recipe_scaling_rule.hpp over plain loops. The CUDA kernels (kernels/cast/recipe_quantize.cu)
// reproduce it bit for bit.
#pragma once

#include <cstdint>

#include "backend/jobs.hpp"

namespace fp8 {

// The checks both backends make before any work: FP8_ERR_DTYPE for another input dtype,
// FP8_ERR_INVALID_ARGUMENT for a margin outside 0..32, a missing pointer or differing modes of out
// and out_t, FP8_ERR_SHAPE for a grid that does not fit.
void check_recipe_quantize(const RecipeQuantizeJob& j);

// check_recipe_quantize, then the reference itself.
void cpu_recipe_quantize(const RecipeQuantizeJob& j);

}  // namespace fp8
