// The GEMM on the CPU reference backend against a float64 computation written here on the same
// dequantised operands, and every refusal of fp8_gemm.
#include <cmath>
#include <random>

#include "core/format.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

struct Operand {
  Tensor t;
  std::vector<double> values;  // dequantised, row-major
};

// A random FP8 (or bf16) matrix and its exact values; FP8 codes avoid NaN.
Operand random_operand(fp8_context_t* ctx, fp8_dtype_t dt, int64_t rows, int64_t cols, float scale_inv, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Operand op{make_tensor(ctx, dt, {rows, cols}), std::vector<double>(static_cast<size_t>(rows * cols))};
  if (dt == FP8_DTYPE_BF16) {
    std::vector<uint16_t> raw(op.values.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      raw[i] = fp8::float_to_bf16(normal(rng));
      op.values[i] = fp8::bf16_to_float(raw[i]);
    }
    upload(op.t.get(), raw);
  } else {
    std::vector<uint8_t> codes(op.values.size());
    for (size_t i = 0; i < codes.size(); ++i) {
      codes[i] = fp8_encode(normal(rng) * 16.0f, dt);
      op.values[i] = static_cast<double>(fp8_decode(codes[i], dt)) * scale_inv;
    }
    upload(op.t.get(), codes);
    EXPECT_EQ(fp8_tensor_set_scale_inv(op.t.get(), scale_inv), FP8_OK);
  }
  return op;
}

std::vector<double> reference(const Operand& a, const Operand& b, int64_t m, int64_t n, int64_t k, double alpha) {
  std::vector<double> d(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double acc = 0;
      for (int64_t i = 0; i < k; ++i) acc += a.values[static_cast<size_t>(r * k + i)] * b.values[static_cast<size_t>(c * k + i)];
      d[static_cast<size_t>(r * n + c)] = alpha * acc;
    }
  return d;
}

class CpuGemm : public ::testing::Test {
 protected:
  Context ctx = make_context(FP8_DEVICE_CPU);
};

TEST_F(CpuGemm, Fp8ProductMatchesFloat64OnTheDequantisedOperandsForEveryInputPair) {
  const int64_t m = 24, n = 32, k = 48;
  for (auto [adt, bdt] : {std::pair{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3}, {FP8_DTYPE_E5M2, FP8_DTYPE_E4M3}, {FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}}) {
    Operand a = random_operand(ctx.get(), adt, m, k, 0.125f, 1), b = random_operand(ctx.get(), bdt, n, k, 0.5f, 2);
    Tensor d = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, n});
    FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.t.get(), b.t.get(), nullptr, d.get(), nullptr, nullptr));
    const auto got = download<float>(d.get());
    const auto want = reference(a, b, m, n, k, 1.0);
    // The reference backend sums in float64 and rounds once: within half an ulp of float.
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(got[i], want[i], std::fabs(want[i]) * 6e-8 + 1e-30) << fp8_dtype_name(adt) << " x " << fp8_dtype_name(bdt) << " i=" << i;
  }
}

TEST_F(CpuGemm, AlphaBiasAndAccumulateCompose) {
  const int64_t m = 4, n = 16, k = 16;
  Operand a = random_operand(ctx.get(), FP8_DTYPE_E4M3, m, k, 0.25f, 3), b = random_operand(ctx.get(), FP8_DTYPE_E4M3, n, k, 0.25f, 4);
  Tensor bias = make_tensor(ctx.get(), FP8_DTYPE_BF16, {n});
  std::vector<uint16_t> bias_raw(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) bias_raw[static_cast<size_t>(c)] = fp8::float_to_bf16(0.5f * static_cast<float>(c) - 3.0f);
  upload(bias.get(), bias_raw);
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, n});
  std::vector<float> start(static_cast<size_t>(m * n));
  for (size_t i = 0; i < start.size(); ++i) start[i] = static_cast<float>(i % 7) - 2.0f;
  upload(d.get(), start);
  fp8_gemm_options_t opts;
  fp8_gemm_options_init(&opts);
  EXPECT_EQ(opts.alpha, 1.0f);
  EXPECT_EQ(opts.accumulate, 0);
  opts.alpha = -2.0f;
  opts.accumulate = 1;
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.t.get(), b.t.get(), bias.get(), d.get(), nullptr, &opts));
  const auto got = download<float>(d.get());
  const auto prod = reference(a, b, m, n, k, -2.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const size_t i = static_cast<size_t>(r * n + c);
      const double want = prod[i] + fp8::bf16_to_float(bias_raw[static_cast<size_t>(c)]) + start[i];
      ASSERT_NEAR(got[i], want, std::fabs(want) * 1e-6 + 1e-6) << r << "," << c;
    }
}

