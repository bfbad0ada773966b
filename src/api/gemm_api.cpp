// GEMM: the checks that make every refusal say which argument and dimension, then one job.
#include <algorithm>
#include <utility>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

void require_16(int64_t value, const char* what) {
  if (value % 16 != 0)
    fp8::fail(FP8_ERR_SHAPE, what, " = ", value,
              " is not a multiple of 16, which FP8 GEMMs need; pad it or use the BF16 GEMM");
}

void require_aligned(const fp8_tensor* t, const char* name) {
  if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, name, "'s data is not 16-byte aligned, which FP8 GEMMs need");
}

// m, n, k of D [m, n] = A [.., k] (m = the product of a's other dimensions) x B [n, k]^T, checked
// against the shapes of a, b and d (refusals name the argument and the shape expected).
struct GemmShape {
  int64_t m, n, k;
};
GemmShape require_gemm_shapes(const fp8_tensor* a, const fp8_tensor* b, const fp8_tensor* d) {
  if (a->ndim < 1) fp8::fail(FP8_ERR_SHAPE, "a has shape [] (a scalar); expected [.., k]");
  const int64_t k = a->cols(), m = a->rows();
  if (b->ndim != 2 || b->shape[1] != k)
    fp8::fail(FP8_ERR_SHAPE, "b has shape ", fp8::shape_string(b->ndim, b->shape), ", expected [n, ", k,
              "] (k = the last dimension of a)");
  const int64_t n = b->shape[0];
  if (k == 0) fp8::fail(FP8_ERR_SHAPE, "k = 0 (the last dimension of a and b); expected k > 0");
  const int64_t want_d[2] = {m, n};
  if (d->ndim != 2 || d->shape[0] != m || d->shape[1] != n)
    fp8::fail(FP8_ERR_SHAPE, "d has shape ", fp8::shape_string(d->ndim, d->shape), ", expected ",
              fp8::shape_string(2, want_d), " (m rows of a, n rows of b)");
  return {m, n, k};
}

// The caller's options (defaults where NULL), their flags checked.
fp8_gemm_options_t read_options(const fp8_gemm_options_t* options) {
  fp8_gemm_options_t opts;
  fp8_gemm_options_init(&opts);
  if (options) fp8::read_versioned(opts, options, fp8::kGemmOptionsV1Size, "options", "fp8_gemm_options_init");
  fp8::require_flag(opts.accumulate, "options->accumulate");
  fp8::require_flag(opts.fast_accumulation, "options->fast_accumulation");
  return opts;
}

// The pairs of scale modes fp8_gemm_scaled multiplies (gemm_scale_pair), refused in the API's terms.
void require_scaled_pair(fp8_scale_mode_t a_mode, fp8::ScaleMode am, fp8_scale_mode_t b_mode, fp8::ScaleMode bm,
                         const fp8_gemm_options_t& opts) {
  const auto name = [](fp8_scale_mode_t mode) {
    return mode == FP8_SCALE_MODE_ROW           ? "FP8_SCALE_MODE_ROW (per-row)"
           : mode == FP8_SCALE_MODE_BLOCK_1X128 ? "FP8_SCALE_MODE_BLOCK_1X128 (1x128-block)"
                                                : "FP8_SCALE_MODE_BLOCK_128X128 (128x128-block)";
  };
  if (!fp8::gemm_scale_pair(am, bm))
    fp8::fail(FP8_ERR_UNSUPPORTED, "a_mode = ", name(a_mode), " with b_mode = ", name(b_mode),
              "; expected ROW with ROW, or a 1x128 grid with a 1x128 or 128x128 one either way round (cuBLASLt does "
              "not multiply two 128x128 grids)");
  if (fp8::is_block_mode(am) && opts.fast_accumulation)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT,
              "options->fast_accumulation = 1 with block scales; expected 0 (cuBLASLt "
              "accumulates block-scaled GEMMs in full precision only)");
}

}  // namespace

