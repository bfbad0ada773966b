// Forward states owned by the caller (fp8_layer_forward_saved / fp8_layer_backward_saved /
// fp8_saved_destroy), FP8_BACKWARD_ACCUMULATE_DX, and every refusal, on the CPU reference.
#include <cmath>
#include <cstdio>
#include <tuple>
#include <functional>

#include "fp8_test_util.hpp"
#include "saved_cases.hpp"

using namespace fp8test;
namespace sc = fp8test::saved_cases;

namespace {

// -------------------------------------------------------------------------------------------------
// Two forwards of one layer in flight
// -------------------------------------------------------------------------------------------------

class TwoInFlight : public ::testing::TestWithParam<sc::Kind> {};

TEST_P(TwoInFlight, EqualThePairsRunOneAfterTheOtherAndTwinLayersBitForBit) {
  const sc::Kind kind = GetParam();
  const sc::Outputs twins = sc::run(FP8_DEVICE_CPU, kind, sc::Mode::kTwins, false);
  for (bool second_first : {false, true}) {
    SCOPED_TRACE(second_first ? "backward of forward 2 first" : "backward of forward 1 first");
    const sc::Outputs flight = sc::run(FP8_DEVICE_CPU, kind, sc::Mode::kInFlight, second_first);
    const sc::Outputs pairs = sc::run(FP8_DEVICE_CPU, kind, sc::Mode::kPairs, second_first);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(flight.y[i], pairs.y[i]) << "y of forward " << i + 1;
      EXPECT_EQ(flight.dx[i], pairs.dx[i]) << "dx of forward " << i + 1;
      EXPECT_EQ(flight.y[i], twins.y[i]) << "y of forward " << i + 1 << " vs its twin layer";
      EXPECT_EQ(flight.dx[i], twins.dx[i]) << "dx of forward " << i + 1 << " vs its twin layer";
      EXPECT_GT(amax_of(flight.dx[i]), 0.0f) << "dx " << i + 1 << " was not written";
    }
    EXPECT_EQ(flight.grads, pairs.grads) << "parameter gradients (same order of accumulation)";
  }
  // The two forwards are different computations (else the test could not tell them apart).
  EXPECT_NE(twins.y[0], twins.y[1]);
}

INSTANTIATE_TEST_SUITE_P(Kinds, TwoInFlight,
                         ::testing::Values(sc::Kind::kLinear, sc::Kind::kLinearFp8, sc::Kind::kLayerNorm,
                                           sc::Kind::kGelu),
                         [](const auto& info) { return std::string(sc::kind_name(info.param)); });

// The FP8 Linear really ran in FP8 in those runs (the report shows the plan of the last forward).
TEST(TwoInFlight, Fp8LinearRanInFp8) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  const int32_t id = sc::add_layer(model.get(), sc::Kind::kLinearFp8, "a");
  Recipe r = make_recipe("small_layer_fallback=0, backend=te");
  FP8_ASSERT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
  FP8_ASSERT_OK(fp8_model_set_autowrap(model.get(), 1));
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  upload(x.get(), randn(static_cast<size_t>(sc::kRows * sc::kIn), 1, 1.0f));
  Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kOut});
  FP8_ASSERT_OK(forward_only(model.get(), id, x.get(), y.get()));
  fp8_layer_report_t rep;
  fp8_layer_report_init(&rep);
  FP8_ASSERT_OK(fp8_layer_get_report(model.get(), id, &rep));
  EXPECT_EQ(rep.fprop, 1);
  EXPECT_EQ(rep.dgrad, 1);
  EXPECT_EQ(rep.wgrad, 1);
}

// -------------------------------------------------------------------------------------------------
// fp8_saved_needs_input: where it says 0, the backward never reads x
// -------------------------------------------------------------------------------------------------

class NeedsInput : public ::testing::TestWithParam<sc::InputUseCase> {};

