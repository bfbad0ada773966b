// Quantize, quantize + transpose, dequantize and amax on the CPU reference backend: the plumbing
// around the numerics (scales, layouts, amax accumulation, scale_inv hand-over) on real data.
#include <cmath>
#include <random>

#include "core/format.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6);
  return v;
}

class CpuCasts : public ::testing::Test {
 protected:
  Context ctx = make_context(FP8_DEVICE_CPU);
  Recipe recipe = make_recipe();
};

TEST_F(CpuCasts, QuantizeAppliesTheStateScaleAndWritesTheTransposedCopy) {
  const std::vector<int64_t> shape = {2, 3, 5};  // a 6 x 5 matrix
  const auto x = random_values(30, 1);
  Tensor in = make_tensor(ctx.get(), FP8_DTYPE_F32, shape);
  Tensor out = make_tensor(ctx.get(), FP8_DTYPE_E4M3, shape);
  Tensor out_t = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {5, 6});
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  upload(in.get(), x);
  FP8_ASSERT_OK(fp8_scaling_set_scale(s.get(), 12.5f));
  FP8_ASSERT_OK(fp8_quantize(ctx.get(), in.get(), out.get(), out_t.get(), s.get()));
  const auto q = download<uint8_t>(out.get());
  const auto qt = download<uint8_t>(out_t.get());
  float amax = 0.0f;
  for (int r = 0; r < 6; ++r) {
    for (int c = 0; c < 5; ++c) {
      const float v = x[static_cast<size_t>(r * 5 + c)];
      amax = std::max(amax, std::fabs(v));
      EXPECT_EQ(q[static_cast<size_t>(r * 5 + c)], fp8_encode(v * 12.5f, FP8_DTYPE_E4M3)) << r << "," << c;
      EXPECT_EQ(qt[static_cast<size_t>(c * 6 + r)], q[static_cast<size_t>(r * 5 + c)]) << r << "," << c;
    }
  }
  EXPECT_EQ(info_of(s.get()).amax, amax);
  float scale_inv = 0.0f;
  FP8_ASSERT_OK(fp8_tensor_get_scale_inv(out.get(), &scale_inv));
  EXPECT_EQ(scale_inv, 1.0f / 12.5f);
  FP8_ASSERT_OK(fp8_tensor_get_scale_inv(out_t.get(), &scale_inv));
  EXPECT_EQ(scale_inv, 1.0f / 12.5f);
}

TEST_F(CpuCasts, QuantizeWidensBf16AndF16Exactly) {
  const auto x = random_values(64, 2);
  for (fp8_dtype_t dt : {FP8_DTYPE_BF16, FP8_DTYPE_F16}) {
    std::vector<uint16_t> raw(x.size());
    for (size_t i = 0; i < x.size(); ++i) raw[i] = dt == FP8_DTYPE_BF16 ? fp8::float_to_bf16(x[i]) : fp8::float_to_f16(x[i]);
    Tensor in = make_tensor(ctx.get(), dt, {8, 8});
    Tensor out = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {8, 8});
    Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_BACKWARD);
    upload(in.get(), raw);
    FP8_ASSERT_OK(fp8_quantize(ctx.get(), in.get(), out.get(), nullptr, s.get()));
    const auto q = download<uint8_t>(out.get());
    for (size_t i = 0; i < x.size(); ++i) {
      const float wide = dt == FP8_DTYPE_BF16 ? fp8::bf16_to_float(raw[i]) : fp8::f16_to_float(raw[i]);
      EXPECT_EQ(q[i], fp8_encode(wide, FP8_DTYPE_E5M2)) << fp8_dtype_name(dt) << " element " << i;
    }
  }
}

TEST_F(CpuCasts, QuantizeThenDequantizeIsWithinHalfAnUlpOfTheFormat) {
  const auto x = random_values(4096, 3);
  Tensor in = make_tensor(ctx.get(), FP8_DTYPE_F32, {64, 64});
  Tensor q = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {64, 64});
  Tensor back = make_tensor(ctx.get(), FP8_DTYPE_F32, {64, 64});
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  upload(in.get(), x);
  // First pass measures the amax, the update sets the scale, the second pass uses it.
  FP8_ASSERT_OK(fp8_quantize(ctx.get(), in.get(), q.get(), nullptr, s.get()));
  fp8_scaling_t* list[1] = {s.get()};
  FP8_ASSERT_OK(fp8_scaling_update(ctx.get(), list, 1, recipe.get()));
  FP8_ASSERT_OK(fp8_quantize(ctx.get(), in.get(), q.get(), nullptr, s.get()));
  FP8_ASSERT_OK(fp8_dequantize(ctx.get(), q.get(), back.get()));
  const auto y = download<float>(back.get());
  const float scale = info_of(s.get()).scale;
  for (size_t i = 0; i < x.size(); ++i) {
    // E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normals; absolute 2^-10/scale below.
    const float tol = std::max(std::fabs(x[i]) * 0.0625f, std::ldexp(1.0f, -10) / scale);
    EXPECT_LE(std::fabs(y[i] - x[i]), tol) << "element " << i << " x=" << x[i];
  }
}

