// Activations on the CPU reference backend: forward against float64 formulas, backward against
// float64 derivatives and central finite differences, FP8 outputs, and every refusal.
#include <cmath>
#include <random>

#include "core/format.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

double gelu64(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }
double silu64(double x) { return x / (1 + std::exp(-x)); }

// Forward in float64 of one output element; SwiGLU takes (a, b).
double forward64(fp8_activation_t act, double a, double b) {
  switch (act) {
    case FP8_ACTIVATION_RELU: return a < 0 ? 0 : a;
    case FP8_ACTIVATION_GELU: return gelu64(a);
    default: return silu64(a) * b;
  }
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

class CpuActivation : public ::testing::TestWithParam<fp8_activation_t> {
 protected:
  Context ctx = make_context(FP8_DEVICE_CPU);
};

TEST_P(CpuActivation, ForwardMatchesFloat64) {
  const fp8_activation_t act = GetParam();
  const int64_t rows = 6, cols = 40, out_cols = act == FP8_ACTIVATION_SWIGLU ? cols / 2 : cols;
  const auto x = random_floats(static_cast<size_t>(rows * cols), 1);
  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, cols}), ty = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, out_cols});
  upload(tx.get(), x);
  FP8_ASSERT_OK(fp8_activation_forward(ctx.get(), act, tx.get(), ty.get(), nullptr));
  const auto y = download<float>(ty.get());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < out_cols; ++c) {
      const double a = x[static_cast<size_t>(r * cols + c)];
      const double b = act == FP8_ACTIVATION_SWIGLU ? x[static_cast<size_t>(r * cols + out_cols + c)] : 0;
      const double want = forward64(act, a, b);
      ASSERT_NEAR(y[static_cast<size_t>(r * out_cols + c)], want, std::fabs(want) * 2e-6 + 1e-7) << r << "," << c;
    }
}

TEST_P(CpuActivation, BackwardMatchesCentralFiniteDifferencesOfTheFloat64Forward) {
  const fp8_activation_t act = GetParam();
  const int64_t rows = 4, cols = 32, out_cols = act == FP8_ACTIVATION_SWIGLU ? cols / 2 : cols;
  auto x = random_floats(static_cast<size_t>(rows * cols), 2);
  for (auto& v : x)
    if (std::fabs(v) < 1e-2f) v = 0.5f;  // keep ReLU's kink away from the finite differences
  const auto dy = random_floats(static_cast<size_t>(rows * out_cols), 3);
  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, cols}), tdy = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, out_cols});
  Tensor tdx = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, cols});
  upload(tx.get(), x);
  upload(tdy.get(), dy);
  FP8_ASSERT_OK(fp8_activation_backward(ctx.get(), act, tx.get(), tdy.get(), tdx.get(), nullptr));
  const auto dx = download<float>(tdx.get());
  // dL/dx_j for L = sum dy * f(x), by central differences in float64.
  const double h = 1e-5;
  auto loss = [&](const std::vector<double>& xs) {
    double l = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < out_cols; ++c) {
        const double a = xs[static_cast<size_t>(r * cols + c)];
        const double b = act == FP8_ACTIVATION_SWIGLU ? xs[static_cast<size_t>(r * cols + out_cols + c)] : 0;
        l += dy[static_cast<size_t>(r * out_cols + c)] * forward64(act, a, b);
      }
    return l;
  };
  std::vector<double> xs(x.begin(), x.end());
  for (size_t j = 0; j < xs.size(); ++j) {
    const double keep = xs[j];
    xs[j] = keep + h;
    const double up = loss(xs);
    xs[j] = keep - h;
    const double down = loss(xs);
    xs[j] = keep;
    const double want = (up - down) / (2 * h);
    ASSERT_NEAR(dx[j], want, std::fabs(want) * 1e-4 + 1e-5) << "element " << j;
  }
}

