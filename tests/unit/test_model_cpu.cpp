// The model and layer API (fp8_model_*, fp8_convert_model, fp8_autocast_*, fp8_layer_*) on the CPU
// reference backend. Numbers are checked against float64 computed here, never against the library:
// where a GEMM runs in FP8, on the values its casts must give (fp8_encode/fp8_decode with the scale
// read from the layer's state before the step, dequantised with scale_inv = 1/scale as float); where
// it runs in high precision, on the unquantised values. Shapes are small (the CPU GEMM is a loop).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

// =================================================================================================
// Handles, host data and small readers
// =================================================================================================

std::vector<int64_t> with_last(std::vector<int64_t> shape, int64_t last) {
  shape.back() = last;
  return shape;
}

// A tensor of `dt` and `shape`, filled with `values` when given (host layout of that dtype).
template <typename T = float>
Tensor tensor_of(fp8_context_t* ctx, fp8_dtype_t dt, const std::vector<int64_t>& shape,
                 const std::vector<T>& values = {}) {
  Tensor t = make_tensor(ctx, dt, shape);
  if (!values.empty()) upload(t.get(), values);
  return t;
}
Tensor f32_tensor(fp8_context_t* ctx, const std::vector<int64_t>& shape, const std::vector<float>& values = {}) {
  return tensor_of(ctx, FP8_DTYPE_F32, shape, values);
}

std::vector<float> param_value(fp8_model_t* m, const std::string& name) {
  return download<float>(param_tensor(m, name));
}
std::vector<float> param_grad(fp8_model_t* m, const std::string& name) {
  return download<float>(param_tensor(m, name, true));
}

fp8_layer_report_t report_of(const fp8_model_t* m, int32_t id) {
  fp8_layer_report_t r;
  fp8_layer_report_init(&r);
  EXPECT_OK(fp8_layer_get_report(m, id, &r));
  return r;
}

fp8_scaling_t* scaling_of(fp8_model_t* m, int32_t id, int32_t slot) {
  fp8_scaling_t* s = nullptr;
  EXPECT_OK(fp8_layer_get_scaling(m, id, slot, &s));
  return s;
}
fp8_scaling_info_t state_info(fp8_model_t* m, int32_t id, int32_t slot) {
  fp8_scaling_t* s = scaling_of(m, id, slot);
  EXPECT_NE(s, nullptr) << "layer " << id << " has no state in slot " << slot;
  if (!s) return fp8_scaling_info_t{};
  return info_of(s);
}

std::string model_report_text(const fp8_model_t* m) {
  size_t needed = 0;
  EXPECT_EQ(fp8_model_report(m, nullptr, 0, &needed), FP8_ERR_BUFFER_TOO_SMALL);
  std::string buf(needed, '\0');
  EXPECT_OK(fp8_model_report(m, buf.data(), buf.size(), nullptr));
  return std::string(buf.c_str());
}

// The default recipe (HYBRID, most_recent) with the small-layer rule off, so that the small shapes
// of these tests still run in FP8, plus `extra` attributes.
// The layer tests pin TransformerEngine's numerics on FP32 weights: backend te keeps them FP32 (the
// MS-AMP levels' F16/E4M3 storage is test_optim_levels' subject).
Recipe fp8_recipe(std::initializer_list<std::pair<fp8_recipe_attr_t, int64_t>> extra = {}) {
  Recipe r = make_recipe("backend=te");
  EXPECT_OK(fp8_recipe_set_int(r.get(), FP8_RECIPE_SMALL_LAYER_FALLBACK, 0));
  for (auto [attr, value] : extra) EXPECT_OK(fp8_recipe_set_int(r.get(), attr, value));
  return r;
}

// =================================================================================================
// float64 references
// =================================================================================================

using Vec = std::vector<double>;

Vec widen(const std::vector<float>& v) {
  return Vec(v.begin(), v.end());
}

// What an FP8 cast with `scale` gives back: decode(encode(x * scale)) * (1/scale as float).
Vec quantised(const std::vector<float>& v, float scale, fp8_dtype_t dt) {
  const float scale_inv = 1.0f / scale;
  Vec q(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    q[i] = static_cast<double>(fp8_decode(fp8_encode(v[i] * scale, dt), dt)) * static_cast<double>(scale_inv);
  return q;
}

// Round to the nearest bf16, ties to even (inputs here are finite).
float bf16_round(float f) {
  uint32_t u = bits_of(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
std::vector<float> bf16_rounded(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  std::transform(v.begin(), v.end(), r.begin(), bf16_round);
  return r;
}

// y [m, out] = x [m, in] W^T [in, out] + b (b may be empty).
Vec y_ref(const Vec& x, const Vec& w, const Vec& b, int64_t m, int64_t in, int64_t out) {
  Vec y(static_cast<size_t>(m * out));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[static_cast<size_t>(o)];
      for (int64_t k = 0; k < in; ++k) acc += x[static_cast<size_t>(r * in + k)] * w[static_cast<size_t>(o * in + k)];
      y[static_cast<size_t>(r * out + o)] = acc;
    }
  return y;
}
// dx [m, in] = dy [m, out] W [out, in].
Vec dx_ref(const Vec& dy, const Vec& w, int64_t m, int64_t in, int64_t out) {
  Vec dx(static_cast<size_t>(m * in), 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < in; ++k)
        dx[static_cast<size_t>(r * in + k)] +=
            dy[static_cast<size_t>(r * out + o)] * w[static_cast<size_t>(o * in + k)];
  return dx;
}
// dW [out, in] = dy^T [out, m] x [m, in].
Vec dw_ref(const Vec& dy, const Vec& x, int64_t m, int64_t in, int64_t out) {
  Vec dw(static_cast<size_t>(out * in), 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < in; ++k)
        dw[static_cast<size_t>(o * in + k)] +=
            dy[static_cast<size_t>(r * out + o)] * x[static_cast<size_t>(r * in + k)];
  return dw;
}
// db [out] = column sums of dy [m, out].
Vec db_ref(const std::vector<float>& dy, int64_t m, int64_t out) {
  Vec db(static_cast<size_t>(out), 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o) db[static_cast<size_t>(o)] += dy[static_cast<size_t>(r * out + o)];
  return db;
}

Vec plus(Vec a, const Vec& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

// Relative Frobenius error ||got - want|| / ||want||.
double rel_err(const std::vector<float>& got, const Vec& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The producers of an FP8 hand-off, in float64: LayerNorm, RMSNorm (rows of d) and GELU.
Vec producer_ref(fp8_layer_kind_t kind, const std::vector<float>& x, int64_t d, const std::vector<float>& gamma,
                 const std::vector<float>& beta, double eps) {
  Vec y(x.size());
  if (kind == FP8_LAYER_ACTIVATION) {
    for (size_t i = 0; i < x.size(); ++i) {
      const double v = x[i];
      y[i] = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / 3.14159265358979323846) * (v + 0.044715 * v * v * v)));
    }
    return y;
  }
  for (size_t r = 0; r < x.size() / static_cast<size_t>(d); ++r) {
    const float* row = &x[r * static_cast<size_t>(d)];
    double mean = 0.0, sq = 0.0;
    if (kind == FP8_LAYER_LAYERNORM) {
      for (int64_t c = 0; c < d; ++c) mean += row[c];
      mean /= static_cast<double>(d);
    }
    for (int64_t c = 0; c < d; ++c) sq += (row[c] - mean) * (row[c] - mean);
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(d) + eps);
    for (int64_t c = 0; c < d; ++c)
      y[r * static_cast<size_t>(d) + static_cast<size_t>(c)] =
          (row[c] - mean) * rstd * gamma[static_cast<size_t>(c)] + (beta.empty() ? 0.0 : beta[static_cast<size_t>(c)]);
  }
  return y;
}

// =================================================================================================
// One Linear "fc" in a model of its own, with its parameters mirrored on the host, and one step of it
// =================================================================================================

constexpr int64_t kIn = 64, kOut = 32, kTokens = 32;

struct LinearCase {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int64_t in, out;
  bool bias;
  int32_t id = -1;
  std::vector<float> w, b;

  LinearCase(int64_t in_features, int64_t out_features, bool with_bias = true, uint32_t seed = 1)
      : in(in_features), out(out_features), bias(with_bias) {
    EXPECT_OK(fp8_model_add_linear(model.get(), "fc", in, out, with_bias ? 1 : 0, &id));
    set_weights(seed);
  }
  // New values through fp8_tensor_copy_from_host, as after an optimizer step.
  void set_weights(uint32_t seed) {
    w = randn(static_cast<size_t>(in * out), seed, 1.0f / std::sqrt(static_cast<float>(in)));
    set_param(model.get(), "fc.weight", w);
    if (bias) {
      b = randn(static_cast<size_t>(out), seed + 1000, 0.5f);
      set_param(model.get(), "fc.bias", b);
    }
  }
  void copy_weights_from(const LinearCase& other) {
    w = other.w;
    b = other.b;
    set_param(model.get(), "fc.weight", w);
    if (bias) set_param(model.get(), "fc.bias", b);
  }
  void convert(const fp8_recipe_t* recipe) { EXPECT_OK(fp8_convert_model(model.get(), recipe, nullptr)); }
  fp8_scaling_info_t state(int32_t slot) { return state_info(model.get(), id, slot); }
  fp8_layer_report_t report() const { return report_of(model.get(), id); }
};

// The scales an FP8 step will use, read from the layer's states before it.
struct Scales {
  float x = 1.0f, w = 1.0f, dy = 1.0f;
  fp8_dtype_t dy_dtype = FP8_DTYPE_E5M2;
};
Scales scales_now(LinearCase& c) {
  Scales s;
  s.x = c.state(FP8_SCALING_INPUT).scale;
  s.w = c.state(FP8_SCALING_WEIGHT).scale;
  s.dy = c.state(FP8_SCALING_GRAD_OUTPUT).scale;
  fp8_scaling_t* dy_state = scaling_of(c.model.get(), c.id, FP8_SCALING_GRAD_OUTPUT);
  if (dy_state) {
    EXPECT_OK(fp8_scaling_dtype(dy_state, &s.dy_dtype));
  }
  return s;
}

struct StepOut {
  std::vector<float> y, dx, dw, db;
};

// One step of c's Linear on F32 activations: [autocast_begin] forward [backward] [autocast_end], then
// y, dx and the parameter gradients read back. `before_end` runs just before fp8_autocast_end.
StepOut run_step(LinearCase& c, const std::vector<int64_t>& x_shape, const std::vector<float>& x,
                 const std::vector<float>& dy, bool autocast, bool backward = true,
                 const std::function<void()>& before_end = {}) {
  const std::vector<int64_t> y_shape = with_last(x_shape, c.out);
  Tensor tx = f32_tensor(c.ctx.get(), x_shape, x), ty = f32_tensor(c.ctx.get(), y_shape);
  Tensor tdy = f32_tensor(c.ctx.get(), y_shape, dy), tdx = f32_tensor(c.ctx.get(), x_shape);
  if (autocast) {
    EXPECT_OK(fp8_autocast_begin(c.model.get()));
  }
  if (backward) {
    EXPECT_OK(fp8_layer_forward(c.model.get(), c.id, tx.get(), ty.get()));
    EXPECT_OK(fp8_layer_backward(c.model.get(), c.id, tdy.get(), tdx.get()));
  } else {
    EXPECT_OK(forward_only(c.model.get(), c.id, tx.get(), ty.get()));
  }
  if (before_end) before_end();
  if (autocast) {
    EXPECT_OK(fp8_autocast_end(c.model.get()));
  }
  StepOut o;
  o.y = download<float>(ty.get());
  if (backward) {
    o.dx = download<float>(tdx.get());
    o.dw = param_grad(c.model.get(), "fc.weight");
    if (c.bias) o.db = param_grad(c.model.get(), "fc.bias");
  }
  return o;
}

// Precision of each GEMM: 1 FP8, 0 high, -1 none (as fp8_layer_report_t has them).
struct Plan {
  int32_t fprop, dgrad, wgrad;
};

void expect_plan(const fp8_layer_report_t& r, Plan p) {
  EXPECT_EQ(r.fprop, p.fprop);
  EXPECT_EQ(r.dgrad, p.dgrad);
  EXPECT_EQ(r.wgrad, p.wgrad);
}

// y, dx, dW and db of one step against float64: an FP8 GEMM on the quantised operands (the FP8
// forward adds the bias rounded to bf16), a high-precision one on the unquantised values.
void expect_step_matches(const LinearCase& c, const std::vector<float>& x, const std::vector<float>& dy,
                         const Scales& s, Plan p, const StepOut& got, bool backward = true) {
  const int64_t m = static_cast<int64_t>(x.size()) / c.in;
  const Vec xq = quantised(x, s.x, FP8_DTYPE_E4M3), wq = quantised(c.w, s.w, FP8_DTYPE_E4M3);
  const Vec xw = widen(x), ww = widen(c.w);
  const Vec bias = !c.bias ? Vec{} : p.fprop == 1 ? widen(bf16_rounded(c.b)) : widen(c.b);
  EXPECT_LT(rel_err(got.y, y_ref(p.fprop == 1 ? xq : xw, p.fprop == 1 ? wq : ww, bias, m, c.in, c.out)), 1e-5) << "y";
  if (!backward) return;
  const Vec dyq = quantised(dy, s.dy, s.dy_dtype), dyw = widen(dy);
  EXPECT_LT(rel_err(got.dx, dx_ref(p.dgrad == 1 ? dyq : dyw, p.dgrad == 1 ? wq : ww, m, c.in, c.out)), 1e-5) << "dx";
  EXPECT_LT(rel_err(got.dw, dw_ref(p.wgrad == 1 ? dyq : dyw, p.wgrad == 1 ? xq : xw, m, c.in, c.out)), 1e-5) << "dW";
  if (c.bias) {
    EXPECT_LT(rel_err(got.db, db_ref(dy, m, c.out)), 1e-6) << "db";
  }
}

// The same layer, never converted, with the same parameters: what high precision computes.
StepOut high_precision_twin(const LinearCase& c, const std::vector<int64_t>& x_shape, const std::vector<float>& x,
                            const std::vector<float>& dy) {
  LinearCase twin(c.in, c.out, c.bias);
  twin.copy_weights_from(c);
  return run_step(twin, x_shape, x, dy, false);
}

std::vector<float> random_x(int64_t rows, int64_t in, uint32_t seed, float stddev = 1.5f) {
  return randn(static_cast<size_t>(rows * in), seed, stddev);
}
std::vector<float> random_dy(int64_t rows, int64_t out, uint32_t seed, float stddev = 0.02f) {
  return randn(static_cast<size_t>(rows * out), seed, stddev);
}

// =================================================================================================
// 1. An FP8 Linear, forward and backward, is the exact product of the quantised values
// =================================================================================================

// Two steps, new weights before each (as after an optimizer step), so that the second one casts
// x, W and dy with scales the first step's amaxes set (not 1). The second step takes a 3-D x.
TEST(LinearFp8, ForwardAndBackwardMatchFloat64OnTheQuantisedValuesOverTwoSteps) {
  for (bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "with bias" : "without bias");
    LinearCase c(kIn, kOut, with_bias);
    c.convert(fp8_recipe().get());
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      c.set_weights(10 + step);
      const Scales s = scales_now(c);
      EXPECT_EQ(s.dy_dtype, FP8_DTYPE_E5M2);  // HYBRID: gradients in E5M2
      if (step == 1) {
        EXPECT_NE(s.x, 1.0f);
        EXPECT_NE(s.w, 1.0f);
        EXPECT_NE(s.dy, 1.0f);
      }
      const auto x = random_x(kTokens, kIn, 20 + step), dy = random_dy(kTokens, kOut, 30 + step);
      FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
      const std::vector<int64_t> shape =
          step == 0 ? std::vector<int64_t>{kTokens, kIn} : std::vector<int64_t>{2, kTokens / 2, kIn};
      const StepOut got = run_step(c, shape, x, dy, true);
      expect_step_matches(c, x, dy, s, {1, 1, 1}, got);
      // The check can tell FP8 from high precision: quantisation moves y by far more than 1e-5.
      const Vec hp_bias = with_bias ? widen(c.b) : Vec{};
      EXPECT_GT(rel_err(got.y, y_ref(widen(x), widen(c.w), hp_bias, kTokens, kIn, kOut)), 1e-3);

      const fp8_layer_report_t r = c.report();
      EXPECT_EQ(r.kind, FP8_LAYER_LINEAR);
      EXPECT_EQ(r.converted, 1);
      expect_plan(r, {1, 1, 1});
      EXPECT_STREQ(r.reason, "");
      EXPECT_EQ(r.fp8_calls, step + 1);
      EXPECT_EQ(r.fallback_calls, 0);
    }
  }
}