TEST_P(NeedsInput, SaysWhetherTheBackwardReadsXAndAnXOverwrittenAfterAForwardThatNeedsNoneChangesNothing) {
  const sc::InputUseCase& c = GetParam();
  int32_t needs = -1, after = -1;
  const sc::Outputs kept = sc::input_use(FP8_DEVICE_CPU, c.kind, c.recipe, false, &needs, &after);
  EXPECT_EQ(needs, c.reads_x ? 1 : 0);
  EXPECT_EQ(after, 0) << "a consumed state reads nothing";
  EXPECT_GT(amax_of(kept.dx[0]), 0.0f);
  if (!c.reads_x) {
    const sc::Outputs overwritten = sc::input_use(FP8_DEVICE_CPU, c.kind, c.recipe, true, &needs, &after);
    EXPECT_EQ(overwritten.y[0], kept.y[0]);
    EXPECT_EQ(overwritten.dx[0], kept.dx[0]) << "dx read the overwritten x";
    EXPECT_EQ(overwritten.grads, kept.grads) << "a parameter gradient read the overwritten x";
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, NeedsInput, ::testing::ValuesIn(sc::kInputUseCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The test above can fail: an overwritten x that the backward does read changes its gradients.
TEST(NeedsInput, OverwritingAnXTheBackwardReadsChangesTheWeightGradient) {
  int32_t needs = -1, after = -1;
  const sc::Outputs kept = sc::input_use(FP8_DEVICE_CPU, sc::Kind::kLinear, nullptr, false, &needs, &after);
  const sc::Outputs overwritten = sc::input_use(FP8_DEVICE_CPU, sc::Kind::kLinear, nullptr, true, &needs, &after);
  EXPECT_NE(overwritten.grads, kept.grads);
}

// -------------------------------------------------------------------------------------------------
// FP8_BACKWARD_ACCUMULATE_DX
// -------------------------------------------------------------------------------------------------

class AccumulateDx : public ::testing::TestWithParam<sc::Kind> {};

// dx += the gradient: the accumulated dx is the old one plus the overwritten one (one float rounding
// for norms and activations; the Linear's GEMM adds the old dx before its single rounding).
TEST_P(AccumulateDx, AddsTheInputGradientToDx) {
  const sc::Kind kind = GetParam();
  const std::vector<float> old = randn(static_cast<size_t>(sc::kRows * sc::kIn), 5, 2.0f);
  auto backward = [&](uint32_t flags) { return sc::backward_into(FP8_DEVICE_CPU, kind, old, flags); };
  const std::vector<float> plain = backward(0), acc = backward(FP8_BACKWARD_ACCUMULATE_DX);
  ASSERT_EQ(plain.size(), acc.size());
  for (size_t i = 0; i < acc.size(); ++i) {
    const float want = old[i] + plain[i];
    if (kind == sc::Kind::kLinear)
      ASSERT_NEAR(acc[i], want, 1e-6f * (std::fabs(old[i]) + std::fabs(plain[i]))) << i;
    else
      ASSERT_EQ(acc[i], want) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, AccumulateDx,
                         ::testing::Values(sc::Kind::kLinear, sc::Kind::kLayerNorm, sc::Kind::kGelu),
                         [](const auto& info) { return std::string(sc::kind_name(info.param)); });

// A residual block, y = x + fc2(GELU(fc1(LN(x)))), differentiated layer by layer with the residual's
// gradient taken in by ACCUMULATE_DX: against the block's gradient in float64 and against central
// differences of loss = sum(y * g).
TEST(AccumulateDx, ResidualBlockMatchesFloat64AndCentralDifferences) {
  constexpr int64_t R = 8, D = 32, H = 48;
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  fp8_model_t* m = model.get();
  int32_t ln = -1, fc1 = -1, act = -1, fc2 = -1;
  FP8_ASSERT_OK(fp8_model_add_layernorm(m, "ln", D, 1e-5f, &ln));
  FP8_ASSERT_OK(fp8_model_add_linear(m, "fc1", D, H, 1, &fc1));
  FP8_ASSERT_OK(fp8_model_add_activation(m, "act", FP8_ACTIVATION_GELU, &act));
  FP8_ASSERT_OK(fp8_model_add_linear(m, "fc2", H, D, 1, &fc2));
  const std::vector<float> gamma = randn(D, 1, 0.2f, 1.0f), beta = randn(D, 2, 0.2f);
  const std::vector<float> w1 = randn(H * D, 3, 0.2f), b1 = randn(H, 4, 0.3f);
  const std::vector<float> w2 = randn(D * H, 5, 0.15f), b2 = randn(D, 6, 0.3f);
  set_param(m, "ln.weight", gamma);
  set_param(m, "ln.bias", beta);
  set_param(m, "fc1.weight", w1);
  set_param(m, "fc1.bias", b1);
  set_param(m, "fc2.weight", w2);
  set_param(m, "fc2.bias", b2);
  std::vector<float> x = randn(R * D, 7, 1.0f, 0.3f);
  const std::vector<float> g = randn(R * D, 8, 1.0f);

  Tensor tx = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, D});
  upload(tx.get(), x);
  Tensor h1 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, D}), h2 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, H});
  Tensor h3 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, H}), h4 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, D});
  Tensor tg = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, D});
  upload(tg.get(), g);
  Tensor d3 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, H}), d2 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, H});
  Tensor d1 = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, D}), tdx = make_tensor(ctx.get(), FP8_DTYPE_F32, {R, D});

  // Forward with states, then the backward: dx starts as the residual's gradient g.
  Saved s[4];
  const int32_t ids[4] = {ln, fc1, act, fc2};
  const fp8_tensor_t* ins[4] = {tx.get(), h1.get(), h2.get(), h3.get()};
  fp8_tensor_t* outs[4] = {h1.get(), h2.get(), h3.get(), h4.get()};
  for (int i = 0; i < 4; ++i) {
    fp8_saved_t* p = nullptr;
    FP8_ASSERT_OK(fp8_layer_forward_saved(m, ids[i], ins[i], outs[i], &p));
    s[i].reset(p);
  }
  upload(tdx.get(), g);
  FP8_ASSERT_OK(fp8_layer_backward_saved(m, fc2, s[3].get(), tg.get(), d3.get(), 0));
  FP8_ASSERT_OK(fp8_layer_backward_saved(m, act, s[2].get(), d3.get(), d2.get(), 0));
  FP8_ASSERT_OK(fp8_layer_backward_saved(m, fc1, s[1].get(), d2.get(), d1.get(), 0));
  FP8_ASSERT_OK(fp8_layer_backward_saved(m, ln, s[0].get(), d1.get(), tdx.get(), FP8_BACKWARD_ACCUMULATE_DX));
  const std::vector<float> dx = download<float>(tdx.get());

  // The block and its gradient with respect to x in float64.
  auto gelu = [](double v) { return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); };
  auto gelu_grad = [](double v) {
    const double u = 0.7978845608028654 * (v + 0.044715 * v * v * v), t = std::tanh(u);
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * v * v);
  };
  std::vector<double> want(static_cast<size_t>(R * D));
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = &x[static_cast<size_t>(r * D)];
    double mean = 0, var = 0;
    for (int64_t c = 0; c < D; ++c) mean += xr[c];
    mean /= D;
    for (int64_t c = 0; c < D; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    const double rstd = 1.0 / std::sqrt(var / D + 1e-5);
    std::vector<double> xhat(D), a1(D), z(H), dz(H), da1(D, 0.0);
    for (int64_t c = 0; c < D; ++c) xhat[c] = (xr[c] - mean) * rstd, a1[c] = xhat[c] * gamma[c] + beta[c];
    for (int64_t j = 0; j < H; ++j) {
      z[j] = b1[j];
      for (int64_t c = 0; c < D; ++c) z[j] += static_cast<double>(w1[j * D + c]) * a1[c];
    }
    for (int64_t j = 0; j < H; ++j) {  // d loss / d gelu(z_j) = sum_o g_o w2[o][j]
      double up = 0;
      for (int64_t o = 0; o < D; ++o) up += static_cast<double>(g[r * D + o]) * w2[o * H + j];
      dz[j] = up * gelu_grad(z[j]);
    }
    for (int64_t c = 0; c < D; ++c)
      for (int64_t j = 0; j < H; ++j) da1[c] += dz[j] * w1[j * D + c];
    double mg = 0, mgx = 0;
    for (int64_t c = 0; c < D; ++c) mg += da1[c] * gamma[c], mgx += da1[c] * gamma[c] * xhat[c];
    mg /= D, mgx /= D;
    for (int64_t c = 0; c < D; ++c) want[r * D + c] = g[r * D + c] + rstd * (da1[c] * gamma[c] - mg - xhat[c] * mgx);
  }
  (void)gelu;
  double err = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) err += (dx[i] - want[i]) * (dx[i] - want[i]), ref += want[i] * want[i];
  EXPECT_LT(std::sqrt(err / ref), 1e-5) << "dx vs float64";

  // Central differences of the block's loss (eval mode: forwards alone).
  FP8_ASSERT_OK(fp8_model_set_training(m, 0));
  auto loss = [&]() {
    upload(tx.get(), x);
    for (int i = 0; i < 4; ++i) EXPECT_OK(fp8_layer_forward(m, ids[i], ins[i], outs[i]));
    const std::vector<float> out = download<float>(h4.get());
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += (static_cast<double>(out[i]) + x[i]) * g[i];
    return l;
  };
  for (size_t i = 0; i < x.size(); i += 37) {
    const float keep = x[i], eps = 1e-2f;
    x[i] = keep + eps;
    const double up = loss();
    x[i] = keep - eps;
    const double down = loss();
    x[i] = keep;
    const double fd = (up - down) / (2.0 * eps);
    EXPECT_NEAR(dx[i], fd, 2e-2 * std::max(1.0, std::fabs(fd))) << "x[" << i << "]";
  }
}