TEST_P(CpuActivation, Fp8OutputIsScaledEncodedAndFeedsItsState) {
  const fp8_activation_t act = GetParam();
  const int64_t rows = 8, cols = 64, out_cols = act == FP8_ACTIVATION_SWIGLU ? cols / 2 : cols;
  const auto x = random_floats(static_cast<size_t>(rows * cols), 4);
  Recipe recipe = make_recipe();
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  FP8_ASSERT_OK(fp8_scaling_set_scale(s.get(), 16.0f));
  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_BF16, {rows, cols});
  Tensor wide = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, out_cols}), q = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {rows, out_cols});
  std::vector<uint16_t> raw(x.size());
  for (size_t i = 0; i < x.size(); ++i) raw[i] = fp8::float_to_bf16(x[i]);
  upload(tx.get(), raw);
  FP8_ASSERT_OK(fp8_activation_forward(ctx.get(), act, tx.get(), wide.get(), nullptr));
  FP8_ASSERT_OK(fp8_activation_forward(ctx.get(), act, tx.get(), q.get(), s.get()));
  const auto y = download<float>(wide.get());
  const auto codes = download<uint8_t>(q.get());
  float amax = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    amax = std::max(amax, std::fabs(y[i]));
    ASSERT_EQ(codes[i], fp8_encode(y[i] * 16.0f, FP8_DTYPE_E4M3)) << i;
  }
  EXPECT_EQ(info_of(s.get()).amax, amax);
  float si = 0;
  FP8_ASSERT_OK(fp8_tensor_get_scale_inv(q.get(), &si));
  EXPECT_EQ(si, 1.0f / 16.0f);
}

INSTANTIATE_TEST_SUITE_P(Activations, CpuActivation,
                         ::testing::Values(FP8_ACTIVATION_RELU, FP8_ACTIVATION_GELU, FP8_ACTIVATION_SWIGLU),
                         [](const auto& info) {
                           return std::string(info.param == FP8_ACTIVATION_RELU   ? "relu"
                                              : info.param == FP8_ACTIVATION_GELU ? "gelu"
                                                                                  : "swiglu");
                         });

TEST(CpuActivationSpecials, ReluKeepsNanAndGradientIsZeroBelowZero) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {4}), y = make_tensor(ctx.get(), FP8_DTYPE_F32, {4});
  upload<float>(x.get(), {-1.0f, NAN, 2.0f, -0.0f});
  FP8_ASSERT_OK(fp8_activation_forward(ctx.get(), FP8_ACTIVATION_RELU, x.get(), y.get(), nullptr));
  const auto v = download<float>(y.get());
  EXPECT_EQ(v[0], 0.0f);
  EXPECT_TRUE(std::isnan(v[1]));
  EXPECT_EQ(v[2], 2.0f);
}

TEST(CpuActivationSpecials, GeluGradientIsOneOrZeroFarOutNotNan) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {4}), dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {4});
  Tensor dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {4});
  upload<float>(x.get(), {6e19f, -1e20f, 12.0f, -12.0f});
  upload<float>(dy.get(), {2.0f, 2.0f, 2.0f, 2.0f});
  FP8_ASSERT_OK(fp8_activation_backward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), dy.get(), dx.get(), nullptr));
  EXPECT_EQ(download<float>(dx.get()), (std::vector<float>{2.0f, 0.0f, 2.0f, 0.0f}));
}

TEST(CpuActivationRefusals, BadArgumentsNameWhatIsWrong) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Recipe recipe = make_recipe();
  Scaling bwd = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_BACKWARD);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 6}), y = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 6});
  Tensor odd = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 5}), half = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 3});
  Tensor y8 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {4, 6}), dy32 = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 6});
  struct Case {
    fp8_status_t got, want;
    const char* words;
  } cases[] = {
      {fp8_activation_forward(ctx.get(), 7, x.get(), y.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "activation = 7"},
      {fp8_activation_forward(nullptr, FP8_ACTIVATION_GELU, x.get(), y.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "'ctx'"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'y'"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_SWIGLU, odd.get(), half.get(), nullptr), FP8_ERR_SHAPE, "even last dimension"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_SWIGLU, x.get(), y.get(), nullptr), FP8_ERR_SHAPE, "expected [4, 3]"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), half.get(), nullptr), FP8_ERR_SHAPE, "expected [4, 6]"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), y8.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "'y_scaling' is NULL"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), y8.get(), bwd.get()), FP8_ERR_DTYPE, "y_scaling quantizes to e5m2"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_GELU, y8.get(), y.get(), nullptr), FP8_ERR_DTYPE, "x has dtype e4m3"},
      {fp8_activation_forward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), x.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "overlap"},
      {fp8_activation_backward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), dy32.get(), y.get(), nullptr), FP8_ERR_DTYPE, "dy has dtype f32"},
      {fp8_activation_backward(ctx.get(), FP8_ACTIVATION_GELU, x.get(), nullptr, y.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "'dy'"},
      {fp8_activation_backward(ctx.get(), FP8_ACTIVATION_SWIGLU, x.get(), y.get(), y.get(), nullptr), FP8_ERR_SHAPE, "dy has shape [4, 6], expected [4, 3]"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(c.got, c.want) << c.words;
  }
  // The message of the last refusal names the function and the argument.
  EXPECT_NE(std::string(fp8_last_error_message()).find("fp8_activation_backward: dy has shape"), std::string::npos)
      << fp8_last_error_message();
}

}  // namespace
