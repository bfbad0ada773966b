// LayerNorm and RMSNorm on the CPU reference backend: forward against float64, backward (dx,
// dgamma, dbeta) against central finite differences of a float64 forward, FP8 output, refusals.
#include <cmath>
#include <random>

#include "core/format.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

std::vector<float> random_floats(size_t n, uint32_t seed, float mean = 0.0f, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// Float64 forward of every row.
std::vector<double> forward64(bool rms, const std::vector<double>& x, const std::vector<double>& gamma,
                              const std::vector<double>& beta, int64_t rows, int64_t d, double eps) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, sq = 0;
    for (int64_t c = 0; c < d; ++c) mean += x[static_cast<size_t>(r * d + c)];
    mean = rms ? 0 : mean / d;
    for (int64_t c = 0; c < d; ++c) sq += std::pow(x[static_cast<size_t>(r * d + c)] - mean, 2);
    const double rstd = 1 / std::sqrt(sq / d + eps);
    for (int64_t c = 0; c < d; ++c)
      y[static_cast<size_t>(r * d + c)] =
          (x[static_cast<size_t>(r * d + c)] - mean) * rstd * gamma[static_cast<size_t>(c)] + (beta.empty() ? 0 : beta[static_cast<size_t>(c)]);
  }
  return y;
}

class CpuNorm : public ::testing::TestWithParam<fp8_norm_t> {
 protected:
  Context ctx = make_context(FP8_DEVICE_CPU);
  bool rms() const { return GetParam() == FP8_NORM_RMSNORM; }
};

TEST_P(CpuNorm, ForwardMatchesFloat64AndSavesTheStatistics) {
  const int64_t rows = 5, d = 48;
  const auto x = random_floats(static_cast<size_t>(rows * d), 1, 3.0f, 2.0f);  // an offset, to test the mean
  const auto gamma = random_floats(static_cast<size_t>(d), 2), beta = random_floats(static_cast<size_t>(d), 3);
  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d}), ty = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d});
  Tensor tg = make_tensor(ctx.get(), FP8_DTYPE_F32, {d}), tb = make_tensor(ctx.get(), FP8_DTYPE_F32, {d});
  Tensor tm = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows}), ts = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows});
  upload(tx.get(), x);
  upload(tg.get(), gamma);
  upload(tb.get(), beta);
  FP8_ASSERT_OK(fp8_norm_forward(ctx.get(), GetParam(), tx.get(), tg.get(), rms() ? nullptr : tb.get(), 1e-5f, ty.get(),
                                 nullptr, rms() ? nullptr : tm.get(), ts.get()));
  const auto y = download<float>(ty.get());
  const auto want = forward64(rms(), std::vector<double>(x.begin(), x.end()), std::vector<double>(gamma.begin(), gamma.end()),
                              rms() ? std::vector<double>{} : std::vector<double>(beta.begin(), beta.end()), rows, d, 1e-5);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], want[i], std::fabs(want[i]) * 1e-6 + 1e-6) << i;
  const auto rstd = download<float>(ts.get());
  for (int64_t r = 0; r < rows; ++r) EXPECT_GT(rstd[static_cast<size_t>(r)], 0.0f);
  if (!rms()) EXPECT_NEAR(download<float>(tm.get())[0], [&] {
    double m = 0;
    for (int64_t c = 0; c < d; ++c) m += x[static_cast<size_t>(c)];
    return m / d;
  }(), 1e-5);
}