// The recipe is copied at conversion: destroying it does not disturb the converted layer.
TEST(LinearFp8, RecipeIsCopiedAtConversion) {
  LinearCase c(kIn, kOut);
  {
    Recipe r = fp8_recipe();
    c.convert(r.get());
  }
  const auto x = random_x(kTokens, kIn, 1), dy = random_dy(kTokens, kOut, 2);
  const Scales s = scales_now(c);
  expect_step_matches(c, x, dy, s, {1, 1, 1}, run_step(c, {kTokens, kIn}, x, dy, true));
  expect_plan(c.report(), {1, 1, 1});
}

// =================================================================================================
// 2. Delayed scaling: every state is updated once per fp8_autocast_end, with that step's amax
// =================================================================================================

class LinearScaling : public ::testing::TestWithParam<int32_t> {};

// most_recent: after each step, scale = fp8_max / amax(this step's tensor), exactly as float; the
// weight (unchanged since the first step) keeps 448 / amax(W). The steps use these scales: each one
// matches float64 with the scales read before it (the weight copy keeps the scale it was made with).
TEST_P(LinearScaling, MostRecentScaleIsFp8MaxOverEachStepsAmax) {
  const int32_t format = GetParam();
  const fp8_dtype_t dy_dtype = format == FP8_FORMAT_HYBRID ? FP8_DTYPE_E5M2 : FP8_DTYPE_E4M3;
  const float dy_max = format == FP8_FORMAT_HYBRID ? 57344.0f : 448.0f;
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{FP8_RECIPE_FP8_FORMAT, format}}).get());
  const float x_mags[] = {1.0f, 7.5f, 0.03f, 300.0f}, dy_mags[] = {0.5f, 1e-3f, 20.0f, 0.07f};
  float w_copy_scale = 0.0f;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Scales s = scales_now(c);
    EXPECT_EQ(s.dy_dtype, dy_dtype);
    if (step == 0) w_copy_scale = s.w;
    s.w = w_copy_scale;  // the FP8 weight was made at step 0 and is reused
    const auto x = random_x(kTokens, kIn, 40 + step, x_mags[step]),
               dy = random_dy(kTokens, kOut, 50 + step, dy_mags[step]);
    FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
    expect_step_matches(c, x, dy, s, {1, 1, 1}, run_step(c, {kTokens, kIn}, x, dy, true));

    const fp8_scaling_info_t ix = c.state(FP8_SCALING_INPUT), iw = c.state(FP8_SCALING_WEIGHT),
                             idy = c.state(FP8_SCALING_GRAD_OUTPUT);
    EXPECT_EQ(ix.scale, 448.0f / amax_of(x));
    EXPECT_EQ(iw.scale, 448.0f / amax_of(c.w));
    EXPECT_EQ(idy.scale, dy_max / amax_of(dy));
    EXPECT_EQ(ix.update_count, step + 1);
    EXPECT_EQ(idy.update_count, step + 1);
    EXPECT_EQ(iw.update_count, 1) << "the weight copy (its only amax) was made once, at step 0";
    for (const fp8_scaling_info_t& i : {ix, iw, idy}) {
      EXPECT_EQ(i.scale_inv, 1.0f / i.scale);
      EXPECT_EQ(i.amax, 0.0f);  // the history rolled: slot 0 is fresh for the next step
      EXPECT_EQ(i.nonfinite_count, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, LinearScaling, ::testing::Values(FP8_FORMAT_HYBRID, FP8_FORMAT_E4M3),
                         [](const ::testing::TestParamInfo<int32_t>& i) {
                           return std::string(i.param == FP8_FORMAT_HYBRID ? "Hybrid" : "E4M3");
                         });

// algo max over a history of 3: the scale follows the largest amax of the last three steps, so a
// large amax keeps the scale down for exactly three updates.
TEST(LinearScalingHistory, MaxAlgoUsesTheLargestAmaxOfTheHistory) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{FP8_RECIPE_AMAX_COMPUTE_ALGO, FP8_AMAX_ALGO_MAX}, {FP8_RECIPE_AMAX_HISTORY_LEN, 3}}).get());
  const float mags[] = {50.0f, 1.0f, 2.0f, 0.5f, 0.25f};
  std::vector<float> amaxes;
  for (int step = 0; step < 5; ++step) {
    const auto x = random_x(kTokens, kIn, 60 + step, mags[step]);
    run_step(c, {kTokens, kIn}, x, random_dy(kTokens, kOut, 70 + step), true);
    amaxes.push_back(amax_of(x));
    const size_t first = amaxes.size() > 3 ? amaxes.size() - 3 : 0;
    const float window_max = *std::max_element(amaxes.begin() + static_cast<std::ptrdiff_t>(first), amaxes.end());
    EXPECT_EQ(c.state(FP8_SCALING_INPUT).scale, 448.0f / window_max) << "step " << step;
  }
}

// =================================================================================================
// 2b. Current scaling: each cast is scaled by the amax of the very tensor it casts
// =================================================================================================

// The current-scaling rule for a normal amax, computed here: (fp8_max * 2^-margin) / amax as a float
// division, then 2^floor(log2) under power_2_scales.
float current_scale_of(const std::vector<float>& v, float fp8_max, int margin, bool pow2) {
  const float s = std::ldexp(fp8_max, -margin) / amax_of(v);
  return pow2 ? std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(static_cast<double>(s))))) : s;
}

// Three steps whose magnitudes jump by 300x and 10^4x, new weights each time: every step matches
// float64 on values quantised with that step's own scales (never the previous step's, as delayed
// scaling would use), for the default format, E4M3 gradients, and a margin with power-of-two
// scales. The states show each cast: its amax in slot 0, its scale, one update per cast; nothing
// else updates them (fp8_autocast_end runs no delayed update).
TEST(LinearCurrentScaling, EachCastUsesTheScaleOfItsOwnTensor) {
  struct Variant {
    const char* text;
    int margin;
    bool pow2;
    fp8_dtype_t dy_dtype;
  };
  for (const Variant& v : {Variant{"", 0, false, FP8_DTYPE_E5M2}, Variant{"fp8_format=E4M3", 0, false, FP8_DTYPE_E4M3},
                           Variant{"margin=1, power_2_scales=on", 1, true, FP8_DTYPE_E5M2}}) {
    SCOPED_TRACE(v.text);
    Recipe r = fp8_recipe({{FP8_RECIPE_SCALING, FP8_SCALING_CURRENT}});
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), v.text));
    LinearCase c(kIn, kOut);
    c.convert(r.get());
    const float dy_max = v.dy_dtype == FP8_DTYPE_E5M2 ? 57344.0f : 448.0f;
    const float x_mags[] = {1.0f, 300.0f, 0.03f}, dy_mags[] = {0.5f, 1e-3f, 20.0f};
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      c.set_weights(80 + step);
      const auto x = random_x(kTokens, kIn, 90 + step, x_mags[step]),
                 dy = random_dy(kTokens, kOut, 100 + step, dy_mags[step]);
      Scales s;
      s.x = current_scale_of(x, 448.0f, v.margin, v.pow2);
      s.w = current_scale_of(c.w, 448.0f, v.margin, v.pow2);
      s.dy = current_scale_of(dy, dy_max, v.margin, v.pow2);
      s.dy_dtype = v.dy_dtype;
      FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
      expect_step_matches(c, x, dy, s, {1, 1, 1}, run_step(c, {kTokens, kIn}, x, dy, true));
      const fp8_scaling_info_t ix = c.state(FP8_SCALING_INPUT), iw = c.state(FP8_SCALING_WEIGHT),
                               idy = c.state(FP8_SCALING_GRAD_OUTPUT);
      EXPECT_EQ(ix.scale, s.x);
      EXPECT_EQ(iw.scale, s.w);
      EXPECT_EQ(idy.scale, s.dy);
      EXPECT_EQ(ix.amax, amax_of(x));
      EXPECT_EQ(iw.amax, amax_of(c.w));
      EXPECT_EQ(idy.amax, amax_of(dy));
      for (const fp8_scaling_info_t& i : {ix, iw, idy}) {
        EXPECT_EQ(i.update_count, step + 1);
        EXPECT_EQ(i.scale_inv, 1.0f / i.scale);
        EXPECT_EQ(i.nonfinite_count, 0);
      }
    }
  }
}

// Micro-batches under current scaling: the weight copy is still made once per weights version (one
// cast of W for two forwards), while x and dy are cast, and counted, per call.
TEST(LinearCurrentScaling, WeightCopyIsMadeOncePerWeightsVersion) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{FP8_RECIPE_SCALING, FP8_SCALING_CURRENT}}).get());
  for (int micro = 0; micro < 2; ++micro) {
    const auto x = random_x(kTokens, kIn, 110 + micro), dy = random_dy(kTokens, kOut, 120 + micro);
    Scales s;
    s.x = current_scale_of(x, 448.0f, 0, false);
    s.w = current_scale_of(c.w, 448.0f, 0, false);
    s.dy = current_scale_of(dy, 57344.0f, 0, false);
    FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
    expect_step_matches(c, x, dy, s, {1, 1, 1}, run_step(c, {kTokens, kIn}, x, dy, true));
  }
  EXPECT_EQ(c.state(FP8_SCALING_WEIGHT).update_count, 1);
  EXPECT_EQ(c.state(FP8_SCALING_INPUT).update_count, 2);
  EXPECT_EQ(c.state(FP8_SCALING_GRAD_OUTPUT).update_count, 2);
}

// A NaN in x: scale 1 for that cast and the state counts it; the next finite x is scaled normally.
TEST(LinearCurrentScaling, NonFiniteInputIsCountedAndTheNextCastRecovers) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{FP8_RECIPE_SCALING, FP8_SCALING_CURRENT}}).get());
  auto x = random_x(kTokens, kIn, 130);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  run_step(c, {kTokens, kIn}, x, random_dy(kTokens, kOut, 131), true);
  fp8_scaling_info_t ix = c.state(FP8_SCALING_INPUT);
  EXPECT_EQ(ix.scale, 1.0f);
  EXPECT_EQ(ix.nonfinite_count, 1);
  EXPECT_TRUE(std::isnan(ix.amax));
  const auto x2 = random_x(kTokens, kIn, 132);
  run_step(c, {kTokens, kIn}, x2, random_dy(kTokens, kOut, 133), true);
  ix = c.state(FP8_SCALING_INPUT);
  EXPECT_EQ(ix.scale, 448.0f / amax_of(x2));
  EXPECT_EQ(ix.nonfinite_count, 1);
  EXPECT_EQ(ix.update_count, 2);
}

// No FP8 hand-off under current scaling: in a whole-model run the norm writes its y in the
// activation dtype and the Linear casts it with the scale of that y; a per-layer call that asks the
// norm (or an activation) for an FP8 y is refused, naming the recipe; a delayed-scaling update of
// the model's current states is refused too.
TEST(LinearCurrentScaling, NormHandsOverAWideYAndRefusesAnFp8One) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t ln = -1, fc = -1, act = -1;
  FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "ln", kIn, 1e-5f, &ln));
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", kIn, kOut, 1, &fc));
  FP8_ASSERT_OK(fp8_model_add_activation(model.get(), "act", FP8_ACTIVATION_GELU, &act));
  set_param(model.get(), "fc.weight", randn(kIn * kOut, 1, 0.125f));
  Recipe recipe = fp8_recipe({{FP8_RECIPE_SCALING, FP8_SCALING_CURRENT}});
  FP8_ASSERT_OK(fp8_convert_model(model.get(), recipe.get(), nullptr));
  const std::vector<float> x = randn(kTokens * kIn, 5, 1.0f, 0.2f);
  Tensor tx = f32_tensor(ctx.get(), {kTokens, kIn}, x), ty = f32_tensor(ctx.get(), {kTokens, kOut});
  FP8_ASSERT_OK(fp8_autocast_begin(model.get()));
  FP8_ASSERT_OK(fp8_model_forward(model.get(), tx.get(), ty.get()));
  FP8_ASSERT_OK(fp8_autocast_end(model.get()));
  EXPECT_EQ(report_of(model.get(), ln).fprop, 0) << "the norm wrote a wide y";
  EXPECT_EQ(report_of(model.get(), fc).fprop, 1);
  // The Linear cast the norm's output itself: its amax is that of the normalised x (about 3-4
  // for 64 normal values), not 0 as after a hand-off.
  const fp8_scaling_info_t ix = state_info(model.get(), fc, FP8_SCALING_INPUT);
  EXPECT_GT(ix.amax, 1.0f);
  EXPECT_EQ(ix.scale, 448.0f / ix.amax);
  EXPECT_EQ(state_info(model.get(), ln, FP8_SCALING_OUTPUT).update_count, 0);

  Tensor h = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {kTokens, kIn});
  Tensor g = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {kTokens, kOut}), ty2 = f32_tensor(ctx.get(), {kTokens, kOut});
  FP8_ASSERT_OK(fp8_autocast_begin(model.get()));
  EXPECT_REFUSED_WORDS(forward_only(model.get(), ln, tx.get(), h.get()), FP8_ERR_UNSUPPORTED, "fp8_layer_forward_saved",
                       "'ln'", "scaling=current", "wide y");
  EXPECT_REFUSED_WORDS(forward_only(model.get(), act, ty.get(), g.get()), FP8_ERR_UNSUPPORTED,
                       "fp8_layer_forward_saved", "'act'", "scaling=current");
  FP8_ASSERT_OK(fp8_autocast_end(model.get()));
  fp8_scaling_t* states[1] = {scaling_of(model.get(), fc, FP8_SCALING_INPUT)};
  EXPECT_REFUSED_WORDS(fp8_scaling_update(ctx.get(), states, 1, recipe.get()), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_scaling_update", "states[0]", "current scaling");
}

// =================================================================================================
// 2c. Rowwise and block scaling: a grid of scales per cast, each cell scaled by its own amax
// =================================================================================================

// v [rows, cols] quantised in cells of th x tw (clipped at the edges), each cell with the current
// scaling rule on its amax (computed here: fp8_max * 2^-margin / amax as a float division, FLT_MAX
// past overflow, 2^floor(log2) under pow2, 1 for a zero cell), and dequantised again.
Vec cells_quantised(const std::vector<float>& v, int64_t rows, int64_t cols, int64_t th, int64_t tw, fp8_dtype_t dt,
                    int margin, bool pow2) {
  const float fp8_max = dt == FP8_DTYPE_E5M2 ? 57344.0f : 448.0f;
  Vec q(v.size());
  for (int64_t r0 = 0; r0 < rows; r0 += th)
    for (int64_t c0 = 0; c0 < cols; c0 += tw) {
      float amax = 0.0f;
      for (int64_t r = r0; r < std::min(rows, r0 + th); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + tw); ++c) amax = std::max(amax, std::fabs(v[static_cast<size_t>(r * cols + c)]));
      float s = amax > 0.0f ? std::ldexp(fp8_max, -margin) / amax : 1.0f;
      if (std::isinf(s)) s = FLT_MAX;
      if (pow2) s = std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(static_cast<double>(s)))));
      const double s_inv = static_cast<double>(1.0f / s);
      for (int64_t r = r0; r < std::min(rows, r0 + th); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + tw); ++c) {
          const size_t i = static_cast<size_t>(r * cols + c);
          q[i] = static_cast<double>(fp8_decode(fp8_encode(v[i] * s, dt), dt)) * s_inv;
        }
    }
  return q;
}