// -------------------------------------------------------------------------------------------------
// Refusals: each leaves the state, the gradients and dx as they were
// -------------------------------------------------------------------------------------------------

struct TwoLinearModel {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  int32_t a = sc::add_layer(model.get(), sc::Kind::kLinear, "a");
  int32_t b = sc::add_layer(model.get(), sc::Kind::kLinear, "b");
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kOut});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kOut});
  Tensor dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  TwoLinearModel() {
    upload(x.get(), randn(static_cast<size_t>(sc::kRows * sc::kIn), 21, 1.0f));
    upload(dy.get(), randn(static_cast<size_t>(sc::kRows * sc::kOut), 22, 1.0f));
    upload(dx.get(), std::vector<float>(static_cast<size_t>(sc::kRows * sc::kIn), 7.0f));
  }
  Saved forward(int32_t id) {
    fp8_saved_t* s = nullptr;
    EXPECT_OK(fp8_layer_forward_saved(model.get(), id, x.get(), y.get(), &s));
    return Saved(s);
  }
  std::vector<float> grad(const char* name) { return download<float>(param_tensor(model.get(), name, true)); }
};

#define EXPECT_UNCHANGED(t)                                                                \
  do {                                                                                     \
    EXPECT_EQ(download<float>(t.dx.get()), std::vector<float>(t.dx_size(), 7.0f)) << "dx"; \
    EXPECT_EQ(amax_of(t.grad("a.weight")), 0.0f) << "a's gradient";                        \
    EXPECT_EQ(amax_of(t.grad("b.weight")), 0.0f) << "b's gradient";                        \
  } while (0)