TEST_P(CpuNorm, BackwardMatchesCentralFiniteDifferences) {
  const int64_t rows = 3, d = 16;
  const auto x = random_floats(static_cast<size_t>(rows * d), 4, 1.0f, 1.5f);
  const auto gamma = random_floats(static_cast<size_t>(d), 5, 1.0f, 0.3f), beta = random_floats(static_cast<size_t>(d), 6);
  const auto dy = random_floats(static_cast<size_t>(rows * d), 7);
  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d}), ty = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d});
  Tensor tg = make_tensor(ctx.get(), FP8_DTYPE_F32, {d}), tb = make_tensor(ctx.get(), FP8_DTYPE_F32, {d});
  Tensor tm = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows}), ts = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows});
  Tensor tdy = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d}), tdx = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d});
  Tensor tdg = make_tensor(ctx.get(), FP8_DTYPE_F32, {d}), tdb = make_tensor(ctx.get(), FP8_DTYPE_F32, {d});
  upload(tx.get(), x);
  upload(tg.get(), gamma);
  upload(tb.get(), beta);
  upload(tdy.get(), dy);
  fp8_tensor_t* mean = rms() ? nullptr : tm.get();
  fp8_tensor_t* beta_t = rms() ? nullptr : tb.get();
  FP8_ASSERT_OK(fp8_norm_forward(ctx.get(), GetParam(), tx.get(), tg.get(), beta_t, 1e-5f, ty.get(), nullptr, mean, ts.get()));
  FP8_ASSERT_OK(fp8_norm_backward(ctx.get(), GetParam(), tx.get(), tg.get(), mean, ts.get(), tdy.get(), tdx.get(), tdg.get(),
                                  rms() ? nullptr : tdb.get()));
  std::vector<double> xs(x.begin(), x.end()), gs(gamma.begin(), gamma.end()), bs(beta.begin(), beta.end());
  if (rms()) bs.clear();
  auto loss = [&] {
    const auto y = forward64(rms(), xs, gs, bs, rows, d, 1e-5);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
    return l;
  };
  auto check = [&](std::vector<double>& param, const std::vector<float>& grad, const char* name) {
    const double h = 1e-6;
    for (size_t j = 0; j < param.size(); ++j) {
      const double keep = param[j];
      param[j] = keep + h;
      const double up = loss();
      param[j] = keep - h;
      const double down = loss();
      param[j] = keep;
      const double want = (up - down) / (2 * h);
      ASSERT_NEAR(grad[j], want, std::fabs(want) * 1e-4 + 1e-4) << name << "[" << j << "]";
    }
  };
  check(xs, download<float>(tdx.get()), "dx");
  check(gs, download<float>(tdg.get()), "dgamma");
  if (!rms()) check(bs, download<float>(tdb.get()), "dbeta");
}

TEST_P(CpuNorm, Fp8OutputIsScaledEncodedAndFeedsItsState) {
  const int64_t rows = 4, d = 32;
  const auto x = random_floats(static_cast<size_t>(rows * d), 8);
  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_BF16, {rows, d}), wide = make_tensor(ctx.get(), FP8_DTYPE_F32, {rows, d});
  Tensor q = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {rows, d}), tg = make_tensor(ctx.get(), FP8_DTYPE_F32, {d});
  std::vector<uint16_t> raw(x.size());
  for (size_t i = 0; i < x.size(); ++i) raw[i] = fp8::float_to_bf16(x[i]);
  upload(tx.get(), raw);
  upload(tg.get(), std::vector<float>(static_cast<size_t>(d), 1.5f));
  Recipe recipe = make_recipe();
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  FP8_ASSERT_OK(fp8_scaling_set_scale(s.get(), 32.0f));
  FP8_ASSERT_OK(fp8_norm_forward(ctx.get(), GetParam(), tx.get(), tg.get(), nullptr, 1e-5f, wide.get(), nullptr, nullptr, nullptr));
  FP8_ASSERT_OK(fp8_norm_forward(ctx.get(), GetParam(), tx.get(), tg.get(), nullptr, 1e-5f, q.get(), s.get(), nullptr, nullptr));
  const auto y = download<float>(wide.get());
  const auto codes = download<uint8_t>(q.get());
  float amax = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    amax = std::max(amax, std::fabs(y[i]));
    ASSERT_EQ(codes[i], fp8_encode(y[i] * 32.0f, FP8_DTYPE_E4M3)) << i;
  }
  EXPECT_EQ(info_of(s.get()).amax, amax);
}

INSTANTIATE_TEST_SUITE_P(Kinds, CpuNorm, ::testing::Values(FP8_NORM_LAYERNORM, FP8_NORM_RMSNORM),
                         [](const auto& info) { return std::string(info.param == FP8_NORM_LAYERNORM ? "layernorm" : "rmsnorm"); });