// Two steps of a Linear with partial 128-blocks in every dimension (208 tokens, 160 -> 144) under
// rowwise and block scaling (and block without power-of-two scales, rowwise with a margin): y, dx,
// dW and db match float64 on the operands quantised cell by cell as each GEMM takes them:
//   y  = x (cells along in) . W (rows, or 128x128 blocks)^T + bf16(b)
//   dx = dy (cells along out) . W^T (columns of W, or the same 128x128 blocks)
//   dW = dy^T (cells along the tokens) . x^T (cells along the tokens)
TEST(LinearCellScaling, RowwiseAndBlockMatchFloat64OnTheCellQuantisedValues) {
  const int64_t in = 160, out = 144, tokens = 208;
  struct Variant {
    const char* text;
    bool block, pow2;
    int margin;
  };
  for (const Variant& v : {Variant{"scaling=rowwise", false, false, 0}, Variant{"scaling=rowwise, margin=1", false, false, 1},
                           Variant{"scaling=block", true, true, 0},
                           Variant{"scaling=block, power_2_scales=off", true, false, 0}}) {
    SCOPED_TRACE(v.text);
    Recipe r = fp8_recipe();
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), v.text));
    LinearCase c(in, out);
    c.convert(r.get());
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      c.set_weights(140 + step);
      // Magnitudes that vary by row and by column block, so that every cell has its own scale.
      std::vector<float> x = random_x(tokens, in, 150 + step), dy = random_dy(tokens, out, 160 + step);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t k = 0; k < in; ++k) x[static_cast<size_t>(t * in + k)] *= std::ldexp(1.0f, static_cast<int>((t % 5) + (k / 128) * 3) - 4);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t o = 0; o < out; ++o) dy[static_cast<size_t>(t * out + o)] *= std::ldexp(1.0f, static_cast<int>((t % 3) - (o / 128) * 2));
      FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
      const StepOut got = run_step(c, {tokens, in}, x, dy, true);
      const int64_t bt = v.block ? 1 : 0;  // (rowwise cells span a whole row or column)
      const auto along_rows = [&](const std::vector<float>& a, int64_t rows, int64_t cols, fp8_dtype_t dt) {
        return cells_quantised(a, rows, cols, 1, bt ? 128 : cols, dt, v.margin, v.pow2);
      };
      const auto along_cols = [&](const std::vector<float>& a, int64_t rows, int64_t cols, fp8_dtype_t dt) {
        return cells_quantised(a, rows, cols, bt ? 128 : rows, 1, dt, v.margin, v.pow2);
      };
      const Vec xq = along_rows(x, tokens, in, FP8_DTYPE_E4M3), xtq = along_cols(x, tokens, in, FP8_DTYPE_E4M3);
      const Vec dyq = along_rows(dy, tokens, out, FP8_DTYPE_E5M2), dytq = along_cols(dy, tokens, out, FP8_DTYPE_E5M2);
      const Vec wq = v.block ? cells_quantised(c.w, out, in, 128, 128, FP8_DTYPE_E4M3, v.margin, v.pow2)
                             : along_rows(c.w, out, in, FP8_DTYPE_E4M3);
      const Vec wtq = v.block ? wq : along_cols(c.w, out, in, FP8_DTYPE_E4M3);
      EXPECT_LT(rel_err(got.y, y_ref(xq, wq, widen(bf16_rounded(c.b)), tokens, in, out)), 1e-5) << "y";
      EXPECT_LT(rel_err(got.dx, dx_ref(dyq, wtq, tokens, in, out)), 1e-5) << "dx";
      EXPECT_LT(rel_err(got.dw, dw_ref(dytq, xtq, tokens, in, out)), 1e-5) << "dW";
      EXPECT_LT(rel_err(got.db, db_ref(dy, tokens, out)), 1e-6) << "db";
      // The checks can tell the modes apart: per-tensor quantisation is far from this.
      EXPECT_GT(rel_err(got.y, y_ref(quantised(x, 448.0f / amax_of(x), FP8_DTYPE_E4M3), wq, widen(bf16_rounded(c.b)),
                                      tokens, in, out)), 1e-3);
      expect_plan(c.report(), {1, 1, 1});
    }
  }
}

// A caller's E4M3 x under cell scaling is dequantised first, its grids made from those values: the
// step equals, bit for bit, the same step given the dequantised values in f32.
TEST(LinearCellScaling, AnFp8XIsDequantisedThenCastByItsCells) {
  for (const char* text : {"scaling=rowwise", "scaling=block"}) {
    SCOPED_TRACE(text);
    Recipe r = fp8_recipe();
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), text));
    LinearCase a(kIn, kOut), b(kIn, kOut);
    b.copy_weights_from(a);
    a.convert(r.get());
    b.convert(r.get());
    std::vector<uint8_t> codes(static_cast<size_t>(kTokens * kIn));
    std::vector<float> values(codes.size());
    for (size_t i = 0; i < codes.size(); ++i) {
      codes[i] = static_cast<uint8_t>((i * 37 + 11) % 256) & 0xF7;  // no NaN codes
      values[i] = fp8_decode(codes[i], FP8_DTYPE_E4M3) * 0.25f;
    }
    Tensor x8 = make_tensor(a.ctx.get(), FP8_DTYPE_E4M3, {kTokens, kIn});
    upload(x8.get(), codes);
    FP8_ASSERT_OK(fp8_tensor_set_scale_inv(x8.get(), 0.25f));
    const auto dy = random_dy(kTokens, kOut, 180);
    Tensor ya = f32_tensor(a.ctx.get(), {kTokens, kOut}), dya = f32_tensor(a.ctx.get(), {kTokens, kOut}, dy);
    Tensor dxa = f32_tensor(a.ctx.get(), {kTokens, kIn});
    FP8_ASSERT_OK(fp8_autocast_begin(a.model.get()));
    FP8_ASSERT_OK(fp8_layer_forward(a.model.get(), a.id, x8.get(), ya.get()));
    FP8_ASSERT_OK(fp8_layer_backward(a.model.get(), a.id, dya.get(), dxa.get()));
    FP8_ASSERT_OK(fp8_autocast_end(a.model.get()));
    const StepOut want = run_step(b, {kTokens, kIn}, values, dy, true);
    expect_plan(a.report(), {1, 1, 1});
    EXPECT_EQ(download<float>(ya.get()), want.y);
    EXPECT_EQ(download<float>(dxa.get()), want.dx);
    EXPECT_EQ(param_grad(a.model.get(), "fc.weight"), want.dw);
  }
}

// A NaN in x: its cell gets scale 1 and is counted (one row under rowwise, one 1x128 block under
// block); a token count that is not a multiple of 8 runs the layer in high precision with the reason.
TEST(LinearCellScaling, NonFiniteCellsAreCountedAndOddTokenCountsFallBack) {
  for (const char* text : {"scaling=rowwise", "scaling=block"}) {
    SCOPED_TRACE(text);
    Recipe r = fp8_recipe();
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), text));
    LinearCase c(kIn, kOut);
    c.convert(r.get());
    auto x = random_x(kTokens, kIn, 170);
    x[3] = std::numeric_limits<float>::quiet_NaN();
    run_step(c, {kTokens, kIn}, x, random_dy(kTokens, kOut, 171), true);
    EXPECT_EQ(c.state(FP8_SCALING_INPUT).nonfinite_count, 1);
    EXPECT_EQ(c.state(FP8_SCALING_GRAD_OUTPUT).nonfinite_count, 0);

    const auto x2 = random_x(36, kIn, 172);
    const StepOut got = run_step(c, {36, kIn}, x2, random_dy(36, kOut, 173), true);
    const fp8_layer_report_t rep = c.report();
    expect_plan(rep, {0, 0, 0});
    EXPECT_NE(std::string(rep.reason).find("multiple of 8"), std::string::npos) << rep.reason;
    EXPECT_LT(rel_err(got.y, y_ref(widen(x2), widen(c.w), widen(c.b), 36, kIn, kOut)), 1e-6);

    // 40 tokens: fprop and dgrad stay FP8, wgrad (K = the tokens) needs a multiple of 16.
    run_step(c, {40, kIn}, random_x(40, kIn, 174), random_dy(40, kOut, 175), true);
    const fp8_layer_report_t rep40 = c.report();
    expect_plan(rep40, {1, 1, 0});
    EXPECT_NE(std::string(rep40.reason).find("wgrad in high precision: 40 tokens is not a multiple of 16"),
              std::string::npos)
        << rep40.reason;
  }
}

// =================================================================================================
// 3. The FP8 weight copy is made once per weights version and reused by every micro-batch
// =================================================================================================

// The weight state's history slot 0 shows whether a forward cast W: amax(W) if it did, 0 if not.
TEST(LinearWeightCopy, MadeOncePerWeightsVersion) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe().get());
  // One forward in its own autocast region; returns the weight state's amax just before the end and
  // checks y against float64 with the scale the FP8 weight copy was made with.
  int seed = 100;
  auto region = [&](float w_copy_scale) {
    Scales s = scales_now(c);
    s.w = w_copy_scale;
    const auto x = random_x(kTokens, kIn, static_cast<uint32_t>(++seed));
    float amax = -1.0f;
    const StepOut got =
        run_step(c, {kTokens, kIn}, x, {}, true, false, [&] { amax = c.state(FP8_SCALING_WEIGHT).amax; });
    expect_step_matches(c, x, {}, s, {1, 1, 1}, got, false);
    return amax;
  };
  const float first_amax = amax_of(c.w);
  EXPECT_EQ(region(1.0f), first_amax) << "first forward: W is cast";
  EXPECT_EQ(region(1.0f), 0.0f) << "second micro-batch: the copy of the first forward is reused";

  c.set_weights(7);  // fp8_tensor_copy_from_host into fc.weight and fc.bias
  float scale = c.state(FP8_SCALING_WEIGHT).scale;
  EXPECT_EQ(scale, 448.0f / first_amax);
  EXPECT_EQ(region(scale), amax_of(c.w)) << "after new weights: cast again";
  EXPECT_EQ(region(scale), 0.0f);

  FP8_ASSERT_OK(fp8_model_weights_changed(c.model.get()));
  scale = c.state(FP8_SCALING_WEIGHT).scale;
  EXPECT_EQ(region(scale), amax_of(c.w)) << "after fp8_model_weights_changed: cast again";
  EXPECT_EQ(region(scale), 0.0f);
}

// After a weights change, the first FP8 forward makes the copies of every Linear that used one at
// this weights version or the one before (nn::make_weight_copies: one grouped cast on the GPU):
// their weight states record the new weights' amax although only the first Linear ran; a Linear
// that never ran in FP8, or not for two versions, is left to its own first call. Fails on per-layer
// copies.
TEST(LinearWeightCopy, TheFirstForwardAfterAWeightsChangeMakesEveryDueCopy) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model m = make_model(ctx.get());
  const int64_t d = 32, tokens = 16;
  for (const char* name : {"l0", "l1", "l2"}) FP8_ASSERT_OK(fp8_model_add_linear(m.get(), name, d, d, 0, nullptr));
  std::vector<std::vector<float>> w;
  for (int i = 0; i < 3; ++i) {
    w.push_back(randn(static_cast<size_t>(d * d), 10 + static_cast<uint32_t>(i), 0.5f * (i + 1)));
    set_param(m.get(), "l" + std::to_string(i) + ".weight", w.back());
  }
  Recipe r = make_recipe("backend=te, small_layer_fallback=off");  // (FP32 weights: amaxes exact)
  FP8_ASSERT_OK(fp8_convert_model(m.get(), r.get(), nullptr));
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {tokens, d}), y = make_tensor(ctx.get(), FP8_DTYPE_F32, {tokens, d});
  upload(x.get(), randn(static_cast<size_t>(tokens * d), 3, 1.0f));
  auto weight_amax = [&](int32_t id) { return state_info(m.get(), id, FP8_SCALING_WEIGHT).amax; };
  // Step 1: l0 and l1 run (each makes its own first copy); l2 never does.
  FP8_ASSERT_OK(fp8_autocast_begin(m.get()));
  for (int32_t id : {0, 1}) FP8_ASSERT_OK(forward_only(m.get(), id, x.get(), y.get()));
  EXPECT_EQ(weight_amax(1), amax_of(w[1]));
  FP8_ASSERT_OK(fp8_autocast_end(m.get()));
  // New weights; only l0 runs.
  for (int i = 0; i < 3; ++i) {
    w[i] = randn(static_cast<size_t>(d * d), 20 + static_cast<uint32_t>(i), 0.25f * (i + 1));
    set_param(m.get(), "l" + std::to_string(i) + ".weight", w[i]);
  }
  FP8_ASSERT_OK(fp8_autocast_begin(m.get()));
  FP8_ASSERT_OK(forward_only(m.get(), 0, x.get(), y.get()));
  EXPECT_EQ(weight_amax(0), amax_of(w[0]));
  EXPECT_EQ(weight_amax(1), amax_of(w[1])) << "l1's copy was made with l0's";
  EXPECT_EQ(weight_amax(2), 0.0f) << "l2 never ran in FP8: no copy made for it";
  // l1's forward reuses that copy: no second cast records anything after the update.
  FP8_ASSERT_OK(fp8_autocast_end(m.get()));
  FP8_ASSERT_OK(fp8_autocast_begin(m.get()));
  FP8_ASSERT_OK(forward_only(m.get(), 1, x.get(), y.get()));
  EXPECT_EQ(weight_amax(1), 0.0f) << "l1's copy is current";
  FP8_ASSERT_OK(fp8_autocast_end(m.get()));
  // From now on only l0 runs: l1, which used its copy at the weights version before, is cast once
  // more (the documented exception), then no longer.
  for (int change = 0; change < 2; ++change) {
    FP8_ASSERT_OK(fp8_model_weights_changed(m.get()));
    FP8_ASSERT_OK(fp8_autocast_begin(m.get()));
    FP8_ASSERT_OK(forward_only(m.get(), 0, x.get(), y.get()));
    EXPECT_EQ(weight_amax(0), amax_of(w[0]));
    if (change == 0)
      EXPECT_EQ(weight_amax(1), amax_of(w[1])) << "l1 used its copy at the version before";
    else
      EXPECT_EQ(weight_amax(1), 0.0f) << "l1 has not used a copy for two versions: not cast";
    FP8_ASSERT_OK(fp8_autocast_end(m.get()));
  }
}

// A new bias alone is a new weights version too: the next FP8 forward adds its bf16 copy (and casts
// W again, with the weight state's current scale).
TEST(LinearWeightCopy, NewBiasIsSeenByTheNextForward) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe().get());
  const auto x = random_x(kTokens, kIn, 3);
  run_step(c, {kTokens, kIn}, x, {}, true, false);
  c.b = randn(static_cast<size_t>(kOut), 99, 2.0f);
  set_param(c.model.get(), "fc.bias", c.b);
  const Scales s = scales_now(c);
  EXPECT_NE(s.w, 1.0f);
  const auto x2 = random_x(kTokens, kIn, 4);
  float w_amax = -1.0f;
  const StepOut got =
      run_step(c, {kTokens, kIn}, x2, {}, true, false, [&] { w_amax = c.state(FP8_SCALING_WEIGHT).amax; });
  expect_step_matches(c, x2, {}, s, {1, 1, 1}, got, false);
  EXPECT_EQ(w_amax, amax_of(c.w));
}

// =================================================================================================
// 4. Gradients accumulate across backward passes until fp8_model_zero_grad
// =================================================================================================

TEST(LinearGradients, AccumulateAcrossBackwardPassesUntilZeroGrad) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe().get());
  const auto x1 = random_x(kTokens, kIn, 5), dy1 = random_dy(kTokens, kOut, 6);
  const auto x2 = random_x(kTokens, kIn, 7, 0.5f), dy2 = random_dy(kTokens, kOut, 8, 0.1f);
  const Scales s1 = scales_now(c);
  run_step(c, {kTokens, kIn}, x1, dy1, true);
  Scales s2 = scales_now(c);
  s2.w = s1.w;  // same weights: the copy of the first pass
  const StepOut got = run_step(c, {kTokens, kIn}, x2, dy2, true);

  const Vec dw1 =
      dw_ref(quantised(dy1, s1.dy, FP8_DTYPE_E5M2), quantised(x1, s1.x, FP8_DTYPE_E4M3), kTokens, kIn, kOut);
  const Vec dw2 =
      dw_ref(quantised(dy2, s2.dy, FP8_DTYPE_E5M2), quantised(x2, s2.x, FP8_DTYPE_E4M3), kTokens, kIn, kOut);
  EXPECT_LT(rel_err(got.dw, plus(dw1, dw2)), 1e-5);
  EXPECT_LT(rel_err(got.db, plus(db_ref(dy1, kTokens, kOut), db_ref(dy2, kTokens, kOut))), 1e-6);
  EXPECT_GT(rel_err(got.dw, dw2), 1e-2) << "the second pass alone would not do";

  FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
  int32_t count = 0;
  FP8_ASSERT_OK(fp8_model_parameter_count(c.model.get(), &count));
  EXPECT_EQ(count, 2);
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t* grad = nullptr;
    FP8_ASSERT_OK(fp8_model_parameter_at(c.model.get(), i, nullptr, nullptr, &grad));
    for (float g : download<float>(grad)) ASSERT_EQ(g, 0.0f) << "parameter " << i;
  }
  EXPECT_EQ(param_value(c.model.get(), "fc.weight"), c.w) << "zero_grad leaves the values";
}