struct Refusals : ::testing::Test, TwoLinearModel {
  size_t dx_size() const { return static_cast<size_t>(sc::kRows * sc::kIn); }
  fp8_model_t* m() { return model.get(); }
};

TEST_F(Refusals, NullArgumentsAndUnknownFlags) {
  const char* fn = "fp8_layer_backward_saved";
  EXPECT_REFUSED(fp8_layer_forward_saved(m(), a, x.get(), y.get(), nullptr), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_layer_forward_saved", "'saved'");
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, nullptr, dy.get(), dx.get(), 0), FP8_ERR_INVALID_ARGUMENT, fn,
                 "'saved'");
  Saved s = forward(a);
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 4u), FP8_ERR_INVALID_ARGUMENT, fn,
                 "flags");
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), 5, s.get(), dy.get(), dx.get(), 0), FP8_ERR_INVALID_ARGUMENT, fn,
                 "layer_id");
  EXPECT_UNCHANGED((*this));
  FP8_ASSERT_OK(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 0));  // still usable
  fp8_saved_destroy(nullptr);
}

TEST_F(Refusals, AnotherLayersState) {
  Saved s = forward(a);
  EXPECT_REFUSED_WORDS(fp8_layer_backward_saved(m(), b, s.get(), dy.get(), dx.get(), 0), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_layer_backward_saved", "'a'", "'b'");
  EXPECT_UNCHANGED((*this));
}

TEST_F(Refusals, AnotherModelsState) {
  TwoLinearModel other;
  fp8_saved_t* p = nullptr;
  FP8_ASSERT_OK(fp8_layer_forward_saved(other.model.get(), other.a, other.x.get(), other.y.get(), &p));
  Saved s(p);
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 0), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_layer_backward_saved", "another model");
  EXPECT_UNCHANGED((*this));
}