extern "C" {

FP8_API void fp8_gemm_options_init(fp8_gemm_options_t* options) {
  if (!options) return;
  *options = fp8_gemm_options_t{};
  options->struct_size = sizeof *options;
  options->alpha = 1.0f;
}

FP8_API fp8_status_t fp8_gemm(fp8_context_t* ctx, const fp8_tensor_t* a, const fp8_tensor_t* b,
                              const fp8_tensor_t* bias, fp8_tensor_t* d, fp8_scaling_t* d_scaling,
                              const fp8_gemm_options_t* options) {
  return guard("fp8_gemm", [&] {
    require_arg(ctx, "ctx");
    require_arg(a, "a");
    require_arg(b, "b");
    require_arg(d, "d");
    const fp8_gemm_options_t opts = read_options(options);
    for (auto [t, name] : {std::pair<const fp8_tensor*, const char*>{a, "a"}, {b, "b"}, {d, "d"}, {bias, "bias"}})
      if (t) fp8::require_same_context(ctx, t, name);
    if (d_scaling) fp8::require_same_context(ctx, d_scaling, "d_scaling");

    const bool fp8_in = fp8::dtype_is_fp8(a->dtype);
    if (fp8_in) {
      fp8::require_fp8(b, "b");
      if (a->dtype == FP8_DTYPE_E5M2 && b->dtype == FP8_DTYPE_E5M2)
        fp8::fail(FP8_ERR_DTYPE, "a and b are both e5m2; FP8 GEMMs take e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3");
    } else if (a->dtype != b->dtype) {
      fp8::fail(FP8_ERR_DTYPE, "a has dtype ", fp8::dtype_name(a->dtype), " and b ", fp8::dtype_name(b->dtype),
                "; expected both FP8 (e4m3/e5m2) or both the same of f32, f16, bf16");
    }
    const bool fp8_out = fp8::dtype_is_fp8(d->dtype);
    if (d->dtype == FP8_DTYPE_E5M2 && a->dtype == FP8_DTYPE_E4M3 && b->dtype == FP8_DTYPE_E4M3)
      fp8::fail(FP8_ERR_DTYPE, "d has dtype e5m2 with e4m3 x e4m3 operands; cuBLASLt writes e5m2 only when an operand is e5m2");
    const bool d_ok = fp8_in ? (fp8_out || d->dtype == FP8_DTYPE_BF16 || d->dtype == FP8_DTYPE_F32)
                             : (d->dtype == a->dtype || d->dtype == FP8_DTYPE_F32);
    if (!d_ok)
      fp8::fail(FP8_ERR_DTYPE, "d has dtype ", fp8::dtype_name(d->dtype), "; expected ",
                fp8_in ? "bf16, f32, e4m3 or e5m2 for FP8 operands"
                       : (std::string(fp8::dtype_name(a->dtype)) + " or f32 for " + fp8::dtype_name(a->dtype) + " operands").c_str());

    const auto [m, n, k] = require_gemm_shapes(a, b, d);
    if (bias) {
      const fp8_dtype_t want = fp8_in ? FP8_DTYPE_BF16 : d->dtype;
      if (bias->dtype != want)
        fp8::fail(FP8_ERR_DTYPE, "bias has dtype ", fp8::dtype_name(bias->dtype), "; expected ", fp8::dtype_name(want));
      if (bias->ndim != 1 || bias->shape[0] != n)
        fp8::fail(FP8_ERR_SHAPE, "bias has shape ", fp8::shape_string(bias->ndim, bias->shape), ", expected [", n, "]");
    }
    fp8::require_output_scaling(d, "d", d_scaling, "d_scaling");
    if (fp8_out && opts.accumulate)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "options->accumulate = 1 with an FP8 d; expected 0");
    if (fp8_in) {
      require_16(k, "k (the last dimension of a and b)");
      require_16(n, "n (the rows of b)");
      for (auto [t, name] : {std::pair<const fp8_tensor*, const char*>{a, "a"}, {b, "b"}, {d, "d"}, {bias, "bias"}})
        if (t) require_aligned(t, name);
    }
    fp8::require_disjoint(d, "d", a, "a");
    fp8::require_disjoint(d, "d", b, "b");
    if (bias) fp8::require_disjoint(d, "d", bias, "bias");

    fp8::GemmJob job{};
    job.a = a->data;
    job.b = b->data;
    job.a_dtype = a->dtype;
    job.b_dtype = b->dtype;
    job.a_scale_inv = fp8::tensor_scale(fp8_in ? a->scale_inv : nullptr);
    job.b_scale_inv = fp8::tensor_scale(fp8_in ? b->scale_inv : nullptr);
    job.m = m;
    job.n = n;
    job.k = k;
    job.bias = bias ? bias->data : nullptr;
    job.bias_dtype = bias ? bias->dtype : FP8_DTYPE_BF16;
    job.d = d->data;
    job.d_dtype = d->dtype;
    job.d_state = fp8_out ? d_scaling->state : nullptr;
    job.d_scale_inv = fp8::tensor_scale(fp8_out ? d->scale_inv : nullptr);
    job.alpha = opts.alpha;
    job.accumulate = opts.accumulate != 0;
    job.fast_accumulation = opts.fast_accumulation != 0;
    if (m == 0 || n == 0) return;  // nothing to compute
    ctx->backend->gemm(job);
  });
}