// =================================================================================================
// 5. override_linear_precision moves exactly one GEMM to high precision
// =================================================================================================

class LinearOverride : public ::testing::TestWithParam<fp8_recipe_attr_t> {};

TEST_P(LinearOverride, MovesOnlyThatGemmToHighPrecision) {
  const fp8_recipe_attr_t attr = GetParam();
  const Plan p{attr != FP8_RECIPE_OVERRIDE_FPROP, attr != FP8_RECIPE_OVERRIDE_DGRAD, attr != FP8_RECIPE_OVERRIDE_WGRAD};
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{attr, 1}}).get());
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    c.set_weights(200 + step);
    const Scales s = scales_now(c);
    const auto x = random_x(kTokens, kIn, 210 + step), dy = random_dy(kTokens, kOut, 220 + step);
    FP8_ASSERT_OK(fp8_model_zero_grad(c.model.get()));
    const StepOut got = run_step(c, {kTokens, kIn}, x, dy, true);
    const fp8_layer_report_t r = c.report();
    expect_plan(r, p);
    EXPECT_STREQ(r.reason, "");
    EXPECT_EQ(r.fallback_calls, 0);
    expect_step_matches(c, x, dy, s, p, got);
  }
}

INSTANTIATE_TEST_SUITE_P(EachGemm, LinearOverride,
                         ::testing::Values(FP8_RECIPE_OVERRIDE_FPROP, FP8_RECIPE_OVERRIDE_DGRAD,
                                           FP8_RECIPE_OVERRIDE_WGRAD),
                         [](const ::testing::TestParamInfo<fp8_recipe_attr_t>& i) {
                           return std::string(i.param == FP8_RECIPE_OVERRIDE_FPROP   ? "Fprop"
                                              : i.param == FP8_RECIPE_OVERRIDE_DGRAD ? "Dgrad"
                                                                                     : "Wgrad");
                         });

// =================================================================================================
// 6. High precision: not converted, outside autocast, or in eval mode
// =================================================================================================

TEST(LinearHighPrecision, MatchesFloat64OnUnquantisedValues) {
  const auto x = random_x(kTokens, kIn, 11), dy = random_dy(kTokens, kOut, 12);
  {
    SCOPED_TRACE("not converted");
    LinearCase c(kIn, kOut);
    expect_step_matches(c, x, dy, {}, {0, 0, 0}, run_step(c, {kTokens, kIn}, x, dy, false));
    expect_plan(c.report(), {0, 0, 0});
    EXPECT_EQ(c.report().converted, 0);
  }
  {
    SCOPED_TRACE("converted, outside autocast");
    LinearCase c(kIn, kOut);
    c.convert(fp8_recipe().get());
    expect_step_matches(c, x, dy, {}, {0, 0, 0}, run_step(c, {kTokens, kIn}, x, dy, false));
    expect_plan(c.report(), {0, 0, 0});
    EXPECT_EQ(c.report().fp8_calls, 0);
    EXPECT_EQ(c.state(FP8_SCALING_INPUT).amax, 0.0f) << "nothing was cast";
  }
  {
    SCOPED_TRACE("converted, inside autocast, eval mode");
    LinearCase c(kIn, kOut);
    c.convert(fp8_recipe().get());
    FP8_ASSERT_OK(fp8_model_set_training(c.model.get(), 0));
    expect_step_matches(c, x, {}, {}, {0, -1, -1}, run_step(c, {kTokens, kIn}, x, {}, true, false), false);
    expect_plan(c.report(), {0, -1, -1});
  }
}

// BF16 activations in high precision use a bf16 copy of W and b, remade when the weights change.
TEST(LinearHighPrecision, Bf16ActivationsUseBf16WeightsRemadeWhenTheWeightsChange) {
  LinearCase c(kIn, kOut);
  const auto x = bf16_rounded(random_x(kTokens, kIn, 13));
  std::vector<uint16_t> x_bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_bits[i] = static_cast<uint16_t>(bits_of(x[i]) >> 16);
  Tensor tx = tensor_of(c.ctx.get(), FP8_DTYPE_BF16, {kTokens, kIn}, x_bits);
  Tensor ty = make_tensor(c.ctx.get(), FP8_DTYPE_BF16, {kTokens, kOut});
  for (int version = 0; version < 2; ++version) {
    SCOPED_TRACE("weights version " + std::to_string(version));
    if (version == 1) c.set_weights(77);
    FP8_ASSERT_OK(forward_only(c.model.get(), c.id, tx.get(), ty.get()));
    std::vector<float> y;
    for (uint16_t h : download<uint16_t>(ty.get())) {
      const uint32_t u = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      y.push_back(f);
    }
    const Vec want = y_ref(widen(x), widen(bf16_rounded(c.w)), widen(bf16_rounded(c.b)), kTokens, kIn, kOut);
    EXPECT_LT(rel_err(y, want), 4e-3);  // one bf16 rounding of the output
  }
}

// The backward of a small F32 stack LayerNorm -> Linear -> GELU -> Linear (not converted) against
// central differences of loss = sum(y * g).
TEST(HighPrecisionStack, BackwardMatchesCentralDifferences) {
  constexpr int64_t kRows = 8, kD = 32, kH = 48, kO = 16;
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t ln = -1, fc1 = -1, act = -1, fc2 = -1;
  FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "ln", kD, 1e-5f, &ln));
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc1", kD, kH, 1, &fc1));
  FP8_ASSERT_OK(fp8_model_add_activation(model.get(), "act", FP8_ACTIVATION_GELU, &act));
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc2", kH, kO, 1, &fc2));
  set_param(model.get(), "ln.weight", randn(kD, 1, 0.2f, 1.0f));
  set_param(model.get(), "ln.bias", randn(kD, 2, 0.2f));
  set_param(model.get(), "fc1.weight", randn(kH * kD, 3, 1.0f / std::sqrt(float(kD))));
  set_param(model.get(), "fc1.bias", randn(kH, 4, 0.3f));
  set_param(model.get(), "fc2.weight", randn(kO * kH, 5, 1.0f / std::sqrt(float(kH))));
  set_param(model.get(), "fc2.bias", randn(kO, 6, 0.3f));
  std::vector<float> x = randn(kRows * kD, 7, 1.0f, 0.3f);
  const std::vector<float> g = randn(kRows * kO, 8, 1.0f);

  Tensor tx = f32_tensor(ctx.get(), {kRows, kD}, x), h1 = f32_tensor(ctx.get(), {kRows, kD});
  Tensor h2 = f32_tensor(ctx.get(), {kRows, kH}), h3 = f32_tensor(ctx.get(), {kRows, kH});
  Tensor ty = f32_tensor(ctx.get(), {kRows, kO}), tg = f32_tensor(ctx.get(), {kRows, kO}, g);
  Tensor d3 = f32_tensor(ctx.get(), {kRows, kH}), d2 = f32_tensor(ctx.get(), {kRows, kH});
  Tensor d1 = f32_tensor(ctx.get(), {kRows, kD}), tdx = f32_tensor(ctx.get(), {kRows, kD});
  auto loss = [&]() {  // training-mode forwards; the first one's states are kept for the backward
    EXPECT_OK(fp8_layer_forward(model.get(), ln, tx.get(), h1.get()));
    EXPECT_OK(fp8_layer_forward(model.get(), fc1, h1.get(), h2.get()));
    EXPECT_OK(fp8_layer_forward(model.get(), act, h2.get(), h3.get()));
    EXPECT_OK(fp8_layer_forward(model.get(), fc2, h3.get(), ty.get()));
    const auto y = download<float>(ty.get());
    double l = 0.0;
    for (size_t i = 0; i < y.size(); ++i) l += static_cast<double>(y[i]) * g[i];
    return l;
  };
  loss();
  FP8_ASSERT_OK(fp8_layer_backward(model.get(), fc2, tg.get(), d3.get()));
  FP8_ASSERT_OK(fp8_layer_backward(model.get(), act, d3.get(), d2.get()));
  FP8_ASSERT_OK(fp8_layer_backward(model.get(), fc1, d2.get(), d1.get()));
  FP8_ASSERT_OK(fp8_layer_backward(model.get(), ln, d1.get(), tdx.get()));
  // The differences need forwards alone: eval mode keeps nothing for a backward (and the stack is not
  // converted, so eval computes what training does).
  FP8_ASSERT_OK(fp8_model_set_training(model.get(), 0));

  // d loss / d v[i] by central differences, v being x or a parameter, perturbed and restored.
  auto central = [&](std::vector<float>& v, size_t i, const std::function<void()>& push) {
    const float keep = v[i], eps = 1e-2f * std::max(1.0f, std::fabs(keep));
    v[i] = keep + eps;
    push();
    const double up = loss();
    v[i] = keep - eps;
    push();
    const double down = loss();
    v[i] = keep;
    push();
    return (up - down) / (2.0 * static_cast<double>(eps));
  };
  auto expect_close = [](const std::vector<float>& analytic, size_t i, double fd, const char* what) {
    const double scale = std::max(std::fabs(analytic[i]), 0.1f * amax_of(analytic));
    EXPECT_NEAR(analytic[i], fd, 2e-2 * scale) << what << "[" << i << "]";
  };

  const auto dx = download<float>(tdx.get());
  EXPECT_GT(amax_of(dx), 0.0f);
  for (size_t i : {0u, 5u, 37u, 100u, 131u, 200u, 255u})
    expect_close(dx, i, central(x, i, [&] { upload(tx.get(), x); }), "dx");

  const std::pair<const char*, std::vector<size_t>> params[] = {{"fc1.weight", {0, 333, 1500}}, {"fc1.bias", {3, 40}},
                                                                {"fc2.weight", {7, 500}},       {"fc2.bias", {11}},
                                                                {"ln.weight", {1, 30}},         {"ln.bias", {9}}};
  for (const auto& [name, entries] : params) {
    std::vector<float> v = param_value(model.get(), name);
    const auto grad = param_grad(model.get(), name);
    for (size_t i : entries) expect_close(grad, i, central(v, i, [&] { set_param(model.get(), name, v); }), name);
  }
}

// =================================================================================================
// 7. Automatic fallbacks: counted with a reason, and computing exactly what high precision computes
// =================================================================================================

// One step under autocast; the report's plan and reason, and results equal to the unconverted twin's.
void expect_whole_layer_fallback(LinearCase& c, int64_t rows, const char* reason_word) {
  const auto x = random_x(rows, c.in, 300), dy = random_dy(rows, c.out, 301);
  const StepOut got = run_step(c, {rows, c.in}, x, dy, true);
  const StepOut hp = high_precision_twin(c, {rows, c.in}, x, dy);
  EXPECT_EQ(got.y, hp.y);
  EXPECT_EQ(got.dx, hp.dx);
  EXPECT_EQ(got.dw, hp.dw);
  EXPECT_EQ(got.db, hp.db);
  expect_step_matches(c, x, dy, {}, {0, 0, 0}, got);
  const fp8_layer_report_t r = c.report();
  EXPECT_EQ(r.converted, 1);
  expect_plan(r, {0, 0, 0});
  EXPECT_NE(std::string(r.reason).find(reason_word), std::string::npos) << r.reason;
  EXPECT_EQ(r.fp8_calls, 0);
  EXPECT_GE(r.fallback_calls, 1);
}

TEST(LinearFallback, SmallLayerRunsInHighPrecisionWhenTheRuleIsOn) {
  LinearCase c(kIn, kOut);
  Recipe r = make_recipe("backend=te");  // the default small_layer_fallback = 1
  int64_t on = 0;
  FP8_ASSERT_OK(fp8_recipe_get_int(r.get(), FP8_RECIPE_SMALL_LAYER_FALLBACK, &on));
  EXPECT_EQ(on, 1);
  c.convert(r.get());
  expect_whole_layer_fallback(c, kTokens, "small");
  EXPECT_EQ(c.report().fallback_calls, 1);
  run_step(c, {kTokens, kIn}, random_x(kTokens, kIn, 1), random_dy(kTokens, kOut, 2), true);
  EXPECT_EQ(c.report().fallback_calls, 2);
  EXPECT_EQ(c.state(FP8_SCALING_INPUT).update_count, 0)
      << "a layer that ran in high precision recorded no amax, so its states are left alone";
}

// A shape no FP8 GEMM takes is refused at conversion: the layer stays high precision, says why, and
// runs exactly as before (its siblings convert).
TEST(LinearFallback, FeaturesNotAMultipleOf16AreLeftUnconverted) {
  for (const auto& [in, out, word] :
       {std::tuple<int64_t, int64_t, const char*>{40, kOut, "in_features = 40"}, {kIn, 40, "out_features = 40"}}) {
    LinearCase c(in, out);
    c.convert(fp8_recipe().get());
    int32_t has = 1;
    FP8_ASSERT_OK(fp8_model_has_fp8_layers(c.model.get(), &has));
    EXPECT_EQ(has, 0);
    const auto x = random_x(kTokens, in, 300), dy = random_dy(kTokens, out, 301);
    const StepOut got = run_step(c, {kTokens, in}, x, dy, true);
    const StepOut hp = high_precision_twin(c, {kTokens, in}, x, dy);
    EXPECT_EQ(got.y, hp.y);
    EXPECT_EQ(got.dx, hp.dx);
    EXPECT_EQ(got.dw, hp.dw);
    const fp8_layer_report_t r = c.report();
    EXPECT_EQ(r.converted, 0);
    expect_plan(r, {0, 0, 0});
    EXPECT_NE(std::string(r.reason).find(std::string("not converted: ") + word), std::string::npos) << r.reason;
    EXPECT_EQ(r.fp8_calls, 0);
    EXPECT_EQ(r.fallback_calls, 0);
    fp8_scaling_t* s = nullptr;
    FP8_ASSERT_OK(fp8_layer_get_scaling(c.model.get(), 0, FP8_SCALING_INPUT, &s));
    EXPECT_EQ(s, nullptr);
  }
}

TEST(LinearFallback, MisalignedYRunsInHighPrecision) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe().get());
  const auto x = random_x(kTokens, kIn, 310), dy = random_dy(kTokens, kOut, 311);
  std::vector<float> y_store(static_cast<size_t>(kTokens * kOut) + 4);
  float* y_data = y_store.data() + (reinterpret_cast<uintptr_t>(y_store.data()) % 16 == 0 ? 1 : 0);
  ASSERT_NE(reinterpret_cast<uintptr_t>(y_data) % 16, 0u);
  const int64_t y_shape[2] = {kTokens, kOut};
  fp8_tensor_t* raw = nullptr;
  FP8_ASSERT_OK(fp8_tensor_wrap(&raw, c.ctx.get(), FP8_DTYPE_F32, 2, y_shape, y_data));
  Tensor ty(raw);
  Tensor tx = f32_tensor(c.ctx.get(), {kTokens, kIn}, x);
  FP8_ASSERT_OK(fp8_autocast_begin(c.model.get()));
  FP8_ASSERT_OK(fp8_layer_forward(c.model.get(), c.id, tx.get(), ty.get()));
  FP8_ASSERT_OK(fp8_autocast_end(c.model.get()));
  EXPECT_EQ(download<float>(ty.get()), high_precision_twin(c, {kTokens, kIn}, x, dy).y);
  expect_plan(c.report(), {0, 0, 0});
  EXPECT_NE(std::string(c.report().reason).find("aligned"), std::string::npos) << c.report().reason;
}

// 40 tokens: the forward and dgrad GEMMs stay FP8; only wgrad (k = tokens) falls back.
TEST(LinearFallback, TokensNotAMultipleOf16MoveOnlyWgradToHighPrecision) {
  constexpr int64_t kRows = 40;
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe().get());
  const Scales s = scales_now(c);
  const auto x = random_x(kRows, kIn, 320), dy = random_dy(kRows, kOut, 321);
  const StepOut got = run_step(c, {kRows, kIn}, x, dy, true);
  expect_step_matches(c, x, dy, s, {1, 1, 0}, got);
  EXPECT_EQ(got.dw, high_precision_twin(c, {kRows, kIn}, x, dy).dw);
  const fp8_layer_report_t r = c.report();
  expect_plan(r, {1, 1, 0});
  EXPECT_NE(std::string(r.reason).find("tokens"), std::string::npos) << r.reason;
  EXPECT_NE(std::string(r.reason).find("40"), std::string::npos) << r.reason;
  EXPECT_EQ(r.fp8_calls, 1);
  EXPECT_EQ(r.fallback_calls, 1);
}