TEST_F(CpuGemm, Fp8OutputIsScaledEncodedAndFeedsTheAmaxOfItsState) {
  const int64_t m = 16, n = 16, k = 32;
  Operand a = random_operand(ctx.get(), FP8_DTYPE_E4M3, m, k, 0.0625f, 5), b = random_operand(ctx.get(), FP8_DTYPE_E4M3, n, k, 0.0625f, 6);
  Recipe recipe = make_recipe();
  Scaling s = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
  FP8_ASSERT_OK(fp8_scaling_set_scale(s.get(), 8.0f));
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {m, n});
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.t.get(), b.t.get(), nullptr, d.get(), s.get(), nullptr));
  const auto codes = download<uint8_t>(d.get());
  const auto want = reference(a, b, m, n, k, 1.0);
  double amax = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    amax = std::max(amax, std::fabs(want[i]));
    ASSERT_EQ(codes[i], fp8_encode(static_cast<float>(want[i]) * 8.0f, FP8_DTYPE_E4M3)) << i;
  }
  EXPECT_FLOAT_EQ(info_of(s.get()).amax, static_cast<float>(amax));
  float si = 0;
  FP8_ASSERT_OK(fp8_tensor_get_scale_inv(d.get(), &si));
  EXPECT_EQ(si, 1.0f / 8.0f);
}

TEST_F(CpuGemm, Bf16GemmMatchesFloat64WithBf16OutputRounding) {
  const int64_t m = 7, n = 9, k = 13;  // the high-precision path takes any shape
  Operand a = random_operand(ctx.get(), FP8_DTYPE_BF16, m, k, 1, 7), b = random_operand(ctx.get(), FP8_DTYPE_BF16, n, k, 1, 8);
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_BF16, {m, n});
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.t.get(), b.t.get(), nullptr, d.get(), nullptr, nullptr));
  const auto got = download<uint16_t>(d.get());
  const auto want = reference(a, b, m, n, k, 1.0);
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(fp8::bf16_to_float(got[i]), want[i], std::fabs(want[i]) * (1.0 / 256) + 1e-6) << i;
}

TEST_F(CpuGemm, EmptyProblemWritesNothingAndSucceeds) {
  Tensor a = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {0, 16}), b = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {16, 16});
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_F32, {0, 16});
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d.get(), nullptr, nullptr));
}

// ---- refusals: status, a message naming the argument, and D untouched -----------------------

class GemmRefusals : public CpuGemm {
 protected:
  Tensor a = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {8, 32});
  Tensor b = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {16, 32});
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_BF16, {8, 16});
  void SetUp() override {
    upload(a.get(), std::vector<uint8_t>(8 * 32, 0x38));
    upload(b.get(), std::vector<uint8_t>(16 * 32, 0x38));
    upload(d.get(), std::vector<uint16_t>(8 * 16, 0x1234));
  }
  void expect_refused(fp8_status_t got, fp8_status_t want, const char* words, fp8_tensor_t* out) {
    EXPECT_EQ(got, want) << fp8_last_error_message();
    EXPECT_NE(std::string(fp8_last_error_message()).find(words), std::string::npos) << fp8_last_error_message();
    EXPECT_NE(std::string(fp8_last_error_message()).find("fp8_gemm"), std::string::npos);
    if (out == d.get()) EXPECT_EQ(download<uint16_t>(d.get()), std::vector<uint16_t>(8 * 16, 0x1234));
  }
};

TEST_F(GemmRefusals, NullArguments) {
  expect_refused(fp8_gemm(nullptr, a.get(), b.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'ctx'", d.get());
  expect_refused(fp8_gemm(ctx.get(), nullptr, b.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'a'", d.get());
  expect_refused(fp8_gemm(ctx.get(), a.get(), nullptr, nullptr, d.get(), nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'b'", d.get());
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'d'", nullptr);
}

TEST_F(GemmRefusals, KOrNNotAMultipleOf16NamesTheDimension) {
  Tensor a40 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {8, 40}), b40 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {16, 40});
  expect_refused(fp8_gemm(ctx.get(), a40.get(), b40.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_SHAPE, "k (the last dimension", d.get());
  Tensor b12 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {12, 32});
  Tensor d12 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {8, 12});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b12.get(), nullptr, d12.get(), nullptr, nullptr), FP8_ERR_SHAPE, "n (the rows of b)", nullptr);
}

TEST_F(GemmRefusals, EmptyInnerDimension) {
  Tensor a0 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {8, 0}), b0 = make_tensor(ctx.get(), FP8_DTYPE_BF16, {16, 0});
  expect_refused(fp8_gemm(ctx.get(), a0.get(), b0.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_SHAPE, "k = 0", d.get());
}

TEST_F(GemmRefusals, E5M2OutputNeedsAnE5M2Operand) {
  Recipe recipe = make_recipe();
  Scaling bwd = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_BACKWARD);
  Tensor d5 = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {8, 16});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d5.get(), bwd.get(), nullptr), FP8_ERR_DTYPE,
                 "e5m2 only when an operand is e5m2", nullptr);
  Tensor a5 = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {8, 32});
  upload(a5.get(), std::vector<uint8_t>(8 * 32, 0x3C));
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a5.get(), b.get(), nullptr, d5.get(), bwd.get(), nullptr));
}

