// Forward states owned by the caller on the GPU: two forwards of one layer in flight, differentiated
// in either order, give the same bits as the pairs run one after the other and as two twin layers
// (on the GPU), and agree with the CPU reference (bit for bit where no GEMM is involved, within
// accumulation-order rounding for the Linear); FP8_BACKWARD_ACCUMULATE_DX adds exactly.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "fp8_test_util.hpp"
#include "saved_cases.hpp"

using namespace fp8test;
namespace sc = fp8test::saved_cases;

namespace {

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double e = 0, r = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    e += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    r += double(want[i]) * want[i];
  }
  return std::sqrt(e / (r > 0 ? r : 1));
}

class GpuTwoInFlight : public ::testing::TestWithParam<sc::Kind> {};

TEST_P(GpuTwoInFlight, SameBitsAsPairsAndTwinsAndCloseToTheCpu) {
  const sc::Kind kind = GetParam();
  const sc::Outputs twins = sc::run(0, kind, sc::Mode::kTwins, false);
  // LayerNorm and GELU compute in float on the GPU and in double (norm statistics) or with another
  // tanhf on the CPU: a few ulps. The Linear's GEMMs sum in another order.
  // (FP8 operands are the same codes on both; the forward GEMM's fast accumulation rounds more.)
  const double tol = kind == sc::Kind::kLinearFp8 ? 2e-3 : 1e-5;
  for (bool second_first : {false, true}) {
    SCOPED_TRACE(second_first ? "backward of forward 2 first" : "backward of forward 1 first");
    const sc::Outputs flight = sc::run(0, kind, sc::Mode::kInFlight, second_first);
    const sc::Outputs pairs = sc::run(0, kind, sc::Mode::kPairs, second_first);
    const sc::Outputs cpu = sc::run(FP8_DEVICE_CPU, kind, sc::Mode::kInFlight, second_first);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(flight.y[i], pairs.y[i]) << "y " << i + 1;
      EXPECT_EQ(flight.dx[i], pairs.dx[i]) << "dx " << i + 1;
      EXPECT_EQ(flight.y[i], twins.y[i]) << "y " << i + 1 << " vs its twin";
      EXPECT_EQ(flight.dx[i], twins.dx[i]) << "dx " << i + 1 << " vs its twin";
      EXPECT_LT(rel_err(flight.y[i], cpu.y[i]), tol) << "y " << i + 1 << " vs the CPU";
      EXPECT_LT(rel_err(flight.dx[i], cpu.dx[i]), tol) << "dx " << i + 1 << " vs the CPU";
    }
    EXPECT_EQ(flight.grads, pairs.grads);
    ASSERT_EQ(flight.grads.size(), cpu.grads.size());
    for (size_t p = 0; p < cpu.grads.size(); ++p)
      EXPECT_LT(rel_err(flight.grads[p], cpu.grads[p]), std::max(tol, 1e-4)) << "grad " << p;
    if (!second_first)
      std::printf("[ %-9s ] in flight == pairs == twins bit for bit; vs CPU: y %.2e, dx %.2e\n", sc::kind_name(kind),
                  rel_err(flight.y[0], cpu.y[0]), rel_err(flight.dx[0], cpu.dx[0]));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, GpuTwoInFlight,
                         ::testing::Values(sc::Kind::kLinear, sc::Kind::kLinearFp8, sc::Kind::kLayerNorm,
                                           sc::Kind::kGelu),
                         [](const auto& info) { return std::string(sc::kind_name(info.param)); });

// dx += the gradient on the GPU: one float addition of the old dx for norms and activations.
TEST(GpuAccumulateDx, AddsTheInputGradientToDx) {
  for (sc::Kind kind : {sc::Kind::kLinearFp8, sc::Kind::kLayerNorm, sc::Kind::kGelu}) {
    SCOPED_TRACE(sc::kind_name(kind));
    const std::vector<float> old = randn(static_cast<size_t>(sc::kRows * sc::kIn), 5, 2.0f);
    // Each backward on a fresh model, so both see the same scales (an FP8 region updates them).
    auto backward = [&](uint32_t flags) { return sc::backward_into(0, kind, old, flags); };
    const std::vector<float> plain = backward(0), acc = backward(FP8_BACKWARD_ACCUMULATE_DX);
    for (size_t i = 0; i < acc.size(); ++i) {
      const float want = old[i] + plain[i];
      if (kind == sc::Kind::kLinearFp8)  // cuBLASLt adds the old dx inside the GEMM's epilogue
        ASSERT_NEAR(acc[i], want, 1e-5f * (std::fabs(old[i]) + std::fabs(plain[i]))) << i;
      else
        ASSERT_EQ(acc[i], want) << i;
    }
  }
}

// fp8_saved_needs_input on the GPU: it says what the CPU says, and where it says 0 an x overwritten
// with NaNs right after the forward leaves y, dx and every gradient bit-identical.
class GpuNeedsInput : public ::testing::TestWithParam<sc::InputUseCase> {};

TEST_P(GpuNeedsInput, SaysWhatTheCpuSaysAndAnOverwrittenXChangesNothingWhereItSaysZero) {
  const sc::InputUseCase& c = GetParam();
  int32_t needs = -1, after = -1;
  const sc::Outputs kept = sc::input_use(0, c.kind, c.recipe, false, &needs, &after);
  EXPECT_EQ(needs, c.reads_x ? 1 : 0);
  EXPECT_EQ(after, 0);
  EXPECT_GT(amax_of(kept.dx[0]), 0.0f);
  if (!c.reads_x) {
    const sc::Outputs overwritten = sc::input_use(0, c.kind, c.recipe, true, &needs, &after);
    EXPECT_EQ(overwritten.y[0], kept.y[0]);
    EXPECT_EQ(overwritten.dx[0], kept.dx[0]);
    EXPECT_EQ(overwritten.grads, kept.grads);
    std::printf("[ %-29s ] x not read by the backward: overwritten with NaN, same bits\n", c.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, GpuNeedsInput, ::testing::ValuesIn(sc::kInputUseCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