FP8_API fp8_status_t fp8_gemm_scaled(fp8_context_t* ctx, const fp8_tensor_t* a, fp8_scale_mode_t a_mode,
                                     const fp8_tensor_t* a_scales, const fp8_tensor_t* b, fp8_scale_mode_t b_mode,
                                     const fp8_tensor_t* b_scales, const fp8_tensor_t* bias, fp8_tensor_t* d,
                                     const fp8_gemm_options_t* options) {
  return guard("fp8_gemm_scaled", [&] {
    require_arg(ctx, "ctx");
    require_arg(a, "a");
    require_arg(a_scales, "a_scales");
    require_arg(b, "b");
    require_arg(b_scales, "b_scales");
    require_arg(d, "d");
    const fp8::ScaleMode am = fp8::scale_mode_of(a_mode, "a_mode"), bm = fp8::scale_mode_of(b_mode, "b_mode");
    const fp8_gemm_options_t opts = read_options(options);
    require_scaled_pair(a_mode, am, b_mode, bm, opts);
    for (auto [t, name] : {std::pair<const fp8_tensor*, const char*>{a, "a"},
                           {a_scales, "a_scales"},
                           {b, "b"},
                           {b_scales, "b_scales"},
                           {d, "d"},
                           {bias, "bias"}})
      if (t) fp8::require_same_context(ctx, t, name);
    fp8::require_fp8(a, "a");
    fp8::require_fp8(b, "b");
    if (a->dtype == FP8_DTYPE_E5M2 && b->dtype == FP8_DTYPE_E5M2)
      fp8::fail(FP8_ERR_DTYPE, "a and b are both e5m2; FP8 GEMMs take e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3");
    if (d->dtype != FP8_DTYPE_F32 && d->dtype != FP8_DTYPE_BF16)
      fp8::fail(FP8_ERR_DTYPE, "d has dtype ", fp8::dtype_name(d->dtype), "; expected bf16 or f32 (GEMMs with scale grids "
                "write no FP8 D)");
    const auto [m, n, k] = require_gemm_shapes(a, b, d);
    if (bias) {
      if (bias->dtype != FP8_DTYPE_BF16)
        fp8::fail(FP8_ERR_DTYPE, "bias has dtype ", fp8::dtype_name(bias->dtype), "; expected bf16");
      if (bias->ndim != 1 || bias->shape[0] != n)
        fp8::fail(FP8_ERR_SHAPE, "bias has shape ", fp8::shape_string(bias->ndim, bias->shape), ", expected [", n, "]");
    }
    fp8::GemmJob job{};
    job.a_scale_inv = fp8::require_grid(a_scales, "a_scales", am, m, k, "a");
    job.b_scale_inv = fp8::require_grid(b_scales, "b_scales", bm, n, k, "b");
    for (auto [t, name] : {std::pair<const fp8_tensor*, const char*>{a, "a"}, {b, "b"}, {d, "d"}, {bias, "bias"},
                           {a_scales, "a_scales"}, {b_scales, "b_scales"}})
      if (t) require_aligned(t, name);
    for (auto [t, name] : {std::pair<const fp8_tensor*, const char*>{a, "a"}, {b, "b"}, {bias, "bias"},
                           {a_scales, "a_scales"}, {b_scales, "b_scales"}})
      if (t) fp8::require_disjoint(d, "d", t, name);
    job.a = a->data;
    job.b = b->data;
    job.a_dtype = a->dtype;
    job.b_dtype = b->dtype;
    job.m = m;
    job.n = n;
    job.k = k;
    job.bias = bias ? bias->data : nullptr;
    job.bias_dtype = FP8_DTYPE_BF16;
    job.d = d->data;
    job.d_dtype = d->dtype;
    job.alpha = opts.alpha;
    job.accumulate = opts.accumulate != 0;
    job.fast_accumulation = opts.fast_accumulation != 0;
    fp8::check_gemm_scales(job, ctx->backend->describe().c_str());  // the pairs and settings, before any work
    if (m == 0 || n == 0) return;  // nothing to compute
    ctx->backend->gemm(job);
  });
}

}  // extern "C"