TEST_F(CpuGemm, OneDimensionalAIsOneRow) {
  Tensor a = make_tensor(ctx.get(), FP8_DTYPE_BF16, {16}), b = make_tensor(ctx.get(), FP8_DTYPE_BF16, {4, 16});
  upload(a.get(), std::vector<uint16_t>(16, fp8::float_to_bf16(0.5f)));
  upload(b.get(), std::vector<uint16_t>(64, fp8::float_to_bf16(2.0f)));
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_F32, {1, 4});
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d.get(), nullptr, nullptr));
  EXPECT_EQ(download<float>(d.get()), std::vector<float>(4, 16.0f));
}

TEST_F(GemmRefusals, MismatchedShapes) {
  Tensor b_k = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {16, 48});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b_k.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_SHAPE, "b has shape [16, 48], expected [n, 32]", d.get());
  Tensor d_bad = make_tensor(ctx.get(), FP8_DTYPE_BF16, {16, 8});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d_bad.get(), nullptr, nullptr), FP8_ERR_SHAPE, "d has shape [16, 8], expected [8, 16]", nullptr);
  Tensor bias = make_tensor(ctx.get(), FP8_DTYPE_BF16, {8});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), bias.get(), d.get(), nullptr, nullptr), FP8_ERR_SHAPE, "bias has shape [8], expected [16]", d.get());
}

TEST_F(GemmRefusals, DtypeCombinations) {
  Tensor a5 = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {8, 32}), b5 = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {16, 32});
  expect_refused(fp8_gemm(ctx.get(), a5.get(), b5.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_DTYPE, "both e5m2", d.get());
  Tensor abf = make_tensor(ctx.get(), FP8_DTYPE_BF16, {8, 32});
  expect_refused(fp8_gemm(ctx.get(), abf.get(), b.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_DTYPE, "expected both FP8", d.get());
  Tensor d16 = make_tensor(ctx.get(), FP8_DTYPE_F16, {8, 16});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d16.get(), nullptr, nullptr), FP8_ERR_DTYPE, "d has dtype f16", nullptr);
  Tensor bias32 = make_tensor(ctx.get(), FP8_DTYPE_F32, {16});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), bias32.get(), d.get(), nullptr, nullptr), FP8_ERR_DTYPE, "bias has dtype f32; expected bf16", d.get());
}

TEST_F(GemmRefusals, Fp8OutputNeedsAMatchingStateAndNoAccumulation) {
  Recipe recipe = make_recipe();
  Scaling fwd = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD), bwd = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_BACKWARD);
  Tensor d8 = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {8, 16});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d8.get(), nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "'d_scaling' is NULL", nullptr);
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d8.get(), bwd.get(), nullptr), FP8_ERR_DTYPE, "d_scaling quantizes to e5m2", nullptr);
  fp8_gemm_options_t opts;
  fp8_gemm_options_init(&opts);
  opts.accumulate = 1;
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d8.get(), fwd.get(), &opts), FP8_ERR_INVALID_ARGUMENT, "accumulate", nullptr);
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d.get(), fwd.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "d_scaling is given", d.get());
  opts.struct_size = 4;
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d.get(), nullptr, &opts), FP8_ERR_INVALID_ARGUMENT, "options->struct_size", d.get());
}

TEST_F(GemmRefusals, TensorsFromAnotherContextAndOverlappingOutput) {
  Context other = make_context(FP8_DEVICE_CPU);
  Tensor b_other = make_tensor(other.get(), FP8_DTYPE_E4M3, {16, 32});
  expect_refused(fp8_gemm(ctx.get(), a.get(), b_other.get(), nullptr, d.get(), nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "b belongs to another context", d.get());
  // d wrapping a's own bytes
  void* a_data = nullptr;
  FP8_ASSERT_OK(fp8_tensor_data(a.get(), &a_data));
  const int64_t shape[2] = {8, 16};
  fp8_tensor_t* alias = nullptr;
  FP8_ASSERT_OK(fp8_tensor_wrap(&alias, ctx.get(), FP8_DTYPE_BF16, 2, shape, a_data));
  Tensor hold(alias);
  expect_refused(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, alias, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "overlap", nullptr);
}

}  // namespace
