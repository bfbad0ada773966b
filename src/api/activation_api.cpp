// Activations: argument checks, then one backend job.
#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

// Checks shared by both directions; returns the job with everything but the direction's tensors.
fp8::ActivationJob check_common(fp8_context_t* ctx, fp8_activation_t activation, const fp8_tensor_t* x,
                                fp8_tensor_t* out, const char* out_name, fp8_scaling_t* scaling,
                                const char* scaling_name) {
  require_arg(ctx, "ctx");
  require_arg(x, "x");
  require_arg(out, out_name);
  if (activation < FP8_ACTIVATION_RELU || activation > FP8_ACTIVATION_SWIGLU)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "activation = ", activation,
              "; expected FP8_ACTIVATION_RELU (0), FP8_ACTIVATION_GELU (1) or FP8_ACTIVATION_SWIGLU (2)");
  fp8::require_same_context(ctx, x, "x");
  fp8::require_same_context(ctx, out, out_name);
  if (scaling) fp8::require_same_context(ctx, scaling, scaling_name);
  fp8::require_wide(x, "x");
  const bool fp8_out = fp8::require_output_scaling(out, out_name, scaling, scaling_name);
  if (activation == FP8_ACTIVATION_SWIGLU && (x->ndim == 0 || x->cols() % 2 != 0))
    fp8::fail(FP8_ERR_SHAPE, "x has shape ", fp8::shape_string(x->ndim, x->shape),
              "; SwiGLU needs an even last dimension (gate and up halves)");
  fp8::require_disjoint(out, out_name, x, "x");
  fp8::ActivationJob job{};
  job.act = activation;
  job.x = x->data;
  job.x_dtype = x->dtype;
  job.rows = x->rows();
  job.cols = x->cols();
  job.out = out->data;
  job.out_dtype = out->dtype;
  job.out_state = fp8_out ? scaling->state : nullptr;
  job.out_scale_inv = fp8::tensor_scale(fp8_out ? out->scale_inv : nullptr);
  return job;
}

// The forward output's shape: x's, with the last dimension halved for SwiGLU.
void require_output_shape(const fp8_tensor* t, const char* name, const fp8_tensor* x, fp8_activation_t activation) {
  int64_t want[FP8_MAX_DIMS] = {};
  for (int32_t i = 0; i < x->ndim; ++i) want[i] = x->shape[i];
  if (activation == FP8_ACTIVATION_SWIGLU) want[x->ndim - 1] /= 2;
  bool same = t->ndim == x->ndim;
  for (int32_t i = 0; same && i < x->ndim; ++i) same = t->shape[i] == want[i];
  if (!same)
    fp8::fail(FP8_ERR_SHAPE, name, " has shape ", fp8::shape_string(t->ndim, t->shape), ", expected ",
              fp8::shape_string(x->ndim, want), activation == FP8_ACTIVATION_SWIGLU ? " (x with its last dimension halved)" : " (x's)");
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_activation_forward(fp8_context_t* ctx, fp8_activation_t activation, const fp8_tensor_t* x,
                                            fp8_tensor_t* y, fp8_scaling_t* y_scaling) {
  return guard("fp8_activation_forward", [&] {
    fp8::ActivationJob job = check_common(ctx, activation, x, y, "y", y_scaling, "y_scaling");
    require_output_shape(y, "y", x, activation);
    ctx->backend->activation(job);
  });
}

FP8_API fp8_status_t fp8_activation_backward(fp8_context_t* ctx, fp8_activation_t activation, const fp8_tensor_t* x,
                                             const fp8_tensor_t* dy, fp8_tensor_t* dx, fp8_scaling_t* dx_scaling) {
  return guard("fp8_activation_backward", [&] {
    fp8::ActivationJob job = check_common(ctx, activation, x, dx, "dx", dx_scaling, "dx_scaling");
    require_arg(dy, "dy");
    fp8::require_same_context(ctx, dy, "dy");
    if (dy->dtype != x->dtype)
      fp8::fail(FP8_ERR_DTYPE, "dy has dtype ", fp8::dtype_name(dy->dtype), "; expected ", fp8::dtype_name(x->dtype), " like x");
    require_output_shape(dy, "dy", x, activation);
    fp8::require_same_shape(dx, "dx", x, "x");
    fp8::require_disjoint(dx, "dx", dy, "dy");
    job.backward = true;
    job.dy = dy->data;
    ctx->backend->activation(job);
  });
}

}  // extern "C"