// =================================================================================================
// 8. Eval mode: no FP8 unless the recipe says use_autocast_during_eval, and no backward
// =================================================================================================

TEST(LinearEval, NoFp8InEvalModeByDefaultAndNoBackward) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe().get());
  FP8_ASSERT_OK(fp8_model_set_training(c.model.get(), 0));
  const auto x = random_x(kTokens, kIn, 400);
  const StepOut got = run_step(c, {kTokens, kIn}, x, {}, true, false);
  EXPECT_EQ(got.y, high_precision_twin(c, {kTokens, kIn}, x, random_dy(kTokens, kOut, 1)).y);
  const fp8_layer_report_t r = c.report();
  expect_plan(r, {0, -1, -1});
  EXPECT_EQ(r.fp8_calls, 0);
  EXPECT_EQ(r.fallback_calls, 0);
  EXPECT_EQ(c.state(FP8_SCALING_INPUT).update_count, 0) << "FP8 was off: no scaling update";

  Tensor tdy = f32_tensor(c.ctx.get(), {kTokens, kOut}, random_dy(kTokens, kOut, 401));
  Tensor tdx = f32_tensor(c.ctx.get(), {kTokens, kIn});
  EXPECT_EQ(fp8_layer_backward(c.model.get(), c.id, tdy.get(), tdx.get()), FP8_ERR_INVALID_STATE);
  EXPECT_NE(std::string(fp8_last_error_message()).find("'fc'"), std::string::npos) << fp8_last_error_message();
  EXPECT_NE(std::string(fp8_last_error_message()).find("eval"), std::string::npos) << fp8_last_error_message();
}

TEST(LinearEval, UseAutocastDuringEvalRunsTheForwardInFp8) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 1}}).get());
  FP8_ASSERT_OK(fp8_model_set_training(c.model.get(), 0));
  const Scales s = scales_now(c);
  const auto x = random_x(kTokens, kIn, 410);
  expect_step_matches(c, x, {}, s, {1, -1, -1}, run_step(c, {kTokens, kIn}, x, {}, true, false), false);
  const fp8_layer_report_t r = c.report();
  expect_plan(r, {1, -1, -1});
  EXPECT_EQ(r.fp8_calls, 1);
  EXPECT_EQ(c.state(FP8_SCALING_INPUT).scale, 448.0f / amax_of(x));

  Tensor tdy = f32_tensor(c.ctx.get(), {kTokens, kOut}, random_dy(kTokens, kOut, 411));
  EXPECT_EQ(fp8_layer_backward(c.model.get(), c.id, tdy.get(), nullptr), FP8_ERR_INVALID_STATE);

  FP8_ASSERT_OK(fp8_model_set_training(c.model.get(), 1));  // back to training: backward allowed again
  const Scales s2 = scales_now(c);
  const auto dy = random_dy(kTokens, kOut, 412);
  const StepOut got = run_step(c, {kTokens, kIn}, x, dy, true);
  expect_step_matches(c, x, dy, {s2.x, 1.0f, s2.dy, s2.dy_dtype}, {1, 1, 1}, got);
}

// fp8_calls counts forwards that ran at least one GEMM in FP8. In eval mode with the forward GEMM
// overridden to high precision nothing runs in FP8 (dgrad and wgrad never run), so it stays 0.
TEST(LinearEval, Fp8CallsDoNotCountAnEvalForwardWhoseOnlyGemmIsOverridden) {
  LinearCase c(kIn, kOut);
  c.convert(fp8_recipe({{FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 1}, {FP8_RECIPE_OVERRIDE_FPROP, 1}}).get());
  FP8_ASSERT_OK(fp8_model_set_training(c.model.get(), 0));
  const auto x = random_x(kTokens, kIn, 420);
  expect_step_matches(c, x, {}, {}, {0, -1, -1}, run_step(c, {kTokens, kIn}, x, {}, true, false), false);
  const fp8_layer_report_t r = c.report();
  expect_plan(r, {0, -1, -1});
  EXPECT_EQ(c.state(FP8_SCALING_INPUT).update_count, 0) << "no cast of x ran, so no amax to update with";
  EXPECT_EQ(r.fp8_calls, 0) << "no GEMM ran in FP8, yet the forward was counted as an FP8 call";
}

// =================================================================================================
// 9. FP8 hand-off: a converted norm or activation writes E4M3 y, the converted Linear takes it as x
// =================================================================================================

class Fp8HandOff : public ::testing::TestWithParam<fp8_layer_kind_t> {};

TEST_P(Fp8HandOff, LinearComputesOnTheDequantisedHandOff) {
  const fp8_layer_kind_t kind = GetParam();
  const float eps = 1e-5f;
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t pre = -1, fc = -1;
  std::vector<float> gamma, beta;
  if (kind == FP8_LAYER_ACTIVATION) {
    FP8_ASSERT_OK(fp8_model_add_activation(model.get(), "pre", FP8_ACTIVATION_GELU, &pre));
  } else {
    gamma = randn(kIn, 1, 0.3f, 1.0f);
    if (kind == FP8_LAYER_LAYERNORM) {
      FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "pre", kIn, eps, &pre));
      beta = randn(kIn, 2, 0.2f);
      set_param(model.get(), "pre.bias", beta);
    } else {
      FP8_ASSERT_OK(fp8_model_add_rmsnorm(model.get(), "pre", kIn, eps, &pre));
    }
    set_param(model.get(), "pre.weight", gamma);
  }
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", kIn, kOut, 1, &fc));
  const std::vector<float> b = randn(kOut, 3, 0.5f);
  set_param(model.get(), "fc.bias", b);
  Recipe recipe = fp8_recipe();
  FP8_ASSERT_OK(fp8_convert_model(model.get(), recipe.get(), nullptr));

  Tensor h = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {kTokens, kIn});
  Tensor ty = f32_tensor(ctx.get(), {kTokens, kOut}), tdh = f32_tensor(ctx.get(), {kTokens, kIn});
  Tensor tdx = f32_tensor(ctx.get(), {kTokens, kIn});
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::vector<float> w = randn(kIn * kOut, 10 + step, 0.125f);
    set_param(model.get(), "fc.weight", w);
    const float h_scale = state_info(model.get(), pre, FP8_SCALING_OUTPUT).scale;
    const float w_scale = state_info(model.get(), fc, FP8_SCALING_WEIGHT).scale;
    const float dy_scale = state_info(model.get(), fc, FP8_SCALING_GRAD_OUTPUT).scale;
    if (step == 1) {
      EXPECT_NE(h_scale, 1.0f);
    }
    const std::vector<float> x = randn(kTokens * kIn, 20 + step, 1.0f, 0.2f), dy = random_dy(kTokens, kOut, 30 + step);
    Tensor tx = f32_tensor(ctx.get(), {kTokens, kIn}, x), tdy = f32_tensor(ctx.get(), {kTokens, kOut}, dy);
    FP8_ASSERT_OK(fp8_model_zero_grad(model.get()));

    FP8_ASSERT_OK(fp8_autocast_begin(model.get()));
    FP8_ASSERT_OK(fp8_layer_forward(model.get(), pre, tx.get(), h.get()));
    FP8_ASSERT_OK(fp8_layer_forward(model.get(), fc, h.get(), ty.get()));
    FP8_ASSERT_OK(fp8_layer_backward(model.get(), fc, tdy.get(), tdh.get()));
    FP8_ASSERT_OK(fp8_layer_backward(model.get(), pre, tdh.get(), tdx.get()));
    EXPECT_EQ(state_info(model.get(), fc, FP8_SCALING_INPUT).amax, 0.0f) << "the hand-off is not cast again";
    FP8_ASSERT_OK(fp8_autocast_end(model.get()));

    // The hand-off: codes of the producer's output at its state's scale, with scale_inv = 1/scale.
    float h_scale_inv = 0.0f;
    FP8_ASSERT_OK(fp8_tensor_get_scale_inv(h.get(), &h_scale_inv));
    EXPECT_EQ(h_scale_inv, 1.0f / h_scale);
    const auto codes = download<uint8_t>(h.get());
    Vec hq(codes.size());
    for (size_t i = 0; i < codes.size(); ++i)
      hq[i] = static_cast<double>(fp8_decode(codes[i], FP8_DTYPE_E4M3)) * static_cast<double>(h_scale_inv);
    const Vec want_h = producer_ref(kind, x, kIn, gamma, beta, eps);
    const double limit = 448.0 * h_scale_inv;
    for (size_t i = 0; i < hq.size(); ++i) {
      const double ref = std::clamp(want_h[i], -limit, limit);
      ASSERT_NEAR(hq[i], ref, std::fabs(ref) / 16 + h_scale_inv / 512 + 1e-6) << "h[" << i << "]";
    }

    const Vec wq = quantised(w, w_scale, FP8_DTYPE_E4M3), dyq = quantised(dy, dy_scale, FP8_DTYPE_E5M2);
    EXPECT_LT(rel_err(download<float>(ty.get()), y_ref(hq, wq, widen(bf16_rounded(b)), kTokens, kIn, kOut)), 1e-5);
    EXPECT_LT(rel_err(download<float>(tdh.get()), dx_ref(dyq, wq, kTokens, kIn, kOut)), 1e-5);
    EXPECT_LT(rel_err(param_grad(model.get(), "fc.weight"), dw_ref(dyq, hq, kTokens, kIn, kOut)), 1e-5);
    for (float v : download<float>(tdx.get())) ASSERT_TRUE(std::isfinite(v));

    const fp8_layer_report_t rp = report_of(model.get(), pre), rf = report_of(model.get(), fc);
    EXPECT_EQ(rp.fprop, 1);
    EXPECT_EQ(rp.fp8_calls, step + 1);
    expect_plan(rf, {1, 1, 1});
    // The producer's state took 448 / amax(y) (its y computed in float; allow a few ulps).
    const fp8_scaling_info_t ih = state_info(model.get(), pre, FP8_SCALING_OUTPUT);
    float want_amax = 0.0f;
    for (double v : want_h) want_amax = std::max(want_amax, static_cast<float>(std::fabs(v)));
    EXPECT_NEAR(ih.scale, 448.0f / want_amax, 1e-5 * ih.scale);
    EXPECT_EQ(ih.update_count, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Producers, Fp8HandOff,
                         ::testing::Values(FP8_LAYER_LAYERNORM, FP8_LAYER_RMSNORM, FP8_LAYER_ACTIVATION),
                         [](const ::testing::TestParamInfo<fp8_layer_kind_t>& i) {
                           return std::string(i.param == FP8_LAYER_LAYERNORM ? "LayerNorm"
                                              : i.param == FP8_LAYER_RMSNORM ? "RMSNorm"
                                                                             : "Gelu");
                         });

// =================================================================================================
// 10. Conversion, both ways, and per layer kind
// =================================================================================================

// ln, fc and a ReLU, with the Linear's weights and the norm's gamma set.
struct SmallModel {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t ln = -1, fc = -1, act = -1;
  SmallModel() {
    EXPECT_OK(fp8_model_add_layernorm(model.get(), "ln", kIn, 1e-5f, &ln));
    EXPECT_OK(fp8_model_add_linear(model.get(), "fc", kIn, kOut, 1, &fc));
    EXPECT_OK(fp8_model_add_activation(model.get(), "act", FP8_ACTIVATION_RELU, &act));
    set_param(model.get(), "fc.weight", randn(kIn * kOut, 1, 0.125f));
    set_param(model.get(), "fc.bias", randn(kOut, 2, 0.5f));
    set_param(model.get(), "ln.weight", randn(kIn, 3, 0.1f, 1.0f));
  }
  int32_t has_fp8() const {
    int32_t has = -1;
    EXPECT_OK(fp8_model_has_fp8_layers(model.get(), &has));
    return has;
  }
};

TEST(Conversion, ToFp8AndBackKeepsParametersAndGradients) {
  SmallModel sm;
  fp8_convert_options_t opts;
  fp8_convert_options_init(&opts);
  EXPECT_EQ(opts.struct_size, sizeof(fp8_convert_options_t));
  EXPECT_EQ(opts.to_fp8, 1);
  EXPECT_EQ(opts.linear, 1);
  EXPECT_EQ(opts.norm, 1);
  EXPECT_EQ(opts.activation, 1);

  EXPECT_EQ(sm.has_fp8(), 0);
  EXPECT_EQ(scaling_of(sm.model.get(), sm.fc, FP8_SCALING_INPUT), nullptr);
  Recipe r = fp8_recipe();
  FP8_ASSERT_OK(fp8_convert_model(sm.model.get(), r.get(), &opts));
  EXPECT_EQ(sm.has_fp8(), 1);
  for (int32_t id : {sm.ln, sm.fc, sm.act}) EXPECT_EQ(report_of(sm.model.get(), id).converted, 1) << id;
  for (int32_t slot : {FP8_SCALING_INPUT, FP8_SCALING_WEIGHT, FP8_SCALING_GRAD_OUTPUT})
    EXPECT_NE(scaling_of(sm.model.get(), sm.fc, slot), nullptr) << slot;
  EXPECT_EQ(scaling_of(sm.model.get(), sm.fc, FP8_SCALING_OUTPUT), nullptr);
  EXPECT_NE(scaling_of(sm.model.get(), sm.ln, FP8_SCALING_OUTPUT), nullptr);
  EXPECT_EQ(scaling_of(sm.model.get(), sm.ln, FP8_SCALING_INPUT), nullptr);

  // A training step gives the Linear gradients to keep.
  Tensor x = f32_tensor(sm.ctx.get(), {kTokens, kIn}, random_x(kTokens, kIn, 1));
  Tensor y = f32_tensor(sm.ctx.get(), {kTokens, kOut}),
         dy = f32_tensor(sm.ctx.get(), {kTokens, kOut}, random_dy(kTokens, kOut, 2));
  FP8_ASSERT_OK(fp8_autocast_begin(sm.model.get()));
  FP8_ASSERT_OK(fp8_layer_forward(sm.model.get(), sm.fc, x.get(), y.get()));
  FP8_ASSERT_OK(fp8_layer_backward(sm.model.get(), sm.fc, dy.get(), nullptr));
  FP8_ASSERT_OK(fp8_autocast_end(sm.model.get()));

  std::vector<std::vector<float>> values, grads;
  int32_t count = 0;
  FP8_ASSERT_OK(fp8_model_parameter_count(sm.model.get(), &count));
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t *v = nullptr, *g = nullptr;
    FP8_ASSERT_OK(fp8_model_parameter_at(sm.model.get(), i, nullptr, &v, &g));
    values.push_back(download<float>(v));
    grads.push_back(download<float>(g));
  }
  EXPECT_GT(amax_of(param_grad(sm.model.get(), "fc.weight")), 0.0f);

  opts.to_fp8 = 0;
  FP8_ASSERT_OK(fp8_convert_model(sm.model.get(), nullptr, &opts));
  EXPECT_EQ(sm.has_fp8(), 0);
  for (int32_t id : {sm.ln, sm.fc, sm.act}) EXPECT_EQ(report_of(sm.model.get(), id).converted, 0) << id;
  EXPECT_EQ(scaling_of(sm.model.get(), sm.fc, FP8_SCALING_INPUT), nullptr);
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t *v = nullptr, *g = nullptr;
    FP8_ASSERT_OK(fp8_model_parameter_at(sm.model.get(), i, nullptr, &v, &g));
    EXPECT_EQ(download<float>(v), values[static_cast<size_t>(i)]) << "parameter " << i;
    EXPECT_EQ(download<float>(g), grads[static_cast<size_t>(i)]) << "gradient " << i;
  }
  EXPECT_EQ(fp8_autocast_begin(sm.model.get()), FP8_ERR_INVALID_STATE) << "no FP8 layers any more";
  // Back in high precision, and adding layers is allowed again.
  FP8_ASSERT_OK(fp8_layer_forward(sm.model.get(), sm.fc, x.get(), y.get()));
  EXPECT_EQ(report_of(sm.model.get(), sm.fc).fprop, 0);
  FP8_ASSERT_OK(fp8_model_add_linear(sm.model.get(), "later", 16, 16, 0, nullptr));
}