TEST_F(CpuCasts, DequantizeRoundsToEachWideDtype) {
  Tensor q = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {256});
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
  upload(q.get(), codes);
  FP8_ASSERT_OK(fp8_tensor_set_scale_inv(q.get(), 0.3f));
  for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16}) {
    Tensor out = make_tensor(ctx.get(), dt, {256});
    FP8_ASSERT_OK(fp8_dequantize(ctx.get(), q.get(), out.get()));
    if (dt == FP8_DTYPE_F32) {
      const auto y = download<float>(out.get());
      for (int i = 0; i < 256; ++i) {
        const float want = fp8_decode(static_cast<uint8_t>(i), FP8_DTYPE_E4M3) * 0.3f;
        if (std::isnan(want)) EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i)]));
        else EXPECT_EQ(y[static_cast<size_t>(i)], want) << i;
      }
    } else {
      const auto y = download<uint16_t>(out.get());
      for (int i = 0; i < 256; ++i) {
        const float want = fp8_decode(static_cast<uint8_t>(i), FP8_DTYPE_E4M3) * 0.3f;
        const uint16_t w = dt == FP8_DTYPE_F16 ? fp8::float_to_f16(want) : fp8::float_to_bf16(want);
        EXPECT_EQ(y[static_cast<size_t>(i)], w) << fp8_dtype_name(dt) << " code " << i;
      }
    }
  }
}

TEST_F(CpuCasts, AmaxPropagatesNanAndInfAndIsZeroWhenEmpty) {
  Tensor a = make_tensor(ctx.get(), FP8_DTYPE_F32, {1});
  auto amax_of = [&](std::vector<float> v) {
    Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {static_cast<int64_t>(v.size())});
    if (!v.empty()) upload(x.get(), v);
    EXPECT_EQ(fp8_amax(ctx.get(), x.get(), a.get(), nullptr), FP8_OK) << fp8_last_error_message();
    return download<float>(a.get())[0];
  };
  EXPECT_EQ(amax_of({1.0f, -3.0f, 2.0f}), 3.0f);
  EXPECT_TRUE(std::isinf(amax_of({1.0f, -INFINITY, 2.0f})));
  EXPECT_TRUE(std::isnan(amax_of({1.0f, INFINITY, NAN, -5.0f})));
  EXPECT_TRUE(std::isnan(amax_of({NAN, INFINITY})));
  EXPECT_EQ(amax_of({}), 0.0f);
}

TEST_F(CpuCasts, WrappedHostMemoryIsReadAndWrittenInPlace) {
  std::vector<float> x = random_values(12, 4);
  std::vector<uint8_t> q(12, 0xCD);
  const int64_t shape[2] = {3, 4};
  fp8_tensor_t *in = nullptr, *out = nullptr;
  FP8_ASSERT_OK(fp8_tensor_wrap(&in, ctx.get(), FP8_DTYPE_F32, 2, shape, x.data()));
  FP8_ASSERT_OK(fp8_tensor_wrap(&out, ctx.get(), FP8_DTYPE_E4M3, 2, shape, q.data()));
  Tensor hold_in(in), hold_out(out);
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  FP8_ASSERT_OK(fp8_quantize(ctx.get(), in, out, nullptr, s.get()));
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(q[i], fp8_encode(x[i], FP8_DTYPE_E4M3)) << i;
  void* data = nullptr;
  FP8_ASSERT_OK(fp8_tensor_data(out, &data));
  EXPECT_EQ(data, q.data());
}

TEST_F(CpuCasts, EmptyTensorsAreValidAndQuantizeToNothing) {
  Tensor in = make_tensor(ctx.get(), FP8_DTYPE_BF16, {0, 16});
  Tensor out = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {0, 16});
  Tensor out_t = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {16, 0});
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  FP8_ASSERT_OK(fp8_quantize(ctx.get(), in.get(), out.get(), out_t.get(), s.get()));
  EXPECT_EQ(info_of(s.get()).amax, 0.0f);
  // An empty last dimension: the matrix view is 5 rows of 0 columns, transposed [0, 5].
  Tensor in_cols0 = make_tensor(ctx.get(), FP8_DTYPE_F32, {5, 0});
  Tensor out_cols0 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {5, 0});
  Tensor t_cols0 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {0, 5});
  FP8_ASSERT_OK(fp8_quantize(ctx.get(), in_cols0.get(), out_cols0.get(), t_cols0.get(), s.get()));
}

}  // namespace
