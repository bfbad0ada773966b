// Quantize, dequantize and amax: argument checks, then one backend job each.
#include <utility>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

extern "C" {

FP8_API fp8_status_t fp8_quantize(fp8_context_t* ctx, const fp8_tensor_t* in, fp8_tensor_t* out,
                                  fp8_tensor_t* out_transposed, fp8_scaling_t* scaling) {
  return guard("fp8_quantize", [&] {
    require_arg(ctx, "ctx");
    require_arg(in, "in");
    require_arg(out, "out");
    require_arg(scaling, "scaling");
    fp8::require_same_context(ctx, in, "in");
    fp8::require_same_context(ctx, out, "out");
    fp8::require_same_context(ctx, scaling, "scaling");
    fp8::require_wide(in, "in");
    if (out->dtype != scaling->dtype)
      fp8::fail(FP8_ERR_DTYPE, "out has dtype ", fp8::dtype_name(out->dtype), "; expected ",
                fp8::dtype_name(scaling->dtype), ", the dtype of the scaling state");
    fp8::require_same_shape(out, "out", in, "in");
    fp8::require_disjoint(out, "out", in, "in");
    if (out_transposed) {
      fp8::require_same_context(ctx, out_transposed, "out_transposed");
      if (out_transposed->dtype != scaling->dtype)
        fp8::fail(FP8_ERR_DTYPE, "out_transposed has dtype ", fp8::dtype_name(out_transposed->dtype), "; expected ",
                  fp8::dtype_name(scaling->dtype), ", the dtype of the scaling state");
      const int64_t want[2] = {in->cols(), in->rows()};
      if (out_transposed->ndim != 2 || out_transposed->shape[0] != want[0] || out_transposed->shape[1] != want[1])
        fp8::fail(FP8_ERR_SHAPE, "out_transposed has shape ",
                  fp8::shape_string(out_transposed->ndim, out_transposed->shape), ", expected ",
                  fp8::shape_string(2, want), " (in viewed as ", in->rows(), " rows of ", in->cols(), ", transposed)");
      fp8::require_disjoint(out_transposed, "out_transposed", in, "in");
      fp8::require_disjoint(out_transposed, "out_transposed", out, "out");
    }
    fp8::QuantizeJob job{};
    job.in = in->data;
    job.in_dtype = in->dtype;
    job.rows = in->rows();
    job.cols = in->cols();
    job.out = static_cast<uint8_t*>(out->data);
    job.out_t = out_transposed ? static_cast<uint8_t*>(out_transposed->data) : nullptr;
    job.e5m2 = scaling->dtype == FP8_DTYPE_E5M2;
    fp8::cast_through(job, *scaling);
    job.out_scale_inv = fp8::tensor_scale(out->scale_inv);
    job.out_t_scale_inv = fp8::tensor_scale(out_transposed ? out_transposed->scale_inv : nullptr);
    ctx->backend->quantize(job);
  });
}

FP8_API fp8_status_t fp8_dequantize(fp8_context_t* ctx, const fp8_tensor_t* in, fp8_tensor_t* out) {
  return guard("fp8_dequantize", [&] {
    require_arg(ctx, "ctx");
    require_arg(in, "in");
    require_arg(out, "out");
    fp8::require_same_context(ctx, in, "in");
    fp8::require_same_context(ctx, out, "out");
    fp8::require_fp8(in, "in");
    fp8::require_wide(out, "out");
    fp8::require_same_shape(out, "out", in, "in");
    fp8::require_disjoint(out, "out", in, "in");
    ctx->backend->dequantize({static_cast<const uint8_t*>(in->data), in->dtype == FP8_DTYPE_E5M2,
                              fp8::tensor_scale(in->scale_inv), out->data, out->dtype, in->numel});
  });
}

FP8_API fp8_status_t fp8_amax(fp8_context_t* ctx, const fp8_tensor_t* in, fp8_tensor_t* amax, fp8_scaling_t* scaling) {
  return guard("fp8_amax", [&] {
    require_arg(ctx, "ctx");
    require_arg(in, "in");
    require_arg(amax, "amax");
    fp8::require_same_context(ctx, in, "in");
    fp8::require_same_context(ctx, amax, "amax");
    if (scaling) fp8::require_same_context(ctx, scaling, "scaling");
    fp8::require_wide(in, "in");
    if (amax->dtype != FP8_DTYPE_F32) fp8::fail(FP8_ERR_DTYPE, "amax has dtype ", fp8::dtype_name(amax->dtype), "; expected f32");
    if (amax->numel != 1)
      fp8::fail(FP8_ERR_SHAPE, "amax has shape ", fp8::shape_string(amax->ndim, amax->shape), "; expected one element");
    fp8::require_disjoint(amax, "amax", in, "in");
    ctx->backend->amax({in->data, in->dtype, in->numel, static_cast<float*>(amax->data),
                        scaling ? fp8::scaling_history(scaling->state) : nullptr});
  });
}

FP8_API fp8_status_t fp8_scale_grid_shape(fp8_scale_mode_t mode, int64_t rows, int64_t cols, int64_t* shape) {
  return guard("fp8_scale_grid_shape", [&] {
    const fp8::ScaleMode m = fp8::scale_mode_of(mode, "mode");
    constexpr int64_t kMax = int64_t{1} << 62;  // an FP8 tensor's elements (fp8_tensor_create)
    if (rows < 0 || cols < 0 || rows > kMax || cols > kMax || (cols > 0 && rows > kMax / cols))
      fp8::fail(FP8_ERR_SHAPE, "rows = ", rows, ", cols = ", cols,
                "; expected both >= 0, each and their product at most 2^62 (an FP8 operand)");
    require_arg(shape, "shape");
    fp8::grid_tensor_shape(m, rows, cols, shape);
  });
}

FP8_API fp8_status_t fp8_quantize_scaled(fp8_context_t* ctx, const fp8_tensor_t* in, fp8_scale_mode_t mode,
                                         const fp8_recipe_t* recipe, fp8_tensor_t* out, fp8_tensor_t* out_scales,
                                         fp8_tensor_t* out_transposed, fp8_tensor_t* out_t_scales) {
  return guard("fp8_quantize_scaled", [&] {
    require_arg(ctx, "ctx");
    require_arg(in, "in");
    require_arg(recipe, "recipe");
    require_arg(out, "out");
    require_arg(out_scales, "out_scales");
    const fp8::ScaleMode m = fp8::scale_mode_of(mode, "mode");
    if (!out_transposed != !out_t_scales)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, out_transposed ? "out_t_scales is NULL but out_transposed is given"
                                                         : "out_t_scales is given but out_transposed is NULL",
                "; pass both or neither");
    for (auto [t, name] : {std::pair<const fp8_tensor*, const char*>{in, "in"}, {out, "out"}, {out_scales, "out_scales"},
                           {out_transposed, "out_transposed"}, {out_t_scales, "out_t_scales"}})
      if (t) fp8::require_same_context(ctx, t, name);
    fp8::require_wide(in, "in");
    fp8::require_fp8(out, "out");
    fp8::require_same_shape(out, "out", in, "in");
    const int64_t rows = in->rows(), cols = in->cols();
    fp8::RecipeQuantizeJob job{};
    job.out_scale_inv = fp8::require_grid(out_scales, "out_scales", m, rows, cols, "in");
    if (out_transposed) {
      if (out_transposed->dtype != out->dtype)
        fp8::fail(FP8_ERR_DTYPE, "out_transposed has dtype ", fp8::dtype_name(out_transposed->dtype), "; expected ",
                  fp8::dtype_name(out->dtype), ", out's");
      const int64_t want[2] = {cols, rows};
      if (out_transposed->ndim != 2 || out_transposed->shape[0] != cols || out_transposed->shape[1] != rows)
        fp8::fail(FP8_ERR_SHAPE, "out_transposed has shape ", fp8::shape_string(out_transposed->ndim, out_transposed->shape),
                  ", expected ", fp8::shape_string(2, want), " (in viewed as ", rows, " rows of ", cols, ", transposed)");
      job.out_t = static_cast<uint8_t*>(out_transposed->data);
      job.out_t_scale_inv = fp8::require_grid(out_t_scales, "out_t_scales", m, cols, rows, "out_transposed");
    }
    const std::pair<const fp8_tensor*, const char*> outputs[] = {
        {out, "out"}, {out_scales, "out_scales"}, {out_transposed, "out_transposed"}, {out_t_scales, "out_t_scales"}};
    for (size_t i = 0; i < 4; ++i) {
      if (!outputs[i].first) continue;
      fp8::require_disjoint(outputs[i].first, outputs[i].second, in, "in");
      for (size_t j = 0; j < i; ++j)
        if (outputs[j].first) fp8::require_disjoint(outputs[i].first, outputs[i].second, outputs[j].first, outputs[j].second);
    }
    job.in = in->data;
    job.in_dtype = in->dtype;
    job.rows = rows;
    job.cols = cols;
    job.e5m2 = out->dtype == FP8_DTYPE_E5M2;
    job.margin = static_cast<int32_t>(recipe->recipe.get(FP8_RECIPE_MARGIN));
    job.pow2_scales = recipe->recipe.power_2_scales(m != fp8::ScaleMode::kRow);  // (auto: on for the block modes)
    job.out = static_cast<uint8_t*>(out->data);
    ctx->backend->recipe_quantize(job);  // (the per-row mode's workspace: the backend's own)
  });
}

}  // extern "C"