TEST(CpuNormRefusals, BadArgumentsNameWhatIsWrong) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 8}), y = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 8});
  Tensor g = make_tensor(ctx.get(), FP8_DTYPE_F32, {8}), g7 = make_tensor(ctx.get(), FP8_DTYPE_F32, {7});
  Tensor g16 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {8}), m = make_tensor(ctx.get(), FP8_DTYPE_F32, {4});
  Tensor m3 = make_tensor(ctx.get(), FP8_DTYPE_F32, {3}), y8 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {4, 8});
  struct Case {
    fp8_status_t got, want;
    const char* words;
  } cases[] = {
      {fp8_norm_forward(ctx.get(), 5, x.get(), g.get(), nullptr, 1e-5f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "kind = 5"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g7.get(), nullptr, 1e-5f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_SHAPE, "gamma has 7 elements; expected 8"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g16.get(), nullptr, 1e-5f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_DTYPE, "gamma has dtype bf16"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g.get(), nullptr, 0.0f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "eps = 0"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_RMSNORM, x.get(), g.get(), g.get(), 1e-5f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "beta is given for RMSNorm"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g.get(), nullptr, 1e-5f, y.get(), nullptr, m3.get(), nullptr), FP8_ERR_SHAPE, "mean has 3 elements; expected 4"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g.get(), nullptr, 1e-5f, y8.get(), nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'y_scaling' is NULL"},
      {fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), nullptr, nullptr, 1e-5f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'gamma'"},
      {fp8_norm_backward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g.get(), nullptr, m.get(), x.get(), y.get(), g.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "'mean'"},
      {fp8_norm_backward(ctx.get(), FP8_NORM_RMSNORM, x.get(), g.get(), nullptr, m.get(), x.get(), y.get(), m.get(), nullptr), FP8_ERR_SHAPE, "dgamma has 4 elements; expected 8"},
      {fp8_norm_backward(ctx.get(), FP8_NORM_RMSNORM, x.get(), g.get(), nullptr, m.get(), x.get(), y8.get(), g7.get(), nullptr), FP8_ERR_DTYPE, "dx has dtype e4m3"},
  };
  for (const auto& c : cases) EXPECT_EQ(c.got, c.want) << c.words;
  // rstd written over x, and a backward wider than the scratch allows.
  void* x_data = nullptr;
  FP8_ASSERT_OK(fp8_tensor_data(x.get(), &x_data));
  const int64_t four = 4;
  fp8_tensor_t* alias = nullptr;
  FP8_ASSERT_OK(fp8_tensor_wrap(&alias, ctx.get(), FP8_DTYPE_F32, 1, &four, x_data));
  Tensor hold(alias);
  EXPECT_EQ(fp8_norm_forward(ctx.get(), FP8_NORM_RMSNORM, x.get(), g.get(), nullptr, 1e-5f, y.get(), nullptr, nullptr, alias),
            FP8_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp8_last_error_message()).find("rstd and x overlap"), std::string::npos) << fp8_last_error_message();
  const int64_t wide = (int64_t{1} << 20) + 16;
  Tensor xw = make_tensor(ctx.get(), FP8_DTYPE_BF16, {1, wide}), gw = make_tensor(ctx.get(), FP8_DTYPE_F32, {wide});
  Tensor sw = make_tensor(ctx.get(), FP8_DTYPE_F32, {1}), dgw = make_tensor(ctx.get(), FP8_DTYPE_F32, {wide});
  Tensor dxw = make_tensor(ctx.get(), FP8_DTYPE_BF16, {1, wide});
  EXPECT_EQ(fp8_norm_backward(ctx.get(), FP8_NORM_RMSNORM, xw.get(), gw.get(), nullptr, sw.get(), xw.get(), dxw.get(), dgw.get(), nullptr),
            FP8_ERR_SHAPE);
  EXPECT_NE(std::string(fp8_last_error_message()).find("at most 1048576"), std::string::npos) << fp8_last_error_message();
  EXPECT_EQ(fp8_norm_forward(ctx.get(), FP8_NORM_LAYERNORM, x.get(), g7.get(), nullptr, 1e-5f, y.get(), nullptr, nullptr, nullptr), FP8_ERR_SHAPE);
  EXPECT_NE(std::string(fp8_last_error_message()).find("fp8_norm_forward: gamma has 7 elements; expected 8"), std::string::npos)
      << fp8_last_error_message();
}

}  // namespace