// linear = 0: only the norm and activation become FP8 layers. The unconverted Linear still takes the
// norm's FP8 hand-off, in high precision on its dequantised values.
TEST(Conversion, LinearZeroConvertsOnlyNormsAndActivations) {
  SmallModel sm;
  fp8_convert_options_t opts;
  fp8_convert_options_init(&opts);
  opts.linear = 0;
  Recipe r = fp8_recipe();
  FP8_ASSERT_OK(fp8_convert_model(sm.model.get(), r.get(), &opts));
  EXPECT_EQ(sm.has_fp8(), 1);
  EXPECT_EQ(report_of(sm.model.get(), sm.fc).converted, 0);
  EXPECT_EQ(report_of(sm.model.get(), sm.ln).converted, 1);
  EXPECT_EQ(report_of(sm.model.get(), sm.act).converted, 1);
  EXPECT_EQ(scaling_of(sm.model.get(), sm.fc, FP8_SCALING_WEIGHT), nullptr);

  const auto x = random_x(kTokens, kIn, 5), dy = random_dy(kTokens, kOut, 6);
  Tensor tx = f32_tensor(sm.ctx.get(), {kTokens, kIn}, x),
         h = make_tensor(sm.ctx.get(), FP8_DTYPE_E4M3, {kTokens, kIn});
  Tensor ty = f32_tensor(sm.ctx.get(), {kTokens, kOut}), tdy = f32_tensor(sm.ctx.get(), {kTokens, kOut}, dy);
  FP8_ASSERT_OK(fp8_autocast_begin(sm.model.get()));
  FP8_ASSERT_OK(fp8_layer_forward(sm.model.get(), sm.ln, tx.get(), h.get()));
  FP8_ASSERT_OK(fp8_layer_forward(sm.model.get(), sm.fc, h.get(), ty.get()));
  FP8_ASSERT_OK(fp8_layer_backward(sm.model.get(), sm.fc, tdy.get(), nullptr));
  FP8_ASSERT_OK(fp8_autocast_end(sm.model.get()));
  expect_plan(report_of(sm.model.get(), sm.fc), {0, 0, 0});

  float si = 0.0f;
  FP8_ASSERT_OK(fp8_tensor_get_scale_inv(h.get(), &si));
  Vec hq;
  for (uint8_t code : download<uint8_t>(h.get()))
    hq.push_back(static_cast<double>(fp8_decode(code, FP8_DTYPE_E4M3)) * si);
  const Vec w = widen(param_value(sm.model.get(), "fc.weight")), b = widen(param_value(sm.model.get(), "fc.bias"));
  EXPECT_LT(rel_err(download<float>(ty.get()), y_ref(hq, w, b, kTokens, kIn, kOut)), 1e-5);
  EXPECT_LT(rel_err(param_grad(sm.model.get(), "fc.weight"), dw_ref(widen(dy), hq, kTokens, kIn, kOut)), 1e-5);

  opts.linear = 1;
  opts.norm = 0;
  opts.activation = 0;
  FP8_ASSERT_OK(fp8_convert_model(sm.model.get(), r.get(), &opts));
  EXPECT_EQ(report_of(sm.model.get(), sm.fc).converted, 1);
  EXPECT_EQ(report_of(sm.model.get(), sm.ln).converted, 0);
  EXPECT_EQ(report_of(sm.model.get(), sm.act).converted, 0);
}

// =================================================================================================
// 11. Misuse: exact status, a message naming the function and the culprit, nothing changed
// =================================================================================================

constexpr float kSentinel = -12345.0f;

class ModelMisuse : public ::testing::Test {
 protected:
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t fc = -1, ln = -1;
  Tensor x = f32_tensor(ctx.get(), {kTokens, kIn}, random_x(kTokens, kIn, 1));
  Tensor y = f32_tensor(ctx.get(), {kTokens, kOut});
  Tensor dy = f32_tensor(ctx.get(), {kTokens, kOut}, random_dy(kTokens, kOut, 2));
  Tensor dx = f32_tensor(ctx.get(), {kTokens, kIn});

  void SetUp() override {
    FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", kIn, kOut, 1, &fc));
    FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "ln", kIn, 1e-5f, &ln));
    set_param(model.get(), "fc.weight", randn(kIn * kOut, 3, 0.125f));
  }
  static void fill(fp8_tensor_t* t, float v) {
    int64_t n = 0;
    fp8_tensor_numel(t, &n);
    upload(t, std::vector<float>(static_cast<size_t>(n), v));
  }
  static void expect_untouched(const fp8_tensor_t* t, const char* what) {
    for (float v : download<float>(t)) ASSERT_EQ(v, kSentinel) << what << " was written by a refused call";
  }
  void convert() {
    Recipe r = fp8_recipe();
    FP8_ASSERT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
  }
};

TEST_F(ModelMisuse, NullHandlesAndArguments) {
  fp8_model_t* m = model.get();
  const int32_t kInv = FP8_ERR_INVALID_ARGUMENT;
  fp8_model_t* out = nullptr;
  EXPECT_REFUSED(fp8_model_create(nullptr, ctx.get()), kInv, "fp8_model_create", "'out'");
  EXPECT_REFUSED(fp8_model_create(&out, nullptr), kInv, "fp8_model_create", "'ctx'");
  EXPECT_EQ(out, nullptr);
  EXPECT_REFUSED(fp8_model_add_linear(nullptr, "a", 16, 16, 1, nullptr), kInv, "fp8_model_add_linear", "'model'");
  EXPECT_REFUSED(fp8_model_add_linear(m, nullptr, 16, 16, 1, nullptr), kInv, "fp8_model_add_linear", "'name'");
  EXPECT_REFUSED(fp8_model_add_layernorm(nullptr, "a", 16, 1e-5f, nullptr), kInv, "fp8_model_add_layernorm", "'model'");
  EXPECT_REFUSED(fp8_model_add_layernorm(m, nullptr, 16, 1e-5f, nullptr), kInv, "fp8_model_add_layernorm", "'name'");
  EXPECT_REFUSED(fp8_model_add_rmsnorm(nullptr, "a", 16, 1e-5f, nullptr), kInv, "fp8_model_add_rmsnorm", "'model'");
  EXPECT_REFUSED(fp8_model_add_rmsnorm(m, nullptr, 16, 1e-5f, nullptr), kInv, "fp8_model_add_rmsnorm", "'name'");
  EXPECT_REFUSED(fp8_model_add_activation(nullptr, "a", FP8_ACTIVATION_GELU, nullptr), kInv, "fp8_model_add_activation",
                 "'model'");
  EXPECT_REFUSED(fp8_model_add_activation(m, nullptr, FP8_ACTIVATION_GELU, nullptr), kInv, "fp8_model_add_activation",
                 "'name'");

  int32_t count = -7, id = -7, has = -7;
  const char* name = nullptr;
  fp8_tensor_t* t = nullptr;
  EXPECT_REFUSED(fp8_model_layer_count(nullptr, &count), kInv, "fp8_model_layer_count", "'model'");
  EXPECT_REFUSED(fp8_model_layer_count(m, nullptr), kInv, "fp8_model_layer_count", "'count'");
  EXPECT_REFUSED(fp8_model_find_layer(nullptr, "fc", &id), kInv, "fp8_model_find_layer", "'model'");
  EXPECT_REFUSED(fp8_model_find_layer(m, nullptr, &id), kInv, "fp8_model_find_layer", "'name'");
  EXPECT_REFUSED(fp8_model_find_layer(m, "fc", nullptr), kInv, "fp8_model_find_layer", "'layer_id'");
  EXPECT_REFUSED(fp8_model_layer_name(nullptr, 0, &name), kInv, "fp8_model_layer_name", "'model'");
  EXPECT_REFUSED(fp8_model_layer_name(m, 0, nullptr), kInv, "fp8_model_layer_name", "'name'");
  EXPECT_REFUSED(fp8_model_parameter(nullptr, "fc.weight", &t, nullptr), kInv, "fp8_model_parameter", "'model'");
  EXPECT_REFUSED(fp8_model_parameter(m, nullptr, &t, nullptr), kInv, "fp8_model_parameter", "'name'");
  EXPECT_REFUSED(fp8_model_parameter_count(nullptr, &count), kInv, "fp8_model_parameter_count", "'model'");
  EXPECT_REFUSED(fp8_model_parameter_count(m, nullptr), kInv, "fp8_model_parameter_count", "'count'");
  EXPECT_REFUSED(fp8_model_parameter_at(nullptr, 0, &name, &t, nullptr), kInv, "fp8_model_parameter_at", "'model'");
  EXPECT_REFUSED(fp8_model_weights_changed(nullptr), kInv, "fp8_model_weights_changed", "'model'");
  EXPECT_REFUSED(fp8_model_zero_grad(nullptr), kInv, "fp8_model_zero_grad", "'model'");
  EXPECT_REFUSED(fp8_model_set_training(nullptr, 1), kInv, "fp8_model_set_training", "'model'");
  Recipe r = fp8_recipe();
  EXPECT_REFUSED(fp8_convert_model(nullptr, r.get(), nullptr), kInv, "fp8_convert_model", "'model'");
  EXPECT_REFUSED(fp8_convert_model(m, nullptr, nullptr), kInv, "fp8_convert_model", "'recipe'");
  EXPECT_REFUSED(fp8_model_has_fp8_layers(nullptr, &has), kInv, "fp8_model_has_fp8_layers", "'model'");
  EXPECT_REFUSED(fp8_model_has_fp8_layers(m, nullptr), kInv, "fp8_model_has_fp8_layers", "'has'");
  EXPECT_REFUSED(fp8_autocast_begin(nullptr), kInv, "fp8_autocast_begin", "'model'");
  EXPECT_REFUSED(fp8_autocast_end(nullptr), kInv, "fp8_autocast_end", "'model'");
  EXPECT_REFUSED(fp8_layer_forward(nullptr, fc, x.get(), y.get()), kInv, "fp8_layer_forward", "'model'");
  EXPECT_REFUSED(fp8_layer_forward(m, fc, nullptr, y.get()), kInv, "fp8_layer_forward", "'x'");
  EXPECT_REFUSED(fp8_layer_forward(m, fc, x.get(), nullptr), kInv, "fp8_layer_forward", "'y'");
  EXPECT_REFUSED(fp8_layer_backward(nullptr, fc, dy.get(), dx.get()), kInv, "fp8_layer_backward", "'model'");
  EXPECT_REFUSED(fp8_layer_backward(m, fc, nullptr, dx.get()), kInv, "fp8_layer_backward", "'dy'");
  fp8_scaling_t* s = nullptr;
  EXPECT_REFUSED(fp8_layer_get_scaling(nullptr, fc, 0, &s), kInv, "fp8_layer_get_scaling", "'model'");
  EXPECT_REFUSED(fp8_layer_get_scaling(m, fc, 0, nullptr), kInv, "fp8_layer_get_scaling", "'scaling'");
  fp8_layer_report_t rep;
  fp8_layer_report_init(&rep);
  EXPECT_REFUSED(fp8_layer_get_report(nullptr, fc, &rep), kInv, "fp8_layer_get_report", "'model'");
  EXPECT_REFUSED(fp8_layer_get_report(m, fc, nullptr), kInv, "fp8_layer_get_report", "'report'");
  char buf[8192];
  EXPECT_REFUSED(fp8_model_report(nullptr, buf, sizeof buf, nullptr), kInv, "fp8_model_report", "'model'");
  EXPECT_REFUSED(fp8_model_report(m, nullptr, sizeof buf, nullptr), kInv, "fp8_model_report", "'buf'");
  // Out-parameters kept their values; destroy and init take NULL.
  EXPECT_EQ(count, -7);
  EXPECT_EQ(id, -7);
  EXPECT_EQ(has, -7);
  EXPECT_EQ(name, nullptr);
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(s, nullptr);
  fp8_model_destroy(nullptr);
  fp8_convert_options_init(nullptr);
  fp8_layer_report_init(nullptr);
}

TEST_F(ModelMisuse, LayerDefinitions) {
  fp8_model_t* m = model.get();
  const int32_t kInv = FP8_ERR_INVALID_ARGUMENT;
  int32_t id = -7;
  EXPECT_REFUSED(fp8_model_add_linear(m, "fc", 16, 16, 1, &id), kInv, "fp8_model_add_linear", "'fc'");
  EXPECT_REFUSED(fp8_model_add_layernorm(m, "ln", 16, 1e-5f, &id), kInv, "fp8_model_add_layernorm", "'ln'");
  for (const char* dotted : {".fc", "fc.", "blocks..fc"})
    EXPECT_REFUSED(fp8_model_add_linear(m, dotted, 16, 16, 1, &id), kInv, "fp8_model_add_linear", "empty part");
  EXPECT_REFUSED(fp8_model_add_linear(m, "", 16, 16, 1, &id), kInv, "fp8_model_add_linear", "name");
  EXPECT_REFUSED(fp8_model_add_linear(m, std::string(128, 'a').c_str(), 16, 16, 1, &id), kInv, "fp8_model_add_linear",
                 "1..127");
  EXPECT_REFUSED(fp8_model_add_linear(m, "a", 0, 16, 1, &id), kInv, "fp8_model_add_linear", "in_features");
  EXPECT_REFUSED(fp8_model_add_linear(m, "a", 16, -1, 1, &id), kInv, "fp8_model_add_linear", "out_features");
  EXPECT_REFUSED(fp8_model_add_linear(m, "a", 16, 16, 2, &id), kInv, "fp8_model_add_linear", "with_bias");
  EXPECT_REFUSED(fp8_model_add_layernorm(m, "a", 0, 1e-5f, &id), kInv, "fp8_model_add_layernorm", "dim");
  for (float eps : {0.0f, -1e-5f, std::nanf("")}) {
    EXPECT_REFUSED(fp8_model_add_layernorm(m, "a", 16, eps, &id), kInv, "fp8_model_add_layernorm", "eps");
    EXPECT_REFUSED(fp8_model_add_rmsnorm(m, "a", 16, eps, &id), kInv, "fp8_model_add_rmsnorm", "eps");
  }
  for (fp8_activation_t a : {-1, 3})
    EXPECT_REFUSED(fp8_model_add_activation(m, "a", a, &id), kInv, "fp8_model_add_activation", "activation");
  EXPECT_EQ(id, -7) << "layer_id written by a refused call";
  int32_t count = 0;
  FP8_ASSERT_OK(fp8_model_layer_count(m, &count));
  EXPECT_EQ(count, 2) << "a refused call added a layer";
  FP8_ASSERT_OK(fp8_model_add_linear(m, std::string(127, 'a').c_str(), 16, 16, 1, &id));
  EXPECT_EQ(id, 2);
  // torch's dotted module paths: the parameter's name is split at its last dot.
  FP8_ASSERT_OK(fp8_model_add_layernorm(m, "blocks.0.ln_1", 16, 1e-5f, &id));
  fp8_tensor_t *w = nullptr, *b = nullptr, *old = nullptr;
  EXPECT_OK(fp8_model_parameter(m, "blocks.0.ln_1.weight", &w, nullptr));
  EXPECT_OK(fp8_model_parameter(m, "blocks.0.ln_1.bias", &b, nullptr));
  EXPECT_OK(fp8_model_parameter(m, "blocks.0.ln_1.gamma", &old, nullptr));  // (the name of earlier releases)
  EXPECT_EQ(old, w);
  EXPECT_OK(fp8_model_parameter(m, "blocks.0.ln_1.beta", &old, nullptr));
  EXPECT_EQ(old, b);
  const char* name = nullptr;
  EXPECT_OK(fp8_model_parameter_at(m, 7, &name, nullptr, nullptr));
  EXPECT_STREQ(name, "blocks.0.ln_1.bias");
}

