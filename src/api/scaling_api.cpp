// Delayed-scaling states and their batched update.
#include <cmath>
#include <atomic>
#include <vector>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

fp8::ScalingHeader read_header(const fp8_scaling* s) {
  fp8::ScalingHeader h{};
  s->backend->copy_to_host(&h, s->state, sizeof h);
  return h;
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_scaling_create(fp8_scaling_t** out, fp8_context_t* ctx, const fp8_recipe_t* recipe,
                                        fp8_role_t role) {
  return guard("fp8_scaling_create", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    require_arg(recipe, "recipe");
    *out = fp8::make_scaling(ctx->backend, recipe->recipe, role).release();
  });
}

FP8_API void fp8_scaling_destroy(fp8_scaling_t* scaling) { delete scaling; }

FP8_API fp8_status_t fp8_scaling_dtype(const fp8_scaling_t* scaling, fp8_dtype_t* dtype) {
  return guard("fp8_scaling_dtype", [&] {
    require_arg(scaling, "scaling");
    require_arg(dtype, "dtype");
    *dtype = scaling->dtype;
  });
}

FP8_API void fp8_scaling_info_init(fp8_scaling_info_t* info) {
  if (!info) return;
  *info = fp8_scaling_info_t{};
  info->struct_size = sizeof *info;
}

FP8_API fp8_status_t fp8_scaling_get_info(const fp8_scaling_t* scaling, fp8_scaling_info_t* info) {
  return guard("fp8_scaling_get_info", [&] {
    require_arg(scaling, "scaling");
    require_arg(info, "info");
    fp8::require_struct_size(info, fp8::kScalingInfoV1Size, "info", "fp8_scaling_info_init");
    const fp8::ScalingHeader h = read_header(scaling);
    fp8_scaling_info_t result{};
    scaling->backend->copy_to_host(&result.amax, fp8::scaling_history(scaling->state), sizeof result.amax);
    result.scale = h.scale;
    result.scale_inv = h.scale_inv;
    result.amax_history_len = scaling->history_len;
    result.update_count = static_cast<int64_t>(h.update_count);
    result.nonfinite_count = static_cast<int64_t>(h.nonfinite_count);
    fp8::write_versioned(info, result);
  });
}

FP8_API fp8_status_t fp8_scaling_get_history(const fp8_scaling_t* scaling, float* history, int32_t len) {
  return guard("fp8_scaling_get_history", [&] {
    require_arg(scaling, "scaling");
    require_arg(history, "history");
    if (len != scaling->history_len)
      fp8::fail(FP8_ERR_SHAPE, "len = ", len, "; expected ", scaling->history_len, " (the state's amax_history_len)");
    scaling->backend->copy_to_host(history, fp8::scaling_history(scaling->state), sizeof(float) * static_cast<size_t>(len));
  });
}

FP8_API fp8_status_t fp8_scaling_set_scale(fp8_scaling_t* scaling, float scale) {
  return guard("fp8_scaling_set_scale", [&] {
    require_arg(scaling, "scaling");
    if (!(std::isfinite(scale) && scale > 0.0f))
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "scale = ", scale, "; expected a finite value > 0");
    const float pair[2] = {scale, 1.0f / scale};
    scaling->backend->copy_from_host(scaling->state, pair, sizeof pair);
  });
}

FP8_API fp8_status_t fp8_scaling_update(fp8_context_t* ctx, fp8_scaling_t* const* states, int32_t count,
                                        const fp8_recipe_t* recipe) {
  return guard("fp8_scaling_update", [&] {
    require_arg(ctx, "ctx");
    require_arg(recipe, "recipe");
    if (count < 0) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "count = ", count, "; expected >= 0");
    if (count > 0) require_arg(states, "states");
    const int64_t history_len = recipe->recipe.get(FP8_RECIPE_AMAX_HISTORY_LEN);
    static std::atomic<uint64_t> calls{0};
    const uint64_t mark = ++calls;
    for (int32_t i = 0; i < count; ++i) {
      fp8_scaling* s = states[i];
      if (!s) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "states[", i, "] is NULL");
      fp8::require_same_context(ctx, s, ("states[" + std::to_string(i) + "]").c_str());
      if (s->history_len != history_len)
        fp8::fail(FP8_ERR_INVALID_ARGUMENT, "states[", i, "] has amax_history_len ", s->history_len,
                  "; the recipe says ", history_len);
      if (s->current)
        fp8::fail(FP8_ERR_INVALID_ARGUMENT, "states[", i,
                  "] scales with current scaling (made from a recipe with scaling=current): each cast makes its "
                  "scale, so it has no delayed update; leave it out");
      if (s->update_mark == mark)
        fp8::fail(FP8_ERR_INVALID_ARGUMENT, "states[", i, "] appears twice; expected each state once per update");
      s->update_mark = mark;
    }
    fp8::update_scaling(*ctx->backend, states, count, recipe->recipe);
  });
}

}  // extern "C"
