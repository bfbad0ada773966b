// LayerNorm / RMSNorm: argument checks, then one backend job.
#include <cmath>
#include <initializer_list>
#include <iterator>
#include <utility>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

void check_kind(fp8_norm_t kind) {
  if (kind != FP8_NORM_LAYERNORM && kind != FP8_NORM_RMSNORM)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "kind = ", kind, "; expected FP8_NORM_LAYERNORM (0) or FP8_NORM_RMSNORM (1)");
}

// x is [.., d] of a wide dtype; returns d.
int64_t check_x(const fp8_context_t* ctx, const fp8_tensor_t* x) {
  require_arg(x, "x");
  fp8::require_same_context(ctx, x, "x");
  fp8::require_wide(x, "x");
  if (x->ndim == 0 || x->cols() == 0) fp8::fail(FP8_ERR_SHAPE, "x has shape ", fp8::shape_string(x->ndim, x->shape), "; expected [.., d] with d > 0");
  return x->cols();
}

// An F32 vector of `n` elements (any shape with that many), from ctx.
void check_f32_vector(const fp8_context_t* ctx, const fp8_tensor_t* t, const char* name, int64_t n, const char* what) {
  fp8::require_same_context(ctx, t, name);
  if (t->dtype != FP8_DTYPE_F32) fp8::fail(FP8_ERR_DTYPE, name, " has dtype ", fp8::dtype_name(t->dtype), "; expected f32");
  if (t->numel != n) fp8::fail(FP8_ERR_SHAPE, name, " has ", t->numel, " elements; expected ", n, " (", what, ")");
}

using Named = std::pair<const fp8_tensor*, const char*>;

// Every output (NULL ones skipped) is disjoint from every input and from the other outputs.
void require_outputs_disjoint(std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (!o->first) continue;
    for (const Named& i : inputs)
      if (i.first) fp8::require_disjoint(o->first, o->second, i.first, i.second);
    for (auto p = std::next(o); p != outputs.end(); ++p)
      if (p->first) fp8::require_disjoint(o->first, o->second, p->first, p->second);
  }
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_norm_forward(fp8_context_t* ctx, fp8_norm_t kind, const fp8_tensor_t* x,
                                      const fp8_tensor_t* gamma, const fp8_tensor_t* beta, float eps, fp8_tensor_t* y,
                                      fp8_scaling_t* y_scaling, fp8_tensor_t* mean, fp8_tensor_t* rstd) {
  return guard("fp8_norm_forward", [&] {
    require_arg(ctx, "ctx");
    check_kind(kind);
    const int64_t d = check_x(ctx, x);
    require_arg(gamma, "gamma");
    require_arg(y, "y");
    check_f32_vector(ctx, gamma, "gamma", d, "d, the last dimension of x");
    if (beta) {
      if (kind == FP8_NORM_RMSNORM) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "beta is given for RMSNorm; expected NULL");
      check_f32_vector(ctx, beta, "beta", d, "d, the last dimension of x");
    }
    if (!(std::isfinite(eps) && eps > 0.0f)) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "eps = ", eps, "; expected a finite value > 0");
    fp8::require_same_context(ctx, y, "y");
    if (y_scaling) fp8::require_same_context(ctx, y_scaling, "y_scaling");
    const bool fp8_out = fp8::require_output_scaling(y, "y", y_scaling, "y_scaling");
    fp8::require_same_shape(y, "y", x, "x");
    fp8::require_disjoint(y, "y", x, "x");
    if (mean) {
      if (kind == FP8_NORM_RMSNORM) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "mean is given for RMSNorm; expected NULL");
      check_f32_vector(ctx, mean, "mean", x->rows(), "one per row of x");
    }
    if (rstd) check_f32_vector(ctx, rstd, "rstd", x->rows(), "one per row of x");
    require_outputs_disjoint({{y, "y"}, {mean, "mean"}, {rstd, "rstd"}}, {{x, "x"}, {gamma, "gamma"}, {beta, "beta"}});
    fp8::NormJob job{};
    job.rms = kind == FP8_NORM_RMSNORM;
    job.x = x->data;
    job.x_dtype = x->dtype;
    job.rows = x->rows();
    job.cols = d;
    job.gamma = static_cast<const float*>(gamma->data);
    job.beta = beta ? static_cast<const float*>(beta->data) : nullptr;
    job.eps = eps;
    job.y = y->data;
    job.y_dtype = y->dtype;
    job.y_state = fp8_out ? y_scaling->state : nullptr;
    job.y_scale_inv = fp8::tensor_scale(fp8_out ? y->scale_inv : nullptr);
    job.mean = mean ? static_cast<float*>(mean->data) : nullptr;
    job.rstd = rstd ? static_cast<float*>(rstd->data) : nullptr;
    if (job.rows > 0 || fp8_out) ctx->backend->norm(job);
  });
}