TEST_F(ModelMisuse, LookupsOutOfRange) {
  fp8_model_t* m = model.get();
  const int32_t kInv = FP8_ERR_INVALID_ARGUMENT;
  const char* name = nullptr;
  fp8_tensor_t* t = nullptr;
  fp8_scaling_t* s = nullptr;
  int32_t id = -7;
  fp8_layer_report_t rep;
  fp8_layer_report_init(&rep);
  for (int32_t bad : {-1, 2, 1000}) {
    EXPECT_REFUSED(fp8_model_layer_name(m, bad, &name), kInv, "fp8_model_layer_name", "layer_id");
    EXPECT_REFUSED(fp8_layer_forward(m, bad, x.get(), y.get()), kInv, "fp8_layer_forward", "layer_id");
    EXPECT_REFUSED(fp8_layer_backward(m, bad, dy.get(), dx.get()), kInv, "fp8_layer_backward", "layer_id");
    EXPECT_REFUSED(fp8_layer_get_scaling(m, bad, 0, &s), kInv, "fp8_layer_get_scaling", "layer_id");
    EXPECT_REFUSED(fp8_layer_get_report(m, bad, &rep), kInv, "fp8_layer_get_report", "layer_id");
  }
  for (int32_t slot : {-1, 4})
    EXPECT_REFUSED(fp8_layer_get_scaling(m, fc, slot, &s), kInv, "fp8_layer_get_scaling", "slot");
  EXPECT_REFUSED(fp8_model_find_layer(m, "nope", &id), kInv, "fp8_model_find_layer", "'nope'");
  for (const char* bad : {"fc.nope", "nope.weight", "fc", "ln.shift", "fc.weight.x"})
    EXPECT_REFUSED(fp8_model_parameter(m, bad, &t, nullptr), kInv, "fp8_model_parameter", std::string("'") + bad + "'");
  for (int32_t bad : {-1, 4})  // fc.weight, fc.bias, ln.weight, ln.bias
    EXPECT_REFUSED(fp8_model_parameter_at(m, bad, &name, &t, nullptr), kInv, "fp8_model_parameter_at", "index");
  EXPECT_REFUSED(fp8_model_set_training(m, 2), kInv, "fp8_model_set_training", "training");
  rep.struct_size = 8;
  rep.kind = 77;
  EXPECT_REFUSED(fp8_layer_get_report(m, fc, &rep), kInv, "fp8_layer_get_report", "struct_size");
  EXPECT_EQ(rep.kind, 77) << "report written by a refused call";
  EXPECT_EQ(name, nullptr);
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(s, nullptr);
  EXPECT_EQ(id, -7);
}

TEST_F(ModelMisuse, RefusedForwardLeavesYUntouched) {
  fp8_model_t* m = model.get();
  convert();
  FP8_ASSERT_OK(fp8_autocast_begin(m));
  fill(y.get(), kSentinel);
  auto refused = [&](fp8_status_t got, fp8_status_t want, const char* word, const fp8_tensor_t* out) {
    EXPECT_REFUSED(got, want, "fp8_layer_forward", word);
    expect_untouched(out, "y");
  };
  Tensor x48 = f32_tensor(ctx.get(), {kTokens, 48}, random_x(kTokens, 48, 4));
  refused(fp8_layer_forward(m, fc, x48.get(), y.get()), FP8_ERR_SHAPE, "'fc'", y.get());
  EXPECT_NE(std::string(fp8_last_error_message()).find("64"), std::string::npos) << "names the expected width";
  Tensor y16 = f32_tensor(ctx.get(), {kTokens, 16});
  fill(y16.get(), kSentinel);
  refused(fp8_layer_forward(m, fc, x.get(), y16.get()), FP8_ERR_SHAPE, "y has shape", y16.get());
  Tensor y_f16 = make_tensor(ctx.get(), FP8_DTYPE_F16, {kTokens, kOut});
  upload(y_f16.get(), std::vector<uint16_t>(kTokens * kOut, 0xBEEF));
  EXPECT_REFUSED(fp8_layer_forward(m, fc, x.get(), y_f16.get()), FP8_ERR_DTYPE, "fp8_layer_forward", "f16");
  EXPECT_EQ(download<uint16_t>(y_f16.get()), std::vector<uint16_t>(kTokens * kOut, 0xBEEF));
  Tensor x_bf16 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {kTokens, kIn});
  upload(x_bf16.get(), std::vector<uint16_t>(kTokens * kIn, 0x3F80));
  refused(fp8_layer_forward(m, fc, x_bf16.get(), y.get()), FP8_ERR_DTYPE, "bf16", y.get());
  Tensor x_e5m2 = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {kTokens, kIn});
  upload(x_e5m2.get(), std::vector<uint8_t>(kTokens * kIn, 0x3C));
  refused(fp8_layer_forward(m, fc, x_e5m2.get(), y.get()), FP8_ERR_DTYPE, "e5m2", y.get());
  Tensor scalar = f32_tensor(ctx.get(), {}, {1.0f});
  refused(fp8_layer_forward(m, fc, scalar.get(), y.get()), FP8_ERR_SHAPE, "'fc'", y.get());

  Context other = make_context(FP8_DEVICE_CPU);
  Tensor x_other = f32_tensor(other.get(), {kTokens, kIn}, random_x(kTokens, kIn, 5));
  Tensor y_other = f32_tensor(other.get(), {kTokens, kOut});
  fill(y_other.get(), kSentinel);
  refused(fp8_layer_forward(m, fc, x_other.get(), y.get()), FP8_ERR_INVALID_ARGUMENT, "another context", y.get());
  refused(fp8_layer_forward(m, fc, x.get(), y_other.get()), FP8_ERR_INVALID_ARGUMENT, "another context", y_other.get());
  EXPECT_EQ(report_of(m, fc).fprop, -1) << "a refused forward is not recorded";
  FP8_ASSERT_OK(fp8_autocast_end(m));
  EXPECT_EQ(state_info(m, fc, FP8_SCALING_INPUT).scale, 1.0f) << "refused forwards recorded an amax";
}

// The norm and activation layers refuse x and y sharing memory; a Linear must too (its GEMM reads x
// while writing y, and its high-precision backward reads x again).
TEST_F(ModelMisuse, LinearForwardRefusesYOverlappingX) {
  int32_t sq = -1;
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "sq", kIn, kIn, 0, &sq));
  void* x_data = nullptr;
  FP8_ASSERT_OK(fp8_tensor_data(x.get(), &x_data));
  const int64_t shape[2] = {kTokens, kIn};
  fp8_tensor_t* raw = nullptr;
  FP8_ASSERT_OK(fp8_tensor_wrap(&raw, ctx.get(), FP8_DTYPE_F32, 2, shape, x_data));
  Tensor alias(raw);
  Tensor h = f32_tensor(ctx.get(), {kTokens, kIn});
  EXPECT_REFUSED(fp8_layer_forward(model.get(), ln, x.get(), alias.get()), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_layer_forward", "overlap");
  EXPECT_REFUSED(fp8_layer_forward(model.get(), sq, x.get(), alias.get()), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_layer_forward", "overlap");
}

TEST_F(ModelMisuse, BackwardRefusalsLeaveDxAndGradientsUntouched) {
  fp8_model_t* m = model.get();
  EXPECT_REFUSED(fp8_layer_backward(m, fc, dy.get(), dx.get()), FP8_ERR_INVALID_STATE, "fp8_layer_backward", "'fc'");
  EXPECT_REFUSED(fp8_layer_backward(m, ln, dx.get(), dx.get()), FP8_ERR_INVALID_STATE, "fp8_layer_backward", "'ln'");
  FP8_ASSERT_OK(fp8_layer_forward(m, fc, x.get(), y.get()));
  fill(dx.get(), kSentinel);
  auto refused = [&](fp8_status_t got, fp8_status_t want, const char* word) {
    EXPECT_REFUSED(got, want, "fp8_layer_backward", word);
    expect_untouched(dx.get(), "dx");
    EXPECT_EQ(amax_of(param_grad(m, "fc.weight")), 0.0f) << "dW written by a refused call";
    EXPECT_EQ(amax_of(param_grad(m, "fc.bias")), 0.0f) << "db written by a refused call";
  };
  Tensor dy_shape = f32_tensor(ctx.get(), {kTokens, kOut + 16}, random_dy(kTokens, kOut + 16, 6));
  refused(fp8_layer_backward(m, fc, dy_shape.get(), dx.get()), FP8_ERR_SHAPE, "dy has shape");
  Tensor dy_rows = f32_tensor(ctx.get(), {kTokens / 2, kOut}, random_dy(kTokens / 2, kOut, 7));
  refused(fp8_layer_backward(m, fc, dy_rows.get(), dx.get()), FP8_ERR_SHAPE, "'fc'");
  Tensor dy_bf16 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {kTokens, kOut});
  upload(dy_bf16.get(), std::vector<uint16_t>(kTokens * kOut, 0x3F80));
  refused(fp8_layer_backward(m, fc, dy_bf16.get(), dx.get()), FP8_ERR_DTYPE, "dy has dtype bf16");
  Tensor dx_shape = f32_tensor(ctx.get(), {kTokens, kIn + 16});
  refused(fp8_layer_backward(m, fc, dy.get(), dx_shape.get()), FP8_ERR_SHAPE, "dx has shape");
  Tensor dx_bf16 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {kTokens, kIn});
  refused(fp8_layer_backward(m, fc, dy.get(), dx_bf16.get()), FP8_ERR_DTYPE, "dx has dtype bf16");
  Context other = make_context(FP8_DEVICE_CPU);
  Tensor dy_other = f32_tensor(other.get(), {kTokens, kOut}, random_dy(kTokens, kOut, 8));
  Tensor dx_other = f32_tensor(other.get(), {kTokens, kIn});
  refused(fp8_layer_backward(m, fc, dy_other.get(), dx.get()), FP8_ERR_INVALID_ARGUMENT, "another context");
  refused(fp8_layer_backward(m, fc, dy.get(), dx_other.get()), FP8_ERR_INVALID_ARGUMENT, "another context");
  // The forward's record survived the refusals: the backward runs, once.
  FP8_ASSERT_OK(fp8_layer_backward(m, fc, dy.get(), dx.get()));
  EXPECT_GT(amax_of(param_grad(m, "fc.weight")), 0.0f);
  EXPECT_REFUSED(fp8_layer_backward(m, fc, dy.get(), dx.get()), FP8_ERR_INVALID_STATE, "fp8_layer_backward", "'fc'");
  // A norm needs its dx.
  Tensor h = f32_tensor(ctx.get(), {kTokens, kIn});
  FP8_ASSERT_OK(fp8_layer_forward(m, ln, x.get(), h.get()));
  EXPECT_REFUSED(fp8_layer_backward(m, ln, h.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_layer_backward", "'dx'");
}

TEST_F(ModelMisuse, AutocastAndConversionState) {
  fp8_model_t* m = model.get();
  EXPECT_REFUSED(fp8_autocast_end(m), FP8_ERR_INVALID_STATE, "fp8_autocast_end", "fp8_autocast_begin");
  EXPECT_REFUSED(fp8_autocast_begin(m), FP8_ERR_INVALID_STATE, "fp8_autocast_begin", "fp8_convert_model");
  Recipe r = fp8_recipe();
  fp8_convert_options_t opts;
  fp8_convert_options_init(&opts);
  opts.struct_size = 4;
  EXPECT_REFUSED(fp8_convert_model(m, r.get(), &opts), FP8_ERR_INVALID_ARGUMENT, "fp8_convert_model", "struct_size");
  fp8_convert_options_init(&opts);
  opts.linear = 2;
  EXPECT_REFUSED(fp8_convert_model(m, r.get(), &opts), FP8_ERR_INVALID_ARGUMENT, "fp8_convert_model", "linear");
  int32_t has = -1;
  FP8_ASSERT_OK(fp8_model_has_fp8_layers(m, &has));
  EXPECT_EQ(has, 0) << "a refused conversion converted";

  FP8_ASSERT_OK(fp8_convert_model(m, r.get(), nullptr));
  FP8_ASSERT_OK(fp8_autocast_begin(m));
  EXPECT_REFUSED(fp8_autocast_begin(m), FP8_ERR_INVALID_STATE, "fp8_autocast_begin", "already");
  EXPECT_REFUSED(fp8_convert_model(m, r.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_convert_model", "autocast");
  FP8_ASSERT_OK(fp8_autocast_end(m));
  EXPECT_REFUSED(fp8_autocast_end(m), FP8_ERR_INVALID_STATE, "fp8_autocast_end", "fp8_autocast_begin");
  int32_t id = -7;
  EXPECT_REFUSED(fp8_model_add_linear(m, "late", 16, 16, 1, &id), FP8_ERR_INVALID_STATE, "fp8_model_add_linear",
                 "fp8_convert_model");
  EXPECT_REFUSED(fp8_model_add_activation(m, "late", FP8_ACTIVATION_RELU, &id), FP8_ERR_INVALID_STATE,
                 "fp8_model_add_activation", "fp8_convert_model");
  EXPECT_EQ(id, -7);
  int32_t count = 0;
  FP8_ASSERT_OK(fp8_model_layer_count(m, &count));
  EXPECT_EQ(count, 2);
}

TEST_F(ModelMisuse, Fp8OutputOfNormsNeedsConversionAndTheForwardFormat) {
  fp8_model_t* m = model.get();
  Tensor h = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {kTokens, kIn});
  upload(h.get(), std::vector<uint8_t>(kTokens * kIn, 0x5A));
  EXPECT_REFUSED(fp8_layer_forward(m, ln, x.get(), h.get()), FP8_ERR_INVALID_STATE, "fp8_layer_forward", "'ln'");
  EXPECT_EQ(download<uint8_t>(h.get()), std::vector<uint8_t>(kTokens * kIn, 0x5A));
  convert();
  Tensor h5 = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {kTokens, kIn});
  upload(h5.get(), std::vector<uint8_t>(kTokens * kIn, 0x5A));
  EXPECT_REFUSED(fp8_layer_forward(m, ln, x.get(), h5.get()), FP8_ERR_DTYPE, "fp8_layer_forward", "e5m2");
  EXPECT_EQ(download<uint8_t>(h5.get()), std::vector<uint8_t>(kTokens * kIn, 0x5A));
  FP8_ASSERT_OK(fp8_layer_forward(m, ln, x.get(), h.get()));
}

// A refused norm forward is not a forward: the report's precision stays as it was.
TEST_F(ModelMisuse, RefusedNormForwardDoesNotChangeTheReport) {
  fp8_model_t* m = model.get();
  Tensor h = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {kTokens, kIn});
  EXPECT_EQ(fp8_layer_forward(m, ln, x.get(), h.get()), FP8_ERR_INVALID_STATE);
  EXPECT_EQ(report_of(m, ln).fprop, -1) << "the refused FP8 forward was recorded as one";
  Tensor hw = f32_tensor(ctx.get(), {kTokens, kIn});
  FP8_ASSERT_OK(fp8_layer_forward(m, ln, x.get(), hw.get()));
  EXPECT_EQ(report_of(m, ln).fprop, 0);
  EXPECT_EQ(fp8_layer_forward(m, ln, x.get(), h.get()), FP8_ERR_INVALID_STATE);
  EXPECT_EQ(report_of(m, ln).fprop, 0) << "the refused FP8 forward was recorded as one";
}

TEST_F(ModelMisuse, ReportBufferTooSmall) {
  fp8_model_t* m = model.get();
  size_t needed = 0;
  char buf[16];
  std::memset(buf, 'z', sizeof buf);
  EXPECT_REFUSED(fp8_model_report(m, buf, sizeof buf, &needed), FP8_ERR_BUFFER_TOO_SMALL, "fp8_model_report", "cap");
  EXPECT_GT(needed, sizeof buf);
  EXPECT_EQ(std::string(buf, sizeof buf), std::string(sizeof buf, 'z')) << "buf written by a refused call";
  std::string full(needed, 'z');
  size_t again = 0;
  EXPECT_REFUSED(fp8_model_report(m, full.data(), needed - 1, &again), FP8_ERR_BUFFER_TOO_SMALL, "fp8_model_report",
                 "cap");
  EXPECT_EQ(again, needed);
  FP8_ASSERT_OK(fp8_model_report(m, full.data(), needed, &again));
  EXPECT_EQ(again, needed);
  EXPECT_EQ(std::strlen(full.c_str()) + 1, needed);
}

// =================================================================================================
// 12. The report text, layer lookup and parameter enumeration
// =================================================================================================

// The line of the report that starts with `name` followed by a space ("" if none).
std::string report_line(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name + " ", 0) == 0) return line;
  return "";
}