TEST_F(Refusals, AConsumedState) {
  Saved s = forward(a);
  FP8_ASSERT_OK(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 0));
  const std::vector<float> dw = grad("a.weight"), dxv = download<float>(dx.get());
  EXPECT_GT(amax_of(dw), 0.0f);
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), FP8_BACKWARD_ACCUMULATE_DX),
                 FP8_ERR_INVALID_STATE, "fp8_layer_backward_saved", "already");
  EXPECT_EQ(grad("a.weight"), dw) << "a refused backward accumulated";
  EXPECT_EQ(download<float>(dx.get()), dxv);
}

TEST_F(Refusals, AnEvalModeState) {
  FP8_ASSERT_OK(fp8_model_set_training(m(), 0));
  Saved s = forward(a);
  FP8_ASSERT_OK(fp8_model_set_training(m(), 1));
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 0), FP8_ERR_INVALID_STATE,
                 "fp8_layer_backward_saved", "eval");
  EXPECT_UNCHANGED((*this));
}

TEST_F(Refusals, AStateFromBeforeAConversion) {
  Saved s = forward(a);
  Recipe r = make_recipe("backend=te");
  FP8_ASSERT_OK(fp8_convert_model(m(), r.get(), nullptr));
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 0), FP8_ERR_INVALID_STATE,
                 "fp8_layer_backward_saved", "converted");
  EXPECT_UNCHANGED((*this));
}

TEST_F(Refusals, WeightsChangedSinceTheForward) {
  Saved s = forward(a);
  set_param(m(), "a.weight", randn(static_cast<size_t>(sc::kIn * sc::kOut), 99, 0.1f));
  EXPECT_REFUSED(fp8_layer_backward_saved(m(), a, s.get(), dy.get(), dx.get(), 0), FP8_ERR_INVALID_STATE,
                 "fp8_layer_backward_saved", "changed");
  EXPECT_UNCHANGED((*this));
}

// The convenience pair keeps one forward per layer: a second training forward is refused and
// writes nothing; the first one's backward then runs.
TEST_F(Refusals, ASecondConvenienceForwardBeforeItsBackward) {
  FP8_ASSERT_OK(fp8_layer_forward(m(), a, x.get(), y.get()));
  const std::vector<float> y1 = download<float>(y.get());
  Tensor x2 = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  upload(x2.get(), randn(static_cast<size_t>(sc::kRows * sc::kIn), 23, 1.0f));
  EXPECT_REFUSED_WORDS(fp8_layer_forward(m(), a, x2.get(), y.get()), FP8_ERR_INVALID_STATE, "fp8_layer_forward",
                       "fp8_layer_backward", "fp8_model_set_training", "fp8_layer_forward_saved");
  EXPECT_EQ(download<float>(y.get()), y1) << "the refused forward wrote y";
  FP8_ASSERT_OK(fp8_layer_forward(m(), b, x2.get(), y.get()));  // another layer is free
  FP8_ASSERT_OK(fp8_layer_backward(m(), a, dy.get(), dx.get()));
  FP8_ASSERT_OK(fp8_layer_forward(m(), a, x2.get(), y.get()));  // allowed again after its backward
}