FP8_API fp8_status_t fp8_norm_backward(fp8_context_t* ctx, fp8_norm_t kind, const fp8_tensor_t* x,
                                       const fp8_tensor_t* gamma, const fp8_tensor_t* mean, const fp8_tensor_t* rstd,
                                       const fp8_tensor_t* dy, fp8_tensor_t* dx, fp8_tensor_t* dgamma,
                                       fp8_tensor_t* dbeta) {
  return guard("fp8_norm_backward", [&] {
    require_arg(ctx, "ctx");
    check_kind(kind);
    const int64_t d = check_x(ctx, x);
    if (d > fp8::kMaxNormBackwardDim)
      fp8::fail(FP8_ERR_SHAPE, "x has d = ", d, "; the backward supports at most ", fp8::kMaxNormBackwardDim,
                " (2^20)");
    require_arg(gamma, "gamma");
    require_arg(rstd, "rstd");
    require_arg(dy, "dy");
    require_arg(dx, "dx");
    require_arg(dgamma, "dgamma");
    check_f32_vector(ctx, gamma, "gamma", d, "d, the last dimension of x");
    if (kind == FP8_NORM_LAYERNORM) {
      require_arg(mean, "mean");
      check_f32_vector(ctx, mean, "mean", x->rows(), "one per row of x");
    } else if (mean) {
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "mean is given for RMSNorm; expected NULL");
    }
    check_f32_vector(ctx, rstd, "rstd", x->rows(), "one per row of x");
    fp8::require_same_context(ctx, dy, "dy");
    fp8::require_same_context(ctx, dx, "dx");
    fp8::require_wide(dy, "dy");
    fp8::require_wide(dx, "dx");
    fp8::require_same_shape(dy, "dy", x, "x");
    fp8::require_same_shape(dx, "dx", x, "x");
    check_f32_vector(ctx, dgamma, "dgamma", d, "d, the last dimension of x");
    if (dbeta) {
      if (kind == FP8_NORM_RMSNORM) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "dbeta is given for RMSNorm; expected NULL");
      check_f32_vector(ctx, dbeta, "dbeta", d, "d, the last dimension of x");
    }
    require_outputs_disjoint({{dx, "dx"}, {dgamma, "dgamma"}, {dbeta, "dbeta"}},
                             {{x, "x"}, {gamma, "gamma"}, {mean, "mean"}, {rstd, "rstd"}, {dy, "dy"}});
    fp8::NormJob job{};
    job.rms = kind == FP8_NORM_RMSNORM;
    job.backward = true;
    job.x = x->data;
    job.x_dtype = x->dtype;
    job.rows = x->rows();
    job.cols = d;
    job.gamma = static_cast<const float*>(gamma->data);
    job.mean = mean ? static_cast<float*>(mean->data) : nullptr;
    job.rstd = static_cast<float*>(rstd->data);
    job.dy = dy->data;
    job.dy_dtype = dy->dtype;
    job.dx = dx->data;
    job.dx_dtype = dx->dtype;
    job.dgamma = static_cast<float*>(dgamma->data);
    job.dbeta = dbeta ? static_cast<float*>(dbeta->data) : nullptr;
    ctx->backend->norm(job);
  });
}

}  // extern "C"