TEST(ModelReport, ListsEveryLayerWithItsPrecisionAndReason) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t fc1 = -1, odd = -1, ln = -1;
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc1", kIn, kOut, 1, &fc1));
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "odd", 40, kOut, 1, &odd));
  FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "ln", kIn, 1e-5f, &ln));
  Recipe r = fp8_recipe();
  FP8_ASSERT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
  Tensor x = f32_tensor(ctx.get(), {kTokens, kIn}, random_x(kTokens, kIn, 1)),
         y = f32_tensor(ctx.get(), {kTokens, kOut});
  Tensor x40 = f32_tensor(ctx.get(), {kTokens, 40}, random_x(kTokens, 40, 2)),
         h = f32_tensor(ctx.get(), {kTokens, kIn});
  FP8_ASSERT_OK(fp8_autocast_begin(model.get()));
  FP8_ASSERT_OK(fp8_layer_forward(model.get(), fc1, x.get(), y.get()));
  FP8_ASSERT_OK(fp8_layer_forward(model.get(), odd, x40.get(), y.get()));
  FP8_ASSERT_OK(fp8_layer_forward(model.get(), ln, x.get(), h.get()));
  FP8_ASSERT_OK(fp8_autocast_end(model.get()));

  const std::string text = model_report_text(model.get());
  const std::string l_fc1 = report_line(text, "fc1"), l_odd = report_line(text, "odd"), l_ln = report_line(text, "ln");
  ASSERT_FALSE(l_fc1.empty()) << text;
  ASSERT_FALSE(l_odd.empty()) << text;
  ASSERT_FALSE(l_ln.empty()) << text;
  EXPECT_NE(l_fc1.find("linear"), std::string::npos) << l_fc1;
  EXPECT_NE(l_fc1.find("fp8"), std::string::npos) << l_fc1;
  EXPECT_EQ(l_fc1.find("high"), std::string::npos) << l_fc1;
  EXPECT_NE(l_odd.find("high"), std::string::npos) << l_odd;
  EXPECT_EQ(l_odd.find("fp8"), std::string::npos) << l_odd;
  EXPECT_NE(l_odd.find("in_features"), std::string::npos) << l_odd;
  EXPECT_NE(l_ln.find("layernorm"), std::string::npos) << l_ln;
  EXPECT_NE(l_ln.find("high"), std::string::npos) << l_ln;  // a wide y
  EXPECT_NE(l_fc1.find("delayed"), std::string::npos) << l_fc1;
  EXPECT_EQ(l_odd.find("delayed"), std::string::npos) << l_odd;  // not converted
  EXPECT_EQ(report_of(model.get(), fc1).scaling, FP8_SCALING_DELAYED);
  EXPECT_EQ(report_of(model.get(), odd).scaling, -1);
}

TEST(ModelLayout, LayersAndParametersInOrderOfAddition) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t ids[5] = {-1, -1, -1, -1, -1};
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc1", 32, 48, 1, &ids[0]));
  FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "ln", 48, 1e-5f, &ids[1]));
  FP8_ASSERT_OK(fp8_model_add_rmsnorm(model.get(), "rms", 48, 1e-6f, &ids[2]));
  FP8_ASSERT_OK(fp8_model_add_activation(model.get(), "act", FP8_ACTIVATION_SWIGLU, &ids[3]));
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc2", 24, 16, 0, &ids[4]));
  for (int32_t i = 0; i < 5; ++i) EXPECT_EQ(ids[i], i);

  const char* names[] = {"fc1", "ln", "rms", "act", "fc2"};
  const fp8_layer_kind_t kinds[] = {FP8_LAYER_LINEAR, FP8_LAYER_LAYERNORM, FP8_LAYER_RMSNORM, FP8_LAYER_ACTIVATION,
                                    FP8_LAYER_LINEAR};
  int32_t count = 0;
  FP8_ASSERT_OK(fp8_model_layer_count(model.get(), &count));
  EXPECT_EQ(count, 5);
  for (int32_t i = 0; i < 5; ++i) {
    const char* name = nullptr;
    int32_t found = -1;
    FP8_ASSERT_OK(fp8_model_layer_name(model.get(), i, &name));
    EXPECT_STREQ(name, names[i]);
    FP8_ASSERT_OK(fp8_model_find_layer(model.get(), names[i], &found));
    EXPECT_EQ(found, i);
    const fp8_layer_report_t r = report_of(model.get(), i);
    EXPECT_EQ(r.kind, kinds[i]);
    EXPECT_EQ(r.converted, 0);
    expect_plan(r, {-1, -1, -1});
  }

  // Parameters: layers in order, then weight, bias / gamma, beta; the documented initial values.
  struct Expected {
    const char* name;
    std::vector<int64_t> shape;
    float init;
  };
  const Expected want[] = {{"fc1.weight", {48, 32}, 0.0f}, {"fc1.bias", {48}, 0.0f},   {"ln.weight", {48}, 1.0f},
                           {"ln.bias", {48}, 0.0f},        {"rms.weight", {48}, 1.0f}, {"fc2.weight", {16, 24}, 0.0f}};
  FP8_ASSERT_OK(fp8_model_parameter_count(model.get(), &count));
  ASSERT_EQ(count, 6);
  for (int32_t i = 0; i < count; ++i) {
    const Expected& e = want[i];
    const char* name = nullptr;
    fp8_tensor_t *value = nullptr, *grad = nullptr;
    FP8_ASSERT_OK(fp8_model_parameter_at(model.get(), i, &name, &value, &grad));
    EXPECT_STREQ(name, e.name);
    EXPECT_EQ(value, param_tensor(model.get(), e.name));
    EXPECT_EQ(grad, param_tensor(model.get(), e.name, true));
    EXPECT_NE(value, grad);
    for (fp8_tensor_t* t : {value, grad}) {
      fp8_dtype_t dt = -1;
      int32_t ndim = 0;
      int64_t shape[FP8_MAX_DIMS] = {};
      FP8_ASSERT_OK(fp8_tensor_dtype(t, &dt));
      FP8_ASSERT_OK(fp8_tensor_shape(t, &ndim, shape));
      EXPECT_EQ(dt, FP8_DTYPE_F32) << e.name;
      EXPECT_EQ(std::vector<int64_t>(shape, shape + ndim), e.shape) << e.name;
    }
    EXPECT_EQ(download<float>(value), std::vector<float>(static_cast<size_t>(numel_of(e.shape)), e.init)) << e.name;
    EXPECT_EQ(download<float>(grad), std::vector<float>(static_cast<size_t>(numel_of(e.shape)), 0.0f)) << e.name;
  }
}

// The model keeps its context's device alive: the context handle may go first.
// fp8.h: the model keeps the latest training-mode forward; a refused one (here a y of the wrong
// shape) leaves it, so the backward after it is the kept forward's, bit for bit.
TEST(ModelForward, ARefusedForwardLeavesTheKeptOne) {
  constexpr int64_t kRows = 4, kI = 16, kO = 8;
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", kI, kO, 1, nullptr));
  set_param(model.get(), "fc.weight", randn(kI * kO, 5, 0.25f));
  Tensor x = f32_tensor(ctx.get(), {kRows, kI}, random_x(kRows, kI, 6));
  Tensor x2 = f32_tensor(ctx.get(), {kRows, kI}, random_x(kRows, kI, 7));
  Tensor y = f32_tensor(ctx.get(), {kRows, kO}), bad_y = f32_tensor(ctx.get(), {kRows, kO - 1});
  Tensor dy = f32_tensor(ctx.get(), {kRows, kO}, random_dy(kRows, kO, 8)), dx = f32_tensor(ctx.get(), {kRows, kI});
  FP8_ASSERT_OK(fp8_model_forward(model.get(), x.get(), y.get()));
  FP8_ASSERT_OK(fp8_model_backward(model.get(), dy.get(), dx.get()));
  const std::vector<float> dx_alone = download<float>(dx.get());
  FP8_ASSERT_OK(fp8_model_forward(model.get(), x.get(), y.get()));
  EXPECT_EQ(fp8_model_forward(model.get(), x2.get(), bad_y.get()), FP8_ERR_SHAPE);
  upload(dx.get(), std::vector<float>(kRows * kI, 0.0f));
  FP8_ASSERT_OK(fp8_model_backward(model.get(), dy.get(), dx.get()));
  EXPECT_EQ(download<float>(dx.get()), dx_alone) << "the backward did not differentiate the kept forward";
}

TEST(ModelLayout, OutlivesItsContextHandle) {
  fp8_context_t* ctx = nullptr;
  FP8_ASSERT_OK(fp8_context_create(&ctx, FP8_DEVICE_CPU));
  Model model = make_model(ctx);
  fp8_context_destroy(ctx);
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", 16, 16, 1, nullptr));
  const std::vector<float> w = randn(256, 1, 1.0f);
  set_param(model.get(), "fc.weight", w);
  EXPECT_EQ(param_value(model.get(), "fc.weight"), w);
}

// A recreated context (fp8.h: objects keep their context alive, so fp8_context_destroy may come
// first). A converted model whose context handle is gone, with its tensors, gets an optimizer and
// trains on bit for bit as a twin on a live context. A context created afterwards (its handle may
// well reuse the old one's address) is another context: the model refuses its tensors (x, y, dy, dx,
// g, other_sumsq), naming the argument and "the model's" context, and changes nothing; a model of the
// new context refuses the old context's tensors the same way. Everything is then destroyed, the old
// context's tensors last (the sanitizer build checks the memory).
TEST(ModelLayout, TrainsAfterItsContextIsDestroyedAndRefusesTheTensorsOfARecreatedOne) {
  constexpr int64_t kRows = 16, kF = 32;
  const std::vector<float> w = randn(kF * kF, 11, 0.125f), xh = random_x(kRows, kF, 12), dyh = random_dy(kRows, kF, 13);
  struct Run {
    fp8_context_t* ctx = nullptr;
    Model model;
    Tensor x, y, dy, dx;
  };
  auto build = [&](Run& r) {
    FP8_ASSERT_OK(fp8_context_create(&r.ctx, FP8_DEVICE_CPU));
    r.model = make_model(r.ctx);
    FP8_ASSERT_OK(fp8_model_add_linear(r.model.get(), "fc", kF, kF, 1, nullptr));
    set_param(r.model.get(), "fc.weight", w);
    Recipe rec = fp8_recipe();
    FP8_ASSERT_OK(fp8_convert_model(r.model.get(), rec.get(), nullptr));
    r.x = f32_tensor(r.ctx, {kRows, kF}, xh);
    r.y = f32_tensor(r.ctx, {kRows, kF});
    r.dy = f32_tensor(r.ctx, {kRows, kF}, dyh);
    r.dx = f32_tensor(r.ctx, {kRows, kF});
  };
  auto train_step = [](Run& r, fp8_optimizer_t* o) {
    FP8_ASSERT_OK(fp8_model_forward(r.model.get(), r.x.get(), r.y.get()));
    FP8_ASSERT_OK(fp8_model_backward(r.model.get(), r.dy.get(), r.dx.get()));
    FP8_ASSERT_OK(fp8_optimizer_step(o));
  };
  Run live, orphan;
  build(live);
  build(orphan);
  ASSERT_FALSE(HasFatalFailure());
  const uintptr_t old_address = reinterpret_cast<uintptr_t>(orphan.ctx);
  fp8_context_destroy(orphan.ctx);  // before its model, tensors and (future) optimizer
  Context fresh = make_context(FP8_DEVICE_CPU);
  SCOPED_TRACE(reinterpret_cast<uintptr_t>(fresh.get()) == old_address ? "the new handle has the old one's address"
                                                                         : "the new handle has another address");

  Optimizer live_opt = make_optimizer(live.model.get(), FP8_OPTIMIZER_ADAM);
  Optimizer orphan_opt = make_optimizer(orphan.model.get(), FP8_OPTIMIZER_ADAM);
  ASSERT_NE(orphan_opt, nullptr);
  for (int step = 0; step < 2; ++step) {
    train_step(live, live_opt.get());
    train_step(orphan, orphan_opt.get());
  }
  ASSERT_FALSE(HasFatalFailure());
  for (const char* p : {"fc.weight", "fc.bias"}) {
    EXPECT_EQ(tensor_bytes(param_tensor(orphan.model.get(), p)), tensor_bytes(param_tensor(live.model.get(), p))) << p;
    EXPECT_EQ(tensor_bytes(param_tensor(orphan.model.get(), p, true)),
              tensor_bytes(param_tensor(live.model.get(), p, true)))
        << p;
  }
  EXPECT_EQ(tensor_bytes(orphan.y.get()), tensor_bytes(live.y.get()));
  EXPECT_EQ(tensor_bytes(orphan.dx.get()), tensor_bytes(live.dx.get()));

  // The recreated context's tensors, refused by the old context's model (with a forward pending,
  // which the refused backward calls must not drop).
  fp8_model_t* m = orphan.model.get();
  FP8_ASSERT_OK(fp8_model_forward(m, orphan.x.get(), orphan.y.get()));
  Tensor x2 = f32_tensor(fresh.get(), {kRows, kF}, xh), y2 = f32_tensor(fresh.get(), {kRows, kF}, {}),
         dy2 = f32_tensor(fresh.get(), {kRows, kF}, dyh), dx2 = f32_tensor(fresh.get(), {kRows, kF}, {}),
         g2 = f32_tensor(fresh.get(), {kF * kF}, w), sumsq2 = f32_tensor(fresh.get(), {1}, {0.0f});
  upload(y2.get(), std::vector<float>(kRows * kF, -7.0f));
  upload(dx2.get(), std::vector<float>(kRows * kF, -7.0f));
  const std::vector<uint8_t> y_before = tensor_bytes(orphan.y.get()), dx_before = tensor_bytes(orphan.dx.get()),
                             y2_before = tensor_bytes(y2.get()), dx2_before = tensor_bytes(dx2.get()),
                             w_before = tensor_bytes(param_tensor(m, "fc.weight")),
                             g_before = tensor_bytes(param_tensor(m, "fc.weight", true));
  const int64_t steps_before = stats_of(orphan_opt.get()).steps;
  const int32_t kInv = FP8_ERR_INVALID_ARGUMENT;
  const char* kOther = "belongs to another context";
  const char* kModels = "expected one of the model's";
  EXPECT_REFUSED_WORDS(fp8_model_forward(m, x2.get(), orphan.y.get()), kInv, "fp8_model_forward", "x", kOther, kModels);
  EXPECT_REFUSED_WORDS(fp8_model_forward(m, orphan.x.get(), y2.get()), kInv, "fp8_model_forward", "y", kOther, kModels);
  EXPECT_REFUSED_WORDS(fp8_model_backward(m, dy2.get(), orphan.dx.get()), kInv, "fp8_model_backward", "dy", kOther,
                       kModels);
  EXPECT_REFUSED_WORDS(fp8_model_backward(m, orphan.dy.get(), dx2.get()), kInv, "fp8_model_backward", "dx", kOther,
                       kModels);
  EXPECT_REFUSED_WORDS(fp8_layer_forward(m, 0, x2.get(), orphan.y.get()), kInv, "fp8_layer_forward", "x", kOther);
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 0, g2.get()), kInv, "fp8_model_accumulate_grad",
                       "g belongs to another context", "expected the model's");
  EXPECT_REFUSED_WORDS(fp8_optimizer_step_joint(orphan_opt.get(), sumsq2.get(), nullptr), kInv,
                       "fp8_optimizer_step_joint", "other_sumsq", kOther, kModels);
  EXPECT_EQ(tensor_bytes(orphan.y.get()), y_before);
  EXPECT_EQ(tensor_bytes(orphan.dx.get()), dx_before);
  EXPECT_EQ(tensor_bytes(y2.get()), y2_before) << "a refused forward wrote y";
  EXPECT_EQ(tensor_bytes(dx2.get()), dx2_before) << "a refused backward wrote dx";
  EXPECT_EQ(tensor_bytes(param_tensor(m, "fc.weight")), w_before);
  EXPECT_EQ(tensor_bytes(param_tensor(m, "fc.weight", true)), g_before);
  EXPECT_EQ(stats_of(orphan_opt.get()).steps, steps_before);
  EXPECT_OK(fp8_model_backward(m, orphan.dy.get(), orphan.dx.get()));  // the pending forward's

  // And a model of the recreated context refuses the old context's tensors.
  Model m2 = make_model(fresh.get());
  FP8_ASSERT_OK(fp8_model_add_linear(m2.get(), "fc", kF, kF, 1, nullptr));
  EXPECT_REFUSED_WORDS(fp8_model_forward(m2.get(), orphan.x.get(), y2.get()), kInv, "fp8_model_forward", "x", kOther,
                       kModels);
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m2.get(), 0, param_tensor(m, "fc.weight", true)), kInv,
                       "fp8_model_accumulate_grad", "g belongs to another context");
  EXPECT_EQ(tensor_bytes(y2.get()), y2_before);
  EXPECT_OK(fp8_model_forward(m2.get(), x2.get(), y2.get()));

  orphan_opt.reset();
  orphan.model.reset();
  orphan.dx.reset();
  orphan.dy.reset();
  orphan.y.reset();
  orphan.x.reset();  // the old context's last object: its resources go here
  live_opt.reset();
  fp8_context_destroy(live.ctx);
}

}  // namespace