// A kept forward that will never get its backward (the caller's step failed in between) is dropped
// by a change of training mode, as the refusal says; the layer then takes a new forward, and a
// backward with none kept is refused.
TEST_F(Refusals, AChangeOfModeDropsTheKeptForward) {
  FP8_ASSERT_OK(fp8_layer_forward(m(), a, x.get(), y.get()));
  EXPECT_EQ(fp8_layer_forward(m(), a, x.get(), y.get()), FP8_ERR_INVALID_STATE);
  FP8_ASSERT_OK(fp8_model_set_training(m(), 0));
  FP8_ASSERT_OK(fp8_model_set_training(m(), 1));
  EXPECT_REFUSED(fp8_layer_backward(m(), a, dy.get(), dx.get()), FP8_ERR_INVALID_STATE, "fp8_layer_backward",
                 "no training-mode forward");
  FP8_ASSERT_OK(fp8_layer_forward(m(), a, x.get(), y.get()));
  FP8_ASSERT_OK(fp8_layer_backward(m(), a, dy.get(), dx.get()));
}

// A state outlives its model (its buffers keep what they need), and destroying it then is safe.
TEST(NeedsInput, EvalModeStatesNeedNothingAndNullArgumentsAreRefused) {
  TwoLinearModel t;
  FP8_ASSERT_OK(fp8_model_set_training(t.model.get(), 0));
  Saved s = t.forward(t.a);
  int32_t needs = -1;
  FP8_ASSERT_OK(fp8_saved_needs_input(s.get(), &needs));
  EXPECT_EQ(needs, 0);
  EXPECT_REFUSED(fp8_saved_needs_input(nullptr, &needs), FP8_ERR_INVALID_ARGUMENT, "fp8_saved_needs_input", "'saved'");
  EXPECT_REFUSED(fp8_saved_needs_input(s.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_saved_needs_input",
                 "'needs_input'");
}

TEST(SavedLifetime, AStateOutlivesItsModel) {
  Saved s;
  {
    TwoLinearModel t;
    s = t.forward(t.a);
  }
  EXPECT_NE(s.get(), nullptr);
  s.reset();
}

// The pool lends buffers again: a steady loop of forward/backward with states allocates nothing
// new, so the same device buffers come back (seen through the state a forward reuses).
TEST(SavedLifetime, ManyStatesInFlightThenAllDifferentiated) {
  TwoLinearModel t;
  std::vector<Saved> states;
  for (int i = 0; i < 8; ++i) states.push_back(t.forward(i % 2 ? t.b : t.a));
  for (int i = 7; i >= 0; --i)
    FP8_ASSERT_OK(fp8_layer_backward_saved(t.model.get(), i % 2 ? t.b : t.a, states[static_cast<size_t>(i)].get(),
                                           t.dy.get(), t.dx.get(), 0));
  // Eight equal forward/backward pairs: each weight gradient is 4x one pair's.
  TwoLinearModel one;
  Saved s = one.forward(one.a);
  FP8_ASSERT_OK(fp8_layer_backward_saved(one.model.get(), one.a, s.get(), one.dy.get(), one.dx.get(), 0));
  const std::vector<float> g1 = one.grad("a.weight"), g4 = t.grad("a.weight");
  for (size_t i = 0; i < g1.size(); i += 101) EXPECT_NEAR(g4[i], 4.0f * g1[i], 1e-5f * std::fabs(4.0f * g1[i]) + 1e-6f);
}

// -------------------------------------------------------------------------------------------------
// What can make a kept or caller-owned state stale
// -------------------------------------------------------------------------------------------------

// A whole-model backward whose weights changed since its forward is refused before any layer runs
// (no gradient moves); a layer added after the forward drops the run.
TEST(StaleStates, ModelBackwardChecksEveryLayerFirst) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  fp8_model_t* m = model.get();
  sc::add_layer(m, sc::Kind::kLinear, "fc");
  sc::add_layer(m, sc::Kind::kGelu, "act");
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  upload(x.get(), randn(static_cast<size_t>(sc::kRows * sc::kIn), 1, 1.0f));
  Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kOut});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kOut});
  upload(dy.get(), randn(static_cast<size_t>(sc::kRows * sc::kOut), 2, 1.0f));
  FP8_ASSERT_OK(fp8_model_forward(m, x.get(), y.get()));
  set_param(m, "fc.bias", randn(static_cast<size_t>(sc::kOut), 3, 0.1f));
  EXPECT_REFUSED(fp8_model_backward(m, dy.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_model_backward", "changed");
  EXPECT_EQ(amax_of(download<float>(param_tensor(m, "fc.weight", true))), 0.0f) << "a layer ran before the refusal";
  FP8_ASSERT_OK(fp8_model_forward(m, x.get(), y.get()));
  FP8_ASSERT_OK(fp8_model_add_linear(m, "late", sc::kOut, 16, 0, nullptr));
  EXPECT_REFUSED(fp8_model_backward(m, dy.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_model_backward",
                 "fp8_model_forward");
}

// The convenience pair: a kept forward whose weights changed cannot be differentiated, and a new
// forward replaces it instead of being refused.
TEST(StaleStates, AStaleKeptForwardIsReplacedByTheNextOne) {
  TwoLinearModel t;
  fp8_model_t* m = t.model.get();
  FP8_ASSERT_OK(fp8_layer_forward(m, t.a, t.x.get(), t.y.get()));
  set_param(m, "a.weight", randn(static_cast<size_t>(sc::kIn * sc::kOut), 4, 0.1f));
  EXPECT_REFUSED(fp8_layer_backward(m, t.a, t.dy.get(), t.dx.get()), FP8_ERR_INVALID_STATE, "fp8_layer_backward",
                 "changed");
  FP8_ASSERT_OK(fp8_layer_forward(m, t.a, t.x.get(), t.y.get()));
  FP8_ASSERT_OK(fp8_layer_backward(m, t.a, t.dy.get(), t.dx.get()));
}

// A norm's state is refused once its gamma changed (its backward would use the new one).
TEST(StaleStates, ANormStateAfterItsParametersChanged) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  const int32_t id = sc::add_layer(model.get(), sc::Kind::kLayerNorm, "ln");
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  upload(x.get(), randn(static_cast<size_t>(sc::kRows * sc::kIn), 5, 1.0f));
  Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  Tensor dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {sc::kRows, sc::kIn});
  fp8_saved_t* p = nullptr;
  FP8_ASSERT_OK(fp8_layer_forward_saved(model.get(), id, x.get(), y.get(), &p));
  Saved s(p);
  set_param(model.get(), "ln.weight", randn(static_cast<size_t>(sc::kIn), 6, 0.1f, 1.0f));
  EXPECT_REFUSED(fp8_layer_backward_saved(model.get(), id, s.get(), y.get(), dx.get(), 0), FP8_ERR_INVALID_STATE,
                 "fp8_layer_backward_saved", "changed");
}

// Two forwards in flight in different activation dtypes (high precision): each backward uses the
// weight in its own dtype, as a twin layer run alone gives.
TEST(StaleStates, HighPrecisionWeightCopyFollowsEachForwardsDtype) {
  auto bf16 = [](const std::vector<float>& f) {
    std::vector<uint16_t> h(f.size());
    for (size_t k = 0; k < f.size(); ++k) h[k] = static_cast<uint16_t>(bits_of(f[k]) >> 16);
    return h;
  };
  const std::vector<float> xv = randn(static_cast<size_t>(sc::kRows * sc::kIn), 7, 1.0f);
  const std::vector<float> dyv = randn(static_cast<size_t>(sc::kRows * sc::kOut), 8, 1.0f);
  // dx of a bf16 forward/backward, with (or without) an f32 forward of the same layer in between.
  auto bf16_dx = [&](bool f32_in_between) {
    TwoLinearModel t;
    fp8_model_t* m = t.model.get();
    Tensor xb = make_tensor(t.ctx.get(), FP8_DTYPE_BF16, {sc::kRows, sc::kIn});
    upload(xb.get(), bf16(xv));
    Tensor yb = make_tensor(t.ctx.get(), FP8_DTYPE_BF16, {sc::kRows, sc::kOut});
    Tensor dyb = make_tensor(t.ctx.get(), FP8_DTYPE_BF16, {sc::kRows, sc::kOut});
    upload(dyb.get(), bf16(dyv));
    Tensor dxb = make_tensor(t.ctx.get(), FP8_DTYPE_BF16, {sc::kRows, sc::kIn});
    Saved a = [&] {
      fp8_saved_t* p = nullptr;
      EXPECT_OK(fp8_layer_forward_saved(m, t.a, xb.get(), yb.get(), &p));
      return Saved(p);
    }();
    Saved f32 = f32_in_between ? t.forward(t.a) : Saved();
    EXPECT_OK(fp8_layer_backward_saved(m, t.a, a.get(), dyb.get(), dxb.get(), 0));
    return download<uint16_t>(dxb.get());
  };
  EXPECT_EQ(bf16_dx(true), bf16_dx(false));
}

// SGD on O2 storage runs O1 (FP32 momentum): its checkpoint saves and loads that layout.
TEST(StaleStates, SgdOnO2StorageCheckpointsItsMomentum) {
  auto make = [](Context& ctx, Model& model, Optimizer& opt) {
    ctx = make_context(FP8_DEVICE_CPU);
    model = make_model(ctx.get());
    sc::add_layer(model.get(), sc::Kind::kLinearFp8, "a");
    Recipe r = make_recipe("backend=auto, opt_level=O2");
    EXPECT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
    opt = make_optimizer(model.get(), FP8_OPTIMIZER_SGD);
    EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_MOMENTUM, 0.9));
  };
  Context c1, c2;
  Model m1, m2;
  Optimizer o1, o2;
  make(c1, m1, o1);
  make(c2, m2, o2);
  EXPECT_EQ(stats_of(o1.get()).opt_level, 1);
  EXPECT_GT(stats_of(o1.get()).state_bytes, 0) << "setting momentum makes the buffer (a captured step cannot)";
  for (int step = 0; step < 2; ++step) {
    Tensor g = make_tensor(c1.get(), FP8_DTYPE_F32, {sc::kIn * sc::kOut});
    upload(g.get(), randn(static_cast<size_t>(sc::kIn * sc::kOut), 30 + step, 0.01f));
    FP8_ASSERT_OK(fp8_optimizer_zero_grad(o1.get()));
    FP8_ASSERT_OK(fp8_model_accumulate_grad(m1.get(), 0, g.get()));
    FP8_ASSERT_OK(fp8_optimizer_step(o1.get()));
  }
  const std::string path = ::testing::TempDir() + "/sgd_o2.fp8ckpt";
  FP8_ASSERT_OK(fp8_checkpoint_save(m1.get(), o1.get(), path.c_str(), 0));
  FP8_ASSERT_OK(fp8_checkpoint_load(m2.get(), o2.get(), path.c_str()));
  for (auto [m, o, ctx] : {std::tuple{m1.get(), o1.get(), c1.get()}, std::tuple{m2.get(), o2.get(), c2.get()}}) {
    Tensor g = make_tensor(ctx, FP8_DTYPE_F32, {sc::kIn * sc::kOut});
    upload(g.get(), randn(static_cast<size_t>(sc::kIn * sc::kOut), 40, 0.01f));
    FP8_ASSERT_OK(fp8_optimizer_zero_grad(o));
    FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 0, g.get()));
    FP8_ASSERT_OK(fp8_optimizer_step(o));
  }
  EXPECT_EQ(tensor_bytes(param_tensor(m1.get(), "a.weight")), tensor_bytes(param_tensor(m2.get(), "a.weight")))
      << "the step after loading differs: the momentum did not travel";
  std::remove(path.c_str());
}

}  // namespace
